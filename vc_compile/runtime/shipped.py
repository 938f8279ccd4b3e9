"""Kernels shipped built: a fresh process loads them instead of building them at its first generation.

A fresh process (empty Triton cache) builds every kernel of its methods' phases before it can run them: on the
H200 (Wan 2.1 1.3B, regional compile) +14 s of start-up over stock torch.compile for V-Smooth + ExpCast, +30 s
for MC-Sparse; built in parallel by helper processes (``runtime/prebuild.py``) +9 s, most of it the helpers'
imports and the longest single build. The binaries do not depend on the process: ``vc_compile/kernels/sm90``
holds the sm_90 (H100 / H200) cubins of the kernels the supported call layouts launch, built by Triton from this
package's sources, with what each launch needs to find them (``manifest.json``, written by
``scripts/ship_kernels.py``):

* ``kernels``: per binary, the Triton function (``module:qualname``), its source hash (``JITFunction.cache_key``:
  the function and everything it calls), and Triton's serialised specialisation (signature, constexprs,
  alignment attributes, options: ``JITFunction.preload``'s format, which also holds the launch's in-memory key).
* ``requests``: per recorded call layout (method, dtype, shapes and stride classes; ``match_key``), the kernels
  its phases launched.

``load(requests)`` (at the rewrite, where ``prebuild`` is on): for each request's family (method, ExpCast,
dtype, head dim) every shipped kernel is put in its function's in-memory cache under the key its launch
computes, and its launcher module is built in a background thread (a C compile, ~1 s, cached on disk by Triton).
A launch then finds its kernel as if this process had built it; a launch whose specialisation is not shipped
builds as before. Nothing else changes: a kernel is loaded only where its function's source hash equals the
recorded one, Triton's version equals the one that built it, and the device is sm_90; otherwise ``report()``
says why nothing was loaded. Requests whose layout was recorded need no helper; others get one.
"""
from __future__ import annotations

import json
import lzma
import os
import tempfile
import threading
from typing import Dict, List, Optional, Tuple

from .prebuild import build_launcher

DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "sm90")
MANIFEST = os.path.join(DIR, "manifest.json")
ARCH = (9, 0)


def family(req: dict) -> str:
    """The kernels a request's calls may launch are those of its method, softmax, dtype and head dim."""
    from ..config import VCConfig

    cfg = VCConfig.from_json(req["config"])
    q = req["q"]
    return f"{cfg.resolved_method.value}{'+expcast' if cfg.expcast else ''}:{q['dtype']}:D{q['shape'][-1]}"


def _cls(n: int) -> str:
    return "1" if n == 1 else ("16" if n % 16 == 0 else "x")


def match_key(req: dict) -> str:
    """A request's layout as its kernels' launches see it: family, shapes, stride classes (Triton specialises an
    integer on == 1 and divisibility by 16), offsets, and the RoPE spec with its tables; not the block identity
    (a weight the op only compares) nor the scale (a float argument, never specialised on)."""
    parts = [family(req), req.get("rope") or ""]
    for name in ("q", "k", "v", "cos", "sin"):
        s = req.get(name)
        parts.append("-" if not s else
                     f"{name}{list(s['shape'])}/{''.join(_cls(int(x)) for x in s['stride'])}/{s['dtype']}"
                     f"/{_cls(int(s.get('offset', 0)) or 16)}")
    return "|".join(parts)


_LOCK = threading.Lock()
_STATE: Dict[str, object] = {"manifest": None, "families": set(), "loaded": 0, "stale": 0, "unreadable": 0,
                             "why": None, "pool": None}


def _manifest() -> Optional[dict]:
    if _STATE["manifest"] is None:
        try:
            with open(MANIFEST) as f:
                _STATE["manifest"] = json.load(f)
        except (OSError, ValueError):
            _STATE["manifest"] = {}
    return _STATE["manifest"] or None


def _refusal(device) -> Optional[str]:
    """Why shipped kernels cannot serve this process, or None."""
    import torch

    m = _manifest()
    if not m:
        return "no shipped kernels in this installation"
    try:
        import triton
    except ImportError:
        return "no triton"
    if triton.__version__ != m.get("triton"):
        return f"shipped kernels were built by triton {m.get('triton')}, this is {triton.__version__}"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) != ARCH:
        return "shipped kernels are sm_90's (H100 / H200)"
    return None


def _function(path: str):
    import importlib

    mod, qual = path.split(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _compiled(fn, entry: dict, tmp: str, directory: str):
    """Triton's ``CompiledKernel`` of a shipped binary and the in-memory key its launch computes (what
    ``JITFunction.preload`` does, with the binary read instead of built)."""
    import triton.language as tl
    from triton.compiler import CompiledKernel
    from triton.runtime.jit import convert_to_tuple_if_list

    d = json.loads(entry["spec"])
    consts = {tuple(k): (tl.dtype(v) if tl.dtype.is_dtype(v) else
                         tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v)
              for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = dict(zip(map(tuple, d["attrs_keys"]), d["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in d["signature"].items()}
    src = fn.ASTSource(fn, signature, consts, attrs)
    name = entry["name"]
    meta, cubin = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.cubin")
    with open(meta, "w") as f:
        json.dump(entry["metadata"], f)
    with lzma.open(os.path.join(directory, entry["file"])) as f, open(cubin, "wb") as g:
        g.write(f.read())
    k = CompiledKernel(src, {f"{name}.json": meta, f"{name}.cubin": cubin}, entry["metadata"]["hash"])
    return d["key"], k


def load_entries(entries: List[dict], dev: int, directory: Optional[str] = None) -> int:
    """Put each manifest entry's kernel in its function's in-memory cache (device ``dev``) unless one is there,
    skipping those whose source changed; their launchers build in background threads. Returns how many."""
    new = []
    with tempfile.TemporaryDirectory() as tmp:
        for e in entries:
            try:
                fn = _function(e["fn"])
            except (ImportError, AttributeError, ValueError):
                _STATE["stale"] += 1
                continue
            if getattr(fn, "cache_key", None) != e["cache_key"]:
                _STATE["stale"] += 1  # the kernel's source changed since it was built: built at its launch
                continue
            cache = fn.device_caches[dev][0]
            try:
                key, k = _compiled(fn, e, tmp, directory or DIR)
            except Exception:  # noqa: BLE001 - an unreadable file or entry: that kernel is built at its launch
                _STATE["unreadable"] += 1
                continue
            if key not in cache:
                cache[key] = k
                new.append(k)
    _STATE["loaded"] += len(new)
    if new:
        import concurrent.futures as cf

        if _STATE["pool"] is None:
            _STATE["pool"] = cf.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                   thread_name_prefix="vcattn-launchers")
        for k in new:
            _STATE["pool"].submit(build_launcher, k)
    return len(new)


def load(requests: List[dict], device=None) -> Tuple[List[dict], Optional[str]]:
    """Load the shipped kernels of ``requests``' families (once per family and process). Returns the requests
    whose layout was recorded (their kernels are all here: no helper needed) and a line for ``report()``."""
    import torch

    if not requests:
        return [], None
    covered = []
    with _LOCK:
        for dev in sorted({_index(r, device) for r in requests}):
            mine = [r for r in requests if _index(r, device) == dev]
            why = _refusal(dev)
            if why:
                _STATE["why"] = why
                continue
            m = _manifest()
            fams = {(dev, family(r)) for r in mine} - _STATE["families"]
            _STATE["families"] |= fams
            names = {f for _, f in fams}
            load_entries([e for e in m["kernels"] if names & set(e["families"])], dev)
            recorded = set(m.get("requests", {}))
            covered += [r for r in mine if match_key(r) in recorded]
        return covered, summary()


def _index(req: dict, device=None) -> int:
    """The CUDA device index a request's calls run on (its q's device; ``device`` overrides)."""
    import torch

    if device is not None:
        return int(device)
    d = torch.device(req["q"]["device"])
    return d.index if d.index is not None else torch.cuda.current_device()


def summary() -> Optional[str]:
    """One line for ``report()``."""
    if _STATE["why"] and not _STATE["loaded"]:
        return f"shipped kernels not used: {_STATE['why']}"
    if not _STATE["loaded"] and not _STATE["stale"] and not _STATE["unreadable"]:
        return None
    line = f"{_STATE['loaded']} shipped sm_90 kernel(s) loaded (not built)"
    if _STATE["stale"]:
        line += f"; {_STATE['stale']} shipped kernel(s) skipped: their sources changed since they were built"
    if _STATE["unreadable"]:
        line += f"; {_STATE['unreadable']} shipped kernel(s) unreadable (built at their launch)"
    return line
