"""The demo's real-size timing: what the trained clip (4096 tokens, 2 heads) cannot show. One attention layer of
the Wan 2.1 T2V 1.3B configuration at 480p x 81 frames (12 heads x 32760 tokens, head dim 128, bf16, random
q, k, v: speed only) through ``torch.compile(backend="vcattn")`` for each method, over a whole denoising
schedule (``vc_compile.sampling`` + ``vc_compile.step``: every phase of every method's schedule, grouping and
anchor steps included), against stock SDPA (cuDNN) on the same tensors. The clip figures say how close each
method stays; these say how fast the attention of a real-size video model runs.

    python -m vc_compile.demo            # on a CUDA GPU: the clip, then this table
    python -m vc_compile.demo --speed-tokens 0   # skip it

Each method: one untimed generation (compilation, kernel builds, tuning), ``vc_compile.reset()``, then the
timed generation: wall clock of ``steps`` calls (CUDA synchronised), reported per step and for the schedule.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from vc_compile.methods import BASELINE

WAN13B = dict(heads=12, tokens=32760, head_dim=128)  # Wan 2.1 T2V 1.3B at 480p x 81 frames


class _Attention(torch.nn.Module):
    """One self-attention call as the models make it (q, k, v in [B, S, H, D], SDPA on [B, H, S, D])."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.q = torch.nn.Linear(heads * head_dim, heads * head_dim, bias=False)  # the block's identity
        self.heads, self.head_dim = heads, head_dim

    def forward(self, x, k, v):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v)


@dataclasses.dataclass
class SpeedRow:
    method: str
    step_ms: float  # mean wall time of one call over the schedule
    schedule_ms: float  # the whole schedule (steps calls)
    speedup: float  # stock SDPA's schedule time / this one
    path: str  # what ran (report's kernel paths)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(B, heads, tokens, head_dim, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, tokens, heads * head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, heads, tokens, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, heads, tokens, head_dim, device=device, dtype=dtype, generator=g)
    return x, k, v


def time_methods(methods, *, heads: int, tokens: int, head_dim: int, steps: int, device, dtype=torch.bfloat16,
                 extra: Optional[Dict] = None, log=print) -> List[SpeedRow]:
    """Per method of ``methods`` ([(label, options)]), the timed schedule of one attention layer; the first row
    is stock SDPA (uncompiled), the reference of the speed-ups."""
    import vc_compile
    from vc_compile.config import merge_options

    device = torch.device(device)
    mod = _Attention(heads, head_dim).to(device=device, dtype=dtype)
    x, k, v = _inputs(1, heads, tokens, head_dim, device, dtype)

    def schedule(fn):
        _sync(device)
        t0 = time.perf_counter()
        with vc_compile.sampling(num_steps=steps):
            for i in range(steps):
                vc_compile.step(i)
                fn(x, k, v)
        _sync(device)
        return (time.perf_counter() - t0) * 1e3

    rows: List[SpeedRow] = []
    with torch.no_grad():
        schedule(mod)  # warm-up (cuDNN plans)
        base = schedule(mod)
        rows.append(SpeedRow("stock SDPA", base / steps, base, 1.0, "sdpa"))
        for label, opts in methods:
            if opts.get("method") == BASELINE.value:
                continue  # stock SDPA through the op: the row above
            torch._dynamo.reset()
            vc_compile.reset(report=True)
            options = merge_options({"min_seq_len": min(tokens, 1024)}, opts, extra or {})
            fn = torch.compile(mod, backend="vcattn", options=options)
            log(f"[vc_demo]   real-size {label}: compiling and warming up ...")
            schedule(fn)  # compile, kernel builds, tuning: untimed
            vc_compile.reset()
            ms = schedule(fn)
            paths = sorted({p for s in vc_compile.report().sites for p in s.kernel_path})
            rows.append(SpeedRow(label, ms / steps, ms, base / ms, "+".join(paths) or "?"))
    return rows


def format_speed(rows: List[SpeedRow], *, heads: int, tokens: int, head_dim: int, steps: int,
                 device_name: str) -> str:
    head = f"{'method':<18}{'ms / step':>11}{'schedule':>12}{'speed-up':>10}  kernels"
    lines = [f"real-size attention, speed only: one layer of Wan 2.1 1.3B ({heads} heads x {tokens} tokens x "
             f"head dim {head_dim}, bf16, random q/k/v), {steps}-step schedule, {device_name}", head,
             "-" * len(head)]
    for r in rows:
        lines.append(f"{r.method:<18}{r.step_ms:>11.2f}{r.schedule_ms / 1e3:>11.2f}s{r.speedup:>9.2f}x  {r.path}")
    slow = [r.method for r in rows[1:] if r.speedup < 1.0]
    if slow:
        lines.append(f"slower than stock here: {', '.join(slow)} (the per-call fixed cost of the 8-bit path "
                     "outweighs its kernel at this size; docs/performance.md)")
    return "\n".join(lines)
