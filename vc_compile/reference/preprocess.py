"""Reference preprocessing (SPEC 3.1): K smoothing, Hadamard, per-block Q/K quantisation, V-Smooth.

This is the oracle of ``vc_compile/templates/preprocess.py``; both return the same named tuples.

Notation
--------
B, H, S, D      batch, heads, tokens, head dim; inputs are [B, H, S, D] (any strides).
perm            [B, H, S] int64 key/value permutation (the V-Smooth cluster order), or None = identity.
BLOCK_Q         tokens per Q scale (128);  BLOCK_K tokens per K scale (64);  BLOCK_V rows per V mean (128).
q8, k8          [B, H, S, D] int8 (or float8_e4m3fn when qk_format == "fp8"); k8 in *permuted* order.
q_scale         [B, H, ceil(S/BLOCK_Q)] fp32, with ``sm_scale * log2(e)`` folded in, so
                ``(q8 . k8) * q_scale * k_scale`` is the base-2 logit.
k_scale         [B, H, ceil(S/BLOCK_K)] fp32 (blocks of the permuted K).
k_mean          [B, H, D] fp32, the token mean removed from K (before rotation). Softmax ignores it;
                the log-sum-exp does not: ``lse_true = lse_smoothed + (q . k_mean) * sm_scale``.
v8t             [B, H, D, S_pad] float8_e4m3fn: the residual ``V' - mu`` quantised, K-major (transposed),
                S_pad = ceil(S/BLOCK_V) * BLOCK_V, padded with zeros.
v_scale         [B, H, D] fp32 per-channel scale of the residual (over all tokens of the head).
v_mean          [B, H, ceil(S/BLOCK_V), D] fp32 block means ``mu_j`` of the permuted V (zeros when
                smoothing is off: then this is plain per-channel FP8 V, our "naive 8-bit").
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .quant import (
    FP8_MAX,
    LOG2E,
    hadamard_matrix,
    quantize_blocks,
    quantize_fp8,
    safe_scale,
)

BLOCK_Q = 128
BLOCK_K = 64
BLOCK_V = 128


class QKQuant(NamedTuple):
    q8: torch.Tensor
    q_scale: torch.Tensor
    k8: torch.Tensor
    k_scale: torch.Tensor
    k_mean: torch.Tensor
    sm_scale: float


class VQuant(NamedTuple):
    v8t: torch.Tensor
    v_scale: torch.Tensor
    v_mean: torch.Tensor
    S: int


def apply_perm(x: torch.Tensor, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows of [B, H, S, D] in the order ``perm`` ([B, H, S]): out[..., t, :] = x[..., perm[t], :]."""
    if perm is None:
        return x
    return torch.gather(x, 2, perm.long().unsqueeze(-1).expand(*perm.shape, x.shape[-1]))


def preprocess_qk(q, k, perm=None, *, sm_scale: float, hadamard: bool = False,
                  qk_format: str = "int8") -> QKQuant:
    qf = q.float()
    kf = k.float()
    k_mean = kf.mean(dim=2)
    kf = kf - k_mean.unsqueeze(2)
    if hadamard:
        Hd = hadamard_matrix(q.shape[-1], device=q.device)
        qf = qf @ Hd
        kf = kf @ Hd
    kf = apply_perm(kf, perm)
    q8, q_scale = quantize_blocks(qf, BLOCK_Q, qk_format)
    k8, k_scale = quantize_blocks(kf, BLOCK_K, qk_format)
    return QKQuant(q8, q_scale * (sm_scale * LOG2E), k8, k_scale, k_mean, float(sm_scale))


def block_means(v: torch.Tensor, block: int = BLOCK_V) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, ceil(S/block), D] means over the valid rows of each block."""
    B, H, S, D = v.shape
    nb = (S + block - 1) // block
    pad = nb * block - S
    vp = torch.nn.functional.pad(v, (0, 0, 0, pad)) if pad else v
    sums = vp.unflatten(2, (nb, block)).sum(dim=3)
    counts = torch.full((nb,), float(block), device=v.device)
    counts[-1] = block - pad
    return sums / counts.view(1, 1, nb, 1)


def preprocess_v(v, perm=None, *, smooth: bool = True) -> VQuant:
    B, H, S, D = v.shape
    vf = apply_perm(v.float(), perm)
    nb = (S + BLOCK_V - 1) // BLOCK_V
    if smooth:
        mu = block_means(vf)
    else:
        mu = torch.zeros(B, H, nb, D, device=v.device)
    resid = vf - mu.repeat_interleave(BLOCK_V, dim=2)[:, :, :S]
    v_scale = safe_scale(resid.abs().amax(dim=2), FP8_MAX)  # [B, H, D]
    v8 = quantize_fp8(resid, v_scale.unsqueeze(2))
    S_pad = nb * BLOCK_V
    v8t = torch.zeros(B, H, D, S_pad, dtype=v8.dtype, device=v.device)
    v8t[..., :S] = v8.transpose(-1, -2)
    return VQuant(v8t, v_scale, mu, S)


def dequantize_v(vq: VQuant) -> torch.Tensor:
    """The V' (permuted) that the attention kernel effectively multiplies by: fp32 [B, H, S, D]."""
    S = vq.S
    r = vq.v8t[..., :S].float().transpose(-1, -2) * vq.v_scale.unsqueeze(2)
    return r + vq.v_mean.repeat_interleave(BLOCK_V, dim=2)[:, :, :S]
