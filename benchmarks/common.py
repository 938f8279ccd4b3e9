"""Shared benchmark harness: timing, baselines, accuracy metrics and the results CSV.

Every benchmark prints a table side by side with the baselines measured in the same run and appends its
rows to ``benchmarks/results/<bench>.csv`` with the agreed columns (extra columns may follow).
"""
from __future__ import annotations

import csv
import datetime
import math
import os
import subprocess
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

COLUMNS = ["date", "commit", "gpu", "torch", "triton", "bench", "variant", "B", "H", "S", "D",
           "density", "ms", "tflops", "speedup_vs_cudnn", "rel_l2", "cos_sim"]
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
            "commit": commit, "gpu": gpu, "torch": torch.__version__, "triton": tv}


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
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{bench}.csv")
    info = env_info()
    if os.path.exists(path):
        with open(path) as f:
            cols = next(csv.reader(f))  # keep the existing header; extras it lacks are dropped
        if cols[:len(COLUMNS)] != COLUMNS:
            raise RuntimeError(f"{path} does not start with the agreed columns {COLUMNS}")
        new = False
    else:
        extras = list(dict.fromkeys(k for r in rows for k in r if k not in COLUMNS))
        cols, new = COLUMNS + extras, True
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            full = {**info, "bench": bench, **r}
            w.writerow({c: _fmt(full.get(c, "")) for c in cols})
    return path


def _fmt(x):
    if isinstance(x, float):
        return f"{x:.6g}" if math.isfinite(x) else str(x)
    return x


def print_table(rows: List[Dict[str, object]], cols: List[str]) -> None:
    widths = [max(len(c), *(len(str(_fmt(r.get(c, "")))) for r in rows)) for c in cols]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(_fmt(r.get(c, ""))).ljust(w) for c, w in zip(cols, widths)))
