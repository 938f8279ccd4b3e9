"""Soak: many generations through one compiled model; memory per generation must stay flat.

    python -m benchmarks.bench_soak                              # 50 generations, vsmooth + mcsparse
    python -m benchmarks.bench_soak --generations 200 --methods mcsparse --seq 1024 --plot soak.png

Per generation it prints the metadata vcattn holds (``vc_compile.runtime.state.bytes_held()``), the
number of metadata entries, call sites and tracker entries, the process RSS and, on CUDA,
``torch.cuda.memory_allocated`` / ``max_memory_allocated``. The model is the tests' TinyDiT (2 blocks of
self- + cross-attention, RoPE, [B, S, H, D] projections) at the given length. Every few generations the
resolution alternates (``--alt-seq``) and, once, the model is deleted and rebuilt, to exercise the paths
that must free state. A summary line gives the growth from the first measured generation to the last;
``--plot`` saves a PNG when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import vc_compile
from vc_compile import ops
from vc_compile.runtime import state
from vc_compile.runtime.steps import TRACKER

METHOD_OPTS = {
    "vsmooth": {"method": "vsmooth", "expcast": False},
    "expcast": {"method": "vsmooth", "expcast": True},
    "mcsparse": {"method": "mcsparse", "density": 0.2},
}


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(method: str, seq: int, device: str, dtype, compiler: str, dim: int, heads: int):
    from tests import tiny_dit  # the tests' tiny model (run from the repository root)

    torch.manual_seed(0)
    m = tiny_dit.TinyDiT(dim=dim, heads=heads, seq=seq).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for b in m.blocks:
            b.q.weight.mul_(4.0)
            b.k.weight.mul_(4.0)
    opts = {**METHOD_OPTS[method], "experimental": {"compiler": compiler}, "min_seq_len": 64}
    return m, torch.compile(m, backend="vcattn", options=opts, dynamic=False)


def inputs(seq: int, device: str, dtype, dim: int):
    g = torch.Generator().manual_seed(seq)
    x = torch.randn(2, seq, dim, generator=g).to(device=device, dtype=dtype)
    ctx = torch.randn(2, 7, 32, generator=g).to(device=device, dtype=dtype)
    return x, ctx


def run(method: str, args) -> list:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    compiler = args.compiler or ("inductor" if device == "cuda" else "eager")
    vc_compile.reset()
    torch._dynamo.reset()
    models = {}

    def model_for(seq):
        if seq not in models:
            models[seq] = build(method, seq, device, dtype, compiler, args.dim, args.heads)
        return models[seq]

    rows = []
    for gen in range(args.generations):
        seq = args.alt_seq if args.alt_seq and gen % args.alt_every == args.alt_every - 1 else args.seq
        if gen == args.generations // 2 and args.seq in models:  # delete and rebuild once
            del models[args.seq]
            gc.collect()
        m, cm = model_for(seq)
        x, ctx = inputs(seq, device, dtype, args.dim)
        t0 = time.perf_counter()
        with torch.no_grad(), vc_compile.sampling(num_steps=args.steps):
            for i in range(args.steps):
                vc_compile.step(i)
                y = cm(x, ctx)
                if args.cfg:
                    cm(x, ctx)  # a second forward per step: the uncond branch
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        gc.collect()
        row = dict(gen=gen, seq=seq, s=dt, meta_mb=state.bytes_held() / 2**20, keys=len(state.keys()),
                   sites=len(vc_compile.report().sites), tracker=len(TRACKER.branch_seen),
                   watched=len(ops._WATCHED), rss_mb=rss_mb(), finite=bool(torch.isfinite(y).all()))
        if device == "cuda":
            row["cuda_mb"] = torch.cuda.memory_allocated() / 2**20
            row["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        rows.append(row)
        if gen % args.print_every == 0 or gen == args.generations - 1:
            print_row(method, row)
    return rows


COLS = ["gen", "seq", "s", "meta_mb", "keys", "sites", "tracker", "watched", "rss_mb", "cuda_mb",
        "cuda_peak_mb", "finite"]


def print_row(method, row):
    cells = [method.ljust(9)]
    for c in COLS:
        if c not in row:
            continue
        v = row[c]
        cells.append(f"{c}={v:.2f}" if isinstance(v, float) else f"{c}={v}")
    print("  ".join(cells), flush=True)


def summary(method, rows, warmup: int):
    base = [r for r in rows if r["seq"] == rows[0]["seq"]][min(warmup, len(rows) - 1):]
    first, last = base[0], base[-1]
    parts = [f"{method}: {len(rows)} generations"]
    for c in ("meta_mb", "keys", "sites", "tracker", "rss_mb", "cuda_mb"):
        if c in first:
            parts.append(f"{c} {first[c]:.2f} -> {last[c]:.2f}" if isinstance(first[c], float)
                         else f"{c} {first[c]} -> {last[c]}")
    parts.append("all finite" if all(r["finite"] for r in rows) else "NON-FINITE OUTPUTS")
    print("SUMMARY " + "; ".join(parts), flush=True)


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no plot written to {path})")
        return
    keys = ["meta_mb", "rss_mb"] + (["cuda_mb"] if "cuda_mb" in next(iter(results.values()))[0] else [])
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
    for ax, key in zip(axes, keys):
        for method, rows in results.items():
            ax.plot([r["gen"] for r in rows], [r[key] for r in rows], label=method)
        ax.set_xlabel("generation")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generations", type=int, default=50)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--alt-seq", type=int, default=384, help="the other resolution (0: never switch)")
    p.add_argument("--alt-every", type=int, default=5)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--cfg", action="store_true", help="two forwards per step (Wan-style CFG)")
    p.add_argument("--methods", default="vsmooth,mcsparse")
    p.add_argument("--compiler", choices=["inductor", "eager"], default=None,
                   help="default: inductor on CUDA, eager on CPU")
    p.add_argument("--print-every", type=int, default=5)
    p.add_argument("--warmup", type=int, default=6,
                   help="generations left out of the growth summary (both resolutions compiled by then)")
    p.add_argument("--plot", default=None, help="save a PNG of memory per generation here")
    args = p.parse_args(argv)
    dev = "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, device {dev}")
    results = {}
    for method in args.methods.split(","):
        results[method] = run(method, args)
    for method, rows in results.items():
        summary(method, rows, args.warmup)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
