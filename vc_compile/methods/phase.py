"""The phases of an attention call (docs/methods.md, "Steps and phases") and what the methods' schedules share.

Each method owns its schedule (``phase_for`` in ``methods/<method>.py``); ``runtime/steps.py`` only says which
step of how many a call is in, and the op (``ops.py``) asks the method for the phase of that step.
"""
from __future__ import annotations

import enum


class Phase(str, enum.Enum):
    DENSE = "dense"  # stock SDPA (warm-up steps; every step of method="dense")
    WARMUP = "warmup"  # MC-Sparse's warm-up on the 8-bit V-Smooth path (own metadata slot, see ops.py)
    GROUP = "group"  # V-Smooth: re-group V (k-means) and run the 8-bit attention
    ANCHOR = "anchor"  # MC-Sparse: select (PDDP groups, exact masses, top-K) and cache the residual
    REUSE = "reuse"  # run with the cached metadata


def warmup_steps(cfg, n: int, fraction: float) -> int:
    """Dense steps at the start of an ``n``-step generation: the ``warmup_steps`` option, else the method's
    ``fraction`` of the steps."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    return int(round(fraction * n))
