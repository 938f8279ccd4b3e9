"""A real diffusers WanPipeline at real sizes, every method against stock Inductor.

    python -m benchmarks.bench_pipeline --plan-only                  # the plan and its time estimate (any machine)
    python -m benchmarks.bench_pipeline --csv $OUT/bench_pipeline.csv        # H200: 1.3B 480p, regional, all methods
    python -m benchmarks.bench_pipeline --sizes 14b-720p --layers 8 --steps 10 --csv $OUT/bench_pipeline.csv
    python -m benchmarks.bench_pipeline --compile whole --methods vsmooth+expcast,mcsparse@0.15
    python -m benchmarks.bench_pipeline --methods vsmooth+expcast,stock+f8lin,vsmooth+expcast+f8lin  # full stack
    python -m benchmarks.bench_pipeline --methods stock+dbcache,mcsparse@0.15+dbcache,mcsparse@0.15+f8lin+dbcache
    python -m benchmarks.bench_pipeline --smoke                      # CPU: tiny config, 2 steps, nothing appended

What runs: ``WanPipeline(tokenizer=None, text_encoder=None, vae=None)`` with a ``WanTransformer3DModel`` of
the published Wan 2.1 T2V configuration (``1.3b-480p``: 30 layers, 12 heads x 128, ffn 8960, text_dim 4096,
in/out channels 16, patch (1, 2, 2); 480 x 832 x 81 frames -> latents 21 x 60 x 104 = 32760 tokens;
``14b-720p``: 40 layers, 40 heads x 128, ffn 13824; 720 x 1280 x 81 -> 21 x 90 x 160 = 75600 tokens).
RANDOM seeded weights in bf16 (``_keep_in_fp32_modules`` kept fp32, as ``from_pretrained(torch_dtype=bf16)``
leaves them): these rows measure speed, not quality. Prompt embeddings are seeded tensors [1, 512, 4096]
(no text encoder), the scheduler is FlowMatchEulerDiscreteScheduler (shift 3 at 480p, 5 at 720p), the output
the final latents (no VAE), ``--steps`` steps (50), CFG ``--guidance`` (5: two transformer forwards per
step). The same initial noise for every variant.

Variants, in one process: ``stock`` (``torch.compile`` with Inductor, SDPA on cuDNN: ``common.prefer_cudnn``
for the whole run, and the stock attention kernel is checked by torch.profiler over one step:
``sdpa_kernel`` column), the peers a diffusers user picks instead (``--peers``, each on stock Inductor, its
attention kernels checked the same way; one whose package is missing or too old is left out with the reason):
``torchao-fp8`` (``torchao.prototype.attention.apply_low_precision_attention``: FA3's FP8 kernel, through
``common``'s shim to the fa3-fwd wheel where FA3 is not installed as ``flash_attn_interface``), ``sage``
(diffusers' ``set_attention_backend("sage")``), ``fa4`` (``activate_flash_attention_impl("FA4")``, flash SDPA
first), and each method through ``backend="vcattn"`` -- ``--compile regional``
(``transformer.compile_repeated_blocks(backend=..., options=...)``), ``whole`` (``torch.compile(transformer,
...)``) or ``both``. Per variant (cache dirs fresh per variant with ``--caches fresh``):
1. the first generation of a fresh compile: ``first_generation_s`` (torch.compile + kernel builds + 50
   steps; ``first_generation_extra_s`` = minus stock's). Kernels an earlier variant built in this process
   stay in memory (e.g. V-Smooth's preprocessing for V-Smooth + ExpCast): run one variant per process for
   a strictly cold figure.
2. ``--timed`` (2) timed generations: ``ms`` = median wall time of a generation; CUDA events per step give
   ``ms_per_step`` and ``step_<phase>_ms`` (step time summed by the phase the op ran in that step).
3. a separate profiled generation (recompiled with ``profile=True``; events per attention call, read per
   step): ``attn_<phase>_ms`` = attention time summed over the generation by phase, ``attn_ms`` their sum,
   ``profile_overhead`` = its steps 1..n against the timed steps 1..n.
``attn_rel_l2``: before the variants, an eager generation records the q, k, v of one self-attention layer (the
middle one) at one step (``--capture-step``, default a fifth into the schedule); each variant's attention on them
against fp32 attention on 512 sampled rows (a method: the op over a whole schedule on those inputs, its last,
reuse step; a peer: its attention call as the pipeline makes it; ``--no-attn-error`` skips it).
A variant ``<method>+f8lin`` / ``stock+f8lin`` runs on a copy of the transformer whose block linears are torchao float8
(``quantize_`` with ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)``:
the Inductor settings of every other row): the full stack in one compile, or float8 linears alone; its
``attn_rel_l2`` is its attention's, on the same captured inputs.
A variant ``...+dbcache`` runs with cache-dit's DBCache on the pipeline (``DBCACHE``: a static step mask, cache-dit's
"medium" policy, 29 of 50 steps computed, a cached step computing the first 8 blocks; the note says how many steps
were computed); ``stock+dbcache`` is the cache alone, ``<method>+f8lin+dbcache`` the whole stack.
``dynamo``: the graphs Dynamo compiled for the variant's first and timed generations and its graph breaks (a
regional compile of identical blocks is one graph: more means a recompile).
``attn_ms`` of stock and of a peer: its attention kernels' time in the 1-step profile x steps.
``--schedule N`` (e.g. 50 with ``--steps 13`` at 14B): the timed generations run ``--steps`` steps of an N-step
schedule and ``ms`` extrapolates each phase's median step time over the N steps' phases (``methods.schedule``;
said in the note). ``peak_mem_gb``: GPU memory allocated at most in the first timed generation; ``metadata_gb``:
the metadata held at its end.
``speedup_vs_stock`` (= ``speedup_vs_cudnn``): stock's median over the variant's, same compile mode;
``rel_l2`` / ``cos_sim``: final latents against stock's (random weights: not a quality measure either).
``--budget`` seconds: items are run only if their estimate fits, the first generation and one timed
generation of every variant before any extra (second timed, profiled); what is left out is listed, and
the plan with its estimate is printed before starting. Rows go to ``benchmarks/results/bench_pipeline.csv``
as each variant finishes (``--csv``: also to that file).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch  # noqa: E402

import vc_compile  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import append_rows, kernel_times, metrics, prefer_cudnn, print_table  # noqa: E402
from vc_compile.config import merge_options  # noqa: E402
from vc_compile import methods  # noqa: E402

BENCH = "bench_pipeline"
RANDOM_NOTE = "random weights: speed only, not quality"
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024)
WAN_14B = {**WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
SIZES = {  # name -> model, transformer config, pixels, flow shift, text tokens
    "1.3b-480p": dict(model="wan2.1-t2v-1.3b", cfg=WAN_1_3B, height=480, width=832, frames=81, shift=3.0, text=512),
    "14b-720p": dict(model="wan2.1-t2v-14b", cfg=WAN_14B, height=720, width=1280, frames=81, shift=5.0, text=512),
    "smoke": dict(model="tiny-wan", cfg={**WAN_1_3B, "num_attention_heads": 2, "attention_head_dim": 64,
                                         "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 32,
                                         "ffn_dim": 64, "num_layers": 2, "rope_max_seq_len": 32},
                  height=128, width=128, frames=9, shift=3.0, text=8),
}
METHODS = {"vsmooth": {"method": "vsmooth", "expcast": False}, "vsmooth+expcast": {"method": "vsmooth", "expcast": True},
           "mcsparse@0.15": {"method": "mcsparse", "density": 0.15},
           "mcsparse@0.25": {"method": "mcsparse", "density": 0.25},
           "dense": {"method": "dense"},  # dense: stock SDPA through the op (its overhead); not in the default
           # the grouping schedule's A/B (docs/design/vsmooth-grouping-schedule.md); not in the default
           "vsmooth+expcast:unshared": {"method": "vsmooth", "expcast": True, "share_grouping": False},
           "vsmooth+expcast:g25": {"method": "vsmooth", "expcast": True, "group_interval": 25},
           # MC-Sparse's metadata formats: the earlier one (key by key, bf16 residual) and runs of 8 keys whether or
           # not the memory plan needs them (docs/design/mcsparse-metadata-format.md); not in the default
           "mcsparse@0.15:tokens-bf16": {"method": "mcsparse", "density": 0.15, "key_run": 1, "residual": "bf16"},
           "mcsparse@0.15:runs8": {"method": "mcsparse", "density": 0.15, "key_run": 8}}
DEFAULT_METHODS = "vsmooth,vsmooth+expcast,mcsparse@0.15,mcsparse@0.25"
# What a diffusers user picks instead of vcattn, each on stock Inductor (regional or whole compile as the methods):
# torchao's one-call FP8 attention, SageAttention through diffusers' attention dispatcher, FA4 as torch's flash
# SDPA. Optional: a peer whose package is missing or too old is left out with the reason printed.
PEERS = ("torchao-fp8", "sage", "fa4")
DEFAULT_PEERS = ",".join(PEERS)
SMOKE_OPTS = {"min_seq_len": 64, "kmeans_iters": 1,
              "experimental": {"compiler": "eager", "kernels": "reference", "kmeans_init_iters": 2}}
# What users stack around the attention, as label suffixes (in this order): "+f8lin", torchao float8 linear layers
# in the transformer blocks (dynamic FP8 activations and weights, per-row scales), in the same compile as the
# attention; "+dbcache", a cache-dit DBCache on the pipeline (DBCACHE). "stock+f8lin" / "stock+dbcache": the part
# alone; "<method>+f8lin+dbcache": the whole stack.
F8, DBC = "+f8lin", "+dbcache"
STACKS = (F8, DBC)
# cache-dit's DBCache with a static step mask (its "medium" policy: at 50 steps 29 computed, 21 cached, the cached
# ones computing the first 8 blocks only): random weights make its residual-difference test meaningless, a fixed
# mask makes the rows reproducible and says how much is skipped
DBCACHE = dict(Fn_compute_blocks=8, Bn_compute_blocks=0, mask_policy="medium")
PHASES = ("dense", "warmup", "group", "anchor", "reuse")  # warmup: MC-Sparse's V-Smooth warm-up
EXTRAS = ["model", "layers", "steps", "guidance", "compile", "first_generation_s", "first_generation_extra_s", "first_steps",
          "speedup_vs_stock", "ms_per_step", "timed_generations", "generation_ms_all", "attn_ms",
          *(f"attn_{p}_ms" for p in PHASES), *(f"step_{p}_ms" for p in PHASES), "phases", "profile_overhead",
          "sites", "sdpa_kernel", "caches", "attn_rel_l2", "dynamo", "note", "schedule", "peak_mem_gb", "metadata_gb"]
ATTN_KERNELS = ("cudnn", "fmha", "flash", "sdpa", "attention", "attn")
# ---- planning priors (replaced by measurements as the run goes) ----
# generation time relative to stock: the measured end-to-end speed-ups (H200, 2026-12-01, this configuration)
PRIOR_RATIO = {"stock": 1.0, "dense": 1.02, "vsmooth": 1 / 1.18, "vsmooth+expcast": 1 / 1.23,
               "mcsparse@0.15": 1 / 1.59, "mcsparse@0.25": 1 / 1.43,
               # peers: torchao's 1.31x measured on this pipeline (H200, 2026-12-01); the others guessed
               "torchao-fp8": 1 / 1.31, "sage": 1 / 1.2, "fa4": 1 / 1.1}
F8_PRIOR = 1 / 1.05  # float8 linears alone on the 1.3B pipeline (H200, 2026-12-02: 1.05x)
DBC_PRIOR = 0.69  # DBCache's medium mask at 50 steps: 29 steps + 21 x 8 of 30 blocks (estimate)
COMPILE_S = {"regional": 15.0, "whole": 90.0}  # torch.compile of the transformer, empty caches (guess)
RECOMPILE_S = {"regional": 10.0, "whole": 45.0}  # the same graph again with profile=True (guess)
JIT_S = 10.0  # a method's Triton kernels built at their first calls (measured: 9.4-10 s)
# stock step time from FLOPs: cuDNN attention ~520 TFLOP/s, GEMMs ~600: 1.03 s for 1.3B at 32760 tokens
# with CFG, measured at 1.04 s (the calibration point)
ATTN_TFLOPS, GEMM_TFLOPS = 5.2e14, 6.0e14


def stacks(label: str) -> tuple:
    """The stack suffixes of a label: ``"mcsparse@0.15+f8lin+dbcache"`` -> ``("+f8lin", "+dbcache")``."""
    found = []
    for suffix in reversed(STACKS):
        if label.endswith(suffix):
            found.insert(0, suffix)
            label = label[:-len(suffix)]
    return tuple(found)


def base_label(label: str) -> str:
    """The variant without its stack: ``"vsmooth+expcast+f8lin"`` -> ``"vsmooth+expcast"``."""
    return label[:len(label) - len("".join(stacks(label)))]


def is_method(label: str) -> bool:
    """Does the variant compile with ``backend="vcattn"`` (else: stock Inductor, a peer's attention or not)?"""
    return base_label(label) in METHODS


def float8_linears(base):
    """A copy of the transformer whose blocks' linear layers are torchao float8 (what a user adds for the GEMMs):
    ``quantize_`` with dynamic per-row FP8 activations and weights, on the ``blocks.*`` linears (the embedders and
    the output projection stay bf16). (None, the reason) where torchao or an FP8-capable GPU is missing."""
    import copy
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as e:
        return None, f"float8 linears skipped: torchao not importable ({e})"
    f8 = copy.deepcopy(base)
    try:
        # NOTE set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent tuning for the
        # whole process (1.3B pipeline, H200, 2026-12-02: a 157 s first generation of stock+f8lin, 10.8 s with it
        # off, and every later variant compiled under it); off, every row shares one Inductor configuration
        quantize_(f8, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False),
                  filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and name.startswith("blocks."))
    except (AssertionError, RuntimeError) as e:
        return None, f"float8 linears skipped: {str(e)[:120]}"
    n = sum(type(m.weight).__name__ == "Float8Tensor" for m in f8.modules() if isinstance(m, torch.nn.Linear))
    return f8, f"float8 linears: torchao quantize_ Float8DynamicActivationFloat8WeightConfig(PerRow), {n} block linears"


def dbcache_missing() -> Optional[str]:
    """Why the ``+dbcache`` variants cannot run here, or None."""
    try:
        import cache_dit  # noqa: F401
    except ImportError as e:
        return f"cache-dit skipped: not importable ({str(e)[:100]})"
    return None


@contextlib.contextmanager
def dbcache_scope(pipe, steps: int, layers: int):
    """cache-dit's DBCache on ``pipe`` for a generation of ``steps`` steps (DBCACHE; the first-block count capped
    at a quarter of the blocks for cut models), disabled after. Yields what it runs, for the row's note."""
    import cache_dit
    mask = cache_dit.steps_mask(total_steps=steps, mask_policy=DBCACHE["mask_policy"]) if steps >= 8 else [1] * steps
    fn = min(DBCACHE["Fn_compute_blocks"], max(1, layers // 4))
    cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=fn, Bn_compute_blocks=DBCACHE["Bn_compute_blocks"], max_warmup_steps=0,
        steps_computation_mask=mask, steps_computation_policy="static", residual_diff_threshold=1e6,
        num_inference_steps=steps))
    try:
        yield (f"cache-dit DBCache F{fn}B{DBCACHE['Bn_compute_blocks']}, static '{DBCACHE['mask_policy']}' mask: "
               f"{sum(mask)} of {len(mask)} steps computed")
    finally:
        cache_dit.disable_cache(pipe)


def log(*a):
    print(*a, flush=True)


def tokens(spec) -> int:
    p = spec["cfg"]["patch_size"]
    return ((spec["frames"] - 1) // 4 + 1) // p[0] * (spec["height"] // 8 // p[1]) * (spec["width"] // 8 // p[2])


# ---- the pipeline -----------------------------------------------------------------------------------------
def build_pipeline(spec, layers, device, seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    with torch.device(device):
        tr = WanTransformer3DModel(**{**spec["cfg"], "num_layers": layers})
    keep = WanTransformer3DModel._keep_in_fp32_modules or []
    for name, p in tr.named_parameters():  # as from_pretrained(torch_dtype=bf16): listed modules stay fp32
        if not any(k in name.split(".") for k in keep):
            p.data = p.data.to(torch.bfloat16)
    tr.eval().requires_grad_(False)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=tr,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=spec["shift"]))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    text_dim, n_text = spec["cfg"]["text_dim"], spec["text"]

    def embeds():  # a 16-token prompt, zero-padded to the text length as the pipeline pads UMT5's output
        e = torch.zeros(1, n_text, text_dim, device=device)
        e[:, :min(16, n_text)] = torch.randn(1, min(16, n_text), text_dim, device=device, generator=g)
        return e.to(torch.bfloat16)
    shape = (1, spec["cfg"]["in_channels"], (spec["frames"] - 1) // 4 + 1, spec["height"] // 8, spec["width"] // 8)
    call = dict(prompt_embeds=embeds(), negative_prompt_embeds=embeds(), height=spec["height"],
                width=spec["width"], num_frames=spec["frames"], output_type="latent", return_dict=False,
                latents=torch.randn(shape, device=device, generator=g))
    return pipe, tr, call


def uncompile(module):
    for m in module.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None


# ---- peers ------------------------------------------------------------------------------------------------
def peer_status(label: str, device) -> tuple:
    """(available, note) of a peer on this machine; the note says what runs, or why it cannot."""
    if device.type != "cuda":
        return False, f"{label} skipped: needs a CUDA GPU"
    if label == "torchao-fp8":
        op, note = common.torchao_fp8_status()
        return op is not None, note
    if label == "sage":
        try:
            from diffusers.models import attention_dispatch as ad
        except ImportError as e:
            return False, f"sage skipped: this diffusers has no attention dispatcher ({e})"
        if not getattr(ad, "_CAN_USE_SAGE_ATTN", False):
            import importlib.metadata as md
            try:
                found = md.version("sageattention")
            except md.PackageNotFoundError:
                found = "not installed"
            need = getattr(ad, "_REQUIRED_SAGE_VERSION", "?")
            return False, (f"sage skipped: diffusers' 'sage' backend needs sageattention>={need} (found {found}; "
                           "PyPI's sageattention wheels stop at 1.0.6, 2.x builds from source against CUDA)")
        return True, "sage: diffusers set_attention_backend('sage') (SageAttention, INT8 QK)"
    if label == "fa4":
        from torch.nn import attention as na
        if "FA4" not in getattr(na, "list_flash_attention_impls", lambda: [])():
            return False, f"fa4 skipped: torch {torch.__version__} registers no FA4 flash SDPA implementation"
        from torch.nn.attention import SDPBackend, sdpa_kernel
        shim = common.fa4_sdpa_shim()
        try:  # activate it and run one small call: a glue / wheel mismatch shows here, not mid-run
            with _flash_impl("FA4"), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                x = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
                torch.nn.functional.scaled_dot_product_attention(x, x, x)
        except Exception as e:  # noqa: BLE001 - flash-attn-4 missing / not loadable / incompatible
            return False, (f"fa4 skipped: FA4 does not run as torch's flash SDPA ({type(e).__name__}: "
                           f"{str(e)[:100]}); needs flash-attn-4 whose _flash_attn_fwd torch {torch.__version__} "
                           "can call")
        return True, ("fa4: FlashAttention-4 as torch's flash SDPA (activate_flash_attention_impl), flash first"
                      + (f"; {shim}" if shim else ""))
    raise ValueError(f"unknown peer {label!r}; known: {list(PEERS)}")


@contextlib.contextmanager
def _flash_impl(name: str):
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    activate_flash_attention_impl(name)
    try:
        yield
    finally:
        restore_flash_attention_impl()


@contextlib.contextmanager
def peer_scope(label: str, pipe, base):
    """What a user does for the peer, around its compile and generations, undone after: torchao's
    ``apply_low_precision_attention`` wrapper as the pipeline's transformer (and its Inductor pre-grad RoPE fusion
    pass, a global setting restored after), diffusers' ``set_attention_backend("sage")``, or FA4 activated as
    torch's flash SDPA with the flash backend first."""
    if label == "torchao-fp8":
        import torch._inductor.config as ic
        from torchao.prototype.attention import apply_low_precision_attention
        prev = ic.pre_grad_custom_pass
        pipe.transformer = apply_low_precision_attention(base)
        try:
            yield
        finally:
            ic.pre_grad_custom_pass = prev
            pipe.transformer = base
    elif label == "sage":
        base.set_attention_backend("sage")
        try:
            yield
        finally:
            base.reset_attention_backend()
    elif label == "fa4":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with _flash_impl("FA4"), sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                               SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True):
            yield
    else:
        yield


# ---- attention error on captured inputs ---------------------------------------------------------------------
def capture_attention(pipe, base, call, a, layer: int, step: int):
    """(q, k, v) [B, H, S, D] that self-attention ``layer`` receives in the conditional forward of denoising step
    ``step``: an eager (uncompiled) generation records them (``demo.capture.capture_sdpa``) and stops there."""
    from vc_compile.demo.capture import capture_sdpa
    got = {}

    def record(info, q, k, v):
        if info["kind"] == "self" and info["layer"] == layer and info["forward"] == 2 * step:
            got["qkv"] = tuple(t.detach().clone() for t in (q, k, v))

    def stop(p, i, t, kw):
        if i >= step:
            p._interrupt = True  # WanPipeline skips the remaining steps
        return kw
    uncompile(base)
    pipe.transformer = base
    with capture_sdpa(base, record), torch.no_grad():
        pipe(**{**call, "latents": call["latents"].clone()}, num_inference_steps=a.steps,
             guidance_scale=a.guidance, callback_on_step_end=stop)
    return got.get("qkv")


def _attention_output(label, q, k, v, a):
    """One variant's attention on (q, k, v) [B, H, S, D], as the variant runs it in the pipeline, or None."""
    F = torch.nn.functional
    if label == "stock":
        return F.scaled_dot_product_attention(q, k, v)  # cuDNN: main() prefers it for the whole run
    if label == "torchao-fp8":
        fn = common.torchao_fp8_fn(q, k, v)
        return fn() if fn is not None else None
    if label == "sage":
        from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
        out = dispatch_attention_fn(*(t.transpose(1, 2) for t in (q, k, v)), backend=AttentionBackendName("sage"))
        return out.transpose(1, 2)
    if label == "fa4":
        with peer_scope("fa4", None, None):
            return F.scaled_dot_product_attention(q, k, v)
    # a method: the op on these inputs for a whole schedule of --steps steps (the inputs held fixed), its last
    # step's output: a reuse step on metadata (grouping, selection) computed from the same inputs
    opts = merge_options(METHODS[label], {"min_seq_len": 16, "experimental": {"kernels": "reference"}}
                         if a.smoke else None)
    cfg = vc_compile.VCConfig.from_options(opts).to_json()
    site = 90_000 + list(METHODS).index(label)
    out = None
    with vc_compile.sampling(num_steps=a.steps):
        for i in range(a.steps):
            vc_compile.step(i)
            out = torch.ops.vcattn.attention(q, k, v, None, site, cfg, None)
    vc_compile.reset()
    return out


def attention_errors(qkv, labels, a, n_rows: int = 512) -> Dict[str, float]:
    """rel. L2 of each variant's attention on the captured inputs against fp32 attention, on ``n_rows`` sampled
    query rows (``common.truth_rows``)."""
    import vc_compile.ops  # noqa: F401  (registers vcattn::attention)
    q, k, v = qkv
    g = torch.Generator().manual_seed(a.seed)
    rows = torch.randperm(q.shape[2], generator=g)[:n_rows].sort().values.to(q.device)
    truth = common.truth_rows(q, k, v, rows)
    errs = {}
    for label in labels:
        with torch.no_grad():
            out = _attention_output(label, q, k, v, a)
        if out is not None:
            errs[label] = metrics(out[:, :, rows].float(), truth)["rel_l2"]
    return errs


def compile_variant(pipe, base, label, opts, mode, smoke):
    torch._dynamo.reset()
    for k in ("stats", "graph_break"):  # dynamo_summary() reads them per variant
        counters[k].clear()
    vc_compile.reset(report=True)
    uncompile(base)
    stockish = not is_method(label)
    if label not in PEERS:
        pipe.transformer = base
    kw = ({"backend": "eager"} if smoke else {}) if stockish else {"backend": "vcattn", "options": opts}
    if mode == "regional":
        base.compile_repeated_blocks(**kw)  # in place: under a peer's wrapper too
    else:
        pipe.transformer = torch.compile(pipe.transformer, **kw)


def dynamo_summary() -> str:
    """Graphs Dynamo compiled for the variant and its graph breaks: a regional compile of identical blocks is one
    graph; more (with no break) means a recompile."""
    n = counters["stats"].get("unique_graphs", 0)
    breaks = sum(counters["graph_break"].values())
    return f"{n} graph{'s' if n != 1 else ''}, {breaks} graph break{'s' if breaks != 1 else ''}"


def phase_totals() -> Dict[str, int]:
    c: Dict[str, int] = {}
    for s in vc_compile.report().sites:  # no sync unless profile=True left events to resolve
        for p, n in s.phases.items():
            c[p] = c.get(p, 0) + n
    return c


class StepRecorder:
    """``callback_on_step_end``: a CUDA event per step (no sync), the phase the op ran in the step (the
    most frequent one among the calls launched in it) and, with ``attn``, the attention time of the step
    (``vc_compile.report()``, which syncs: profiled generations only)."""

    def __init__(self, cuda, steps, prefix, attn=False, t0=None):
        self.cuda, self.steps, self.prefix, self.attn = cuda, steps, prefix, attn  # ``steps`` run, then it stops
        self.t0 = t0 or time.perf_counter()
        self.marks, self.phases, self.attn_ms = [], [], []
        self.counts = phase_totals()
        self.total = vc_compile.report().total_time_ms if attn else 0.0
        self._mark()

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def __call__(self, pipe, i, t, kw):
        self._mark()
        now = phase_totals()
        delta = {p: now.get(p, 0) - self.counts.get(p, 0) for p in now}
        delta = {p: n for p, n in delta.items() if n > 0}
        self.phases.append(max(sorted(delta), key=delta.get) if delta else "stock")
        self.counts = now
        if self.attn:
            total = vc_compile.report().total_time_ms
            self.attn_ms.append(total - self.total)
            self.total = total
        if i + 1 >= self.steps:
            pipe._interrupt = True  # a partial run of a longer schedule: WanPipeline skips the rest
        every = max(1, self.steps // 5)
        if (i + 1) % every == 0 or i + 1 == self.steps:
            log(f"    {self.prefix}: step {i + 1}/{self.steps} [{time.perf_counter() - self.t0:.0f} s]")
        return kw

    def step_ms(self) -> List[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def generate(pipe, call, steps, guidance, rec: StepRecorder, schedule=None):
    if rec.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = pipe(**{**call, "latents": call["latents"].clone()}, num_inference_steps=schedule or steps,
                   guidance_scale=guidance, callback_on_step_end=rec)[0]
    if rec.cuda:
        torch.cuda.synchronize()
    return out.float(), time.perf_counter() - t0


def stock_attention_kernel(pipe, call, guidance) -> tuple:
    """Which attention kernels the compiled stock model launches: torch.profiler over a 1-step generation
    (same shapes, same graph: no recompile): (``"cudnn: <top kernel>"`` or what else ran, the attention kernels'
    milliseconds in that step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        pipe(**{**call, "latents": call["latents"].clone()}, num_inference_steps=1, guidance_scale=guidance)
        torch.cuda.synchronize()
    kern = {n: t for n, t in kernel_times(prof).items() if any(p in n.lower() for p in ATTN_KERNELS)}
    if not kern:
        return "no attention kernel found", float("nan")
    name = max(kern, key=kern.get)
    kind = "cudnn" if "cudnn" in name.lower() or "sdpa" in name.lower() else "NOT cuDNN"
    total = sum(kern.values())
    return f"{kind}: {name[:80]} ({kern[name]:.0f} ms of {total:.0f} ms attention in 1 step)", total


def kernel_table(pipe, call, guidance, label, out_dir) -> None:
    """torch.profiler over a 2-step generation (a method's first step groups or anchors, its second reuses):
    every CUDA kernel's milliseconds, written to ``out_dir/<label>.json``; the top 12 printed."""
    import json
    import re

    from torch.profiler import ProfilerActivity, profile

    vc_compile.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        pipe(**{**call, "latents": call["latents"].clone()}, num_inference_steps=2, guidance_scale=guidance)
        torch.cuda.synchronize()
    kern = kernel_times(prof)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", label) + ".json"), "w") as f:
        json.dump({"label": label, "steps": 2, "total_ms": sum(kern.values()), "kernels": kern}, f, indent=0)
    log(f"    {label}: {sum(kern.values()):.0f} ms of kernels in a 2-step generation; the largest:")
    for n, t in sorted(kern.items(), key=lambda kv: -kv[1])[:12]:
        log(f"      {t:8.1f} ms  {n[:110]}")


def site_summary() -> str:
    rep = vc_compile.report()
    fb: Dict[str, int] = {}
    for s in rep.fallbacks:
        fb[s.reason or "?"] = fb.get(s.reason or "?", 0) + 1
    rt: Dict[str, int] = {}
    for s in rep.rewritten:
        for r, n in s.runtime_fallbacks.items():
            rt[r] = rt.get(r, 0) + n
    out = f"{len(rep.rewritten)} rewritten"
    if fb:
        out += "; stock SDPA: " + ", ".join(f"{n} {r}" for r, n in fb.items())
    if rt:
        out += "; run-time fallbacks: " + ", ".join(f"{r} x{n}" for r, n in rt.items())
    return out


# ---- one variant ------------------------------------------------------------------------------------------
@dataclass
class Result:
    label: str
    mode: str
    first_s: float = float("nan")
    gens_s: List[float] = field(default_factory=list)
    step_ms: List[float] = field(default_factory=list)
    phases: List[str] = field(default_factory=list)
    latents: Optional[torch.Tensor] = None
    attn: Dict[str, float] = field(default_factory=dict)
    prof_step_ms: List[float] = field(default_factory=list)
    sites: str = ""
    sdpa_kernel: str = ""
    skipped: List[str] = field(default_factory=list)
    peer_note: str = ""  # a peer: what ran (peer_status)
    dynamo: str = ""  # graphs and graph breaks of the first + timed generations
    peak_gb: float = float("nan")  # GPU memory allocated at most during the first timed generation
    metadata_gb: float = float("nan")  # metadata held at its end (report().bytes_held)


def run_variant(pipe, base, call, label, mode, a, est: Estimator, t_start, reserve_s) -> Result:
    """Cold generation, timed generation(s), profiled generation, each if the budget allows."""
    res = Result(label, mode, peer_note=a.peer_notes.get(label, ""))
    opts = (merge_options(METHODS[base_label(label)], SMOKE_OPTS if a.smoke else None) if is_method(label)
            else None)
    tag = f"{label} [{mode}]"

    def left():
        return (a.budget - (time.perf_counter() - t_start)) if a.budget else float("inf")

    if est.item_s("cold", label, mode) + est.item_s("timed", label, mode) > left():
        res.skipped.append(f"{tag}: everything (needs ~{est.item_s('cold', label, mode):.0f} s + "
                           f"{est.item_s('timed', label, mode):.0f} s, {max(0, left()):.0f} s left)")
        return res
    if label not in PEERS:
        pipe.transformer = base  # before a cache wraps the pipeline's transformer
    cache = (dbcache_scope(pipe, a.steps, base.config.num_layers) if DBC in stacks(label)
             else contextlib.nullcontext())
    with peer_scope(label, pipe, base), cache as cache_note:
        res.peer_note = "; ".join(x for x in (res.peer_note, cache_note) if x)
        _run_variant_items(pipe, base, call, label, mode, a, est, res, opts, tag, left, reserve_s)
    uncompile(base)
    pipe.transformer = base
    torch._dynamo.reset()
    return res


def _run_variant_items(pipe, base, call, label, mode, a, est, res, opts, tag, left, reserve_s):
    cuda = a.device.type == "cuda"
    log(f"  {tag}: first generation (compile{' + kernel builds' if is_method(label) else ''}) ...")
    compile_variant(pipe, base, label, opts, mode, a.smoke)
    res.latents, res.first_s = generate(pipe, call, a.first_steps, a.guidance,
                                        StepRecorder(cuda, a.first_steps, f"{tag} first"))
    res.sites = site_summary() if is_method(label) else ""
    for k in range(a.timed):
        if k > 0 and est.item_s("timed", label, mode) + reserve_s > left():
            res.skipped.append(f"{tag}: timed generation {k + 1}")
            continue
        vc_compile.reset()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rec = StepRecorder(cuda, a.steps, f"{tag} timed {k + 1}")
        lat, s = generate(pipe, call, a.steps, a.guidance, rec, a.schedule)
        res.gens_s.append(s)
        if k == 0:
            res.step_ms, res.phases, res.latents = rec.step_ms(), rec.phases, lat
            res.metadata_gb = vc_compile.report().bytes_held / 2**30
            res.peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    res.dynamo = dynamo_summary()  # after the first and the timed generations, before any profiled recompile
    est.observe(label, mode, first_s=res.first_s, gen_s=statistics.median(res.gens_s), first_frac=a.first_steps / a.steps)
    if a.kernel_table and cuda:  # every kernel of a 2-step generation, for comparing variants outside attention
        kernel_table(pipe, call, a.guidance, label, a.kernel_table)
    if not is_method(label) and cuda:  # which attention kernels actually ran, and their time in one step
        res.sdpa_kernel, step_ms = stock_attention_kernel(pipe, call, a.guidance)
        if math.isfinite(step_ms) and DBC not in stacks(label):  # a cache skips blocks: one step is no measure
            res.attn = {"total": step_ms * a.steps}  # its attention kernels in one profiled step x the steps
        log(f"    {label} attention kernel: {res.sdpa_kernel}")
    if is_method(label) and a.profiled:  # the op's per-call events: our methods only
        if est.item_s("profiled", label, mode) + reserve_s > left():
            res.skipped.append(f"{tag}: profiled generation")
        else:
            log(f"  {tag}: profiled generation (recompile with profile=True) ...")
            compile_variant(pipe, base, label, {**opts, "profile": True}, mode, a.smoke)
            rec = StepRecorder(cuda, a.steps, f"{tag} profiled", attn=True)
            _, s = generate(pipe, call, a.steps, a.guidance, rec, a.schedule)
            est.observe(label, mode, profiled_s=s)
            res.prof_step_ms = rec.step_ms()
            for p in PHASES:
                res.attn[p] = sum(t for t, ph in zip(rec.attn_ms, rec.phases) if ph == p)
            res.attn["total"] = sum(rec.attn_ms)


def schedule_ms(res: Result, a) -> float:
    """A generation's ms: the timed median, or with ``--schedule`` longer than ``--steps`` each phase's median step
    time (of the first timed generation) over the phases of the whole schedule (``methods.schedule``)."""
    if not res.gens_s:
        return float("nan")
    if a.schedule == a.steps or not res.step_ms:
        return statistics.median(res.gens_s) * 1e3
    cfg = vc_compile.VCConfig.from_options(METHODS[base_label(res.label)]) if is_method(res.label) else None
    phases = [p.value for p in methods.schedule(cfg, a.schedule)] if cfg else ["stock"] * a.schedule
    # NOTE each run step by the schedule's phase, not the phase most blocks ran: under a memory plan most blocks
    # of an anchor or reuse step run the dense 8-bit path, and that step's time is what the schedule's step costs
    ran = phases[:len(res.step_ms)]
    by = {p: statistics.median(t for t, q in zip(res.step_ms, ran) if q == p) for p in set(ran)}
    return sum(by.get(p, statistics.median(res.step_ms)) for p in phases)


def make_row(res: Result, stock: Optional[Result], spec, layers, a) -> dict:
    cfg = spec["cfg"]
    H, Dh, S = cfg["num_attention_heads"], cfg["attention_head_dim"], tokens(spec)
    med = schedule_ms(res, a)
    row = dict(variant=res.label, B=1, H=H, S=S, D=Dh, ms=med, model=spec["model"], layers=layers,
               steps=a.steps, guidance=a.guidance, compile=res.mode, first_generation_s=res.first_s,
               first_steps=a.first_steps,
               ms_per_step=med / a.schedule, timed_generations=len(res.gens_s), schedule=a.schedule,
               peak_mem_gb=res.peak_gb, metadata_gb=res.metadata_gb,
               generation_ms_all=" ".join(f"{s * 1e3:.0f}" for s in res.gens_s), sites=res.sites,
               sdpa_kernel=res.sdpa_kernel, caches=a.caches, dynamo=res.dynamo,
               density=METHODS.get(base_label(res.label), {}).get("density", 1.0))
    if stock is not None and stock.gens_s and res.gens_s:
        sp = schedule_ms(stock, a) / med
        row.update(speedup_vs_stock=sp, speedup_vs_cudnn=sp,
                   first_generation_extra_s=res.first_s - stock.first_s)
        if res is not stock and stock.latents is not None and res.latents is not None:
            m = metrics(res.latents, stock.latents)
            row.update(rel_l2=m["rel_l2"], cos_sim=m["cos_sim"])
    if res.label != "stock" and res.phases:
        for p in PHASES:
            row[f"step_{p}_ms"] = sum(t for t, ph in zip(res.step_ms, res.phases) if ph == p)
        row["phases"] = " ".join(f"{p}:{res.phases.count(p)}" for p in PHASES if p in res.phases)
    if res.attn:
        row["attn_ms"] = res.attn["total"]
        row.update({f"attn_{p}_ms": res.attn[p] for p in PHASES if p in res.attn})
        calls = a.steps * (2 if a.guidance > 1 else 1) * layers
        if DBC not in stacks(res.label):  # with a block cache the calls made are fewer than steps x layers
            row["tflops"] = 4.0 * H * S * S * Dh * calls / (res.attn["total"] * 1e-3) / 1e12
        if len(res.prof_step_ms) > 1 and len(res.step_ms) > 1:
            row["profile_overhead"] = sum(res.prof_step_ms[1:]) / sum(res.step_ms[1:]) - 1.0
    cut = [] if layers == cfg["num_layers"] else [f"cut to {layers} of {cfg['num_layers']} layers"]
    if a.held_gb:
        cut.append(f"{a.held_gb:.1f} GiB of the GPU held outside torch (--gpu-memory-gb {a.gpu_memory_gb:g})")
    if a.schedule > a.steps:
        cut.append(f"extrapolated: {a.steps} of {a.schedule} steps run, each phase's median step time x its steps "
                   f"in the {a.schedule}-step schedule")
    elif a.steps != 50:
        cut.append(f"{a.steps} of 50 steps")
    n = len(res.gens_s)
    bad = res.latents is not None and not bool(torch.isfinite(res.latents).all())
    row["note"] = "; ".join([RANDOM_NOTE, *cut, f"{spec['height']}x{spec['width']}x{spec['frames']} px",
                             f"CFG {a.guidance:g}",
                             f"timed: median of {n} generations" if n > 1 else "timed: 1 generation",
                             *([res.peer_note] if res.peer_note else []),
                             *(["profiled generation left out (budget)"] if is_method(res.label) and a.profiled
                               and not res.attn else []),
                             *(["attention time: its kernels in one profiled step x steps"]
                               if not is_method(res.label) and res.attn else []),
                             *(["NON-FINITE final latents"] if bad else []),
                             *(["CPU smoke: eager, reference kernels"] if a.smoke else [])])
    return row


# ---- budget ------------------------------------------------------------------------------------------------
class Estimator:
    """Seconds per planned item: FLOP-based priors first, measured values once a variant has run."""

    def __init__(self, cfg, layers, S, steps, guidance, cuda):
        d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        per_fwd = (4.0 * S * S * d / ATTN_TFLOPS + 2.0 * S * (6 * d * d + 2 * d * cfg["ffn_dim"]) / GEMM_TFLOPS)
        self.step_s = (2 if guidance > 1 else 1) * layers * per_fwd if cuda else 0.0
        self.steps, self.cuda, self.first_frac = steps, cuda, 1.0
        self.build_s = (5.0 + 1e-9 * layers * (8 * d * d + 2 * d * cfg["ffn_dim"])) if cuda else 0.0  # guess
        self.gen: Dict[str, float] = {}
        self.overhead: Dict[tuple, float] = {}  # (mode, stock?) -> first generation - steady generation
        self.recompile: Dict[str, float] = {}

    def gen_s(self, label):
        if label in self.gen:
            return self.gen[label]
        stock = self.gen.get("stock", self.step_s * self.steps)
        prior = PRIOR_RATIO.get(base_label(label).split(":")[0], 1.0)  # "vsmooth+expcast:g25": its method's
        return (stock * prior * (F8_PRIOR if F8 in stacks(label) else 1.0)
                * (DBC_PRIOR if DBC in stacks(label) else 1.0))

    def item_s(self, item, label, mode):
        if not self.cuda:
            return 0.0
        g = self.gen_s(label)
        if item == "timed":
            return g
        if item == "cold":
            prior = COMPILE_S[mode] + (self.step_s if label == "stock" else JIT_S)  # stock: + the SDPA check
            return g * self.first_frac + self.overhead.get((mode, label == "stock"), prior)
        return 1.02 * g + self.recompile.get(mode, RECOMPILE_S[mode])  # profiled

    def observe(self, label, mode, first_s=None, gen_s=None, profiled_s=None, first_frac=1.0):
        if gen_s is not None:
            self.gen[label] = gen_s
            if first_s is not None:
                self.overhead[(mode, label == "stock")] = max(0.0, first_s - first_frac * gen_s)
        if profiled_s is not None and label in self.gen:
            self.recompile[mode] = max(0.0, profiled_s - self.gen[label])


def plan_items(est: Estimator, labels, modes, timed, profiled, budget, spent):
    """The plan as printable lines and its total estimate; with a budget, what the run's rules (first
    generation + one timed generation of every variant first, extras only if the rest still fits) would
    leave out with today's estimates."""
    lines, total, t = [f"build the pipeline ~{est.build_s:.0f} s"], est.build_s, spent + est.build_s
    seq = [(m, lab) for m in modes for lab in labels]
    for j, (mode, lab) in enumerate(seq):
        ess = est.item_s("cold", lab, mode) + est.item_s("timed", lab, mode)
        reserve = sum(est.item_s("cold", l2, m2) + est.item_s("timed", l2, m2) for m2, l2 in seq[j + 1:])
        extras = [("timed", f"timed {k + 1}") for k in range(1, timed)]
        extras += [("profiled", "profiled")] if profiled and lab in METHODS else []
        full = ess + sum(est.item_s(kind, lab, mode) for kind, _ in extras)
        total += full
        if budget and t + ess > budget:
            lines.append(f"{lab:16s} [{mode}] ~{full:5.0f} s: LEFT OUT (budget)")
            continue
        t += ess
        done, out = ["first", "timed 1"], []
        for kind, name in extras:
            s = est.item_s(kind, lab, mode)
            if budget and t + s + reserve > budget:
                out.append(name)
            else:
                t += s
                done.append(name)
        lines.append(f"{lab:16s} [{mode}] ~{full:5.0f} s: " + ", ".join(done)
                     + (f"; left out: {', '.join(out)}" if out else ""))
    return lines, total


# ---- main -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1.3b-480p", help=f"comma-separated, from {[s for s in SIZES if s != 'smoke']}")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help=f"comma-separated, from {list(METHODS)}; suffix {F8}: with torchao float8 linear layers in "
                         f"the blocks, {DBC}: with a cache-dit DBCache (both: '<method>{F8}{DBC}'); 'stock{F8}' / "
                         f"'stock{DBC}': the part alone")
    ap.add_argument("--peers", default=DEFAULT_PEERS,
                    help=f"comma-separated, from {list(PEERS)} ('' for none): what users pick instead, where installed")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-stock", dest="stock", action="store_false",
                    help="leave stock out (its rows from another run of the same GPU; a 14B call holds few variants)")
    ap.add_argument("--first-steps", type=int, default=None,
                    help="steps of the first (compiling) generation; default --steps. Fewer keep a run short: "
                         "first_generation_s then covers compile + kernel builds + these steps (column first_steps)")
    ap.add_argument("--schedule", type=int, default=None,
                    help="steps of the schedule (default --steps): the timed generations run --steps of them, and "
                         "'ms' extrapolates each phase's median step time over the whole schedule (stated in the note)")
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--compile", choices=("regional", "whole", "both"), default="regional")
    ap.add_argument("--layers", type=int, default=None, help="transformer layers (cut the 14B model; default all)")
    ap.add_argument("--timed", type=int, default=2, help="timed generations per variant (median)")
    ap.add_argument("--no-profiled", dest="profiled", action="store_false",
                    help="skip the profiled generation (per-phase attention time)")
    ap.add_argument("--caches", choices=("fresh", "shared"), default="fresh",
                    help="fresh: new Inductor/Triton cache dirs per variant (cold first generations)")
    ap.add_argument("--budget", type=float, default=510.0, help="seconds for the whole run (0 = no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-attn-error", dest="attn_error", action="store_false",
                    help="skip the attention error of every variant on inputs captured from the run")
    ap.add_argument("--capture-step", type=int, default=None,
                    help="denoising step whose inputs are captured (default: a fifth into the schedule)")
    ap.add_argument("--csv", default=None, help="also append the rows to this CSV")
    ap.add_argument("--kernel-table", default=None, metavar="DIR",
                    help="per variant, every kernel's time in a profiled 2-step generation, as DIR/<label>.json")
    ap.add_argument("--gpu-memory-gb", type=float, default=None,
                    help="leave the process this many GiB of the GPU: the rest is allocated outside torch (CUDA "
                         "driver API) for the whole run, so a larger GPU plans and runs out of memory as a smaller one "
                         "(79.2 = an H100 80GB); said in the rows' note")
    ap.add_argument("--plan-only", action="store_true", help="print the plan and its estimate, run nothing")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny config, 2 steps, eager compiler, reference "
                    "kernels, no rows appended")
    a = ap.parse_args(argv)
    a.methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in a.methods if base_label(m) not in (*METHODS, "stock") or m == "stock"
           or base_label(m) + "".join(stacks(m)) != m]
    if bad:
        ap.error(f"unknown methods {bad}; known: {list(METHODS)}, each also with the suffixes {F8} and / or {DBC} "
                 f"(in this order), and 'stock' with them")
    a.peers = [p for p in a.peers.split(",") if p]
    bad = [p for p in a.peers if p not in PEERS]
    if bad:
        ap.error(f"unknown peers {bad}; known: {list(PEERS)}")
    a.sizes = ["smoke"] if a.smoke else [s for s in a.sizes.split(",") if s]
    if any(s not in SIZES for s in a.sizes):
        ap.error(f"unknown sizes {a.sizes}; known: {list(SIZES)}")
    if a.smoke:
        # 2 steps, or an explicit --steps up to 12 (enough for a step cache's mask to skip some)
        a.steps, a.caches, a.budget = (2 if a.steps == 50 else min(a.steps, 12)), "shared", 0.0
    a.modes = ["regional", "whole"] if a.compile == "both" else [a.compile]
    a.first_steps = min(a.steps, a.first_steps or a.steps)
    a.schedule = max(a.steps, a.schedule or a.steps)
    a.budget = a.budget or None
    a.device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    a.peer_notes = {}
    a.capture_step = min(a.steps - 1, a.capture_step if a.capture_step is not None else a.steps // 5)
    return a


_HELD = []  # device pointers held outside torch for the whole run (--gpu-memory-gb)


def hold_gpu_memory(leave_gb: float) -> float:
    """Allocate all but ``leave_gb`` GiB of the GPU's total outside torch's allocator (cuMemAlloc in torch's primary
    context), so ``mem_get_info`` and torch's own allocations see the GPU a smaller one would be; GiB held."""
    import ctypes
    torch.zeros(1, device="cuda")  # torch's primary context, current on this thread
    free, total = torch.cuda.mem_get_info()
    hold = int(total - leave_gb * 2**30)
    if hold <= 0:
        return 0.0
    if hold > free:
        sys.exit(f"bench_pipeline: --gpu-memory-gb {leave_gb:g} needs {hold / 2**30:.1f} GiB held, "
                 f"{free / 2**30:.1f} free")
    ptr = ctypes.c_uint64()
    rc = ctypes.CDLL("libcuda.so.1").cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(hold))
    if rc != 0:
        sys.exit(f"bench_pipeline: cuMemAlloc of {hold / 2**30:.1f} GiB failed (CUresult {rc})")
    _HELD.append(ptr)
    log(f"[bench_pipeline] holding {hold / 2**30:.1f} GiB outside torch: {leave_gb:g} GiB left of "
        f"{total / 2**30:.1f}")
    return hold / 2**30


def main(argv=None):
    smoke_threads = "--smoke" in (sys.argv[1:] if argv is None else argv)
    threads = torch.get_num_threads()
    if smoke_threads:  # tiny CPU ops: one thread is ~6x faster than two on a shared 2-core machine
        torch.set_num_threads(1)
    try:
        with prefer_cudnn():
            return _main(argv)
    finally:
        torch.set_num_threads(threads)


def _main(argv=None):
    t_start = time.perf_counter()
    a = parse_args(argv)
    if not a.smoke and a.device.type != "cuda" and not a.plan_only:
        sys.exit("bench_pipeline: needs a CUDA GPU (or --smoke / --plan-only)")
    a.held_gb = hold_gpu_memory(a.gpu_memory_gb) if a.gpu_memory_gb and a.device.type == "cuda" else 0.0
    all_rows, skipped = [], []
    for size in a.sizes:
        spec = SIZES[size]
        layers = a.layers or spec["cfg"]["num_layers"]
        est = Estimator(spec["cfg"], layers, tokens(spec), a.steps, a.guidance,
                        cuda=a.device.type == "cuda" or (a.plan_only and not a.smoke))
        est.first_frac = a.first_steps / a.steps
        peers = []
        for p in a.peers:  # a peer that cannot run here is left out, with the reason
            ok, note = (True, f"{p}: (plan only)") if a.plan_only else peer_status(p, a.device)
            a.peer_notes[p] = note
            log(f"  peer {note}")
            if ok:
                peers.append(p)
            else:
                skipped.append(note)
        labels = ["stock"] * a.stock + [*peers, *a.methods]
        log(f"[bench_pipeline] {size}: {spec['model']} config, {layers} layers, {tokens(spec)} tokens, {a.steps} "
            f"steps, CFG {a.guidance:g}, compile {'+'.join(a.modes)}; {RANDOM_NOTE}")
        plan, total = plan_items(est, labels, a.modes, a.timed, a.profiled, a.budget,
                                 time.perf_counter() - t_start)
        for line in plan:
            log("  plan: " + line)
        log(f"  plan: estimated {total:.0f} s" + (f" of a {a.budget:.0f} s budget" if a.budget else ""))
        if a.plan_only:
            continue
        pipe, base, call = build_pipeline(spec, layers, a.device, a.seed)
        log(f"  built in {time.perf_counter() - t_start:.0f} s")
        errs = {}
        if a.attn_error:
            layer = layers // 2
            qkv = capture_attention(pipe, base, call, a, layer, a.capture_step)
            if qkv is None:
                skipped.append(f"attention error: no self-attention inputs captured at layer {layer}, step "
                               f"{a.capture_step}")
            else:
                errs = attention_errors(qkv, list(dict.fromkeys(base_label(x) for x in labels)), a)
                errs.update({x: errs[base_label(x)] for x in labels if base_label(x) in errs})  # same attention
                log(f"  attention rel. L2 vs fp32 on inputs of layer {layer}, step {a.capture_step} "
                    f"({tuple(qkv[0].shape)}): " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
                del qkv
            a.attn_where = f"layer {layer}, step {a.capture_step}"
        f8 = None
        for mode in a.modes:
            stock = None
            for j, label in enumerate(labels):
                reserve = sum(est.item_s("cold", lab, mode) + est.item_s("timed", lab, mode) for lab in labels[j + 1:])
                reserve += sum(est.item_s("cold", lab, m) + est.item_s("timed", lab, m)
                               for m in a.modes[a.modes.index(mode) + 1:] for lab in labels)
                model = base
                if DBC in stacks(label) and dbcache_missing():
                    skipped.append(f"{label}: {dbcache_missing()}")
                    continue
                if F8 in stacks(label):
                    if f8 is None and "f8" not in a.peer_notes:  # built once, at the first such variant
                        f8, note = float8_linears(base)
                        log(f"  {note}")
                        a.peer_notes["f8"] = note
                    if f8 is None:
                        skipped.append(f"{label}: {a.peer_notes['f8']}")
                        continue
                    a.peer_notes[label] = a.peer_notes["f8"]
                    model = f8
                with _cache_scope(a.caches):
                    res = run_variant(pipe, model, call, label, mode, a, est, t_start, reserve)
                skipped += res.skipped
                if not res.gens_s:
                    if label == "stock":
                        skipped.append(f"every method [{mode}]: no stock baseline")
                        break
                    continue
                stock = res if label == "stock" else stock
                row = make_row(res, stock, spec, layers, a)
                if label in errs:
                    row["attn_rel_l2"] = errs[label]
                    row["note"] += f"; attention rel. L2 on inputs captured at {a.attn_where}"
                all_rows.append(row)
                log(f"  {label} [{mode}]: {row['ms'] / 1e3:.1f} s/generation ({row['ms_per_step']:.0f} ms/step), "
                    f"x{row.get('speedup_vs_stock', float('nan')):.2f} vs stock, first generation "
                    f"{row['first_generation_s']:.1f} s, attention {row.get('attn_ms', float('nan')) / 1e3:.1f} s, "
                    f"rel_l2 {row.get('rel_l2', float('nan')):.2e}; {res.sites} "
                    f"[{time.perf_counter() - t_start:.0f} s]")
                if not a.smoke:
                    path = append_rows(BENCH, [row], extras=EXTRAS)
                    if a.csv:
                        append_rows(BENCH, [row], path=a.csv, extras=EXTRAS)
        del pipe, base, call, f8
        if a.device.type == "cuda":
            torch.cuda.empty_cache()
    if all_rows:
        log("")
        print_table(all_rows, ["variant", "compile", "S", "ms", "ms_per_step", "speedup_vs_stock", "first_generation_s",
                               "first_generation_extra_s", "attn_ms", *(f"attn_{p}_ms" for p in PHASES), "rel_l2",
                               "attn_rel_l2"])
        log(f"({RANDOM_NOTE})")
        if not a.smoke:
            log(f"[bench_pipeline] rows appended to {path}")
    if skipped:
        log("[bench_pipeline] left out (budget, or a peer not installed): " + "; ".join(skipped))
    log(f"[bench_pipeline] {time.perf_counter() - t_start:.0f} s in all")
    return all_rows


@contextlib.contextmanager
def _cache_scope(kind):
    """``fresh``: a new, empty Inductor + Triton cache dir for the variant (torch's own ``fresh_cache``),
    deleted after it; ``shared``: the process's caches as they are."""
    if kind != "fresh":
        yield
        return
    from torch._inductor import utils as iu

    fresh = getattr(iu, "fresh_cache", None) or iu.fresh_inductor_cache
    with fresh():
        yield


if __name__ == "__main__":
    main()
