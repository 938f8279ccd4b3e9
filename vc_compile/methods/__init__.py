"""One module per attention method (``METHODS``). Each owns its phase schedule, its metadata slots, its guard
and its eligibility, and runs its kernels through ``kernels/dispatch.py`` (the reference or the kernels: the
``impl`` that dispatch chose for the call), never a kernel module by name. What a method module provides is
``protocol.AttentionMethod`` (``methods/protocol.py``); the op asks it for a ``Plan`` of each call and every other
consumer reads its ``SPEC`` (``protocol.MethodSpec``): none knows a method by name. Adding a method: its module
here, its row in ``METHODS`` and its ``config.Method`` value (with its options in ``config.py``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from ..config import Method
from . import dense, mcsparse, vsmooth
from .output import finish_output, kernel_out_dtype
from .phase import Phase
from .protocol import AttentionMethod, MethodSpec, Plan

__all__ = ["METHODS", "AttentionMethod", "MethodSpec", "Phase", "Plan", "BASELINE", "BASELINE_LABEL", "finish_output", "get",
           "kernel_out_dtype", "schedule", "variants", "warmup_variants", "ladder", "tunable"]
METHODS = {Method.DENSE: dense, Method.VSMOOTH: vsmooth, Method.MCSPARSE: mcsparse}
BASELINE = Method.DENSE  # stock SDPA through the op: the row every other method is compared with
BASELINE_LABEL = METHODS[BASELINE].SPEC.variants[0][0]


def get(method: Method):
    """The module of a resolved method (``VCConfig.resolved_method``)."""
    return METHODS[method]


def schedule(cfg, n: int) -> Tuple[Phase, ...]:
    """The phase of each step of an n-step generation under ``cfg`` (every block's metadata kept)."""
    return tuple(get(cfg.resolved_method).schedule(cfg, n))


def variants() -> List[Tuple[str, Mapping[str, Any]]]:
    """(label, options) of every method's variants, the baseline's first (the demo's and benchmarks' rows)."""
    return [v for m in sorted(METHODS, key=lambda m: m != BASELINE) for v in METHODS[m].SPEC.variants]


def warmup_variants() -> Dict[str, Mapping[str, Any]]:
    """{label: options} of the variants whose kernels ``python -m vc_compile warmup`` builds by default."""
    return {lab: opts for m in METHODS.values() for lab, opts in m.SPEC.variants if lab in m.SPEC.warmup}


def ladder() -> List[Tuple[str, Mapping[str, Any]]]:
    """(label, options) of every method's ablation ladder (demo ``--ladder``)."""
    return [r for m in METHODS.values() for r in m.SPEC.ladder]


def tunable() -> Dict[str, Any]:
    """{method name: module} of the methods ``vc_compile tune`` offers (a tunable kernel)."""
    return {m.value: mod for m, mod in METHODS.items() if mod.SPEC.tune is not None}
