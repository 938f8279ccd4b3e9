"""Step tracking through a diffusers pipeline's documented per-step hook, ``callback_on_step_end``.

``track(pipe)`` (called by ``vc_compile.enable``) gives that one pipeline object a ``__call__`` that opens a
``PipelineCall`` in the step tracker of the loop active where it is called (a new generation at step 0), chains a step-end callback *after* the
user's own ``callback_on_step_end`` and closes the call when the pipeline returns. Each callback of step
``i`` moves the tracker to step ``i + 1``; the step count is the pipeline's public ``num_timesteps``. Nothing
here reads a frame or a loop variable, so it does not depend on how a diffusers version writes its loop
(the frame probe in ``steps.py`` stays as the fallback for pipelines compiled by hand).

How the user's callback is kept: a plain function is called first and its result returned; a diffusers
``PipelineCallback`` / ``MultiPipelineCallbacks`` (whose ``tensor_inputs`` the pipeline reads) is wrapped in
a ``MultiPipelineCallbacks`` with ours last (``tensor_inputs`` unchanged).

How the call is wrapped: Python looks ``__call__`` up on the type, so the object's class is swapped for a
subclass of the same name, module and docstring that only overrides ``__call__`` (``isinstance`` and the
pipeline's config are unchanged); ``untrack`` swaps it back. Pipelines whose ``__call__`` has no
``callback_on_step_end`` parameter are left alone.
"""
from __future__ import annotations

import functools
import inspect
import types
import weakref
from typing import Dict, Optional

from .steps import active_tracker


class PipelineCall:
    """One tracked pipeline ``__call__``. ``step`` is the step the next model calls belong to: 0 at the
    start, ``i + 1`` after the callback of step ``i``. The pipeline is held weakly."""

    __slots__ = ("pipe_ref", "step", "last", "restart", "tracker")

    def __init__(self, pipe):
        self.pipe_ref = weakref.ref(pipe)
        self.step, self.last, self.restart = 0, -1, False
        self.tracker = None  # the tracker of the loop the call runs in (``begin_call``)

    def num_steps(self, default: int) -> int:
        """The loop's step count: the pipeline's public ``num_timesteps`` (``len(timesteps)``, set before
        the loop), else ``len(scheduler.timesteps)``, else ``default``."""
        pipe = self.pipe_ref()
        if pipe is None:
            return default
        try:
            n = getattr(pipe, "num_timesteps", None)
        except Exception:  # noqa: BLE001 - a property that fails before the loop sets its attribute
            n = None
        if type(n) is not int or n < 1:
            try:
                n = len(pipe.scheduler.timesteps)
            except Exception:  # noqa: BLE001 - no scheduler or no timesteps yet
                n = None
        return n if n else default


def begin_call(pipe) -> PipelineCall:
    """A tracked pipeline call starts: a new generation at step 0."""
    tracker = active_tracker()
    with tracker.lock:
        call = PipelineCall(pipe)
        call.tracker = tracker
        tracker.calls.append(call)
        tracker.pending_generation = False
        tracker.last_source = None
        tracker._new_generation_locked()
        return call


def step_end(call: PipelineCall, i: int) -> None:
    """The callback of step ``i`` ran: the next model calls belong to step ``i + 1``; after the last step
    they start a new generation at step 0 (segment loops run the schedule again)."""
    tracker = call.tracker
    with tracker.lock:
        i = int(i)
        if i < call.last:  # the loop index went back before the schedule ended: another segment
            tracker._new_generation_locked()
        call.last = i
        n = call.num_steps(0)
        if n and i + 1 >= n:
            call.step, call.last, call.restart = 0, -1, True
        else:
            call.step = i + 1


def end_call(call: PipelineCall) -> None:
    tracker = call.tracker
    with tracker.lock:
        if call in tracker.calls:
            tracker.calls.remove(call)
        tracker.last_source = None
        tracker.pending_generation = True  # whatever runs next is another generation


class _StepEnd:
    """Our ``callback_on_step_end``: the user's callback (if any) first, then the step advance."""

    tensor_inputs: list = []  # read by MultiPipelineCallbacks: we need no tensors

    def __init__(self, call: PipelineCall, user=None):
        self.call, self.user = call, user

    def __call__(self, pipe, i, t, callback_kwargs):
        out = self.user(pipe, i, t, callback_kwargs) if self.user is not None else callback_kwargs
        step_end(self.call, i)
        return out


def chain(user, call: PipelineCall):
    """The callback to pass to the pipeline: ours after ``user`` (None, a function or a diffusers callback)."""
    if user is not None and hasattr(user, "tensor_inputs"):
        try:
            from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
        except ImportError:  # pragma: no cover - a tensor_inputs object without diffusers
            MultiPipelineCallbacks = PipelineCallback = ()
        if isinstance(user, MultiPipelineCallbacks):
            return MultiPipelineCallbacks([*user.callbacks, _StepEnd(call)])
        if isinstance(user, PipelineCallback):
            return MultiPipelineCallbacks([user, _StepEnd(call)])
    return _StepEnd(call, user)


_SUBCLASSES: Dict[tuple, type] = {}  # (class, callback position) -> its tracked subclass


def _callback_position(cls) -> Optional[int]:
    """Index of ``callback_on_step_end`` among the positional arguments after ``self`` (-1: keyword
    only), or None when ``cls.__call__`` has no such parameter."""
    try:
        params = list(inspect.signature(cls.__call__).parameters.values())
    except (TypeError, ValueError):
        return None
    for k, p in enumerate(params):
        if p.name == "callback_on_step_end":
            return k - 1 if p.kind == p.POSITIONAL_OR_KEYWORD else -1
    return None


def _rebuild(cls, state):
    """A copy of a tracked pipeline as an object of its own class (``__reduce_ex__`` of the tracked class)."""
    obj = cls.__new__(cls)
    if state is not None:
        if hasattr(obj, "__setstate__") and type(obj).__setstate__ is not object.__setstate__:
            obj.__setstate__(state)
        else:
            obj.__dict__.update(state)
    return obj


def _tracked_class(cls, pos: int) -> type:
    sub = _SUBCLASSES.get((cls, pos))
    if sub is not None:
        return sub

    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        call = begin_call(self)
        try:
            if 0 <= pos < len(args):
                args = (*args[:pos], chain(args[pos], call), *args[pos + 1:])
            else:
                kwargs["callback_on_step_end"] = chain(kwargs.get("callback_on_step_end"), call)
            # the class's __call__ as it is now, not as it was when the first pipeline was tracked: a library
            # that patches the pipeline class later (cache-dit wraps ``__call__`` to set up its cache context)
            # must still be called for every pipeline tracked after that
            return cls.__call__(self, *args, **kwargs)
        finally:
            end_call(call)

    def __reduce_ex__(self, protocol):
        # a copy (pickle, copy.deepcopy) is of the pipeline's own class: this subclass is not importable, and the
        # tracking (like torch's compiled module calls, which a copy drops) stays with the object enable() saw
        state = self.__getstate__() if hasattr(self, "__getstate__") else dict(self.__dict__)
        return (_rebuild, (cls, state))

    ns = {"__call__": __call__, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, "_vc_tracked_base": cls}
    sub = types.new_class(cls.__name__, (cls,), {}, lambda d: d.update(ns))
    _SUBCLASSES[(cls, pos)] = sub
    return sub


def is_tracked(pipe) -> bool:
    return "_vc_tracked_base" in type(pipe).__dict__


def track(pipe) -> bool:
    """Follow ``pipe``'s steps through its ``callback_on_step_end``. False (and nothing changed) when its
    ``__call__`` has no such parameter: the frame probe then reads its loop."""
    if is_tracked(pipe):
        return True
    pos = _callback_position(type(pipe))
    if pos is None:
        return False
    object.__setattr__(pipe, "__class__", _tracked_class(type(pipe), pos))
    return True


def untrack(pipe) -> None:
    base = type(pipe).__dict__.get("_vc_tracked_base")
    if base is not None:
        object.__setattr__(pipe, "__class__", base)
