"""Per-call-site metadata, kept outside the graph and keyed at run time (SPEC 2, 4).

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

Metadata belongs to one generation: when a generation starts, everything cached is dropped (the op
subscribes ``clear`` to the step tracker, ``ops.py``). Entries are written only after an op call succeeded,
so an exception inside a call leaves the store usable.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import torch

from . import report as _report

_LOCK = threading.Lock()
_STORE: Dict[tuple, Any] = {}


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


def get(key: tuple) -> Optional[Any]:
    with _LOCK:
        return _STORE.get(key)


def put(key: tuple, meta: Any) -> None:
    """Store ``meta`` under ``key``; ``None`` drops the entry."""
    site = key[0]
    with _LOCK:
        old = _STORE.get(key)
        if meta is None:
            _STORE.pop(key, None)
        else:
            _STORE[key] = meta
        delta = nbytes(meta) - nbytes(old)
    _report.site(site).bytes_held += delta


def keys() -> list:
    """The keys of the metadata held now: ``(site, block identity, branch, q shape, k shape, device)``
    (diagnostics and tests: which expert / block / branch / resolution has metadata)."""
    with _LOCK:
        return list(_STORE)


def items() -> list:
    """(key, metadata) pairs held now (a snapshot; diagnostics, tests and benchmarks)."""
    with _LOCK:
        return list(_STORE.items())


def busy() -> bool:
    """Whether some thread holds the store's lock now (a weakref finalizer that runs inside a garbage
    collection must not wait for it)."""
    return _LOCK.locked()


def bytes_held() -> int:
    with _LOCK:
        return sum(nbytes(m) for m in _STORE.values())


def clear(_generation: Optional[int] = None) -> None:
    """Drop all metadata (``TRACKER.subscribe(state.clear)``: a new generation starts)."""
    with _LOCK:
        _STORE.clear()
    _report.set_bytes_held(None, 0)


def drop_sites(sites) -> None:
    """Forget the metadata of some sites (their graph was freed)."""
    sites = set(sites)
    with _LOCK:
        for key in [k for k in _STORE if k[0] in sites]:
            del _STORE[key]
    _report.set_bytes_held(sites, 0)
