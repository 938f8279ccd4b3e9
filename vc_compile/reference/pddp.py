"""Reference Fast PDDP query grouping (docs/methods.md, MC-Sparse step 1): recursive principal-direction median splits
into groups of exactly C queries.

Oracle of ``vc_compile/kernels/pddp.py``.

Notation
--------
q           [B, H, S, D] queries; every (b, h) is split independently, all heads at once.
C           group size (the sparse kernel's query tile); G = ceil(S / C) groups, the last one may be
            partial (S mod C queries).
segment     a run of ``g`` groups of the current order (g*C rows, or fewer for the run holding the
            partial group). A segment with g > 1 is split: centre its rows, run ``n_iters`` power
            iterations ``v <- X^T X v / ||.||`` from a fixed start vector, project ``X v``, stable-sort
            the projection and give the ``floor(g/2) * C`` smallest rows to the left child, the rest
            (holding the partial group, if any) to the right.
sigma       [B, H, S] int64: the final order; group j is ``sigma[..., j*C:(j+1)*C]``.
Degenerate data (duplicate queries: X = 0) gives v = 0, a constant projection, and the stable sort keeps
the current order: no NaN.
"""
from __future__ import annotations

import torch

from vc_compile.torch_ops import start_vector


def principal_projection(X: torch.Tensor, n_iters: int) -> torch.Tensor:
    """X [N, n, D] (centred) -> projection [N, n] on the top principal direction of each X."""
    v = start_vector(X.shape[-1], X.device).expand(X.shape[0], -1).contiguous()
    for _ in range(n_iters):
        v = ((X @ v.unsqueeze(-1)).transpose(-1, -2) @ X).squeeze(-2)
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return (X @ v.unsqueeze(-1)).squeeze(-1)


def pddp_perm(q: torch.Tensor, group_size: int, n_iters: int = 8) -> torch.Tensor:
    B, H, S, D = q.shape
    C = int(group_size)
    G = (S + C - 1) // C
    x = q.reshape(B * H, S, D).float()
    sigma = torch.arange(S, device=q.device).expand(B * H, S).clone()
    stack = [(0, G)]  # (first group, number of groups)
    while stack:
        g0, g = stack.pop()
        if g <= 1:
            continue
        r0, r1 = g0 * C, min(S, (g0 + g) * C)
        idx = sigma[:, r0:r1]
        X = torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, D))
        X = X - X.mean(dim=1, keepdim=True)
        proj = principal_projection(X, n_iters)
        order = torch.sort(proj, dim=1, stable=True).indices
        sigma[:, r0:r1] = torch.gather(idx, 1, order)
        gl = g // 2
        stack.append((g0 + gl, g - gl))
        stack.append((g0, gl))
    return sigma.view(B, H, S)
