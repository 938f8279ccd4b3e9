"""V-Smooth's grouping schedule by attention error: when should the k-means grouping of V be re-run?

    python -m benchmarks.bench_vsmooth_schedule        # 50 steps; schedules 0.02; 0.04; 0.25; 1; 0.02,10; 0.02,5
    python -m benchmarks.bench_vsmooth_schedule --schedules "0.25;0.02,10" --expcast   # on the ExpCast path
    python -m benchmarks.bench_vsmooth_schedule --smoke   # CPU: 4 steps, 4 frames, no rows

V-Smooth re-groups the keys/values (k-means of V, warm-started from the schedule's previous grouping) on the
first ``group_fraction`` of the steps and every ``group_interval``-th step after (options; a schedule
"F,I" here is group_fraction F, group_interval I), and reuses the last grouping otherwise. A grouping only
orders the keys; an old one is a worse ordering, never a wrong result, so the question is how much error a
stale grouping adds, and where re-grouping pays. The final clip's PSNR answers it too noisily (the sampler
amplifies any difference: one option moved 32-40 dB with the seed, ``bench_mcsparse_schedule
--group-fractions``), so this benchmark measures the attention itself on the dense trajectory: the trained demo
model (``vc_compile.demo``, 6 layers, 2 heads, D = 128, 4096 tokens, CFG 3) samples with stock SDPA, and at
every self-attention call (every layer, step and CFG branch) each schedule runs the method's own step on those
inputs (``methods.vsmooth.run`` with the phase ``methods.vsmooth.group_phase`` gives, on the schedule's own
grouping chain: the reference kernels on CPU, the kernels on a GPU) beside an fp64 reference.
Rows: per schedule, the mean rel. L2 against fp64 over every call, over the second half of the steps, its worst
call, its ratio to re-grouping every step (when "1" is among the schedules) and the group steps it costs (each
~9% more than a reuse step on the Wan 2.1 1.3B pipeline, ``bench_pipeline.csv``). Plot:
``docs/img/vsmooth_schedule.png`` (mean rel. L2 per step and schedule). Rows:
``benchmarks/results/bench_vsmooth_schedule.csv``.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

from benchmarks.common import append_rows, metrics, print_table

BENCH = "bench_vsmooth_schedule"
PLOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img",
                    "vsmooth_schedule.png")


def log(*a):
    print(*a, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--schedules", default="0.02;0.04;0.25;1;0.02,10;0.02,5",
                    help='schedules "group_fraction[,group_interval]", semicolon-separated')
    ap.add_argument("--expcast", action="store_true", help="the ExpCast path (option expcast)")
    ap.add_argument("--share-cfg", action="store_true",
                    help="also each schedule with one grouping for both CFG branches (the uncond branch reuses "
                         "the cond branch's grouping of the same step; needs both branches)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--branches", default="cond,uncond", help="CFG branches measured (cond, uncond)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu (reference kernels)")
    ap.add_argument("--smoke", action="store_true", help="CPU: 4 steps, 4 frames, no rows, no plot")
    a = ap.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.smoke:
        a.steps = 4
    a.schedule_list = []
    for spec in (x.strip() for x in a.schedules.split(";") if x.strip()):
        try:
            parts = spec.split(",")
            f, i = float(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        except (ValueError, IndexError):
            ap.error(f"--schedules: {spec!r} is not group_fraction[,group_interval]")
        if not 0.0 <= f <= 1.0 or i < 0 or len(parts) > 2:
            ap.error(f"--schedules: {spec!r}: group_fraction in [0, 1], group_interval >= 0")
        a.schedule_list.append((f, i))
    if not a.schedule_list:
        ap.error("--schedules: none given")
    a.branch_list = [b.strip() for b in a.branches.split(",") if b.strip()]
    if not a.branch_list or any(b not in ("cond", "uncond") for b in a.branch_list):
        ap.error(f"--branches {a.branches!r}: cond and/or uncond")
    return a


def label(sched) -> str:
    f, i = sched[:2]
    return f"group_fraction={f:g}" + (f",group_interval={i}" if i else "") + (", one grouping for both CFG "
                                                                            "branches" if len(sched) > 2 else "")


def group_steps(cfg, n: int) -> list:
    """The steps that re-group under ``cfg``'s schedule (``methods.vsmooth.group_phase``, a grouping held)."""
    from vc_compile.methods import vsmooth
    from vc_compile.methods.phase import Phase
    return [t for t in range(n) if t == 0 or vsmooth.group_phase(cfg, t, n, True) == Phase.GROUP]


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return metrics(out, ref)["rel_l2"]  # in float64, as every benchmark's


def dense_trajectory(a, visit, header, branches=("cond", "uncond"), on_step=None):
    """Sample the trained demo model with stock SDPA (``a.steps`` steps, CFG 3, ``a.seed``; 4 frames with
    ``a.smoke``) and call ``visit(t, layer, branch, q, k, v, sm_scale, ref)`` at every self-attention call of
    ``branches``, ``ref`` its fp64 output; ``on_step(i)`` at the start of step i. ``header(tokens, trained)``
    gives the line logged before sampling. Returns (the demo model's config, tokens, trained, start time)."""
    from vc_compile.demo.capture import capture_sdpa
    from vc_compile.demo.model import DEFAULT_PROMPT, encode, load_demo, parse_prompt
    from vc_compile.demo.sampler import sample

    transformer, text_encoder, mcfg, trained = load_demo(None, device=torch.device(a.device), dtype=torch.bfloat16,
                                                         allow_random=True)
    frames = 4 if a.smoke else mcfg.frames
    tokens = mcfg.tokens(frames, mcfg.height, mcfg.width)
    cond = encode(text_encoder, parse_prompt(DEFAULT_PROMPT, mcfg.max_sprites), torch.bfloat16)
    uncond = encode(text_encoder, parse_prompt("", mcfg.max_sprites), torch.bfloat16)
    n = a.steps
    cur = {"step": -1, "forward0": 0}
    names = ("cond", "uncond")
    t0 = time.perf_counter()

    def step_fn(i):
        cur["step"] = i
        cur["forward0"] = state["forward"] + 1
        if on_step is not None:
            on_step(i)
        if i % 5 == 0 or i == n - 1:
            log(f"  step {i}/{n} [{time.perf_counter() - t0:.0f} s]")

    def cb(info, q, k, v):
        branch = names[min(info["forward"] - cur["forward0"], 1)]
        if info["kind"] != "self" or branch not in branches:
            return
        sm_scale = info.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        with torch.no_grad():
            qd, kd, vd = (x.double() for x in (q, k, v))
            ref = torch.softmax(qd @ kd.transpose(-1, -2) * sm_scale, dim=-1) @ vd
            visit(cur["step"], info["layer"], branch, q, k, v, sm_scale, ref)

    log(header(tokens, trained))
    with capture_sdpa(transformer, cb) as state:
        sample(transformer, cond, uncond=uncond, guidance=3.0, frames=frames, height=mcfg.height, width=mcfg.width,
               steps=n, seed=a.seed, dtype=torch.bfloat16, step_fn=step_fn)
    return mcfg, tokens, trained, t0


def plot(per_step, scheds, gsteps, n, path, expcast):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("  (matplotlib absent: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for sc in scheds:
        ys = [sum(per_step[(sc, t)]) / len(per_step[(sc, t)]) for t in range(n)]
        ax.plot(range(n), ys, label=f"{label(sc)} ({len(gsteps[sc])} group steps)")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("attention rel. L2 vs fp64")
    ax.set_title(f"V-Smooth{' + ExpCast' if expcast else ''}: error by grouping schedule (demo model, dense "
                 "trajectory, mean of layers and CFG branches)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"  plot: {path}")


def main(argv=None):
    a = parse_args(argv)
    from vc_compile.config import VCConfig
    from vc_compile.methods import vsmooth
    from vc_compile.kernels import dispatch

    cpu = a.device == "cpu"
    impl = dispatch.Impl.REFERENCE if cpu else dispatch.Impl.TRITON
    n = a.steps
    cfgs = {sc: VCConfig.from_options({"method": "vsmooth", "group_fraction": sc[0], "group_interval": sc[1],
                                       "expcast": bool(a.expcast)}) for sc in a.schedule_list}
    gsteps = {sc: group_steps(c, n) for sc, c in cfgs.items()}
    chains = {}  # (schedule, layer, branch) -> the schedule's grouping (VSmoothMeta)
    if a.share_cfg:  # (f, i, "shared"): the uncond branch takes the cond branch's grouping of its step
        for sc in list(a.schedule_list):
            a.schedule_list.append((*sc, "shared"))
            cfgs[a.schedule_list[-1]] = cfgs[sc]
            gsteps[a.schedule_list[-1]] = gsteps[sc]
    per_step = {(sc, t): [] for sc in a.schedule_list for t in range(n)}

    def visit(t, layer, branch, q, k, v, sm_scale, ref):
        for sc, c in cfgs.items():
            key = (sc, layer, branch)
            meta = chains.get(key)
            phase = vsmooth.group_phase(c, t, n, meta is not None)
            if len(sc) > 2 and branch == "uncond" and phase.name == "GROUP":
                meta, phase = chains[(sc, layer, "cond")], type(phase).REUSE
            out, chains[key] = vsmooth.run(q, k, v, phase=phase, meta=meta, cfg=c, sm_scale=sm_scale, impl=impl)
            per_step[(sc, t)].append(rel_l2(out, ref))

    def header(tokens, trained):
        return (f"[{BENCH}] demo model ({'trained' if trained else 'RANDOM weights'}), {tokens} tokens, {n} steps, "
                f"{'ExpCast' if a.expcast else 'V-Smooth'}, branches {a.branch_list}, {a.device}"
                + (" (reference kernels)" if cpu else ""))

    mcfg, tokens, trained, t0 = dense_trajectory(a, visit, header, branches=a.branch_list)
    every = next((sc for sc in a.schedule_list if len(gsteps[sc]) == n), None)
    late = range(n // 2, n)
    rows = []
    for sc in a.schedule_list:
        allv = [e for t in range(n) for e in per_step[(sc, t)]]
        latev = [e for t in late for e in per_step[(sc, t)]]
        rows.append(dict(variant=f"vsmooth{'+expcast' if a.expcast else ''}+{label(sc)}", B=1,
                         H=mcfg.num_attention_heads, S=tokens, D=mcfg.attention_head_dim, density=1.0,
                         rel_l2=sum(allv) / len(allv), rel_l2_late=sum(latev) / len(latev) if latev else "",
                         rel_l2_max=max(allv), group_steps=len(gsteps[sc]), steps=n, calls=len(allv), seed=a.seed,
                         model="vc-demo" + ("" if trained else " (random weights)"), device=a.device,
                         note=("reference kernels on CPU" if cpu else "kernels") +
                              "; attention on the dense trajectory's inputs, against fp64; group steps " +
                              " ".join(map(str, gsteps[sc]))))
    if every is not None:
        base = rows[a.schedule_list.index(every)]
        for r in rows:
            r["vs_every_step"] = r["rel_l2"] / base["rel_l2"]
            if r["rel_l2_late"] != "":
                r["late_vs_every_step"] = r["rel_l2_late"] / base["rel_l2_late"]
    print_table(rows, ["variant", "group_steps", "rel_l2", "rel_l2_late", "rel_l2_max", "vs_every_step",
                       "late_vs_every_step"])
    log(f"  late = steps {n // 2}..{n - 1}; {time.perf_counter() - t0:.0f} s")
    if not a.smoke:
        path = append_rows(BENCH, rows, extras=["rel_l2_late", "rel_l2_max", "vs_every_step", "late_vs_every_step",
                                                "group_steps", "steps", "calls", "seed", "model", "device", "note"])
        log(f"[{BENCH}] rows appended to {path}")
        plot(per_step, a.schedule_list, gsteps, n, PLOT.replace(".png", "_expcast.png") if a.expcast else PLOT,
             a.expcast)
    return rows


if __name__ == "__main__":
    main()
