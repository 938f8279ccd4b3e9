"""Reference MC-Sparse exact selection (docs/methods.md, MC-Sparse step 2): group masses from exact probabilities, top-K.

Oracle of ``vc_compile/kernels/select.py``.

Notation
--------
sigma       [B, H, S] query order from PDDP; group g = queries ``sigma[g*C:(g+1)*C]`` (last may be partial).
lse2        [B, H, S] base-2 LSE of the *true* logits (pass 1; add the K-smoothing correction first if
            pass 1 ran on smoothed K).
mass        [B, H, G, Sk] fp32: ``mass[g, j] = sum_{i in g} 2^{s_ij - lse2_i}`` -- exact probabilities
            summed over the group's rows, recomputed per tile (the kernel never stores an S x S matrix).
n_keep      keys kept per group: ``round(density * Sk)`` rounded *up* to the KV tile (64), at least one
            tile, at most Sk (``formats.n_keep``).
idx         [B, H, G, n_keep] int32, the top-``n_keep`` keys of each group, sorted ascending.

The top-K of the masses (``n_keep`` keys per group: ``formats.n_keep``) and the ablation variants of the
selection are plain torch on every device: ``vc_compile/torch_ops.py``.
"""
from __future__ import annotations

import torch

from vc_compile.formats import LOG2E
from vc_compile.torch_ops import gather_rows


def group_key_mass(q, k, sigma, lse2, *, sm_scale: float, group_size: int, chunk_groups: int = 16):
    B, H, S, D = q.shape
    Sk = k.shape[2]
    C = group_size
    G = (S + C - 1) // C
    pad = G * C - S
    qs = gather_rows(q.float(), sigma)
    ls = torch.gather(lse2, 2, sigma.long())
    if pad:
        qs = torch.nn.functional.pad(qs, (0, 0, 0, pad))
        ls = torch.nn.functional.pad(ls, (0, pad), value=float("inf"))  # padded rows: p = 0
    kf = k.float().transpose(-1, -2)
    mass = torch.empty(B, H, G, Sk, device=q.device, dtype=torch.float32)
    for g0 in range(0, G, chunk_groups):
        g1 = min(G, g0 + chunk_groups)
        s = (qs[:, :, g0 * C:g1 * C] @ kf) * (sm_scale * LOG2E)
        p = torch.exp2(s - ls[:, :, g0 * C:g1 * C, None])
        mass[:, :, g0:g1] = p.unflatten(2, (g1 - g0, C)).sum(dim=3)
    return mass
