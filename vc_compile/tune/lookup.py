"""The one lookup ``templates/dispatch.py`` makes for a kernel's launch configuration (``resolve``).

Configurations are plain JSON dicts here (``configs.py``'s ``to_json``): this package imports no kernel.
Order: shipped table of the GPU family -> local cache -> tune on first use (``triton.testing.do_bench``
over the kernel's candidates, each output validated against the first candidate's, a progress bar,
stored in the cache). Off CUDA or not ``tunable`` (the caller says so under ``TRITON_INTERPRET``): the first
candidate (the measured default), source ``default``, no file I/O, never tuned.

Hot path: the answer is memoised per (kernel, dtype, head dim, sequence length, variant, device) in
this process, so a launch costs one dict lookup. ``configure()`` changes the policy at run time (cache
directory, ignore the shipped table, force re-tuning) and clears the memo; nothing is read from the
environment at import time (``$VCATTN_CACHE_DIR`` is read at the first lookup of a key).

``recording()`` collects, for one op call, ``"<kernel>:<source>"`` counts: ``vcattn::attention`` puts
them into the call site's record (``report()``'s ``config`` column).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import cache
from .cache import Config

_LOCK = threading.Lock()
_MEMO: Dict[tuple, Tuple[Config, str]] = {}
_LAST: Dict[str, Config] = {}
_POLICY = {"directory": None, "shipped": True, "force": False, "progress": None}
_TL = threading.local()
# Two valid variants of one kernel differ only in rounding (row sums in fp16 vs fp32, the bf16 hi/lo
# mean MMA, summation order): their outputs agree to ~1e-3 relative L2, while each is ~5e-3 from the
# fp32 truth (docs/kernels_notes.md). A broken compile (the NaN rows seen with some exp2 + MEAN 1
# specialisations, garbage from a mis-compiled layout) is far beyond 2e-2: rejected, never cached.
VALIDATE_REL_L2 = 2e-2


def configure(*, cache_dir: Optional[str] = None, shipped: Optional[bool] = None,
              force: Optional[bool] = None, progress=None) -> Dict[str, object]:
    """Set the tuning policy for this process (None = keep) and forget memoised answers.

    ``cache_dir``: where tuned configurations are stored (default: ``$VCATTN_CACHE_DIR``, else
    ``~/.cache/vc_compile/tune``; pass "" to go back to the default). ``shipped=False``: ignore the
    shipped table (tune as on an unknown GPU). ``force=True``: re-tune every key once, even when it is
    shipped or cached. ``progress``: callback ``(i, config, ms or None)`` (the CLI draws a bar)."""
    with _LOCK:
        if cache_dir is not None:
            _POLICY["directory"] = cache_dir or None
        if shipped is not None:
            _POLICY["shipped"] = bool(shipped)
        if force is not None:
            _POLICY["force"] = bool(force)
        if progress is not None:
            _POLICY["progress"] = progress or None
        _MEMO.clear()
        return dict(_POLICY)


def clear_memo() -> None:
    with _LOCK:
        _MEMO.clear()


@contextlib.contextmanager
def recording(directory: Optional[str] = None):
    """Collect ``"<kernel>:<source>"`` counts of the lookups made inside the block (this thread).
    ``directory``: the cache directory for these lookups (the op passes the ``tune_cache_dir`` option;
    None = the process policy of :func:`configure`, then ``$VCATTN_CACHE_DIR``)."""
    prev, prev_dir = getattr(_TL, "rec", None), getattr(_TL, "directory", None)
    rec = _TL.rec = collections.Counter()
    _TL.directory = directory
    try:
        yield rec
    finally:
        _TL.rec, _TL.directory = prev, prev_dir


@functools.lru_cache(maxsize=None)
def _arch(index: int) -> cache.Arch:
    return cache.current_arch(torch.device("cuda", index))


def resolve(kernel: str, src_files: List[str], candidates: List[Config], *, dtype, head_dim: int, seq_len: int,
            variant: str, device: torch.device, tunable: bool = True,
            bench: Optional[Callable[[Config], float]] = None) -> Tuple[Config, str]:
    """(config, source) for one launch; source is shipped | cache | tuned | default (see module doc).
    ``src_files``: the kernel's sources (their hash names its cache file)."""
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    directory = getattr(_TL, "directory", None)
    mkey = (kernel, dtype, head_dim, seq_len, variant, device.type, index, directory)
    hit = _MEMO.get(mkey)
    if hit is None:
        hit = _lookup(kernel, src_files, candidates, dtype, head_dim, seq_len, variant, device, index, tunable,
                      bench, directory)
        if hit is None:  # not memoised: e.g. during CUDA graph capture, ask again next time
            hit = (candidates[0], "default")
        else:
            with _LOCK:
                _MEMO[mkey] = hit
    _LAST[kernel] = hit[0]
    rec = getattr(_TL, "rec", None)
    if rec is not None:
        rec[f"{kernel}:{hit[1]}"] += 1
    return hit


def last_config(kernel: str) -> Optional[Config]:
    """The configuration of ``kernel``'s latest launch in this process (the CLI prints it)."""
    return _LAST.get(kernel)


def _lookup(kernel, src_files, candidates, dtype, head_dim, seq_len, variant, device, index, tunable, bench,
            directory=None):
    if device.type != "cuda" or not tunable:
        return dict(candidates[0]), "default"
    if torch.cuda.is_current_stream_capturing():
        return None  # no benchmarking (or anything else) inside a graph capture
    key = cache.make_key(kernel, list(src_files), dtype, head_dim, seq_len, variant)
    pol = dict(_POLICY)
    try:
        with torch.cuda.device(index):
            return cache.get_config(key, candidates, bench, arch=_arch(index), directory=directory or pol["directory"],
                                    shipped=pol["shipped"], force=pol["force"], progress=pol["progress"])
    except RuntimeError as e:  # every candidate failed to run or validate: never fatal
        warnings.warn(f"vcattn: tuning {kernel} failed ({e}); using its default configuration.",
                      RuntimeWarning, stacklevel=3)
        return dict(candidates[0]), "default"


def validated_bench(launch: Callable[[Config], object], *, warmup: int = 25, rep: int = 100
                    ) -> Callable[[Config], float]:
    """``bench(config) -> ms`` for ``cache.get_config``: runs ``launch(config)`` once and checks its
    output against the first candidate's (finite where that one is finite; relative L2 within
    ``VALIDATE_REL_L2``), raising ValueError otherwise (the candidate is skipped), then times it."""
    state: Dict[str, object] = {}

    def bench(cfg: Config) -> float:
        import triton.testing

        out = launch(cfg)
        out = out[0] if isinstance(out, tuple) else out
        if "ref" not in state:
            state["ref"], state["finite"] = out, bool(torch.isfinite(out).all())
        else:
            _check(out, state["ref"], state["finite"])
        del out
        return float(triton.testing.do_bench(lambda: launch(cfg), warmup=warmup, rep=rep,
                                             return_mode="median"))
    return bench


def _check(out: torch.Tensor, ref: torch.Tensor, ref_finite: bool) -> None:
    if ref_finite and not bool(torch.isfinite(out).all()):
        raise ValueError("non-finite output")
    err = torch.zeros((), device=out.device, dtype=torch.float64)
    nrm = torch.zeros_like(err)
    o, r = out.reshape(-1), ref.reshape(-1)
    for i in range(0, o.numel(), 1 << 26):  # chunks: a 75600-token output is GBs in fp32
        oc, rc = o[i:i + (1 << 26)].float(), r[i:i + (1 << 26)].float()
        ok = torch.isfinite(rc)
        err += ((oc - rc)[ok].double() ** 2).sum()
        nrm += (rc[ok].double() ** 2).sum()
    rel = float((err / nrm.clamp_min(1e-300)).sqrt())
    if not rel <= VALIDATE_REL_L2:
        raise ValueError(f"output differs from the default configuration's (rel. L2 {rel:.2e})")
