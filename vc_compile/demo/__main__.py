"""``python -m vc_compile.demo``: one clip, generated with dense attention and with every vcattn method.

Loads the shipped demo model (``vc_compile/demo/weights``; random weights, with a loud warning, when
the file is absent), then for each configuration compiles it with
``torch.compile(transformer, backend="vcattn", options=...)`` and runs the flow-matching Euler sampler
(classifier-free guidance: two model calls per step, as in diffusers' WanPipeline) under
``vc_compile.sampling``/``vc_compile.step``. ``{"method": "dense"}`` is the bf16 SDPA baseline; every
other method is compared with it: attention time, end-to-end time, speed-up, and PSNR/SSIM of the
final clip against the dense clip (same seed, same noise).

Writes into ``--out`` (default ``./vc_demo_out``): ``grid.png`` (rows = methods, columns = frames),
``demo.gif`` (methods side by side), ``results.json`` (the table and each run's vc_compile report).

On a machine without CUDA this is a reduced run (6 steps, 6 x 32 x 32 pixels = 1536 tokens, Inductor
replaced by the rewritten graph run eagerly, the plain-PyTorch reference kernels): it shows the
mechanics and the fidelity, not the speed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from vc_compile.config import merge_options

GPU_DEFAULTS = dict(steps=50, frames=16, height=64, width=64, compiler="inductor", warmup=6)
# NOTE: 6 steps x 6 x 32 x 32 px (1536 tokens) keeps the CPU run to minutes: 8 steps at 8 x 32 x 32
# took 190 s for V-Smooth alone (the reference path) on a loaded 2-core machine.
CPU_DEFAULTS = dict(steps=6, frames=6, height=32, width=32, compiler="eager", warmup=1)


def parse_args(argv=None):
    from .model import DEFAULT_PROMPT
    from .runner import METHODS

    ap = argparse.ArgumentParser(prog="python -m vc_compile.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="vc_demo_out")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--height", type=int, default=None, help="pixels (= latent; tokens = F * H/2 * W/2)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help='e.g. "red circle right; blue square up"')
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--shift", type=float, default=1.0, help="flow shift of the sigma schedule")
    ap.add_argument("--weights", default=None, help="safetensors file (default: the shipped weights)")
    ap.add_argument("--methods", default=",".join(m for m, _ in METHODS),
                    help="comma-separated subset of: " + ", ".join(m for m, _ in METHODS))
    ap.add_argument("--compiler", choices=("inductor", "eager"), default=None,
                    help="what compiles the rewritten graph (default: inductor on CUDA, eager on CPU)")
    ap.add_argument("--regional", action="store_true",
                    help="compile only the repeated Wan blocks (transformer.compile_repeated_blocks): one block "
                         "graph, much faster to compile; default: torch.compile of the whole transformer")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps of the untimed warm-up generation (default: 6 on CUDA, 1 on CPU)")
    ap.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                    help="a vcattn option for every method, e.g. --set rope_fusion=false (value read as JSON, "
                         "else as a string); repeatable")
    a = ap.parse_args(argv)
    a.options = {}
    for item in a.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            ap.error(f"--set expects OPTION=VALUE, got {item!r}")
        try:
            a.options[key] = json.loads(raw)
        except ValueError:
            a.options[key] = raw
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.reduced = not a.device.startswith("cuda")
    for k, v in (CPU_DEFAULTS if a.reduced else GPU_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    known = dict(METHODS)
    a.method_list = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in a.method_list if m not in known]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {list(known)}")
    if "dense" not in a.method_list:
        a.method_list.insert(0, "dense")  # the reference every other method is compared with
    return a


def _progress(label: str):
    tty = sys.stdout.isatty()

    def cb(i, n, seconds):
        msg = f"  {label:<16} step {i + 1:3d}/{n}  {seconds:7.2f} s"
        if tty:
            print("\r" + msg, end="\n" if i + 1 == n else "", flush=True)
        elif (i + 1) % max(1, n // 10) == 0 or i + 1 == n:
            print(msg, flush=True)

    return cb


def format_table(rows) -> str:
    head = f"{'method':<18}{'attn ms':>10}{'e2e ms':>11}{'speed-up':>10}{'PSNR dB':>9}{'SSIM':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        attn = f"{r['attn_ms']:.1f}" if r["attn_ms"] is not None else "n/a"
        lines.append(f"{r['method']:<18}{attn:>10}{r['e2e_ms']:>11.1f}{r['speedup']:>9.2f}x"
                     f"{r['psnr']:>9.2f}{r['ssim']:>8.4f}")
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    from .media import write_gif, write_grid
    from .metrics import compare
    from .model import encode, load_demo, parse_prompt
    from .runner import METHODS, compile_full, compile_regional, run_config, vc_api

    vc_api()  # fail early, with a clear message, when the backend is missing
    device, dtype = torch.device(a.device), torch.bfloat16
    transformer, text_encoder, cfg, trained = load_demo(a.weights, device=device, dtype=dtype)
    tokens = cfg.tokens(a.frames, a.height, a.width)
    print(f"[vc_demo] model: WanTransformer3DModel, {cfg.num_layers} layers x {cfg.num_attention_heads} heads x "
          f"head dim {cfg.attention_head_dim}; weights: {'trained' if trained else 'RANDOM (errors understated)'}")
    if a.reduced:
        print("[vc_demo] *** REDUCED CPU RUN: no CUDA, so a small clip, few steps and the plain-PyTorch reference "
              "kernels. Times here say nothing about GPU speed; fidelity numbers are real. ***")
    print(f"[vc_demo] clip {a.frames} x {a.height} x {a.width} px = {tokens} tokens, {a.steps} steps, "
          f"CFG {a.guidance} (2 calls/step), seed {a.seed}, device {device}, compiler {a.compiler}"
          f"{', regional compile' if a.regional else ''}")
    print(f"[vc_demo] prompt: {a.prompt}")
    cond = encode(text_encoder, parse_prompt(a.prompt, cfg.max_sprites), dtype)
    uncond = encode(text_encoder, parse_prompt("", cfg.max_sprites), dtype)
    extra = merge_options({"experimental": {"compiler": a.compiler}}, a.options)
    if tokens < 1024:
        extra["min_seq_len"] = tokens  # the backend's default leaves short attention to stock SDPA

    known, results = dict(METHODS), []
    for label in a.method_list:
        print(f"[vc_demo] {label}: compiling and warming up ({a.warmup} steps) ...", flush=True)
        res = run_config(transformer, cond, uncond, label, merge_options(known[label], extra), frames=a.frames,
                         height=a.height, width=a.width, steps=a.steps, seed=a.seed, guidance=a.guidance,
                         shift=a.shift, dtype=dtype, warmup=a.warmup, progress=_progress(label),
                         compile_fn=compile_regional if a.regional else compile_full)
        print(f"  {label}: {res.summary}")
        results.append(res)

    dense = results[0]
    rows = []
    for r in results:
        m = compare(r.clip, dense.clip)
        rows.append({"method": r.label, "options": r.options, "attn_ms": r.attn_ms, "e2e_ms": r.e2e_ms,
                     "speedup": dense.e2e_ms / r.e2e_ms, **m, "summary": r.summary})
    print()
    print(format_table(rows))
    if not trained:
        print("[vc_demo] WARNING: random weights -> near-uniform attention -> errors above are understated.")
    if a.reduced:
        print("[vc_demo] (reduced CPU run: times are reference-path times, not kernel speed)")

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    clips, labels = [r.clip[0] for r in results], [r.label for r in results]
    write_grid(out / "grid.png", clips, labels)
    write_gif(out / "demo.gif", clips, labels)
    info = {"args": {k: v for k, v in vars(a).items()}, "trained_weights": trained, "tokens": tokens,
            "rows": rows, "reports": {r.label: r.report.to_dict() for r in results if hasattr(r.report, "to_dict")}}
    (out / "results.json").write_text(json.dumps(info, indent=1, default=str))
    print(f"[vc_demo] wrote {out / 'grid.png'}, {out / 'demo.gif'}, {out / 'results.json'}")
    return rows


if __name__ == "__main__":
    main()
