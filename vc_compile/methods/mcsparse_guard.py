"""MC-Sparse quality guard: measure each reuse step's error on a few sampled query rows and re-anchor
when it exceeds a threshold (beyond the paper, which names an adaptive anchor schedule as
future work). Decision note with the measurements: docs/mcsparse_guard.md.

What is measured
----------------
At the anchor the guard fixes R query rows per head (``sample_rows``). On every reuse step the
non-finite-flags pass (``kernels/finite_flags.py``), which reads every key and value anyway, also
computes the exact attention output of those rows over all keys; ``probe_error`` compares it with the
rows the reuse step returned (sparse + residual) and gives (sum ||o - o_exact||^2, sum ||o_exact||^2)
over the sampled rows of every head: ``rel_error`` = the step's relative L2 error, estimated. It is the
quantity the schedule is about (the residual's staleness included), not a proxy such as selection
coverage (which ignores what the residual compensates) or Q/K drift since the anchor (which would need
a copy of the anchor's Q and K).

When it decides
---------------
Without a host sync: the two numbers stay on the device and are copied to pinned memory with an event
(``Readback``); the next call of the same (site, block, branch) -- normally the next step -- reads the
newest finished reading (``GuardState.poll``) and, above the threshold, runs that step as an anchor --
but never sooner than ``MIN_GAP`` steps after the previous anchor (below: dearer than dense attention).
The decision therefore lags one step (two if the GPU runs more than a step behind the host), and it is
made inside the op at run time: no recompiles. A non-finite reading (NaN/Inf inputs) never triggers:
an anchor on non-finite inputs caches nothing (methods/mcsparse.py).

Everything here is device-agnostic (tests/methods/test_mcsparse_guard.py). The integration: ``methods/mcsparse.py``'s
reuse step runs the probe (through ``kernels/dispatch.py``: ``finite_flags`` + ``probe_error``) and
``GuardState.record``s it; ``ops.attention`` asks ``guard_check`` when the schedule says REUSE.
"""
from __future__ import annotations

import collections
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Tuple

import torch

# NOTE 16 rows per head: the probe's tl.dot tile is at least 16 rows, and at B = 1, H = 40, S = 32760,
# D = 128 its QK and PV are 4 R S D = 10.7 GFLOP per call, hidden under the pass's 670 MB read. The
# estimate pools every head's rows (640 rows at H = 40; 32 on the 2-head demo model: its estimate vs the
# true error per call comes from docs/design/quality-guard.md).
ROWS = 16
_HISTORY = 64  # read-back errors kept per metadata entry (diagnostics)


def sample_rows(B: int, H: int, S: int, rows: int = ROWS, device=None) -> torch.Tensor:
    """[B, H, rows] int32 query indices: pseudo-random (seeded by S, so the same shape always samples
    the same rows) and different per head. Not strided: a stride of S / rows (256 at 16 x 16 x 16
    tokens) would hit the same spatial position in every frame."""
    g = torch.Generator().manual_seed(0x5EED + S)
    return torch.randint(0, S, (B, H, rows), generator=g, dtype=torch.int64).to(torch.int32).to(device)


@functools.lru_cache(maxsize=64)
def _device_rows(B: int, H: int, S: int, rows: int, device: torch.device) -> torch.Tensor:
    """``sample_rows`` on ``device``, copied there once per shape: a guard state is made on the first reuse
    step after each anchor, and a host->device copy there would be a sync (read-only: nothing writes rows)."""
    return sample_rows(B, H, S, rows, device)


def rel_error(num: float, den: float) -> float:
    """sqrt(num / den): the relative L2 error of the sampled rows (NaN when the reading is non-finite;
    ``num`` itself for an all-zero exact output, where any error is absolute)."""
    if not (math.isfinite(num) and math.isfinite(den)):
        return float("nan")
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


# NOTE at least 4 steps from one anchor to the next, whatever the readings: an anchor costs a few dense steps and
# a reuse step a fraction of one, so anchoring every P steps costs (anchor + reuse (P - 1)) / P dense steps, above
# one dense step for P < 4. The gap keeps the guard from ever making a layer dearer than dense attention
# (measured costs: docs/mcsparse_guard.md).
MIN_GAP = 4


def should_reanchor(err: Optional[float], threshold: float, reuse_steps: int = MIN_GAP) -> bool:
    """Re-anchor when a finite reading exceeds a positive threshold (0 = the guard is off) and the
    next step is at least ``MIN_GAP`` steps after the anchor (``reuse_steps`` reuse steps ran since)."""
    return (threshold > 0 and err is not None and math.isfinite(err) and err > threshold
            and reuse_steps >= MIN_GAP - 1)


class Readback:
    """One [2] fp32 reading on its way to the host: on CUDA a non-blocking copy into pinned memory
    and an event (``ready`` polls the event, never waits); on other devices the value at once."""

    __slots__ = ("host", "event")

    def __init__(self, t: torch.Tensor):
        t = t.detach()
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = t, None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def value(self) -> float:
        return self.values()[0]

    def values(self) -> List[float]:
        """Every (num, den) pair of the reading as relative errors (a [2 n] reading)."""
        x = [float(v) for v in self.host.tolist()]
        return [rel_error(x[i], x[i + 1]) for i in range(0, len(x), 2)]


@dataclass
class GuardState:
    """The guard's part of one ``SparseMeta`` (one site, block and branch, since the last anchor)."""

    rows: torch.Tensor  # [B, H, R] int32 sampled query rows
    pending: Deque[Readback] = field(default_factory=lambda: collections.deque(maxlen=8))
    errors: List[float] = field(default_factory=list)  # read-back errors, oldest first (last _HISTORY)
    reuse_steps: int = 0  # reuse steps run since the anchor
    readings: int = 0  # readings read back since the anchor

    @classmethod
    def new(cls, q: torch.Tensor, rows: int = ROWS) -> "GuardState":
        B, H, S, _ = q.shape
        return cls(rows=_device_rows(B, H, S, rows, q.device))

    def record(self, err2: torch.Tensor) -> None:
        """Start reading back one step's (num, den) (``probe_error``); no sync."""
        self.pending.append(Readback(err2))
        self.reuse_steps += 1

    def poll(self) -> Optional[float]:
        """The newest finished reading since the last poll (None if none has finished); never waits.
        Readings finish in order (one stream), so the first unfinished one ends the scan."""
        err = None
        while self.pending and self.pending[0].ready():
            err = self.pending.popleft().value()
            self.errors.append(err)
            self.readings += 1
        del self.errors[:-_HISTORY]
        return err

    def first_over(self, threshold: float) -> bool:
        """Whether the first reading after the anchor already exceeded the threshold: then anchoring
        more often cannot meet it at this density (``guard_check`` warns once)."""
        first = self.errors[0] if self.readings == len(self.errors) and self.errors else None
        return should_reanchor(first, threshold)


def guard_check(meta, cfg):
    """(newest guard reading or None, re-anchor now?) for a call the MC-Sparse schedule made a reuse step:
    the reuse error measured at an earlier step of this (site, block, branch), read back without a sync.
    ``meta``: the cached ``mcsparse.SparseMeta`` (or None); its ``guard`` is None until a reuse step after
    the anchor has measured."""
    guard = getattr(meta, "guard", None)
    if guard is None or cfg.guard_threshold <= 0:
        return None, False
    err = guard.poll()
    if err is not None and guard.first_over(cfg.guard_threshold):
        _warn_unreachable(cfg.guard_threshold, cfg.density)
    return err, should_reanchor(err, cfg.guard_threshold, guard.reuse_steps)


@functools.lru_cache(maxsize=None)
def _warn_unreachable(threshold: float, density: float) -> None:
    warnings.warn(
        f"vcattn mcsparse: the first reuse step after an anchor already exceeds guard_threshold={threshold:g} "
        f"(relative error on sampled rows): re-anchoring cannot meet it at density={density:g}, the guard "
        f"re-anchors at most every {MIN_GAP} steps. Raise 'density' or 'guard_threshold', or use "
        "method='vsmooth'; report() shows each site's largest reading (err<=...).", RuntimeWarning, stacklevel=4)


# ---- the reuse check (option ``reuse_check``, on by default) ------------------------------------------------
# NOTE the first reuse step after an anchor is the one most in the method's favour (one step of drift since the
# selection and residual were made); the check compares it with what the previous step's output -- the anchor's,
# dense -- would give now, on the guard's sampled rows. Worse than that output and above CHECK_FLOOR, the reused
# selection and residual do harm rather than approximate: the inputs move too much (or are too diffuse and noisy)
# for this density. The floor keeps the check out of the 8-bit paths' own error class (V-Smooth 0.04-0.08 rel. L2
# on random inputs, ops.SHARP_ERR): a step that accurate is never refused. Measurements: docs/design/reuse-check.md.
CHECK_FLOOR = 0.05


@dataclass
class ReuseCheck:
    """One anchor's check: the sampled rows, the anchor's output on them, the first reuse step's reading."""

    rows: torch.Tensor  # [B, H, R] int32 (the guard's rows: ``sample_rows``)
    anchor_rows: torch.Tensor  # [B, H, R, Dv] the anchor step's output on those rows (its dtype)
    reading: Optional[Readback] = None  # (reuse num, den, anchor-output num, den); None until the step ran
    errors: Optional[Tuple[float, float]] = None  # (reuse step's error, the anchor output's error) once read
    failed: bool = False  # the reuse step was worse: this (site, block, branch) runs stock SDPA until its next anchor

    @classmethod
    def new(cls, q: torch.Tensor, out: torch.Tensor, rows: int = ROWS) -> "ReuseCheck":
        B, H, S, _ = q.shape
        r = _device_rows(B, H, S, rows, q.device)
        got = torch.gather(out, 2, r.long().unsqueeze(-1).expand(B, H, rows, out.shape[-1]))
        return cls(rows=r, anchor_rows=got.contiguous())

    @property
    def pending(self) -> bool:
        """The first reuse step has not run yet: the next reuse call measures (not replayable)."""
        return self.reading is None

    def poll(self) -> bool:
        """Whether the reuse step is known to be worse (reads the reading back once it has finished; no wait)."""
        if self.errors is None and self.reading is not None and self.reading.ready():
            e_reuse, e_anchor = self.reading.values()
            self.errors = (e_reuse, e_anchor)
            self.failed = worse_than_previous(e_reuse, e_anchor)
        return self.failed


def worse_than_previous(e_reuse: float, e_prev: float, floor: float = CHECK_FLOOR) -> bool:
    """The check's rule: a finite reading above ``floor`` and above the previous output's error (NaN: never)."""
    return math.isfinite(e_reuse) and math.isfinite(e_prev) and e_reuse > max(floor, e_prev)
