"""Per-call-site metadata, kept outside the graph and keyed at run time (docs/methods.md, "Where the rewrite happens", "Steps and phases").

Key: ``(site, block identity, branch, shape, device)``.
* ``site``: the call site id the rewrite pass baked into the graph (one per call site of a compiled model;
  a recompile of the same model, e.g. for another grad mode, keeps it, so its metadata carries over;
  models share one only where Dynamo serves them one graph, and the block identity keeps them apart).
* block identity: ``data_ptr`` of the weight that feeds the block's q projection, passed into the op as a
  tensor (a weight dequantised inside ``forward`` is traced back to its stored parameter). Regional
  compile and Wan 2.2's two experts run one graph for many blocks; the weight tells them apart. MC-Sparse
  trusts it only while it is stable (``ops.identity_problem``): a site with no identity, or whose weight at
  a known address is another tensor or was overwritten in place (offloading into reused buffers), runs
  stock SDPA with a warning instead of reusing a selection that may belong to another block.
* branch: the n-th call of the same (site, block) within one step (CFG cond/uncond).
* shape and device: a new resolution or batch never reuses metadata of another.

Metadata belongs to one generation of one loop: each loop (``runtime/runtime.py``: the default one, or a
``vc_compile.sampling()`` block's) has a ``MetadataStore`` of its own, and when a generation starts
everything its loop cached is dropped (the op subscribes ``clear`` to the step trackers, ``ops.py``; a
generation starts in the context of its loop, so ``clear`` clears that loop's store). The module functions
act on the store of the loop active here (``runtime.active_loop()``), except ``bytes_held`` and
``drop_sites``, which cover every loop. Entries are written only after an op call succeeded, so an exception
inside a call leaves the store usable.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, Optional

import torch

from . import report as _report  # noqa: F401  (provides the sites part a store accounts its bytes to)
from .runtime import active_loop, current, provide


def nbytes(meta: Any) -> int:
    """Bytes of the tensors a metadata object holds (dataclass / NamedTuple / dict of tensors)."""
    if meta is None:
        return 0
    if isinstance(meta, torch.Tensor):
        return meta.numel() * meta.element_size()
    if isinstance(meta, dict):
        return sum(nbytes(v) for v in meta.values())
    if isinstance(meta, (tuple, list)):
        return sum(nbytes(v) for v in meta)
    if hasattr(meta, "__dict__"):
        return sum(nbytes(v) for v in vars(meta).values())
    return 0


class MetadataStore:
    """One loop's metadata, keyed as the module docstring says. ``lock`` is shared by a runtime's stores
    (``busy()``); ``sites`` is the report's registry, whose per-site ``bytes_held`` this store keeps up to
    date (it remembers what it added per site, so clearing one loop's store leaves another's bytes)."""

    def __init__(self, lock, sites):
        self.lock, self._sites = lock, sites
        self._data: Dict[tuple, Any] = {}
        self._site_bytes: collections.Counter = collections.Counter()
        # decisions made once per generation of this loop (MC-Sparse's memory plan); dropped with the entries
        self.memo: Dict[str, Any] = {}

    def get(self, key: tuple) -> Optional[Any]:
        with self.lock:
            return self._data.get(key)

    def put(self, key: tuple, meta: Any) -> None:
        site = key[0]
        with self.lock:
            old = self._data.get(key)
            if meta is None:
                self._data.pop(key, None)
            else:
                self._data[key] = meta
            delta = nbytes(meta) - nbytes(old)
            self._site_bytes[site] += delta
        self._sites.site(site).bytes_held += delta

    def keys(self) -> list:
        with self.lock:
            return list(self._data)

    def items(self) -> list:
        with self.lock:
            return list(self._data.items())

    def bytes_held(self) -> int:
        with self.lock:
            return sum(nbytes(m) for m in self._data.values())

    def _take(self, sites=None) -> Dict[int, int]:
        """Drop the entries of ``sites`` (all when None), lock held; the bytes they held per site."""
        if sites is None:
            self._data.clear()
            self.memo.clear()
            dropped, self._site_bytes = dict(self._site_bytes), collections.Counter()
        else:
            for key in [k for k in self._data if k[0] in sites]:
                del self._data[key]
            dropped = {s: self._site_bytes.pop(s) for s in sites if s in self._site_bytes}
        return dropped

    def _unaccount(self, dropped: Dict[int, int]) -> None:
        for site, n in dropped.items():
            if n:
                rec = self._sites.get(site)
                if rec is not None:
                    rec.bytes_held = max(0, rec.bytes_held - n)

    def clear(self) -> None:
        with self.lock:
            dropped = self._take()
        self._unaccount(dropped)

    def drop_sites(self, sites) -> None:
        with self.lock:
            dropped = self._take(sites)
        self._unaccount(dropped)

    def adopt(self, other: "MetadataStore") -> None:
        """Take over ``other``'s entries (a sampling loop ended: its metadata is held until the next
        generation of the loop it ran in); entries under the same key are replaced."""
        if other is self:
            return
        with self.lock:
            replaced: collections.Counter = collections.Counter()
            for key, meta in other._data.items():
                old = self._data.get(key)
                if old is not None:
                    replaced[key[0]] += nbytes(old)
                self._data[key] = meta
            for site, n in other._site_bytes.items():
                self._site_bytes[site] += n - replaced.pop(site, 0)
            for site, n in replaced.items():
                self._site_bytes[site] -= n
            other._data.clear()
            other._site_bytes = collections.Counter()
        self._unaccount(replaced)


provide("store", lambda rt: MetadataStore(rt.store_lock, rt.sites))


# ---- the store of the loop active here (what the op reads and writes) ---------------------------------
def get(key: tuple) -> Optional[Any]:
    return active_loop().store.get(key)


def put(key: tuple, meta: Any) -> None:
    """Store ``meta`` under ``key``; ``None`` drops the entry."""
    active_loop().store.put(key, meta)


def keys() -> list:
    """The keys of the metadata held now: ``(site, block identity, branch, q shape, k shape, device)``
    (diagnostics and tests: which expert / block / branch / resolution has metadata)."""
    return active_loop().store.keys()


def items() -> list:
    """(key, metadata) pairs held now (a snapshot; diagnostics, tests and benchmarks)."""
    return active_loop().store.items()


def memo() -> Dict[str, Any]:
    """The active loop's per-generation decisions (cleared with its metadata when a generation starts)."""
    return active_loop().store.memo


def clear(_generation: Optional[int] = None) -> None:
    """Drop the active loop's metadata (``TRACKER.subscribe(state.clear)``: a new generation starts)."""
    active_loop().store.clear()


# ---- every loop ---------------------------------------------------------------------------------------
def busy() -> bool:
    """Whether some thread holds the stores' lock now (a weakref finalizer that runs inside a garbage
    collection must not wait for it)."""
    return current().store_lock.locked()


def bytes_held() -> int:
    """Bytes of metadata held now, by every loop (MC-Sparse's ``residual_budget_gb`` is per process)."""
    return current().bytes_held()


def drop_sites(sites) -> None:
    """Forget the metadata of some sites, in every loop (their graph was freed, or the op refused them)."""
    sites = set(sites)
    for loop in current().loops():
        if loop.built_store is not None:
            loop.built_store.drop_sites(sites)
