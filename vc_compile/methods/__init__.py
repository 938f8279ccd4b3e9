"""One module per attention method. Each runs its phases and owns its metadata type; it calls the
Triton templates on CUDA and the plain-PyTorch reference elsewhere (``impl`` picks, see ``resolve``).

Every ``run`` has the signature
``run(q, k, v, *, phase, meta, cfg, sm_scale, impl) -> (out [B, H, S, Dv] in q.dtype, new meta)``
with q, k, v in [B, H, S, D] (any strides).
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import SimpleNamespace
from typing import Tuple

import torch

from ..config import Kernels, VCConfig

_TEMPLATE_MODULES = {
    "vsmooth": ("preprocess", "vsmooth_attn", "kmeans"),
    "mcsparse": ("pddp", "select", "sparse_attn", "finite_flags"),
}


@functools.lru_cache(maxsize=None)
def _load(pkg: str, names: Tuple[str, ...]):
    mods = {}
    for n in names:
        mods[n] = importlib.import_module(f"vc_compile.{pkg}.{n}")
    return SimpleNamespace(**mods)


def reference(method: str):
    return _load("reference", _TEMPLATE_MODULES[method])


@functools.lru_cache(maxsize=None)
def _templates_or_error(method: str):
    try:
        return _load("templates", _TEMPLATE_MODULES[method]), None
    except Exception as e:  # the kernels are missing or failed to import: say so, never silently
        return None, f"{type(e).__name__}: {e}"


def fp8_capable(device: torch.device) -> bool:
    if device.type != "cuda":
        return os.environ.get("TRITON_INTERPRET") == "1"
    if getattr(torch.version, "hip", None):  # Triton's float8e4nv (OCP E4M3 on NVIDIA) is not ROCm's
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def needs_fp8(method: str, cfg: VCConfig) -> bool:
    """Whether this method's kernels use FP8 (E4M3) tensor-core MMAs with these options.

    V-Smooth always does (FP8 PV). MC-Sparse only with ``sparse_qk="fp8"``: its bf16 gather kernel, PDDP
    and selection run on any GPU Triton supports (the FP8 residual is a plain torch cast)."""
    if method == "mcsparse":
        return cfg.sparse_qk == "fp8"
    return True


def resolve(method: str, cfg: VCConfig, device: torch.device):
    """(module namespace, path name) for this call: Triton templates or the reference.

    ``kernels="auto"``: Triton on CUDA GPUs when the method's options need no FP8 or the GPU has it
    (sm_89+); the reference elsewhere (CPU; a GPU without FP8, with a one-time warning). ``"triton"``
    forces the kernels, and refuses with a clear error what cannot work (CPU without TRITON_INTERPRET=1,
    FP8 options on a GPU without FP8, Triton missing); ``"reference"`` forces the reference.
    """
    if cfg.kernels == Kernels.REFERENCE:
        return reference(method), "reference"
    fp8_ok = not needs_fp8(method, cfg) or fp8_capable(device)
    if cfg.kernels == Kernels.TRITON:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
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
        return reference(method), "reference"
    mods, err = _templates_or_error(method)
    if mods is None:
        if cfg.kernels == Kernels.TRITON:
            raise RuntimeError(f"vcattn: kernels='triton' but the {method} Triton kernels failed to "
                               f"load ({err}). Install triton, or use kernels='reference'.")
        _warn_once(f"vcattn: {method} Triton kernels unavailable ({err}); running the reference.")
        return reference(method), f"reference ({err.split(':')[0]})"
    return mods, "triton"


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def kernel_ineligible(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Why the Triton kernels cannot run these inputs (the op then runs stock SDPA and records the
    reason), or None. The reference runs any shape; the kernels have limits of their own."""
    D, Dv = q.shape[-1], v.shape[-1]
    if method == "vsmooth":
        if D not in (64, 128) or Dv != D:
            return "head_dim unsupported by the 8-bit kernels (64 or 128)"
        if q.shape[2] != k.shape[2]:
            return "cross-attention (Sq != Sk) unsupported by the 8-bit kernels"
        return None
    if any(d < 16 or d > 256 or d & (d - 1) for d in (D, Dv)):
        return "head_dim unsupported by the sparse kernels (power of two in [16, 256])"
    return None


FP16_MAX = 65504.0


def kernel_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to ask a kernel for when the op must return ``dtype``: fp32 for fp16 (see
    ``finish_output``), else ``dtype`` itself."""
    return torch.float32 if dtype == torch.float16 else dtype


def finish_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The op's output in ``dtype`` from a kernel output in ``kernel_out_dtype(dtype)``.

    fp16 saturates: an attention output row is a convex combination of V rows, so with finite inputs
    SDPA never exceeds max|V| <= 65504. The approximate paths add rounding on top (V-Smooth's FP8
    residual can round up by 1/16 of its scale; MC-Sparse adds a residual cached at another step to the
    sparse output), so a value at 65504 - eps can land above 65520 and become inf in fp16. For fp16 inputs
    the fp32 math itself cannot overflow, so an inf in the fp32 output comes from an Inf input and is kept
    (like SDPA); finite values are clamped to +-65504; NaN stays NaN."""
    if dtype == torch.float16 and out.dtype != torch.float16:
        out = torch.where(torch.isinf(out), out, out.clamp(-FP16_MAX, FP16_MAX))
    return out.to(dtype)
