"""``method="dense"``: stock SDPA through our op (the baseline). Every step is ``Phase.DENSE``, which the op
runs itself (the same SDPA call as the other methods' warm-up steps); its ``run`` is never reached."""
from __future__ import annotations

from typing import Optional

from .phase import Phase
from .protocol import MethodSpec, Plan

# the baseline every table and the demo compare with: no kernels, nothing to warm up or tune
SPEC = MethodSpec(label=lambda cfg: "dense", variants=(("dense", {"method": "dense"}),))
USES_KERNELS = False
FUSES_ROPE = False
NEEDS_IDENTITY = False


def phase_for(cfg, step: int, n: int, has_meta: bool) -> Phase:
    return Phase.DENSE


def plan(cfg, step: int, n: int, slot, q, k, v, impl) -> Plan:
    return Plan(Phase.DENSE)


def schedule(cfg, n: int):
    return (Phase.DENSE,) * n


def run(q, k, v, *, phase, meta, cfg, sm_scale, impl, **kw):
    raise AssertionError("method='dense' runs stock SDPA in the op (Phase.DENSE never reaches run)")


def needs_fp8(cfg) -> bool:
    return False


def ineligible(q, k, v) -> Optional[str]:
    return None


def path_label(path: str, phase: Phase, cfg, q, v) -> str:
    return "sdpa"


def replayable(phase: Phase, cfg) -> bool:
    return False


def main_kernel(q, v, cfg) -> Optional[str]:
    return None
