"""RoPE of the prologue fusion: the fp32 rotation (the conventions and ``RopeArgs``: ``vc_compile/formats.py``).

Precision: the rotation runs in fp32 and rounds once to the input dtype, as Wan (bf16 x times fp32 tables),
HunyuanVideo, LTX and CogVideoX (``x.float() * cos + ...``, ``.to(x.dtype)``) do; the products are summed
in the models' order (``x*cos`` first), so this reference is bit-identical to those models' RoPE on CPU.
A model that rotates in bf16 (tests/tiny_dit.py casts its tables to bf16) differs by bf16 roundings.
"""
from __future__ import annotations

import torch

from vc_compile.formats import RopeArgs


def rotate(x: torch.Tensor, form: str) -> torch.Tensor:
    """rot(x) of ``x*cos + rot(x)*sin`` along the last dim."""
    if form == "interleaved":
        return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, rope: RopeArgs) -> torch.Tensor:
    """x [B, H, S, D] (any strides) -> rotated copy (contiguous, x's dtype): fp32 math, one rounding."""
    D = x.shape[-1]
    xs = x[:, :, rope.lo:rope.hi].float()
    c, s = rope.cos.float(), rope.sin.float()
    if c.shape[-1] * 2 == D:  # pair table: one value per pair (2i, 2i+1)
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
    y = (xs * c + rotate(xs, rope.form) * s).to(x.dtype)
    out = x.contiguous().clone() if (rope.lo, rope.hi) != (0, x.shape[2]) else None
    if out is None:
        return y.contiguous()
    out[:, :, rope.lo:rope.hi] = y
    return out
