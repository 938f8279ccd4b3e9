"""Per-architecture autotuning cache for the Triton kernels.

A kernel configuration (tile sizes, warps, stages, variant switches) is chosen per

    (GPU name, compute capability, CUDA version, Triton version)        -> one JSON file per kernel source
    (kernel, kernel source hash)                                        -> the file name
    (dtype, head dim, sequence-length bucket, method/variant)           -> an entry in that file

Files live under ``cache_dir()``: the ``cache_dir`` argument, else ``$VCATTN_CACHE_DIR``, else
``<Inductor's cache dir>/vcattn``. Writes are atomic (temp file + ``os.replace``) under a file lock, so
several processes tuning at once never lose or corrupt each other's entries. A corrupt or stale file is
reported once and ignored, never fatal.

Where a configuration comes from (reported per call site): ``shipped`` (the table measured on the H200
that ships in ``vc_compile/tune/shipped_<arch>.json``: a first run on a known GPU tunes nothing),
``cache`` (an earlier run on this machine), ``tuned`` (benchmarked now, with a progress line), or
``default`` (no GPU to tune on, e.g. under ``TRITON_INTERPRET``: the first candidate; never tuned).
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

Config = Dict[str, object]
SHIPPED_DIR = os.path.dirname(os.path.abspath(__file__))


def seq_bucket(S: int) -> int:
    """Sequence lengths share a configuration within a power-of-two bucket (at least 1024)."""
    b = 1024
    while b < S:
        b *= 2
    return b


@functools.lru_cache(maxsize=None)
def source_hash(*paths: str) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Arch:
    gpu: str
    cc: Tuple[int, int]
    cuda: str
    triton: str

    @property
    def dirname(self) -> str:
        safe = "".join(c if c.isalnum() else "_" for c in self.gpu)
        return f"{safe}-sm{self.cc[0]}{self.cc[1]}-cuda{self.cuda}-triton{self.triton}"

    @property
    def family(self) -> str:
        return f"sm{self.cc[0]}{self.cc[1]}"


def current_arch(device=None) -> Arch:
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = "none"
    if torch.cuda.is_available():
        dev = torch.device(device or "cuda")
        return Arch(torch.cuda.get_device_name(dev), tuple(torch.cuda.get_device_capability(dev)),
                    str(torch.version.cuda), tv)
    return Arch("cpu", (0, 0), "none", tv)


@dataclass(frozen=True)
class TuneKey:
    kernel: str
    src_hash: str
    dtype: str
    head_dim: int
    bucket: int
    variant: str = ""

    @property
    def entry(self) -> str:
        return f"{self.dtype}|d{self.head_dim}|s{self.bucket}|{self.variant}"

    def filename(self) -> str:
        return f"{self.kernel}-{self.src_hash}.json"


def make_key(kernel: str, src_files: Sequence[str], dtype, head_dim: int, seq_len: int,
             variant: str = "") -> TuneKey:
    return TuneKey(kernel, source_hash(*src_files), str(dtype).replace("torch.", ""), int(head_dim),
                   seq_bucket(int(seq_len)), variant)


def cache_dir(override: Optional[str] = None) -> str:
    if override:
        return override
    env = os.environ.get("VCATTN_CACHE_DIR")
    if env:
        return env
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        base = inductor_cache_dir()
    except Exception:
        base = os.path.join(tempfile.gettempdir(), f"torchinductor_{os.environ.get('USER', 'user')}")
    return os.path.join(base, "vcattn")


_REPORTED = set()


def _report_bad(path: str, why: str) -> None:
    if path not in _REPORTED:
        _REPORTED.add(path)
        warnings.warn(f"vcattn: ignoring tuning cache file {path} ({why}); it will be rewritten.",
                      RuntimeWarning, stacklevel=3)


def load(path: str) -> Dict[str, Config]:
    """Entries of a cache file; {} when missing. A corrupt file is reported and ignored."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _report_bad(path, f"unreadable: {type(e).__name__}")
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        _report_bad(path, "not a vcattn tuning file")
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(v, dict) and isinstance(v.get("config"), dict)}


def store(path: str, entry: str, record: Dict[str, object]) -> None:
    """Add one entry, atomically, under a lock (read-modify-write: concurrent writers keep all entries)."""
    from filelock import FileLock

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with FileLock(path + ".lock", timeout=60):
        entries = load(path)
        entries[entry] = record
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


@functools.lru_cache(maxsize=None)
def _shipped(family: str) -> Dict[str, Dict[str, Config]]:
    path = os.path.join(SHIPPED_DIR, f"shipped_{family}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _report_bad(path, f"unreadable: {type(e).__name__}")
        return {}


def shipped_config(key: TuneKey, family: str) -> Optional[Config]:
    """The shipped configuration for ``key``: an exact entry, else the most specific ``*`` pattern
    (fewest ``*``; e.g. ``bfloat16|d128|s*|exp2-int8`` covers every sequence length)."""
    table = _shipped(family).get(key.kernel, {})
    if key.entry in table:
        return dict(table[key.entry])
    pats = sorted((p for p in table if "*" in p and fnmatch.fnmatchcase(key.entry, p)),
                  key=lambda p: (p.count("*"), p))
    return dict(table[pats[0]]) if pats else None


def _line_progress(key: TuneKey, arch: Arch, n: int) -> Callable[[int, Config, Optional[float]], None]:
    """The default progress report: ONE line on stderr, a dot per benchmarked configuration."""
    print(f"vcattn: tuning {key.kernel} [{key.entry}] on {arch.gpu}: {n} configs ", end="",
          file=sys.stderr, flush=True)

    def step(i: int, cfg: Config, ms: Optional[float]) -> None:
        print("." if ms is not None else "x", end="" if i + 1 < n else "\n", file=sys.stderr, flush=True)
    return step


def get_config(key: TuneKey, candidates: List[Config], bench: Optional[Callable[[Config], float]] = None,
               *, arch: Optional[Arch] = None, directory: Optional[str] = None,
               shipped: bool = True, quiet: bool = False, force: bool = False,
               progress: Optional[Callable[[int, Config, Optional[float]], None]] = None
               ) -> Tuple[Config, str]:
    """The configuration for ``key`` and where it came from: shipped, cache, tuned or default.

    Order: the shipped table of the GPU family (skipped with ``shipped=False``), then the cache file,
    then tuning: ``bench(config) -> ms`` runs one candidate (it may raise: that candidate is skipped)
    and the fastest is stored. Tuning never happens without ``bench`` (the caller passes none where it
    cannot time kernels, e.g. under ``TRITON_INTERPRET``): then the first candidate (the measured default)
    is used, source ``default``, nothing is written.
    ``progress(i, config, ms or None)`` is called after each candidate (default: one line on stderr).
    ``force=True`` skips the shipped table and the cache: it always tunes (where tuning is possible).
    """
    if not candidates:
        raise ValueError(f"no candidate configurations for {key.kernel}")
    arch = arch or current_arch()
    if shipped and not force:
        hit = shipped_config(key, arch.family)
        if hit is not None:
            return hit, "shipped"
    path = os.path.join(cache_dir(directory), arch.dirname, key.filename())
    hit = None if force else load(path).get(key.entry)
    if hit is not None:
        return dict(hit["config"]), "cache"
    if bench is None:
        return dict(candidates[0]), "default"
    if progress is None:
        progress = (lambda i, cfg, ms: None) if quiet else _line_progress(key, arch, len(candidates))
    timings = []
    for i, cfg in enumerate(candidates):
        try:
            ms = float(bench(cfg))
        except Exception:  # a config that fails to compile, run or validate (e.g. out of shared memory)
            ms = float("inf")
        progress(i, cfg, ms if ms != float("inf") else None)
        timings.append(ms)
    best = min(range(len(candidates)), key=lambda i: timings[i])
    if timings[best] == float("inf"):
        raise RuntimeError(f"vcattn: every candidate configuration of {key.kernel} failed for {key.entry}")
    store(path, key.entry, {"config": candidates[best], "ms": timings[best],
                            "all_ms": [t if t != float("inf") else None for t in timings]})
    return dict(candidates[best]), "tuned"
