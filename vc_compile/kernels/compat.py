"""What differs between the Triton releases the kernels build on (3.6 to 3.9), resolved once by feature detection,
never by version string.

Gluon names that moved. Every Gluon kernel of the package calls these instead of the Triton module attributes, so
one kernel source builds on each supported Triton:

=================  ======================================  ==========================================
name here          newer Triton (3.7+ / 3.8+)              Triton 3.6
=================  ======================================  ==========================================
``barrier``        ``gl.barrier`` (3.7+)                   ``gl.thread_barrier``
``cp_async_load``  ``ampere.async_copy.async_load`` (3.8+) ``ampere.async_copy.async_copy_global_to_shared``
``tma_load``       ``hopper.tma.async_load`` (3.8+)        ``hopper.tma.async_copy_global_to_shared``
=================  ======================================  ==========================================

The new name is taken wherever it exists: Triton 3.8 keeps the old names as aliases, 3.9 keeps them only as
functions that raise. Each is the same builtin with the same positional arguments.

The sm_90 assembler. Triton 3.9 assembles sm_90 code with the CUDA 13 ptxas it ships as ``ptxas-blackwell``;
it also ships a CUDA 12 ``ptxas``. ``sm90_ptxas()`` is that CUDA 12 ptxas where the installed Triton picks a
CUDA 13+ one for sm_90 and ships a CUDA 12 one (None elsewhere), and ``assembled(namespace)`` (called at the end
of every kernel module) makes each kernel of the module build with it: its launches run inside
``knobs.nvidia.scope()`` with ``ptxas_blackwell`` pointed at it, so a build (Triton's disk cache key includes the
ptxas version) uses it and nothing outside our kernels is touched.
FP fusion. Triton 3.9 warns that kernels launched without ``enable_fp_fusion`` lose FMA contraction from 3.10 on;
where that default is announced (``fusion_unpinned``), ``assembled`` also asks for fusion at every launch, which is
what 3.6-3.9 build anyway (same code, no warning).
NOTE CUDA 13.4's ptxas serialises the wgmmas of the warp-specialised V-Smooth kernel ("insufficient register
resources", C7512) where CUDA 12 did not; the design record docs/design/toolchain.md has the measurement.
"""
from __future__ import annotations

import contextlib
import functools
import re
from typing import Optional

__all__ = ["assembled", "assembler", "barrier", "choose_ptxas", "cp_async_load", "fusion_unpinned", "sm90_ptxas",
           "tma_load"]

try:  # (a Triton without Gluon: the Gluon kernel modules fail to import, the Triton kernels' import this one)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import (
        async_copy as _async_copy,
    )
    from triton.experimental.gluon.language.nvidia.hopper import tma as _tma
except ImportError:
    pass
else:
    barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    cp_async_load = getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared
    tma_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared


def _major(version: Optional[str]) -> int:
    m = re.match(r"(\d+)", version or "")
    return int(m.group(1)) if m else 0


@functools.lru_cache(maxsize=None)
def sm90_ptxas() -> Optional[str]:
    """The bundled CUDA 12 ptxas where the installed Triton assembles sm_90 with a CUDA 13+ one, else None."""
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas
        return choose_ptxas(get_ptxas(90), knobs.nvidia.ptxas)
    except Exception:  # noqa: BLE001 - no CUDA backend (or another layout of it): Triton's own choice
        return None


def choose_ptxas(chosen, legacy) -> Optional[str]:
    """``legacy.path`` where Triton's sm_90 ptxas ``chosen`` is CUDA 13+ and ``legacy`` (its bundled ``ptxas``) is
    CUDA 12, else None (tools: objects with ``path`` and ``version``)."""
    if chosen is None or legacy is None or chosen.path == legacy.path:
        return None
    return legacy.path if _major(chosen.version) >= 13 and _major(legacy.version) == 12 else None


@contextlib.contextmanager
def assembler():
    """Builds inside the block assemble sm_90 with ``sm90_ptxas()`` (no change where it is None)."""
    path = sm90_ptxas()
    if path is None:
        yield
        return
    from triton import knobs
    with knobs.nvidia.scope():
        knobs.nvidia.ptxas_blackwell = path
        yield


def fusion_unpinned() -> bool:
    """Whether the installed Triton's default for FP fusion (FMA contraction) is about to change: 3.9 warns that
    kernels which do not ask for it get it disabled from 3.10 on (``knobs.language.fp_fusion_enabled``)."""
    try:
        from triton import knobs
        return hasattr(knobs.language, "fp_fusion_enabled")
    except Exception:  # noqa: BLE001 - an older knobs layout: fusion on by default, nothing to pin
        return False


def assembled(namespace: dict) -> None:
    """Make every kernel (JIT function) defined in a module's ``namespace`` build with ``assembler()`` and, where
    the installed Triton's FP-fusion default is about to change (``fusion_unpinned``), with FP fusion asked for:
    its ``run`` (what a launch and a warm-up call; a remembered launch never builds) is wrapped on the instance.
    NOTE the kernels' arithmetic is written for contracted multiply-adds (ExpCast's code is one FFMA, the exp2
    path folds its scales into the exponent's FFMA): built without fusion they would round differently."""
    fusion = fusion_unpinned()
    if sm90_ptxas() is None and not fusion:
        return
    from triton.runtime.jit import JITFunction
    for fn in list(namespace.values()):
        if isinstance(fn, JITFunction) and "run" not in vars(fn):
            fn.run = _wrap(fn, fusion)


def _wrap(fn, fusion: bool = False):
    def run_assembled(*args, **kwargs):  # the class's run at call time (a harness may patch it later)
        if fusion:
            kwargs.setdefault("enable_fp_fusion", True)
        with assembler():
            return type(fn).run(fn, *args, **kwargs)
    return run_assembled
