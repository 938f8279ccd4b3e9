"""The one lookup ``kernels/dispatch.py`` makes for a kernel's launch configuration (``resolve``).

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

State: the policy, the memo and each kernel's latest config are a ``TunePolicy`` held by the process's
``runtime.Runtime`` (``tuning``); ``resolve(policy=...)`` takes one explicitly. The op's per-call
``tune_cache_dir`` and counts travel in a context variable set by ``recording`` (dispatch, between the op and
``resolve``, passes no tuning argument).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import threading
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..runtime.runtime import current, provide
from . import cache
from .cache import Config

# Two valid variants of one kernel differ only in rounding (row sums in fp16 vs fp32, the bf16 hi/lo
# mean MMA, summation order): their outputs agree to ~1e-3 relative L2, while each is ~5e-3 from the
# fp32 truth (docs/design/vsmooth-triton-config.md). A broken compile (the NaN rows seen with some exp2 + MEAN 1
# specialisations, garbage from a mis-compiled layout) is far beyond 2e-2: rejected, never cached.
VALIDATE_REL_L2 = 2e-2


class TunePolicy:
    """The process's tuning policy and what it has answered (``runtime.Runtime.tuning``): the cache directory,
    whether the shipped table counts, forced re-tuning, the progress callback; the memo of answers and each
    kernel's latest config. The module functions act on the current runtime's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.memo: Dict[tuple, Tuple[Config, str]] = {}
        self.last: Dict[str, Config] = {}
        self.directory: Optional[str] = None
        self.shipped, self.force, self.progress = True, False, None

    def as_dict(self) -> Dict[str, object]:
        return {"directory": self.directory, "shipped": self.shipped, "force": self.force, "progress": self.progress}

    def configure(self, *, cache_dir: Optional[str] = None, shipped: Optional[bool] = None,
                  force: Optional[bool] = None, progress=None) -> Dict[str, object]:
        with self.lock:
            if cache_dir is not None:
                self.directory = cache_dir or None
            if shipped is not None:
                self.shipped = bool(shipped)
            if force is not None:
                self.force = bool(force)
            if progress is not None:
                self.progress = progress or None
            self.memo.clear()
            return self.as_dict()

    def clear_memo(self) -> None:
        with self.lock:
            self.memo.clear()


provide("tuning", lambda rt: TunePolicy())


def configure(*, cache_dir: Optional[str] = None, shipped: Optional[bool] = None,
              force: Optional[bool] = None, progress=None) -> Dict[str, object]:
    """Set the tuning policy for this process (None = keep) and forget memoised answers.

    ``cache_dir``: where tuned configurations are stored (default: ``$VCATTN_CACHE_DIR``, else
    ``~/.cache/vc_compile/tune``; pass "" to go back to the default). ``shipped=False``: ignore the
    shipped table (tune as on an unknown GPU). ``force=True``: re-tune every key once, even when it is
    shipped or cached. ``progress``: callback ``(i, config, ms or None)`` (the CLI draws a bar)."""
    return current().tuning.configure(cache_dir=cache_dir, shipped=shipped, force=force, progress=progress)


def clear_memo() -> None:
    current().tuning.clear_memo()


# The op call in progress in this context: (its "<kernel>:<source>" counts, its cache directory). Set by
# ``recording`` around one op call; the launches dispatch makes inside it read it (dispatch's signatures
# carry no tuning argument, so the op's ``tune_cache_dir`` reaches ``resolve`` this way).
_CALL: contextvars.ContextVar = contextvars.ContextVar("vc_compile_tune_call", default=None)


@contextlib.contextmanager
def recording(directory: Optional[str] = None):
    """Collect ``"<kernel>:<source>"`` counts of the lookups made inside the block (this context).
    ``directory``: the cache directory for these lookups (the op passes the ``tune_cache_dir`` option;
    None = the process policy of :func:`configure`, then ``$VCATTN_CACHE_DIR``)."""
    rec = collections.Counter()
    token = _CALL.set((rec, directory))
    try:
        yield rec
    finally:
        _CALL.reset(token)


@functools.lru_cache(maxsize=None)
def _arch(index: int) -> cache.Arch:
    return cache.current_arch(torch.device("cuda", index))


def resolve(kernel: str, src_files: List[str], candidates: List[Config], *, dtype, head_dim: int, seq_len: int,
            variant: str, device: torch.device, tunable: bool = True,
            bench: Optional[Callable[[Config], float]] = None, policy: Optional[TunePolicy] = None,
            directory: Optional[str] = None) -> Tuple[Config, str]:
    """(config, source) for one launch; source is shipped | cache | tuned | default (see module doc).
    ``src_files``: the kernel's sources (their hash names its cache file). ``policy``: the tuning policy to
    use (default: the current runtime's); ``directory``: the cache directory of this launch (default: the
    enclosing ``recording``'s, then the policy's)."""
    pol = policy if policy is not None else current().tuning
    call = _CALL.get()
    if directory is None and call is not None:
        directory = call[1]
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    mkey = (kernel, dtype, head_dim, seq_len, variant, device.type, index, directory)
    hit = pol.memo.get(mkey)
    if hit is None:
        hit = _lookup(kernel, src_files, candidates, dtype, head_dim, seq_len, variant, device, index, tunable,
                      bench, directory, policy=pol)
        if hit is None:  # not memoised: e.g. during CUDA graph capture, ask again next time
            hit = (candidates[0], "default")
        else:
            with pol.lock:
                pol.memo[mkey] = hit
    pol.last[kernel] = hit[0]
    if call is not None:
        call[0][f"{kernel}:{hit[1]}"] += 1
    return hit


def last_config(kernel: str) -> Optional[Config]:
    """The configuration of ``kernel``'s latest launch in this process (the CLI prints it)."""
    return current().tuning.last.get(kernel)


def _lookup(kernel, src_files, candidates, dtype, head_dim, seq_len, variant, device, index, tunable, bench,
            directory=None, policy: Optional[TunePolicy] = None):
    if device.type != "cuda" or not tunable:
        return dict(candidates[0]), "default"
    if torch.cuda.is_current_stream_capturing():
        return None  # no benchmarking (or anything else) inside a graph capture
    key = cache.make_key(kernel, list(src_files), dtype, head_dim, seq_len, variant)
    pol = (policy if policy is not None else current().tuning).as_dict()
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
