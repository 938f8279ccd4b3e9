"""Shared benchmark harness: timing, baselines, accuracy metrics and the results CSV.

Every benchmark prints a table side by side with the baselines measured in the same run and appends its
rows to ``benchmarks/results/<bench>.csv`` with the agreed columns (extra columns may follow). Each row
also carries what NVML says about the GPU (``GPU_COLUMNS``: the board's UUID, driver, memory, power limit
and maximum clocks, and its clocks, temperature, power draw and clock-event reasons when the row was
written: they explain noisy runs); a file whose header lacks a column a row brings is rewritten with the
column added at the end (older rows leave it empty).

Benchmarks are modules of the ``benchmarks`` package, run from the repository root:
``python -m benchmarks.bench_vsmooth_attn`` (no ``sys.path`` edits).
"""
from __future__ import annotations

import csv
import datetime
import os
import subprocess
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from vc_compile import nvml
from vc_compile.table import fmt_cell, format_table

COLUMNS = ["date", "commit", "gpu", "torch", "triton", "bench", "variant", "B", "H", "S", "D",
           "density", "ms", "tflops", "speedup_vs_cudnn", "rel_l2", "cos_sim"]
GPU_COLUMNS = list(nvml.LIMIT_FIELDS + nvml.STATE_FIELDS)  # after a benchmark's own extras
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def env_info() -> Dict[str, str]:
    """Date (UTC), commit, GPU, torch and triton versions for a results row. ``VC_COMMIT`` wins over git:
    the device machine's copy of ``.git`` can lag behind the working tree it was sent (a row there once
    named the session's first commit instead of the one that ran)."""
    commit = os.environ.get("VC_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                             cwd=os.path.dirname(os.path.abspath(__file__)),
                                             stderr=subprocess.DEVNULL).strip()
            dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                            text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                                            stderr=subprocess.DEVNULL).strip()
            commit += "-dirty" if dirty else ""
        except Exception:  # noqa: BLE001 - no git on the benchmark box
            commit = "unknown"
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "commit": commit, "gpu": gpu, "torch": torch.__version__, "triton": tv, **gpu_info()}


def gpu_info() -> Dict[str, object]:
    """NVML's view of the current CUDA device for a results row ({} on a CPU or without NVML)."""
    if not torch.cuda.is_available():
        return {}
    index = torch.cuda.current_device()
    return {**(nvml.limits(index) or {}), **nvml.state(index)}


def bench_ms(fn: Callable[[], object], warmup: int = 50, rep: int = 200) -> float:
    """Median time in ms (triton.testing.do_bench on CUDA, a wall clock otherwise)."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    import time

    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[1]


def attn_flops(B, H, Sq, Sk, D) -> float:
    return 4.0 * B * H * Sq * Sk * D


def metrics(out: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    o, r = out.double().flatten(), ref.double().flatten()
    err = o - r
    return {"rel_l2": (err.norm() / r.norm()).item(),
            "cos_sim": F.cosine_similarity(o, r, dim=0).item(),
            "rel_l1": (err.abs().sum() / r.abs().sum()).item(),
            "rmse": err.pow(2).mean().sqrt().item(),
            "sqnr_db": (20 * torch.log10(r.norm() / err.norm().clamp_min(1e-30))).item()}


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                        "math": SDPBackend.MATH}[name])


def sdpa_fn(q, k, v, backend: str):
    def run():
        with sdpa_backend(backend):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def sage_fn(q, k, v) -> Optional[Callable]:
    """sageattention 1.0.6 (Triton, INT8 QK, fp16 PV) when installed, else None."""
    try:
        from sageattention import sageattn
    except Exception:
        return None
    return lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False)


def append_rows(bench: str, rows: List[Dict[str, object]]) -> str:
    """Append rows (dicts with the COLUMNS and optional extras) to results/<bench>.csv."""
    info = env_info()
    return append_csv(os.path.join(RESULTS_DIR, f"{bench}.csv"), [{**info, "bench": bench, **r} for r in rows])


def append_csv(path: str, rows: List[Dict[str, object]], columns: Optional[List[str]] = None) -> str:
    """Append complete rows to a results CSV: a new file gets ``COLUMNS``, the rows' extras, then
    ``GPU_COLUMNS``; an existing one keeps its header (extras it lacks are dropped), widened (the file
    rewritten) only by the ``GPU_COLUMNS`` it lacks. The header must start with the agreed ``COLUMNS``.
    ``columns``: a new file's header before the GPU columns (default: COLUMNS + the rows' extras)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    old: List[List[str]] = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            old = list(csv.reader(f))
    if old:
        cols = old[0]
        if cols[:len(COLUMNS)] != COLUMNS:
            raise RuntimeError(f"{path} does not start with the agreed columns {COLUMNS}")
        wider = cols + [k for k in GPU_COLUMNS if k in keys and k not in cols]  # other extras: dropped
    else:
        first = list(columns) if columns else COLUMNS + _extras(keys)
        cols = wider = first + [c for c in GPU_COLUMNS if c in keys and c not in first]
    if wider != cols:  # rewrite with the new columns at the end (a temp file, then an atomic rename)
        tmp = path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(wider)
            w.writerows(r + [""] * (len(wider) - len(r)) for r in old[1:])
        os.replace(tmp, path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=wider, extrasaction="ignore")
        if not old:
            w.writeheader()
        for r in rows:
            w.writerow({c: _fmt(r.get(c, "")) for c in wider})
    return path


def _extras(keys: List[str]) -> List[str]:
    return [k for k in keys if k not in COLUMNS and k not in GPU_COLUMNS]


def _fmt(x):
    return fmt_cell(x) if isinstance(x, float) else x


def print_table(rows: List[Dict[str, object]], cols: List[str]) -> None:
    print(format_table(rows, cols))
