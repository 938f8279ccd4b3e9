"""Bare attention over a whole denoising generation: every phase, as a user calls it.

    python -m benchmarks.bench_generation                      # H200: S in {32760, 75600} x H in {40, 12}
    python benchmarks/bench_generation.py --sizes 32760 --heads 40 --csv $OUT/bench_generation.csv
    python -m benchmarks.bench_generation --smoke              # CPU: tiny shapes, reference kernels, no rows

Per shape (B = 1, D = 128, bf16): structured q, k, v (``common.structured_inputs``: channel-biased K,
clustered V with token outliers) that drift a little each step (``common.Drift``: a random walk, 5% of
the spread per step, ``--drift-rate``), ``--steps`` steps (default 50). That drift is independent per token and
coordinate, which reshuffles the keys that matter within a few steps: MC-Sparse's reuse (selection and residual
from the last anchor) meets inputs it is not built for, and its ``rel_l2`` on the last step says so (0.72 at
s = 0.15, 32760 tokens and the default rate on an H100; 2.4e-3 on reuse steps of still inputs, CPU reference path,
2048 tokens); a denoiser's inputs move far less. Each method is called through
``torch.ops.vcattn.attention`` (the op the rewrite puts in place of SDPA; q, k, v as [B, H, S, D] views of
the model's [B, S, H, D] layout) inside ``vc_compile.sampling(num_steps=n)`` with ``vc_compile.step(i)``,
so its real phase schedule runs: dense warm-up, V-Smooth grouping, MC-Sparse anchors, reuse steps.
Baselines on the same inputs: ``sdpa_cudnn`` (n cuDNN calls), ``fa4-bf16`` (FlashAttention-4, when
``flash_attn.cute`` imports), and, on a sm_90 GPU where they import, ``fa3-fp8``
(FlashAttention-3's FP8 kernel from the fa3-fwd wheel; per-(batch, head) FP8 quantisation inside every call,
since the inputs change every step) and ``torchao-fp8`` (torchao's FP8 attention op as its
``apply_low_precision_attention`` calls it, quantisation included; FA3 active as torch's flash SDPA for the
whole generation, as its wrapper keeps it for a forward); ``speedup_vs_torchao`` against the latter.

Timing: each variant runs one untimed generation first (Triton JIT, cuDNN plans: ``first_generation_s``
is its wall time), then a timed one. Every step synchronises after making its inputs, then CUDA events
bracket the one call: the step's time includes the op's Python, metadata lookups and launch gaps (host
work a busy pipeline may hide; the same for every variant). ``ms`` = attention time summed over every
step; ``ms_<phase>`` / ``n_<phase>`` = its split by the phase the op recorded for the step
(``vc_compile.report()``); ``step_ms`` = the per-step times; ``tflops`` = dense FLOPs of n calls over
``ms`` (effective, for sparse methods). ``rel_l2`` / ``cos_sim``: the last step's output against an fp32
reference on 512 sampled query rows of every head.

Reuse-step breakdown (``<method>:reuse_breakdown`` rows, at ``--breakdown-size``, default S = 32760,
H = 40): a third generation runs to the second reuse step and profiles that call with torch.profiler:
GPU kernel times by name, split into attention kernels (names matching ``ATTN_KERNELS``) and the rest;
``gap_ms`` = step time - all kernel time (launch gaps, Python, metadata lookups while the GPU idles),
``host_ms`` = the op's host time on the previous reuse step (no profiler), ``outside_share`` = 1 -
attention-kernel time / step time: the target "everything outside the attention kernels <= 5% of the
step". A residual added in the attention kernel's epilogue is inside the kernel (not separable here;
``bench_sparse_attn``'s ``reuse_*`` vs ``sparse_*`` rows measure it).

Rows are appended to ``benchmarks/results/bench_generation.csv`` per shape (``--csv``: also to that file).
``--budget`` seconds: a variant whose estimated time would not fit is skipped and listed.
"""
from __future__ import annotations

import argparse
import functools
import contextlib
import itertools
import sys
import time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vc_compile  # noqa: E402
import vc_compile.ops  # noqa: E402,F401 - registers torch.ops.vcattn.*, which this script calls directly
from benchmarks.common import (truth_rows, Drift, add_speedup, append_rows, attn_flops, fa3_fp8_fn,  # noqa: E402
                               fa4_fn, fa4_status, fp8_baselines, kernel_times, metrics, parse_methods,
                               print_table, sdpa_backend)
from vc_compile.config import merge_options  # noqa: E402

BENCH = "bench_generation"
# NOTE MC-Sparse without its reuse check: this benchmark times each phase, and its drift (independent per token and
# coordinate) makes the first reuse step worse than the previous output, so the check would run the reuse steps
# as stock SDPA (bench_reuse_check measures the check; bench_pipeline runs it as users get it).
_NO_CHECK = {"reuse_check": False}
METHODS = {
    "vsmooth": {"method": "vsmooth", "expcast": False},
    "vsmooth+expcast": {"method": "vsmooth", "expcast": True},
    "mcsparse@0.15": {"method": "mcsparse", "density": 0.15, **_NO_CHECK},
    "mcsparse@0.25": {"method": "mcsparse", "density": 0.25, **_NO_CHECK},
    # the sm_90 gather kernel's 8-bit QK (opt-in; not in the default --methods)
    "mcsparse+int8@0.15": {"method": "mcsparse", "density": 0.15, "sparse_qk": "int8", **_NO_CHECK},
    # the grouping schedule's A/B (docs/design/vsmooth-grouping-schedule.md; not in the default --methods)
    "vsmooth+expcast:g10": {"method": "vsmooth", "expcast": True, "group_interval": 10},
}
DEFAULT_METHODS = "vsmooth,vsmooth+expcast,mcsparse@0.15,mcsparse@0.25"
PHASES = ("dense", "warmup", "group", "anchor", "reuse")  # warmup: MC-Sparse's V-Smooth warm-up
# GPU kernels counted as "attention kernels" in the reuse-step breakdown (lower-case substrings): ours
# (vsmooth_attn*, sparse_attn*) and SDPA's (cuDNN, flash, fmha)
ATTN_KERNELS = ("attn", "attention", "fmha", "flash", "sdpa", "cudnn")
# Prior per-step time of a method relative to one cuDNN call (H200 2026-12-01; only to plan the
# budget: measured times replace them as the run goes)
PRIOR_RATIO = {"vsmooth": 0.85, "vsmooth+expcast": 0.8, "mcsparse@0.15": 0.45, "mcsparse@0.25": 0.5,
               "mcsparse+int8@0.15": 0.45}
JIT_PRIOR_S = 15.0  # first call of a method's kernels in this process (measured: 9.4-10 s)
_SITES = itertools.count(900_000)  # call-site ids of this script's op calls (one per method and shape)
EXTRAS = ["steps", "speedup_vs_fa4", "first_generation_s", "ms_per_step_median",
          *(f"ms_{p}" for p in PHASES), *(f"n_{p}" for p in PHASES), "attn_kernel_ms", "other_kernels_ms",
          "gap_ms", "host_ms", "outside_share", "step_ms", "note", "speedup_vs_torchao", "drift_rate"]


def log(*a):
    print(*a, flush=True)


class Clock:
    """Per-call time: CUDA events (resolved at the end) or, on CPU, a wall clock."""

    def __init__(self, cuda: bool):
        self.cuda, self.pairs, self.wall = cuda, [], []

    def time(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            self.pairs.append((a, b))
        else:
            t0 = time.perf_counter()
            out = fn()
            self.wall.append((time.perf_counter() - t0) * 1e3)
        return out

    def ms(self):
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.pairs]
        return list(self.wall)


def _phase_counts(site: int) -> dict:
    rec = next((s for s in vc_compile.report().sites if s.site == site), None)
    return dict(rec.phases) if rec is not None else {}


def _step_phase(before: dict, after: dict) -> str:
    delta = {p: after.get(p, 0) - before.get(p, 0) for p in after}
    delta = {p: n for p, n in delta.items() if n > 0}
    return max(sorted(delta), key=delta.get) if delta else "?"


class Runner:
    """One shape: makes the op / baseline callables and runs generations on drifting inputs."""

    def __init__(self, S, H, D, steps, seed, device, smoke, drift_rate=0.05):
        self.S, self.H, self.D, self.steps, self.seed = S, H, D, steps, seed
        self.device, self.smoke, self.drift_rate = device, smoke, drift_rate
        self.cuda = device.type == "cuda"

    def drift(self):
        return Drift(1, self.H, self.S, self.D, seed=self.seed, device=self.device, rate=self.drift_rate)

    def op(self, opts):
        extra = {"min_seq_len": 16, "experimental": {"kernels": "reference"}} if self.smoke else {}
        cfg = vc_compile.VCConfig.from_options(merge_options(opts, extra)).to_json()
        site = next(_SITES)
        return site, lambda q, k, v: torch.ops.vcattn.attention(q, k, v, None, site, cfg, None)

    def generation(self, call, site=None, timed=True):
        """Run ``steps`` steps; returns (per-step ms, per-step phase, last output, last inputs, wall s).
        ``site`` given: the call is the vcattn op (explicit steps, phases recorded)."""
        clock, phases = Clock(self.cuda), []
        drift, out, qkv = self.drift(), None, None
        t0 = time.perf_counter()
        ctx = vc_compile.sampling(num_steps=self.steps) if site is not None else contextlib.nullcontext()
        with ctx, sdpa_backend("cudnn" if self.cuda else "math"):
            for i in range(self.steps):
                qkv = tuple(t.transpose(1, 2) for t in drift.step())  # [B, H, S, D] views
                if site is not None:
                    vc_compile.step(i)
                    before = _phase_counts(site)
                out = clock.time(lambda: call(*qkv)) if timed else call(*qkv)
                if site is not None:
                    phases.append(_step_phase(before, _phase_counts(site)))
        ms = clock.ms() if timed else []
        if self.cuda:
            torch.cuda.synchronize()
        return ms, phases, out, qkv, time.perf_counter() - t0


def fidelity(out, qkv, n_rows, seed):
    q, k, v = qkv
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(q.shape[2], generator=g)[:n_rows].sort().values.to(q.device)
    m = metrics(out[:, :, rows].float(), truth_rows(q, k, v, rows))
    return {"rel_l2": m["rel_l2"], "cos_sim": m["cos_sim"]}


def breakdown(runner, call, site, step_ms):
    """Profile the op on the second reuse step of a fresh generation (see the module docstring); the
    first reuse step gives the op's host time. None if the generation has fewer than two reuse steps."""
    drift, res, n_reuse = runner.drift(), {}, 0
    with vc_compile.sampling(num_steps=runner.steps), sdpa_backend("cudnn" if runner.cuda else "math"):
        for i in range(runner.steps):
            qkv = tuple(t.transpose(1, 2) for t in drift.step())
            vc_compile.step(i)
            before = _phase_counts(site)
            if n_reuse == 1:  # a reuse step: the op's host time (launches + Python), no profiler
                if runner.cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                call(*qkv)
                res["host_ms"] = (time.perf_counter() - t0) * 1e3
            elif n_reuse >= 2:
                res.update(_profile_call(lambda: call(*qkv), runner.cuda))
            else:
                call(*qkv)
            phase = _step_phase(before, _phase_counts(site))
            if "kernels" in res:
                res["profiled_phase"] = phase
                break
            n_reuse += phase == "reuse"
    if "kernels" not in res:
        return None
    ms = sorted(t for t, p in step_ms if p == "reuse")
    step = ms[len(ms) // 2] if ms else float("nan")
    has = bool(res["kernels"])
    res.update(ms=step, gap_ms=step - res["attn_kernel_ms"] - res["other_kernels_ms"] if has else float("nan"),
               outside_share=1.0 - res["attn_kernel_ms"] / step if has else float("nan"))
    return res


def _profile_call(fn, cuda):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kern = kernel_times(prof)
    is_attn = {n: any(p in n.lower() for p in ATTN_KERNELS) for n in kern}
    top = sorted(kern.items(), key=lambda x: -x[1])
    return {"kernels": top,
            "attn_kernel_ms": sum(t for n, t in kern.items() if is_attn[n]),
            "other_kernels_ms": sum(t for n, t in kern.items() if not is_attn[n])}


def estimate_s(S, H, D, steps, label, cuda):
    """Planning estimate (seconds) of one variant: an untimed and a timed generation (+ JIT)."""
    if not cuda:
        return 1.0
    dense = attn_flops(1, H, S, S, D) / 5.0e14  # cuDNN ~500 TFLOP/s on the H200
    ratio = PRIOR_RATIO.get(label, 1.0)
    return 2 * steps * (dense * ratio + 0.004) + (JIT_PRIOR_S if label in METHODS else 1.0)


def bench_shape(S, H, args, device, t_start):
    D = args.head_dim
    runner = Runner(S, H, D, args.steps, args.seed, device, args.smoke, args.drift_rate)
    base = dict(B=1, H=H, S=S, D=D, steps=args.steps, density="", drift_rate=args.drift_rate)
    flops = attn_flops(1, H, S, S, D) * args.steps
    rows, skipped = [], []
    n_rows = 64 if args.smoke else 512

    def fits(label):
        if args.budget is None:
            return True
        ok = time.perf_counter() - t_start + estimate_s(S, H, D, args.steps, label, runner.cuda) <= args.budget
        if not ok:
            skipped.append(f"{label}@S={S},H={H}")
        return ok

    def add(label, ms, phases, out, qkv, first_s, note="", **extra):
        row = dict(base, variant=label, ms=sum(ms), tflops=flops / (sum(ms) * 1e-3) / 1e12,
                   first_generation_s=first_s, ms_per_step_median=sorted(ms)[len(ms) // 2],
                   step_ms=" ".join(f"{t:.2f}" for t in ms), note=note, **extra)
        row.update(fidelity(out, qkv, n_rows, args.seed))
        if phases:
            for p in PHASES:
                row[f"ms_{p}"] = sum(t for t, ph in zip(ms, phases) if ph == p)
                row[f"n_{p}"] = sum(ph == p for ph in phases)
        rows.append(row)
        split = " ".join(f"{p} {row[f'ms_{p}']:.0f} ms/{row[f'n_{p}']}" for p in PHASES if row.get(f"n_{p}"))
        log(f"  {label:18s} {row['ms']:10.1f} ms over {len(ms)} steps  first generation {first_s:6.1f} s  "
            f"rel_l2 {row['rel_l2']:.2e}  {split}  [{time.perf_counter() - t_start:.0f} s]")
        return row

    log(f"\n=== S={S} H={H} D={D} B=1 bf16, {args.steps} steps, drifting structured inputs ===")
    # baselines: cuDNN (math on CPU) and FA4
    if fits("sdpa_cudnn"):
        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v)
        first = runner.generation(sdpa, timed=False)[-1]
        ms, _, out, qkv, _ = runner.generation(sdpa)
        add("sdpa_cudnn", ms, [], out, qkv, first, note="" if runner.cuda else "CPU: SDPA math")
    fa4_note = fa4_status()[1]
    if runner.cuda and fa4_status()[0] is not None and fits("fa4-bf16"):
        def fa4(q, k, v):
            return fa4_fn(q, k, v)()
        first = runner.generation(fa4, timed=False)[-1]
        ms, _, out, qkv, _ = runner.generation(fa4)
        add("fa4-bf16", ms, [], out, qkv, first, note=fa4_note)
    elif runner.cuda:
        log(f"  {fa4_note}")
    # FP8 baselines (sm_90, optional): FA3's FP8 kernel quantising inside every call, torchao's FP8 op
    how = {"fa3-fp8": "; quantised inside every call (eager torch: amax, scale, cast)"}
    for label, make, status, ctx in fp8_baselines():
        if label == "fa3-fp8":  # inputs change every step: the per-call quantisation is part of the cost
            make = functools.partial(fa3_fp8_fn, quantize_inside=True)
        func, note = status()
        if runner.cuda and func is not None and fits(label):
            def call(q, k, v, make=make):
                return make(q, k, v)()
            try:
                with ctx():
                    first = runner.generation(call, timed=False)[-1]
                    ms, _, out, qkv, _ = runner.generation(call)
            except Exception as e:  # noqa: BLE001 - an optional baseline must not end the run
                log(f"  {label} failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            add(label, ms, [], out, qkv, first, note=note + how.get(label, ""))
        elif runner.cuda:
            log(f"  {note}")
    # the methods, through the op
    for label in args.methods:
        if not fits(label):
            continue
        site, call = runner.op(METHODS[label])
        first = runner.generation(call, site=site, timed=False)[-1]
        vc_compile.reset()  # zero the counts of the untimed generation
        ms, phases, out, qkv, _ = runner.generation(call, site=site)
        row = add(label, ms, phases, out, qkv, first, density=METHODS[label].get("density", 1.0),
                  note=("CPU: reference kernels; " if args.smoke else "") + "phases by step: "
                  + " ".join(f"{p}:{phases.count(p)}" for p in PHASES if p in phases))
        if (S, H) == args.breakdown_size and "reuse" in phases:
            b = breakdown(runner, call, site, list(zip(ms, phases)))
            if b is not None:
                top = "; ".join(f"{n[:60]} {t:.3f}" for n, t in b["kernels"][:8]) or "no CUDA kernels (CPU)"
                rows.append(dict(base, variant=f"{label}:reuse_breakdown", ms=b["ms"], density=row.get("density"),
                                 attn_kernel_ms=b["attn_kernel_ms"], other_kernels_ms=b["other_kernels_ms"],
                                 gap_ms=b["gap_ms"], host_ms=b["host_ms"], outside_share=b["outside_share"],
                                 note=f"reuse step (profiled step's phase: {b['profiled_phase']}); "
                                      f"kernels (ms): {top}"))
                if b["kernels"]:
                    log(f"    reuse step {b['ms']:.2f} ms: attention kernels {b['attn_kernel_ms']:.2f}, other "
                        f"kernels {b['other_kernels_ms']:.2f}, gaps {b['gap_ms']:.2f}, op host time "
                        f"{b['host_ms']:.2f} ms; outside the attention kernels {100 * b['outside_share']:.1f}% "
                        f"(target <= 5%; profiled step's phase: {b['profiled_phase']})")
                else:
                    log(f"    reuse step {b['ms']:.2f} ms, op host time {b['host_ms']:.2f} ms (no CUDA kernels to "
                        "profile on this device)")
                for n, t in b["kernels"][:8]:
                    log(f"      {t:8.3f} ms  {n[:100]}")
        del out, qkv
    add_speedup(rows, "sdpa_cudnn", "speedup_vs_cudnn", keys=("H", "S"))
    add_speedup(rows, "fa4-bf16", "speedup_vs_fa4", keys=("H", "S"))
    add_speedup(rows, "torchao-fp8", "speedup_vs_torchao", keys=("H", "S"))
    for r in rows:
        if r["variant"].endswith(":reuse_breakdown"):
            r["speedup_vs_cudnn"] = r["speedup_vs_fa4"] = r["speedup_vs_torchao"] = ""
    if runner.cuda:
        torch.cuda.empty_cache()
    return rows, skipped


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32760,75600", help="sequence lengths (comma-separated)")
    ap.add_argument("--heads", default="40,12", help="head counts (comma-separated); every S x H")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"from {list(METHODS)}")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drift-rate", type=float, default=0.05,
                    help="the inputs' random walk per step, as a share of their spread (0: the same inputs every "
                         "step; the rows' drift_rate column)")
    ap.add_argument("--breakdown-size", default="32760x40", help="SxH of the reuse-step breakdown ('' = none)")
    ap.add_argument("--budget", type=float, default=None, help="seconds; skip what would not fit, list it")
    ap.add_argument("--csv", default=None, help="also append the rows to this CSV")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: S=256, H=2, 6 steps, "
                    "reference kernels, nothing appended")
    a = ap.parse_args(argv)
    a.methods = parse_methods(ap, a.methods, METHODS)
    if a.smoke:
        a.sizes, a.heads, a.steps, a.breakdown_size = "256", "2", min(a.steps, 6), "256x2"
        a.head_dim = 64
    a.shapes = [(int(s), int(h)) for s in a.sizes.split(",") if s for h in a.heads.split(",") if h]
    a.breakdown_size = tuple(int(x) for x in a.breakdown_size.split("x")) if a.breakdown_size else None
    return a


def main(argv=None):
    a = parse_args(argv)
    threads = torch.get_num_threads()
    if a.smoke:  # tiny CPU ops: one thread is much faster than two on a shared 2-core machine
        torch.set_num_threads(1)
    try:
        return _main(a)
    finally:
        torch.set_num_threads(threads)


def _main(a):
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if not a.smoke and device.type != "cuda":
        sys.exit("bench_generation: needs a CUDA GPU (or --smoke)")
    t_start = time.perf_counter()
    est = sum(estimate_s(S, H, a.head_dim, a.steps, lab, device.type == "cuda") for S, H in a.shapes
              for lab in ["sdpa_cudnn", "fa4-bf16", "fa3-fp8", "torchao-fp8", *a.methods])
    log(f"[bench_generation] {len(a.shapes)} shapes x {len(a.methods)} methods + baselines, {a.steps} steps; "
        f"estimated {est:.0f} s" + (f" (budget {a.budget:.0f} s)" if a.budget else ""))
    all_rows, skipped = [], []
    for S, H in a.shapes:
        rows, sk = bench_shape(S, H, a, device, t_start)
        skipped += sk
        all_rows += rows
        if not a.smoke and rows:
            path = append_rows(BENCH, rows, extras=EXTRAS)
            if a.csv:
                append_rows(BENCH, rows, path=a.csv, extras=EXTRAS)
            log(f"  rows appended to {path}")
    log("")
    print_table(all_rows, ["variant", "H", "S", "ms", "speedup_vs_cudnn", "speedup_vs_fa4", "speedup_vs_torchao",
                           "ms_dense", "ms_group", "ms_anchor", "ms_reuse", "first_generation_s", "rel_l2",
                           "outside_share"])
    if skipped:
        log(f"[bench_generation] skipped (budget {a.budget:.0f} s): {', '.join(skipped)}")
    log(f"[bench_generation] {time.perf_counter() - t_start:.0f} s in all")
    return all_rows


if __name__ == "__main__":
    main()
