"""Train the demo video DiT with flow matching on synthetic sprite clips, within a time budget.

    python -m vc_compile.demo.train --minutes 6 --out train_out          # one H200, ~7 min in all
    python -m vc_compile.demo.train --preset fidelity --out train_out    # the fidelity model: one H100, ~8 min
    python -m vc_compile.demo.train --smoke --out /tmp/smoke             # CPU check, 1-2 minutes

``--preset fidelity``: 4 heads, 3 layers, FFN 1024, camera pans, a main phase on 21 x 32 x 32 and 5 x 60 x 104 px,
then a last phase (``--final``, its own time budget and EMA) on 21 x 60 x 104 px = 32760 tokens, eager, int8
storage. The rest of this text describes the demo preset.

What it does: the Wan model of ``model.py`` (6.1M parameters) learns to predict the velocity
``noise - x_0`` of rectified flow on RGB clips from ``data.py``, alternating two sizes of 4096 tokens
each (``--buckets``: 16 x 32 x 32 for time, 4 x 64 x 64 for space, so RoPE has seen the distances of
the demo's 16 x 64 x 64 clips), with logit-normal t, 10% of the prompts dropped for classifier-free
guidance, AdamW, linear warm-up then cosine decay, an EMA of the weights, bf16 autocast, and on CUDA a
regional ``torch.compile`` (default Inductor) of the Wan blocks (``compile_repeated_blocks``: one
graph for all 6 layers, static per size).

Cost: ~0.43 TFLOP of matmul per clip (fwd + bwd; 73% of it attention at 4096 tokens), so a batch of
32 clips is ~13.6 TFLOP: compute-bound, not latency-bound, at roughly 10-20 it/s on one H200.

Time budget: ``--minutes`` covers the training loop including compilation. After a short probe
(iterations 20-60) the script fixes the total iteration count from the measured speed, so the LR
schedule is a normal iteration-based cosine; the count is printed and saved, and ``--iters N``
reproduces a run exactly (same seed, same data, same schedule; GPU kernels may still differ in the
last bits). Evaluation and sampling afterwards take well under a minute on a GPU.

Writes into ``--out``: ``vc_demo_wan_2x128_6l.safetensors`` (fp16, ~12 MB: the EMA or the raw
weights, whichever has the lower validation loss), ``train_stats.json`` (config, arguments, loss
curve, validation loss per t, attention statistics of the trained vs a random model, timings),
``samples.png`` (rows: a data clip, then the model's sample for the same prompt, 16 x 32 x 32),
``samples_large.png`` (the same prompts at 16 x 64 x 64) and ``train_log.txt`` (the progress lines).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import make_batch, render, sample_params, tokens_from_params
from .model import (DEFAULT_WEIGHTS, FIDELITY_CONFIG, FIDELITY_WEIGHTS, DemoConfig, SpriteTextEncoder,
                    build_transformer, describe_tokens, load_demo, save_weights)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the vc_compile demo video DiT (flow matching).")
    ap.add_argument("--minutes", type=float, default=None,
                    help="time budget of the training loop (demo 6; fidelity 4.5 before its last phase)")
    ap.add_argument("--iters", type=int, default=None, help="exact iteration count (overrides --minutes)")
    ap.add_argument("--out", default="vc_demo_train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=None, help="peak LR (demo 4e-4, fidelity 3e-4)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--p-uncond", type=float, default=0.1, help="prompt dropout for CFG")
    ap.add_argument("--buckets", default=None,
                    help="clip sizes FxHxW (pixels), cycled per iteration; the first is the reference size "
                         "(validation, samples.png). 4x64x64 (also 4096 tokens) teaches RoPE distances up to "
                         "32 tokens in height/width, so the model runs at the demo/benchmark sizes; fidelity: "
                         "21x32x32,5x60x104, every distance of its last phase's 21 x 30 x 52 tokens")
    ap.add_argument("--layers", type=int, default=None, help=f"default {DemoConfig.num_layers} (preset fidelity: "
                    f"{FIDELITY_CONFIG.num_layers})")
    ap.add_argument("--heads", type=int, default=None, help="attention heads of 128 channels (demo 2, fidelity 4)")
    ap.add_argument("--ffn", type=int, default=None, help="FFN width (demo 768, fidelity 1024)")
    ap.add_argument("--preset", choices=("demo", "fidelity"), default="demo",
                    help="demo: the small CPU demo model; fidelity: 4 heads, 3 layers, camera pans, a last phase "
                         "at 21 x 60 x 104 px = 32760 tokens (Wan 2.1 480p), int8 storage")
    ap.add_argument("--final", default=None, help="FxHxW of a last training phase (fidelity: 21x60x104)")
    ap.add_argument("--final-minutes", type=float, default=None, help="time budget of the last phase")
    ap.add_argument("--final-iters", type=int, default=None, help="exact iteration count of the last phase")
    ap.add_argument("--final-lr", type=float, default=None, help="peak LR of the last phase (default lr / 2)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="tokens per iteration: each size's batch is this / its tokens (default: --batch clips)")
    ap.add_argument("--camera", action="store_true", default=None, help="camera pans in the training clips")
    ap.add_argument("--storage", choices=("fp16", "int8"), default=None, help="weights file format")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--amp", choices=("bf16", "none"), default="bf16", help="autocast dtype (none: fp32)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--sample-steps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="a few iterations at a tiny size (CPU check)")
    a = ap.parse_args(argv)
    base = FIDELITY_CONFIG if a.preset == "fidelity" else DemoConfig()
    preset = {"layers": base.num_layers, "heads": base.num_attention_heads, "ffn": base.ffn_dim,
              "camera": base.camera, "storage": "fp16", "minutes": 6.0, "lr": 4e-4, "buckets": "16x32x32,4x64x64"}
    if a.preset == "fidelity":
        # NOTE the fidelity model trains eagerly: at 32760 tokens attention is ~90% of its FLOPs (SDPA's flash
        # kernels either way), and three clip sizes would cost three Inductor compiles.
        preset.update(storage="int8", compile=False, final=f"{base.frames}x{base.height}x{base.width}",
                      minutes=4.5, final_minutes=2.5, batch_tokens=65536, lr=3e-4, buckets="21x32x32,5x60x104")
    for k, v in preset.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.smoke:
        a.buckets, a.batch, a.batch_tokens = "4x16x16,2x32x32", 2, None
        a.iters = a.iters or 4
        a.log_every, a.sample_steps, a.warmup = 1, 3, 2
        if a.final:
            a.final, a.final_iters = "3x16x24", a.final_iters or 3
    if a.compile is None:
        a.compile = a.device.startswith("cuda")
    a.bucket_list = [tuple(int(x) for x in b.lower().split("x")) for b in a.buckets.split(",") if b.strip()]
    a.final_size = tuple(int(x) for x in a.final.lower().split("x")) if a.final else None
    if any(len(b) != 3 or b[1] % 2 or b[2] % 2 for b in a.bucket_list + ([a.final_size] if a.final_size else [])):
        ap.error(f"--buckets / --final: sizes FxHxW with even H and W, got {a.buckets!r} / {a.final!r}")
    if a.final_size and a.final_minutes is None and a.final_iters is None:
        ap.error("--final needs --final-minutes or --final-iters")
    # the reference size (validation, samples.png, attention statistics): the last phase's, else the first bucket
    a.frames, a.height, a.width = a.final_size or a.bucket_list[0]
    return a


def batch_for(a, size) -> int:
    """Clips per iteration at ``size``: ``--batch-tokens`` / tokens (at least 1), else ``--batch``."""
    if not a.batch_tokens:
        return a.batch
    f, h, w = size
    return max(1, a.batch_tokens // (f * (h // 2) * (w // 2)))


def lr_at(it: int, total: int, base: float, warmup: int, final_frac: float = 0.1) -> float:
    if it < warmup:
        return base * (it + 1) / warmup
    if total is None:  # not yet known: still warming up or probing
        return base
    p = min(1.0, (it - warmup) / max(1, total - warmup))
    return base * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def train_flops_per_clip(cfg: DemoConfig, frames: int, height: int, width: int) -> float:
    """Matmul FLOPs of one training clip (forward + backward = 3x forward)."""
    S = cfg.tokens(frames, height, width)
    d = cfg.num_attention_heads * cfg.attention_head_dim
    per_token = 2 * (6 * d * d + 2 * d * cfg.ffn_dim)          # q,k,v,o self + q,o cross + FFN
    attn = 4 * S * d                                              # QK^T and PV, per token
    return 3.0 * S * cfg.num_layers * (per_token + attn)


class EMA:
    def __init__(self, params, decay: float):
        self.decay, self.n = decay, 0
        self.shadow = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def update(self, params):
        self.n += 1
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in params], 1 - d)



@torch.no_grad()
def eager_copy(cfg, tensors, device):
    """Fresh uncompiled (transformer, text encoder) in eval mode holding ``tensors`` (in parameter order)."""
    tr, te = build_transformer(cfg).to(device), SpriteTextEncoder(cfg).to(device)
    for p, t in zip(list(tr.parameters()) + list(te.parameters()), tensors):
        p.copy_(t.detach())
    return tr.eval().requires_grad_(False), te.eval().requires_grad_(False)


@torch.no_grad()
def val_loss(tr, te, cfg, a, device, amp, ts=(0.1, 0.3, 0.5, 0.7, 0.9), batch=None) -> dict:
    """Flow-matching loss on a fixed held-out batch at fixed t (lower is better), at the reference size."""
    batch = batch or min(16, 2 * batch_for(a, (a.frames, a.height, a.width)))
    video, tokens = make_batch(10**9 + 7, batch, a.frames, a.height, a.width, device, cfg.max_sprites, cfg.camera)
    g = torch.Generator().manual_seed(1234)
    noise = torch.randn(video.shape, generator=g).to(device)
    out = {}
    for t in ts:
        x = (1 - t) * video + t * noise
        with amp:
            pred = tr(hidden_states=x, timestep=torch.full((batch,), t * 1000.0, device=device),
                      encoder_hidden_states=te(tokens), return_dict=False)[0]
        out[f"{t:.1f}"] = F.mse_loss(pred.float(), noise - video).item()
    out["mean"] = sum(out.values()) / len(ts)
    return out


@torch.no_grad()
def sample_grid(tr, te, cfg, a, device, amp, path, size, n=4):
    from .media import write_grid
    from .sampler import sample

    frames, height, width = size
    p = sample_params(10**9 + 99, n, cfg.max_sprites, cfg.camera)
    real = render(p, frames, height, width, device)
    tokens = tokens_from_params(p).to(device)
    with amp:
        cond, uncond = te(tokens), te(torch.zeros_like(tokens))
        gen = sample(tr, cond, uncond=uncond, guidance=3.0, frames=frames, height=height, width=width,
                     steps=a.sample_steps, seed=5, dtype=torch.float32)
    clips, labels = [], []
    for i in range(n):
        clips += [real[i], gen[i]]
        labels += [f"data {i}", f"sample {i}"]
    write_grid(path, clips, labels)
    return [describe_tokens(tokens[i].cpu()) for i in range(n)]


def attn_report(tr, te, cfg, a, device, amp) -> list:
    from .capture import attention_stats

    video, tokens = make_batch(10**9 + 11, 2, a.frames, a.height, a.width, device, cfg.max_sprites, cfg.camera)
    noise = torch.randn(video.shape, generator=torch.Generator().manual_seed(3)).to(device)
    out = []
    for t in (0.2, 0.5, 0.8):
        with amp:
            st = attention_stats(tr, te(tokens), (1 - t) * video + t * noise, t)
        out.append({"t": t, "layers": st})
    return out


def main(argv=None):
    a = parse_args(argv)
    # bf16 activations meet Wan's fp32 RMSNorm weights under autocast: harmless, and noisy in the log
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log_f = open(out / "train_log.txt", "w")

    t_start = time.perf_counter()

    def log(msg):
        msg = msg if msg.startswith("[train] it ") else f"{msg}  [{time.perf_counter() - t_start:.0f} s]"
        print(msg, flush=True)
        log_f.write(msg + "\n")
        log_f.flush()

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(a.seed)
    cfg = dataclasses.replace(DemoConfig(), num_layers=a.layers, num_attention_heads=a.heads, ffn_dim=a.ffn,
                              camera=bool(a.camera), frames=a.frames, height=a.height, width=a.width)
    tr, te = build_transformer(cfg).to(device), SpriteTextEncoder(cfg).to(device)
    params = list(tr.parameters()) + list(te.parameters())
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.99), weight_decay=0.01, fused=cuda)
    ema = EMA(params, a.ema)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.amp == "bf16")
    # Regional compile: one graph for the identical blocks (fewer compile seconds than the whole model), static
    # per bucket (dynamic=False: no symbolic-shape graph after the second size).
    if a.compile:
        tr.compile_repeated_blocks(dynamic=False)
    model = tr
    phases = [("main", a.bucket_list, a.iters, a.minutes, a.lr, a.warmup)]
    if a.final_size:
        phases.append(("final", [a.final_size], a.final_iters, a.final_minutes, a.final_lr or a.lr / 2,
                       min(a.warmup, 20)))
    desc = "; ".join(f"{name}: {'/'.join('x'.join(map(str, b)) + f' ({cfg.tokens(*b)} tok, batch {batch_for(a, b)})' for b in bl)}"
                     for name, bl, *_ in phases)
    log(f"[train] {n_params / 1e6:.2f}M params ({cfg.num_layers} layers x {cfg.num_attention_heads} heads x "
        f"{cfg.attention_head_dim}, ffn {cfg.ffn_dim}), {desc}, device {device}"
        f"{' (' + torch.cuda.get_device_name() + ')' if cuda else ''}, compile={a.compile}, camera={cfg.camera}")

    gen = torch.Generator(device=device).manual_seed(a.seed)
    curve, iters_done, it_global = [], [], 0
    train_t0 = time.perf_counter()
    for ph, (name, buckets, total, minutes, lr_peak, warmup) in enumerate(phases):
        flops_it = sum(train_flops_per_clip(cfg, *b) * batch_for(a, b) for b in buckets) / len(buckets)
        budget = (minutes or 0.0) * 60.0
        run_loss, run_n = torch.zeros((), device=device), 0
        t_phase = time.perf_counter()
        probe = (20, 60) if ph == 0 else (5, 15)  # iterations timed to fix the count
        t_probe, it = None, 0
        log(f"[train] phase {name}: {total or '%.1f min' % minutes}, peak LR {lr_peak:.1e}, "
            f"~{flops_it / 1e12:.2f} TFLOP/iter")
        while total is None or it < total:
            seed_it = a.seed * 1_000_003 + it + 10_000_000 * ph
            size = buckets[it % len(buckets)]
            bsz = batch_for(a, size)
            video, tokens = make_batch(seed_it, bsz, *size, device, cfg.max_sprites, cfg.camera)
            keep = torch.rand(bsz, device=device, generator=gen) >= a.p_uncond  # CFG prompt dropout
            tokens = tokens * keep[:, None, None]
            t = torch.sigmoid(torch.randn(bsz, device=device, generator=gen))  # logit-normal t
            noise = torch.randn(video.shape, device=device, generator=gen)
            tt = t[:, None, None, None, None]
            x_t = (1 - tt) * video + tt * noise
            lr = lr_at(it, total, lr_peak, warmup)
            for grp in opt.param_groups:
                grp["lr"] = lr
            with amp:
                pred = model(hidden_states=x_t, timestep=t * 1000.0, encoder_hidden_states=te(tokens),
                             return_dict=False)[0]
            loss = F.mse_loss(pred.float(), noise - video)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            ema.update(params)
            run_loss += loss.detach()
            run_n += 1
            it += 1
            it_global += 1
            if total is None and it == probe[0]:
                if cuda:
                    torch.cuda.synchronize()
                t_probe = time.perf_counter()
            if total is None and it == probe[1]:
                if cuda:
                    torch.cuda.synchronize()
                now = time.perf_counter()
                sec_it = (now - t_probe) / (probe[1] - probe[0])
                total = max(it + 1, it + int((budget - (now - t_phase)) / sec_it))
                log(f"[train] {name}: {1 / sec_it:.2f} it/s ({flops_it / sec_it / 1e12:.0f} TFLOP/s matmul "
                    f"estimate); {now - t_phase:.0f} s so far -> {total} iterations")
            if it % a.log_every == 0 or it == total:
                mean = (run_loss / run_n).item()
                curve.append([it_global, round(mean, 5)])
                run_loss.zero_()
                run_n = 0
                el = time.perf_counter() - t_phase
                eta = f"{(total - it) * el / it / 60:.1f} min" if total else "?"
                log(f"[train] it {it:6d}/{total or '?'} ({name})  loss {mean:.4f}  lr {lr:.2e}  {it / el:5.2f} it/s  "
                    f"elapsed {(time.perf_counter() - t_start) / 60:.1f} min  eta {eta}")
        iters_done.append(it)
        if ph + 1 < len(phases):  # the last phase starts from the raw weights; its own EMA
            ema = EMA(params, min(a.ema, 0.995))
    it = sum(iters_done)
    reproduce = f"--iters {iters_done[0]}" + (f" --final-iters {iters_done[1]}" if len(iters_done) > 1 else "")
    log(f"[train] iterations {iters_done}; reproduce with --preset {a.preset} --seed {a.seed} {reproduce}")
    t_start_eval = time.perf_counter()
    train_s = t_start_eval - train_t0

    # --- evaluation on fresh eager copies (the compiled blocks would recompile for every new shape,
    # and capture.py must see the real F.scaled_dot_product_attention): raw vs EMA, keep the better --
    raw_tr, raw_te = eager_copy(cfg, params, device)
    ema_tr, ema_te = eager_copy(cfg, ema.shadow, device)
    vl_raw = val_loss(raw_tr, raw_te, cfg, a, device, amp)
    vl_ema = val_loss(ema_tr, ema_te, cfg, a, device, amp)
    use_ema = vl_ema["mean"] <= vl_raw["mean"]
    tr, te = (ema_tr, ema_te) if use_ema else (raw_tr, raw_te)
    log(f"[train] val loss raw {vl_raw['mean']:.4f}  ema {vl_ema['mean']:.4f} -> saving {'EMA' if use_ema else 'raw'}")
    name = (FIDELITY_WEIGHTS if a.preset == "fidelity" else DEFAULT_WEIGHTS).name
    wpath = save_weights(out / name, tr, te, cfg,
                         {"iterations": it, "phase_iterations": iters_done, "preset": a.preset, "seed": a.seed,
                          "ema": use_ema, "val_loss": round(min(vl_raw["mean"], vl_ema["mean"]), 5)},
                         storage=a.storage)
    size_mb = wpath.stat().st_size / 1e6
    log(f"[train] wrote {wpath} ({size_mb:.2f} MB, {a.storage})" + ("  WARNING: over 15 MB" if size_mb > 15 else ""))
    # from here on the model is the stored one (int8 storage changes the weights a little): reload it
    tr, te, _, _ = load_demo(wpath, device=device, dtype=torch.float32)
    vl_stored = val_loss(tr, te, cfg, a, device, amp)
    log(f"[train] val loss of the stored weights {vl_stored['mean']:.4f}")
    prompts = sample_grid(tr, te, cfg, a, device, amp, out / "samples.png", (a.frames, a.height, a.width))
    log(f"[train] wrote {out / 'samples.png'} (prompts: {prompts})")
    large = (max(b[0] for b in a.bucket_list), max(b[1] for b in a.bucket_list), max(b[2] for b in a.bucket_list))
    if large != (a.frames, a.height, a.width):
        sample_grid(tr, te, cfg, a, device, amp, out / "samples_large.png", large)
        log(f"[train] wrote {out / 'samples_large.png'} ({'x'.join(map(str, large))}, same prompts)")
    attn_trained = attn_report(tr, te, cfg, a, device, amp)
    torch.manual_seed(a.seed + 1)
    attn_random = attn_report(build_transformer(cfg).to(device).eval(), te, cfg, a, device, amp)
    for tr_t, rd_t in zip(attn_trained, attn_random):
        ent = [round(x["entropy_ratio"], 3) for x in tr_t["layers"]]
        ent_r = [round(x["entropy_ratio"], 3) for x in rd_t["layers"]]
        top = [[round(m, 3) for m in x["top15pct_mass_heads"]] for x in tr_t["layers"]]
        top_r = [round(x["top15pct_mass"], 3) for x in rd_t["layers"]]
        log(f"[train] attention at t={tr_t['t']}: entropy / log S trained {ent}, random {ent_r}; top-15% key mass "
            f"per layer x head trained {top}, random (mean over heads) {top_r}")
    stats = {
        "config": dataclasses.asdict(cfg), "args": vars(a), "params": n_params, "iterations": it,
        "train_seconds": round(train_s, 1), "it_per_s": round(it / train_s, 2), "loss_curve": curve,
        "val_loss_raw": vl_raw, "val_loss_ema": vl_ema, "val_loss_stored": vl_stored,
        "saved": "ema" if use_ema else "raw", "phase_iterations": iters_done, "reproduce": reproduce,
        "weights": wpath.name, "weights_mb": round(size_mb, 3), "sample_prompts": prompts,
        "attention_trained": attn_trained, "attention_random_init": attn_random,
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "gpu": torch.cuda.get_device_name() if cuda else None,
                "date": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    (out / "train_stats.json").write_text(json.dumps(stats, indent=1))
    log(f"[train] wrote {out / 'train_stats.json'}; total {(time.perf_counter() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
