"""The step tracker: the (generation, step, steps, branch, source) of one ``vcattn::attention`` call.

The signals it reads, in order, and the rules of each are in ``runtime/steps.py``'s module docstring (the
public API lives there too); the stack walk behind signals 2 and 3 is ``runtime/probe.py``.
"""
from __future__ import annotations

import itertools
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .probe import LoopCache, _bump, _frame_timestep, _probe, _read_timestep

# More calls of one (site, block) within one declared step than any CFG scheme makes (cond / uncond /
# image guidance: <= 3 forwards per step) mean the declaration went stale: nobody advances the step.
MAX_BRANCHES = 8


@dataclass(frozen=True)
class StepInfo:
    generation: int
    step: int
    num_steps: int
    branch: int
    source: str



@dataclass
class _TimestepState:
    """Signal 3's view of the current generation."""

    obj: Any = None  # the tensor last read (strong reference: keeps its identity unambiguous)
    version: int = -1
    step: int = -1  # -1: nothing seen in this generation yet
    value: Optional[float] = None
    first: Optional[float] = None
    direction: int = 0  # +1 / -1 once two distinct values were seen
    ptrs: Set[int] = field(default_factory=set)  # storages that carried this step's value
    batch_shape: Optional[tuple] = None
    forwards_per_step: int = 0  # learned from completed steps (0 = unknown)


class Tracker:
    """The step state of one loop (``runtime/runtime.py``: the default loop's, or a ``sampling()`` block's).
    ``subscribers`` and ``generations`` are shared by a runtime's trackers: the functions run when any
    generation starts, and the generation numbers (unique across loops)."""

    def __init__(self, subscribers: Optional[List[Callable[[int], None]]] = None, generations=None):
        self.lock = threading.RLock()
        self.generation = 0
        # run when a generation starts (``subscribe``)
        self._subscribers: List[Callable[[int], None]] = subscribers if subscribers is not None else []
        self._generations = generations if generations is not None else itertools.count(1)
        self.loop_cache = LoopCache()  # the diffusers frame's per-step memo (``probe.LoopCache``)
        # explicit API
        self.explicit_active = False
        self.explicit_steps: Optional[int] = None
        self.explicit_step: Optional[int] = None
        self.pending_generation = False  # diffusers_callback saw the last step: next call starts anew
        # diffusers frame
        self.diff_token: Any = None  # the loop's timesteps object (strong reference)
        self.diff_pipe = 0  # id() of the pipeline
        self.diff_step = -1
        # pipeline calls tracked through their callback_on_step_end (vc_compile.enable), innermost last
        self.calls: list = []
        # fallbacks
        self.ts = _TimestepState()
        self.learned_steps: Optional[int] = None
        self.last_source: Optional[str] = None
        self.key_shapes: Dict[tuple, tuple] = {}
        # per-key accounting
        self.branch_seen: Dict[tuple, Tuple[int, int, int]] = {}  # key -> (gen, step, branch)
        self.call_counts: Dict[tuple, Tuple[int, int]] = {}  # key -> (gen, count)
        self.step_forwards = 0  # max branch + 1 seen in the current (gen, step) of signal 3
        self.stale_warned: Optional[Tuple[int, int]] = None  # (gen, step) of the last stale-step warning

    # ---- generations ---------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(generation)`` whenever a generation starts (idempotent per function)."""
        with self.lock:
            if fn not in self._subscribers:
                self._subscribers.append(fn)

    def new_generation(self) -> int:
        with self.lock:
            return self._new_generation_locked()

    def _new_generation_locked(self) -> int:
        # called with the lock held (an RLock: listeners may take it again)
        self.generation = next(self._generations)
        self.branch_seen.clear()
        self.call_counts.clear()
        self.key_shapes.clear()
        fps = self.ts.forwards_per_step
        self.ts = _TimestepState(forwards_per_step=fps)
        self.step_forwards = 0
        gen = self.generation
        for fn in list(self._subscribers):
            fn(gen)
        return gen

    def reset(self) -> None:
        """``vc_compile.reset()``: a fresh generation with no step declared. A ``sampling()`` block's tracker
        keeps its ``num_steps`` and explicit mode: a reset between two generations of one block must not
        fall back to ``num_steps=50``."""
        with self.lock:
            if not self.explicit_active:
                self.explicit_steps = None
            self.explicit_step = None
            self.pending_generation = False
            self.diff_token, self.diff_pipe, self.diff_step = None, 0, -1
            self.loop_cache.clear()
            self.learned_steps = None
            self.last_source = None
            self._new_generation_locked()
            self.ts = _TimestepState()

    # ---- the step of one call -----------------------------------------------------------------
    def current(self, key: tuple, default_steps: int, shape: Optional[tuple] = None) -> StepInfo:
        """The (generation, step, steps, branch, source) of one op call of ``key`` = (site, block)."""
        with self.lock:
            if self.pending_generation:
                self.pending_generation = False
                self.last_source = None
                self._new_generation_locked()
            if self.explicit_step is not None:
                step, n, src = self.explicit_step, self.explicit_steps or default_steps, "explicit"
            elif self.calls:
                call = self.calls[-1]
                if call.restart:  # the loop ran its last step and goes on (a segment loop): a new generation
                    call.restart = False
                    self._new_generation_locked()
                step, src = call.step, "callback"
                n = self.explicit_steps or call.num_steps(default_steps)
            else:
                found, t_frame = _probe(self.loop_cache)
                if found is not None:
                    token, pipe, step, n = found
                    # the token (the loop's timesteps) is held, so its identity is never reused; the
                    # pipeline is only compared by id (holding it would keep its weights alive)
                    if token is not self.diff_token or id(pipe) != self.diff_pipe or step < self.diff_step:
                        self._new_generation_locked()
                    self.diff_token, self.diff_pipe, self.diff_step = token, id(pipe), step
                    src = "diffusers"
                    n = self.explicit_steps or n
                else:
                    t = _frame_timestep(*t_frame) if t_frame is not None else None
                    src = "timestep" if t is not None else "call-count"
                    if self.last_source != src and self.last_source is not None:
                        self._new_generation_locked()  # another loop took over
                    self._check_shape(key, shape)
                    n = self.explicit_steps or self.learned_steps or default_steps
                    if t is not None:
                        step = self._timestep_step(t[0], n)
                        n = self.explicit_steps or self.learned_steps or default_steps  # a restart learns n
                    else:
                        gen, count = self.call_counts.get(key, (self.generation, 0))
                        if gen != self.generation:
                            count = 0
                        if count >= n:  # n calls make a generation: the next one starts afresh
                            _bump("generation:wrap")
                            self._new_generation_locked()
                            count = 0
                        self.call_counts[key] = (self.generation, count + 1)
                        step = count
            self.last_source = src
            gen = self.generation
            prev = self.branch_seen.get(key)
            branch = prev[2] + 1 if prev is not None and prev[:2] == (gen, step) else 0
            if src == "call-count":
                branch = 0
            elif src == "explicit" and branch == MAX_BRANCHES and self.stale_warned != (gen, step):
                self.stale_warned = (gen, step)
                _warn_stale_step(step, branch + 1)
            self.branch_seen[key] = (gen, step, branch)
            if src == "timestep":
                self.step_forwards = max(self.step_forwards, branch + 1)
            return StepInfo(gen, step, n, branch, src)

    def _check_shape(self, key: tuple, shape: Optional[tuple]) -> None:
        if shape is None:
            return
        old = self.key_shapes.get(key)
        if old is not None and old != shape:
            _bump("generation:shape_change")
            self._new_generation_locked()
        self.key_shapes[key] = shape

    def _timestep_step(self, t: Any, n: int) -> int:
        ts = self.ts
        if t is ts.obj and getattr(t, "_version", 0) == ts.version:
            return ts.step  # the same forward (or the same timestep object again: the same step)
        value, ptr, bshape = _read_timestep(t)
        if ts.step >= 0 and bshape != ts.batch_shape:
            _bump("generation:batch_change")
            self._new_generation_locked()
        ts = self.ts
        if ts.step < 0:  # first forward of a generation
            self._seed(value, ptr)
        elif value == ts.value:
            same_storage = ptr is not None and ptr in ts.ptrs
            if same_storage or (ts.forwards_per_step and self.step_forwards < ts.forwards_per_step):
                if ptr is not None:
                    ts.ptrs.add(ptr)
            else:  # a repeated value (UniPC 999, 999) on new storage: the next step
                self._next_step(value, ptr, n)
        else:
            d = 1 if value > ts.value else -1
            if (ts.direction and d != ts.direction) or value == ts.first:
                self.learned_steps = ts.step + 1
                _bump("generation:timestep_restart")
                self._new_generation_locked()
                self._seed(value, ptr)
            else:
                self.ts.direction = d
                self._next_step(value, ptr, n)
        ts = self.ts
        ts.obj, ts.version, ts.batch_shape = t, getattr(t, "_version", 0), bshape
        return ts.step

    def _seed(self, value: float, ptr: Optional[int]) -> None:
        ts = self.ts
        ts.step, ts.value, ts.first, ts.direction = 0, value, value, 0
        ts.ptrs = {ptr} if ptr is not None else set()

    def _next_step(self, value: float, ptr: Optional[int], n: int) -> None:
        ts = self.ts
        ts.forwards_per_step = max(self.step_forwards, 1)
        self.step_forwards = 0
        if ts.step + 1 >= n:
            # more steps than a generation has (a constant timestep, e.g. a context-parallel rank that
            # holds only t = 0 tokens, gives no restart to see): start afresh rather than run on
            _bump("generation:wrap")
            self._new_generation_locked()
            self._seed(value, ptr)
            return
        ts.step += 1
        ts.value = value
        ts.ptrs = {ptr} if ptr is not None else set()


def _warn_stale_step(step: int, calls: int) -> None:
    _bump("stale_explicit_step")
    warnings.warn(
        f"vcattn: step {step} was declared (vc_compile.step({step})) and one attention call site has run "
        f"{calls} times in it since: each call counts as another CFG branch of that step, so every call "
        f"recomputes its metadata (MC-Sparse re-anchors every call) and the metadata held grows. In a "
        f"sampling loop call vc_compile.step(i) before every step's forward, inside `with "
        f"vc_compile.sampling(num_steps=n):`; or call vc_compile.reset() to drop the declaration.",
        UserWarning, stacklevel=4)


_Tracker = Tracker  # the name it had in steps.py
