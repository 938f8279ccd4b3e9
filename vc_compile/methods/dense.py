"""``method="dense"``: stock SDPA through our op (the baseline). Every step is ``Phase.DENSE``, which the op
runs itself (the same SDPA call as the other methods' warm-up steps), so this method has no ``run``."""
from __future__ import annotations

from typing import Optional

from .phase import Phase


def phase_for(cfg, step: int, n: int, has_meta: bool) -> Phase:
    return Phase.DENSE


def needs_fp8(cfg) -> bool:
    return False


def ineligible(q, k, v) -> Optional[str]:
    return None


def path_label(path: str, phase: Phase, cfg, device) -> str:
    return "sdpa"
