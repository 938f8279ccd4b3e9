"""The frame probe of the step tracker (``runtime/tracker.py``): one walk up the call stack from the op finds
the diffusers pipeline loop (signal 2, the frame fallback) or the model's timestep argument (signal 3).

What it reads and why it is cheap is in ``runtime/steps.py``'s module docstring (the signals, their cost).
Everything here is a pure function of the stack, plus two process-wide caches of facts that never change
(the directories of torch and of this package; the timestep parameter of each ``nn.Module`` type's
``forward``). The per-step memo of the pipeline frame (``LoopCache``) belongs to a tracker.
"""
from __future__ import annotations

import inspect
import os
import sys
import weakref
from typing import Dict, Optional, Tuple


def _bump(name: str, n: int = 1) -> None:
    from torch._dynamo.utils import counters

    counters["vcattn"][name] += n



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


class LoopCache:
    """Skips building the pipeline frame's ``f_locals`` (the costly part of the probe) while the loop is
    provably on the same step: same frame, and the pipeline's ``_current_timestep`` (every diffusers
    loop sets it to ``t`` before calling the model) is the very object seen last time. The cache holds
    that object, so its identity cannot be reused; the pipeline is held weakly. One per tracker (read and
    written under the tracker's lock), so two loops never read each other's frame."""

    __slots__ = ("frame_id", "pipe_ref", "current_t", "result")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.frame_id, self.pipe_ref, self.current_t, self.result = 0, None, None, None


def _probe(cache: LoopCache, max_depth: int = 96):
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
                found = _pipeline_loop(f, cache)
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


def _pipeline_loop(f, c: LoopCache):
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
