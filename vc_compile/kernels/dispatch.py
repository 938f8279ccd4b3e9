"""The one place that decides how a kernel call runs: the plain-PyTorch reference, a Triton kernel or the Gluon
sm_90 kernel; whether the kernels can take the inputs at all; and which launch configuration (the tuning cache,
``vc_compile/tune``, asked with the candidates of ``configs.py``).

    method (methods/*.py) --impl--> dispatch.<kernel>(...) --launch config--> kernels/<kernel>.py
                                                    \\--> reference/<kernel>.py   (impl = REFERENCE)

Rules, in order:
* ``choose``: per op call, REFERENCE or TRITON for all of a method's kernels. ``kernels="reference"`` (an
  experimental option) forces the reference; ``"triton"`` forces the kernels and refuses, with a clear error,
  what cannot work (CPU without ``TRITON_INTERPRET=1``, FP8 options on a GPU without FP8 tensor cores, Triton
  missing); ``"auto"`` runs the kernels on CUDA GPUs where the method's options are supported (FP8 needs
  sm_89+) and the reference elsewhere (CPU; a GPU without FP8, with a one-time warning).
* ``vsmooth_attention`` with TRITON: the Gluon kernel (``vsmooth_attn_sm90.py``) on an sm_90 GPU for INT8 Q/K
  outside the interpreter, the Triton kernel (``vsmooth_attn.py``) otherwise; a ``launch`` config picks its
  kernel explicitly (``VSmoothSm90Config`` / ``VSmoothTritonConfig``: benchmarks' side-by-side rows).
  NOTE Gluon on sm_90: it issues both MMAs asynchronously and runs the softmax between them, which the Triton
  kernel cannot express, and measured faster on every mode; docs/design/sm90-gluon-kernel.md.
* ``launch=None``: ``tune.lookup.resolve`` (shipped table of the GPU family -> local cache -> tuned on first
  use; the first candidate, never tuned, off CUDA and under the interpreter).
* Eligibility (``vsmooth_ineligible`` / ``sparse_ineligible``): the reasons the op records when it runs stock
  SDPA instead of the kernels (head dims ``configs.VSMOOTH_HEAD_DIMS`` / powers of two in [16, 256],
  cross-attention for the 8-bit kernels).

* ``KERNELS``: one row per kernel (module, launch-config class, tuned or not and the sources that key its
  tuning, candidates and tuning key, the report's label, its oracle in ``reference/`` and the entry points
  both modules provide); ``triton_error``, ``SOURCES``, ``_resolve``, ``call`` and ``implementation`` read it.
  ``call(kernel, entry, impl, ...)`` runs an entry (the oracle for REFERENCE, the kernel with its launch for
  TRITON); the named wrappers below are ``call`` plus a tuned launch where there is one, and
  ``implementation`` is the label of what a call runs, the same decision the call makes (``report()`` uses it).
  A new kernel is a row here (and a wrapper only if its launch is tuned or its arguments need converting).

Nothing here holds state that selects an implementation: every decision is a function of the arguments and
the device.
"""
from __future__ import annotations

import enum
import functools
import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from vc_compile import torch_ops
from vc_compile.kernels import configs as C
from vc_compile.kernels.interpret import interpreting
from vc_compile.runtime import report as _report
from vc_compile.runtime.runtime import current
from vc_compile.tune import lookup as tune

_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class KernelRow:
    """One kernel of ``kernels/``: its module (imported lazily, at the first TRITON call), its launch-config
    class, whether the tuner picks its launch (then ``sources``, the files whose text keys its tuning-cache
    entries: a change of the kernel re-tunes), and the kernel path ``report()`` records where it runs."""
    name: str
    module: str
    config: Optional[type] = None
    sources: Tuple[str, ...] = ()
    label: str = "triton"
    # tuned kernels: the candidates (first = the measured default) and the tuning key's variant field of one
    # call, functions of the shape keywords the wrapper passes to ``_resolve``
    candidates: Optional[Callable[..., list]] = None
    variant: Optional[Callable[..., str]] = None
    # part of ``triton_error``'s import check: the Triton kernels every GPU path needs. The Gluon sm_90 kernels
    # are not (a Triton without Gluon must not take the other kernels down); they import where they run.
    core: bool = True
    # the plain-PyTorch oracle: its module in reference/ (REFERENCE calls), and the entry points ``call`` routes,
    # each the same function name in both modules unless ``ref_names`` maps it ("module:function" in reference/)
    reference: Optional[str] = None
    entries: Tuple[str, ...] = ()
    ref_names: Tuple[Tuple[str, str], ...] = ()
    # the launch config an untuned kernel's entries take when the caller gives none (``launched``: which do)
    default_launch: Optional[object] = None
    # a specialised kernel (the Gluon sm_90 ones): the row whose calls it takes over, and why it cannot take a
    # call (None: it runs it), a function of the call's keywords (``row_for``); its own launch config picks it too
    replaces: Optional[str] = None
    applies: Optional[Callable[..., Optional[str]]] = None
    launched: Tuple[str, ...] = ()

    @property
    def tuned(self) -> bool:
        return bool(self.sources)


# The kernels, one row each: ``triton_error``, ``SOURCES``, the tuning (``_resolve``) and the report's labels
# follow from this table.
KERNELS: Dict[str, KernelRow] = {r.name: r for r in (
    KernelRow("preprocess", "preprocess", C.PreprocessConfig, reference="preprocess",
              entries=("preprocess_qk", "preprocess_v", "preprocess"), default_launch=C.PREPROCESS_DEFAULT,
              launched=("preprocess_qk", "preprocess")),
    KernelRow("kmeans", "kmeans", reference="kmeans", entries=("kmeans_perm",)),
    KernelRow("vsmooth_attn", "vsmooth_attn", C.VSmoothTritonConfig, ("vsmooth_attn.py",),
              candidates=lambda D, expcast, **_: list(C.VSMOOTH_TRITON_CANDIDATES[(D, bool(expcast))]),
              variant=lambda expcast, qk_fp8, **_: C.vsmooth_triton_variant(expcast, qk_fp8),
              reference="vsmooth_attn", entries=("vsmooth_attention",)),
    KernelRow("vsmooth_attn_sm90", "vsmooth_attn_sm90", C.VSmoothSm90Config,
              ("vsmooth_attn_sm90.py", "vsmooth_attn_sm90_softmax.py", "vsmooth_attn_sm90_steps.py"),
              label="triton/gluon_sm90", core=False,
              replaces="vsmooth_attn", applies=lambda device, qk_format, **_: _sm90_vsmooth_ineligible(device, qk_format),
              candidates=lambda D, expcast, S, **_: list(C.vsmooth_sm90_candidates(D, expcast, S)),
              variant=lambda D, expcast, S, **_: C.vsmooth_sm90_variant(expcast, C.sm90_regime(D, expcast, S)),
              reference="vsmooth_attn", entries=("vsmooth_attention_sm90",),
              ref_names=(("vsmooth_attention_sm90", "vsmooth_attn:vsmooth_attention"),)),
    KernelRow("pddp", "pddp", reference="pddp", entries=("pddp_perm",)),
    KernelRow("select", "select", reference="select", entries=("dense_with_lse", "group_key_mass"),
              ref_names=(("dense_with_lse", "dense:dense_attention_lse"),)),
    KernelRow("sparse_attn", "sparse_attn", C.SparseAttnConfig, ("sparse_attn.py",),
              candidates=lambda fmt, D, C_, **_: list(C.sparse_candidates(fmt, D, C_)),
              variant=lambda fmt, C_, keep, Sk, **_: C.sparse_variant(fmt, C_, keep, Sk),
              reference="sparse_attn", entries=("sparse_attention",)),
    # the Gluon gather kernel: bf16 / fp16 on sm_90 (``sparse_kernel``), its launch per group size (untuned)
    KernelRow("sparse_attn_sm90", "sparse_attn_sm90", C.SparseAttnSm90Config, label="triton/gluon_sm90_gather",
              core=False, reference="sparse_attn", entries=("sparse_attention_sm90",), replaces="sparse_attn",
              applies=lambda q, v, qk_format, group_size, **_: (
                  "16-bit scores only" if qk_format != "bf16" else sm90_gather_ineligible(q, v, group_size)),
              ref_names=(("sparse_attention_sm90", "sparse_attn:sparse_attention"),)),
    KernelRow("finite_flags", "finite_flags", C.FiniteFlagsConfig, reference="finite_flags",
              entries=("finite_flags", "probe_error"), default_launch=C.FINITE_FLAGS_DEFAULT,
              launched=("finite_flags",)),
    KernelRow("anchor_mass", "anchor_mass", C.AnchorMassConfig, reference="anchor_mass",
              entries=("group_key_mass_q8", "anchor_select_q8")),
    KernelRow("topk", "topk", C.TopKConfig, reference="topk", entries=("select_topk",),
              default_launch=C.TOPK_DEFAULT, launched=("select_topk",)),
)}
# base row -> the rows that take over its calls where they apply (``row_for``: asked on every call, so read once)
_SPECIALISED: Dict[str, Tuple[KernelRow, ...]] = {
    base: tuple(r for r in KERNELS.values() if r.replaces == base) for base in {r.replaces for r in KERNELS.values()}
    if base is not None}
# the files whose source keys a tuned kernel's cache entries
SOURCES = {r.name: tuple(os.path.join(_HERE, f) for f in r.sources) for r in KERNELS.values() if r.tuned}


class Impl(str, enum.Enum):
    REFERENCE = "reference"  # reference/<kernel>.py: plain PyTorch, any device
    TRITON = "triton"  # kernels/<kernel>.py (the Gluon kernel among them where it applies)


def kernel_module(name: str):
    """The module of kernel ``name`` (a KERNELS row), imported on first use."""
    return importlib.import_module(f"vc_compile.kernels.{KERNELS[name].module}")


def reference_fn(name: str, entry: str) -> Callable:
    """The plain-PyTorch oracle of entry ``entry`` of kernel ``name`` (its row's ``reference`` module, or the
    ``ref_names`` mapping)."""
    row = KERNELS[name]
    if entry not in row.entries:
        raise ValueError(f"kernel {name!r} has no entry {entry!r} (its row lists {list(row.entries)})")
    module, _, fn = dict(row.ref_names).get(entry, f"{row.reference}:{entry}").partition(":")
    return getattr(importlib.import_module(f"vc_compile.reference.{module}"), fn)


def kernel_fn(name: str, entry: str) -> Callable:
    """The Triton / Gluon entry point ``entry`` of kernel ``name`` (imported on first use)."""
    if entry not in KERNELS[name].entries:
        raise ValueError(f"kernel {name!r} has no entry {entry!r} (its row lists {list(KERNELS[name].entries)})")
    return getattr(kernel_module(name), entry)


def call(name: str, entry: str, impl: "Impl", *args, launch=None, **kw):
    """One call of entry ``entry`` of kernel ``name`` with implementation ``impl``: REFERENCE the oracle (a
    launch config is refused: the reference has none), TRITON the kernel, with ``launch`` or the row's default
    where the entry takes one. The wrappers below are this, plus any tuning of the launch."""
    row = KERNELS[name]
    if impl == Impl.REFERENCE:
        _no_launch(launch)
        return reference_fn(name, entry)(*args, **kw)
    if entry in row.launched:
        kw["launch"] = launch or row.default_launch
    elif launch is not None:
        raise ValueError(f"{name}.{entry} takes no launch config")
    return kernel_fn(name, entry)(*args, **kw)


def implementation(name: str, impl: "Impl", *, device=None, qk_format: str = "int8", launch=None) -> str:
    """The implementation a call of kernel ``name`` with ``impl`` runs, as ``report()`` names it: "reference",
    or the label of the row that runs (the attention: the Gluon sm_90 row where ``vsmooth_kernel`` picks it,
    the same decision ``vsmooth_attention`` makes)."""
    if impl == Impl.REFERENCE:
        return "reference"
    if name == "vsmooth_attn":
        name = vsmooth_kernel(device, qk_format, launch)
    return KERNELS[name].label


# ---- which implementation ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def triton_error() -> Optional[str]:
    """None when every core kernel module of ``KERNELS`` imports, else why not (``"ImportError: ..."``)."""
    try:
        for row in KERNELS.values():
            if row.core:
                importlib.import_module(f"vc_compile.kernels.{row.module}")
    except Exception as e:  # the kernels are missing or failed to import: say so, never silently
        return f"{type(e).__name__}: {e}"
    return None


def fp8_capable(device: torch.device) -> bool:
    """Whether Triton's float8e4nv MMAs run on ``device`` (sm_89+ NVIDIA; the CPU interpreter)."""
    if device.type != "cuda":
        return interpreting()
    if getattr(torch.version, "hip", None):  # Triton's float8e4nv (OCP E4M3 on NVIDIA) is not ROCm's
        return False
    return _capability(device) >= (8, 9)


# NOTE cached: torch.cuda.get_device_capability is slow for a per-call question whose answer never changes;
# docs/design/host-overhead.md
@functools.lru_cache(maxsize=None)
def _capability(device) -> tuple:
    """(major, minor) of a CUDA device (a torch.device or an index; cuda without an index: the current one)."""
    return tuple(torch.cuda.get_device_capability(device))


def choose(method: str, kernels: str, needs_fp8: bool, device: torch.device) -> Tuple[Impl, str]:
    """(implementation, path label for ``report()``) of one call of ``method`` (see the module doc).
    ``kernels``: "auto" | "triton" | "reference" (``VCConfig.experimental.kernels``)."""
    kernels = getattr(kernels, "value", kernels)
    if kernels == "reference":
        return Impl.REFERENCE, "reference"
    fp8_ok = not needs_fp8 or fp8_capable(device)
    if kernels == "triton":
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(f"vcattn: kernels='triton' on a {device.type} tensor needs a CUDA GPU, or "
                               "TRITON_INTERPRET=1 set before triton is imported (tests); or use "
                               "kernels='auto' / 'reference'.")
        if not fp8_ok:
            raise RuntimeError(f"vcattn: kernels='triton' but this GPU has no FP8 tensor cores (needs sm_89+) "
                               f"and {method} with these options uses FP8; use kernels='auto' (the reference, "
                               "slow), method='dense', or for mcsparse sparse_qk='bf16'.")
    elif device.type != "cuda" or not fp8_ok:
        if device.type == "cuda":
            _warn_once(f"vcattn: this GPU has no FP8 tensor cores (needs sm_89+); {method} runs the "
                       "plain-PyTorch reference (slow). Use method='dense' for speed on this GPU.")
        return Impl.REFERENCE, "reference"
    err = triton_error()
    if err is not None:
        if kernels == "triton":
            raise RuntimeError(f"vcattn: kernels='triton' but the {method} Triton kernels failed to "
                               f"load ({err}). Install triton, or use kernels='reference'.")
        _warn_once(f"vcattn: {method} Triton kernels unavailable ({err}); running the reference.")
        return Impl.REFERENCE, f"reference ({err.split(':')[0]})"
    return Impl.TRITON, "triton"


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


# ---- kernels that do not build on this toolchain ------------------------------------------------------------
class KernelBuildError(RuntimeError):
    """No kernel path could be built for a call on this toolchain (the op then runs stock SDPA and reports why)."""


# kernel row -> why it failed to build in this process: a fact of the installed Triton, so a row that failed is
# never tried again (``forget_build_failures`` is for tests)
_BUILD_FAILED: Dict[str, str] = current().build_failures  # (the Runtime's, bound here)
# what replaced each failed row ("the Triton kernel", "stock SDPA"), for ``report()``
_BUILD_FALLBACK: Dict[str, str] = current().build_fallbacks


def build_failure(name: str) -> Optional[str]:
    """Why kernel row ``name`` failed to build in this process, or None."""
    return _BUILD_FAILED.get(name)


def build_failures() -> Dict[str, Tuple[str, str]]:
    """Every failed row: (why, what ran instead)."""
    return {n: (why, _BUILD_FALLBACK.get(n, "stock SDPA")) for n, why in _BUILD_FAILED.items()}


def forget_build_failures() -> None:
    _BUILD_FAILED.clear()
    _BUILD_FALLBACK.clear()


def _build_line() -> Optional[str]:
    """The kernels that did not build on the installed Triton and what ran instead (``kernels/dispatch.py``),
    and an untested toolchain; None where every kernel built (or none was tried: nothing here imports triton)."""
    from vc_compile import toolchain

    failed = build_failures()
    parts = [f"{name} ({why}) -> {to}" for name, (why, to) in failed.items()]
    line = f"kernels that did not build on Triton {toolchain.triton_version()}: {'; '.join(parts)}" if parts else None
    untested = toolchain.untested_reason()
    sm90 = sys.modules.get("vc_compile.kernels.vsmooth_attn_sm90")
    clamp = sm90.BYTEMASK_GUARD.summary() if sm90 is not None else None
    return "; ".join(x for x in (line, untested, clamp) if x) or None


_report.line_source("builds", _build_line)


# Triton's ``DependenciesFinder`` (``triton/runtime/jit.py``): what walks a kernel's source before it compiles
_JIT_SOURCE_READERS = frozenset({"record_reference", "visit_Name", "visit_Attribute", "visit_Call", "cache_key",
                                 "_get_config", "visit_Assign", "visit_FunctionDef"})


def is_build_error(e: BaseException) -> bool:
    """Whether ``e`` is a kernel failing to build (not a kernel failing to run): Triton's compile errors, a kernel
    that does not fit the GPU, ptxas failing, or any error raised inside Triton's compiler (an MLIR pass, a Gluon
    API the installed Triton lacks)."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources, PTXASError
        if isinstance(e, (CompilationError, OutOfResources, PTXASError)):
            return True
    except ImportError:
        pass
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        name = code.co_filename.replace(os.sep, "/")
        if "/triton/compiler/" in name or ("/triton/backends/" in name and name.endswith("/compiler.py")):
            return True
        # the JIT reading a kernel's source for its cache key (a name that is no kernel or builtin of this Triton)
        if name.endswith("/triton/runtime/jit.py") and code.co_name in _JIT_SOURCE_READERS:
            return True
        # a kernel module that does not import on this Triton (a Gluon name it lacks)
        if isinstance(e, (ImportError, AttributeError)) and "importlib._bootstrap" in name:
            return True
        tb = tb.tb_next
    return False


def _why(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # Triton's CompilationError text is the source excerpt, its last line the cause
    return f"{type(e).__name__}: {(lines[-1] if lines else '')[:200]}"


def built(name: str, fn: Callable, *args, **kw):
    """``fn(*args, **kw)``, a call of kernel row ``name``; a build failure marks the row failed for the process and
    raises ``KernelBuildError`` (as does any later call of the row). Other errors propagate unchanged."""
    why = _BUILD_FAILED.get(name)
    if why is not None:
        raise KernelBuildError(f"{name}: {why}")
    try:
        return fn(*args, **kw)
    except KernelBuildError:
        raise
    except Exception as e:
        if not is_build_error(e):
            raise
        _BUILD_FAILED[name] = _why(e)
        raise KernelBuildError(f"{name}: {_BUILD_FAILED[name]}") from e


def method_build_failure(method: str) -> Optional[str]:
    """The report reason of a method whose kernels did not build in this process (its calls run stock SDPA), or
    None."""
    return _BUILD_FAILED.get(f"method:{method}")


def method_failed(method: str, e: BaseException) -> Optional[str]:
    """Where ``e`` (raised by a call of ``method``'s kernels) is a build failure: mark the method failed for the
    process, warn once (the Triton version and the fix) and return the report reason; else None."""
    if not isinstance(e, KernelBuildError) and not is_build_error(e):
        return None
    key = f"method:{method}"
    if key not in _BUILD_FAILED:
        _BUILD_FAILED[key] = f"kernel build failed: {_why(e) if not isinstance(e, KernelBuildError) else str(e)}"
        _fell_back(key, "stock SDPA", f"{method} kernels")
    return _BUILD_FAILED[key]


def _fell_back(name: str, to: str, label: str) -> None:
    """Record what replaced a failed row, and warn (the Triton version, what runs instead, the fix) once per
    process and tier: the first Gluon kernel that fails (others are listed by ``report()``), and the first method
    whose kernels fail."""
    from vc_compile import toolchain
    tier = "method" if name.startswith("method:") else "gluon"
    warned = any(n.startswith("method:") == (tier == "method") for n in _BUILD_FALLBACK)
    _BUILD_FALLBACK[name] = to
    if warned:
        return
    warnings.warn(f"vcattn: the {label} did not build on Triton {toolchain.triton_version()} "
                  f"({_BUILD_FAILED.get(name)}); {to} runs instead, slower. {toolchain.fix()}.", RuntimeWarning,
                  stacklevel=4)


# ---- eligibility (the kernels' limits; the reference runs any shape) ----------------------------------------
def vsmooth_ineligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why the 8-bit kernels cannot run these inputs (the op then runs stock SDPA and records it), or None."""
    D, Dv = q.shape[-1], v.shape[-1]
    if C.vsmooth_head_dim_error(D) or Dv != D:
        return "head_dim unsupported by the 8-bit kernels (64 or 128)"
    if q.shape[2] != k.shape[2]:
        return "cross-attention (Sq != Sk) unsupported by the 8-bit kernels"
    # NOTE on sm_90 one key gave a non-finite output (naive 8-bit, D = 128; every mode after a grouping;
    # tests/test_hostile.py) where SDPA returns v; 2 keys and more were finite. Not root-caused: such a call runs
    # stock SDPA.
    if k.shape[2] < 2:
        return "a single key: the 8-bit kernels need 2 or more"
    return None


def sparse_ineligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why the sparse kernels cannot run these inputs, or None."""
    if any(C.pow2_head_dim_error(d) for d in (q.shape[-1], v.shape[-1])):
        return "head_dim unsupported by the sparse kernels (power of two in [16, 256])"
    return None


# ---- tuning ------------------------------------------------------------------------------------------------
def candidates(kernel: str, **shape) -> List:
    """The tuner's candidates of a tuned kernel for one call's shape keywords (first = the measured default)."""
    row = KERNELS[kernel]
    if not row.tuned:
        raise ValueError(f"kernel {kernel!r} is not tuned (no sources in dispatch.KERNELS)")
    return row.candidates(**shape)


def _resolve(kernel: str, launch_fn: Callable, *, dtype, head_dim: int, seq_len: int, device: torch.device,
             **shape):
    """The launch config of one call of a tuned kernel (a KERNELS row with sources): ``tune.resolve`` over the
    row's candidates for ``shape``, keyed by the row's variant, as a config object of the row's class."""
    row = KERNELS[kernel]
    cls = row.config
    items = tuple(sorted(shape.items()))
    cands, variant = _candidates_json(kernel, items)

    def launch(d):
        return launch_fn(cls.from_json(d))
    tunable = device.type == "cuda" and not interpreting()
    d, _ = tune.resolve(kernel, list(SOURCES[kernel]), list(cands), dtype=dtype, head_dim=head_dim,
                        seq_len=seq_len, variant=variant, device=device, tunable=tunable,
                        bench=tune.validated_bench(launch) if tunable else None)
    return _config_of(kernel, tuple(sorted(d.items())))


# NOTE memoised: ``_resolve`` built the candidates, converted them to JSON and the answer back (~10 dataclass
# round trips) on every call, more host time than the lookup itself; docs/design/host-overhead.md
@functools.lru_cache(maxsize=1024)
def _candidates_json(kernel: str, items: tuple) -> Tuple[tuple, str]:
    """(the candidates as JSON dicts, the tuning key's variant) of a tuned kernel for these shape keywords."""
    shape = dict(items)
    return tuple(c.to_json() for c in candidates(kernel, **shape)), KERNELS[kernel].variant(**shape)


@functools.lru_cache(maxsize=1024)
def _config_of(kernel: str, items: tuple):
    return KERNELS[kernel].config.from_json(dict(items))


# ---- V-Smooth ----------------------------------------------------------------------------------------------
def quant_reading(q, k, v, qk_format: str, hadamard: bool):
    """What the 8-bit codes would lose at a call site (``reference/quant_check.read``, on any device): the reference
    arithmetic is the model of the kernels' quantisation there, on a small sample, whichever path then runs."""
    from vc_compile.reference import quant_check
    return quant_check.read(q, k, v, qk_format, hadamard)


def preprocess_qk(impl: Impl, q, k, perm=None, *, sm_scale: float, hadamard: bool = False, qk_format: str = "int8",
                  rope=None, launch: Optional[C.PreprocessConfig] = None):
    """QKQuant of q, k (reference/preprocess.py's contract); ``rope``: q, k un-rotated (prologue fusion)."""
    return call("preprocess", "preprocess_qk", impl, q, k, perm, sm_scale=sm_scale, hadamard=hadamard,
                qk_format=qk_format, rope=rope, launch=launch)


def preprocess_v(impl: Impl, v, perm=None, *, smooth: bool = True):
    """VQuant of v (reference/preprocess.py's contract)."""
    return call("preprocess", "preprocess_v", impl, v, perm, smooth=smooth)


def vsmooth_v_layout(device: torch.device, qk_format: str, D: int, expcast: bool, S: int) -> str:
    """The VQuant layout the attention of these inputs reads without a conversion: "sm90" where the Gluon kernel
    runs with register P~ (its measured default for the shape), else "natural". NOTE a tuned or shipped
    config that disagrees with the default still runs right: the kernel converts the layout (one more pass)."""
    if not uses_sm90(device, qk_format):
        return "natural"
    cfg = C.vsmooth_sm90_default(D, expcast, S)
    return "sm90" if cfg.p_operand == C.POperand.REGISTERS else "natural"


def preprocess(impl: Impl, q, k, v, perm=None, *, sm_scale: float, hadamard: bool = False, qk_format: str = "int8",
               smooth: bool = True, expcast: bool = False, rope=None, launch: Optional[C.PreprocessConfig] = None):
    """(QKQuant, VQuant) of q, k, v for ``vsmooth_attention`` (reference/preprocess.py's contract): TRITON runs
    the two-launch preprocessing (kernels/preprocess.py) and writes V in the layout the attention kernel
    reads (``vsmooth_v_layout``); REFERENCE the plain-PyTorch oracle ("natural" layout)."""
    if impl == Impl.REFERENCE:  # the "natural" layout
        return call("preprocess", "preprocess", impl, q, k, v, perm, sm_scale=sm_scale, hadamard=hadamard,
                    qk_format=qk_format, smooth=smooth, rope=rope, launch=launch)
    layout = vsmooth_v_layout(q.device, qk_format, q.shape[-1], expcast, k.shape[2])
    # the sm_90 kernel's shared-memory-P~ path reads mu' too: written here, not divided eagerly per call
    mu_prime = layout == "natural" and smooth and uses_sm90(q.device, qk_format)
    return call("preprocess", "preprocess", impl, q, k, v, perm, sm_scale=sm_scale, hadamard=hadamard,
                qk_format=qk_format, smooth=smooth, rope=rope, v_layout=layout, mu_prime=mu_prime, launch=launch)


def kmeans_perm(impl: Impl, x, n_clusters: int, n_iters: int, init=None, sample: int = 1):
    """k-means of the rows of x per (b, h) -> KMeansResult(perm, centroids, labels); the iterations see
    every ``sample``-th row."""
    return call("kmeans", "kmeans_perm", impl, x, n_clusters, n_iters, init=init, sample=sample)


def row_for(base: str, launch=None, **call) -> str:
    """The row a TRITON call of kernel ``base`` runs: a row that ``replaces`` it where it ``applies`` to the call and
    built on this Triton (a launch config of its own picks it, whatever the call), else ``base``."""
    for row in _SPECIALISED.get(base, ()):
        if launch is not None:
            if isinstance(launch, row.config):
                return row.name
        elif row.name not in _BUILD_FAILED and row.applies(**call) is None:
            return row.name
    return base


def _sm90_vsmooth_ineligible(device: torch.device, qk_format: str) -> Optional[str]:
    if qk_format != "int8":
        return "FP8 Q/K (the Gluon kernel takes INT8)"
    return None if _on_sm90(device) else "not an sm_90 GPU"


def uses_sm90(device: torch.device, qk_format: str) -> bool:
    """Whether ``vsmooth_attention`` (TRITON, no launch config) runs the Gluon sm_90 kernel for these inputs (not
    where it failed to build: then the Triton kernel)."""
    return vsmooth_kernel(device, qk_format) == "vsmooth_attn_sm90"


def _on_sm90(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU the compiled kernels run on (not under the interpreter)."""
    if device.type != "cuda" or interpreting():
        return False
    return _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


def _is_sm90(index: int) -> bool:
    return _capability(index) == (9, 0)


def vsmooth_kernel(device: torch.device, qk_format: str, launch=None) -> str:
    """The tuning-table name of the attention kernel a TRITON call runs: "vsmooth_attn_sm90" (Gluon) or
    "vsmooth_attn" (Triton)."""
    return row_for("vsmooth_attn", launch, device=device, qk_format=qk_format)


def vsmooth_label(device: torch.device, qk_format: str) -> str:
    """The kernel path ``report()`` records for a TRITON ``vsmooth_attention`` call (no launch config): the row
    label of the kernel ``vsmooth_kernel`` picks, the same decision the call makes."""
    return implementation("vsmooth_attn", Impl.TRITON, device=device, qk_format=qk_format)


def vsmooth_candidates(kernel: str, D: int, expcast: bool, S: int) -> List:
    """The tuner's candidates of ``kernel`` for this shape (first = the measured default)."""
    return candidates(kernel, D=D, expcast=expcast, S=S)


def vsmooth_attention(impl: Impl, qk, vq, *, expcast: bool = False, out_dtype=torch.bfloat16,
                      return_lse: bool = False, launch=None):
    """8-bit attention of a QKQuant / VQuant: O [B, H, S, D] (and the base-2 LSE of the smoothed logits)."""
    if impl == Impl.REFERENCE:
        _no_launch(launch)
        return call("vsmooth_attn", "vsmooth_attention", impl, qk, vq, expcast=expcast, out_dtype=out_dtype,
                    return_lse=return_lse)
    kernel_module("vsmooth_attn").check_inputs(qk, vq)  # a clear error before any table is read
    fmt = "fp8" if qk.q8.dtype == torch.float8_e4m3fn else "int8"
    kernel = vsmooth_kernel(qk.q8.device, fmt, launch)
    if kernel == "vsmooth_attn_sm90":
        try:
            return built(kernel, _vsmooth_run, kernel, qk, vq, expcast, out_dtype, return_lse, launch)
        except KernelBuildError:
            if launch is not None:  # a launch config that names the Gluon kernel: no other kernel takes it
                raise
            _fell_back(kernel, "the Triton kernel", "Gluon sm_90 V-Smooth kernel")
            kernel = "vsmooth_attn"
    return built(kernel, _vsmooth_run, kernel, qk, vq, expcast, out_dtype, return_lse, launch)


def _vsmooth_run(kernel, qk, vq, expcast, out_dtype, return_lse, launch):
    """One call of V-Smooth attention kernel ``kernel`` (its launch tuned where none is given)."""
    B, H, S, D = qk.q8.shape
    sm90 = kernel == "vsmooth_attn_sm90"
    run = kernel_fn(kernel, "vsmooth_attention_sm90" if sm90 else "vsmooth_attention")
    if launch is None:
        shape = dict(S=S) if sm90 else dict(qk_fp8=qk.q8.dtype == torch.float8_e4m3fn)
        launch = _resolve(kernel, lambda c: run(qk, vq, expcast=expcast, out_dtype=out_dtype,
                                                return_lse=return_lse, launch=c),
                          dtype=out_dtype, head_dim=D, seq_len=S, device=qk.q8.device, D=D, expcast=expcast, **shape)
    return run(qk, vq, expcast=expcast, out_dtype=out_dtype, return_lse=return_lse, launch=launch)


# ---- MC-Sparse ---------------------------------------------------------------------------------------------
def pddp_perm(impl: Impl, q, group_size: int):
    """sigma [B, H, S] int64: query order whose consecutive ``group_size`` chunks are the Fast PDDP groups."""
    return call("pddp", "pddp_perm", impl, q, group_size)


def dense_with_lse(impl: Impl, q, k, v, sm_scale: float):
    """Pass 1: dense attention and its base-2 LSE [B, H, S] fp32 (reference/dense.py's convention)."""
    return call("select", "dense_with_lse", impl, q, k, v, sm_scale=sm_scale)


def group_key_mass(impl: Impl, q, k, sigma, lse2, *, sm_scale: float, group_size: int):
    """Pass 2: mass [B, H, G, Sk] fp32, exact probabilities summed over each query group."""
    return call("select", "group_key_mass", impl, q, k, sigma, lse2, sm_scale=sm_scale, group_size=group_size)


def sparse_candidates(qk_format: str, D: int, C_: int) -> List:
    return candidates("sparse_attn", fmt=qk_format, D=D, C_=C_)


def sparse_kernel(q, v, qk_format: str, group_size: int, launch=None) -> str:
    """The gather kernel a TRITON ``sparse_attention`` call runs: "sparse_attn_sm90" (the warp-specialised Gluon
    kernel) on an sm_90 GPU for bf16 / fp16 scores (``qk_format="bf16"``) with head dims 64 / 128 and C = 64 /
    128, "sparse_attn" (Triton) otherwise; a launch config picks its kernel."""
    return row_for("sparse_attn", launch, q=q, v=v, qk_format=qk_format, group_size=group_size)


def sm90_gather_ineligible(q, v, group_size: int) -> Optional[str]:
    """Why the Gluon sm_90 gather kernel cannot take a call (device, group size, dtype, head dims), or None."""
    if int(group_size) not in (64, 128) or q.dtype not in (torch.bfloat16, torch.float16):
        return f"group_size {group_size} / dtype {q.dtype} (needs 64 or 128, bf16 or fp16)"
    if q.shape[-1] not in (64, 128) or v.shape[-1] not in (64, 128):
        return f"head dims {q.shape[-1]} / {v.shape[-1]} (need 64 or 128)"
    if not _on_sm90(q.device):
        return "this is not an sm_90 GPU"
    if "sparse_attn_sm90" in _BUILD_FAILED:
        return f"it did not build on this Triton ({_BUILD_FAILED['sparse_attn_sm90']})"
    return None


def sparse_int8_ineligible(q, v, group_size: int, launch=None) -> Optional[str]:
    """Why a TRITON ``sparse_attention`` call with ``qk_format="int8"`` cannot run (only the sm_90 Gluon gather
    kernel has 8-bit QK), or None."""
    if launch is not None and not isinstance(launch, C.SparseAttnSm90Config):
        return f"the launch {type(launch).__name__} is the Triton gather kernel's"
    return sm90_gather_ineligible(q, v, group_size)


def sparse_label(q, v, qk_format: str, group_size: int) -> str:
    """The kernel path ``report()`` records for a TRITON ``sparse_attention`` call (no launch config): the row
    label of the kernel ``sparse_kernel`` picks."""
    if qk_format == "int8":
        return KERNELS["sparse_attn_sm90"].label + "+int8_qk"
    return KERNELS[sparse_kernel(q, v, qk_format, group_size)].label


def sparse_attention(impl: Impl, q, k, v, sigma, idx, *, sm_scale: float, group_size: int, residual=None,
                     out_dtype=None, qk_format: str = "bf16", launch=None, k_fp8=None, flag=None, run: int = 1,
                     res_scale=None):
    """Token-gather sparse attention (reference/sparse_attn.py; ``qk_format="fp8"``: reference/sparse_attn_q8.py):
    [B, H, S, Dv] in ``out_dtype`` (default q.dtype), original query order; ``flag`` [B, H, Dv] int32
    (``finite_flags``): NaN in the flagged columns; ``run``: idx holds run numbers of aligned runs of ``run`` keys;
    ``res_scale``: the per-token scale of a residual of 8-bit codes (int8 / FP8).
    TRITON: the kernel of ``sparse_kernel`` (``launch``: a
    ``SparseAttnConfig`` or ``SparseAttnSm90Config``, which picks its kernel); the Triton kernel's launch is tuned
    (without ``flag``: one epilogue select), the Gluon kernel's is its default per group size."""
    if impl == Impl.REFERENCE:
        _no_launch(launch)
        q8 = importlib.import_module("vc_compile.reference.sparse_attn_q8")
        if qk_format == "int8":  # the sm_90 kernel's contract: per-head int8 K, per-row int8 Q
            k8, ks = q8.quantize_k_int8_head(k)
            return q8.sparse_attention_qk8(q, k8, ks, v, sigma, idx, sm_scale=sm_scale, group_size=group_size,
                                           residual=residual, out_dtype=out_dtype, flag=flag, run=run,
                                           res_scale=res_scale)
        # FP8 QK has an oracle of its own (the FP8 rounding of q and k before the scores)
        fn = q8.sparse_attention_q8 if qk_format == "fp8" else reference_fn("sparse_attn", "sparse_attention")
        return fn(q, k, v, sigma, idx, sm_scale=sm_scale, group_size=group_size, residual=residual,
                  out_dtype=out_dtype, flag=flag, run=run, res_scale=res_scale)
    if qk_format == "int8":
        why = sparse_int8_ineligible(q, v, group_size, launch)
        if why:
            err = KernelBuildError if "sparse_attn_sm90" in _BUILD_FAILED else RuntimeError
            raise err(f"vcattn: sparse_qk='int8' runs only on the sm_90 gather kernel, and {why}; use "
                      "sparse_qk='bf16' (the default) or 'fp8'.")
        k8, ks = built("sparse_attn", kernel_module("sparse_attn").quantize_k_int8_head, k)
        return built("sparse_attn_sm90", lambda: kernel_fn("sparse_attn_sm90", "sparse_attention_sm90")(
            q, k8, v, sigma, idx, sm_scale=sm_scale, group_size=group_size, residual=residual, out_dtype=out_dtype,
            flag=flag, launch=launch, k_scale=ks, run=run, res_scale=res_scale))
    if sparse_kernel(q, v, qk_format, group_size, launch) == "sparse_attn_sm90":
        try:
            return built("sparse_attn_sm90", lambda: kernel_fn("sparse_attn_sm90", "sparse_attention_sm90")(
                q, k, v, sigma, idx, sm_scale=sm_scale, group_size=group_size, residual=residual, out_dtype=out_dtype,
                flag=flag, launch=launch, run=run, res_scale=res_scale))
        except KernelBuildError:
            if launch is not None:
                raise
            _fell_back("sparse_attn_sm90", "the Triton gather kernel", "Gluon sm_90 gather kernel")
    return built("sparse_attn", _sparse_triton, q, k, v, sigma, idx, sm_scale, group_size, residual, out_dtype,
                 qk_format, launch, k_fp8, flag, run, res_scale)


def _sparse_triton(q, k, v, sigma, idx, sm_scale, group_size, residual, out_dtype, qk_format, launch, k_fp8, flag,
                   run=1, res_scale=None):
    """One call of the Triton gather kernel (its launch tuned where none is given)."""
    kmod = kernel_module("sparse_attn")
    if launch is None:
        fmt = "fp8" if qk_format == "fp8" else "bf16"
        if fmt == "fp8" and k_fp8 is None:  # once, not once per tuning candidate
            k_fp8 = kmod.quantize_k_fp8(k if k.stride(-1) == 1 else k.contiguous())
        D, Sk, keep = q.shape[3], k.shape[2], idx.shape[3] * run
        launch = _resolve("sparse_attn",
                          lambda c: kmod.sparse_attention(q, k, v, sigma, idx, sm_scale=sm_scale, group_size=group_size,
                                                          residual=residual, out_dtype=out_dtype, qk_format=fmt,
                                                          launch=c, k_fp8=k_fp8, run=run, res_scale=res_scale),
                          dtype=q.dtype, head_dim=D, seq_len=q.shape[2], device=q.device, fmt=fmt, D=D,
                          C_=int(group_size), keep=keep, Sk=Sk)
    return kmod.sparse_attention(q, k, v, sigma, idx, sm_scale=sm_scale, group_size=group_size, residual=residual,
                                 out_dtype=out_dtype, qk_format=qk_format, launch=launch, k_fp8=k_fp8, flag=flag,
                                 run=run, res_scale=res_scale)


def finite_flags(impl: Impl, k, v, probe=None, *, launch: Optional[C.FiniteFlagsConfig] = None):
    """(flag [B, H, Dv] int32, probe partials or None) of one reuse step (reference/finite_flags.py);
    ``probe = (q, rows [B, H, R], sm_scale)``: also the exact output of the sampled rows (the MC-Sparse guard).
    The partials are opaque: pass them to ``probe_error`` with the same ``impl``."""
    return call("finite_flags", "finite_flags", impl, k, v, probe=probe, launch=launch)


def probe_error(impl: Impl, out, rows, partials):
    """[2] fp32 on out's device: (sum ||out[row] - exact[row]||^2, sum ||exact[row]||^2) over the sampled rows
    (``partials`` from ``finite_flags`` with the same ``impl``)."""
    return call("finite_flags", "probe_error", impl, out, rows, partials)


def select_topk(mass, keep: int):
    """idx [..., keep] int32: the ``keep`` largest masses per row, ascending: torch on every device (no kernel
    row; the radix-select kernel is ``topk``)."""
    return torch_ops.select_topk(mass, keep)


# ---- MC-Sparse cheap anchor (methods/anchor.py) ---------------------------------------------------
def _no_launch(*launches) -> None:
    if any(x is not None for x in launches):
        raise ValueError("a launch config selects a kernel; the reference has none")


def anchor_mass_launch(group_size: int, exp: C.ExpMode, launch: Optional[C.AnchorMassConfig] = None):
    """The pass-2 launch of one call: ``launch`` (its ``exp`` must be ``exp``) or the default for the group size."""
    exp = C.ExpMode(exp)
    if launch is None:
        return C.anchor_mass_default(group_size, exp)
    if launch.exp != exp:
        raise ValueError(f"anchor mass: launch.exp={launch.exp.value!r} but exp={exp.value!r}; pass one exp mode")
    return launch


def group_key_mass_q8(impl: Impl, qk, lse_s, sigma, *, group_size: int, key_perm=None, exp=C.ExpMode.SHIFT,
                      mass_dtype=torch.float32, launch: Optional[C.AnchorMassConfig] = None):
    """Pass 2 on pass 1's INT8 codes: mass [B, H, G, Sk] in original key order (reference/anchor_mass.py)."""
    if impl == Impl.REFERENCE:  # the oracle takes the exp mode by value; the kernel its launch config
        return call("anchor_mass", "group_key_mass_q8", impl, qk, lse_s, sigma, group_size=group_size,
                    key_perm=key_perm, exp=C.ExpMode(exp).value, mass_dtype=mass_dtype, launch=launch)
    return kernel_fn("anchor_mass", "group_key_mass_q8")(qk, lse_s, sigma, group_size=group_size, key_perm=key_perm,
                                                         launch=anchor_mass_launch(group_size, exp, launch),
                                                         mass_dtype=mass_dtype)


def anchor_select_q8(impl: Impl, qk, lse_s, sigma, *, group_size: int, keep: int, key_perm=None,
                     exp=C.ExpMode.SHIFT, mass_dtype=torch.bfloat16, max_mass_bytes: int = 1 << 30,
                     launch: Optional[C.AnchorMassConfig] = None, topk_launch: Optional[C.TopKConfig] = None,
                     run: int = 1):
    """Pass 2 on the INT8 codes + top-K, a chunk of heads at a time: idx [B, H, G, keep / run] int32 ascending (key
    ids, or with ``run`` > 1 the top runs of ``run`` keys by summed mass, ``torch_ops.run_mass``)."""
    if impl == Impl.REFERENCE:
        _no_launch(topk_launch)
        return call("anchor_mass", "anchor_select_q8", impl, qk, lse_s, sigma, group_size=group_size, keep=keep,
                    key_perm=key_perm, exp=C.ExpMode(exp).value, mass_dtype=mass_dtype,
                    max_mass_bytes=max_mass_bytes, launch=launch, run=run)
    return kernel_fn("anchor_mass", "anchor_select_q8")(
        qk, lse_s, sigma, group_size=group_size, keep=keep, key_perm=key_perm,
        launch=anchor_mass_launch(group_size, exp, launch), topk_launch=topk_launch or C.TOPK_DEFAULT,
        mass_dtype=mass_dtype, max_mass_bytes=max_mass_bytes, run=run)


def topk(impl: Impl, mass, keep: int, launch: Optional[C.TopKConfig] = None):
    """idx [..., keep] int32: the ``keep`` largest masses per row, ties lowest index first, ascending
    (reference/topk.py; TRITON: the radix select of kernels/topk.py)."""
    return call("topk", "select_topk", impl, mass, keep, launch=launch)
