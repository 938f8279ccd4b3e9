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
    "mcsparse": ("pddp", "select", "sparse_attn"),
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
    return torch.cuda.get_device_capability(device) >= (8, 9)


def resolve(method: str, cfg: VCConfig, device: torch.device):
    """(module namespace, path name) for this call: Triton templates or the reference.

    ``kernels="auto"``: Triton on CUDA GPUs with FP8 (sm_89+); the reference elsewhere (CPU, older GPUs,
    with a one-time warning on GPUs). ``"triton"`` forces the kernels (CPU only under TRITON_INTERPRET=1);
    ``"reference"`` forces the reference.
    """
    if cfg.kernels == Kernels.REFERENCE:
        return reference(method), "reference"
    want_triton = cfg.kernels == Kernels.TRITON or (device.type == "cuda" and fp8_capable(device))
    if not want_triton:
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
