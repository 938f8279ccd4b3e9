"""MC-Sparse's reuse check (option ``reuse_check``, ``vc_compile/methods/mcsparse_guard.py``) on moving inputs:
when it sends a site to stock SDPA, and the method's error with and without it beside a naive cache.

    python -m benchmarks.bench_reuse_check [--S 1024] [--steps 8] [--densities 0.15,0.25] [--no-csv]

Runs on the CPU reference path (the kernels' arithmetic; no GPU needed). Per trajectory and density, the op runs
MC-Sparse for ``--steps`` steps at a fresh site (no warm-up, one anchor at step 0) with the check and once with
``reuse_check=False``. Errors are rel. L2 against fp64 SDPA on the same bf16 inputs, averaged over steps 1.. (the
steps after the anchor); ``prev`` is what a naive cache would give -- each step's exact output of the step before --
the bar the check holds a reuse step to. ``sparse`` is how many of those steps ran the sparse kernel.

Trajectories (B = 1, H = 2, D = 64): ``walk d``: q, k, v each a random walk x_t = x_{t-1} + d N(0, 1) from
Gaussians (diffuse attention); ``noisy n``: Gaussian q, k, v plus fresh noise of n t at step t; ``peaked``: the
same with q, k x 8 (sharp attention); ``structured d``: the kernel benchmark's channel-biased K and clustered V
(``benchmarks.common.structured_inputs``), random-walking at d.
Rows: ``benchmarks/results/bench_reuse_check.csv`` (variant = the trajectory).
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.nn.functional as F

from benchmarks.common import append_rows, print_table, structured_inputs

BENCH = "bench_reuse_check"
TRAJECTORIES = ["walk 0.002", "walk 0.01", "walk 0.02", "walk 0.05", "noisy 0.02", "noisy 0.05", "peaked 0.05",
                "structured 0.002", "structured 0.01", "structured 0.05"]


def trajectory(name: str, steps: int, S: int, D: int = 64, H: int = 2, seed: int = 0):
    kind, amount = name.split()
    a = float(amount)
    g = torch.Generator().manual_seed(seed)
    if kind == "structured":
        x = [t.transpose(1, 2).float() for t in structured_inputs(1, H, S, D, seed=seed)]
    else:
        x = [torch.randn(1, H, S, D, generator=g) for _ in range(3)]
        if kind == "peaked":
            x[0], x[1] = x[0] * 8, x[1] * 8
    out, cur = [], x
    for t in range(steps):
        if kind in ("noisy", "peaked"):
            cur = [b + a * t * torch.randn(b.shape, generator=g) for b in x]
        elif t:
            cur = [b + a * b.std() * torch.randn(b.shape, generator=g) for b in cur]
        out.append([c.bfloat16() for c in cur])
    return out


def run_one(traj, density: float, check: bool):
    import vc_compile
    import vc_compile.ops  # noqa: F401 - registers torch.ops.vcattn.*
    from vc_compile.config import VCConfig
    from vc_compile.runtime import report as _report
    cj = VCConfig.from_options({"method": "mcsparse", "min_seq_len": 1, "warmup_steps": 0, "anchor_steps": (0,),
                                "density": density, "reuse_check": check,
                                "experimental": {"kernels": "reference"}}).to_json()
    site = _report.register_site(graph="bench", node="n", module="m", shape="?", dtype="?", method="mcsparse",
                                 rewritten=True).site
    errs, prev_errs, prev = [], [], None
    with vc_compile.sampling(num_steps=len(traj)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t, (q, k, v) in enumerate(traj):
            vc_compile.step(t)
            o = torch.ops.vcattn.attention(q, k, v, None, site, cj, None)
            truth = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
            rel = lambda a: ((a.double() - truth).norm() / truth.norm()).item()  # noqa: E731
            if t:
                errs.append(rel(o))
                prev_errs.append(rel(prev))
            prev = truth
    rec = _report.site(site)
    return errs, prev_errs, rec.phases.get("reuse", 0)


def run(S, steps, densities, names):
    rows = []
    for name in names:
        traj = trajectory(name, steps, S)
        for s in densities:
            on, prev, sparse_on = run_one(traj, s, True)
            off, _, sparse_off = run_one(traj, s, False)
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            rows.append(dict(variant=name, B=1, H=2, S=S, D=64, density=s, steps=steps, rel_l2=mean(on),
                             rel_l2_unchecked=mean(off), rel_l2_max=max(on), rel_l2_unchecked_max=max(off),
                             rel_l2_prev=mean(prev), first_reuse=off[0], first_prev=prev[0],
                             sparse_steps=f"{sparse_on}/{steps - 1}",
                             action="sparse" if sparse_on == steps - 1 else "stock SDPA after step 1"))
            r = rows[-1]
            print(f"{name:17s} s={s:.2f}  first reuse {r['first_reuse']:.3f} vs previous output {r['first_prev']:.3f}"
                  f"  -> {r['action']:24s} mean error unchecked {r['rel_l2_unchecked']:.3f} checked {r['rel_l2']:.3f}"
                  f" (naive cache {r['rel_l2_prev']:.3f})", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--densities", default="0.15,0.25")
    ap.add_argument("--trajectories", default=",".join(TRAJECTORIES))
    ap.add_argument("--no-csv", action="store_true")
    a = ap.parse_args(argv)
    rows = run(a.S, a.steps, [float(x) for x in a.densities.split(",")],
               [x for x in a.trajectories.split(",") if x])
    print_table(rows, ["variant", "density", "first_reuse", "first_prev", "action", "rel_l2_unchecked", "rel_l2",
                       "rel_l2_prev"])
    if not a.no_csv:
        extras = ["steps", "rel_l2_unchecked", "rel_l2_max", "rel_l2_unchecked_max", "rel_l2_prev", "first_reuse",
                  "first_prev", "sparse_steps", "action"]
        print("rows appended to " + append_rows(BENCH, rows, extras=extras))
    return 0


if __name__ == "__main__":
    sys.exit(main())
