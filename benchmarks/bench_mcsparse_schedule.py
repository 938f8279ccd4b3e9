"""MC-Sparse's schedule by fidelity: how long a warm-up the trained demo model needs.

    python -m benchmarks.bench_mcsparse_schedule                          # 50 steps, s = 0.15, warm-up 2..10
    python -m benchmarks.bench_mcsparse_schedule --warmups 0,4,10 --density 0.25 --steps 50
    python -m benchmarks.bench_mcsparse_schedule --smoke                  # CPU: 3 steps, 4 frames, no rows
    python -m benchmarks.bench_mcsparse_schedule --warmups 10 --anchor-sets "10,26;10;10,18,26,34,42"
    python -m benchmarks.bench_mcsparse_schedule --warmups 10 --options '{"kmeans_iters": 1}'   # grouping cost
    python -m benchmarks.bench_mcsparse_schedule --group-fractions 0.25,0.1,0.04,0.02   # V-Smooth's re-grouping
    python -m benchmarks.bench_mcsparse_schedule --open-loop --warmups 2,6,10        # attention error per step

The warm-up is the largest share of MC-Sparse's attention time over a generation (Wan 2.1 1.3B, 50 steps, H200:
6.3 s of 15.3 s, ``bench_pipeline.csv``): its steps run the dense 8-bit V-Smooth path, ~1.7x a reuse step's
cost at s = 0.15. Its length (``warmup_steps``; default 20% of the steps, the paper's) is a fidelity choice, so
it is measured: the trained demo model (``vc_compile.demo``: a WanTransformer3DModel trained on sprite clips,
16 x 32 x 32 px = 4096 tokens, CFG 3), one ``--steps``-step generation per warm-up length, each against the
dense clip of the same seed (PSNR, SSIM, rel. L2 of the frames) and the anchors where the schedule puts them
(the first step after the warm-up and 52% of the steps). The same generation with V-Smooth alone is the
8-bit floor the sparse steps add to. ``--anchor-sets`` sweeps the anchor schedule instead (option
``anchor_steps``; the warm-up of ``--warmups``, one value): where re-selecting pays for its cost.
``--group-fractions`` sweeps V-Smooth's own schedule instead (option ``group_fraction``: the first steps that
re-run the k-means grouping, 25% by default; each one costs ~9% more than a reuse step on the 1.3B pipeline). ``attn_cost`` models the generation's attention time in reuse-step units
from the measured per-call costs of the 1.3B pipeline rows (warm-up 1.7, anchor 0.55 x 1.7 / ... see COSTS).

``--open-loop`` measures the attention instead of the clip, as ``bench_vsmooth_schedule`` does for V-Smooth: the
demo model samples with stock SDPA, and every self-attention call of that trajectory (each layer, step and CFG
branch) runs through the op once per schedule (a call site of its own, the schedule's own metadata), against
fp64 on the same q, k, v. It separates what a schedule costs at each step from how the sampler compounds it
(the clip's PSNR has both, and moves several dB with the seed). Rows: ``variant`` ``...+open-loop``, ``rel_l2`` the
mean over every call, ``rel_l2_late`` over the second half of the steps, ``rel_l2_max`` the worst call.

On a CPU the op runs its plain-PyTorch reference (the kernels' oracle): the fidelity is the method's, the times
say nothing. Rows: ``benchmarks/results/bench_mcsparse_schedule.csv`` (device column: where it ran).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import append_rows, print_table

BENCH = "bench_mcsparse_schedule"
# per-call attention cost relative to a reuse step at s = 0.15 (Wan 2.1 1.3B pipeline, H200, 2026-12-02,
# bench_pipeline.csv ce849ed: warm-up 6.33 s / 600 calls = 10.5 ms, anchor 3.09 s / 120 = 25.8 ms, reuse
# 5.88 s / 2280 = 2.58 ms)
COSTS = {"warmup": 10.5 / 2.58, "anchor": 25.8 / 2.58, "reuse": 1.0}


def log(*a):
    print(*a, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--warmups", default="2,4,6,8,10", help="warm-up lengths (steps), comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu (reference kernels)")
    ap.add_argument("--expcast", action="store_true", help="MC-Sparse's warm-up (and the V-Smooth floor) on the "
                    "ExpCast path (option expcast)")
    ap.add_argument("--anchor-sets", default=None,
                    help='anchor schedules to compare, e.g. "10,26;10;10,18,26,34,42" (steps; needs one --warmups)')
    ap.add_argument("--no-floor", dest="floor", action="store_false", help="skip the V-Smooth floor run")
    ap.add_argument("--group-fractions", default=None,
                    help="V-Smooth's re-grouping schedule instead: the dense clip, then V-Smooth alone at each "
                    "group_fraction (comma-separated, e.g. 0.25,0.04,0.02; no MC-Sparse runs)")
    ap.add_argument("--options", default=None,
                    help='JSON options added to every method run (MC-Sparse and the V-Smooth floor), e.g. '
                         '\'{"kmeans_iters": 1}\': the grouping\'s cost against its fidelity')
    ap.add_argument("--open-loop", action="store_true", help="the attention error per call on the dense "
                    "trajectory's inputs instead of the clip (see the module doc)")
    ap.add_argument("--smoke", action="store_true", help="CPU: 3 steps, 4 frames (1024 tokens), warm-ups 0,1, "
                    "no rows")
    a = ap.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.smoke:
        a.steps, a.device = 3, "cpu"
        a.warmups = a.warmups if a.anchor_sets else "0,1"
    a.extra_opts = {}
    if a.options:
        import json

        try:
            a.extra_opts = json.loads(a.options)
        except ValueError as e:
            ap.error(f"--options {a.options!r}: not JSON ({e})")
        if not isinstance(a.extra_opts, dict):
            ap.error(f"--options {a.options!r}: a JSON object of vcattn options")
    a.warmup_list = [int(x) for x in a.warmups.split(",") if x.strip()]
    if any(w < 0 or w >= a.steps for w in a.warmup_list):
        ap.error(f"--warmups must lie in [0, {a.steps - 1}]")
    a.anchor_list = None
    if a.anchor_sets:
        if len(a.warmup_list) != 1:
            ap.error("--anchor-sets needs one --warmups value (the warm-up every schedule shares)")
        try:
            a.anchor_list = [tuple(sorted({int(x) for x in grp.split(",")})) for grp in a.anchor_sets.split(";")]
        except ValueError:
            ap.error(f"--anchor-sets {a.anchor_sets!r}: steps as integers, e.g. \"10,26;10\"")
        w = a.warmup_list[0]
        if any(not st or min(st) != w or max(st) >= a.steps for st in a.anchor_list):
            ap.error(f"--anchor-sets: every schedule starts at step {w} (the first step after the warm-up selects: "
                     f"nothing is cached before it) and stays below {a.steps}")
    return a


def schedule_cost(steps: int, warmup: int, density: float, anchors=None) -> tuple:
    """(phase per step, the generation's attention cost in reuse-step units) as MC-Sparse runs them
    (``anchors``: the ``anchor_steps`` option, None for the default schedule)."""
    from vc_compile.config import VCConfig
    from vc_compile.methods import mcsparse
    cfg = VCConfig.from_options({"method": "mcsparse", "density": density, "warmup_steps": warmup,
                                 **({"anchor_steps": list(anchors)} if anchors else {})})
    anchors = set(mcsparse.anchor_steps(cfg, steps))
    phases = ["warmup" if i < warmup else "anchor" if i in anchors else "reuse" for i in range(steps)]
    return phases, sum(COSTS[p] for p in phases)


def open_loop(a):
    """``--open-loop``: each schedule's attention error per call on the dense trajectory (module doc)."""
    import json

    import vc_compile
    from benchmarks.bench_vsmooth_schedule import dense_trajectory, rel_l2
    from vc_compile.config import VCConfig
    from vc_compile.runtime import report as _report

    cpu = a.device == "cpu"
    n = a.steps
    ec = {"expcast": bool(a.expcast), **a.extra_opts}
    kern = {"experimental": {"kernels": "reference"}} if cpu else {}
    if a.anchor_list:
        w = a.warmup_list[0]
        scheds = [(f"anchors {','.join(map(str, st))}", {"warmup_steps": w, "anchor_steps": list(st)}, w)
                  for st in a.anchor_list]
    else:
        scheds = [(f"warmup {w}", {"warmup_steps": w}, w) for w in a.warmup_list]  # (label, options, warm-up)
    cfgs = {lab: VCConfig.from_options({"method": "mcsparse", "density": a.density, "min_seq_len": 1, **kern, **ec,
                                        **o}).to_json() for lab, o, _ in scheds}
    sites, errs = {}, {(lab, t): [] for lab, _, _ in scheds for t in range(n)}

    def visit(t, layer, branch, q, k, v, sm, ref):
        for lab, cj in cfgs.items():
            key = (lab, layer, branch)
            if key not in sites:
                sites[key] = _report.register_site(graph="open-loop", node=f"{lab}/{layer}/{branch}", module="demo",
                                                   shape=str(tuple(q.shape)), dtype="bf16", method="mcsparse",
                                                   rewritten=True).site
            out = torch.ops.vcattn.attention(q, k, v, None, sites[key], cj, sm)
            errs[(lab, t)].append(rel_l2(out, ref))

    def header(tokens, trained):
        return (f"[{BENCH}] open loop: demo model ({'trained' if trained else 'RANDOM weights'}), {tokens} tokens, "
                f"{n} steps, s = {a.density:g}, schedules {[lab for lab, _, _ in scheds]}, {a.device}")

    vc_compile.reset(report=True)
    with vc_compile.sampling(num_steps=n):
        mcfg, tokens, trained, t0 = dense_trajectory(a, visit, header, on_step=vc_compile.step)
    tag = ("+expcast" if a.expcast else "") + "".join(f"+{k}={v}" for k, v in sorted(a.extra_opts.items()))
    rows = []
    for lab, o, w in scheds:
        allv = [e for t in range(n) for e in errs[(lab, t)]]
        late = [e for t in range(n // 2, n) for e in errs[(lab, t)]]
        phases, cost = schedule_cost(n, w, a.density, o.get("anchor_steps"))
        rows.append(dict(variant=f"mcsparse{tag}@{a.density:g}+open-loop", B=1, H=mcfg.num_attention_heads, S=tokens,
                         D=mcfg.attention_head_dim, density=a.density, steps=n, warmup_steps=w,
                         anchors=" ".join(str(i) for i, p in enumerate(phases) if p == "anchor"), attn_cost=cost,
                         rel_l2=sum(allv) / len(allv), rel_l2_late=sum(late) / len(late), rel_l2_max=max(allv),
                         model="vc-demo" + ("" if trained else " (random weights)"), device=a.device, seed=a.seed,
                         per_step=json.dumps([round(sum(errs[(lab, t)]) / len(errs[(lab, t)]), 6) for t in range(n)]),
                         note=("reference kernels on CPU" if cpu else "kernels") + "; open loop: attention on the "
                              "dense trajectory's inputs against fp64, per call"))
        log(f"  {lab}: rel. L2 {rows[-1]['rel_l2']:.4e} (second half {rows[-1]['rel_l2_late']:.4e}, worst "
            f"{rows[-1]['rel_l2_max']:.3e}), attention cost {cost:.0f} [{time.perf_counter() - t0:.0f} s]")
    print_table(rows, ["variant", "warmup_steps", "anchors", "rel_l2", "rel_l2_late", "rel_l2_max", "attn_cost"])
    if not a.smoke:
        path = append_rows(BENCH, rows, extras=["model", "steps", "warmup_steps", "anchors", "psnr_db", "ssim",
                                                "attn_cost", "device", "phases", "note", "seed", "rel_l2_late",
                                                "rel_l2_max", "per_step"])
        log(f"[{BENCH}] rows appended to {path}")
    return rows


def main(argv=None):
    a = parse_args(argv)
    if a.open_loop:
        return open_loop(a)
    from vc_compile.demo.metrics import compare
    from vc_compile.demo.model import DEFAULT_PROMPT, encode, load_demo, parse_prompt
    from vc_compile.demo.pipe import build_pipeline
    from vc_compile.demo.runner import run_pipeline

    device, cpu = torch.device(a.device), a.device == "cpu"
    transformer, text_encoder, cfg, trained = load_demo(None, device=device, dtype=torch.bfloat16, allow_random=True)
    frames, height, width = (4 if a.smoke else cfg.frames), cfg.height, cfg.width
    tokens = cfg.tokens(frames, height, width)
    cond = encode(text_encoder, parse_prompt(DEFAULT_PROMPT, cfg.max_sprites), torch.bfloat16)
    uncond = encode(text_encoder, parse_prompt("", cfg.max_sprites), torch.bfloat16)
    pipe = build_pipeline(transformer, a.steps)
    base = {"experimental": {"compiler": "eager" if cpu else "inductor"}, "min_seq_len": min(1024, tokens)}
    kw = dict(frames=frames, height=height, width=width, steps=a.steps, seed=a.seed, guidance=3.0,
              warmup=0 if cpu else 2, profile=False, progress=False)  # the CPU's eager path compiles nothing
    log(f"[{BENCH}] demo model ({'trained' if trained else 'RANDOM weights'}), {tokens} tokens, {a.steps} steps, "
        f"s = {a.density:g}, warm-ups {a.warmup_list}, {a.device}"
        + (" (reference kernels: fidelity only)" if cpu else ""))
    t0 = time.perf_counter()
    runs = [("dense", {"method": "dense"}, None)]  # the reference first; V-Smooth (the 8-bit floor) last
    ec = {"expcast": bool(a.expcast), **a.extra_opts}
    tag = ("+expcast" if a.expcast else "") + "".join(f"+{k}={v}" for k, v in sorted(a.extra_opts.items()))
    if a.group_fractions:  # V-Smooth's grouping schedule: dense, then V-Smooth per group_fraction
        fracs = [float(x) for x in a.group_fractions.split(",") if x.strip()]
        runs += [(f"vsmooth{tag}+group_fraction={g:g}", {"method": "vsmooth", **ec, "group_fraction": g}, None)
                 for g in fracs]
        a.floor = False
    elif a.anchor_list:
        w = a.warmup_list[0]
        runs += [(f"mcsparse{tag}@{a.density:g} anchors {','.join(map(str, st))}",
                  {"method": "mcsparse", "density": a.density, "warmup_steps": w, "anchor_steps": list(st), **ec}, w)
                 for st in a.anchor_list]
    else:
        runs += [(f"mcsparse{tag}@{a.density:g} warmup {w}", {"method": "mcsparse", "density": a.density,
                                                               "warmup_steps": w, **ec}, w) for w in a.warmup_list]
    if a.floor:
        runs += [(f"vsmooth{tag}", {"method": "vsmooth", **ec}, None)]
    extras = ["model", "steps", "warmup_steps", "anchors", "psnr_db", "ssim", "attn_cost", "device", "phases", "note",
              "seed"]
    dense, rows = None, []
    for label, opts, w in runs:
        res = run_pipeline(pipe, cond, uncond, label, {**base, **opts}, **kw)
        if dense is None:
            dense = res.clip
        m = compare(res.clip, dense)
        row = dict(variant=label.split(" ")[0], B=1, H=cfg.num_attention_heads, S=tokens,
                   D=cfg.attention_head_dim, density=a.density if w is not None else 1.0, steps=a.steps,
                   warmup_steps=w if w is not None else "", psnr_db=m["psnr"], ssim=m["ssim"], rel_l2=m["rel_l2"],
                   ms=res.e2e_ms, model="vc-demo" + ("" if trained else " (random weights)"), device=a.device,
                   seed=a.seed,
                   note=("reference kernels on CPU: fidelity only, times meaningless" if cpu else "") +
                        ("" if trained else "; random weights: errors understated"))
        if w is not None:
            phases, cost = schedule_cost(a.steps, w, a.density, opts.get("anchor_steps"))
            row.update(anchors=" ".join(str(i) for i, p in enumerate(phases) if p == "anchor"), attn_cost=cost,
                       phases=res.summary)
        rows.append(row)
        if not a.smoke:  # row by row: a long CPU study keeps what it finished
            path = append_rows(BENCH, [row], extras=extras)
        log(f"  {label}: PSNR {m['psnr']:.2f} dB, SSIM {m['ssim']:.4f}"
            + (f", anchors {row['anchors']}, attention cost {row['attn_cost']:.0f} reuse steps" if w is not None
               else "") + f" [{time.perf_counter() - t0:.0f} s]")
    print_table(rows, ["variant", "warmup_steps", "anchors", "psnr_db", "ssim", "rel_l2", "attn_cost"])
    if not a.smoke:
        log(f"[{BENCH}] rows appended to {path}")
    return rows


if __name__ == "__main__":
    main()
