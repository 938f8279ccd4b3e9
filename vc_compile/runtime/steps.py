"""Sampler-step tracking (SPEC 4): which denoising step of how many is this attention call in?

Everything here runs inside the opaque ``vcattn::attention`` op, at run time: Dynamo never sees it, so step
and branch changes never recompile. What a step *does* (its phase) is each method's schedule
(``methods/<method>.py: phase_for``).

Step signal, first that applies wins:

1. **explicit**: ``vc_compile.step(i)`` (usually inside ``with vc_compile.sampling(num_steps=n):``), or
   the ``vc_compile.diffusers_callback`` helper. Always wins; ``sampling(num_steps=n)`` also overrides
   the step count of every other signal.
2. **callback** (a pipeline set up by ``vc_compile.enable``): its ``__call__`` is wrapped and a step-end
   callback is chained after the user's own ``callback_on_step_end`` (diffusers' documented per-step hook,
   ``runtime/pipeline_calls.py``): step 0 when the call starts, ``i + 1`` after the callback of step ``i``,
   steps = the pipeline's public ``num_timesteps``. Reads no frame and no diffusers internals, so it
   survives changes to the loop's variable names; the frame probe below is the fallback for pipelines
   compiled by hand.
   **diffusers** (the frame probe): the call stack holds a diffusers pipeline ``__call__`` frame (``self``
   has a ``scheduler``) whose locals have the loop index ``i`` (every diffusers 0.42 denoising loop is
   ``for i, t in enumerate(...)``): step = ``i``, steps = ``pipe._num_timesteps`` (set before the loop;
   it is ``len(step_matrix)`` in SkyReels diffusion forcing) or ``len(timesteps)``. Python ints read from
   the frame: no GPU sync. Cost: one walk up the stack per attention call (~10-15 us on our slow 2-core
   CI machine); the pipeline frame's ``f_locals`` (the dear part, ~50 us for a big ``__call__``) is
   built once per step only: while the pipeline's ``_current_timestep`` (set to ``t`` by every loop
   before it calls the model) is the object seen last time, the last answer stands. A new generation
   starts when the loop's ``timesteps`` object changes (a new pipeline call: ``set_timesteps`` makes a
   new tensor; the tracker holds a reference so the identity test is sound) or ``i`` goes backwards
   (Wan-Animate / FramePack segment loops).
3. **timestep**: no pipeline frame (custom loops, ComfyUI-style callers, regional compile under them).
   The model's timestep is read from the innermost ``nn.Module`` call on the stack whose ``forward``
   has a parameter named ``timestep``/``timesteps``/``sigma``/``sigmas``/``t`` (found through the
   ``Module._call_impl`` frame's ``args``/``kwargs``, so it works for whole-model compile, where the
   model's own forward frame is replaced by Dynamo's, for regional compile and across graph breaks), or
   from a plain function on the stack with an argument ``timestep``/``t``/``sigma``.
   *Why the frame and not an extra op input:* regional compile (``compile_repeated_blocks``) and graphs
   after a graph break have no timestep placeholder, so an op input would cover only whole-model
   graphs; the frame covers all three and keeps the op signature unchanged.
   *Cost:* its value (``t.max()``: conditioning tokens may carry t = 0) is read **once per forward**:
   the tracker keeps the tensor it read and, while the same tensor object (same ``_version``) comes
   back, reuses the value. A CPU tensor or a Python number costs no sync; a CUDA tensor costs one
   device->host sync per forward (``counters["vcattn"]["timestep_sync"]``), never one per attention
   call. Loops that mind it use the explicit API (no sync at all).
   Rules: the same tensor object, or another tensor on the same storage (``t.expand(B)`` twice), is the
   same step (another CFG branch). A new value is a new step, unless it reverses the direction the
   generation has been moving in or returns to the generation's first value: then it is a new
   generation (so Mochi's increasing timesteps and sigma inputs in [0, 1] work like 999 -> 0). An
   equal value on another storage (UniPC with shift repeats 999, 999) is a new step, unless earlier
   steps showed more forwards per step than this step has had (CFG as two forwards with freshly
   allocated equal timesteps). A change of the batch shape of t starts a new generation. The step count
   is unknown here: ``sampling(num_steps=n)``'s if given, else the previous generation's count once one
   ended, else the ``num_steps`` option; a generation that runs past it starts afresh (a constant
   timestep, e.g. a context-parallel rank holding only t = 0 tokens, shows no restart).
   Known limit: two generations in a row whose timesteps run in opposite directions (999 -> 1, then
   Mochi's 0 -> 578) are told apart one step late (1 -> 0 still looks like the first run going on).
4. **call-count**: nothing at all tells us the step: every call of a (site, block) counts as one step,
   ``num_steps`` comes from the option, and ``num_steps`` calls make a generation (the next call starts
   a new one). Two calls per step (CFG as two forwards) then look like two steps: use
   ``vc_compile.sampling`` / ``vc_compile.step`` in such loops.

In the fallback signals (3, 4), a call site seeing a new q/k shape (new resolution or batch) also starts
a new generation. A new generation drops all cached metadata: the op (``ops.py``) subscribes the store's
``clear`` with ``TRACKER.subscribe``.

Branch: within one (generation, step), the n-th call of the same (site, block identity) is branch n:
the cond/uncond forwards of Wan-style CFG keep separate metadata. Batched CFG (CogVideoX, LTX: B = 2 in
one call) is one branch; its rows are separate (b, h) slices of the per-(b, h) metadata. Counting calls
(instead of trusting the block identity alone) also keeps blocks apart when two blocks' weights share one
address within a step; addresses reused across steps are caught by the op (``ops.identity_problem``).

One process-wide tracker serves every compiled graph (Wan 2.2's two experts, regional block graphs,
graphs split by breaks). Two sampling loops running concurrently in different threads would share it:
use one loop at a time per process.
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple


@dataclass(frozen=True)
class StepInfo:
    generation: int
    step: int
    num_steps: int
    branch: int
    source: str


def _bump(name: str, n: int = 1) -> None:
    from torch._dynamo.utils import counters

    counters["vcattn"][name] += n


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


class _Tracker:
    def __init__(self):
        self.lock = threading.RLock()
        self.generation = 0
        self._subscribers: List[Callable[[int], None]] = []  # run when a generation starts (``subscribe``)
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
        self.generation += 1
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
        """``vc_compile.reset()``: a fresh generation with no step declared. Inside ``sampling()`` the
        block's own state (its ``num_steps``, explicit mode) survives: ``sampling()`` restores it on exit,
        and a reset between two generations of one block must not fall back to ``num_steps=50``."""
        with self.lock:
            if not self.explicit_active:
                self.explicit_steps = None
            self.explicit_step = None
            self.pending_generation = False
            self.diff_token, self.diff_pipe, self.diff_step = None, 0, -1
            _LOOP.frame_id, _LOOP.pipe_ref, _LOOP.current_t, _LOOP.result = 0, None, None, None
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
                found, t_frame = _probe()
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


TRACKER = _Tracker()


# ---- signals 2 and 3: one walk up the stack ------------------------------------------------------
_MODULE_T_NAMES = ("timestep", "timesteps", "sigma", "sigmas", "t")
_FUNC_T_NAMES = ("timestep", "t", "sigma")
# plain functions count only among the first few frames outside torch and vc_compile (the compiled
# function itself, e.g. ``torch.compile(lambda x, t: model(x, t))``), never a far caller's ``t``
_FUNC_T_DEPTH = 3
_SKIP_DIRS: Optional[Tuple[str, ...]] = None  # torch's and our own package: never the caller's frames
_MODULE_FILE = os.path.join("nn", "modules", "module.py")
_PARAM_CACHE: Dict[type, Optional[Tuple[str, Optional[int]]]] = {}


def _skip_dirs() -> Tuple[str, ...]:
    global _SKIP_DIRS
    if _SKIP_DIRS is None:
        import torch

        _SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                           for m in (torch, sys.modules[__name__.split(".")[0]]))
    return _SKIP_DIRS


def _probe(max_depth: int = 96):
    """One walk from the op outwards: (diffusers loop or None, timestep frame or None).

    The diffusers loop is ``(timesteps token, pipeline, i, steps)`` of the innermost pipeline frame. The
    timestep frame is the innermost frame that holds the model's timestep, as (frame, kind). Building a
    frame's ``f_locals`` is the costly part (tens of microseconds for a big frame), so only the pipeline
    candidates are read during the walk; module-call frames are read only when no pipeline was found."""
    try:
        f = sys._getframe(2)  # _probe <- current <- the op
    except ValueError:
        return None, None
    skip = _skip_dirs()
    cands = []  # (frame, kind) that may hold the timestep, innermost first
    user_frames = 0
    depth = 0
    while f is not None and depth < max_depth:
        code = f.f_code
        name = code.co_name
        if name == "__call__":
            if "self" in code.co_varnames and ("i" in code.co_varnames or "i" in code.co_cellvars):
                found = _pipeline_loop(f)
                if found is not None:
                    return found, None
        else:
            fname = code.co_filename
            if name == "_call_impl" and fname.endswith(_MODULE_FILE):
                cands.append((f, "module"))
            elif not fname.startswith(skip) and not fname.startswith("<"):
                user_frames += 1
                if user_frames <= _FUNC_T_DEPTH:
                    argnames = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
                    if any(n in argnames for n in _FUNC_T_NAMES):
                        cands.append((f, "function"))
        f = f.f_back
        depth += 1
    for f, kind in cands:
        if kind == "function" or _frame_module_t(f, peek=True):
            return None, (f, kind)
    return None, None


class _LoopCache:
    """Skips building the pipeline frame's ``f_locals`` (the costly part of the probe) while the loop is
    provably on the same step: same frame, and the pipeline's ``_current_timestep`` (every diffusers
    loop sets it to ``t`` before calling the model) is the very object seen last time. The tracker holds
    that object, so its identity cannot be reused; the pipeline is held weakly."""

    frame_id: int = 0
    pipe_ref: Any = None
    current_t: Any = None
    result: Any = None


_LOOP = _LoopCache()


def _pipeline_loop(f):
    c = _LOOP
    if c.frame_id == id(f) and c.current_t is not None:
        pipe = c.pipe_ref() if c.pipe_ref is not None else None
        if pipe is not None and getattr(pipe, "__dict__", {}).get("_current_timestep") is c.current_t:
            token, i, n = c.result
            return token, pipe, i, n
    found = _pipeline_loop_read(f)
    c.frame_id, c.pipe_ref, c.current_t, c.result = 0, None, None, None
    if found is not None:
        token, pipe, i, n = found
        ct = getattr(pipe, "__dict__", {}).get("_current_timestep")
        try:
            c.pipe_ref = weakref.ref(pipe)
        except TypeError:  # a pipeline that cannot be weakly referenced: no cache
            return found
        c.frame_id, c.current_t, c.result = id(f), ct, (token, i, n)
    return found


def _pipeline_loop_read(f):
    loc = f.f_locals
    i = loc.get("i")
    pipe = loc.get("self")
    if type(i) is not int or i < 0 or pipe is None or getattr(pipe, "scheduler", None) is None:
        return None
    timesteps = loc.get("timesteps")
    n = None
    declared = getattr(pipe, "__dict__", {}).get("_num_timesteps")
    if type(declared) is int and declared > i:
        n = declared
    elif timesteps is not None:
        try:
            m = len(timesteps)
        except TypeError:
            m = None
        if m and m > i:
            n = m
    if n is None:
        return None
    token = timesteps if timesteps is not None else getattr(pipe.scheduler, "timesteps", None)
    return token, pipe, i, n


def _module_t_param(mod_type: type):
    """(name, positional index or None) of ``mod_type.forward``'s timestep parameter, or None."""
    try:
        return _PARAM_CACHE[mod_type]
    except KeyError:
        pass
    found = None
    try:
        params = list(inspect.signature(mod_type.forward).parameters.values())
    except (TypeError, ValueError, AttributeError):
        params = []
    if params and params[0].name == "self":
        params = params[1:]
    by_name = {p.name: p for p in params}
    for name in _MODULE_T_NAMES:
        p = by_name.get(name)
        if p is not None and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            pos = params.index(p) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
            found = (name, pos)
            break
    _PARAM_CACHE[mod_type] = found
    return found


def _usable(x) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() > 0 and not x.is_complex()
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _frame_module_t(f, peek: bool = False):
    """The timestep argument of the module call in this ``Module._call_impl`` frame (``peek``: only
    whether its module's forward has a timestep parameter)."""
    loc = f.f_locals
    mod = loc.get("self")
    spec = _module_t_param(type(mod)) if mod is not None else None
    if spec is None or peek:
        return spec is not None
    name, pos = spec
    kwargs = loc.get("kwargs") or {}
    args = loc.get("args") or ()
    val = kwargs.get(name) if name in kwargs else (args[pos] if pos is not None and pos < len(args) else None)
    return val if val is not None and _usable(val) else None


def _frame_timestep(f, kind: str):
    """(the timestep value held by the frame ``_probe`` chose,) or None."""
    if kind == "module":
        val = _frame_module_t(f)
        return (val,) if val is not None else None
    loc = f.f_locals
    for n in _FUNC_T_NAMES:
        val = loc.get(n)
        if val is not None and _usable(val):
            return (val,)
    return None


def _read_timestep(t) -> Tuple[float, Optional[int], tuple]:
    """(value, storage pointer or None, batch shape) of a timestep input. One host read: a device->host
    sync when t lives on a GPU (counted), free on CPU."""
    import torch

    if not isinstance(t, torch.Tensor):
        return float(t), None, ()
    if t.device.type != "cpu":
        _bump("timestep_sync")
    v = t.detach()
    v = v.max() if v.numel() > 1 else v.reshape(())
    return float(v.item()), t.data_ptr(), tuple(t.shape[:1])


# ---- public API ----------------------------------------------------------------------------------
# More calls of one (site, block) within one declared step than any CFG scheme makes (cond / uncond /
# image guidance: <= 3 forwards per step) mean the declaration went stale: nobody advances the step.
MAX_BRANCHES = 8
_WARNED: Set[str] = set()  # one-time warnings already given in this process


def _as_index(x, minimum: int, error: str) -> int:
    """``x`` as a Python int >= ``minimum``: ints, numpy integers and 0-d integer tensors (``step(t)``
    with ``t = torch.tensor(3)``) are accepted; floats, bools and arrays raise ``ValueError(error)``."""
    ok = not isinstance(x, bool) and "bool" not in str(getattr(x, "dtype", "")) and getattr(x, "ndim", 0) == 0
    try:
        v = operator.index(x) if ok else None
    except TypeError:
        v = None
    if v is None or v < minimum:
        raise ValueError(error)
    return v


def _warn_stale_step(step: int, calls: int) -> None:
    _bump("stale_explicit_step")
    warnings.warn(
        f"vcattn: step {step} was declared (vc_compile.step({step})) and one attention call site has run "
        f"{calls} times in it since: each call counts as another CFG branch of that step, so every call "
        f"recomputes its metadata (MC-Sparse re-anchors every call) and the metadata held grows. In a "
        f"sampling loop call vc_compile.step(i) before every step's forward, inside `with "
        f"vc_compile.sampling(num_steps=n):`; or call vc_compile.reset() to drop the declaration.",
        UserWarning, stacklevel=4)


@contextlib.contextmanager
def sampling(num_steps: Optional[int] = None):
    """One generation of ``num_steps`` steps. Inside, ``vc_compile.step(i)`` declares each step; without
    it, the diffusers frame or the timestep input gives the step (``num_steps`` still overrides their
    step count), else each call of a site counts as one step. ``vc_compile.reset()`` inside the block
    starts a new generation and keeps ``num_steps``."""
    if num_steps is not None:
        num_steps = _as_index(num_steps, 1, f"vc_compile.sampling(num_steps={num_steps!r}): num_steps must be "
                                            "an int >= 1")
    with TRACKER.lock:
        saved = (TRACKER.explicit_active, TRACKER.explicit_steps, TRACKER.explicit_step)
        TRACKER.explicit_active, TRACKER.explicit_steps, TRACKER.explicit_step = True, num_steps, None
        TRACKER.pending_generation = False
        TRACKER.last_source = None
        TRACKER._new_generation_locked()
    try:
        yield
    finally:
        with TRACKER.lock:
            TRACKER.explicit_active, TRACKER.explicit_steps, TRACKER.explicit_step = saved
            TRACKER.last_source = None
            TRACKER.pending_generation = True  # whatever runs next is another generation


def step(i: int, num_steps: Optional[int] = None) -> None:
    """Declare that the next model calls belong to step ``i`` (0-based). A step index lower than the
    previous one starts a new generation. ``i`` may be an int, a numpy integer or a 0-d integer tensor.

    Outside ``sampling()`` the declaration is pinned: it stays in force for every later call until the
    next ``step()`` or ``vc_compile.reset()`` (said once per process, with a warning). Pinned, not "the
    next call only": one step is many attention calls (every block, every CFG forward) and nothing else
    marks where it ends. A declared step that keeps being re-entered (more than ``MAX_BRANCHES`` calls of
    one call site: no sampler makes that many forwards per step) warns at run time."""
    i = _as_index(i, 0, f"vc_compile.step({i!r}): the step index must be an int >= 0 (a Python or numpy "
                        "integer, or a 0-d integer tensor)")
    if num_steps is not None:
        num_steps = _as_index(num_steps, 1, f"vc_compile.step(num_steps={num_steps!r}): num_steps must be an "
                                            "int >= 1")
    if not TRACKER.explicit_active and "step-outside-sampling" not in _WARNED:
        _WARNED.add("step-outside-sampling")
        n = num_steps if num_steps is not None else TRACKER.explicit_steps
        n = f"{n} steps per generation" if n else "steps per generation from the num_steps option"
        warnings.warn(
            f"vcattn: vc_compile.step({i}) outside `with vc_compile.sampling(num_steps=n):` pins step {i} for "
            f"every later model call until the next vc_compile.step() or vc_compile.reset() ({n}). In a "
            "sampling loop call step(i) before every step inside `with vc_compile.sampling(num_steps=n):` "
            "(which also ends the declaration when the loop ends).",
            UserWarning, stacklevel=2)
    _declare(i, num_steps)


def _declare(i: int, num_steps: Optional[int]) -> None:
    with TRACKER.lock:
        if TRACKER.explicit_step is not None and i < TRACKER.explicit_step:
            TRACKER.pending_generation = False
            TRACKER._new_generation_locked()
        TRACKER.explicit_step = i
        if num_steps is not None:
            TRACKER.explicit_steps = num_steps


def diffusers_callback(pipe, i, t, callback_kwargs):
    """``callback_on_step_end`` helper for diffusers pipelines whose loop the frame probe does not
    recognise: declares step ``i + 1`` explicitly (the callback runs after step ``i``). Step 0 comes from
    the frame probe or the fallbacks; after the last step the declaration is dropped, so the next
    pipeline call starts a new generation at step 0. Inside a call tracked by ``vc_compile.enable`` it does
    nothing (the tracker already follows the loop's own callback)."""
    if any(call.pipe_ref() is pipe for call in TRACKER.calls):
        return callback_kwargs
    n = getattr(pipe, "_num_timesteps", None) or getattr(pipe, "num_timesteps", None)
    n = int(n) if n else None
    if n is not None and int(i) + 1 >= n:
        with TRACKER.lock:
            TRACKER.explicit_step = None
            if not TRACKER.explicit_active:
                TRACKER.explicit_steps = None
            TRACKER.pending_generation = True
        return callback_kwargs
    _declare(int(i) + 1, n)  # the documented helper: no "outside sampling()" warning
    return callback_kwargs
