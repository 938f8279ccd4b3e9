"""Reference MC-Sparse exact selection (SPEC 3.4 step 2): group masses from exact probabilities, top-K.

Oracle of ``vc_compile/templates/select.py``.

Notation
--------
sigma       [B, H, S] query order from PDDP; group g = queries ``sigma[g*C:(g+1)*C]`` (last may be partial).
lse2        [B, H, S] base-2 LSE of the *true* logits (pass 1; add the K-smoothing correction first if
            pass 1 ran on smoothed K).
mass        [B, H, G, Sk] fp32: ``mass[g, j] = sum_{i in g} 2^{s_ij - lse2_i}`` -- exact probabilities
            summed over the group's rows, recomputed per tile (the kernel never stores an S x S matrix).
n_keep      keys kept per group: ``round(density * Sk)`` rounded *up* to the KV tile (64), at least one
            tile, at most Sk.
idx         [B, H, G, n_keep] int32, the top-``n_keep`` keys of each group, sorted ascending.

Ablation variants (config ``selection`` / ``selection_unit`` / ``query_grouping``; the ladder of the
paper's Table 5, docs/sparse_notes.md). All produce the same ``idx`` format, so the same gather kernel runs
them. They are plain torch (device-agnostic) and shared by the Triton path: only the group masses of the
exact selection have a kernel (``templates/select.group_key_mass``).
identity    ``query_grouping="none"``: sigma = arange(S), i.e. contiguous query tiles of C.
scores      ``selection="mean_pool"``: ``score[g, j] = (mean_{i in g} q_i) . k_j * sm_scale`` per key, or
            ``. mean_{j in block} k_j`` per key block (``mean_pool_scores``): the score of the mean query,
            which is not the mean of the queries' probabilities (the selection error of SPEC 3.4).
            ``selection="exact"`` with blocks: the exact group masses summed over each key block
            (``block_mass``).
blocks      key block b = keys [b*KV_TILE, (b+1)*KV_TILE) (the last one partial when Sk is not a multiple).
            ``expand_blocks`` ranks the blocks by score (descending) and keeps the first ``n_keep`` keys
            of the blocks in that order: whole blocks when Sk is a multiple of 64 (n_keep is a multiple of
            64), else the partial block, if chosen, leaves room for the first keys of the next-ranked
            block so every group keeps exactly n_keep keys.
"""
from __future__ import annotations

import torch

from vc_compile.formats import KV_TILE, LOG2E


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D], idx [B, H, N] -> [B, H, N, D]."""
    return torch.gather(x, 2, idx.long().unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


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


def select_topk(mass: torch.Tensor, keep: int) -> torch.Tensor:
    """idx [..., keep] int32: the ``keep`` largest masses per row, sorted ascending (torch on every device; the
    Triton path uses it too).

    NOTE cost: torch.topk (radix select over each Sk row; unsorted output) then a sort of the kept
    indices; measured in benchmarks/bench_sparse_attn.py ("topk" rows, docs/sparse_notes.md). It reads
    the whole mass tensor once more (G * Sk * 4 bytes per head)."""
    idx = torch.topk(mass, keep, dim=-1, sorted=False).indices
    return torch.sort(idx, dim=-1).values.to(torch.int32)


def identity_perm(B: int, H: int, S: int, device) -> torch.Tensor:
    """sigma [B, H, S] int64 = arange(S): groups are contiguous query tiles (``query_grouping="none"``)."""
    return torch.arange(S, device=device).expand(B, H, S).contiguous()


def _group_means(x: torch.Tensor, order: torch.Tensor, size: int) -> torch.Tensor:
    """x [B, H, N, D] fp32, order [B, H, N] -> [B, H, ceil(N/size), D]: the mean of each run of ``size``
    rows of x in ``order`` (the last run may be partial: the mean of its rows only)."""
    B, H, N, D = x.shape
    n = (N + size - 1) // size
    xs = gather_rows(x, order) if order is not None else x
    pad = n * size - N
    if pad:
        xs = torch.nn.functional.pad(xs, (0, 0, 0, pad))
    sums = xs.unflatten(2, (n, size)).sum(dim=3)
    counts = torch.full((n,), float(size), device=x.device)
    counts[-1] = N - (n - 1) * size
    return sums / counts[:, None]


def mean_pool_scores(q, k, sigma, *, sm_scale: float, group_size: int, block: int) -> torch.Tensor:
    """[B, H, G, Sk] (``block == 1``) or [B, H, G, ceil(Sk/block)] fp32: the logit of each group's mean
    query against each key (or each key block's mean key). Ranking logits ranks the softmax of the mean
    query too (softmax is monotonic per row), which is what MInference / SpargeAttn-style block selection
    does."""
    qm = _group_means(q.float(), sigma, group_size)
    km = k.float() if block == 1 else _group_means(k.float(), None, block)
    return (qm @ km.transpose(-1, -2)) * sm_scale


def block_mass(mass: torch.Tensor, block: int) -> torch.Tensor:
    """mass [B, H, G, Sk] -> [B, H, G, ceil(Sk/block)]: exact group masses summed over each key block."""
    Sk = mass.shape[-1]
    nb = (Sk + block - 1) // block
    pad = nb * block - Sk
    if pad:
        mass = torch.nn.functional.pad(mass, (0, pad))
    return mass.unflatten(-1, (nb, block)).sum(dim=-1)


def expand_blocks(scores: torch.Tensor, keep: int, Sk: int, block: int = KV_TILE) -> torch.Tensor:
    """scores [B, H, G, NB] (key block scores) -> idx [B, H, G, keep] int32 ascending: the first ``keep``
    keys of the blocks taken in descending score order (see the module docstring)."""
    *lead, nb = scores.shape
    if keep >= Sk:
        return torch.arange(Sk, device=scores.device, dtype=torch.int32).expand(*lead, Sk).contiguous()
    m = min(nb, -(-keep // block) + 1)  # enough blocks for keep keys even if the partial one is among them
    order = torch.topk(scores, m, dim=-1, sorted=True).indices  # descending score
    tok = order.unsqueeze(-1) * block + torch.arange(block, device=scores.device)  # [..., m, block]
    tok = tok.flatten(-2)
    valid = tok < Sk
    take = valid & (torch.cumsum(valid.to(torch.int32), dim=-1) <= keep)
    # every row takes exactly keep keys; a stable sort moves them to the front in rank order without the
    # device -> host sync of boolean indexing (this runs at every sparse step for selection_refresh
    # "every_step")
    first = torch.sort((~take).to(torch.uint8), dim=-1, stable=True).indices[..., :keep]
    idx = torch.gather(tok, -1, first)
    return torch.sort(idx.to(torch.int32), dim=-1).values
