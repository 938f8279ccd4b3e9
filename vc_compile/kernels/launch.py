"""Launching a compiled Triton / Gluon kernel again without Triton's per-call binder.

Notation
--------
fn          a ``triton.JITFunction`` (Triton or Gluon kernel)
key         the caller's description of everything the kernel's specialisation depends on besides ``fn``
            and the launch options: the shapes, strides and dtypes that reach it as integers or tensors, and the
            16-byte alignment of every tensor the caller did not allocate itself (the binder specialises on
            ``data_ptr() % 16``, integer arguments on ``== 1`` and ``% 16``; a key that fixes the shapes and
            strides fixes those)
bound       the argument list the launcher takes: every parameter of ``fn`` in order (constexprs included, which
            the launcher skips), defaults filled in

What it does. ``launch(fn, grid, key, *args, **kwargs)`` runs ``fn[grid](*args, **kwargs)`` the first time a
``(fn, key, kwargs' names)`` is seen, and remembers the compiled kernel and the order of its parameters. Later
calls with that key hand the arguments straight to the compiled kernel's launcher: no binder, no
specialisation, no cache-key hashing. The launcher itself is Triton's, so tensor descriptors, scratch memory
and the stream are handled as in a normal launch.

When it does not. Under the CPU interpreter, with a launch hook installed (``triton.knobs.runtime``, e.g. a
profiler's), with a pre-run hook on ``fn``, or on a Triton whose JIT does not launch the way this module replays
(``convention_error``: the binder in ``device_caches``, the compiled kernel's ``run`` with the grid, stream,
function, packed metadata, launch metadata and hooks before the bound arguments; read from the installed
Triton's own ``JITFunction.run``, not from its version: 3.6 to 3.9 launch this way), every call takes the normal
path. ``FAST_LAUNCH.enabled = False`` turns the fast path off for the process (tests compare both paths).

NOTE (H200 host, torch 2.11, triton 3.6, docs/design/host-path.md, ExpCast reuse call at H12 S32760):
``JITFunction.run`` took 0.47 ms for the call's three launches, 0.16 of it Triton's launcher; the rest (binder,
specialisation, cache key, launch metadata for the default empty hook chain) is what a remembered launch skips.
Offline (this module's test harness, a fake sm_90 driver) a V-Smooth call's Python went 0.416 -> 0.268 ms.
"""
from __future__ import annotations

import functools
import inspect
import re
import threading
from typing import Any, Dict, Optional, Tuple

import triton
from triton.compiler import CompiledKernel
from triton.runtime import driver

from vc_compile.kernels.interpret import interpreting

# How Triton's ``JITFunction.run`` launches a compiled kernel, the calling convention a remembered launch repeats:
# the per-device caches with the binder last, and the launcher's arguments in this order (whitespace aside).
_CONVENTION = (
    r"kernel_cache,kernel_key_cache,target,backend,binder=self\.device_caches\[device\]",
    r"bound_args,specialization,options=binder\(\*args,\*\*kwargs\)",
    r"kernel\.run\(grid_0,grid_1,grid_2,stream,kernel\.function,kernel\.packed_metadata,launch_metadata,"
    r"knobs\.runtime\.launch_enter_hook,knobs\.runtime\.launch_exit_hook,\*bound_args\.values\(\)\)",
)


def _convention_error() -> Optional[str]:
    """None where the installed Triton's JIT launches as ``_CONVENTION`` says, else what differs."""
    from triton.runtime.jit import JITFunction
    try:
        # (a wrapper that names the function it wraps, e.g. the offline compile harness's, is looked through)
        src = re.sub(r"\s+", "", inspect.getsource(inspect.unwrap(JITFunction.run)))
    except (OSError, TypeError) as e:
        return f"the source of Triton's JITFunction.run is unreadable ({e})"
    for pat in _CONVENTION:
        if not re.search(pat, src):
            return (f"Triton {triton.__version__}'s JITFunction.run does not launch as the remembered launches "
                    "replay (a new calling convention)")
    return None


_CONVENTION_ERROR = _convention_error()


class FastLaunch:
    """The process's remembered launches (see the module docstring)."""

    def __init__(self):
        self.enabled = True
        self._memo: Dict[tuple, Tuple[Any, tuple]] = {}
        self._lock = threading.Lock()
        self.fast = 0  # launches that skipped the binder
        self.slow = 0  # launches through fn[grid]

    def usable(self, fn) -> bool:
        """Whether a launch of ``fn`` may skip the binder now."""
        return self._usable_fn(fn) and no_launch_hooks()

    def _usable_fn(self, fn) -> bool:
        return (self.enabled and _CONVENTION_ERROR is None and not interpreting()
                and not getattr(fn, "pre_run_hooks", None))

    def __call__(self, fn, grid: tuple, key, *args, **kwargs):
        """``fn[grid](*args, **kwargs)``, remembered under ``key`` (see the module docstring)."""
        rec = getattr(RECORDING, "rec", None)
        if rec is not None:  # runtime/programs.py records this call (its hook makes ``usable`` False meanwhile)
            return self._recorded(rec, fn, grid, key, args, kwargs)
        if not self.usable(fn):
            self.slow += 1
            return fn[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        mkey = (fn, key, tuple(kwargs), len(args), device)
        hit = self._memo.get(mkey)
        if hit is not None:
            return self._launch(hit, grid, args, kwargs, device)[0]
        kernel = fn[grid](*args, **kwargs)
        self.slow += 1
        if kernel is not None and not hasattr(kernel, "result"):
            self._remember(mkey, fn, kernel, device, args, kwargs)
        return kernel

    def _recorded(self, rec, fn, grid, key, args, kwargs):
        """A launch inside a recorded call (runtime/programs.py): launched as a remembered launch and noted as
        (compiled kernel, grid, bound arguments); one the recording cannot note (not remembered yet, or one the
        remembered path does not take) is launched through the binder and refuses the recording."""
        device = driver.active.get_current_device()
        hit = self._memo.get((fn, key, tuple(kwargs), len(args), device)) if self._usable_fn(fn) else None
        if hit is None:
            rec.refuse(f"a launch of {getattr(fn, '__name__', fn)} that is not remembered")
            self.slow += 1
            return fn[grid](*args, **kwargs)
        kernel, bound = self._launch(hit, grid, args, kwargs, device)
        rec.launches.append((kernel, tuple(grid), bound))
        return kernel

    def _launch(self, hit, grid, args, kwargs, device):
        """A remembered launch: (the compiled kernel, the bound arguments it was handed)."""
        kernel, tail = hit
        bound = args + tuple(kwargs[n] if isinstance(n, str) else n[0] for n in tail)
        g = tuple(grid) + (1, 1)
        stream = driver.active.get_current_stream(device)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *bound)
        self.fast += 1
        return kernel, bound

    def _remember(self, mkey, fn, kernel, device, args, kwargs) -> None:
        caches = getattr(fn, "device_caches", None)
        if not isinstance(kernel, CompiledKernel) or caches is None or device not in caches:
            return  # not a plain JIT function's launch (an autotuner, a wrapper): keep the normal path
        binder = caches[device][4]
        bound, _, _ = binder(*args, **kwargs)
        params = list(bound)
        if len(params) != len(fn.params) or params[:len(args)] != [p.name for p in fn.params[:len(args)]]:
            return  # not the plain positional-then-keyword binding assumed below: keep the normal path
        tail = []
        for name in params[len(args):]:
            # a keyword given at the call: read it from the call; a default: the bound value itself, boxed in a
            # tuple so that it is told apart from a name
            tail.append(name if name in kwargs else (bound[name],))
        with self._lock:
            if len(self._memo) >= 4096:  # e.g. a dynamic-shape model's many lengths: start again, never grow
                self._memo.clear()
            self._memo[mkey] = (kernel, tuple(tail))

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()

    def off_reason(self) -> Optional[str]:
        """Why no launch can skip the binder in this process, or None."""
        if not self.enabled:
            return "turned off"
        if _CONVENTION_ERROR is not None:
            return _CONVENTION_ERROR
        if interpreting():
            return "the CPU interpreter runs the kernels"
        return None

    def summary(self) -> Optional[str]:
        """A line for ``report()``: launches remembered and through the binder, and why none is remembered."""
        if not self.fast + self.slow:
            return None
        why = self.off_reason()
        line = f"kernel launches: {self.fast} remembered (Triton's binder skipped), {self.slow} through the binder"
        return line + (f"; remembered launches off: {why}" if why else "")


FAST_LAUNCH = FastLaunch()
# this thread's recording of a call (runtime/programs.py sets ``RECORDING.rec``), or none
RECORDING = threading.local()


def no_launch_hooks() -> bool:
    """Whether Triton's launch hooks call nothing (a profiler's would need every launch through the binder)."""
    rt = triton.knobs.runtime
    return _no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)


def _no_hook(hook) -> bool:
    """Whether a launch hook of Triton's knobs calls nothing: None, or an empty ``HookChain`` (3.6's default, which
    the binder's path still builds launch metadata for and hands to the launcher to call)."""
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


def aligned(*tensors) -> tuple:
    """The binder's alignment bits of tensors the caller did not allocate (part of a launch key)."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors if t is not None)


# the SM count a grid is sized for where no GPU is at hand (the offline sm_90 compile): an H100 SXM's / H200's
OFFLINE_SMS = 132


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (read from the device, cached per device), ``OFFLINE_SMS`` off a GPU."""
    if getattr(device, "type", "cpu") != "cuda":
        return OFFLINE_SMS
    index = device.index if device.index is not None else _current_device()
    return _sms(index)


def _current_device() -> int:
    import torch
    return torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


_DESCRIPTORS: Dict[tuple, tuple] = {}


def tma_descriptor(cls, tensor, block_shape, layout):
    """``cls.from_tensor(tensor, block_shape, layout)`` (a Gluon ``TensorDescriptor``) with its checks run once per
    (shape, strides, dtype, block, layout): later ones copy the checked fields and only test the base's
    16-byte alignment (the one check that depends on the tensor itself).
    NOTE (H200 host): five ``from_tensor`` per attention launch cost ~36 us of host time (its dataclass checks)."""
    shape, strides = tuple(tensor.shape), tensor.stride()
    key = (cls, shape, strides, tensor.dtype, tuple(block_shape), layout)
    fields = _DESCRIPTORS.get(key)
    if fields is None or tensor.data_ptr() % 16:
        d = cls.from_tensor(tensor, list(block_shape), layout)
        _DESCRIPTORS[key] = {k: v for k, v in vars(d).items() if k != "base"}
        return d
    d = object.__new__(cls)
    d.__dict__.update(fields)
    d.base = tensor
    return d
