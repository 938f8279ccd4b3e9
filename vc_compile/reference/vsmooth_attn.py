"""Reference 8-bit attention with V-Smooth mean compensation and optional ExpCast-FP8 (docs/methods.md, V-Smooth and ExpCast-FP8).

Oracle of ``vc_compile/kernels/vsmooth_attn.py``.

Notation (see ``reference/preprocess.py`` for the inputs)
--------
s_ij    base-2 logit ``(q8_i . k8_j) * q_scale_i * k_scale_j`` (q_scale per query token, [B, H, S], with
        sm_scale * log2 e folded in; k_scale per 64 keys).
m_i     row max of s.  u_ij = s_ij - m_i <= 0.
P~_ij   the FP8 probability the PV product multiplies: ``fp8(256 * 2^u)`` (exp2 + cast), or the decoded
        ExpCast code ``c(u) = clip(round(8u + 119.65), 0, 120)``.
l_i     row sum of the *decoded* P~ (so the normalisation matches what the MMA multiplied).
O_i     ``sum_j P~_ij (R_q,j * v_scale + mu_j) / l_i`` -- the mean term is ``r_ij mu_j`` with
        ``r_ij`` = the row sum of P~ over key block j, which is what the kernel adds per block.

Differences from the kernel, by design: the kernel quantises P~ against the *running* row max of its
online softmax; the reference uses the final row max. Both are valid roundings of the same numbers; the
kernel test tolerances account for it. The reference works in fp32 on chunks of queries, so it never
holds more than ``chunk x S`` scores: 256 rows on a CPU (at S = 4096 on 2 cores 2.3x faster than 1024
rows, whose 16 MB temporaries miss the caches and the allocator's free lists; the demo's CPU run spends most of
its time here), 1024 on a GPU.
"""
from __future__ import annotations

import torch

from typing import Optional

from vc_compile.formats import BLOCK_K, BLOCK_V, EXPCAST_OFFSET, LOG2E, P_SCALE_LOG2, QKQuant, VQuant

from .preprocess import dequantize_v
from .quant import decode_e4m3, expand_blocks, expcast_codes, fp8_round


def row_chunk(device) -> int:
    """Query rows per chunk of the chunked references: 256 on a CPU, 1024 on a GPU (module doc)."""
    return 256 if torch.device(device).type == "cpu" else 1024


def quantized_probs(s: torch.Tensor, expcast: bool, *, block_ref: Optional[float] = None,
                    p_log2: float = P_SCALE_LOG2, offset: float = EXPCAST_OFFSET):
    """Base-2 logits [..., n, S] -> (P~ fp32 values, row max m).

    ``block_ref`` = L (docs/methods.md): each key block of ``BLOCK_V`` keys is quantised against
    its own reference r_j = max(max of the block, m - L) instead of the row max, and returned as
    P~_j 2^(r_j - m) (what the kernel's accumulator holds after its rescaling): a block far below the row max
    keeps FP8's full range instead of underflowing. ``p_log2``: log2 of P~'s value at u = 0 on the exp2 path;
    ``offset``: ExpCast's code of u = 0."""
    m = s.amax(dim=-1, keepdim=True)
    # A row that is all -inf has no max; keep it finite so the row stays 0/0 -> NaN like SDPA.
    ref = m
    if block_ref is not None:
        n = s.shape[-1]
        nb = (n + BLOCK_V - 1) // BLOCK_V
        sp = torch.nn.functional.pad(s, (0, nb * BLOCK_V - n), value=float("-inf"))
        bmax = sp.unflatten(-1, (nb, BLOCK_V)).amax(dim=-1)
        ref = torch.maximum(bmax, m - block_ref).repeat_interleave(BLOCK_V, dim=-1)[..., :n]
    u = s - ref
    if expcast:
        p = decode_e4m3(expcast_codes(u, offset))
    else:
        p = fp8_round(torch.exp2(u + p_log2))
    if block_ref is not None:
        p = p * torch.exp2(ref - m)
    return p, m


def vsmooth_attention(qk: QKQuant, vq: VQuant, *, expcast: bool = False, out_dtype=torch.bfloat16,
                      return_lse: bool = False, chunk: Optional[int] = None, block_ref: Optional[float] = None,
                      p_log2: float = P_SCALE_LOG2, offset: float = EXPCAST_OFFSET):
    """8-bit attention. Returns O [B, H, S, D] (``out_dtype``) and, if asked, the base-2 LSE of the
    *smoothed* logits, [B, H, S] fp32 (add ``lse_correction`` for the LSE of the true logits).
    ``block_ref``, ``p_log2``, ``offset``: see ``quantized_probs`` (defaults: the shipped kernels' numerics)."""
    B, H, S, D = qk.q8.shape
    Sk = qk.k8.shape[2]
    chunk = chunk or row_chunk(qk.q8.device)
    ks = expand_blocks(qk.k_scale, BLOCK_K, Sk)  # [B, H, Sk]
    qs = qk.q_scale  # [B, H, S]: one scale per query token
    if qs.shape[-1] != S:
        raise ValueError(f"q_scale must be per query token [B, H, S={S}], got {tuple(qs.shape)}")
    kf = qk.k8.float()
    vdeq = dequantize_v(vq)  # [B, H, Sk, D]
    out = torch.empty(B, H, S, vdeq.shape[-1], dtype=out_dtype, device=qk.q8.device)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=qk.q8.device) if return_lse else None
    for i0 in range(0, S, chunk):
        i1 = min(S, i0 + chunk)
        s = (qk.q8[:, :, i0:i1].float() @ kf.transpose(-1, -2)) * qs[:, :, i0:i1, None] * ks[:, :, None, :]
        p, m = quantized_probs(s, expcast, block_ref=block_ref, p_log2=p_log2, offset=offset)
        l = p.sum(dim=-1, keepdim=True)
        out[:, :, i0:i1] = ((p @ vdeq) / l).to(out_dtype)
        if return_lse:
            lse[:, :, i0:i1] = (m + torch.log2(l) - (p_log2 if not expcast else (offset + 0.35 - 56.0) / 8.0)
                                ).squeeze(-1)
    return (out, lse) if return_lse else out
