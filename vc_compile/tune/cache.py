"""Per-architecture autotuning cache for the Triton kernels.

A kernel configuration (tile sizes, warps, stages, variant switches) is chosen per

    (GPU name, compute capability, CUDA version, Triton version,
     memory, power limit, max SM clock (NVML))                          -> one JSON file per kernel source
    (kernel, kernel source hash)                                        -> the file name
    (dtype, head dim, sequence-length bucket, method/variant)           -> an entry in that file

Files live under ``cache_dir()``: the ``cache_dir`` argument, else ``$VCATTN_CACHE_DIR``, else the user's
persistent cache, ``$XDG_CACHE_HOME/vc_compile/tune`` (``~/.cache/vc_compile/tune``; it survives reboots,
as Triton's compiled kernels in ``~/.triton`` do). The NVML part of the key (``vc_compile/nvml.py``) keeps a
power-capped or down-clocked board from reusing another's measurements; without NVML (no nvidia-ml-py, no
driver) it is empty and the key is the one used before it existed, so such entries keep their meaning (a
cache written without NVML is re-tuned once where NVML is present). Writes are atomic (temp file +
``os.replace``) under a file lock, so several processes tuning at once never lose or corrupt each other's
entries. A corrupt or stale file is reported once and ignored, never fatal; so is an entry whose
configuration is not among the kernel's candidates (re-tuned), and a directory that cannot be written
(tuned without caching, one warning).

Where a configuration comes from (reported per call site): ``shipped`` (the table measured on the H200
that ships in ``vc_compile/tune/shipped_<arch>.json``: a first run on a known GPU tunes nothing),
``cache`` (an earlier run on this machine), ``tuned`` (benchmarked now, with a progress bar), or
``default`` (no GPU to tune on, e.g. under ``TRITON_INTERPRET``: the first candidate; never tuned).
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..runtime.runtime import current

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
    hw: str = ""  # NVML: "<mem>GB-<power limit>W-<max SM clock>MHz", "" when unknown

    @property
    def dirname(self) -> str:
        safe = "".join(c if c.isalnum() else "_" for c in self.gpu)
        name = f"{safe}-sm{self.cc[0]}{self.cc[1]}-cuda{self.cuda}-triton{self.triton}"
        return f"{name}-{self.hw}" if self.hw else name

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
        from ..nvml import tuning_suffix

        dev = torch.device(device or "cuda")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return Arch(torch.cuda.get_device_name(dev), tuple(torch.cuda.get_device_capability(dev)),
                    str(torch.version.cuda), tv, tuning_suffix(index))
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
    """``override``, else ``$VCATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/vc_compile/tune`` (default
    ``~/.cache/vc_compile/tune``; a temporary folder when there is no home directory)."""
    if override:
        return override
    env = os.environ.get("VCATTN_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not base:
        home = os.path.expanduser("~")
        base = os.path.join(home, ".cache") if home not in ("~", "", "/") else ""
    if not base:  # per user id (not the spoofable $USER); its ownership is checked before use (_private_ok)
        uid = os.getuid() if hasattr(os, "getuid") else os.environ.get("USER", "user")
        return os.path.join(tempfile.gettempdir(), f"vc_compile-{uid}", "tune")
    return os.path.join(base, "vc_compile", "tune")


MAX_FILE_BYTES = 4 << 20  # a cache file holds a few KB; anything larger is not ours


def _private_ok(directory: str) -> bool:
    """False when ``directory`` sits under the shared temporary folder (the no-home fallback) in a parent
    this user does not own or others can write: another user could plant files there."""
    tmp = os.path.realpath(tempfile.gettempdir())
    d = os.path.realpath(directory)
    if not hasattr(os, "getuid") or not d.startswith(tmp + os.sep):
        return True
    top = os.path.join(tmp, os.path.relpath(d, tmp).split(os.sep)[0])
    try:
        st = os.stat(top)
    except FileNotFoundError:
        return True  # not there yet: made by us, mode 0o700 (_store)
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _report_bad(path: str, why: str) -> None:
    if current().once("tuning cache file", path):
        warnings.warn(f"vcattn: ignoring tuning cache file {path} ({why}); it will be rewritten.",
                      RuntimeWarning, stacklevel=3)


def _read_regular(path: str) -> bytes:
    """The bytes of a regular file, at most MAX_FILE_BYTES + 1: opened non-blocking and checked with fstat, so
    a FIFO, a device (/dev/zero) or a socket at the path is refused instead of blocking or reading forever."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        import stat
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        chunks, n = [], 0
        while n <= MAX_FILE_BYTES:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
            n += len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load(path: str) -> Dict[str, Config]:
    """Entries of a cache file; {} when missing. A corrupt file (not JSON, not a regular file, too large,
    nested too deep, another format version) is reported and ignored, never fatal and never blocking."""
    if not _private_ok(os.path.dirname(path)):
        _report_bad(path, "its shared temporary folder is not owned by this user alone")
        return {}
    try:
        raw = _read_regular(path)
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        data = json.loads(raw)
    except (FileNotFoundError, NotADirectoryError):  # (a directory on the way is a file: store() says so)
        return {}
    except (OSError, ValueError, RecursionError, UnicodeDecodeError) as e:
        _report_bad(path, f"unreadable: {type(e).__name__}")
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        _report_bad(path, "not a vcattn tuning file")
        return {}
    if data.get("version") != 1:
        _report_bad(path, f"format version {data.get('version')!r}, this vcattn reads 1")
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(v, dict) and isinstance(v.get("config"), dict)}


def store(path: str, entry: str, record: Dict[str, object]) -> bool:
    """Add one entry, atomically, under a lock (read-modify-write: concurrent writers keep all entries).

    Never fatal: a cache directory that cannot be created or written (a file in its place, no
    permission, a full or read-only disk, a lock timeout) leaves the tuned result uncached, with one
    warning per directory. Returns whether the entry was written."""
    try:
        _store(path, entry, record)
        return True
    except OSError as e:  # NotADirectoryError, FileExistsError, PermissionError, filelock.Timeout, ...
        directory = os.path.dirname(path)
        if current().once("tuning cache directory", directory):
            warnings.warn(f"vcattn: cannot write the tuning cache in {directory} ({type(e).__name__}: {e}); "
                          "kernels are tuned without caching (again in every new process). Point "
                          "options={'tune_cache_dir': ...} or $VCATTN_CACHE_DIR at a writable directory.",
                          RuntimeWarning, stacklevel=3)
        return False


def _store(path: str, entry: str, record: Dict[str, object]) -> None:
    from filelock import FileLock

    if not _private_ok(os.path.dirname(path)):
        raise PermissionError("a shared temporary folder not owned by this user alone")
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
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
    """The default progress report: a tqdm bar (``vc_compile.log.Progress``) that stacks under a running
    diffusers bar and disappears when done, then one INFO line on the ``vc_compile.tune`` logger."""
    from ..log import Progress, get_logger

    log = get_logger("vc_compile.tune")
    bar = Progress(n, f"vcattn: tuning {key.kernel} [{key.entry}]", log)
    best: list = [None]

    def step(i: int, cfg: Config, ms: Optional[float]) -> None:
        if ms is not None and (best[0] is None or ms < best[0]):
            best[0] = ms
        bar.update(ms is not None, f"best {best[0]:.3f} ms" if best[0] is not None else "")
        if i + 1 >= n:
            bar.close()
            log.info("tuned %s [%s] on %s: %d configs, %d failed, best %s ms", key.kernel, key.entry, arch.gpu,
                     n, bar.failed, f"{best[0]:.3f}" if best[0] is not None else "-")
    return step


def _as_candidate(cfg: object, candidates: List[Config]) -> Optional[Config]:
    """The candidate equal to a cached ``cfg`` (compared as JSON: the file turns tuples into lists and
    may reorder keys), or None when the cache holds something the kernel would not run."""
    try:
        want = json.dumps(cfg, sort_keys=True)
        return next((dict(c) for c in candidates if json.dumps(c, sort_keys=True) == want), None)
    except (TypeError, ValueError):
        return None


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
    ``progress(i, config, ms or None)`` is called after each candidate (default: a tqdm bar, then an INFO line).
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
        cfg = _as_candidate(hit["config"], candidates)
        if cfg is not None:
            return cfg, "cache"
        warnings.warn(f"vcattn: the tuning cache entry {key.entry} of {path} holds {hit['config']}, which is not "
                      f"one of the kernel's candidate configurations (a stale or edited file); re-tuning.",
                      RuntimeWarning, stacklevel=3)
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
