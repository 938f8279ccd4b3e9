"""What 8-bit QK costs in attention error, per-token against per-head K scales (CPU, fp64 arithmetic on the codes).

    python -m scripts.qk8_accuracy

Dense attention on ``benchmarks.common.structured_inputs`` (channel-biased K, clustered V with 1% token
outliers; bf16 inputs), rel. L2 against fp64 attention of the same bf16 inputs, for Q as INT8 codes with one scale
a row and K smoothed (token mean per head subtracted) as INT8 codes with one scale per token or ONE scale per
head (what the sm_90 gather kernel's 8-bit QK variant uses: no per-column factor in its softmax), on the inputs as
they are and with 0.1% of the keys scaled x8 (outlier tokens that set a per-head scale). docs/sparse_notes.md
quotes the printout.
"""
from __future__ import annotations

import math

import torch

from benchmarks.common import structured_inputs


def attention(scores, v, d):
    return torch.softmax(scores / math.sqrt(d), -1) @ v


def int8(x, dims):
    """Codes (as fp64) and scales: one scale per slice over ``dims``, amax / 127, round to nearest even."""
    amax = x.abs().amax(dim=dims, keepdim=True).clamp_min(1e-30)
    scale = amax / 127
    return torch.round(x / scale).clamp(-127, 127), scale


def errors(q, k, v, D):
    ref = attention(q @ k.transpose(-1, -2), v, D)
    rel = lambda o: ((o - ref).norm() / ref.norm()).item()  # noqa: E731
    km = k - k.mean(2, keepdim=True)
    qc, qs = int8(q, (-1,))
    out = {}
    for name, dims in (("per-token K", (-1,)), ("per-head K", (-2, -1))):
        kc, ks = int8(km, dims)
        scale = qs * (ks.transpose(-1, -2) if name == "per-token K" else ks)
        out[name] = rel(attention((qc @ kc.transpose(-1, -2)) * scale, v, D))
    return out


def main():
    torch.manual_seed(0)
    for S, D, seed in ((4096, 128, 0), (4096, 64, 1), (8192, 128, 2)):
        q, k, v = (t.transpose(1, 2).double() for t in structured_inputs(1, 2, S, D, seed=seed))
        plain = errors(q, k, v, D)
        ko = k.clone()
        ko[:, :, torch.randperm(S)[:S // 1000]] *= 8
        outl = errors(q, ko, v, D)
        print(f"S {S} D {D}: " + ", ".join(f"{n} {e:.2e}" for n, e in plain.items())
              + " | 0.1% keys x8: " + ", ".join(f"{n} {e:.2e}" for n, e in outl.items()))


if __name__ == "__main__":
    main()
