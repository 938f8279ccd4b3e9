"""End-to-end benchmark: the demo video DiT at ~32K and ~75K tokens, 50 steps, every vcattn method.

    python -m benchmarks.bench_e2e                 # H200: both sizes, 50 steps (several minutes)
    python -m benchmarks.bench_e2e --quick         # 32K tokens only, 20 steps
    python -m benchmarks.bench_e2e --sizes 75k --csv $OUT/bench_e2e.csv
    python -m benchmarks.bench_e2e --sizes 16k --ladder --csv $OUT/bench_e2e.csv   # MC-Sparse ablation

Sizes mirror Wan 2.1's token counts (patch (1, 2, 2) on pixels): ``32k`` = 21 x 60 x 104 px =
21 * 30 * 52 = 32760 tokens (Wan 480p), ``75k`` = 21 x 90 x 160 px = 21 * 45 * 80 = 75600 tokens (Wan
720p). The model was trained on 4096-token clips (16 x 32 x 32 and 4 x 64 x 64), so at these sizes its
RoPE extrapolates and the samples are not pretty; the attention is still the trained, non-uniform one,
which is what the fidelity numbers need.

Per size: each method with its default step schedule (``runner.known_methods()``), compiled with
``backend="vcattn"`` (Inductor) and timed after a warm-up; CFG 2 calls per step (B = 1 per call).
Fidelity of the final clip against the dense bf16 run (same seed, same noise): PSNR, SSIM, relative
L2, cosine. Noise floor: ``floor:bf16-vs-fp32`` (the dense bf16 clip against an eager fp32 run, TF32
off) and ``floor:seed-to-seed`` (dense bf16, seed vs seed + 1: two unrelated clips).
SDPA prefers cuDNN in every run (``sdpa_kernel(..., set_priority=True)``), so ``speedup_vs_cudnn`` is
end-to-end time of the dense cuDNN run over the method's. ``--peers torchao-fp8``: torchao's FP8 attention
(``apply_low_precision_attention`` around the transformer, then Inductor), where it imports.

``--weights fidelity``: the fidelity model (4 heads, trained last at 32760 tokens). With ``--attention`` (on by
default on CUDA), rows in ``bench_e2e_attention.csv`` too: ``mass`` rows, the top-15% key mass of every layer
and head at a few steps of the dense sampling run (``capture.mass_by_step``), and ``attn`` rows, each variant's
attention on the inputs one layer received at every step of the dense run (``capture.errors_by_phase``: the
method's real schedule over those inputs) against fp32 attention, median and max rel. L2 by phase.
``--grid PATH`` writes the clips side by side (``media.write_grid``) with their PSNR.

``--ladder``: dense + the MC-Sparse ablation ladder (``runner.LADDER``, the paper's Table 5: mean-pooled
block-sparse -> exact selection reused -> token level -> + PDDP query grouping -> + residual) at each of
``--densities`` (default 0.15, 0.25); rows get ``bench = e2e_ladder``. Each rung's PSNR/SSIM is printed as
soon as it finishes.

Appends rows to ``benchmarks/results/bench_e2e.csv`` (header written only when the file is created), each
as soon as its run finishes (a run stopped by a time limit keeps its finished rows):
``ms`` is the end-to-end sampling time, ``tflops`` the self-attention FLOPs (4 B H S^2 D per call; dense
FLOPs for sparse methods, i.e. "effective") over the profiled attention time.
"""
from __future__ import annotations

import argparse
import time
from statistics import median
from pathlib import Path

import torch

from benchmarks.common import append_csv, env_info, prefer_cudnn, torchao_fp8_fn, torchao_fp8_status
from vc_compile.config import merge_options
from vc_compile.demo.metrics import compare
from vc_compile.demo.model import DEFAULT_PROMPT, encode, load_demo, parse_prompt, resolve_weights
from vc_compile.demo.runner import (known_methods, compile_full, compile_regional, ladder_methods,
                                    run_config)
from vc_compile.demo.sampler import print_progress, sample

ROOT = Path(__file__).resolve().parents[1]

SIZES = {"32k": (21, 60, 104), "75k": (21, 90, 160), "16k": (16, 64, 64), "4k": (16, 32, 32),
         "1k": (4, 32, 32)}  # 1k: a CPU check of this script
HEADER = ["date", "commit", "gpu", "torch", "triton", "bench", "variant", "B", "H", "S", "D", "density", "ms",
          "tflops", "speedup_vs_cudnn", "rel_l2", "cos_sim", "psnr", "ssim",
          # extra columns (after the agreed ones)
          "attn_ms", "steps", "frames", "height", "width", "guidance", "seed", "weights", "warmup_s", "phases"]


def fp32_reference(weights, cond_tokens, device, **kw):
    """The dense clip in fp32, eager (no compile), TF32 off: the precision noise floor's reference."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        tr, te, _, _ = load_demo(weights, device=device, dtype=torch.float32)
        cond = encode(te, cond_tokens, torch.float32)
        uncond = encode(te, torch.zeros_like(cond_tokens), torch.float32)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        clip = sample(tr, cond, uncond=uncond, dtype=torch.float32, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clip.cpu(), (time.perf_counter() - t0) * 1e3
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def peer_compile(cfn):
    """A ``compile_fn`` for torchao's FP8 attention: its wrapper around the transformer, then Inductor (regional
    compile in place under the wrapper, as bench_pipeline does). The wrapper sets Inductor's pre-grad pass, a
    global: ``compile_fn.restore()`` puts the previous one back."""
    import torch._inductor.config as ic
    prev = ic.pre_grad_custom_pass

    def compile_fn(transformer, backend, options):
        from torchao.prototype.attention import apply_low_precision_attention
        wrapped = apply_low_precision_attention(transformer)
        if cfn is compile_regional:
            transformer.compile_repeated_blocks()
            return wrapped
        return torch.compile(wrapped)
    compile_fn.restore = lambda: setattr(ic, "pre_grad_custom_pass", prev)
    return compile_fn


def attention_rows(tr, cond, uncond, cfg, kw, labels, known, peers, a, common, path):
    """``mass`` and ``attn`` rows (module docstring) into ``bench_e2e_attention.csv`` beside ``path``."""
    from vc_compile.demo.capture import capture_run, errors_by_phase, mass_by_step
    out, steps = path.with_name("bench_e2e_attention.csv"), kw["steps"]
    layer = cfg.num_layers // 2
    size = {k: kw[k] for k in ("frames", "height", "width")}
    at = sorted({0, steps // 5, steps // 2, (4 * steps) // 5, steps - 1})
    rows = [{**common, "variant": "mass", "layer": m["layer"], "step": m["step"], "head": h, "top15_mass": round(x, 4)}
            for m in mass_by_step(tr, cond, uncond, num_steps=steps, at_steps=at, seed=a.seed, guidance=a.guidance,
                                  **size) for h, x in enumerate(m["top15pct_mass_heads"])]
    print(f"  top-15% key mass, median over (layer, head, step): {median(r['top15_mass'] for r in rows):.3f}")
    kept = capture_run(tr, cond, uncond, num_steps=steps, layers={layer}, steps=set(range(steps)), seed=a.seed,
                       guidance=a.guidance, **size)
    captured = [tuple(rec[n].to(tr.device) for n in "qkv") for rec in sorted(kept, key=lambda r: r["step"])]
    for label in labels:
        if label in peers:
            method = lambda q, k, v: torchao_fp8_fn(q, k, v)()  # noqa: E731
        elif label == "dense":
            method = torch.nn.functional.scaled_dot_product_attention
        else:
            method = merge_options(known[label], {"speed_gate": "off"})
        errs = errors_by_phase(captured, method, seed=a.seed)
        for phase in dict.fromkeys(e["phase"] for e in errs):
            v = [e["rel_l2"] for e in errs if e["phase"] == phase]
            rows.append({**common, "variant": f"attn:{label}", "layer": layer, "phase": phase, "n": len(v),
                         "rel_l2": round(median(v), 6), "rel_l2_max": round(max(v), 6)})
            print(f"  attention {label} {phase}: {len(v)} steps, rel. L2 median {median(v):.2e} max {max(v):.2e}")
    append_csv(str(out), rows, columns=[*HEADER[:17], "layer", "step", "phase", "head", "n", "top15_mass",
                                         "rel_l2_max", "frames", "height", "width", "steps", "weights"])


def _x(v) -> str:
    return f"{v:.2f}x" if isinstance(v, float) else "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="32k only, 20 steps")
    ap.add_argument("--sizes", default=None, help=f"comma-separated, from {list(SIZES)} (default 32k,75k)")
    ap.add_argument("--steps", type=int, default=None, help="default 50 (20 with --quick)")
    ap.add_argument("--methods", default=",".join(m for m, _ in known_methods()))
    ap.add_argument("--ladder", action="store_true",
                    help="dense + the MC-Sparse ablation ladder at --densities (instead of --methods)")
    ap.add_argument("--densities", default="0.15,0.25", help="densities of the --ladder rungs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--warmup", type=int, default=6, help="steps of the untimed warm-up generation")
    ap.add_argument("--no-floor", action="store_true", help="skip the fp32 and seed-to-seed runs")
    ap.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    ap.add_argument("--regional", action="store_true",
                    help="compile_repeated_blocks instead of the whole transformer (faster compiles)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "bench_e2e.csv"))
    ap.add_argument("--peers", default=None, help="torchao-fp8 (default on CUDA) or ''")
    ap.add_argument("--attention", action=argparse.BooleanOptionalAction, default=None,
                    help="attention mass and per-phase error rows (default on CUDA)")
    ap.add_argument("--grid", default=None, help="write the clips with their PSNR into this PNG")
    a = ap.parse_args(argv)
    sizes = (a.sizes or ("32k" if a.quick else "32k,75k")).split(",")
    steps = a.steps or (20 if a.quick else 50)
    known = dict(known_methods())
    # A/B, not in the default --methods: MC-Sparse's earlier metadata (key by key, bf16 residual) and runs of 8 keys
    # whether or not the memory plan needs them (docs/design/mcsparse-metadata-format.md)
    known["mcsparse@0.15:tokens-bf16"] = {"method": "mcsparse", "density": 0.15, "key_run": 1, "residual": "bf16"}
    known["mcsparse@0.15:runs8"] = {"method": "mcsparse", "density": 0.15, "key_run": 8}
    cfn = compile_regional if a.regional else compile_full
    labels = ["dense"] + [m for m in a.methods.split(",") if m and m != "dense"]
    bench = "e2e"
    if a.ladder:
        ladder = ladder_methods([float(d) for d in a.densities.split(",") if d])
        known.update(ladder)
        labels = ["dense"] + [lab for lab, _ in ladder]
        bench = "e2e_ladder"
    unknown = [m for m in labels if m not in known]
    if unknown:
        raise SystemExit(f"[bench_e2e] unknown methods {unknown}; known: {sorted(known)}")
    t_start = time.perf_counter()
    device, dtype = torch.device(a.device), torch.bfloat16
    cuda = device.type == "cuda"
    peers = [p for p in (a.peers if a.peers is not None else "torchao-fp8" if cuda else "").split(",") if p]
    if peers and torchao_fp8_status()[0] is None:
        print(f"[bench_e2e] {torchao_fp8_status()[1]}", flush=True)
        peers = []
    labels += peers
    if device.type != "cuda":
        print("[bench_e2e] WARNING: no CUDA: reference paths, times are meaningless", flush=True)
    env = env_info()
    tr, te, cfg, trained = load_demo(a.weights, device=device, dtype=dtype)
    tokens = parse_prompt(a.prompt, cfg.max_sprites)
    cond, uncond = encode(te, tokens, dtype), encode(te, torch.zeros_like(tokens), dtype)
    H, D = cfg.num_attention_heads, cfg.attention_head_dim
    rows = []
    path = Path(a.csv)
    path.parent.mkdir(parents=True, exist_ok=True)

    def append(row):
        """Each row goes to the CSV as soon as its run finishes: a run cut short by a time limit keeps
        the rows it finished."""
        rows.append(row)
        append_csv(str(path), [row], columns=HEADER)  # + the GPU columns (benchmarks/common.py)

    for size in sizes:
        F_, Hpx, Wpx = SIZES[size]
        S = cfg.tokens(F_, Hpx, Wpx)
        calls = steps * 2 * cfg.num_layers  # CFG: 2 forwards per step
        flops = 4.0 * H * S * S * D * calls
        print(f"[bench_e2e] {size}: {F_} x {Hpx} x {Wpx} px = {S} tokens, {steps} steps, weights "
              f"{'trained' if trained else 'RANDOM'}", flush=True)
        kw = dict(frames=F_, height=Hpx, width=Wpx, steps=steps, seed=a.seed, guidance=a.guidance, shift=1.0)
        common = {**env, "bench": bench, "B": 1, "H": H, "S": S, "D": D, "steps": steps, "frames": F_,
                  "height": Hpx, "width": Wpx, "guidance": a.guidance, "seed": a.seed,
                  "weights": resolve_weights(a.weights).stem if trained else "random"}
        results = {}
        with prefer_cudnn():
            for label in labels:
                opts = merge_options(known.get(label, {}), {"experimental": {"compiler": a.compiler}})
                fn = peer_compile(cfn) if label in peers else cfn
                r = run_config(tr, cond, uncond, label, opts, dtype=dtype, warmup=a.warmup, compile_fn=fn,
                               progress=print_progress(f"{size} {label}", every=max(1, steps // 5)), **kw)
                getattr(fn, "restore", lambda: None)()
                results[label] = r
                base = results["dense"]
                m = compare(r.clip, base.clip)
                phases = " ".join(f"{k}:{v}" for k, v in sorted(r.report.phase_counts().items())) if r.report else ""
                append({**common, "variant": label, "density": r.options.get("density", ""),
                        "ms": round(r.e2e_ms, 2),
                        "tflops": round(flops / (r.attn_ms * 1e-3) / 1e12, 1) if r.attn_ms else "",
                        "speedup_vs_cudnn": round(base.e2e_ms / r.e2e_ms, 3),
                        **{k: round(v, 6) for k, v in m.items()},
                        "attn_ms": round(r.attn_ms, 2) if r.attn_ms is not None and label not in peers else "",
                        "warmup_s": round(r.warmup_s, 1), "phases": phases})
                print(f"  {label}: e2e {r.e2e_ms:.0f} ms, attention {r.attn_ms or 0:.0f} ms, "
                      f"warm-up {r.warmup_s:.0f} s, PSNR {m['psnr']:.2f} dB, SSIM {m['ssim']:.4f} "
                      f"[{time.perf_counter() - t_start:.0f} s elapsed]; {r.summary}", flush=True)
            if not a.no_floor:
                floor = {**common, "density": "", "tflops": "", "speedup_vs_cudnn": "", "attn_ms": "",
                         "warmup_s": "", "phases": ""}
                torch._dynamo.reset()
                clip32, ms32 = fp32_reference(a.weights, tokens, device, **kw)
                m = compare(results["dense"].clip, clip32)
                append({**floor, "variant": "floor:bf16-vs-fp32", "ms": round(ms32, 2),
                        **{k: round(v, 6) for k, v in m.items()}})
                r2 = run_config(tr, cond, uncond, "dense", merge_options(known["dense"],
                                                                         {"experimental": {"compiler": a.compiler}}),
                                dtype=dtype, warmup=1, compile_fn=cfn, **{**kw, "seed": a.seed + 1})
                m = compare(r2.clip, results["dense"].clip)
                append({**floor, "variant": "floor:seed-to-seed", "ms": round(r2.e2e_ms, 2),
                        **{k: round(v, 6) for k, v in m.items()}})
                print(f"  floors: bf16-vs-fp32 {rows[-2]['psnr']:.2f} dB, seed-to-seed {rows[-1]['psnr']:.2f} dB "
                      f"[{time.perf_counter() - t_start:.0f} s elapsed]", flush=True)
            if a.grid:
                from vc_compile.demo.media import write_grid
                notes = [[f"PSNR {compare(r.clip, results['dense'].clip)['psnr']:.2f} dB",
                          f"{results['dense'].e2e_ms / r.e2e_ms:.2f}x dense"] for r in results.values()]
                write_grid(a.grid, [r.clip[0] for r in results.values()], list(results), notes=notes,
                           title=[f"{cfg.num_layers} x {H} heads, {F_} x {Hpx} x {Wpx} px = {S} tokens, {steps} steps, "
                                  f"CFG {a.guidance:g}, {env['gpu']}"])
            if a.attention if a.attention is not None else cuda:
                attention_rows(tr, cond, uncond, cfg, kw, labels, known, peers, a, common, path)

    print()
    head = f"{'S':>6} {'variant':<30}{'e2e ms':>10}{'attn ms':>10}{'TFLOP/s':>9}{'speed-up':>9}{'PSNR':>8}{'SSIM':>8}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['S']:>6} {r['variant']:<30}{r['ms']:>10.1f}{str(r['attn_ms']):>10}{str(r['tflops']):>9}"
              f"{_x(r['speedup_vs_cudnn']):>9}{r['psnr']:>8.2f}{r['ssim']:>8.4f}")
    if not trained:
        print("[bench_e2e] WARNING: RANDOM weights: attention near uniform, errors understated")
    print(f"[bench_e2e] appended {len(rows)} rows to {path} ({time.perf_counter() - t_start:.0f} s in all)")
    return rows


if __name__ == "__main__":
    main()
