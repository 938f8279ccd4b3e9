"""Train the demo video DiT with flow matching on synthetic sprite clips, within a time budget.

    python -m vc_compile.demo.train --minutes 6 --out train_out          # one H200, ~7 min in all
    python -m vc_compile.demo.train --smoke --out /tmp/smoke             # CPU check, 1-2 minutes

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
from .model import DEFAULT_WEIGHTS, DemoConfig, SpriteTextEncoder, build_transformer, describe_tokens, save_weights


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the vc_compile demo video DiT (flow matching).")
    ap.add_argument("--minutes", type=float, default=6.0, help="time budget of the training loop")
    ap.add_argument("--iters", type=int, default=None, help="exact iteration count (overrides --minutes)")
    ap.add_argument("--out", default="vc_demo_train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--p-uncond", type=float, default=0.1, help="prompt dropout for CFG")
    ap.add_argument("--buckets", default="16x32x32,4x64x64",
                    help="clip sizes FxHxW (pixels), cycled per iteration; the first is the reference size "
                         "(validation, samples.png). 4x64x64 (also 4096 tokens) teaches RoPE distances up to "
                         "32 tokens in height/width, so the model runs at the demo/benchmark sizes")
    ap.add_argument("--layers", type=int, default=DemoConfig.num_layers)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--amp", choices=("bf16", "none"), default="bf16", help="autocast dtype (none: fp32)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--sample-steps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="a few iterations at a tiny size (CPU check)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.buckets, a.batch = "4x16x16,2x32x32", 2
        a.iters = a.iters or 4
        a.log_every, a.sample_steps, a.warmup = 1, 3, 2
    if a.compile is None:
        a.compile = a.device.startswith("cuda")
    a.bucket_list = [tuple(int(x) for x in b.lower().split("x")) for b in a.buckets.split(",") if b.strip()]
    if any(len(b) != 3 or b[1] % 2 or b[2] % 2 for b in a.bucket_list):
        ap.error(f"--buckets: sizes FxHxW with even H and W, got {a.buckets!r}")
    a.frames, a.height, a.width = a.bucket_list[0]
    return a


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
def val_loss(tr, te, cfg, a, device, amp, ts=(0.1, 0.3, 0.5, 0.7, 0.9), batch=16) -> dict:
    """Flow-matching loss on a fixed held-out batch at fixed t (lower is better)."""
    video, tokens = make_batch(10**9 + 7, batch, a.frames, a.height, a.width, device, cfg.max_sprites)
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
    p = sample_params(10**9 + 99, n, cfg.max_sprites)
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

    video, tokens = make_batch(10**9 + 11, 2, a.frames, a.height, a.width, device, cfg.max_sprites)
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
    cfg = dataclasses.replace(DemoConfig(), num_layers=a.layers, frames=a.frames, height=a.height, width=a.width)
    tr, te = build_transformer(cfg).to(device), SpriteTextEncoder(cfg).to(device)
    params = list(tr.parameters()) + list(te.parameters())
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.99), weight_decay=0.01, fused=cuda)
    ema = EMA(params, a.ema)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.amp == "bf16")
    # Regional compile: one graph for the 6 identical blocks (6x less compile time than the whole
    # model), static per bucket (dynamic=False: no symbolic-shape graph after the second size).
    if a.compile:
        tr.compile_repeated_blocks(dynamic=False)
    model = tr
    flops_clip = sum(train_flops_per_clip(cfg, *b) for b in a.bucket_list) / len(a.bucket_list)
    toks = "/".join(str(cfg.tokens(*b)) for b in a.bucket_list)
    log(f"[train] {n_params / 1e6:.2f}M params, buckets {a.buckets} ({toks} tokens/clip), "
        f"batch {a.batch}, device {device}{' (' + torch.cuda.get_device_name() + ')' if cuda else ''}, "
        f"compile={a.compile}, budget {a.iters or '%.1f min' % a.minutes}"
        f"{'' if a.iters else ''}, ~{flops_clip * a.batch / 1e12:.2f} TFLOP/iter")

    gen = torch.Generator(device=device).manual_seed(a.seed)
    budget = a.minutes * 60.0
    total = a.iters
    curve, run_loss, run_n = [], torch.zeros((), device=device), 0
    t_start = time.perf_counter()
    t_probe = None
    it = 0
    while total is None or it < total:
        seed_it = a.seed * 1_000_003 + it
        video, tokens = make_batch(seed_it, a.batch, *a.bucket_list[it % len(a.bucket_list)], device,
                                   cfg.max_sprites)
        keep = torch.rand(a.batch, device=device, generator=gen) >= a.p_uncond  # CFG prompt dropout
        tokens = tokens * keep[:, None, None]
        t = torch.sigmoid(torch.randn(a.batch, device=device, generator=gen))  # logit-normal t
        noise = torch.randn(video.shape, device=device, generator=gen)
        tt = t[:, None, None, None, None]
        x_t = (1 - tt) * video + tt * noise
        lr = lr_at(it, total, a.lr, a.warmup)
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
        if total is None and it == 20:
            if cuda:
                torch.cuda.synchronize()
            t_probe = time.perf_counter()
        if total is None and it == 60:
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            sec_it = (now - t_probe) / 40
            total = max(it + 1, it + int((budget - (now - t_start)) / sec_it))
            log(f"[train] {1 / sec_it:.1f} it/s after compile ({flops_clip * a.batch / sec_it / 1e12:.0f} TFLOP/s "
                f"matmul estimate); {now - t_start:.0f} s so far -> total {total} iterations")
        if it % a.log_every == 0 or it == total:
            mean = (run_loss / run_n).item()
            curve.append([it, round(mean, 5)])
            run_loss.zero_()
            run_n = 0
            el = time.perf_counter() - t_start
            eta = f"{(total - it) * el / it / 60:.1f} min" if total else "?"
            log(f"[train] it {it:6d}/{total or '?'}  loss {mean:.4f}  lr {lr:.2e}  {it / el:5.1f} it/s  "
                f"elapsed {el / 60:.1f} min  eta {eta}")
    train_s = time.perf_counter() - t_start

    # --- evaluation on fresh eager copies (the compiled blocks would recompile for every new shape,
    # and capture.py must see the real F.scaled_dot_product_attention): raw vs EMA, keep the better --
    raw_tr, raw_te = eager_copy(cfg, params, device)
    ema_tr, ema_te = eager_copy(cfg, ema.shadow, device)
    vl_raw = val_loss(raw_tr, raw_te, cfg, a, device, amp)
    vl_ema = val_loss(ema_tr, ema_te, cfg, a, device, amp)
    use_ema = vl_ema["mean"] <= vl_raw["mean"]
    tr, te = (ema_tr, ema_te) if use_ema else (raw_tr, raw_te)
    log(f"[train] val loss raw {vl_raw['mean']:.4f}  ema {vl_ema['mean']:.4f} -> saving {'EMA' if use_ema else 'raw'}")
    wpath = save_weights(out / DEFAULT_WEIGHTS.name, tr, te, cfg,
                         {"iterations": it, "seed": a.seed, "ema": use_ema, "val_loss": round(min(vl_raw["mean"], vl_ema["mean"]), 5)})
    size_mb = wpath.stat().st_size / 1e6
    log(f"[train] wrote {wpath} ({size_mb:.2f} MB)" + ("  WARNING: over 15 MB" if size_mb > 15 else ""))
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
        log(f"[train] attention entropy / log S at t={tr_t['t']}: trained {ent}  random {ent_r}")
    stats = {
        "config": dataclasses.asdict(cfg), "args": vars(a), "params": n_params, "iterations": it,
        "train_seconds": round(train_s, 1), "it_per_s": round(it / train_s, 2), "loss_curve": curve,
        "val_loss_raw": vl_raw, "val_loss_ema": vl_ema, "saved": "ema" if use_ema else "raw",
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
