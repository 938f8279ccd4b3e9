"""One module per attention method (``METHODS``). Each owns its phase schedule, its metadata slots, its guard
and its eligibility, and runs its kernels through ``kernels/dispatch.py`` (the reference or the kernels: the
``impl`` that dispatch chose for the call), never a kernel module by name. What a method module provides is
``protocol.AttentionMethod`` (``methods/protocol.py``); the op asks it for a ``Plan`` of each call and knows no
method by name. Adding a method: its module here, its row in ``METHODS`` and its ``config.Method`` value (with
its options in ``config.py``).
"""
from __future__ import annotations

from ..config import Method
from . import dense, mcsparse, vsmooth
from .output import finish_output, kernel_out_dtype
from .phase import Phase
from .protocol import AttentionMethod, Plan

__all__ = ["METHODS", "AttentionMethod", "Phase", "Plan", "finish_output", "get", "kernel_out_dtype"]
METHODS = {Method.DENSE: dense, Method.VSMOOTH: vsmooth, Method.MCSPARSE: mcsparse}


def get(method: Method):
    """The module of a resolved method (``VCConfig.resolved_method``)."""
    return METHODS[method]
