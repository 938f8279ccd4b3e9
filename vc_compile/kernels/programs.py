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
Triton's launcher. A CUDA graph (``kernels/graphs.py``) removes all of it but pins its intermediates per call
site (~2.5x q), which is why it is off above small shapes. A program removes most of it and pins nothing:
each call allocates one workspace and the output (the caching allocator's usual blocks, freed at the call's
end as before) and hands each kernel's launcher the recorded arguments with integer addresses filled in.

How. Per entry: the first call runs normally (kernels compiled, launches remembered by
``kernels/launch.py``); the second runs normally under a recorder that notes
* every launch made through ``FAST_LAUNCH`` (its compiled kernel, grid and bound arguments),
* every torch operation (a ``TorchDispatchMode``): allocations (``empty``/``empty_strided``) are noted, views
  are allowed, anything else (a computation whose result a program could not recompute) refuses the recording,
* every launch made elsewhere (a hook on Triton's launch chain, for this thread): any refuses the recording,
and builds the program from them. Every later call of the entry replays it. A recording refused, or an argument
the program cannot place (an input view at an offset), leaves the entry on the normal path for good, with the
reason in ``report()``.

When. Where the method says a call is replayable (``replayable(phase, cfg)``: its launches depend only on q, k, v
and the metadata, no host reads, no metadata update; the same contract as a CUDA graph), on a CUDA device, with
the remembered launches usable (``FAST_LAUNCH``: the installed Triton's calling convention, no launch hook, not
under the interpreter) and no
RoPE prologue. An entry lives as long as its metadata object (a weak key), as the graphs do.
"""
from __future__ import annotations

import collections
import sys
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime import report as _report
from ..runtime.runtime import current, provide

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


def _desc(base: int, fields: tuple):
    """A host TMA descriptor as the recorded launch had it (``fields``: its class and every attribute but the base,
    whatever the installed Triton's descriptor holds), on the device address ``base``."""
    cls, attrs = fields
    d = object.__new__(cls)
    d.__dict__.update(attrs)
    d.base = _Ptr(base)
    return d


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

    L = _launch()
    rec = Recording()
    chain = triton.knobs.runtime.launch_enter_hook
    hook = None
    if isinstance(chain, triton.knobs.HookChain):
        hook = _same_thread_counter(rec)
        chain.add(hook)
    else:
        rec.refuse("a launch hook is installed")
    L.RECORDING.rec = rec
    try:
        with _Mode(rec):
            out = fn(q, k, v)
    finally:
        L.RECORDING.rec = None
        if hook is not None:
            chain.remove(hook)
    if rec.other_launches:  # (a launch through the remembered path that is not remembered refused it already)
        rec.refuse(f"{rec.other_launches} launch(es) outside the remembered launches")
    return out, rec


def layout_key(q, k, v) -> tuple:
    """What a program of these inputs depends on besides the op's state key (module docstring: ``entry``).
    NOTE written out (no generator): it runs on every call, and a generator doubled its cost; docs/design/host-overhead.md."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0, q is k, k is v, q is v,
            torch.cuda.current_device() if q.is_cuda else -1)


def _raw_launcher(launcher):
    """(the compiled launcher's C entry, {signature index: TMA descriptor metadata}) of Triton 3.6's CUDA launcher,
    or None where it is not that shape (the program then calls the launcher object, as the normal path does).
    The entry takes the descriptors expanded (``make_tensordesc_arg``), which a program does once per base address
    instead of once per launch."""
    if hasattr(launcher, "arg_annotations"):
        return None  # Triton 3.7+: one generic C entry with another argument order; the launcher object is called
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None  # scratch is allocated per launch by the launcher object
    if getattr(launcher, "launch_cooperative_grid", None) is None or getattr(launcher, "launch_pdl", None) is None:
        return None
    fn = launcher.launch
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return (fn, {}) if callable(fn) else None  # no descriptor argument: the C entry itself
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= set(cells):
        return None
    metas = list(cells["tensordesc_meta"])
    return cells["launcher"], dict(zip(sorted(cells["tensordesc_indices"]), metas))


class _Launch:
    """One recorded launch: the C entry and its arguments expanded, with holes (see ``Program``)."""

    __slots__ = ("call", "head", "tmpl", "ptrs", "descs", "maps")

    def __init__(self, call, head, tmpl, ptrs, descs):
        self.call, self.head, self.tmpl, self.ptrs, self.descs = call, head, tmpl, ptrs, descs
        self.maps: Dict[tuple, list] = {}  # (descriptor position, base address) -> its expanded arguments


class Program:
    """A recorded call (see the module docstring); ``run(q, k, v, stream)`` launches it on these inputs.

    Per launch: ``head`` (grid, function, and the launcher's fixed arguments), ``tmpl`` the argument list with
    holes, ``ptrs`` [(position, slot, byte offset)] the tensor arguments (slots: q, k, v, workspace, output),
    ``descs`` [(position, count, slot, byte offset, fields, metadata)] the TMA descriptors. With Triton 3.6's
    launcher the C entry is called directly: a descriptor is expanded (its ``CUtensorMap`` filled) once per base
    address and reused while the address repeats (the caching allocator hands a call's workspace the same block
    step after step), and pointers go in as integers (no ``cuPointerGetAttribute`` per argument)."""

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
        for L in self.launches:
            args = L.tmpl.copy()
            for pos, slot, off in L.ptrs:
                args[pos] = bases[slot] + off
            for pos, n, slot, off, fields, meta in L.descs:
                base = bases[slot] + off
                if n:  # expanded: the C entry's arguments, memoised per base address
                    ex = L.maps.get((pos, base))
                    if ex is None:
                        ex = _expand(base, fields, meta)
                        if len(L.maps) >= 64:
                            L.maps.clear()
                        L.maps[(pos, base)] = ex
                    args[pos:pos + n] = ex
                else:  # the launcher object expands it
                    args[pos] = _desc(base, fields)
            g0, g1, g2, function, fixed = L.head
            L.call(g0, g1, g2, stream, function, *fixed, *args)
        del ws  # freed after the launches were queued on this stream (stream-ordered reuse, as in the normal path)
        return out


def _expand(base: int, fields: tuple, meta) -> list:
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg(_desc(base, fields), meta)


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
            launcher = kernel.run
            raw = _raw_launcher(launcher)
            tmpl, ptrs, descs = [], [], []
            for i, a in enumerate(bound):
                if isinstance(a, torch.Tensor):
                    where = place(a)
                    if where is None:
                        tmpl.append(a.data_ptr())
                    else:
                        ptrs.append((len(tmpl),) + where)
                        tmpl.append(None)
                elif hasattr(a, "block_shape") and isinstance(getattr(a, "base", None), torch.Tensor):
                    where = place(a.base)
                    if not hasattr(a, "__dict__"):
                        raise _Unplaceable("a descriptor argument the program cannot copy")
                    fields = (type(a), {n: x for n, x in vars(a).items() if n != "base"})
                    if raw is not None and i in raw[1]:
                        n = len(_expand(a.base.data_ptr(), fields, raw[1][i]))
                        if where is None:  # a constant base: expanded once
                            tmpl.extend(_expand(a.base.data_ptr(), fields, raw[1][i]))
                            continue
                        descs.append((len(tmpl), n, where[0], where[1], fields, raw[1][i]))
                        tmpl.extend([None] * n)
                    elif where is None:
                        tmpl.append(a)
                    else:
                        descs.append((len(tmpl), 0, where[0], where[1], fields, None))
                        tmpl.append(None)
                elif raw is not None and i in raw[1]:
                    raise _Unplaceable("a descriptor argument the program cannot expand")
                else:
                    tmpl.append(a)
            g = tuple(grid) + (1, 1)
            if raw is not None:  # the C entry: cooperative grid, PDL, scratch (none), metadata, hooks (none)
                call = raw[0]
                fixed = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, kernel.packed_metadata,
                         None, None, None)
            else:
                call, fixed = launcher, (kernel.packed_metadata, None, None, None)
            launches.append(_Launch(call, (g[0], g[1], g[2], kernel.function, fixed), tmpl, tuple(ptrs),
                                    tuple(descs)))
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
        from .graphs import PerMeta

        self._entries = PerMeta()  # per metadata object: {(state key, layout): Entry}
        self.recorded = 0
        self.replays = 0
        self.launches = 0

    def clear(self, *_args) -> None:
        self._entries.clear()

    @staticmethod
    def usable(q) -> bool:
        """Whether a call on q may run a program now (CUDA, remembered launches usable, no capture running)."""
        if not q.is_cuda:
            return False
        L = _launch()
        if not (L.FAST_LAUNCH.enabled and L.FAST_LAUNCH.off_reason() is None and L.no_launch_hooks()):
            return False
        return not torch._C._cuda_isCurrentStreamCapturing()

    def run(self, key: tuple, meta, fn: Callable, q, k, v, sources: collections.Counter,
            layout: Optional[tuple] = None) -> Optional[torch.Tensor]:
        """This call's output, through the entry's program (recorded at its second call), or None: run the call
        normally (the entry's first call, or one refused). ``layout``: ``layout_key(q, k, v)`` if known."""
        per_meta = self._entries.of(meta)
        if per_meta is None:
            return None
        layout = layout if layout is not None else layout_key(q, k, v)
        ekey = (key, layout)
        entry = per_meta.get(ekey)
        if entry is None:
            if len(per_meta) >= 16:  # inputs that change layout every call: no program for them
                return None
            entry = per_meta[ekey] = Entry(layout)
        if entry.program is not None:
            out = self._replay(entry, q, k, v)
            sources.update(entry.sources)
            return out
        entry.calls += 1
        if entry.failed is not None or entry.calls == 1:
            return None
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

    def replay(self, key: tuple, meta, q, k, v, layout: tuple):
        """(output, the recorded call's tuning-lookup counts) through the entry's program where it has one, else
        None (nothing done: the caller takes the normal path)."""
        per_meta = self._entries.find(meta)
        entry = per_meta.get((key, layout)) if per_meta is not None else None
        if entry is None or entry.program is None:
            return None
        return self._replay(entry, q, k, v), entry.sources

    def _replay(self, entry: "Entry", q, k, v) -> torch.Tensor:
        drv = _launch().driver.active
        entry.calls += 1
        out = entry.program.run(q, k, v, drv.get_current_stream(drv.get_current_device()))
        self.replays += 1
        self.launches += len(entry.program.launches)
        return out

    def failures(self, meta) -> Dict[tuple, str]:
        per_meta = self._entries.find(meta) or {}
        return {key[0]: e.failed for key, e in per_meta.items() if e.failed is not None}

    def programs(self) -> list:
        """Every live program (tests)."""
        return [e.program for per_meta in self._entries.values() for e in per_meta.values()
                if e.program is not None]


_LAUNCH = None


def _launch():
    """kernels/launch.py, imported once on first use (this module imports no Triton at import time)."""
    global _LAUNCH
    if _LAUNCH is None:
        from vc_compile.kernels import launch

        _LAUNCH = launch
    return _LAUNCH


provide("programs", lambda rt: LaunchPrograms())


def _launch_line() -> Optional[str]:
    """How the kernels were launched: remembered (Triton's binder skipped, ``kernels/launch.py``) or through the
    binder, and why the remembered path is off where it is. None before any launch (the module not imported:
    nothing here imports triton)."""
    mod = sys.modules.get("vc_compile.kernels.launch")
    if mod is None:
        return None
    line = mod.FAST_LAUNCH.summary()
    progs = current().programs
    if progs.replays:
        line = (line or "kernel launches: none through Python") + (
            f"; {progs.launches} more from {progs.replays} replays of recorded reuse steps "
            f"({progs.recorded} recorded)")
    return line


_report.line_source("launches", _launch_line)
