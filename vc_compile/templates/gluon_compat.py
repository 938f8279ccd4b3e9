"""Gluon names that moved between Triton releases, resolved once by feature detection (never by version string).

Every Gluon kernel of the package calls these instead of the Triton module attributes, so one kernel source
builds on each supported Triton:

=================  ======================================  ==========================================
name here          newer Triton (3.7+ / 3.8+)              Triton 3.6
=================  ======================================  ==========================================
``barrier``        ``gl.barrier`` (3.7+)                   ``gl.thread_barrier``
``cp_async_load``  ``ampere.async_copy.async_load`` (3.8+) ``ampere.async_copy.async_copy_global_to_shared``
``tma_load``       ``hopper.tma.async_load`` (3.8+)        ``hopper.tma.async_copy_global_to_shared``
=================  ======================================  ==========================================

The new name is taken wherever it exists: Triton 3.8 keeps the old names as aliases, 3.9 keeps them only as
functions that raise. Each is the same builtin with the same positional arguments, so the compiled code is
identical (the offline sm_90 checks compare instruction counts across releases).
"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma as _tma

__all__ = ["barrier", "cp_async_load", "tma_load"]

barrier = getattr(gl, "barrier", None) or gl.thread_barrier
cp_async_load = getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared
tma_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared
