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
import operator
import warnings
from typing import Optional, Set

from .probe import _bump, _frame_timestep, _probe, _read_timestep  # noqa: F401  (re-exported)
from .runtime import current
from .tracker import MAX_BRANCHES, StepInfo, Tracker, _TimestepState, _Tracker, _warn_stale_step  # noqa: F401

TRACKER = current().tracker  # the process's step tracker (held by its Runtime, runtime/runtime.py)


# ---- public API ----------------------------------------------------------------------------------
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
