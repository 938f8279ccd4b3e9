"""Shared benchmark harness: timing, baselines, accuracy metrics and the results CSV.

Every benchmark prints a table side by side with the baselines measured in the same run and appends its
rows to ``benchmarks/results/<bench>.csv`` with the agreed columns (extra columns may follow). Each row
also carries what NVML says about the GPU (``GPU_COLUMNS``: the board's UUID, driver, memory, power limit
and maximum clocks, and its clocks, temperature, power draw and clock-event reasons when the row was
written: they explain noisy runs); a file whose header lacks a column a row brings is rewritten with the
column added at the end (older rows leave it empty).

Benchmarks are modules of the ``benchmarks`` package, run from the repository root:
``python -m benchmarks.bench_vsmooth_attn`` (no ``sys.path`` edits).
"""
from __future__ import annotations

import functools

import contextlib
import csv
import datetime
import importlib
import importlib.util
import math
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from vc_compile import nvml
from vc_compile.table import fmt_cell, format_table

COLUMNS = ["date", "commit", "gpu", "torch", "triton", "bench", "variant", "B", "H", "S", "D",
           "density", "ms", "tflops", "speedup_vs_cudnn", "rel_l2", "cos_sim"]
GPU_COLUMNS = list(nvml.LIMIT_FIELDS + nvml.STATE_FIELDS)  # after a benchmark's own extras
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def env_info() -> Dict[str, str]:
    """Date (UTC), commit, GPU, torch and triton versions for a results row. ``VC_COMMIT`` wins over git:
    the device machine's copy of ``.git`` can lag behind the working tree it was sent (a row there once
    named an earlier commit instead of the one that ran)."""
    commit = os.environ.get("VC_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                             cwd=os.path.dirname(os.path.abspath(__file__)),
                                             stderr=subprocess.DEVNULL).strip()
            dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                            text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                                            stderr=subprocess.DEVNULL).strip()
            commit += "-dirty" if dirty else ""
        except Exception:  # noqa: BLE001 - no git on the benchmark box
            commit = "unknown"
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "commit": commit, "gpu": gpu, "torch": torch.__version__, "triton": tv, **gpu_info()}


def gpu_info() -> Dict[str, object]:
    """NVML's view of the current CUDA device for a results row ({} on a CPU or without NVML)."""
    if not torch.cuda.is_available():
        return {}
    index = torch.cuda.current_device()
    return {**(nvml.limits(index) or {}), **nvml.state(index)}


def bench_ms(fn: Callable[[], object], warmup: int = 50, rep: int = 200) -> float:
    """Median time in ms (triton.testing.do_bench on CUDA, a wall clock otherwise)."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    import time

    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[1]


def attn_flops(B, H, Sq, Sk, D) -> float:
    return 4.0 * B * H * Sq * Sk * D


def metrics(out: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    o, r = out.double().flatten(), ref.double().flatten()
    err = o - r
    return {"rel_l2": (err.norm() / r.norm()).item(),
            "cos_sim": F.cosine_similarity(o, r, dim=0).item(),
            "rel_l1": (err.abs().sum() / r.abs().sum()).item(),
            "rmse": err.pow(2).mean().sqrt().item(),
            "sqnr_db": (20 * torch.log10(r.norm() / err.norm().clamp_min(1e-30))).item()}


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                        "math": SDPBackend.MATH}[name])


def sdpa_fn(q, k, v, backend: str):
    def run():
        with sdpa_backend(backend):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def prefer_cudnn():
    """SDPA backend priority cuDNN > flash > efficient > math for everything inside, compiled graphs
    included (runtime dispatch): the stock baseline's attention is cuDNN's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # older torch without set_priority: allow all, default order
        return sdpa_kernel(order)


def truth_rows(q, k, v, rows):
    """fp32 attention output of the sampled query rows [B, H, n, D] (q, k, v: [B, H, S, D]), one head at a time."""
    from vc_compile.demo.capture import truth_rows as rows_fp32
    return rows_fp32(q, k, v, rows)


def sage_fn(q, k, v) -> Optional[Callable]:
    """sageattention 1.0.6 (Triton, INT8 QK, fp16 PV) when installed, else None."""
    try:
        from sageattention import sageattn
    except Exception:
        return None
    return lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False)


_FA4: Optional[tuple] = None


def fa4_status() -> tuple:
    """``(flash_attn_func or None, one-line note)``: FlashAttention-4 (CuTe DSL; bf16, [B, S, H, D]) when
    ``flash_attn.cute`` imports and a sm_90+ GPU is present. Optional: never a requirement of the package
    (the sm_90 forward is bf16/fp16 only)."""
    global _FA4
    if _FA4 is None:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
            _FA4 = (None, "fa4-bf16 skipped: needs a sm_90+ CUDA GPU")
        else:
            try:
                from flash_attn.cute import flash_attn_func
                _FA4 = (flash_attn_func, "fa4-bf16: flash_attn.cute.flash_attn_func")
            except Exception as e:  # noqa: BLE001 - not installed / CuTe DSL missing
                _FA4 = (None, f"fa4-bf16 skipped: flash_attn.cute not importable ({type(e).__name__}: "
                              f"{str(e)[:120]}); install flash-attn-4 with its CUDA 13 dependencies")
    return _FA4


def fa4_sdpa_shim() -> Optional[str]:
    """Let torch's FA4 flash-SDPA glue call this flash-attn-4. torch 2.11 / 2.13 (``torch.nn.attention._fa4``)
    unpack ``flash_attn.cute.interface._flash_attn_fwd(...)`` as ``(out, lse)``; flash-attn-4 4.0.0b36 returns
    five values (out, lse and three None / debug outputs), so every FA4 SDPA call raised "too many values to
    unpack" (H200, torch 2.11). The benchmark wraps the function to return the first two, as the FA3 shim
    lets torchao find the fa3-fwd wheel; the kernel and its arguments are untouched. Returns a note when it
    wrapped, None when nothing needed wrapping or FA4 is absent."""
    try:
        import flash_attn.cute.interface as fi
    except Exception:  # noqa: BLE001 - flash-attn-4 absent: the caller reports that
        return None
    fwd = fi._flash_attn_fwd
    if getattr(fwd, "_vc_two_outputs", False):
        return "flash_attn.cute.interface._flash_attn_fwd wrapped to return (out, lse) for torch's FA4 glue"

    @functools.wraps(fwd)  # its attributes too: torch's glue reads ``_flash_attn_fwd.compile_cache``
    def two_outputs(*args, **kwargs):
        r = fwd(*args, **kwargs)
        return tuple(r[:2]) if isinstance(r, tuple) and len(r) > 2 else r
    two_outputs._vc_two_outputs = True
    fi._flash_attn_fwd = two_outputs
    return "flash_attn.cute.interface._flash_attn_fwd wrapped to return (out, lse) for torch's FA4 glue"


def fa4_fn(q, k, v) -> Optional[Callable]:
    """FA4 bf16 on [B, H, S, D] inputs (any strides) as a no-argument callable returning [B, H, S, D],
    or None (see :func:`fa4_status`). FA4 takes [B, S, H, D]: inputs that are permuted views of a
    [B, S, H, D] tensor (the model's layout) are passed as they are; others are copied once, here, so the
    callable times the kernel alone, like ``sdpa_fn``."""
    func, _ = fa4_status()
    if func is None or q.dtype != torch.bfloat16:
        return None
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    qs, ks, vs = (t if t.is_contiguous() else t.contiguous() for t in (qs, ks, vs))

    def run():
        out = func(qs, ks, vs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.transpose(1, 2)
    return run


# ---- FP8 baselines: FlashAttention-3's FP8 forward (the fa3-fwd wheel) and torchao's FP8 SDPA ---------------
# Both are optional: without the packages or a sm_90 GPU their status is (None, why) and the rows are skipped.
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_FA3: Optional[tuple] = None
_TORCHAO: Optional[tuple] = None
_SHIMMED: Dict[str, object] = {}  # module names the FA3 shim aliased -> the torch.library fragment it made


def _hopper_missing(name: str) -> Optional[str]:
    """Why ``name`` (an FA3 FP8 baseline) can not run here, or None on a sm_90 GPU (FA3 is Hopper-only)."""
    if not torch.cuda.is_available():
        return f"{name} skipped: needs a sm_90 (Hopper) CUDA GPU, none here"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return f"{name} skipped: FA3 runs on sm_90 (Hopper) only, this GPU is sm_{cap[0]}{cap[1]}"
    return None


def _fa3_fp8_import() -> Callable:
    """``fa3_fwd_interface.flash_attn_func`` (raises when the fa3-fwd wheel is absent or does not load)."""
    from fa3_fwd_interface import flash_attn_func
    return flash_attn_func


def fa3_fp8_status() -> tuple:
    """``(flash_attn_func or None, one-line note)``: FlashAttention-3's FP8 (e4m3) forward from the fa3-fwd
    wheel (module ``fa3_fwd_interface``; [B, S, H, D] q, k, v with [B, H_kv] fp32 descales) when it imports
    and a sm_90 GPU is present. Optional: never a requirement of the package."""
    global _FA3
    if _FA3 is None:
        why = _hopper_missing("fa3-fp8")
        if why is not None:
            _FA3 = (None, why)
        else:
            try:
                _FA3 = (_fa3_fp8_import(), "fa3-fp8: fa3_fwd_interface.flash_attn_func, FP8 e4m3 q/k/v with "
                                           "per-(batch, head) descales (amax / 448)")
            except Exception as e:  # noqa: BLE001 - not installed / built for another torch or CUDA
                _FA3 = (None, f"fa3-fp8 skipped: fa3_fwd_interface not importable ({type(e).__name__}: "
                              f"{str(e)[:120]}); pip install the fa3-fwd wheel")
    return _FA3


def fp8_per_head(x: torch.Tensor, groups: int = 1) -> tuple:
    """FP8 e4m3 with one scale per (batch, head) for FA3: x [B, H, S, D] -> (x8 [B, S, H, D] view (the layout
    of x's memory is kept: a permuted view of [B, S, H, D] gives a contiguous x8), descale [B, H // groups]
    fp32). The scale is 448 / amax over S and D (torchao's too); ``groups`` > 1 (GQA queries): one scale per
    group of ``groups`` consecutive heads, as FA3 wants q_descale per KV head. All-zero heads get scale 1."""
    B, H, S, D = x.shape
    amax = x.abs().amax(dim=(2, 3)).float().view(B, H // groups, groups).amax(-1)  # [B, H_kv]
    nz = amax > 1e-12
    scale = torch.where(nz, FP8_MAX / amax, torch.ones_like(amax)).repeat_interleave(groups, dim=1)
    descale = torch.where(nz, amax / FP8_MAX, torch.ones_like(amax))
    # |x * scale| <= 448 up to fp32 rounding, well below 464 where e4m3fn's rounding turns to NaN: no clamp
    x8 = (x.transpose(1, 2) * scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return x8, descale.contiguous()


def _fa3_fp8_call(func: Callable, q, k, v, quantize_inside: bool = False) -> Callable:
    """The plumbing of :func:`fa3_fp8_fn` around an FA3-style ``func`` (``flash_attn_func``'s signature):
    q, k, v [B, H, S, D] (any strides) -> a no-argument callable returning [B, H, S, D] bf16 (a transposed
    view of FA3's [B, S, H, D] output; ``func`` may return ``(out, lse)``). ``quantize_inside=False``:
    quantised once, here (the callable times the kernel alone); True: on every call (inputs that change)."""
    groups = q.shape[1] // k.shape[1]

    def quantize():
        (q8, dq), (k8, dk), (v8, dv) = fp8_per_head(q, groups), fp8_per_head(k), fp8_per_head(v)
        return q8, k8, v8, dq, dk, dv

    def kernel(q8, k8, v8, dq, dk, dv):
        out = func(q8, k8, v8, causal=False, q_descale=dq, k_descale=dk, v_descale=dv)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.transpose(1, 2).to(torch.bfloat16)  # FA3's FP8 output is bf16 already: no copy

    if quantize_inside:
        return lambda: kernel(*quantize())
    pre = quantize()
    return lambda: kernel(*pre)


def fa3_fp8_fn(q, k, v, quantize_inside: bool = False) -> Optional[Callable]:
    """FA3 FP8 on bf16 [B, H, S, D] inputs (any strides) as a no-argument callable returning [B, H, S, D]
    bf16, or None (see :func:`fa3_fp8_status`). Per-(batch, head) FP8 scales (:func:`fp8_per_head`):
    quantised once, here, so the callable times the kernel alone like ``sdpa_fn``; ``quantize_inside=True``
    quantises on every call (eager torch: amax, scale, cast), the honest cost where inputs change each call
    (a generation)."""
    func, _ = fa3_fp8_status()
    if func is None or q.dtype != torch.bfloat16:
        return None
    return _fa3_fp8_call(func, q, k, v, quantize_inside)


def _torchao_fa3_shim(src_module: str = "fa3_fwd_interface", dst_module: str = "flash_attn_interface",
                      src_ns: str = "fa3_fwd", dst_ns: str = "flash_attn_3", ops=("fwd", "bwd")) -> bool:
    """Let torch's FA3 SDPA backend (which torchao's FP8 attention runs on) find the fa3-fwd wheel.

    ``torch.nn.attention.activate_flash_attention_impl("FA3")`` imports a module named
    ``flash_attn_interface`` and requires ops ``torch.ops.flash_attn_3.fwd`` and ``.bwd``, whose fwd it calls
    with FA3's C++ signature; torchao's own check (``_is_fa3_available``) imports the same module. The fa3-fwd
    wheel ships that code as module ``fa3_fwd_interface`` with ops ``torch.ops.fa3_fwd.*``. When
    ``dst_module`` is not importable but ``src_module`` is, this registers ``sys.modules[dst_module]`` = the
    ``src_module`` module and defines each op ``dst_ns::<name>`` (a torch.library fragment, kept alive here)
    with the schema of ``src_ns::<name>``, a CompositeImplicitAutograd kernel that calls it (an op missing
    from ``src_ns``: a stub that raises, e.g. ``bwd`` of a forward-only build). Returns True when the alias
    is in place (now or from an earlier call), False when nothing was done: ``dst_module`` imports on its
    own (a full FA3 install), or ``src_module`` is absent or does not load. The names are parameters so
    that a test can exercise the mechanism on namespaces of its own."""
    if dst_module in _SHIMMED:
        return True
    try:
        if dst_module in sys.modules or importlib.util.find_spec(dst_module) is not None:
            return False
    except (ImportError, ValueError):  # a parent package that fails / a module without __spec__
        return False
    try:
        if src_module not in sys.modules and importlib.util.find_spec(src_module) is None:
            return False
        mod = importlib.import_module(src_module)  # registers the src_ns ops (the CUDA extension)
    except Exception:  # noqa: BLE001 - absent, or its extension does not load (CPU torch, other CUDA)
        return False
    src_ops, dst_ops = getattr(torch.ops, src_ns), getattr(torch.ops, dst_ns)
    lib = torch.library.Library(dst_ns, "FRAGMENT")
    try:
        for name in ops:
            if hasattr(dst_ops, name):
                continue
            if hasattr(src_ops, name):
                target = getattr(src_ops, name).default
                lib.define(str(target._schema).split("::", 1)[1])
                lib.impl(name, _forward_to(target), "CompositeImplicitAutograd")
            else:
                lib.define(f"{name}(Tensor x) -> Tensor")
                lib.impl(name, _missing_op(f"{src_ns}::{name}"), "CompositeImplicitAutograd")
    except Exception:  # noqa: BLE001 - a schema this torch can not take: no alias (the status says why)
        return False
    sys.modules[dst_module] = mod
    _SHIMMED[dst_module] = lib
    return True


def _forward_to(target) -> Callable:
    def call(*args, **kwargs):
        return target(*args, **kwargs)
    return call


def _missing_op(name: str) -> Callable:
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name} is not in this build (forward-only FA3)")
    return call


def torchao_fp8_status() -> tuple:
    """``(op or None, one-line note)``: torchao's FP8 attention as ``apply_low_precision_attention`` gives it
    to a model: its ``F.scaled_dot_product_attention`` replacement calls the custom op
    ``torch.ops.torchao.fp8_fa3_sdpa`` (``torchao.prototype.attention.fp8_fa3.attention._ops.fp8_sdpa_op``):
    torchao's Triton per-(batch, head) FP8 quantisation of [B, H, S, D] q, k, v, then FA3's FP8 kernel through
    torch's SDPA (``_scaled_dot_product_attention_quantized`` with the FA3 flash impl active). Needs torch
    >= 2.11 (the FA3 flash impl registry), a sm_90 GPU, torchao (written against 0.18.0) and FA3 as
    ``flash_attn_interface``, or the fa3-fwd wheel through :func:`_torchao_fa3_shim`. Optional: never a
    requirement of the package."""
    global _TORCHAO
    if _TORCHAO is None:
        _TORCHAO = _torchao_probe()
    return _TORCHAO


def _torchao_probe() -> tuple:
    why = _hopper_missing("torchao-fp8")
    if why is not None:
        return None, why
    try:
        from torch.nn.attention import activate_flash_attention_impl  # noqa: F401 - torch >= 2.11
    except ImportError:
        return None, f"torchao-fp8 skipped: torch {torch.__version__} has no FA3 flash impl registry (needs 2.11+)"
    try:
        import torchao
        from torchao.prototype.attention.fp8_fa3.attention import _ops
    except Exception as e:  # noqa: BLE001 - not installed / an incompatible build
        return None, f"torchao-fp8 skipped: torchao FP8 attention not importable ({type(e).__name__}: {str(e)[:120]})"
    try:  # what activate_flash_attention_impl("FA3") checks, without changing the global SDPA state
        shimmed = _torchao_fa3_shim()
        importlib.import_module("flash_attn_interface")
        if not (hasattr(torch.ops.flash_attn_3, "fwd") and hasattr(torch.ops.flash_attn_3, "bwd")):
            raise RuntimeError("no torch.ops.flash_attn_3.fwd/bwd")
    except Exception as e:  # noqa: BLE001
        return None, (f"torchao-fp8 skipped: no FA3 for torch's SDPA ({type(e).__name__}: {str(e)[:100]}); "
                      "install FA3 (flash_attn_interface) or the fa3-fwd wheel")
    fa3 = "fa3-fwd via the flash_attn_interface shim" if shimmed else "flash_attn_interface"
    return _ops.fp8_sdpa_op, (f"torchao-fp8: torchao {getattr(torchao, '__version__', '?')} fp8_fa3_sdpa "
                              f"(Triton per-head FP8 quantisation + FA3 FP8 via SDPA; FA3: {fa3})")


@contextlib.contextmanager
def fa3_sdpa_impl():
    """FA3 as torch's flash SDPA implementation inside the block (what the module wrapper of torchao's
    ``apply_low_precision_attention`` does around every forward), the previous one restored after. A no-op
    where torchao-fp8 is unavailable or FA3 is already active. Note: ``sdpa_flash`` inside runs FA3."""
    if torchao_fp8_status()[0] is None:
        yield
        return
    from torch.nn.attention import (activate_flash_attention_impl, current_flash_attention_impl,
                                    restore_flash_attention_impl)
    prev = current_flash_attention_impl()
    if prev == "FA3":
        yield
        return
    activate_flash_attention_impl("FA3")
    try:
        yield
    finally:
        if prev is None:
            restore_flash_attention_impl()
        else:
            activate_flash_attention_impl(prev)


def torchao_fp8_fn(q, k, v) -> Optional[Callable]:
    """torchao's FP8 attention on bf16 [B, H, S, D] inputs (SDPA layout, any strides) as a no-argument callable
    returning [B, H, S, D] bf16, or None (see :func:`torchao_fp8_status`): the op the patched SDPA calls,
    quantisation included (as a user gets it from bf16 inputs). FA3 is made torch's flash impl for the call
    unless it already is: benchmarks time it inside :func:`fa3_sdpa_impl`, as a model runs under the wrapper
    (a per-forward cost, not a per-call one)."""
    op, _ = torchao_fp8_status()
    if op is None or q.dtype != torch.bfloat16:
        return None

    def run():
        with fa3_sdpa_impl():
            return op(q, k, v, is_causal=False, scale=0.0, enable_gqa=False, hadamard="NONE")
    return run


def fp8_baselines():
    """The optional FP8 baselines: (name, make(q, k, v) -> callable or None, status() -> (func, note), context
    that must be active while it runs): FA3's FP8 kernel alone (inputs quantised once, per (batch, head)) and
    torchao's FP8 attention op from bf16 (its quantisation included; FA3 active as torch's flash SDPA, as under
    torchao's wrapper)."""
    return (("fa3-fp8", fa3_fp8_fn, fa3_fp8_status, contextlib.nullcontext),
            ("torchao-fp8", torchao_fp8_fn, torchao_fp8_status, fa3_sdpa_impl))


def run_fp8_baselines(q, k, v, measure: Callable, log: Callable, prefix: str = "  ") -> None:
    """For each FP8 baseline available here, ``measure(name, fn, note)`` inside its context; a missing one logs
    its note, a failing one its error (an optional baseline never ends a benchmark)."""
    if not torch.cuda.is_available():
        return
    for name, make, status, ctx in fp8_baselines():
        try:
            fn = make(q, k, v)
            if fn is None:
                log(f"{prefix}{status()[1]}")
                continue
            with ctx():
                measure(name, fn, status()[1])
        except Exception as e:  # noqa: BLE001
            log(f"{prefix}{name} failed: {type(e).__name__}: {str(e)[:300]}")


def kernel_times(prof) -> Dict[str, float]:
    """GPU time (ms) by kernel name from a finished ``torch.profiler.profile``: its device-side events, or,
    where a torch version lists none, the kernels it attached to the CPU ops."""
    out: Dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    if not out:
        for e in prof.events():
            for k in getattr(e, "kernels", None) or []:
                out[k.name] = out.get(k.name, 0.0) + k.duration / 1e3
    return out


def run_clustered_inputs(B, H, S, D, dtype, device="cpu", seed=0):
    """[B, H, S, D] q, k, v of the kernels' GPU tests (``tests/kernels/test_vsmooth_attn.make_qkv``): peaked attention,
    channel-biased K, V from 6 centres in token runs plus 0.3 noise, 1% token outliers (15x)."""
    g = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, H, S, D, generator=g) + 3.0 * torch.randn(H, 1, D, generator=g)
    centers = 2.0 * torch.randn(B, H, 6, D, generator=g)
    run = (torch.arange(S) * 6 // S).view(1, 1, S, 1).expand(B, H, S, D)
    v = torch.gather(centers, 2, run) + 0.3 * torch.randn(B, H, S, D, generator=g)
    out = torch.rand(B, H, S, 1, generator=g) < 0.01
    v = v + out * 15.0 * torch.randn(B, H, S, D, generator=g)
    return [t.to(dtype).to(device) for t in (q, k, v)]


def structured_inputs(B, H, S, D, seed=0, device="cpu", dtype=torch.bfloat16):
    """[B, S, H, D] q, k, v (the model's layout; view them with ``.transpose(1, 2)`` for SDPA): channel-
    biased K, V in 64 clusters per head scattered over the tokens plus 1% token outliers, as
    ``bench_vsmooth_attn.make_inputs``."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    q = 1.5 * r(B, S, H, D)
    k = r(B, S, H, D) + 3.0 * r(1, 1, H, D)
    centers = 2.0 * r(H, 64, D)
    lab = torch.randint(0, 64, (B, S, H), device=device, generator=g)
    v = centers[torch.arange(H, device=device).view(1, 1, H), lab] + 0.4 * r(B, S, H, D)
    v = v + (torch.rand(B, S, H, 1, device=device, generator=g) < 0.01) * 12.0 * r(B, S, H, D)
    return tuple(t.to(dtype) for t in (q, k, v))


class Drift:
    """Structured inputs that drift a little each step, like a denoiser's attention inputs: a random walk
    ``x_{i+1} = x_i + rate * std(x_0) * N(0, 1)`` on each of q, k, v from :func:`structured_inputs`
    (rate 0.05: after 50 steps x has moved ~0.35 of its spread). Deterministic from the seed, so every
    method sees the same sequence. ``step()`` returns the next [B, S, H, D] triple (the first call returns
    x_0); generation happens outside any timed region."""

    def __init__(self, B, H, S, D, seed=0, device="cpu", rate=0.05):
        self.x = [t.float() for t in structured_inputs(B, H, S, D, seed, device)]
        self.std = [t.std().item() for t in self.x]
        self.g = torch.Generator(device=device).manual_seed(seed + 1)
        self.rate, self.i = rate, 0

    def step(self):
        if self.i > 0:
            for x, s in zip(self.x, self.std):
                x.add_(torch.randn(x.shape, device=x.device, generator=self.g), alpha=self.rate * s)
        self.i += 1
        return tuple(x.to(torch.bfloat16) for x in self.x)


def parse_methods(ap, text: str, known) -> List[str]:
    """A benchmark's ``--methods``: the comma-separated names, each one of ``known``; any other is an argparse
    error naming it and the known ones (exits, as ``ap.error`` does)."""
    methods = [m for m in text.split(",") if m]
    bad = [m for m in methods if m not in known]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {list(known)}")
    return methods


def append_rows(bench: str, rows: List[Dict[str, object]], path: Optional[str] = None,
                extras: Optional[List[str]] = None) -> str:
    """Append rows (dicts with the COLUMNS and optional extras) to results/<bench>.csv (or ``path``).
    ``extras``: columns kept even when an existing file's header lacks them (the header is widened once,
    see :func:`append_csv`), so a new column such as ``speedup_vs_fa4`` is kept instead of dropped."""
    info = env_info()
    return append_csv(path or os.path.join(RESULTS_DIR, f"{bench}.csv"),
                      [{**info, "bench": bench, **r} for r in rows], widen=extras)


def append_csv(path: str, rows: List[Dict[str, object]], columns: Optional[List[str]] = None,
               widen: Optional[List[str]] = None) -> str:
    """Append complete rows to a results CSV: a new file gets ``COLUMNS``, the rows' extras, then
    ``GPU_COLUMNS``; an existing one keeps its header (extras it lacks are dropped), widened (the file
    rewritten) only by the ``GPU_COLUMNS`` it lacks. The header must start with the agreed ``COLUMNS``.
    ``columns``: a new file's header before the GPU columns (default: COLUMNS + ``widen`` + the rows' other
    extras). ``widen``: extra columns an existing header gains too (added at the end, like GPU_COLUMNS)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    old: List[List[str]] = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            old = list(csv.reader(f))
    if old:
        cols = old[0]
        if cols[:len(COLUMNS)] != COLUMNS:
            raise RuntimeError(f"{path} does not start with the agreed columns {COLUMNS}")
        add = [k for k in (widen or []) if k not in cols and k not in COLUMNS]
        wider = cols + add + [k for k in GPU_COLUMNS if k in keys and k not in cols and k not in add]
        # other extras: dropped
    else:
        first = list(columns) if columns else COLUMNS + _extras(list(dict.fromkeys([*(widen or []), *keys])))
        cols = wider = first + [c for c in GPU_COLUMNS if c in keys and c not in first]
    if wider != cols:  # rewrite with the new columns at the end (a temp file, then an atomic rename)
        tmp = path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(wider)
            w.writerows(r + [""] * (len(wider) - len(r)) for r in old[1:])
        os.replace(tmp, path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=wider, extrasaction="ignore")
        if not old:
            w.writeheader()
        for r in rows:
            w.writerow({c: _fmt(r.get(c, "")) for c in wider})
    return path


def add_speedup(rows: List[Dict[str, object]], base_variant: str, column: str,
                keys=("B", "H", "S", "D")) -> None:
    """``row[column] = base.ms / row.ms`` for every timed row, ``base`` being the ``base_variant`` row of
    the same shape (``keys``); rows without such a base (or untimed rows) get ""."""
    base = {tuple(r.get(k) for k in keys): r["ms"] for r in rows
            if r.get("variant") == base_variant and _finite(r.get("ms"))}
    for r in rows:
        b = base.get(tuple(r.get(k) for k in keys))
        r[column] = b / r["ms"] if b is not None and _finite(r.get("ms")) and r["ms"] > 0 else ""


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _extras(keys: List[str]) -> List[str]:
    return [k for k in keys if k not in COLUMNS and k not in GPU_COLUMNS]


def _fmt(x):
    return fmt_cell(x) if isinstance(x, float) else x


def print_table(rows: List[Dict[str, object]], cols: List[str]) -> None:
    print(format_table(rows, cols))
