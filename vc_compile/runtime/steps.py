"""Sampler-step tracking (docs/methods.md, "Steps and phases"): which denoising step of how many is this attention call in?

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
   the frame: no GPU sync. Cost: one walk up the stack per attention call (tens of microseconds at
   most); the pipeline frame's ``f_locals`` (the dear part, several times that for a big ``__call__``) is
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
a new generation. A new generation drops all metadata its loop cached: the op (``ops.py``) subscribes the
store's ``clear`` with ``TRACKER.subscribe``.

Branch: within one (generation, step), the n-th call of the same (site, block identity) is branch n:
the cond/uncond forwards of Wan-style CFG keep separate metadata. Batched CFG (CogVideoX, LTX: B = 2 in
one call) is one branch; its rows are separate (b, h) slices of the per-(b, h) metadata. Counting calls
(instead of trusting the block identity alone) also keeps blocks apart when two blocks' weights share one
address within a step; addresses reused across steps are caught by the op (``ops.identity_problem``).

Loops: a tracker serves every compiled graph its loop calls (Wan 2.2's two experts, regional block graphs,
graphs split by breaks). Each ``with vc_compile.sampling(...)`` block is a loop of its own, with its own
tracker and metadata store (``runtime/runtime.py``: ``Loop``), active in the context that entered it: two
sampling loops running concurrently in different threads (or asyncio tasks) never share a step, a
generation or metadata. Interleaved generators in one thread share a context: call ``loop.step(i)`` on
the handle ``sampling()`` returns (``with vc_compile.sampling(num_steps=n) as loop:``), which makes that
loop the active one again, or run each generator in a context of its own (``contextvars.copy_context()``).
Everything outside a ``sampling()`` block (pipelines followed through their callback or their frame,
timestep and call-count fallbacks) shares the process's default loop: run such loops one at a time.
``TRACKER`` is the tracker of the loop active where it is used.
"""
from __future__ import annotations

import contextlib
import operator
import warnings
from typing import Optional

from .probe import _bump, _frame_timestep, _probe, _read_timestep  # noqa: F401  (re-exported)
from .runtime import Loop, active_loop, current
from .tracker import MAX_BRANCHES, StepInfo, Tracker, _TimestepState, _Tracker, _warn_stale_step  # noqa: F401


def active_tracker() -> Tracker:
    """The step tracker of the loop active here (the innermost open ``sampling()`` block of this context,
    else the process's default loop)."""
    return active_loop().tracker


class _ActiveTracker:
    """``TRACKER``: stands for the tracker of the loop active where an attribute is read (``TRACKER.current``,
    ``TRACKER.generation``, ``with TRACKER.lock:``), so code written for the one process-wide tracker keeps
    working and each ``sampling()`` block's calls reach its own. One ``ContextVar.get`` per access."""

    __slots__ = ()

    def __getattribute__(self, name):  # (not __getattr__: no failed lookup first; the op reads it per call)
        return getattr(active_loop().tracker, name)

    def __setattr__(self, name, value):
        setattr(active_loop().tracker, name, value)

    def __repr__(self) -> str:
        return f"<TRACKER: {active_loop().tracker!r}>"


TRACKER = _ActiveTracker()


# ---- public API ----------------------------------------------------------------------------------


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


class Sampling:
    """The handle of one ``sampling()`` block (``with vc_compile.sampling(num_steps=n) as loop:``): its loop
    (``loop.loop``: tracker and metadata store) and ``loop.step(i)``, which declares step ``i`` of this loop
    and makes it the active one in this context (interleaved generators: each finds its own loop)."""

    __slots__ = ("loop",)

    def __init__(self, loop: Loop):
        self.loop = loop

    @property
    def tracker(self) -> Tracker:
        return self.loop.tracker

    def step(self, i: int, num_steps: Optional[int] = None) -> None:
        """``vc_compile.step(i, num_steps)`` on this block's loop."""
        i, num_steps = _step_args(i, num_steps)
        self.loop.activate()
        _declare(self.loop.tracker, i, num_steps)


@contextlib.contextmanager
def sampling(num_steps: Optional[int] = None):
    """One generation of ``num_steps`` steps. Inside, ``vc_compile.step(i)`` declares each step; without
    it, the diffusers frame or the timestep input gives the step (``num_steps`` still overrides their
    step count), else each call of a site counts as one step. ``vc_compile.reset()`` inside the block
    starts a new generation and keeps ``num_steps``.

    The block is a loop of its own (its own step tracker and metadata store), active in the context that
    entered it: sampling loops in other threads never see its steps. Yields a ``Sampling`` handle."""
    if num_steps is not None:
        num_steps = _as_index(num_steps, 1, f"vc_compile.sampling(num_steps={num_steps!r}): num_steps must be "
                                            "an int >= 1")
    rt = current()
    loop, token = rt.open_loop(num_steps)
    try:
        yield Sampling(loop)
    finally:
        rt.close_loop(loop, token)


def _step_args(i, num_steps):
    i = _as_index(i, 0, f"vc_compile.step({i!r}): the step index must be an int >= 0 (a Python or numpy "
                        "integer, or a 0-d integer tensor)")
    if num_steps is not None:
        num_steps = _as_index(num_steps, 1, f"vc_compile.step(num_steps={num_steps!r}): num_steps must be an "
                                            "int >= 1")
    return i, num_steps


def step(i: int, num_steps: Optional[int] = None) -> None:
    """Declare that the next model calls belong to step ``i`` (0-based). A step index lower than the
    previous one starts a new generation. ``i`` may be an int, a numpy integer or a 0-d integer tensor.

    Outside ``sampling()`` the declaration is pinned: it stays in force for every later call until the
    next ``step()`` or ``vc_compile.reset()`` (said once per process, with a warning). Pinned, not "the
    next call only": one step is many attention calls (every block, every CFG forward) and nothing else
    marks where it ends. A declared step that keeps being re-entered (more than ``MAX_BRANCHES`` calls of
    one call site: no sampler makes that many forwards per step) warns at run time."""
    i, num_steps = _step_args(i, num_steps)
    tracker = active_tracker()
    if not tracker.explicit_active and current().once("steps", "step-outside-sampling"):
        n = num_steps if num_steps is not None else tracker.explicit_steps
        n = f"{n} steps per generation" if n else "steps per generation from the num_steps option"
        warnings.warn(
            f"vcattn: vc_compile.step({i}) outside `with vc_compile.sampling(num_steps=n):` pins step {i} for "
            f"every later model call until the next vc_compile.step() or vc_compile.reset() ({n}). In a "
            "sampling loop call step(i) before every step inside `with vc_compile.sampling(num_steps=n):` "
            "(which also ends the declaration when the loop ends).",
            UserWarning, stacklevel=2)
    _declare(tracker, i, num_steps)


def _declare(tracker: Tracker, i: int, num_steps: Optional[int]) -> None:
    with tracker.lock:
        if tracker.explicit_step is not None and i < tracker.explicit_step:
            tracker.pending_generation = False
            tracker._new_generation_locked()
        tracker.explicit_step = i
        if num_steps is not None:
            tracker.explicit_steps = num_steps


def diffusers_callback(pipe, i, t, callback_kwargs):
    """``callback_on_step_end`` helper for diffusers pipelines whose loop the frame probe does not
    recognise: declares step ``i + 1`` explicitly (the callback runs after step ``i``). Step 0 comes from
    the frame probe or the fallbacks; after the last step the declaration is dropped, so the next
    pipeline call starts a new generation at step 0. Inside a call tracked by ``vc_compile.enable`` it does
    nothing (the tracker already follows the loop's own callback)."""
    tracker = active_tracker()
    if any(call.pipe_ref() is pipe for call in tracker.calls):
        return callback_kwargs
    n = getattr(pipe, "_num_timesteps", None) or getattr(pipe, "num_timesteps", None)
    n = int(n) if n else None
    if n is not None and int(i) + 1 >= n:
        with tracker.lock:
            tracker.explicit_step = None
            if not tracker.explicit_active:
                tracker.explicit_steps = None
            tracker.pending_generation = True
        return callback_kwargs
    _declare(tracker, int(i) + 1, n)  # the documented helper: no "outside sampling()" warning
    return callback_kwargs
