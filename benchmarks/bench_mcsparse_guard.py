"""MC-Sparse quality guard (methods/mcsparse_guard.py): fixed vs adaptive anchor schedules, side by side.

    python -m benchmarks.bench_mcsparse_guard                  # both below (H200: ~2-3 min, one command)
    python -m benchmarks.bench_mcsparse_guard --synthetic      # drifting synthetic inputs
    python -m benchmarks.bench_mcsparse_guard --demo           # the trained demo model, closed loop
    python -m benchmarks.bench_mcsparse_guard --demo --trace   # + per-call true vs estimated error
    python -m benchmarks.bench_mcsparse_guard --smoke          # CPU dry run, tiny (no CSV)

Sizes: synthetic B = 1, H = 8, S = 8192, D = 128 on CUDA (H = 2, S = 1024, D = 64 on CPU), 30 steps; the
demo at 16 x 32 x 32 px (4096 tokens, the size it was trained at), 50 steps.

Every schedule runs through the real op (``torch.ops.vcattn.attention``: phases, metadata, the guard's
lagged read-back), the reference kernels on CPU and the Triton kernels on CUDA.

``--synthetic``: one attention call per step along a drifting trajectory, ``--steps`` steps, warm-up 0,
anchor at step 0. Trajectories (``trajectory``): ``random`` = Gaussian q, k, v (diffuse attention) on a
random walk of relative size ``drift`` per step (the issue's setting: its error grows like sqrt(steps));
``structured`` = channel-biased K, peaked attention, clustered V with outliers (as
tests/test_reference_math) on a coherent drift ``x_t = cos(drift t) x_0 + sin(drift t) x_1`` (x_1 an
independent draw; the error grows linearly); ``burst`` = the structured inputs, still except for a 4-step
burst of ``drift`` per step a third of the way in (``burst_rate``). Error = relative L2 of the output against fp32 SDPA on the
same inputs, per step (mean, max over steps).

``--demo``: the trained demo model (``vc_compile/demo``) sampling a clip with CFG (2 calls per step), each
self-attention call routed to the op through a patched ``F.scaled_dot_product_attention`` (one site per
layer, eager: the schedule logic is the op's, no compile needed). PSNR / SSIM of the final clip against the
dense run's (same seed, same noise). On CPU the model's linears run in fp32 and only the attention in bf16
(bf16 matmuls are ~200x slower than fp32 on the 2-core CI machine); on CUDA the whole model runs in bf16.
``--trace``: every self-attention call also computes fp32 SDPA (true error) and the guard's estimate on
its 16 sampled rows per head, for the estimator table.

Cost: in dense-step units per attention call, from H200 measurements at B = 1, H = 40, S = 32760, D = 128
(docs/sparse_notes.md, C = 128, s = 0.15): dense (cuDNN) 1.0, reuse step 0.20 (7.68 / 38.4 ms), anchor
2.6 (~99.5 ms), the flags pass 0.004 on every reuse step (one read of K and V, with or without the guard)
and the guard's probe on top 0.001 (``COST``; docs/design/finite-flags.md measures the last two). The
``cost`` column is the schedule's total over all calls / the all-dense total.
``ms``: synthetic rows, the op's own time summed over the trajectory's calls (CUDA events; not the
inputs, not the fp32 reference), so fixed and adaptive schedules compare directly at this size; demo rows,
the whole sampling loop's wall time (model included; with ``--trace`` the fp32 references too).
Rows go to ``benchmarks/results/bench_mcsparse_guard.csv`` (``--csv`` to write elsewhere).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import benchmarks.common as common
from benchmarks.common import print_table
import vc_compile
import vc_compile.ops  # noqa: F401  (registers torch.ops.vcattn.*: ``import vc_compile`` is lazy)
from vc_compile.config import VCConfig
from vc_compile.methods.mcsparse_guard import sample_rows
from vc_compile.reference.finite_flags import probe_rows
from vc_compile.runtime import report as _report

COST = {"dense": 1.0, "reuse": 0.20, "anchor": 2.6, "flags": 0.004, "guard": 0.001}
EXTRAS = ["err_max", "err_last", "anchors", "guard_anchors", "cost", "psnr", "ssim", "steps", "note"]


# ---- schedules -------------------------------------------------------------------------------------------
def schedules(kind: str, thresholds, steps: int = 50):
    """[(label, options)]: fixed schedules, then the guard at each threshold on the default schedule
    (``guard@t``) and, for the demo, on the first anchor alone (``guard-only@t``: the guard in place of
    the fixed second anchor)."""
    if kind == "synthetic":  # warm-up 0, anchor at 0 (the setting), then more frequent anchors
        fixed = [("fixed:anchor0", {"anchor_steps": (0,)}), ("fixed:every10", {"anchor_interval": 10}),
                 ("fixed:every5", {"anchor_interval": 5}), ("fixed:every3", {"anchor_interval": 3})]
        base = {"anchor_steps": (0,)}
    else:  # the default schedule (20% dense warm-up, anchors at 20% and 52%) and denser fixed ones
        fixed = [("fixed:default", {}), ("fixed:every8", {"anchor_interval": 8}),
                 ("fixed:every4", {"anchor_interval": 4})]
        base = {}
    out = fixed + [(f"guard@{t:g}", {**base, "guard_threshold": float(t)}) for t in thresholds]
    if kind != "synthetic":
        first = (int(round(0.2 * steps)),)  # the default warm-up's end (runtime/steps.warmup_steps)
        out += [(f"guard-only@{t:g}", {"anchor_steps": first, "guard_threshold": float(t)}) for t in thresholds]
    return out


def cost_of(phases: dict, guard: bool, calls: int) -> float:
    reuse = phases.get("reuse", 0)
    c = (phases.get("dense", 0) * COST["dense"] + phases.get("anchor", 0) * COST["anchor"]
         + reuse * (COST["reuse"] + COST["flags"] + (COST["guard"] if guard else 0.0)))
    return c / max(1, calls)


# ---- synthetic trajectories ------------------------------------------------------------------------------
def _draw(kind, B, H, S, D, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    if kind == "random":
        return [r(B, H, S, D) for _ in range(3)]
    # structured (also the burst trajectory's inputs)
    q = r(B, H, S, D) * 1.5
    k = r(B, H, S, D) * 1.5 + 4.0 * r(1, H, 1, D)
    centres = r(B, H, 8, D) * 3.0
    lab = torch.randint(0, 8, (B, H, S), generator=g, device=device)
    v = torch.gather(centres, 2, lab[..., None].expand(B, H, S, D)) + 0.3 * r(B, H, S, D)
    out = torch.randint(0, S, (B, H, max(1, S // 64)), generator=g, device=device)
    v.scatter_(2, out[..., None].expand(*out.shape, D), 40.0 * r(*out.shape, D))
    return [q, k, v]


def trajectory(kind: str, drift: float, steps: int, B=1, H=2, S=2048, D=128, seed=0, dtype=torch.bfloat16,
               device="cpu"):
    """(q, k, v) per step. ``random``: Gaussian inputs on a random walk, ``x_t = x_{t-1} + drift eps_t``
    (eps_t ~ N(0, 1), x_0's scale: the issue's setting); ``structured``: structured inputs on a coherent
    drift, ``x_t = cos(drift t) x_0 + sin(drift t) x_1`` with x_1 an independent draw (norms kept)."""
    x0, x1 = _draw(kind, B, H, S, D, seed, device), _draw(kind, B, H, S, D, seed + 1000, device)
    g = torch.Generator(device=device).manual_seed(seed + 2000)
    x = [t.clone() for t in x0]
    angle = 0.0
    for t in range(steps):
        if kind == "random":
            if t:
                x = [a + drift * torch.randn(a.shape, generator=g, device=device) for a in x]
        else:
            if t:
                angle += burst_rate(drift, t, steps) if kind == "burst" else drift
            c, s = math.cos(angle), math.sin(angle)
            x = [c * a + s * b for a, b in zip(x0, x1)]
        yield [a.to(dtype) for a in x]


def burst_rate(drift: float, t: int, steps: int) -> float:
    """``burst``: ``drift`` per step during 4 steps from a third of the way in, drift / 20 elsewhere (a
    motion burst or scene change that a fixed schedule cannot know about)."""
    t0 = steps // 3
    return drift if t0 <= t < t0 + 4 else drift / 20


def run_synthetic(kind, drift, label, opts, a, device):
    # NOTE the reuse check off: these rows compare anchor schedules and the guard, and the fast drifts would send
    # the fixed schedules' reuse steps to stock SDPA (bench_reuse_check measures the check)
    cfg = VCConfig.from_options({"method": "mcsparse", "density": a.density, "warmup_steps": 0, "min_seq_len": 1,
                                 "group_size": a.group_size, "reuse_check": False, **opts}).to_json()
    site = _report.register_site(graph="guard", node=label, module=f"{kind}-{drift}", shape="?", dtype="?",
                                 method="mcsparse", rewritten=True).site
    errs, ms = [], 0.0
    with vc_compile.sampling(num_steps=a.steps):
        for t, (q, k, v) in enumerate(trajectory(kind, drift, a.steps, H=a.heads, S=a.seq, D=a.dim, device=device)):
            vc_compile.step(t)
            with _OpTimer(device) as tm:  # the op alone: not the inputs, not the fp32 reference
                o = torch.ops.vcattn.attention(q, k, v, None, site, cfg, None)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            errs.append(((o.float() - ref).norm() / ref.norm()).item())  # syncs: the timer's events are done
            ms += tm.ms()
    rec = _report.site(site)
    return errs, dict(rec.phases), rec.guard_anchors, ms


class _OpTimer:
    """Time of one op call: CUDA events around it on the GPU (no sync inside the call, so the guard's
    asynchronous read-back behaves as in a real run; read ``ms()`` after a later sync), a wall clock on
    the CPU."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    def __enter__(self):
        if self.cuda:
            self.e0, self.e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.e0.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.e1.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        return self.e0.elapsed_time(self.e1) if self.cuda else (self.t1 - self.t0) * 1e3


# ---- the demo model, closed loop -------------------------------------------------------------------------
@contextlib.contextmanager
def vcattn_sdpa(transformer, options: dict, trace=None):
    """Route every self-attention SDPA call of ``transformer`` (eager) to ``vcattn::attention`` in bf16, one
    site per layer; cross-attention stays stock SDPA (also in bf16). ``trace``: a list that receives
    (layer, true error, guard estimate, step, phase) per self-attention call."""
    original = F.scaled_dot_product_attention
    cfg = VCConfig.from_options({"min_seq_len": 1, **options}).to_json()
    sites, state = {}, {"layer": 0, "step": -1}

    def pre_hook(module, args, kwargs):
        state["layer"] = 0

    def sdpa(query, key, value, *args, **kwargs):
        if state.get("inside"):  # the op's own stock-SDPA calls (dense phases)
            return original(query, key, value, *args, **kwargs)
        dt = query.dtype
        q, k, v = (x.to(torch.bfloat16) for x in (query, key, value))
        if q.shape[-2] != k.shape[-2]:
            return original(q, k, v, *args, **kwargs).to(dt)
        layer = state["layer"]
        state["layer"] += 1
        if layer not in sites:
            sites[layer] = _report.register_site(graph="demo", node=f"attn1.{layer}", module=f"blocks.{layer}.attn1",
                                                 shape="?", dtype="bf16", method="?", rewritten=True).site
        rec = _report.site(sites[layer])
        before = dict(rec.phases)
        state["inside"] = True
        try:
            o = torch.ops.vcattn.attention(q, k, v, None, sites[layer], cfg, kwargs.get("scale"))
        finally:
            state["inside"] = False
        if trace is not None:
            ref = original(q.float(), k.float(), v.float())
            rows = sample_rows(q.shape[0], q.shape[1], q.shape[2], device=q.device)
            exact = probe_rows(q, k, v, rows, 1.0 / math.sqrt(q.shape[-1]))
            got = torch.gather(o.float(), 2, rows.long()[..., None].expand(*rows.shape, o.shape[-1]))
            est = ((got - exact).norm() / exact.norm()).item()
            phase = next((p for p, n in rec.phases.items() if n > before.get(p, 0)), "?")
            trace.append((layer, ((o.float() - ref).norm() / ref.norm()).item(), est, state["step"], phase))
        return o.to(dt)

    handle = transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield sites, state
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        handle.remove()


def run_demo(label, opts, a, model, trace=None):
    from vc_compile.demo.sampler import sample

    tr, cond, uncond, dtype = model
    vc_compile.reset(report=True)
    t0 = time.perf_counter()
    with vcattn_sdpa(tr, opts, trace) as (sites, st), vc_compile.sampling(num_steps=a.steps):
        def step_fn(i):
            st["step"] = i
            vc_compile.step(i)

        clip = sample(tr, cond, uncond=uncond, guidance=a.guidance, frames=a.frames, height=a.height,
                      width=a.width, steps=a.steps, seed=a.seed, dtype=dtype, step_fn=step_fn,
                      progress=lambda i, n, s: print(f"  [{label}] step {i + 1}/{n} {s:.0f} s", flush=True)
                      if (i + 1) % 10 == 0 else None)
    ms = (time.perf_counter() - t0) * 1e3
    recs = [_report.site(s) for s in sites.values()]
    phases = {}
    for r in recs:
        for p, n in r.phases.items():
            phases[p] = phases.get(p, 0) + n
    return clip.cpu(), ms, phases, sum(r.guard_anchors for r in recs), sum(r.calls for r in recs)


def plot_trace(trace_json: str, out_png: str, title: str = "") -> None:
    """Two panels from a ``--trace-out`` file: each traced schedule's reuse error per step (mean and max
    over layers and CFG branches; anchors and dense steps are exact), and the guard's estimate against
    the true error of every reuse call."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(trace_json).read_text())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, calls in data.items():
        steps = sorted({c["step"] for c in calls})
        per = {s: [c["true"] if c["phase"] == "reuse" else 0.0 for c in calls if c["step"] == s] for s in steps}
        line, = ax1.plot(steps, [sum(v) / len(v) for v in per.values()], label=f"{label} (mean)")
        ax1.plot(steps, [max(v) for v in per.values()], ls=":", color=line.get_color(), label=f"{label} (max)")
        reuse = [c for c in calls if c["phase"] == "reuse"]
        ax2.scatter([c["true"] for c in reuse], [c["est"] for c in reuse], s=6, alpha=0.5, label=label)
    ax1.set_xlabel("denoising step")
    ax1.set_ylabel("attention output rel. L2 error vs fp32 SDPA")
    ax1.set_title("reuse error per step (layers x CFG branches)")
    ax1.legend(fontsize=7)
    hi = max(max(c["true"], c["est"]) for calls in data.values() for c in calls)
    ax2.plot([0, hi], [0, hi], color="grey", lw=0.8)
    ax2.set_xlabel("true error (all rows)")
    ax2.set_ylabel("guard estimate (16 sampled rows / head)")
    ax2.set_title("the guard's estimate, every reuse call")
    ax2.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"[guard] plot: {out_png}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", action="store_true", help="(neither flag: both)")
    ap.add_argument("--demo", action="store_true", help="(neither flag: both)")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: tiny synthetic + demo, no CSV unless --csv")
    ap.add_argument("--trace", action="store_true", help="--demo: true vs estimated error of every call")
    ap.add_argument("--thresholds", default="0.03,0.05,0.08")
    ap.add_argument("--only", default="", help="comma-separated schedule labels to run (default: all)")
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--group-size", type=int, default=128)
    # synthetic
    ap.add_argument("--kinds", default="random,structured,burst")
    ap.add_argument("--drifts", default="0.02", help="per kind (comma-separated); burst uses the last one x 3")
    ap.add_argument("--seq", type=int, default=None, help="default 8192 on CUDA, 1024 on CPU")
    ap.add_argument("--heads", type=int, default=None, help="default 8 on CUDA, 2 on CPU")
    ap.add_argument("--dim", type=int, default=None, help="default 128 on CUDA, 64 on CPU")
    # demo
    ap.add_argument("--steps", type=int, default=None, help="default 30 (synthetic), 50 (demo)")
    ap.add_argument("--frames", type=int, default=16, help="16 x 32 x 32 px: the size the demo was trained at")
    ap.add_argument("--height", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-out", default=None, help="--trace: also write every call's errors (JSON) here")
    ap.add_argument("--dense-cache", default=None, help="directory: reuse / keep the dense clip there")
    ap.add_argument("--csv", default=None, help="write rows to this CSV instead of benchmarks/results/")
    ap.add_argument("--plot", default=None, help="with --trace-out: draw it into this PNG (after the runs)")
    a = ap.parse_args(argv)
    if a.plot and not (a.synthetic or a.demo):  # only redraw an existing trace
        plot_trace(a.trace_out, a.plot)
        return []
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    gpu = device == "cuda"
    if not (a.synthetic or a.demo):
        a.synthetic = a.demo = True
    if a.smoke:  # seconds on 2 CPU cores: every code path, no numbers worth quoting
        a.kinds, a.drifts, a.thresholds = "structured,burst", "0.05", "0.03"
        a.seq, a.heads, a.dim, a.group_size = a.seq or 300, a.heads or 2, a.dim or 64, 64
        a.steps, a.frames, a.height, a.width = a.steps or 6, 2, 16, 16
        a.only = a.only or "fixed:anchor0,fixed:every3,fixed:default,guard@0.03,guard-only@0.03"
    a.seq, a.heads, a.dim = a.seq or (8192 if gpu else 1024), a.heads or (8 if gpu else 2), a.dim or (128 if gpu else 64)
    torch.set_grad_enabled(False)
    thresholds = [float(x) for x in a.thresholds.split(",") if x]
    only = {x for x in a.only.split(",") if x}
    rows = []

    def emit(r):
        rows.append(r)
        print("  " + ", ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}"
                               for k in ("variant", "rel_l2", "err_max", "anchors", "guard_anchors", "cost", "psnr")
                               if k in r), flush=True)

    if a.synthetic:
        a.steps = a.steps or 30
        for kind in a.kinds.split(","):
            drifts = [float(x) for x in a.drifts.split(",")]
            for drift in (drifts if kind != "burst" else [3 * drifts[-1]]):
                for label, opts in schedules("synthetic", thresholds):
                    if only and label not in only:
                        continue
                    errs, phases, ga, ms = run_synthetic(kind, drift, label, opts, a, device)
                    emit({"variant": f"{kind}-{drift:g}-{label}", "B": 1, "H": a.heads, "S": a.seq, "D": a.dim,
                          "density": a.density, "ms": ms, "rel_l2": sum(errs) / len(errs), "err_max": max(errs),
                          "err_last": errs[-1], "anchors": phases.get("anchor", 0), "guard_anchors": ga,
                          "cost": cost_of(phases, "guard_threshold" in opts, a.steps), "steps": a.steps,
                          "note": "errors per step: " + " ".join(f"{e:.3f}" for e in errs)})
    if a.demo:
        from vc_compile.demo.metrics import compare
        from vc_compile.demo.model import DEFAULT_PROMPT, encode, load_demo, parse_prompt

        a.steps = a.steps or 50
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        tr, te, cfg, trained = load_demo(None, device=device, dtype=dtype)
        tok = parse_prompt(DEFAULT_PROMPT, cfg.max_sprites)
        model = (tr, encode(te, tok, dtype), encode(te, torch.zeros_like(tok), dtype), dtype)
        S = cfg.tokens(a.frames, a.height, a.width)
        shape = {"B": 1, "H": cfg.num_attention_heads, "S": S, "D": cfg.attention_head_dim, "steps": a.steps}
        print(f"[guard] demo: {a.frames} x {a.height} x {a.width} px = {S} tokens, {a.steps} steps, CFG "
              f"{a.guidance}, weights {'trained' if trained else 'RANDOM'}, {device}", flush=True)
        key = f"dense_{a.frames}x{a.height}x{a.width}_{a.steps}st_g{a.guidance:g}_s{a.seed}_{device}.pt"
        cached = Path(a.dense_cache) / key if a.dense_cache else None
        if cached is not None and cached.exists():  # the dense clip of an earlier run of this script
            base, ms0 = torch.load(cached), float("nan")
            print(f"[guard] dense clip from {cached}", flush=True)
        else:
            base, ms0, _, _, _ = run_demo("dense", {"method": "dense"}, a, model)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                torch.save(base, cached)
        emit({**shape, "variant": "dense", "density": 1.0, "ms": ms0, "cost": 1.0, "psnr": float("inf")})
        for label, opts in schedules("demo", thresholds, a.steps):
            if only and label not in only:
                continue
            trace = [] if a.trace else None
            clip, ms, phases, ga, calls = run_demo(label, {"method": "mcsparse", "density": a.density,
                                                          "group_size": a.group_size, "reuse_check": False, **opts},
                                                   a, model, trace)
            m = compare(clip, base)
            note = ""
            if trace:
                te_, es = torch.tensor([t[1] for t in trace]), torch.tensor([t[2] for t in trace])
                mask = torch.tensor([t[4] == "reuse" for t in trace])
                cc = torch.corrcoef(torch.stack([te_[mask], es[mask]]))[0, 1].item() if mask.sum() > 2 else float("nan")
                note = (f"trace: {int(mask.sum())} reuse calls, true err mean {te_[mask].mean():.4f} max "
                        f"{te_[mask].max():.4f}; estimate mean {es[mask].mean():.4f} max {es[mask].max():.4f}; "
                        f"corr {cc:.3f}; per layer max true err " + " ".join(
                            f"L{layer}:{max([t[1] for t in trace if t[0] == layer]):.3f}" for layer in sorted({t[0] for t in trace})))
                print("  " + note, flush=True)
                if a.trace_out:
                    import json

                    path = Path(a.trace_out)
                    old = json.loads(path.read_text()) if path.exists() else {}
                    old[label] = [{"layer": t[0], "true": t[1], "est": t[2], "step": t[3], "phase": t[4]}
                                  for t in trace]
                    path.write_text(json.dumps(old))
            emit({**shape, "variant": label, "density": a.density, "ms": ms, "rel_l2": m["rel_l2"],
                  "cos_sim": m["cos_sim"], "psnr": m["psnr"], "ssim": m["ssim"], "anchors": phases.get("anchor", 0),
                  "guard_anchors": ga, "cost": cost_of(phases, "guard_threshold" in opts, calls), "note": note})
    if a.plot and a.trace_out:
        plot_trace(a.trace_out, a.plot, f"demo {a.frames}x{a.height}x{a.width} px, {a.steps} steps, s = "
                   f"{a.density:g}, C = {a.group_size}, {device}")
    print()
    print_table(rows, ["variant", "S", "ms", "rel_l2", "err_max", "anchors", "guard_anchors", "cost", "psnr", "ssim"])
    if a.smoke and not a.csv:
        print("[guard] smoke run: rows not written")
        return rows
    path = common.append_rows("bench_mcsparse_guard", rows, path=a.csv, extras=EXTRAS)
    print(f"[guard] appended {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
