"""A call site's steady-state launches replayed as one CUDA graph: the op's fixed cost on small shapes.

What it is for. A reuse step of an 8-bit or sparse method is a fixed sequence of kernel launches (V-Smooth: the
two preprocessing passes and the attention kernel; MC-Sparse: the gather kernel) on tensors whose addresses
do not change between steps, except q, k and v. Launching them from Python costs ~0.3-0.7 ms of host time per
Triton/Gluon launch path (binder, descriptors, launcher), which is longer than the kernels themselves below
~16K tokens at 12 heads: there the op is host-bound and slower than stock SDPA. Replaying a captured graph
costs a few microseconds of host time.

How. Per (site, block, branch, shape, device, metadata slot) and per metadata object (``Entry``):
* the first replayable call runs normally (kernels compiled, launch configs looked up and memoised) and notes
  where q, k and v live (addresses and strides);
* a later call where q, k, v sit where the previous call's did captures ``fn`` (the method's run) into a
  ``torch.cuda.CUDAGraph`` on the caller's own tensors (a *direct* graph: a compiled model's buffers come back
  at the same addresses step after step) and replays it at every call that finds them there: nothing copied;
* a call whose inputs moved replays the *staged* graph (captured at the first such call on staging tensors)
  after copying q, k, v into them; inputs that move and then stay put get a new direct graph (at most
  ``MAX_DIRECT`` per entry);
* every replay returns a clone of the graph's output (never a buffer a later replay overwrites).
A direct graph reads the caller's tensors only at the addresses it checked this call: whatever lives there now
is this call's q, k, v (same shapes, strides, dtype), so it is as right as launching the kernels on them.
Staging tensors are shared by every graph of one (thread, shape, strides, dtype, device) (a thread's calls run
one after another on one stream; an entry replays on the staging of the thread that captured it, so a loop that
moves to another thread while the first still replays would share it); each graph keeps its intermediates and its
output in its own memory pool (~2.5x the size of q: the 8-bit codes, scales and the kernel's output). NOTE not
one pool shared by all graphs: on torch 2.11 the captures after a shared pool's graphs were freed (a new
generation) failed with an internal allocator assert (``use_count > 0``, CUDACachingAllocator.cpp). The extra
GPU work is one copy of the output per call, plus one of q, k, v on the staged graph (measured in
benchmarks/bench_op_overhead.py). After a capture fails, no graph is captured again in this process (the
reason is in ``report()``).

When. The method says whether a call is replayable (``replayable(phase, cfg)``: its launches depend only on
q, k, v and the metadata, with no host reads and no metadata update); the option ``cuda_graphs`` says
where: ``off`` (the default: the recorded launch sequence of runtime/programs.py instead, measured as fast or
faster at every size, with no memory kept; config.py NOTE); ``on`` (every replayable call on a CUDA device);
``auto`` (where the call's attention work B H S Sk D is at most ``AUTO_MAX_WORK``, i.e. where the launches, not
the kernels, bound the call). Never while another capture is running (the op inside a user's graph), never on a side stream, and a
capture that fails turns graphs off for that entry for good, with the reason in ``report()``.

An entry lives as long as its metadata object (a weak key): when the metadata is replaced (a V-Smooth
regrouping, an MC-Sparse anchor) or dropped (a new generation, ``vc_compile.reset()``), its graph goes with it.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable, Dict, Optional

import torch

# NOTE AUTO_MAX_WORK = B H S Sk D <= 1.1e11 (12 heads x 8192^2 x 128 = 1.03e11 is in, 12 x 16384^2 x 128 is out).
# H200, bench_op_overhead, reuse calls back to back, graphs off -> on (host ms / GPU ms per call):
#   H12 S8192:  V-Smooth 0.72 / 0.77 -> 0.23 / 0.77, ExpCast 0.70 / 0.74 -> 0.30 / 0.70,
#               MC-Sparse s = 0.15 0.29 / 0.30 -> 0.20 / 0.27 (host-bound: 1.99x -> 2.23x cuDNN);
#   H12 S16384: V-Smooth 0.71 / 2.37 -> 0.19 / 2.45, MC-Sparse 0.27 / 0.65 -> 0.17 / 0.75 (+16%: the staging
#               copies, with nothing to hide);
#   H2 S32760:  V-Smooth 0.71 / 1.52 -> 0.36 / 1.50 (GPU-bound either way).
# So below the bound the graph frees the host (and wins where the call is host-bound); above it the copies cost.
AUTO_MAX_WORK = 1.1e11


# a direct graph is captured again when the inputs move and then stay put; inputs that move every call get
# the staged graph instead of a capture per call
MAX_DIRECT = 3


class Entry:
    __slots__ = ("calls", "last", "direct", "direct_captures", "staged", "sources", "failed")

    def __init__(self):
        self.calls, self.failed = 0, None
        self.last = None  # where the previous call's q, k, v lived (see _where)
        self.direct = None  # (graph, output, where) captured on the caller's tensors
        self.direct_captures = 0
        self.staged = None  # (graph, output, q, k, v staging)
        self.sources: collections.Counter = collections.Counter()


def _where(q, k, v) -> tuple:
    """What a graph captured on these tensors depends on: addresses, shapes, strides, dtypes."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in (q, k, v))


class PerMeta:
    """Entries that live as long as a metadata object: id(metadata) -> (a weak reference to it, {key: entry}).
    By id: metadata dataclasses compare by value (unhashable); the weak reference's callback drops the entries
    when the metadata dies, before its id can be reused. (The graphs here and runtime/programs.py's launch
    sequences.)"""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: Dict[int, tuple] = {}

    def clear(self) -> None:
        with self._lock:
            self._entries = {}

    def find(self, meta) -> Optional[dict]:
        """The entries of ``meta``, or None (none made yet)."""
        hit = self._entries.get(id(meta))
        return hit[1] if hit is not None and hit[0]() is meta else None

    def of(self, meta) -> Optional[dict]:
        """The entries of ``meta``, made empty if new; None for metadata that cannot be weakly referenced."""
        found = self.find(meta)
        if found is not None:
            return found
        mid = id(meta)
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

    def values(self):
        """Every live metadata object's entries."""
        return [hit[1] for hit in list(self._entries.values()) if hit[0]() is not None]


class LaunchGraphs:
    """The process's captured graphs (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        # per metadata object: {entry key: Entry}; the key is the op's state key (site, block, branch, shapes,
        # device, slot)
        self._entries = PerMeta()
        self._staging: Dict[tuple, tuple] = {}
        self.broken: Optional[str] = None  # a capture failed: no more captures in this process
        self.captures = 0
        self.replays = 0
        self.direct_replays = 0  # replays that copied nothing (q, k, v where the graph read them)

    def clear(self, *_args) -> None:
        """Forget every graph and staging buffer (a new generation drops the metadata anyway)."""
        self._entries.clear()
        with self._lock:
            self._staging.clear()

    @staticmethod
    def wanted(mode: str, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether the option allows a graph for this call (before the method's own say)."""
        if mode == "off" or not q.is_cuda:
            return False
        # NOTE raw-stream queries: torch.cuda.current_stream()/default_stream() build Stream objects, 35-57 us
        # of host time per call on the H200's host (docs/design/host-path.md) against a few us for these
        if torch._C._cuda_getCurrentRawStream(q.device.index if q.device.index is not None
                                              else torch.cuda.current_device()) != 0:
            return False  # a side stream or a capture (never the default stream): staging is per stream
        if torch._C._cuda_isCurrentStreamCapturing():
            return False
        return LaunchGraphs.may_want(mode, q, k)

    @staticmethod
    def may_want(mode: str, q: torch.Tensor, k: torch.Tensor) -> bool:
        """``wanted`` without its device and stream checks: whether the option could ever want a graph for a call
        of these shapes."""
        if mode == "off":
            return False
        if mode == "on":
            return True
        # NOTE not above the bound even for a direct graph: each graph keeps its intermediates in its own pool
        # (~2.5x q), e.g. 1.9 GB per call site at 40 heads x 75600 tokens, x 30 blocks x 2 CFG branches
        B, H, S, D = q.shape
        return B * H * S * k.shape[2] * D <= AUTO_MAX_WORK

    def run(self, key: tuple, meta, fn: Callable, q, k, v, sources: collections.Counter) -> Optional[torch.Tensor]:
        """This call's output through the entry's graph, or None (run the call normally: the first call, or a
        failed capture). ``fn(q, k, v)`` returns the output; ``sources`` is the call's tuning-lookup counter
        (the counts its capture recorded are added again at each replay, so ``report()`` counts every call).

        Which graph: the direct one where q, k, v sit at its addresses; else a new direct one where they sit
        where the previous call's did (inputs that stay put; at most ``MAX_DIRECT`` captures per entry), else
        the staged one."""
        per_meta = self._entries.of(meta)
        if per_meta is None:  # metadata that cannot be weakly referenced: no graphs for it
            return None
        entry = per_meta.get(key)
        if entry is None:
            entry = per_meta[key] = Entry()
        entry.calls += 1
        where = _where(q, k, v)
        last, entry.last = entry.last, where
        if entry.failed is not None or entry.calls == 1:
            return None
        if entry.direct is not None and entry.direct[2] == where:
            graph, out = entry.direct[:2]
            self.direct_replays += 1
        elif where == last and entry.direct_captures < MAX_DIRECT:
            if not self._can_capture(entry) or not self._capture(entry, fn, q, k, v, sources, where=where):
                return None
            graph, out = entry.direct[:2]
            self.direct_replays += 1
        else:
            if entry.staged is None:
                if not self._can_capture(entry) or not self._capture(entry, fn, q, k, v, sources):
                    return None
            graph, out, qs, ks, vs = entry.staged
            qs.copy_(q)
            ks.copy_(k)
            vs.copy_(v)
        graph.replay()
        self.replays += 1
        sources.update(entry.sources)
        return out.clone()

    def _can_capture(self, entry: Entry) -> bool:
        if self.broken is not None:
            entry.failed = f"an earlier capture failed ({self.broken})"
            return False
        return True

    def failures(self, meta) -> Dict[tuple, str]:
        per_meta = self._entries.find(meta) or {}
        return {key: e.failed for key, e in per_meta.items() if e.failed is not None}

    def _staging_for(self, q, k, v):
        # per thread: two sampling loops may run in two threads (runtime.py), each its own staging
        skey = (threading.get_ident(),) + tuple((tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))
                                                for t in (q, k, v))
        with self._lock:
            st = self._staging.get(skey)
            if st is None:
                st = self._staging[skey] = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                     device=t.device) for t in (q, k, v))
        return st

    def _capture(self, entry: Entry, fn, q, k, v, sources, where: Optional[tuple] = None) -> bool:
        """Capture ``fn`` on the caller's q, k, v (``where``: their ``_where``, a direct graph) or, without it,
        on staging copies of them (the staged graph); the graph is not replayed here."""
        staged = where is None
        dev = q.device
        if staged:
            ins = self._staging_for(q, k, v)
            for dst, src in zip(ins, (q, k, v)):
                dst.copy_(src)
        else:
            ins = (q, k, v)
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        before = collections.Counter(sources)
        try:
            with torch.cuda.stream(side):
                g.capture_begin(capture_error_mode="thread_local")
                try:
                    out = fn(*ins)
                finally:
                    g.capture_end()
        except Exception as e:  # noqa: BLE001 - any capture problem: this entry runs without a graph
            entry.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.broken = entry.failed
            torch.cuda.current_stream(dev).wait_stream(side)
            return False
        torch.cuda.current_stream(dev).wait_stream(side)
        recorded = sources - before
        if not entry.sources:
            entry.sources = recorded
        for c in recorded:  # the capture's lookups are counted at each replay instead
            sources[c] -= recorded[c]
        sources += collections.Counter()  # drop zero counts
        if staged:
            entry.staged = (g, out) + tuple(ins)
        else:
            entry.direct = (g, out, where)  # a replaced direct graph goes (its pool with it)
            entry.direct_captures += 1
        self.captures += 1
        return True
