"""``python -m vc_compile.demo``: one clip through a diffusers ``WanPipeline``, with dense attention and
with every vcattn method.

The shipped demo model (a diffusers ``WanTransformer3DModel``, latent = pixels) goes into a stock
``WanPipeline`` (``demo/pipe.py``). For each configuration the transformer is compiled exactly as the
README tells users, ``pipe.transformer = torch.compile(pipe.transformer, backend="vcattn", options=...)``
(``--regional``: ``pipe.transformer.compile_repeated_blocks(...)``), and the clip comes from
``pipe(prompt_embeds=..., negative_prompt_embeds=..., output_type="latent", ...)``: the step index and
count come from the pipeline itself, the demo never calls ``vc_compile.step``. ``{"method": "dense"}`` is
the bf16 SDPA baseline; every other method is compared with it: attention time, end-to-end time,
speed-up, and PSNR/SSIM of the final clip against the dense clip (same seed, same noise).

Default clip: the size the model was trained at (from the weights' metadata), 50 Euler steps, CFG 3. On a
GPU the model is the fidelity model (``--model fidelity``: 4 heads x 128, trained last at 21 x 60 x 104 px =
32760 tokens, Wan 2.1 480p's token count), so the clip itself is at real size; on a CPU the small demo model
(2 heads, 16 x 32 x 32 px = 4096 tokens). Writes into ``--out`` (default ``./vc_demo_out``): ``grid.png``
(rows = methods with their figures, columns = frames, a title with the settings), ``demo.mp4`` and
``demo.gif`` (methods side by side), ``results.json`` (the table and each run's vc_compile report),
``clips.pt`` (the clips).

With ``--model demo`` on a CUDA GPU the clip is followed by a real-size timing (``demo/speed.py``): one attention
layer of the Wan 2.1 1.3B configuration at 32760 tokens through every method over a 50-step schedule, against
stock SDPA (speed only, random tensors); ``--speed-tokens 0`` skips it.

Without CUDA this is a reduced run (10 steps, Inductor replaced by the rewritten graph run eagerly, the
plain-PyTorch reference kernels) and says so: it shows the mechanics and the fidelity, not the speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import time
from pathlib import Path

import torch

from vc_compile.config import merge_options
from vc_compile.methods import BASELINE_LABEL
from vc_compile.demo.speed import WAN13B

# Clip size on every device: the one the model was trained at (the weights' metadata: 16 x 32 x 32 px).
# NOTE: measured flow-matching loss of the trained model on held-out data clips (mean over frames, fp32,
# CPU, 2 clips): at t = 0.3 / 0.6: 16 x 32 x 32 0.040, 8 x 32 x 32 0.055, 6 x 32 x 32 (the old CPU
# default, whose grid showed blobs) 0.069; at t = 0.9, where the layout is decided: 16 x 32 x 32 0.094,
# 16 x 64 x 64 (the old GPU default, never trained: 64 x 64 only with 4 frames; its grid had five empty
# frames) 0.150, its first frames worst (0.18; at t = 0.3 / 0.6 it is 0.037, fine). So the reduced CPU
# run keeps the clip and cuts the steps: 10 Euler steps give the same frames as 16 (seed 0, fp32, side by
# side); 6 steps x 6 frames gave blobs.
# CFG 5 instead of 3 and seeds 1-4 gave no cleaner clip than seed 0 at CFG 3.
GPU_DEFAULTS = dict(steps=50, compiler="inductor", warmup=6)
CPU_DEFAULTS = dict(steps=10, compiler="eager", warmup=1)


def parse_args(argv=None):
    from .model import DEFAULT_PROMPT
    from .runner import known_methods

    METHODS = known_methods()

    ap = argparse.ArgumentParser(prog="python -m vc_compile.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="vc_demo_out")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu (a reduced run)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: 50; reduced CPU run: 10)")
    ap.add_argument("--frames", type=int, default=None,
                    help="default (with --height/--width): the clip size the model was trained at, 16 x 32 x 32")
    ap.add_argument("--height", type=int, default=None, help="pixels (= latent; tokens = F * H/2 * W/2)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help='e.g. "red circle right; blue square up"')
    ap.add_argument("--guidance", type=float, default=3.0, help="CFG scale (the training samples used 3)")
    ap.add_argument("--shift", type=float, default=1.0, help="flow shift of the sigma schedule (trained: 1)")
    ap.add_argument("--model", choices=("demo", "fidelity"), default=None,
                    help="demo: 2 heads, trained at 4096 tokens (the CPU default); fidelity: 4 heads, trained last at "
                         "21 x 60 x 104 px = 32760 tokens, Wan 2.1 480p's size (the GPU default)")
    ap.add_argument("--weights", default=None, help="safetensors file (default: the --model's file in "
                                                    "vc_compile/demo/weights/ of a clone of the repository; not in "
                                                    "the pip package)")
    ap.add_argument("--random-weights", action="store_true",
                    help="run untrained weights when no weights file is found (mechanics only: errors understated)")
    ap.add_argument("--methods", default=",".join(m for m, _ in METHODS),
                    help="comma-separated subset of: " + ", ".join(m for m, _ in METHODS))
    ap.add_argument("--compiler", choices=("inductor", "eager"), default=None,
                    help="what compiles the rewritten graph (default: inductor on CUDA, eager on CPU)")
    ap.add_argument("--regional", action="store_true",
                    help="compile only the repeated Wan blocks (pipe.transformer.compile_repeated_blocks): one "
                         "block graph, much faster to compile; default: torch.compile of the whole transformer")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps of the untimed warm-up generation (default: 6 on CUDA, 1 on CPU)")
    ap.add_argument("--fps", type=int, default=8, help="frame rate of demo.mp4 / demo.gif")
    ap.add_argument("--speed-tokens", type=int, default=None,
                    help="real-size timing after the clip (demo/speed.py): one Wan 2.1 1.3B attention layer at "
                         "this many tokens (default on CUDA: 32760, 480p x 81 frames; 0 = skip; CPU: skipped)")
    ap.add_argument("--speed-steps", type=int, default=50, help="steps of the real-size timing's schedule")
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
    if a.model is None:  # a GPU runs the model trained at real size, a CPU the small one
        from .model import FIDELITY_WEIGHTS
        a.model = "fidelity" if not a.reduced and FIDELITY_WEIGHTS.is_file() else "demo"
    if a.speed_tokens is None:  # the fidelity model's clip is already at real size
        a.speed_tokens = 0 if a.reduced or a.model == "fidelity" else WAN13B["tokens"]
    for k, v in (CPU_DEFAULTS if a.reduced else GPU_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    known = dict(METHODS)
    a.method_list = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in a.method_list if m not in known]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {list(known)}")
    if BASELINE_LABEL not in a.method_list:  # stock SDPA through the op: what every other method is compared with
        a.method_list.insert(0, BASELINE_LABEL)
    return a


def fmt_ms(ms) -> str:
    if ms is None:
        return "n/a"
    return f"{ms / 1e3:.1f} s" if ms >= 1e4 else f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def format_table(rows) -> str:
    head = f"{'method':<18}{'attn ms':>10}{'e2e ms':>11}{'speed-up':>10}{'PSNR dB':>9}{'SSIM':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        attn = f"{r['attn_ms']:.1f}" if r["attn_ms"] is not None else "n/a"
        lines.append(f"{r['method']:<18}{attn:>10}{r['e2e_ms']:>11.1f}{r['speedup']:>9.2f}x"
                     f"{r['psnr']:>9.2f}{r['ssim']:>8.4f}")
    return "\n".join(lines)


def grid_text(a, rows, cfg, tokens, device_name):
    """(title lines, per-row note lines) drawn on grid.png."""
    title = [f"vc_compile demo: diffusers WanPipeline, torch.compile(transformer, backend=\"vcattn\"); "
             f"trained WanTransformer3DModel ({cfg.num_layers} layers x {cfg.num_attention_heads} heads x "
             f"{cfg.attention_head_dim})",
             f"{a.frames} x {a.height} x {a.width} px = {tokens} tokens, {a.steps} Euler steps (shift {a.shift:g}), "
             f"CFG {a.guidance:g}, seed {a.seed}; prompt: {a.prompt}",
             (f"REDUCED CPU RUN ({device_name}): reference kernels, eager; times are not GPU speed"
              if a.reduced else f"{device_name}, compiler {a.compiler}"
              f"{', regional compile' if a.regional else ''}; PSNR/SSIM of each clip vs the dense clip")]
    notes = []
    for r in rows:
        timing = f"e2e {fmt_ms(r['e2e_ms'])}" + (f", attn {fmt_ms(r['attn_ms'])}" if r["attn_ms"] else "")
        if r["method"] == BASELINE_LABEL:
            notes.append(["reference: bf16 SDPA", timing])
        else:
            notes.append([f"PSNR {r['psnr']:.2f} dB  SSIM {r['ssim']:.4f}", f"{timing} ({r['speedup']:.2f}x)"])
    return title, notes


# what the demo needs beyond the package: (module, distribution) -> installed by the "demo" extra
DEMO_NEEDS = (("PIL", "pillow"), ("safetensors", "safetensors"), ("diffusers", "diffusers"))


def check_demo_deps() -> None:
    """A clear exit, naming the fix, when a package of the ``demo`` extra is missing (a plain ``pip install
    vc_compile`` has none of them): not a raw ModuleNotFoundError from deep inside the demo."""
    import importlib.util
    missing = [dist for mod, dist in DEMO_NEEDS if importlib.util.find_spec(mod) is None]
    if missing:
        raise SystemExit(f"vc_compile demo: missing {', '.join(missing)}; install the demo extra: "
                         f"pip install 'vc_compile[demo]' (in a checkout: pip install -e '.[demo]', or "
                         f"bash tools/setup.sh)")


def main(argv=None):
    a = parse_args(argv)
    check_demo_deps()
    from .media import VideoEncoderMissing, write_gif, write_grid, write_mp4
    from .metrics import compare
    from .model import DemoWeightsMissing, encode, load_demo, parse_prompt
    from .pipe import build_pipeline
    from .runner import known_methods, run_pipeline, vc_api

    METHODS = known_methods()

    vc_api()  # fail early, with a clear message, when the backend is missing
    device, dtype = torch.device(a.device), torch.bfloat16
    try:
        transformer, text_encoder, cfg, trained = load_demo(a.weights or a.model, device=device, dtype=dtype,
                                                            allow_random=a.random_weights)
    except DemoWeightsMissing as e:
        raise SystemExit(str(e)) from None
    for k in ("frames", "height", "width"):  # GPU default: the clip size the model was trained at
        if getattr(a, k) is None:
            setattr(a, k, getattr(cfg, k))
    tokens = cfg.tokens(a.frames, a.height, a.width)
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"CPU, {torch.get_num_threads()} threads")
    print(f"[vc_demo] model: WanTransformer3DModel, {cfg.num_layers} layers x {cfg.num_attention_heads} heads x "
          f"head dim {cfg.attention_head_dim}, trained at {cfg.frames} x {cfg.height} x {cfg.width} px; weights: "
          f"{'trained' if trained else 'RANDOM (asked for; errors understated)'}")
    if a.reduced:
        print(f"[vc_demo] *** REDUCED CPU RUN: no CUDA, so {a.steps} steps (GPU: 50), Inductor replaced by eager "
              "and the plain-PyTorch reference kernels. Times here say nothing about GPU speed; fidelity "
              "numbers are real. ***")
    print(f"[vc_demo] clip {a.frames} x {a.height} x {a.width} px = {tokens} tokens, {a.steps} steps, "
          f"CFG {a.guidance} (2 calls/step), seed {a.seed}, {device_name}, compiler {a.compiler}"
          f"{', regional compile' if a.regional else ''}")
    print(f"[vc_demo] prompt: {a.prompt}")
    cond = encode(text_encoder, parse_prompt(a.prompt, cfg.max_sprites), dtype)
    uncond = encode(text_encoder, parse_prompt("", cfg.max_sprites), dtype)
    pipe = build_pipeline(transformer, a.steps, a.shift)
    extra = merge_options({"experimental": {"compiler": a.compiler}}, a.options)
    if tokens < 1024:
        extra["min_seq_len"] = tokens  # the backend's default leaves short attention to stock SDPA

    known, results = dict(METHODS), []
    print(f"[vc_demo] {len(a.method_list)} clips ({', '.join(a.method_list)}); expect "
          f"{'3-5 minutes on 2 CPU cores' if a.reduced else 'about 3 minutes on an H100 / H200'} in all; an estimate "
          "from this machine's own pace follows each clip", flush=True)
    t_all = time.perf_counter()
    for i, label in enumerate(a.method_list):
        if i:
            per = (time.perf_counter() - t_all) / i
            left = len(a.method_list) - i
            print(f"[vc_demo] {i} of {len(a.method_list)} clips in {time.perf_counter() - t_all:.0f} s; about "
                  f"{per * left:.0f} s left for the clips", flush=True)
        print(f"[vc_demo] {label}: compiling and warming up ({a.warmup} steps) ...", flush=True)
        res = run_pipeline(pipe, cond, uncond, label, merge_options(known[label], extra), frames=a.frames,
                           height=a.height, width=a.width, steps=a.steps, seed=a.seed, guidance=a.guidance,
                           shift=a.shift, warmup=a.warmup, regional=a.regional)
        print(f"  {label}: {res.summary}", flush=True)
        results.append(res)
    wall_s = time.perf_counter() - t_all

    dense = results[0]
    rows = []
    for r in results:
        m = compare(r.clip, dense.clip)
        rows.append({"method": r.label, "options": r.options, "attn_ms": r.attn_ms, "e2e_ms": r.e2e_ms,
                     "speedup": dense.e2e_ms / r.e2e_ms, "warmup_s": r.warmup_s, **m, "summary": r.summary})
    print()
    print(format_table(rows))
    slower = [r["method"] for r in rows[1:] if r["speedup"] < 1.0]
    if slower and not a.reduced and tokens < WAN13B["tokens"]:
        print(f"[vc_demo] {', '.join(slower)}: slower than dense on this clip because the clip is small "
              f"({tokens} tokens x {cfg.num_attention_heads} heads): it runs every method's kernels past the speed "
              "gate to measure fidelity, where a compiled model would keep such calls on stock SDPA "
              "(speed_gate='auto'); the speed is in the real-size timing below.")
    print(f"[vc_demo] wall time, all methods with compile and warm-up: {wall_s:.0f} s")
    if not trained:
        print("[vc_demo] WARNING: random weights -> near-uniform attention -> errors above are understated.")
    if a.reduced:
        print("[vc_demo] (reduced CPU run: times are reference-path times, not kernel speed)")

    speed = []
    if a.speed_tokens > 0:  # what the small clip cannot show: the attention of a real-size model
        from .speed import format_speed, time_methods
        print(f"[vc_demo] real-size timing: one Wan 2.1 1.3B attention layer at {a.speed_tokens} tokens ...",
              flush=True)
        speed = time_methods([(m, known[m]) for m in a.method_list], heads=WAN13B["heads"], tokens=a.speed_tokens,
                             head_dim=WAN13B["head_dim"], steps=a.speed_steps, device=device,
                             extra={"experimental": {"compiler": a.compiler}, **a.options})
        print()
        print(format_speed(speed, heads=WAN13B["heads"], tokens=a.speed_tokens, head_dim=WAN13B["head_dim"],
                           steps=a.speed_steps, device_name=device_name))

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    clips, labels = [r.clip[0] for r in results], [r.label for r in results]
    title, notes = grid_text(a, rows, cfg, tokens, device_name)
    # the animations carry each clip's figures too: PSNR against the dense clip and, on a GPU, the speed-up
    shown = [r["method"] if r["method"] == BASELINE_LABEL else f"{r['method']} {r['psnr']:.1f} dB"
             + ("" if a.reduced else f" {r['speedup']:.2f}x") for r in rows]
    written = [write_grid(out / "grid.png", clips, labels, notes=notes, title=title),
               write_gif(out / "demo.gif", clips, shown, fps=a.fps)]
    mp4_problem = None
    try:
        written.append(write_mp4(out / "demo.mp4", clips, shown, fps=a.fps))
    except VideoEncoderMissing as e:
        mp4_problem = str(e)
        print(f"[vc_demo] MP4 NOT WRITTEN: {e}. grid.png and demo.gif are written.")
    info = {"args": {k: v for k, v in vars(a).items()}, "trained_weights": trained, "tokens": tokens,
            "wall_s": round(wall_s, 1), "rows": rows, "mp4": mp4_problem or "written",
            "real_size_speed": [dataclasses.asdict(r) for r in speed],
            "env": {"device": device_name, "torch": torch.__version__, "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
            "reports": {r.label: r.report.to_dict() for r in results if hasattr(r.report, "to_dict")}}
    (out / "results.json").write_text(json.dumps(_json_safe(info), indent=1, default=str, allow_nan=False))
    torch.save({r.label: r.clip for r in results}, out / "clips.pt")  # [1, 3, F, H, W] in [-1, 1] each
    written += [out / "results.json", out / "clips.pt"]
    print(f"[vc_demo] wrote {', '.join(str(p) for p in written)}")
    return rows


def _json_safe(x):
    """``x`` with every non-finite float as the string "inf" / "-inf" / "nan" (JSON has no such numbers: the
    dense row's PSNR against itself is +inf)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


if __name__ == "__main__":
    main()
