"""vc_compile: a torch.compile backend that runs video-DiT attention as 8-bit or token-sparse kernels.

    model = torch.compile(transformer, backend="vcattn")                      # no import needed
    model = torch.compile(transformer, backend="vcattn", options={"method": "mcsparse", "density": 0.15})
    pipe = vc_compile.enable(pipe, method="vsmooth")                          # a whole diffusers pipeline

Public API (small on purpose): ``enable()``, ``disable()``, ``report()``, ``sampling()``, ``step()``,
``diffusers_callback``, ``reset()``, ``VCConfig``; the ``vc_compile`` logger (``vc_compile.log``).

Importing is cheap (names resolve on first use): torch._dynamo is imported when the backend runs, the
``torch.ops.vcattn.*`` custom ops are registered when the backend (``vc_compile.backend``, loaded by
torch.compile through the ``torch_dynamo_backends`` entry point) or ``vc_compile.ops`` is first imported.
Code that calls ``torch.ops.vcattn.*`` itself, or loads an exported program holding them, imports
``vc_compile.ops`` first.
"""
from __future__ import annotations

from ._version import __version__

__all__ = ["enable", "disable", "report", "Report", "sampling", "step", "diffusers_callback", "reset",
           "VCConfig", "VCConfigError", "Method", "QKFormat", "__version__"]

_LAZY = {
    "enable": "vc_compile.pipeline", "disable": "vc_compile.pipeline",
    "report": "vc_compile.runtime.report", "Report": "vc_compile.runtime.report",
    "sampling": "vc_compile.runtime.steps", "step": "vc_compile.runtime.steps",
    "diffusers_callback": "vc_compile.runtime.steps",
    "VCConfig": "vc_compile.config", "VCConfigError": "vc_compile.config", "Method": "vc_compile.config",
    "QKFormat": "vc_compile.config",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'vc_compile' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _register_without_entry_point() -> None:
    """``backend="vcattn"`` also for a source checkout on ``PYTHONPATH`` (not pip-installed, so no
    ``torch_dynamo_backends`` entry point): register on import. With the entry point present (the usual
    case; a ~50 ms scan of the installed distributions) torch loads the backend lazily itself, and
    registering here would make it raise "duplicate name: vcattn"."""
    from importlib.metadata import entry_points

    if "vcattn" in entry_points(group="torch_dynamo_backends").names:
        return
    from torch._dynamo.backends import registry  # only here: a source checkout pays for Dynamo's import

    if "vcattn" in registry._COMPILER_FNS:
        return
    from .backend import vcattn

    registry.register_backend(compiler_fn=vcattn, name="vcattn")


_register_without_entry_point()


def reset(report: bool = False) -> None:
    """Drop all cached metadata and step state (a fresh generation); ``report=True`` also forgets the
    call-site records and counts. The process's ``Runtime.reset`` (``vc_compile/runtime/runtime.py``)."""
    from .runtime.runtime import current

    current().reset(report=report)
    from .methods import mcsparse

    mcsparse.release_pools()  # the metadata just dropped: its pool's blocks can go back to the driver
