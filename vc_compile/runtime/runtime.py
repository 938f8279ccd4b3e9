"""The process's run-time state, in one object: ``Runtime``; ``current()`` is the process-wide instance.

What ``vcattn::attention`` remembers between calls, and what ``vc_compile.reset()`` forgets, is held here:

* ``default``: the ``Loop`` that serves every call made outside ``vc_compile.sampling()`` (pipelines
  followed through their callback or their frame, custom loops read through the timestep argument, call
  counts): a step tracker (``runtime/tracker.py``) and a metadata store (``runtime/state.py``).
* the loops of the ``sampling()`` blocks open now: each block gets a ``Loop`` of its own (tracker and
  store), so two sampling loops, in two threads or two interleaved generators, never share a step, a
  generation or metadata (``runtime/steps.py`` says which loop a call belongs to: ``active_loop()``).
* ``sites``: the report's call-site registry (``runtime/report.py``).
* ``tuning``: the tuning policy and the memo of launch configurations (``tune/lookup.py``).
* ``checks``: what the op has seen per site (block identities, sharpness readings, one-time warnings, the
  blocks whose weights it watches; ``ops.py`` binds these containers at import).
* ``graphs``: the reuse steps captured as CUDA graphs (``kernels/graphs.py``; a new generation of any loop
  clears them, with the metadata they were captured for).
* ``programs``: the reuse steps recorded as launch sequences (``kernels/programs.py``; cleared with the graphs).
* ``live_graphs``: how many live compiled graphs call each site (``backend.py``: a freed graph's metadata
  goes with it).
* ``prebuilds``: the helper processes that build the kernels of the compiled calls ahead of their first launch
  (``prebuild/helpers.py``; the op's first call waits for them).
* ``said``: the one-time warnings and notes given so far (``once(topic, key)``), which ``reset()`` keeps.
* ``build_failures`` / ``build_fallbacks``: the kernels that did not build on the installed Triton and what ran
  instead; ``cp_findings``: what the context-parallel detection found; ``owners``: which pipelines enabled a module.
* ``subscribers``: functions run whenever a generation of any loop starts (``ops.py`` subscribes the store's
  ``clear`` and its own per-generation memory). A generation of a loop always starts in a context where that
  loop is the active one, so ``state.clear`` clears that loop's store.

The module functions of the parts (``state.get/put``, ``report.site``, ``lookup.configure`` ...) are thin
delegators to ``current()`` / ``active_loop()``.

This module sits at the bottom of the package: it imports nothing of it but the step tracker. A part that lives
elsewhere (``PARTS``) is built on first use by the factory its module registers at import (``provide``), so the
parts' modules import this one and never the other way round; a part whose module was never imported does not
exist, and ``part(name)`` says so with None (no kernel-build helper can be running if the module that starts them
was never imported).
"""
from __future__ import annotations

import collections
import contextvars
import itertools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

from .tracker import Tracker

# Every part of a Runtime built by another module, and that module: it registers the part's factory at import.
PARTS: Dict[str, str] = {
    "sites": "vc_compile.runtime.report",  # the call-site registry
    "store": "vc_compile.runtime.state",  # a loop's metadata store (one per loop, not per runtime)
    "tuning": "vc_compile.tune.lookup",  # the tuning policy and its memo
    "graphs": "vc_compile.kernels.graphs",  # reuse steps captured as CUDA graphs
    "programs": "vc_compile.kernels.programs",  # reuse steps recorded as launch sequences
    "prebuilds": "vc_compile.prebuild.helpers",  # kernel-build helper processes
}
_FACTORIES: Dict[str, Callable[["Runtime"], Any]] = {}


def provide(name: str, factory: Callable[["Runtime"], Any]) -> None:
    """Register the factory of part ``name`` (called once by the module ``PARTS[name]`` names, at import)."""
    if name not in PARTS:
        raise ValueError(f"vc_compile runtime: {name!r} is not a runtime part (PARTS: {sorted(PARTS)})")
    _FACTORIES[name] = factory

_CREATE = threading.Lock()
_DEFAULT: Optional["Runtime"] = None
# The sampling() loop active in this context (thread, asyncio task, or a context a generator runs in);
# None: the runtime's default loop. Read on every op call (one ContextVar.get).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("vc_compile_active_loop", default=None)


class Loop:
    """One sampling loop's step tracker and metadata store. ``parent``: the loop active where this one was
    opened (None for a runtime's default loop); ``closed``: its ``sampling()`` block has ended (a context
    still pointing at it falls back to its nearest open parent). The store is built on first use (its module,
    ``runtime/state.py``, imports this one); ``built_store`` is None until then."""

    __slots__ = ("tracker", "built_store", "_runtime", "parent", "closed", "__weakref__")

    def __init__(self, tracker, runtime: "Runtime", parent: Optional["Loop"] = None):
        self.tracker, self._runtime, self.parent, self.closed = tracker, runtime, parent, False
        self.built_store = None

    @property
    def store(self):
        s = self.built_store
        if s is None:
            with _CREATE:
                if self.built_store is None:
                    self.built_store = _build(self._runtime, "store")
                s = self.built_store
        return s

    def activate(self) -> None:
        """Make this loop the active one in the current context (``vc_compile.sampling() as loop``:
        ``loop.step(i)`` does it, so interleaved generators each find their own loop again)."""
        if not self.closed:
            _ACTIVE.set(self)


def _build(rt: "Runtime", name: str):
    factory = _FACTORIES.get(name)
    if factory is None:
        raise RuntimeError(f"vc_compile runtime: the part {name!r} comes from {PARTS[name]}, which is not "
                           f"imported; import it before using the part")
    return factory(rt)


class Checks:
    """What the op remembers per site across calls (``ops.py`` binds these containers at import, under its
    historical names): block identities and the sites refused for an unstable one, sharpness readings,
    one-time warnings; the blocks whose weights are watched and the ones freed (drained at the next call)."""

    def __init__(self):
        self.idents: dict = {}  # (site, ident ptr) -> (version, weakref or storage id)
        self.unstable: dict = {}  # site -> what was seen (refused until reset())
        self.ident_warned: set = set()
        self.sharp: dict = {}  # (site, ident ptr, q shape, k shape, device) -> sampled logit std
        self.sharp_worst: dict = {}  # site -> (readings taken, the largest)
        self.sharp_warned: set = set()
        self.quant: dict = {}  # (site, ident ptr, q shape, k shape, device) -> quant_check's action
        self.quant_warned: set = set()  # (site, action)
        self.known_warned: set = set()  # sites warned of a kernel failure known on the installed Triton
        self.mask_warned: set = set()  # mask reasons warned (every site of a model shares its mask)
        self.nonfinite_warned: set = set()
        self.method_warned: set = set()  # (site, reason) of calls a method sent to stock SDPA for accuracy
        self.watched: dict = {}  # (site, ident ptr) -> the weight (weakly) and the metadata keys written
        self.lanes: dict = {}  # (site, config, scale) -> the call's layout-bound decisions (ops._Lane)
        self.freed: collections.deque = collections.deque()

    def forget(self) -> None:
        """What ``vc_compile.reset()`` forgets (the watched blocks stay: their finalizers are registered)."""
        for c in (self.idents, self.unstable, self.ident_warned, self.sharp, self.sharp_worst, self.sharp_warned,
                  self.quant, self.quant_warned, self.known_warned, self.mask_warned, self.nonfinite_warned,
                  self.method_warned, self.lanes):
            c.clear()


class Runtime:
    """The run-time state of one process (see the module docstring); ``current()`` is the one in use."""

    def __init__(self):
        self._lock = threading.RLock()  # re-entrant: a finalizer run by a GC inside it may call loops()
        self.subscribers: List[Any] = []  # fn(generation), run when a generation of any loop starts
        self.generations = itertools.count(1)  # generation numbers, unique across this runtime's loops
        self.store_lock = threading.Lock()  # one lock for every loop's store (``state.busy()``)
        self.checks = Checks()
        self.live_graphs: collections.Counter = collections.Counter()  # site id -> live compiled graphs
        # one-time notes given in this process, per topic (``once``); reset() keeps them: a warning is said once
        self.said: Dict[str, set] = collections.defaultdict(set)
        # kernel rows that failed to build on the installed Triton (why) and what ran instead (kernels/dispatch.py);
        # facts of the toolchain, kept by reset()
        self.build_failures: Dict[str, str] = {}
        self.build_fallbacks: Dict[str, str] = {}
        self.cp_findings: List[Any] = []  # context-parallel findings of the compiled graphs (passes/cp_detect.py)
        # module -> the pipelines enabled with it (pipeline.py: a shared transformer stays compiled until the last)
        self.owners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.default = Loop(self._tracker(), self)
        self._open: "weakref.WeakSet[Loop]" = weakref.WeakSet()  # the sampling() loops open now

    def __getattr__(self, name: str):
        """A part of ``PARTS`` (sites, tuning, graphs, programs, prebuilds), built on first use."""
        if name not in PARTS or name == "store":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        with self._lock:
            part = self.__dict__.get(name)
            if part is None:
                part = self.__dict__[name] = _build(self, name)
        return part

    def once(self, topic: str, key: Any) -> bool:
        """True the first time ``(topic, key)`` is asked in this process: a one-time warning or note is due."""
        with self._lock:
            seen = self.said[topic]
            if key in seen:
                return False
            seen.add(key)
            return True

    def part(self, name: str):
        """Part ``name`` if it was built, else None (nothing of it exists yet)."""
        if name not in PARTS:
            raise ValueError(f"vc_compile runtime: {name!r} is not a runtime part")
        return self.__dict__.get(name)

    def _tracker(self):
        return Tracker(subscribers=self.subscribers, generations=self.generations)

    # ---- the default loop's parts, by their old names -------------------------------------------
    @property
    def tracker(self):
        return self.default.tracker

    @property
    def store(self):
        return self.default.store

    def loops(self) -> List[Loop]:
        """The default loop and every sampling loop open now."""
        with self._lock:
            return [self.default, *self._open]

    # ---- sampling() blocks ------------------------------------------------------------------------
    def open_loop(self, num_steps: Optional[int]):
        """A ``sampling(num_steps)`` block starts: a new loop, active in this context, at a new generation
        of its own. Opened from the default loop it also starts a new generation there, as the one shared
        tracker did before loops had their own: the metadata of whatever ran before is dropped now.
        Returns ``(loop, token)`` for ``close_loop``."""
        parent = active_loop()
        if parent is self.default:
            t = parent.tracker
            with t.lock:
                t.pending_generation = False
                t.last_source = None
                t._new_generation_locked()
        loop = Loop(self._tracker(), self, parent)
        t = loop.tracker
        t.explicit_active, t.explicit_steps, t.explicit_step = True, num_steps, None
        with self._lock:
            self._open.add(loop)
        token = _ACTIVE.set(loop)
        with t.lock:
            t._new_generation_locked()
        return loop, token

    def close_loop(self, loop: Loop, token) -> None:
        """A ``sampling()`` block ends. Its metadata stays held until the next generation, as before: a loop
        opened from the default loop hands its store to the default loop, whose next call starts a new
        generation; a loop nested in another sampling loop drops its metadata (the outer generation goes on
        undisturbed)."""
        loop.closed = True
        if _ACTIVE.get() is loop:
            try:
                _ACTIVE.reset(token)
            except (ValueError, RuntimeError):  # closed from another context (a generator finalised elsewhere)
                _ACTIVE.set(_open_parent(loop))
        with self._lock:
            self._open.discard(loop)
        parent = _open_parent(loop)
        if parent is self.default:
            t = parent.tracker
            with t.lock:
                t.last_source = None
                t.pending_generation = True  # whatever runs next is another generation
            if loop.built_store is not None:
                parent.store.adopt(loop.built_store)
        elif loop.built_store is not None:
            loop.built_store.clear()

    # ---- vc_compile.reset() -------------------------------------------------------------------------
    def reset(self, report: bool = False) -> None:
        """Drop all cached metadata and step state (a fresh generation in every loop: the default one and
        the sampling loops open now, each keeping its ``num_steps``) and what the op remembered per site;
        ``report=True`` also forgets the call-site records and counts (and the kernel-build helpers' records),
        else only the counts are zeroed."""
        for loop in self.loops():
            loop.tracker.reset()
            if loop.built_store is not None:
                loop.built_store.clear()
        self.checks.forget()
        for name in ("graphs", "programs"):
            if self.part(name) is not None:
                self.part(name).clear()
        sites, prebuilds = self.part("sites"), self.part("prebuilds")
        if report:
            if sites is not None:
                sites.clear()
            if prebuilds is not None:
                prebuilds.forget()
        elif sites is not None:
            sites.reset_counts()

    def bytes_held(self) -> int:
        """Bytes of metadata held by every loop (the MC-Sparse residual budget is per process)."""
        return sum(loop.built_store.bytes_held() for loop in self.loops() if loop.built_store is not None)


def _open_parent(loop: Loop) -> Loop:
    p = loop.parent
    while p is not None and p.closed:
        p = p.parent
    return p if p is not None else current().default


def current() -> Runtime:
    """The process's runtime (built on first use)."""
    rt = _DEFAULT
    if rt is None:
        rt = _create()
    return rt


def _create() -> Runtime:
    global _DEFAULT
    with _CREATE:
        if _DEFAULT is None:
            _DEFAULT = Runtime()
        return _DEFAULT


def active_loop() -> Loop:
    """The loop a call made here belongs to: the innermost open ``sampling()`` loop of this context, else
    the runtime's default loop."""
    loop = _ACTIVE.get()
    if loop is None:
        return current().default
    while loop.closed:
        loop = loop.parent
        if loop is None:
            return current().default
    return loop
