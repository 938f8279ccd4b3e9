"""Capture the attention inputs (q, k, v) of the demo model during a real sampling run.

For the kernel fidelity benchmarks: instead of Gaussian test tensors, the exact [B, H, S, D] tensors
that the demo model hands to ``F.scaled_dot_product_attention`` at chosen layers and denoising steps.

How: in eager mode (no torch.compile), :func:`capture_sdpa` temporarily replaces
``torch.nn.functional.scaled_dot_product_attention``, which diffusers' attention dispatcher looks up
at call time (``_native_attention``), with a recorder that calls the original and hands the inputs to
a callback. A forward pre-hook on the transformer numbers the forwards, so each call is identified by
(forward index, self-attention layer, kind). Within a sampling step the forwards are the CFG
branches: 0 = conditional, 1 = unconditional.

CLI (writes ``qkv_L{layer}_s{step}_{branch}.pt`` files with ``q, k, v`` in bf16 plus ``index.json``)::

    python -m vc_compile.demo.capture --out qkv --layers 0,3,5 --steps 0,25,49 --num-steps 50 \
        --frames 21 --height 60 --width 104
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def capture_sdpa(transformer, callback):
    """Within the block, ``callback(info, q, k, v)`` sees every SDPA call of ``transformer``'s forwards.

    ``info``: dict with ``forward`` (index since entering), ``layer`` (index among calls of the same
    kind in this forward), ``kind`` ("self" when q and k have the same length, else "cross") and the
    SDPA keyword arguments. Eager mode only: under torch.compile the patched function is traced away.
    """
    original = F.scaled_dot_product_attention
    state = {"forward": -1, "self": 0, "cross": 0}

    def pre_hook(module, args, kwargs):
        state["forward"] += 1
        state["self"] = state["cross"] = 0

    def recorder(query, key, value, *args, **kwargs):
        kind = "self" if query.shape[-2] == key.shape[-2] else "cross"
        info = {"forward": state["forward"], "layer": state[kind], "kind": kind, "kwargs": kwargs}
        state[kind] += 1
        callback(info, query, key, value)
        return original(query, key, value, *args, **kwargs)

    handle = transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    torch.nn.functional.scaled_dot_product_attention = recorder
    try:
        yield state
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        handle.remove()


@torch.no_grad()
def row_stats(q, k, rows: int, g) -> dict:
    """Attention statistics of ``rows`` random query rows of q, k [B, H, S, D] (fp32 softmax of q k^T / sqrt(D))."""
    S, D = q.shape[-2], q.shape[-1]
    idx = torch.randperm(S, generator=g)[: min(rows, S)].to(q.device)
    with torch.autocast(q.device.type, enabled=False):  # fp32 scores even under bf16 autocast
        p = torch.softmax((q[..., idx, :].float() @ k.float().transpose(-1, -2)) / math.sqrt(D), dim=-1)
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1) / math.log(S)
    top1 = p.topk(max(1, S // 100), dim=-1).values.sum(-1)
    top15 = p.topk(max(1, int(0.15 * S)), dim=-1).values.sum(-1)           # [B, H, rows]
    heads = top15.mean(dim=(0, 2))
    return {"entropy_ratio": ent.mean().item(), "top1pct_mass": top1.mean().item(),
            "top15pct_mass": heads.mean().item(), "top15pct_mass_heads": heads.tolist()}


@torch.no_grad()
def mass_by_step(transformer, cond, uncond, *, frames, height, width, num_steps, at_steps, seed=0, guidance=3.0,
                 rows=256, dtype=torch.bfloat16) -> list:
    """Along one sampling run (eager, conditional branch): :func:`row_stats` of every self-attention layer at
    the steps ``at_steps``. Returns [{"step", "layer", **row_stats}]."""
    out = []
    g = torch.Generator().manual_seed(seed)

    def cb(step, branch, info, q, k, v):
        if info["kind"] == "self" and step in at_steps and branch == "cond":
            out.append({"step": step, "layer": info["layer"], **row_stats(q, k, rows, g)})

    _sample_seen(transformer, cond, uncond, cb, frames=frames, height=height, width=width, num_steps=num_steps,
                 seed=seed, guidance=guidance, dtype=dtype)
    return out


def _sample_seen(transformer, cond, uncond, cb, *, frames, height, width, num_steps, seed, guidance, dtype):
    """Run the sampler eagerly; ``cb(step, branch, info, q, k, v)`` sees every SDPA call, ``branch`` "cond" for a
    step's first forward and "uncond" after it (:func:`capture_sdpa`'s ``info``)."""
    from .sampler import sample

    cur = {"step": -1, "forward0": 0}
    names = ("cond", "uncond")

    def step_fn(i):
        cur["step"] = i
        cur["forward0"] = state["forward"] + 1

    def seen(info, q, k, v):
        cb(cur["step"], names[min(info["forward"] - cur["forward0"], 1)], info, q, k, v)

    with capture_sdpa(transformer, seen) as state:
        sample(transformer, cond, uncond=uncond, guidance=guidance, frames=frames, height=height, width=width,
               steps=num_steps, seed=seed, dtype=dtype, step_fn=step_fn)


@torch.no_grad()
def attention_stats(transformer, text_states, x, t: float, rows: int = 256, seed: int = 0) -> list:
    """Per self-attention layer: how far from uniform the attention of one forward at noise level t is.

    ``entropy_ratio``: mean row entropy / log(S) (1.0 = uniform); ``top1pct_mass`` / ``top15pct_mass``: mean
    probability mass of the top 1% / 15% of keys (0.01 / 0.15 = uniform), ``top15pct_mass_heads`` per head.
    Computed in fp32 on ``rows`` random query rows.
    """
    stats = []
    g = torch.Generator().manual_seed(seed)

    def cb(info, q, k, v):
        if info["kind"] != "self":
            return
        st = row_stats(q, k, rows, g)
        stats.append({"layer": info["layer"], **st})

    timestep = torch.full((x.shape[0],), t * 1000.0, device=x.device)
    with capture_sdpa(transformer, cb):
        transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=text_states, return_dict=False)
    return stats


def truth_rows(q, k, v, rows):
    """fp32 attention of the query rows ``rows`` of q, k, v [B, H, S, D] -> [B, H, len(rows), D], head by head."""
    out = []
    for h in range(q.shape[1]):
        sc = q[:, h, rows].float() @ k[:, h].float().transpose(-1, -2) * q.shape[-1] ** -0.5
        out.append(torch.softmax(sc, -1) @ v[:, h].float())
    return torch.stack(out, 1)


@torch.no_grad()
def errors_by_phase(captured, method, n_rows: int = 512, seed: int = 0, site: int = 95_000) -> list:
    """Score attention on captured inputs, step by step, as a sampling run would call it.

    ``captured``: one (q, k, v) [B, H, S, D] per denoising step (:func:`capture_run` of one layer at every step);
    ``method``: vcattn options (the op runs the method's real schedule over the steps: warm-up, grouping,
    anchors, reuse) or a callable ``(q, k, v) -> out`` (a baseline; its phase is "call"). Returns
    ``[{"step", "phase", "rel_l2"}]``: the output's relative L2 error on ``n_rows`` sampled query rows against
    fp32 attention, and the phase the op recorded for the step.
    """
    import vc_compile
    import vc_compile.ops  # noqa: F401 - registers torch.ops.vcattn.attention
    from vc_compile.config import VCConfig

    g = torch.Generator().manual_seed(seed)
    out = []

    def phases():
        rec = next((r for r in vc_compile.report().sites if r.site == site), None)
        return dict(rec.phases) if rec is not None else {}

    cfg = None if callable(method) else VCConfig.from_options(method).to_json()
    with vc_compile.sampling(num_steps=len(captured)):
        for i, (q, k, v) in enumerate(captured):
            vc_compile.step(i)
            before = phases()
            o = method(q, k, v) if cfg is None else torch.ops.vcattn.attention(q, k, v, None, site, cfg, None)
            after = phases()
            grew = {p: n - before.get(p, 0) for p, n in after.items() if n > before.get(p, 0)}
            rows = torch.randperm(q.shape[2], generator=g)[:n_rows].sort().values.to(q.device)
            ref = truth_rows(q, k, v, rows)
            err = ((o[:, :, rows].double() - ref.double()).norm() / ref.double().norm()).item()
            out.append({"step": i, "phase": max(sorted(grew), key=grew.get) if grew else "call", "rel_l2": err})
    vc_compile.reset()
    return out


def capture_run(transformer, cond, uncond, *, frames, height, width, num_steps, layers, steps,
                branches=("cond",), seed=0, guidance=3.0, dtype=torch.bfloat16, out=None) -> list:
    """Run the sampler eagerly, keep q, k, v of the chosen self-attention layers/steps/branches.

    Returns a list of dicts (tensors on CPU); with ``out`` also saves them and an ``index.json``.
    """
    kept = []

    def cb(step, branch, info, q, k, v):
        if info["kind"] == "self" and info["layer"] in layers and step in steps and branch in branches:
            # contiguous copies: the SDPA inputs are permuted views of larger projection buffers
            kept.append({"layer": info["layer"], "step": step, "branch": branch,
                         **{n: x.detach().to("cpu", torch.bfloat16).contiguous().clone()
                            for n, x in (("q", q), ("k", k), ("v", v))}})

    _sample_seen(transformer, cond, uncond, cb, frames=frames, height=height, width=width, num_steps=num_steps,
                 seed=seed, guidance=guidance, dtype=dtype)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        index = []
        for rec in kept:
            name = f"qkv_L{rec['layer']}_s{rec['step']}_{rec['branch']}.pt"
            torch.save({k: rec[k] for k in ("q", "k", "v")}, out / name)
            index.append({"file": name, "layer": rec["layer"], "step": rec["step"], "branch": rec["branch"],
                          "shape_BHSD": list(rec["q"].shape)})
        meta = {"frames": frames, "height": height, "width": width, "num_steps": num_steps, "seed": seed,
                "guidance": guidance, "layout": "[B, H, S, D] as passed to SDPA (RoPE applied)", "files": index}
        (out / "index.json").write_text(json.dumps(meta, indent=1))
    return kept


def main(argv=None):
    from .model import DEFAULT_PROMPT, encode, load_demo, parse_prompt

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="vc_qkv")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--layers", default="0,3,5")
    ap.add_argument("--steps", default="0,25,49", help="steps to capture (0-based)")
    ap.add_argument("--num-steps", type=int, default=50)
    ap.add_argument("--branches", default="cond")
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--height", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    dtype = torch.bfloat16
    tr, te, cfg, _ = load_demo(a.weights, device=a.device, dtype=dtype)
    cond = encode(te, parse_prompt(a.prompt, cfg.max_sprites), dtype)
    uncond = encode(te, parse_prompt("", cfg.max_sprites), dtype)
    kept = capture_run(tr, cond, uncond, frames=a.frames, height=a.height, width=a.width, num_steps=a.num_steps,
                       layers={int(x) for x in a.layers.split(",")}, steps={int(x) for x in a.steps.split(",")},
                       branches=tuple(a.branches.split(",")), seed=a.seed, guidance=a.guidance, out=a.out)
    print(f"captured {len(kept)} (q, k, v) triples into {a.out}/")


if __name__ == "__main__":
    main()
