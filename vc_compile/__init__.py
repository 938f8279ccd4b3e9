"""vc_compile: a torch.compile backend that runs video-DiT attention as 8-bit or token-sparse kernels.

    model = torch.compile(transformer, backend="vcattn")                      # no import needed
    model = torch.compile(transformer, backend="vcattn", options={"method": "mcsparse", "density": 0.15})

Public API (small on purpose): ``report()``, ``sampling()``, ``step()``, ``diffusers_callback``,
``reset()``, ``VCConfig``.
"""
from __future__ import annotations

from . import ops  # noqa: F401  (registers torch.ops.vcattn.*)
from .config import Method, QKFormat, VCConfig, VCConfigError
from .runtime.report import Report, report
from .runtime.steps import diffusers_callback, sampling, step

__all__ = ["report", "Report", "sampling", "step", "diffusers_callback", "reset", "VCConfig",
           "VCConfigError", "Method", "QKFormat"]
__version__ = "0.1.0"


def _register_without_entry_point() -> None:
    """``backend="vcattn"`` also for a source checkout on ``PYTHONPATH`` (not pip-installed, so no
    ``torch_dynamo_backends`` entry point): register on import. With the entry point present torch loads
    the backend lazily itself and registering here would make it raise "duplicate name: vcattn"."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if "vcattn" in entry_points(group="torch_dynamo_backends").names or "vcattn" in registry._COMPILER_FNS:
        return
    from .backend import vcattn

    registry.register_backend(compiler_fn=vcattn, name="vcattn")


_register_without_entry_point()


def reset(report: bool = False) -> None:
    """Drop all cached metadata and step state (a fresh generation); ``report=True`` also forgets the
    call-site records and counts."""
    from .runtime import report as _report
    from .runtime import state
    from .runtime.steps import TRACKER

    TRACKER.reset()
    state.clear()
    if report:
        _report.clear()
    else:
        _report.reset_counts()
