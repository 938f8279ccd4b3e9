"""Reference token-gather sparse attention (docs/methods.md, MC-Sparse steps 3-4, 6).

Oracle of ``vc_compile/kernels/sparse_attn.py``.

Notation
--------
sigma [B, H, S] query order; group g = queries ``sigma[g*C:(g+1)*C]``.
idx   [B, H, G, n] int16 / int32 / int64 selection of group g (sorted ascending): key ids (``run = 1``), or run
      numbers r of aligned runs of ``run`` keys, keys r*run .. r*run + run - 1 (``torch_ops.expand_runs``).
O_sparse_i = softmax over the selected keys of i's group only (renormalised), times their V rows;
written back in the original query order. ``residual`` (R = O_dense - O_sparse of the anchor step, in
the original order) is added in the epilogue: ``O = O_sparse(t) + R(tau)``; 8-bit codes (int8 / FP8) with ``res_scale``
[B, H, S] fp32 stand for codes x scale, in fp32 (``torch_ops.residual_values``).
flag  optional [B, H, Dv] int32 (``reference/finite_flags.py``): NaN in the flagged columns of each head.
"""
from __future__ import annotations

from typing import Optional

import torch

from vc_compile.formats import LOG2E
from vc_compile.torch_ops import expand_runs, gather_rows, residual_values

from .finite_flags import apply_flag


def sparse_attention(q, k, v, sigma, idx, *, sm_scale: float, group_size: int,
                     residual: Optional[torch.Tensor] = None, out_dtype=None, chunk_groups: int = 8,
                     flag: Optional[torch.Tensor] = None, run: int = 1, res_scale: Optional[torch.Tensor] = None):
    idx = expand_runs(idx, run)
    B, H, S, D = q.shape
    C = group_size
    G, keep = idx.shape[2], idx.shape[3]
    pad = G * C - S
    qs = gather_rows(q.float(), sigma)
    if pad:
        qs = torch.nn.functional.pad(qs, (0, 0, 0, pad))
    qs = qs.unflatten(2, (G, C))  # [B, H, G, C, D]
    kf, vf = k.float(), v.float()
    o = torch.empty(B, H, G, C, v.shape[-1], device=q.device, dtype=torch.float32)
    for g0 in range(0, G, chunk_groups):
        g1 = min(G, g0 + chunk_groups)
        ii = idx[:, :, g0:g1].reshape(B, H, -1)
        ks = gather_rows(kf, ii).unflatten(2, (g1 - g0, keep))
        vs = gather_rows(vf, ii).unflatten(2, (g1 - g0, keep))
        s = (qs[:, :, g0:g1] @ ks.transpose(-1, -2)) * (sm_scale * LOG2E)
        p = torch.softmax(s * (1.0 / LOG2E), dim=-1)
        o[:, :, g0:g1] = p @ vs
    o = o.flatten(2, 3)[:, :, :S]
    out = torch.empty_like(o)
    out.scatter_(2, sigma.long().unsqueeze(-1).expand_as(o), o)
    if residual is not None:
        out = out + residual_values(residual, res_scale)
    return apply_flag(out, flag).to(out_dtype or q.dtype)
