"""Sampler-step tracking and the phase schedule (SPEC 4).

Which denoising step is this attention call in, and what should it do?

Step signal, first that applies wins:
1. **explicit**: ``with vc_compile.sampling(num_steps=n):`` + ``vc_compile.step(i)`` (or the
   ``vc_compile.diffusers_callback`` helper). Always wins.
2. **diffusers**: the call stack holds a diffusers pipeline ``__call__`` frame whose locals have the loop
   index ``i`` and ``timesteps`` (every diffusers 0.42 denoising loop is
   ``for i, t in enumerate(timesteps)``): step = ``i``, steps = ``len(timesteps)``. Python ints, no GPU
   sync (~ microseconds per call).
3. **call-count** (documented fallback): nothing tells us the step, so every call of a (site, block)
   counts as one step, and ``num_steps`` comes from the ``num_steps`` option. Two calls per step (CFG
   as two forwards) then look like two steps: use ``vc_compile.sampling`` in such loops.

A *generation* is one sampling run. Entering ``sampling()``, a new diffusers pipeline call, or the
step index going backwards starts a new one; a new generation drops all cached metadata.

Branch: within one (generation, step), the n-th call of the same (site, block) is branch n (the
cond/uncond forwards of Wan-style CFG), so each branch keeps its own metadata.

Phases: DENSE (warm-up), GROUP (V-Smooth re-grouping), ANCHOR (MC-Sparse selection + residual),
REUSE (run with cached metadata). None of this is visible to Dynamo: it all runs inside the opaque op,
so step and phase changes never recompile.
"""
from __future__ import annotations

import contextlib
import enum
import math
import sys
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..config import Method, VCConfig


class Phase(str, enum.Enum):
    DENSE = "dense"
    GROUP = "group"
    ANCHOR = "anchor"
    REUSE = "reuse"


@dataclass(frozen=True)
class StepInfo:
    generation: int
    step: int
    num_steps: int
    branch: int
    source: str


class _Tracker:
    def __init__(self):
        self.lock = threading.RLock()
        self.generation = 0
        self.explicit_active = False
        self.explicit_steps: Optional[int] = None
        self.explicit_step: Optional[int] = None
        self.last_diffusers: Optional[Tuple[int, int, int]] = None  # (id(frame), id(pipe), i)
        self.branch_seen: Dict[tuple, Tuple[int, int, int]] = {}  # key -> (gen, step, count)
        self.call_counts: Dict[tuple, Tuple[int, int]] = {}  # key -> (gen, count)
        self.listeners = []  # callables(generation) run when a generation starts

    # ---- generations ---------------------------------------------------------------------------
    def new_generation(self) -> int:
        with self.lock:
            self.generation += 1
            self.branch_seen.clear()
            self.call_counts.clear()
            gen = self.generation
        for fn in list(self.listeners):
            fn(gen)
        return gen

    def reset(self) -> None:
        with self.lock:
            self.explicit_active = False
            self.explicit_steps = self.explicit_step = None
            self.last_diffusers = None
        self.new_generation()

    # ---- the step of one call -----------------------------------------------------------------
    def current(self, key: tuple, default_steps: int) -> StepInfo:
        with self.lock:
            if self.explicit_step is not None:
                step, n, src = self.explicit_step, self.explicit_steps or default_steps, "explicit"
            else:
                found = None if self.explicit_active else _diffusers_step()
                if found is not None:
                    frame_id, pipe_id, step, n = found
                    last = self.last_diffusers
                    if last is None or (frame_id, pipe_id) != last[:2] or step < last[2]:
                        self._new_generation_locked()
                    self.last_diffusers = (frame_id, pipe_id, step)
                    src = "diffusers"
                else:
                    gen, count = self.call_counts.get(key, (self.generation, 0))
                    if gen != self.generation:
                        count = 0
                    self.call_counts[key] = (self.generation, count + 1)
                    step, src = count, "call-count"
                    n = self.explicit_steps or default_steps
            gen = self.generation
            prev = self.branch_seen.get(key)
            branch = prev[2] + 1 if prev is not None and prev[:2] == (gen, step) else 0
            if src == "call-count":
                branch = 0
            self.branch_seen[key] = (gen, step, branch)
            return StepInfo(gen, step, n, branch, src)

    def _new_generation_locked(self) -> None:
        # called with the lock held; listeners take their own locks
        self.generation += 1
        self.branch_seen.clear()
        self.call_counts.clear()
        gen = self.generation
        for fn in list(self.listeners):
            fn(gen)


TRACKER = _Tracker()


def _diffusers_step(max_depth: int = 48):
    """(id(frame), id(pipeline), i, len(timesteps)) of the innermost diffusers denoising loop, or None."""
    try:
        f = sys._getframe(2)
    except ValueError:
        return None
    depth = 0
    while f is not None and depth < max_depth:
        if f.f_code.co_name == "__call__":
            loc = f.f_locals
            if "i" in loc and "timesteps" in loc:
                pipe = loc.get("self")
                i = loc["i"]
                if pipe is not None and hasattr(pipe, "scheduler") and isinstance(i, int):
                    try:
                        n = len(loc["timesteps"])
                    except TypeError:
                        n = None
                    if n:
                        return id(f), id(pipe), i, n
        f = f.f_back
        depth += 1
    return None


# ---- public API ----------------------------------------------------------------------------------
@contextlib.contextmanager
def sampling(num_steps: Optional[int] = None):
    """One generation of ``num_steps`` steps. Inside, call ``vc_compile.step(i)`` at each step (without
    it, each call of a site counts as one step)."""
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
        raise ValueError(f"vc_compile.sampling(num_steps={num_steps!r}): num_steps must be an int >= 1")
    with TRACKER.lock:
        saved = (TRACKER.explicit_active, TRACKER.explicit_steps, TRACKER.explicit_step)
        TRACKER.explicit_active, TRACKER.explicit_steps, TRACKER.explicit_step = True, num_steps, None
    TRACKER.new_generation()
    try:
        yield
    finally:
        with TRACKER.lock:
            TRACKER.explicit_active, TRACKER.explicit_steps, TRACKER.explicit_step = saved


def step(i: int, num_steps: Optional[int] = None) -> None:
    """Declare that the next model calls belong to step ``i`` (0-based). A step index lower than the
    previous one starts a new generation."""
    if not isinstance(i, int) or i < 0:
        raise ValueError(f"vc_compile.step({i!r}): the step index must be an int >= 0")
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
        raise ValueError(f"vc_compile.step(num_steps={num_steps!r}): num_steps must be an int >= 1")
    new_gen = False
    with TRACKER.lock:
        if TRACKER.explicit_step is not None and i < TRACKER.explicit_step:
            new_gen = True
        TRACKER.explicit_step = i
        if num_steps is not None:
            TRACKER.explicit_steps = num_steps
    if new_gen:
        TRACKER.new_generation()


def diffusers_callback(pipe, i, t, callback_kwargs):
    """``callback_on_step_end`` helper for diffusers pipelines: declares the next step explicitly."""
    n = getattr(pipe, "_num_timesteps", None) or getattr(pipe, "num_timesteps", None)
    step(int(i) + 1, int(n) if n else None)
    return callback_kwargs


# ---- the schedule -------------------------------------------------------------------------------
def warmup_steps(cfg: VCConfig, n: int) -> int:
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    return int(round(0.2 * n)) if cfg.resolved_method == Method.MCSPARSE else 0


def anchor_steps(cfg: VCConfig, n: int) -> Tuple[int, ...]:
    if cfg.anchor_steps is not None:
        return tuple(cfg.anchor_steps)
    w = warmup_steps(cfg, n)
    if cfg.anchor_interval is not None:
        return tuple(range(w, max(n, w + 1), cfg.anchor_interval))
    # the paper's example: anchors at steps 10 and 26 of 50, after 10 dense warm-up steps
    return tuple(sorted({w, max(w, int(round(0.52 * n)))}))


def phase_for(cfg: VCConfig, step: int, n: int, has_meta: bool) -> Phase:
    method = cfg.resolved_method
    if method == Method.DENSE or step < warmup_steps(cfg, n):
        return Phase.DENSE
    if method == Method.VSMOOTH:
        if not cfg.smooth_v:
            return Phase.REUSE  # naive 8-bit: nothing to group
        in_window = step < max(1, math.ceil(cfg.group_fraction * n)) if cfg.group_fraction > 0 else False
        return Phase.GROUP if (in_window or not has_meta) else Phase.REUSE
    # MC-Sparse
    if step in anchor_steps(cfg, n) or not has_meta:
        return Phase.ANCHOR
    return Phase.REUSE
