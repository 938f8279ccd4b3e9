"""V-Smooth's grouping schedule by attention error: how stale may a k-means grouping of V get?

    python -m benchmarks.bench_vsmooth_schedule                       # 50 steps, fractions 0.02,0.04,0.1,0.25,1
    python -m benchmarks.bench_vsmooth_schedule --expcast             # the same on the ExpCast path
    python -m benchmarks.bench_vsmooth_schedule --smoke               # CPU: 4 steps, 4 frames, no rows

V-Smooth re-groups the keys/values (k-means of V, warm-started from the previous grouping) on the first
``group_fraction`` of the steps and reuses the last grouping after them. A grouping only orders the keys; an
old one is a worse ordering, never a wrong result, so the question is how much error a stale grouping adds.
The final clip's PSNR answers it too noisily (the sampler amplifies any difference: the same option moved
32-40 dB with the seed, ``bench_mcsparse_schedule --group-fractions``), so this benchmark measures the
attention itself on the dense trajectory: the trained demo model (``vc_compile.demo``, 6 layers, 2 heads,
D = 128, 4096 tokens, CFG 3) samples with stock SDPA, and at every self-attention call (every layer, step and
CFG branch) the method's own steps run on those inputs (``methods.vsmooth.run``, the reference kernels on CPU,
the kernels on a GPU) beside an fp64 reference:
* the grouping chain: GROUP at every step (k-means warm-started from the previous step's centroids), which is
  also the schedule ``group_fraction = 1``;
* for each ``group_fraction`` f: the output with the grouping the schedule would hold at this step (the chain's
  grouping of step ``min(t, ceil(f n) - 1)``).
Rows: per schedule, the mean rel. L2 against fp64 over every call, over the calls after every window has
closed (the steps where the schedules differ), its worst call, and its ratio to re-grouping every step; plus the
group steps it costs (each ~9% more than a reuse step on the Wan 2.1 1.3B pipeline, ``bench_pipeline.csv``).
Plot: ``docs/img/vsmooth_schedule.png`` (mean rel. L2 per step and schedule). Rows:
``benchmarks/results/bench_vsmooth_schedule.csv``.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

from benchmarks.common import append_rows, print_table

BENCH = "bench_vsmooth_schedule"
PLOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img",
                    "vsmooth_schedule.png")


def log(*a):
    print(*a, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--fractions", default="0.02,0.04,0.1,0.25,1", help="group_fraction values, comma-separated")
    ap.add_argument("--expcast", action="store_true", help="the ExpCast path (option expcast)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--branches", default="cond,uncond", help="CFG branches measured (cond, uncond)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu (reference kernels)")
    ap.add_argument("--smoke", action="store_true", help="CPU: 4 steps, 4 frames, no rows, no plot")
    a = ap.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.smoke:
        a.steps = 4
    a.fraction_list = sorted({float(x) for x in a.fractions.split(",") if x.strip()})
    if not a.fraction_list or any(not 0.0 < f <= 1.0 for f in a.fraction_list):
        ap.error(f"--fractions {a.fractions!r}: values in (0, 1]")
    a.branch_list = [b.strip() for b in a.branches.split(",") if b.strip()]
    if not a.branch_list or any(b not in ("cond", "uncond") for b in a.branch_list):
        ap.error(f"--branches {a.branches!r}: cond and/or uncond")
    return a


def group_steps(fraction: float, n: int) -> int:
    """Steps that re-group under ``group_fraction`` (``methods.vsmooth.group_phase``)."""
    return max(1, math.ceil(fraction * n))


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def plot(per_step, fractions, n, path, expcast):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("  (matplotlib absent: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for f in fractions:
        ys = [sum(per_step[(f, t)]) / len(per_step[(f, t)]) for t in range(n)]
        ax.plot(range(n), ys, label=f"group_fraction {f:g} ({group_steps(f, n)} group steps)")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("attention rel. L2 vs fp64")
    ax.set_title(f"V-Smooth{' + ExpCast' if expcast else ''}: a stale grouping's error (demo model, mean of "
                 "layers and CFG branches)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"  plot: {path}")


def main(argv=None):
    a = parse_args(argv)
    from vc_compile.config import VCConfig
    from vc_compile.demo.capture import capture_sdpa
    from vc_compile.demo.model import DEFAULT_PROMPT, encode, load_demo, parse_prompt
    from vc_compile.demo.sampler import sample
    from vc_compile.methods import vsmooth
    from vc_compile.methods.phase import Phase
    from vc_compile.templates import dispatch

    device, cpu = torch.device(a.device), a.device == "cpu"
    impl = dispatch.Impl.REFERENCE if cpu else dispatch.Impl.TRITON
    transformer, text_encoder, mcfg, trained = load_demo(None, device=device, dtype=torch.bfloat16,
                                                         allow_random=True)
    frames = 4 if a.smoke else mcfg.frames
    tokens = mcfg.tokens(frames, mcfg.height, mcfg.width)
    cond = encode(text_encoder, parse_prompt(DEFAULT_PROMPT, mcfg.max_sprites), torch.bfloat16)
    uncond = encode(text_encoder, parse_prompt("", mcfg.max_sprites), torch.bfloat16)
    cfg = VCConfig.from_options({"method": "vsmooth", **({"expcast": True} if a.expcast else {})})
    n = a.steps
    gs = {f: group_steps(f, n) for f in a.fraction_list}
    keep_until = max(gs.values())  # the chain's groupings a schedule may hold
    chain, perms = {}, {}  # (layer, branch) -> last VSmoothMeta / {step: VSmoothMeta}
    per_step = {(f, t): [] for f in a.fraction_list for t in range(n)}
    cur = {"step": -1, "forward0": 0}
    names = ("cond", "uncond")
    t0 = time.perf_counter()

    def step_fn(i):
        cur["step"] = i
        cur["forward0"] = state["forward"] + 1
        if i % 5 == 0 or i == n - 1:
            log(f"  step {i}/{n} [{time.perf_counter() - t0:.0f} s]")

    def cb(info, q, k, v):
        branch = names[min(info["forward"] - cur["forward0"], 1)]
        if info["kind"] != "self" or branch not in a.branch_list:
            return
        t, site = cur["step"], (info["layer"], branch)
        sm_scale = info.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        with torch.no_grad():
            qd, kd, vd = (x.double() for x in (q, k, v))
            ref = torch.softmax(qd @ kd.transpose(-1, -2) * sm_scale, dim=-1) @ vd
            fresh, meta = vsmooth.run(q, k, v, phase=Phase.GROUP, meta=chain.get(site), cfg=cfg, sm_scale=sm_scale,
                                      impl=impl)
            chain[site] = meta
            if t < keep_until:
                perms.setdefault(site, {})[t] = meta
            e_fresh = rel_l2(fresh, ref)
            for f, g in gs.items():
                if t < g:
                    per_step[(f, t)].append(e_fresh)
                else:
                    out, _ = vsmooth.run(q, k, v, phase=Phase.REUSE, meta=perms[site][g - 1], cfg=cfg,
                                         sm_scale=sm_scale, impl=impl)
                    per_step[(f, t)].append(rel_l2(out, ref))

    log(f"[{BENCH}] demo model ({'trained' if trained else 'RANDOM weights'}), {tokens} tokens, {n} steps, "
        f"{'ExpCast' if a.expcast else 'V-Smooth'}, branches {a.branch_list}, {a.device}"
        + (" (reference kernels)" if cpu else ""))
    with capture_sdpa(transformer, cb) as state:
        sample(transformer, cond, uncond=uncond, guidance=3.0, frames=frames, height=mcfg.height, width=mcfg.width,
               steps=n, seed=a.seed, dtype=torch.bfloat16, step_fn=step_fn)
    every = a.fraction_list[-1] if gs[a.fraction_list[-1]] == n else None
    late = range(keep_until, n)
    rows = []
    for f in a.fraction_list:
        allv = [e for t in range(n) for e in per_step[(f, t)]]
        latev = [e for t in late for e in per_step[(f, t)]]
        rows.append(dict(variant=f"vsmooth{'+expcast' if a.expcast else ''}+group_fraction={f:g}", B=1,
                         H=mcfg.num_attention_heads, S=tokens, D=mcfg.attention_head_dim, density=1.0,
                         rel_l2=sum(allv) / len(allv), rel_l2_late=sum(latev) / len(latev) if latev else "",
                         rel_l2_max=max(allv), group_steps=gs[f], steps=n, calls=len(allv), seed=a.seed,
                         model="vc-demo" + ("" if trained else " (random weights)"), device=a.device,
                         note=("reference kernels on CPU" if cpu else "kernels") +
                              "; attention on the dense trajectory's inputs, against fp64"))
    if every is not None:
        base = rows[-1]
        for r in rows:
            r["vs_every_step"] = r["rel_l2"] / base["rel_l2"]
            if r["rel_l2_late"] != "":
                r["late_vs_every_step"] = r["rel_l2_late"] / base["rel_l2_late"]
    print_table(rows, ["variant", "group_steps", "rel_l2", "rel_l2_late", "rel_l2_max", "vs_every_step",
                       "late_vs_every_step"])
    log(f"  late = steps {keep_until}..{n - 1} (after every schedule's window); {time.perf_counter() - t0:.0f} s")
    if not a.smoke:
        path = append_rows(BENCH, rows, extras=["rel_l2_late", "rel_l2_max", "vs_every_step", "late_vs_every_step",
                                                "group_steps", "steps", "calls", "seed", "model", "device", "note"])
        log(f"[{BENCH}] rows appended to {path}")
        plot(per_step, a.fraction_list, n, PLOT.replace(".png", "_expcast.png") if a.expcast else PLOT, a.expcast)
    return rows


if __name__ == "__main__":
    main()
