"""A call site's reuse step replayed as a recorded launch sequence: the host cost of a step without a CUDA graph.

Notation
--------
entry       one (op state key, metadata object, input layout): what a program is valid for. The layout is the
            shapes, strides, dtypes and 16-byte alignment of q, k, v, which of them are one tensor, and the
            current device.
program     the recorded call as data: one workspace of the call's intermediates (byte offsets), the output's
            allocation, and per launch the compiled kernel, its grid and its argument list, each tensor argument
            replaced by a hole (an input, the workspace at an offset, the output) or held as a constant (the
            metadata's tensors, cached tables: alive as long as the program).

Why. A reuse step is a fixed sequence of launches (V-Smooth: the two preprocessing passes and the attention
kernel; MC-Sparse: the gather kernel) on q, k, v, the metadata and fresh intermediates. Through the op's normal
path each call rebuilds that sequence in Python: ~13 allocations, the kernels' geometry and checks, argument
lists of 20-40 values, five TMA descriptors, and one ``cuPointerGetAttribute`` per tensor argument inside
Triton's launcher. A CUDA graph (``runtime/graphs.py``) removes all of it but pins its intermediates per call
site (~2.5x q), which is why it is off above small shapes. A program removes most of it and pins nothing:
each call allocates one workspace and the output (the caching allocator's usual blocks, freed at the call's
end as before) and hands each kernel's launcher the recorded arguments with integer addresses filled in.

How. Per entry: the first call runs normally (kernels compiled, launches remembered by
``templates/launch.py``); the second runs normally under a recorder that notes
* every launch made through ``FAST_LAUNCH`` (its compiled kernel, grid and bound arguments),
* every torch operation (a ``TorchDispatchMode``): allocations (``empty``/``empty_strided``) are noted, views
  are allowed, anything else (a computation whose result a program could not recompute) refuses the recording,
* every launch made elsewhere (a hook on Triton's launch chain, for this thread): any refuses the recording,
and builds the program from them. Every later call of the entry replays it. A recording refused, or an argument
the program cannot place (an input view at an offset), leaves the entry on the normal path for good, with the
reason in ``report()``.

When. Where the method says a call is replayable (``replayable(phase, cfg)``: its launches depend only on q, k, v
and the metadata, no host reads, no metadata update; the same contract as a CUDA graph), on a CUDA device, with
the remembered launches usable (``FAST_LAUNCH``: Triton 3.6, no launch hook, not under the interpreter) and no
RoPE prologue. An entry lives as long as its metadata object (a weak key), as the graphs do.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALIGN = 256  # workspace offsets (the caching allocator's blocks are 512-byte aligned; TMA needs 16)

_ALLOCS = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"})
_VIEWS = frozenset({"view", "_unsafe_view", "as_strided", "transpose", "permute", "t", "select", "slice",
                    "unsqueeze", "squeeze", "expand", "alias", "detach", "unflatten", "split", "unbind",
                    "narrow", "view_as", "_reshape_alias"})


class _Ptr(int):
    """A device address that also answers ``data_ptr()`` (what Triton's launcher asks a TMA descriptor's base);
    as an ``int`` the launcher takes it as the pointer itself (no ``cuPointerGetAttribute``)."""

    __slots__ = ()

    def data_ptr(self) -> int:
        return int(self)


class _Desc:
    """A host TMA descriptor as Triton's launcher reads it (base, shape, strides, padding)."""

    __slots__ = ("base", "shape", "strides", "padding", "block_shape", "layout")

    def __init__(self, base, shape, strides, padding, block_shape, layout):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding
        self.block_shape, self.layout = block_shape, layout


class Recording:
    """What one recorded call did (see the module docstring); ``problem`` is why it cannot become a program."""

    def __init__(self):
        self.launches: List[tuple] = []  # (compiled kernel, grid, bound arguments)
        self.allocs: List[torch.Tensor] = []
        self.problem: Optional[str] = None
        self.other_launches = 0
        self.thread = threading.get_ident()

    def refuse(self, why: str) -> None:
        if self.problem is None:
            self.problem = why


class _Mode(TorchDispatchMode):
    def __init__(self, rec: Recording):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _ALLOCS:
            self.rec.allocs.append(out)
        elif name not in _VIEWS:
            self.rec.refuse(f"the call runs a torch operation ({name})")
        return out


def _same_thread_counter(rec: Recording):
    def hook(*_a):
        if threading.get_ident() == rec.thread:
            rec.other_launches += 1
    return hook


def record(fn: Callable, q, k, v) -> Tuple[torch.Tensor, Recording]:
    """Run ``fn(q, k, v)`` under a recorder: (its output, what it did)."""
    import triton

    from vc_compile.templates.launch import FAST_LAUNCH, RECORDING

    rec = Recording()
    chain = triton.knobs.runtime.launch_enter_hook
    hook = None
    if isinstance(chain, triton.knobs.HookChain):
        hook = _same_thread_counter(rec)
        chain.add(hook)
    else:
        rec.refuse("a launch hook is installed")
    RECORDING.rec = rec
    before = FAST_LAUNCH.slow
    try:
        with _Mode(rec):
            out = fn(q, k, v)
    finally:
        RECORDING.rec = None
        if hook is not None:
            chain.remove(hook)
    if rec.other_launches:
        rec.refuse(f"{rec.other_launches} launch(es) outside the remembered launches")
    if FAST_LAUNCH.slow != before:
        rec.refuse("a launch not remembered yet")
    return out, rec


def layout_key(q, k, v) -> tuple:
    """What a program of these inputs depends on besides the op's state key (module docstring: ``entry``)."""
    return (tuple((tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in (q, k, v)),
            q is k, k is v, q is v, torch.cuda.current_device() if q.is_cuda else -1)


class Program:
    """A recorded call (see the module docstring); ``run(q, k, v)`` launches it on these inputs."""

    __slots__ = ("ws_bytes", "out_spec", "launches", "consts", "device")

    def __init__(self, ws_bytes, out_spec, launches, consts, device):
        self.ws_bytes, self.out_spec, self.launches = ws_bytes, out_spec, launches
        self.consts, self.device = consts, device

    def run(self, q, k, v, stream: int) -> torch.Tensor:
        dev = self.device
        shape, stride, dtype = self.out_spec
        out = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
        ws = torch.empty(self.ws_bytes, dtype=torch.uint8, device=dev) if self.ws_bytes else None
        bases = (q.data_ptr(), k.data_ptr(), v.data_ptr(), ws.data_ptr() if ws is not None else 0, out.data_ptr())
        for run, g0, g1, g2, function, meta, template, holes, descs in self.launches:
            args = list(template)
            for pos, slot, off in holes:
                args[pos] = _Ptr(bases[slot] + off)
            for pos, slot, off, shp, strides, padding, block, layout in descs:
                args[pos] = _Desc(_Ptr(bases[slot] + off), shp, strides, padding, block, layout)
            run(g0, g1, g2, stream, function, meta, None, None, None, *args)
        del ws  # freed after the launches were queued on this stream (stream-ordered reuse, as in the normal path)
        return out


def build(rec: Recording, out, q, k, v) -> Tuple[Optional[Program], Optional[str]]:
    """(the program of a recorded call, None) or (None, why not)."""
    if rec.problem is not None:
        return None, rec.problem
    if not rec.launches:
        return None, "no launch recorded"
    if not isinstance(out, torch.Tensor):
        return None, "the call returns no single tensor"
    inputs = (q, k, v)
    storages: Dict[int, tuple] = {}  # storage address -> (slot, offset of the storage start)
    out_st = out.untyped_storage().data_ptr()
    off = 0
    for t in rec.allocs:
        if not isinstance(t, torch.Tensor):
            return None, "an allocation that is not one tensor"
        st = t.untyped_storage()
        p = st.data_ptr()
        if p in storages:
            continue
        if p == out_st:
            storages[p] = (4, 0)
        else:
            storages[p] = (3, off)
            off += -(-st.nbytes() // _ALIGN) * _ALIGN
    if storages.get(out_st) != (4, 0) or out.data_ptr() != out_st:
        return None, "the output is not a fresh allocation of the call"
    if out.untyped_storage().nbytes() != out.numel() * out.element_size() or not out.is_contiguous():
        return None, "the output does not fill its allocation"
    consts: list = []

    def place(t: torch.Tensor):
        """(slot, byte offset) of a tensor argument, or None: a constant (kept alive by the program)."""
        for i, x in enumerate(inputs):
            if t is x or (t.data_ptr() == x.data_ptr() and t.untyped_storage().data_ptr()
                          == x.untyped_storage().data_ptr()):
                return i, 0
        st = t.untyped_storage().data_ptr()
        hit = storages.get(st)
        if hit is not None:
            return hit[0], hit[1] + (t.data_ptr() - st)
        if any(st == x.untyped_storage().data_ptr() for x in inputs):
            raise _Unplaceable("an input view at an offset")
        consts.append(t)
        return None

    launches = []
    try:
        for kernel, grid, bound in rec.launches:
            template, holes, descs = list(bound), [], []
            for pos, a in enumerate(bound):
                if isinstance(a, torch.Tensor):
                    where = place(a)
                    if where is None:
                        template[pos] = a.data_ptr()
                    else:
                        holes.append((pos,) + where)
                        template[pos] = None
                elif hasattr(a, "block_shape") and isinstance(getattr(a, "base", None), torch.Tensor):
                    where = place(a.base)
                    slot, boff = where if where is not None else (3, 0)
                    shp, strides = tuple(a.shape), tuple(a.strides)
                    if where is None:  # a constant base: the descriptor itself is a constant
                        continue
                    descs.append((pos, slot, boff, shp, strides, a.padding, tuple(a.block_shape), a.layout))
                    template[pos] = None
            g = tuple(grid) + (1, 1)
            launches.append((kernel.run, g[0], g[1], g[2], kernel.function, kernel.packed_metadata,
                             tuple(template), tuple(holes), tuple(descs)))
    except _Unplaceable as e:
        return None, str(e)
    return Program(off, (tuple(out.shape), out.stride(), out.dtype), tuple(launches), tuple(consts),
                   out.device), None


class _Unplaceable(Exception):
    pass


class Entry:
    __slots__ = ("calls", "program", "failed", "sources", "layout")

    def __init__(self, layout):
        self.calls, self.program, self.failed, self.layout = 0, None, None, layout
        self.sources: collections.Counter = collections.Counter()


class LaunchPrograms:
    """The process's recorded reuse steps (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: Dict[int, tuple] = {}  # id(metadata) -> (weak reference, {(state key, layout): Entry})
        self.recorded = 0
        self.replays = 0
        self.launches = 0

    def clear(self, *_args) -> None:
        with self._lock:
            self._entries = {}

    @staticmethod
    def usable(q) -> bool:
        """Whether a call on q may run a program now (CUDA, remembered launches usable, no capture running)."""
        from vc_compile.templates.launch import FAST_LAUNCH, no_launch_hooks

        if not (q.is_cuda and FAST_LAUNCH.enabled and FAST_LAUNCH.off_reason() is None and no_launch_hooks()):
            return False
        return not torch._C._cuda_isCurrentStreamCapturing()

    def run(self, key: tuple, meta, fn: Callable, q, k, v, sources: collections.Counter) -> Optional[torch.Tensor]:
        """This call's output, through the entry's program (recorded at its second call), or None: run the call
        normally (the entry's first call, or one refused)."""
        per_meta = self._per_meta(meta)
        if per_meta is None:
            return None
        layout = layout_key(q, k, v)
        ekey = (key, layout)
        entry = per_meta.get(ekey)
        if entry is None:
            if len(per_meta) >= 16:  # inputs that change layout every call: no program for them
                return None
            entry = per_meta[ekey] = Entry(layout)
        entry.calls += 1
        if entry.failed is not None or entry.calls == 1:
            return None
        if entry.program is None:
            before = collections.Counter(sources)
            out, rec = record(fn, q, k, v)
            program, why = build(rec, out, q, k, v)
            if program is None:
                entry.failed = why
            else:
                entry.program = program
                entry.sources = sources - before
                self.recorded += 1
            return out
        from triton.runtime import driver

        out = entry.program.run(q, k, v, driver.active.get_current_stream(driver.active.get_current_device()))
        self.replays += 1
        self.launches += len(entry.program.launches)
        sources.update(entry.sources)
        return out

    def failures(self, meta) -> Dict[tuple, str]:
        hit = self._entries.get(id(meta))
        per_meta = hit[1] if hit is not None and hit[0]() is meta else {}
        return {key[0]: e.failed for key, e in per_meta.items() if e.failed is not None}

    def _per_meta(self, meta):
        mid = id(meta)
        hit = self._entries.get(mid)
        if hit is not None and hit[0]() is meta:
            return hit[1]
        entries = self._entries

        def gone(_ref, mid=mid):
            cur = entries.get(mid)
            if cur is not None and cur[0] is _ref:
                entries.pop(mid, None)
        try:
            ref = weakref.ref(meta, gone)
        except TypeError:
            return None
        per_meta: dict = {}
        with self._lock:
            self._entries[mid] = (ref, per_meta)
        return per_meta
