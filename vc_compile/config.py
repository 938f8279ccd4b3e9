"""``VCConfig``: the validated, frozen form of ``torch.compile(..., backend="vcattn", options={...})``.

Every option has one home here: its type, default, accepted values and what it does (docs/usage.md's
options table is generated from ``OPTION_DOCS``). An unknown key or a bad value raises
``VCConfigError`` naming the key and what is accepted, at compile time.

Two tables: ``OPTION_DOCS``, what users tune; ``EXPERIMENTAL_DOCS``, the ablation and debug knobs, given
together as ONE option, ``experimental={...}`` (``Experimental``): MC-Sparse's ablation ladder, naive 8-bit
V, the first k-means step's iterations, which implementation runs the ops and what compiles the graph. They
are validated as strictly as the others, but are for experiments and tests, not for tuning a model. A
knob given at the top level that lives in ``experimental`` is refused with an error that says so.
"""
from __future__ import annotations

import os
import sys

import dataclasses
import enum
import functools
import json
import math
import operator
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple


class VCConfigError(ValueError):
    """A bad ``options`` entry for ``backend="vcattn"``."""


class Method(str, enum.Enum):
    AUTO = "auto"  # V-Smooth: the full-fidelity 8-bit path (sparse attention is opt-in)
    VSMOOTH = "vsmooth"
    MCSPARSE = "mcsparse"
    DENSE = "dense"


class QKFormat(str, enum.Enum):
    INT8 = "int8"
    FP8 = "fp8"


class Kernels(str, enum.Enum):
    AUTO = "auto"  # Triton kernels on CUDA when they are available, the reference elsewhere
    TRITON = "triton"  # always the Triton kernels (on CPU only under TRITON_INTERPRET=1: tests)
    REFERENCE = "reference"  # always the plain-PyTorch reference


class Compiler(str, enum.Enum):
    INDUCTOR = "inductor"  # hand the rewritten graph to Inductor (compile_fx)
    EAGER = "eager"  # run the rewritten graph as is (debugging, fast tests)


class Selection(str, enum.Enum):
    EXACT = "exact"  # exact attention mass (pass 1 LSE + pass 2 probabilities summed over the group)
    MEAN_POOL = "mean_pool"  # score of the group's mean query against each key / mean-pooled key block


class SelectionUnit(str, enum.Enum):
    TOKEN = "token"  # top-K single keys
    BLOCK = "block"  # top key blocks of the KV tile (64 keys), expanded to their token indices


class QueryGrouping(str, enum.Enum):
    PDDP = "pddp"  # Fast PDDP groups of C similar queries
    NONE = "none"  # contiguous tiles of C queries in token order (identity permutation)


class WarmupAttention(str, enum.Enum):
    """What MC-Sparse's warm-up steps run (every phase fast)."""
    VSMOOTH = "vsmooth"  # the 8-bit V-Smooth path (grouping V as method="vsmooth" does)
    EXPCAST = "expcast"  # the same with ExpCast's softmax, whatever ``expcast`` says: the fastest dense 8-bit path
    SDPA = "sdpa"  # stock scaled_dot_product_attention (the paper's dense warm-up)


class CudaGraphs(str, enum.Enum):
    """Where a reuse step's kernel launches are replayed as a CUDA graph (kernels/graphs.py)."""
    AUTO = "auto"  # where the launches, not the kernels, bound the call (small shapes)
    ON = "on"  # every replayable call on a CUDA device
    OFF = "off"  # never: the recorded launch sequence (kernels/programs.py), launched from Python


class SpeedGate(str, enum.Enum):
    """Whether a call our kernels are measured slower on than stock SDPA stays stock (tune/gate.py)."""
    AUTO = "auto"  # by the shipped measurements of this GPU (none: no gate)
    OFF = "off"  # always our path


class Prebuild(str, enum.Enum):
    """Whether a fresh process builds its compiled calls' kernels ahead of their first launch, in helper processes
    running while Inductor compiles (prebuild/helpers.py). Built kernels stay in Triton's on-disk cache for every
    later process; ``python -m vc_compile warmup`` builds the usual layouts' ahead of any process."""
    OFF = "off"  # each kernel is built at its first launch, in the calling process
    AUTO = "auto"  # helpers build the kernels of the calls that run our kernels on a CUDA device (the default)
    ON = "on"  # also helpers on the CPU reference path (tests)


class SelectionRefresh(str, enum.Enum):
    ANCHOR = "anchor"  # select at anchor steps, reuse the selection in between
    EVERY_STEP = "every_step"  # re-select from the current q, k at every sparse step (mean_pool only)


class SparseQK(str, enum.Enum):
    BF16 = "bf16"  # the gather kernel's QK in the inputs' 16-bit type
    FP8 = "fp8"  # Q and K in E4M3 (FP8 MMAs: sm_89+)
    INT8 = "int8"  # K as int8 codes with one scale a head, Q quantised per row in the sm_90 gather kernel


class Residual(str, enum.Enum):
    BF16 = "bf16"
    INT8 = "int8"  # one scale per token (amax / 127): half the memory
    FP8 = "fp8"  # E4M3, one scale per token: half the memory (2.7x INT8's error on a residual's rows)
    NONE = "none"  # no residual


class AnchorDense(str, enum.Enum):
    BF16 = "bf16"  # cuDNN SDPA gives O_dense (and its LSE)
    Q8 = "q8"  # the 8-bit V-Smooth pass gives O_dense (cheaper; its error enters the residual)


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
GROUP_SIZES = (64, 128)  # MC-Sparse query groups = the gather kernel's query tiles (configs.SPARSE_DEFAULT)

OPTION_DOCS: Dict[str, str] = {
    "method": "'auto' | 'vsmooth' | 'mcsparse' | 'dense'. auto = vsmooth (8-bit; its error in numbers: docs/usage.md, Methods).",
    "expcast": "V-Smooth: write the softmax as E4M3 codes directly (ExpCast-FP8; the default): ~8% faster end to end "
               "than exp2 and a cast (False), 1.1-1.3x its rel. L2 (docs/design/default-method.md).",
    "hadamard": "Rotate Q and K by an orthonormal Hadamard matrix before quantising them.",
    "qk_format": "'int8' | 'fp8': 8-bit format of Q and K (fp8 is a little faster, less accurate).",
    "kmeans_clusters": "V-Smooth clusters per head; 0 = one per 128 tokens, at most 256.",
    "kmeans_iters": "Lloyd iterations per grouping step (warm-started from the previous step).",
    "group_fraction": "V-Smooth (and MC-Sparse's 8-bit warm-up): fraction of the steps, from the start, that "
                      "re-group V; the first step always does.",
    "group_interval": "V-Smooth (and MC-Sparse's 8-bit warm-up): re-group V at every N-th step (0, N, 2N, ...); "
                      "0 = never. Default 25 (steps 0 and 25 of 50): 2% above every 10th step on the demo model "
                      "and 0.5% faster end to end (docs/design/vsmooth-grouping-schedule.md).",
    "share_grouping": "V-Smooth: a grouping step clusters V once per block and step, in the first CFG branch; the "
                      "other branches reuse its grouping (False: one k-means per branch).",
    "density": "MC-Sparse: fraction of keys each query group keeps (0 < density <= 1).",
    "group_size": "MC-Sparse: queries per group (the sparse kernel's query tile): 64 or 128 (128: 17% faster "
                  "sparse steps, 0.3-0.4 dB lower PSNR on the demo; docs/design/sparse-group-size.md).",
    "warmup_steps": "Warm-up steps at the start (dense SDPA; MC-Sparse: see warmup_attention). None = 0 for vsmooth, 20% of the steps for mcsparse.",
    "anchor_steps": "MC-Sparse: steps that re-select (tuple of ints). None = (20%, 52%) of the steps.",
    "anchor_interval": "MC-Sparse: re-select every N steps after the warm-up (instead of anchor_steps).",
    "sparse_qk": ("MC-Sparse: QK precision of the gather kernel: 'bf16' | 'fp8' | 'int8' (sm_90: 1.09-1.13x the "
                  "bf16 kernel, ~2x its error; docs/design/sparse-qk8-scale.md)."),
    "warmup_attention": "MC-Sparse warm-up steps: 'expcast' (8-bit V-Smooth with ExpCast's softmax, the fastest "
                        "dense 8-bit path; default), 'vsmooth' (8-bit V-Smooth, as the option expcast says) or "
                        "'sdpa' (stock SDPA, the paper's).",
    "residual": "MC-Sparse residual storage: 'int8' (one scale a token; default) | 'fp8' (E4M3, one scale a token) "
                "| 'bf16' (twice the memory) | 'none'.",
    "key_run": "MC-Sparse: keys are selected in aligned runs of this many (the top runs by summed attention mass), "
               "kept as one 16-bit number a run: None (default) = key by key where every block's metadata fits the "
               "GPU, else the shortest run of 2, 4, 8 with which it does (the memory plan; a report note says so); "
               "or a power of two from 1 (key by key) to 64. A sequence not a whole number of runs selects key by "
               "key.",
    "anchor_dense": "MC-Sparse anchor steps: the dense pass giving O_dense and R: 'bf16' (cuDNN, today's "
                    "accuracy) | 'q8' (the 8-bit V-Smooth pass: faster, R carries its error; "
                    "docs/design/anchor-selection.md).",
    "residual_budget_gb": "MC-Sparse: the metadata budget. A generation's first anchor plans: the blocks whose "
                          "metadata fits this and the GPU's free memory run sparse, the others the dense 8-bit path "
                          "(one warning, counted in report()); an anchor still over it keeps none and its block "
                          "runs stock SDPA until its next anchor, one the GPU has no room for the dense 8-bit path.",
    "guard_threshold": "MC-Sparse: re-anchor a layer when its reuse error, measured on sampled rows, exceeds "
                       "this (relative L2; 0 = guard off). docs/mcsparse_guard.md.",
    "reuse_check": "MC-Sparse: measure the first reuse step after each anchor on sampled rows; a site where it is "
                   "further from exact attention than the previous step's output (and > 5%) runs stock SDPA until "
                   "its next anchor, with a warning. docs/design/reuse-check.md.",
    "propagate_nonfinite": "MC-Sparse reuse steps: NaN/Inf in keys/values no query group selected turn the output "
                           "NaN as in SDPA (one pass over K/V; +19% of a reuse step measured at S = 32760).",
    "cuda_graphs": "'off' | 'auto' | 'on': replay a reuse step's kernel launches as one CUDA graph per call site "
                   "(q, k, v copied into staging buffers where they move; each graph keeps ~2.5x q of intermediates). "
                   "'off': the recorded launch sequence instead (H200: 0.06-0.21 ms of host time per call, as fast "
                   "or faster than a graph at every measured size, no memory kept); 'auto': graphs where B H S^2 D "
                   "<= 1.1e11 (e.g. 12 heads x 8K tokens).",
    "speed_gate": "'auto' | 'off': 'auto' leaves a call to stock SDPA where this GPU's shipped measurements "
                  "(benchmarks/results/bench_op_overhead.csv) put our reuse step below stock SDPA's speed at its "
                  "size (e.g. V-Smooth at 12 heads x 8K tokens on the H200), reported; 'off' always runs ours.",
    "max_logit_std": "8-bit paths (V-Smooth, MC-Sparse's V-Smooth warm-up): a site whose sampled attention logits "
                     "have a std above this (checked once per site, block and shape) stays stock SDPA, reported: "
                     "their INT8 QK error grows with it (docs/design/sharpness-check.md). 0 = no check (force 8-bit); "
                     "with expcast, logits of base-2 magnitude beyond ~2000 then give NaN rows (outside its codes' range).",
    "quant_check": "8-bit paths: before a site's first 8-bit call (once per site, block and shape) its quantisation "
                   "error is read on a sample (reference/quant_check.py); a site with an outlier K channel runs with the "
                   "Hadamard rotation, one whose outlier keys or values the 8-bit codes cannot hold stays stock "
                   "SDPA, reported and warned once. False = no check.",
    "prebuild": "'auto' | 'on' | 'off': whether a fresh process builds its kernels ahead of their first launch. "
                "'auto' (default): helper processes build the kernels of the compiled calls in parallel while "
                "Inductor compiles (a phase's first call waits for them; each helper holds its call's inputs on "
                "the GPU meanwhile); 'on' also on the CPU reference path; 'off' builds every kernel at its first "
                "launch. Built kernels stay in Triton's on-disk cache: only a machine's first process (or "
                "one after an upgrade) builds, and `python -m vc_compile warmup` builds the usual layouts ahead "
                "(docs/performance.md, Cold start).",
    "num_steps": "Steps per generation when nothing tells us (no vc_compile.sampling, no diffusers loop).",
    "rope_fusion": "Fold the model's recognised RoPE + permute into the 8-bit preprocessing kernel (vsmooth). "
                   "Opt-in: on the H200 it saves 0.3-0.6 ms of preprocessing but only 0.2% of the op.",
    "min_seq_len": "Attention with fewer query or key tokens than this stays stock SDPA.",
    "head_dims": "Head dims that are rewritten (the kernels support 64 and 128).",
    "profile": "Time every attention call (CUDA events) into vc_compile.report().",
    "warn_fallbacks": "Warn once per compiled graph whose attention stays (partly) stock SDPA, with the fix.",
    "tune_cache_dir": "Directory of the kernel autotuning cache. None = $VCATTN_CACHE_DIR, else "
                      "~/.cache/vc_compile/tune ($XDG_CACHE_HOME).",
    "mode": "Inductor mode, as torch.compile's mode= (which torch refuses together with options=).",
    "experimental": "Ablation and debug knobs, as one dict (table EXPERIMENTAL_DOCS), e.g. "
                    "{'kernels': 'reference', 'compiler': 'eager'}. Not for tuning a model.",
}

EXPERIMENTAL_DOCS: Dict[str, str] = {
    "smooth_v": "V-Smooth: cluster V rows and subtract 128-row block means (False = naive 8-bit PV).",
    "kmeans_init_iters": "Lloyd iterations for the first grouping step of a generation (no warm start).",
    "kmeans_sample": "V-Smooth's k-means iterates on every N-th row of V (at least 32 rows a cluster), then "
                     "assigns every row once; 1 = every row in every iteration.",
    "selection": "MC-Sparse ablation: 'exact' (two-pass attention mass) | 'mean_pool' (mean query x keys).",
    "selection_unit": "MC-Sparse ablation: 'token' (top-K keys) | 'block' (top 64-key blocks, block-sparse).",
    "query_grouping": "MC-Sparse ablation: 'pddp' (Fast PDDP groups) | 'none' (contiguous query tiles).",
    "selection_refresh": "MC-Sparse ablation: 'anchor' (select at anchors, reuse) | 'every_step' (mean_pool).",
    "kernels": "'auto' | 'triton' | 'reference': which implementation runs the ops.",
    "compiler": "'inductor' | 'eager': what compiles the rewritten graph.",
}


def _did_you_mean(unknown, names) -> str:
    """ ``" (did you mean 'density'?)"`` for the unknown names close to an accepted one, else ""."""
    import difflib

    hints = [f"{u!r} -> {m[0]!r}" for u in unknown
             for m in [difflib.get_close_matches(str(u), sorted(names), n=1, cutoff=0.6)] if m]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _tuple_of_ints(v) -> Tuple[int, ...]:
    # exact ints only: int(1.5) == 1, int("3") == 3 and int(True) == 1 would silently change a schedule
    # (operator.index accepts ints and numpy integers, refuses floats and strings)
    if any(isinstance(x, bool) for x in v):
        raise TypeError("bools are not step indices / head dims")
    return tuple(operator.index(x) for x in v)


@dataclass(frozen=True)
class Experimental:
    """The ``experimental={...}`` option: ablation and debug knobs (``EXPERIMENTAL_DOCS``)."""
    smooth_v: bool = True
    kmeans_init_iters: int = 8
    # NOTE a quarter of the rows carry the iterations at +0.2% attention error; docs/design/kmeans-sample.md
    kmeans_sample: int = 4
    selection: Selection = Selection.EXACT
    selection_unit: SelectionUnit = SelectionUnit.TOKEN
    query_grouping: QueryGrouping = QueryGrouping.PDDP
    selection_refresh: SelectionRefresh = SelectionRefresh.ANCHOR
    kernels: Kernels = Kernels.AUTO
    compiler: Compiler = Compiler.INDUCTOR

    @classmethod
    def from_options(cls, options: Any) -> "Experimental":
        if isinstance(options, Experimental):
            return options
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise VCConfigError(f"vcattn option experimental={options!r} is invalid; accepted: a dict of "
                                f"{sorted(EXPERIMENTAL_DOCS)} -> value, e.g. {{'kernels': 'reference'}}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise VCConfigError(f"unknown vcattn experimental option(s) {unknown}{_did_you_mean(unknown, names)}; "
                                f"accepted: {sorted(names)}")
        kw = {f.name: _coerce(f.name, options[f.name], f.default, f"experimental['{f.name}']", cls)
              for f in dataclasses.fields(cls) if f.name in options}
        return cls(**kw)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), f.default,
                                                     f"experimental['{f.name}']", Experimental))
        if self.kmeans_init_iters < 1:
            raise VCConfigError(f"vcattn option experimental['kmeans_init_iters']={self.kmeans_init_iters!r} is "
                                "invalid; accepted: an int >= 1")
        if not 1 <= self.kmeans_sample <= 64:
            raise VCConfigError(f"vcattn option experimental['kmeans_sample']={self.kmeans_sample!r} is "
                                "invalid; accepted: an int from 1 (every row) to 64")

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: (v.value if isinstance(v, enum.Enum) else v)
                for f in dataclasses.fields(self) for v in (getattr(self, f.name),)}


@dataclass(frozen=True)
class VCConfig:
    method: Method = Method.AUTO
    # NOTE ExpCast by default: the only dense 8-bit path that keeps pace with torchao's FP8 attention end to end
    # (docs/design/default-method.md)
    expcast: bool = True
    hadamard: bool = False
    qk_format: QKFormat = QKFormat.INT8
    kmeans_clusters: int = 0
    # NOTE 3 kept: one iteration helps the exp2 paths but costs V-Smooth + ExpCast (the default) its fidelity, for
    # 1.5-2% of a generation; docs/design/kmeans-iterations.md
    kmeans_iters: int = 3
    # NOTE every 25th step, none packed at the start: spread-out grouping steps come closest to re-grouping every
    # step; 25 instead of 10 keeps the default ahead of torchao's FP8 attention for +2% attention error;
    # docs/design/vsmooth-grouping-schedule.md
    group_fraction: float = 0.0
    group_interval: int = 25
    # NOTE one grouping for the CFG branches of a step: the branches share x_t, so their V orders alike;
    # docs/design/vsmooth-grouping-schedule.md
    share_grouping: bool = True
    density: float = 0.15
    # NOTE 128 by default: the larger query tile makes reuse steps faster for a small loss of fidelity from the
    # coarser groups; 64 stays an option. docs/design/sparse-group-size.md
    group_size: int = 128
    warmup_steps: Optional[int] = None
    # NOTE ExpCast by default: the fastest dense 8-bit path, and its extra error over V-Smooth's is far below the
    # sparse steps' own; docs/design/mcsparse-schedule.md
    warmup_attention: WarmupAttention = WarmupAttention.EXPCAST
    anchor_steps: Optional[Tuple[int, ...]] = None
    anchor_interval: Optional[int] = None
    sparse_qk: SparseQK = SparseQK.BF16
    # NOTE INT8 codes by default: half a bf16 residual's memory; with key_run=8 every block of Wan 14B at 720p fits
    # one 80 GB GPU. INT8, not FP8: a third of E4M3's rounding error on a residual's rows.
    # docs/design/mcsparse-metadata-format.md
    residual: Residual = Residual.INT8
    # NOTE key by key unless the metadata would not fit: runs of 8 (a sixteenth of the selection's bytes) fit Wan 14B
    # at 720p on an 80 GB GPU but cost 4 dB of the CPU demo's clip. docs/design/mcsparse-metadata-format.md
    key_run: Optional[int] = None
    anchor_dense: AnchorDense = AnchorDense.BF16
    residual_budget_gb: float = 64.0
    # NOTE off by default (opt in): the guard beats fixed schedules on bursts of motion, but on steady fast drift it
    # turns into a fixed every-4-steps schedule and could nearly double MC-Sparse's attention cost; whether a
    # threshold becomes the default waits for the demo model's PSNR at equal cost. docs/mcsparse_guard.md
    guard_threshold: float = 0.0
    # NOTE on by default: it measures one reuse step per anchor (a pass over K and V on sampled rows), and a
    # site whose first reuse step is worse than the previous step's output runs stock SDPA until its next anchor
    # (methods/mcsparse_guard.py, docs/design/reuse-check.md).
    reuse_check: bool = True
    # NOTE off by default: the flags pass costs far more of a reuse step than its 2% target; without it a NaN/Inf in
    # a key or value no group selected does not reach the output (kept off until it is cheap).
    # docs/design/finite-flags.md
    propagate_nonfinite: bool = False
    # NOTE the 8-bit error grows with the logit spread; 32 keeps the predicted error under twice the one at unit
    # logits, and a model with QK-norm sits far below it. docs/design/sharpness-check.md
    max_logit_std: float = 32.0
    quant_check: bool = True
    # NOTE 'off' by default since reuse steps replay recorded launch sequences (kernels/programs.py): about as fast
    # as a graph, and a graph pins ~2.5x q of intermediates per call site and CFG branch.
    # docs/design/reuse-replay.md
    cuda_graphs: CudaGraphs = CudaGraphs.OFF
    speed_gate: SpeedGate = SpeedGate.AUTO
    # NOTE 'auto': helpers build a fresh process's kernels in parallel while Inductor compiles, instead of one at
    # each first launch; built kernels stay in Triton's on-disk cache, so later processes build nothing.
    # docs/design/cold-start.md
    prebuild: Prebuild = Prebuild.AUTO
    num_steps: int = 50
    # NOTE off by default (opt in): the fused prologue saves a fraction of the preprocessing, not of the op, and
    # moves ExpCast's clip; no speed to show for a graph rewrite and a fidelity change. On by default once the op
    # gains >= 5%. docs/design/rope-fusion.md
    rope_fusion: bool = False
    min_seq_len: int = 1024
    head_dims: Tuple[int, ...] = (64, 128)
    profile: bool = False
    warn_fallbacks: bool = True
    tune_cache_dir: Optional[str] = None
    mode: Optional[str] = None
    experimental: Experimental = field(default_factory=Experimental)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None) -> "VCConfig":
        if options is not None and not isinstance(options, Mapping):
            raise VCConfigError(f"vcattn options must be a dict of option -> value, got {type(options).__name__} "
                                f"{options!r}; e.g. options={{'method': 'vsmooth'}}")
        opts = dict(options or {})
        if mode is not None and opts.get("mode") not in (None, mode):
            raise VCConfigError(f"mode={mode!r} and options['mode']={opts['mode']!r} disagree")
        if mode is not None:
            opts["mode"] = mode
        names = {f.name for f in dataclasses.fields(cls)}
        moved = sorted(set(opts) & set(EXPERIMENTAL_DOCS))
        if moved:
            raise VCConfigError(
                f"vcattn option(s) {moved} are experimental knobs: give them as experimental="
                f"{{{', '.join(repr(m) + ': ...' for m in moved)}}} (accepted there: {sorted(EXPERIMENTAL_DOCS)})")
        unknown = sorted(set(opts) - names)
        if unknown:
            raise VCConfigError(f"unknown vcattn option(s) {unknown}{_did_you_mean(unknown, names)}; accepted "
                                f"options: {sorted(names)}")
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name == "experimental" and f.name in opts:
                kw[f.name] = Experimental.from_options(opts[f.name])
            elif f.name in opts:
                kw[f.name] = _coerce(f.name, opts[f.name], f.default, cls=cls)
        return cls(**kw)

    def __post_init__(self):
        # types and enums coerced and checked here too, so that VCConfig(method="bogus") fails when built
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), f.default, cls=VCConfig))

        def bad(key, accepted):
            raise VCConfigError(f"vcattn option {key}={getattr(self, key)!r} is invalid; accepted: {accepted}")

        if not isinstance(self.experimental, Experimental):  # VCConfig(experimental={...}) in code
            object.__setattr__(self, "experimental", Experimental.from_options(self.experimental))
        ex = self.experimental

        if not 0.0 < self.density <= 1.0:
            bad("density", "a float in (0, 1]")
        if not 0.0 <= self.group_fraction <= 1.0:
            bad("group_fraction", "a float in [0, 1]")
        if not 0 <= self.group_interval <= 100000:
            bad("group_interval", "an int >= 0 (0: no re-grouping after the group_fraction window)")
        if self.group_size not in GROUP_SIZES:
            bad("group_size", " or ".join(map(str, GROUP_SIZES)))
        if self.kmeans_clusters < 0:
            bad("kmeans_clusters", "an int >= 0 (0 = automatic)")
        if not 1 <= self.kmeans_iters <= 100:
            bad("kmeans_iters", "an int >= 1, at most 100 (each iteration is a pass over V per grouping step)")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            bad("warmup_steps", "None or an int >= 0")
        if self.anchor_steps is not None and any(s < 0 for s in self.anchor_steps):
            bad("anchor_steps", "None or a tuple of step indices >= 0")
        if self.anchor_interval is not None and self.anchor_interval < 1:
            bad("anchor_interval", "None or an int >= 1")
        if self.anchor_steps is not None and self.anchor_interval is not None:
            raise VCConfigError("give anchor_steps or anchor_interval, not both")
        if ex.selection_refresh == SelectionRefresh.EVERY_STEP and ex.selection != Selection.MEAN_POOL:
            raise VCConfigError(
                f"vcattn option experimental['selection_refresh']='every_step' needs experimental['selection']="
                f"'mean_pool' (exact selection needs a dense pass: every step would cost more than dense), got "
                f"selection={ex.selection.value!r}; accepted: selection_refresh='anchor', or selection='mean_pool'")
        if ex.selection_refresh == SelectionRefresh.EVERY_STEP and self.residual != Residual.NONE:
            raise VCConfigError(
                f"vcattn option experimental['selection_refresh']='every_step' needs residual='none' (a residual "
                f"cached with the anchor's selection does not belong to a selection made at another step), got "
                f"residual={self.residual.value!r}; accepted: residual='none', or selection_refresh='anchor'")
        if self.key_run is not None and not (1 <= self.key_run <= 64 and self.key_run & (self.key_run - 1) == 0):
            bad("key_run", "None (by the memory plan) or a power of two from 1 (key by key) to 64")
        if not self.residual_budget_gb > 0:  # also refuses NaN (every comparison with NaN is False)
            bad("residual_budget_gb", "a positive float (float('inf') = no limit)")
        if not 0.0 <= self.guard_threshold < math.inf:  # also refuses NaN
            bad("guard_threshold", "a float >= 0 (0 = the MC-Sparse guard is off)")
        if not 0.0 <= self.max_logit_std < math.inf:  # also refuses NaN
            bad("max_logit_std", "a float >= 0 (0 = no sharpness check: always the 8-bit path)")
        if self.num_steps < 1:
            bad("num_steps", "an int >= 1")
        if self.min_seq_len < 1:
            bad("min_seq_len", "an int >= 1")
        if not self.head_dims or any(d < 1 for d in self.head_dims):
            bad("head_dims", "a non-empty tuple of positive ints")
        if self.mode is not None and self.mode not in MODES:
            bad("mode", list(MODES))
        if self.hadamard and any(d & (d - 1) for d in self.head_dims):
            # caught here, not as a ValueError inside the op at the first call with such a head dim
            raise VCConfigError(
                f"vcattn option hadamard=True needs power-of-two head dims, but head_dims={self.head_dims}; "
                "accepted: hadamard=False, or head_dims of powers of two (e.g. (64, 128))")

    # ---- derived --------------------------------------------------------------------------------
    @property
    def resolved_method(self) -> Method:
        return Method.VSMOOTH if self.method == Method.AUTO else self.method

    def to_json(self) -> str:
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Experimental):
                v = v.to_dict()
            d[f.name] = v.value if isinstance(v, enum.Enum) else (list(v) if isinstance(v, tuple) else v)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "VCConfig":
        return cls.from_options(json.loads(s))


def merge_options(*options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``options`` dicts merged left to right, later keys winning, with their ``experimental`` dicts merged the
    same way (not replaced): e.g. a method's options plus ``{"experimental": {"compiler": "eager"}}``."""
    out: Dict[str, Any] = {}
    for opts in options:
        for key, val in (opts or {}).items():
            if key == "experimental" and isinstance(val, Mapping) and isinstance(out.get(key), Mapping):
                val = {**out[key], **val}
            out[key] = val
    return out


@functools.lru_cache(maxsize=None)
def _field_types(cls) -> Dict[str, Any]:
    """The resolved annotations of a config dataclass's fields: what ``_coerce`` converts each option to."""
    return typing.get_type_hints(cls)


def _plain_scalar(value: Any) -> Any:
    """A numpy scalar (``np.float32(0.2)``, ``np.int64(3)``, ``np.bool_``) or a one-element 0-d tensor
    (``torch.tensor(3)``) as the Python value it holds; anything else unchanged. The option then goes
    through the same checks as a Python value (``np.float32(2.0)`` is still no int)."""
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value


def _coerce(key: str, value: Any, default: Any, label: Optional[str] = None, cls: Optional[type] = None) -> Any:
    """``value`` as option ``key`` of ``cls`` (VCConfig, or Experimental for ``experimental['...']``) wants it,
    driven by the field's annotation: an Enum (by value), bool, int, float, ``Optional[...]`` of those,
    ``Tuple[int, ...]``; ``mode`` and ``tune_cache_dir`` check their own. A field without a rule is an error
    (never passed through unchecked)."""
    def fail(accepted):
        raise VCConfigError(f"vcattn option {label or key}={value!r} is invalid; accepted: {accepted}")

    value = _plain_scalar(value)
    if cls is None:
        cls = Experimental if label is not None and label.startswith("experimental[") else VCConfig
    tp = _field_types(cls)[key]
    if key == "mode":
        if value is not None and not isinstance(value, str):
            fail(list(MODES))
        return value
    if key == "tune_cache_dir":
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)
                                  or "\x00" in str(os.fspath(value))):
            fail("None or a non-empty directory path without NUL bytes")
        return None if value is None else os.fspath(value)
    optional = False
    if typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp):
        optional = True
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if value is None:
            return None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value.value if isinstance(value, enum.Enum) else value)
        except (ValueError, TypeError):  # TypeError: an unhashable value such as a list
            values = [m.value for m in tp]
            hint = _did_you_mean([value], values) if isinstance(value, str) else ""
            fail(f"{values}{hint}")
    if tp is bool:
        if not isinstance(value, bool):
            fail("True or False")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("None or an int" if optional else "an int")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail("a number")
        try:
            return float(value)
        except OverflowError:  # an int beyond float range, e.g. 10**400
            fail("a number within float range (float('inf') where the option allows no limit)")
    if typing.get_origin(tp) is tuple:
        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__") or iter(value) is value:
            # (a dict would give its keys, a generator would be consumed by the check and reported empty)
            fail("a tuple of ints (or a list)")
        try:
            return _tuple_of_ints(value)
        except (TypeError, ValueError):
            fail("a tuple of ints")
    if key == "experimental":
        return value  # VCConfig turns a dict into Experimental (from_options), with its own checks
    raise TypeError(f"config field {key!r} of type {tp!r} has no coercion rule in config._coerce")


# ---- the environment switch (``$VCATTN_METHOD``): read by every compile of backend="vcattn" and every
# vc_compile.enable (docs/usage.md; vc_compile/pipeline.py's module doc)
def _log():
    from .log import get_logger
    return get_logger("vc_compile.config")


ENV_METHOD = "VCATTN_METHOD"
# off, auto, the baseline, then every other method
_ENV_VALUES = ("off", "auto", "dense", *(m.value for m in Method if m not in (Method.AUTO, Method.DENSE)))


def method_from_env() -> Optional[str]:
    """``$VCATTN_METHOD`` lower-cased: None when unset or empty, else one of off/auto/dense/vsmooth/mcsparse
    (anything else raises ``VCConfigError`` naming the accepted values)."""
    raw = os.environ.get(ENV_METHOD, "").strip().lower()
    if not raw:
        return None
    if raw not in _ENV_VALUES:
        raise VCConfigError(f"{ENV_METHOD}={os.environ[ENV_METHOD]!r} is invalid; accepted: "
                            f"{', '.join(_ENV_VALUES)} (or unset)")
    return raw


def options_dict(options: Any) -> Dict[str, Any]:
    """``options=`` as a plain dict: a ``VCConfig`` (every field), a mapping (as given) or None ({})."""
    if options is None:
        return {}
    if isinstance(options, VCConfig):
        return json.loads(options.to_json())
    if isinstance(options, Mapping):
        return dict(options)
    raise VCConfigError(f"vcattn options must be a VCConfig or a dict of option -> value, got "
                        f"{type(options).__name__} {options!r}; e.g. options={{'method': 'vsmooth'}}")


def apply_env(opts: Dict[str, Any], where: str) -> Tuple[Dict[str, Any], bool]:
    """(options with ``$VCATTN_METHOD``'s method, off?) -- the switch applied to one compile or enable."""
    env = method_from_env()
    if env is None:
        return opts, False
    if env == "off":
        return opts, True
    given = opts.get("method")
    given = getattr(given, "value", given)
    if given not in (None, env):
        _log().warning("%s: %s=%s overrides method=%r", where, ENV_METHOD, env, given)
    return {**opts, "method": env}, False
