"""Reference dense attention with the base-2 log-sum-exp (MC-Sparse pass 1), fp32, chunked over queries.

Notation: s = (q . k) * sm_scale * log2(e) (base-2 logits); ``lse2_i = log2 sum_j 2^{s_ij}``;
p_ij = 2^{s_ij - lse2_i}.
"""
from __future__ import annotations

from typing import Optional

import torch

from vc_compile.formats import LOG2E


def dense_attention_lse(q, k, v, *, sm_scale: float, chunk: Optional[int] = None):
    """Returns (O fp32 [B, H, S, Dv], lse2 fp32 [B, H, S]). ``chunk`` query rows at a time (default:
    ``reference.vsmooth_attn.row_chunk``)."""
    from .vsmooth_attn import row_chunk

    chunk = chunk or row_chunk(q.device)
    B, H, S, D = q.shape
    kf = k.float()
    vf = v.float()
    out = torch.empty(B, H, S, v.shape[-1], device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    for i0 in range(0, S, chunk):
        s = (q[:, :, i0:i0 + chunk].float() @ kf.transpose(-1, -2)) * (sm_scale * LOG2E)
        # normalised by the row sum, as the GPU's flash / cuDNN kernels do: through the LSE (p = 2^(s - lse2)) a
        # row of logits ~1e5 (sm_scale 1e4) lost ~0.5% to lse2's fp32 rounding (one ulp at that magnitude)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp2(s - m)
        l = p.sum(dim=-1, keepdim=True)
        out[:, :, i0:i0 + chunk] = (p @ vf) / l
        lse[:, :, i0:i0 + chunk] = (m + torch.log2(l)).squeeze(-1)
    return out, lse
