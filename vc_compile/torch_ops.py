"""Plain-torch steps that the production path runs on every device (CPU and GPU alike), and the fixed
start values that a kernel and its reference share. None of them is the reference of a kernel: each is the
one implementation, so the methods, ``ops.py`` and the kernels call it here and never import ``reference/``.

* ``safe_scale``: ``amax / qmax``, 1 for an all-zero block (the quantisation convention of reference/quant.py;
  MC-Sparse quantises its 8-bit residuals with it: ``row_codes``, back to fp32 by ``residual_values``).
* MC-Sparse selection outside the exact pass-2 kernel: the top-K of the group masses (``select_topk``), and
  the ablation variants of the paper's Table 5 (config ``selection`` / ``selection_unit`` / ``query_grouping``,
  docs/methods.md, MC-Sparse). All produce the same ``idx`` format, so the same gather kernel runs them; only the
  exact group masses have a kernel (``kernels/select.group_key_mass``).
  runs        the kept keys as aligned runs of ``run`` keys (config ``key_run``): entry r of a selection stands for
              keys r*run .. r*run + run - 1 (``expand_runs``); the top runs are ranked by their summed group mass
              (``run_mass``). ``run = 1`` is the token selection (one entry a key).
  identity    ``query_grouping="none"``: sigma = arange(S), i.e. contiguous query tiles of C.
  scores      ``selection="mean_pool"``: ``score[g, j] = (mean_{i in g} q_i) . k_j * sm_scale`` per key, or
              ``. mean_{j in block} k_j`` per key block (``mean_pool_scores``): the score of the mean query,
              which is not the mean of the queries' probabilities (the selection error of docs/methods.md, MC-Sparse).
              ``selection="exact"`` with blocks: the exact group masses summed over each key block
              (``block_mass``).
  blocks      key block b = keys [b*KV_TILE, (b+1)*KV_TILE) (the last one partial when Sk is not a multiple).
              ``expand_blocks`` ranks the blocks by score (descending) and keeps the first ``n_keep`` keys
              of the blocks in that order: whole blocks when Sk is a multiple of 64 (n_keep is a multiple of
              64), else the partial block, if chosen, leaves room for the first keys of the next-ranked
              block so every group keeps exactly n_keep keys.
* ``lse_correction``: the base-2 LSE shift that K smoothing removes (the cheap anchor adds it back).
* V-Smooth k-means: the number of clusters and the deterministic initial centroids (``init_centroids``:
  the rows at ``floor(j * S / K)``), shared by the kernel, the reference and the warm start.
* PDDP: the fixed start vector of the power iteration, shared by the kernel and the reference.
* RoPE: the fp32 rotation (``apply_rope``) that every path not fused into the preprocessing runs first, and
  the oracle of the fused prologue. The conventions (spec, tables, ``RopeArgs``) are in ``formats.py``.
  Precision: the rotation runs in fp32 and rounds once to the input dtype, as Wan (bf16 x times fp32
  tables), HunyuanVideo, LTX and CogVideoX (``x.float() * cos + ...``, ``.to(x.dtype)``) do; the products are
  summed in the models' order (``x*cos`` first), so it is bit-identical to those models' RoPE on CPU. A model
  that rotates in bf16 (tests/tiny_dit.py casts its tables to bf16) differs by bf16 roundings.
"""
from __future__ import annotations

import torch

from vc_compile.formats import BLOCK_V, FP8_MAX, KV_TILE, LOG2E, RopeArgs


def safe_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``amax / qmax``, or 1 where the block is all zero. (A NaN/Inf amax would give a NaN/Inf scale;
    callers pass the amax of the finite values and mark non-finite blocks with ``poison``.) A
    tensor-by-tensor division: torch divides by a Python scalar as a multiply by its reciprocal on CUDA,
    an ulp away from the kernels' IEEE division."""
    s = amax / torch.full_like(amax, qmax)
    return torch.where(amax == 0, torch.ones_like(s), s)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D], idx [B, H, N] -> [B, H, N, D]."""
    return torch.gather(x, 2, idx.long().unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def select_topk(mass: torch.Tensor, keep: int) -> torch.Tensor:
    """idx [..., keep] int32: the ``keep`` largest masses per row, sorted ascending (torch on every device; the
    Triton path uses it too).

    NOTE cost: torch.topk (radix select over each Sk row; unsorted output) then a sort of the kept
    indices; measured in benchmarks/bench_sparse_attn.py ("topk" rows; docs/design/anchor-mass-config.md). It reads
    the whole mass tensor once more (G * Sk * 4 bytes per head)."""
    idx = torch.topk(mass, keep, dim=-1, sorted=False).indices
    return torch.sort(idx, dim=-1).values.to(torch.int32)


def run_mass(mass: torch.Tensor, run: int) -> torch.Tensor:
    """mass [..., Sk] -> [..., Sk / run] fp32: the masses summed over each aligned run of ``run`` keys (Sk a multiple
    of ``run``); ``run = 1``: the masses as they are."""
    if run == 1:
        return mass
    Sk = mass.shape[-1]
    if Sk % run:
        raise ValueError(f"run_mass: {Sk} keys are not a whole number of runs of {run}")
    return mass.unflatten(-1, (Sk // run, run)).sum(dim=-1, dtype=torch.float32)


def expand_runs(idx: torch.Tensor, run: int) -> torch.Tensor:
    """idx [..., n] of runs -> [..., n * run] int64 key ids (ascending where the runs are); ``run = 1``: idx."""
    if run == 1:
        return idx
    return (idx.long().unsqueeze(-1) * run + torch.arange(run, device=idx.device)).flatten(-2)


def run_id_dtype(Sk: int, run: int) -> torch.dtype:
    """The narrowest signed dtype that holds every run number of ``Sk`` keys in runs of ``run``."""
    return torch.int16 if (Sk + run - 1) // run <= 2**15 - 1 else torch.int32


def row_codes(x: torch.Tensor, dtype: torch.dtype, heads: int = 8):
    """x [B, H, S, D] -> (8-bit codes [B, H, S, D], scale [B, H, S] fp32), one scale a row: int8 (amax / 127, rounded
    to nearest even) or FP8 E4M3 (amax / 448); ``heads`` at a time, so the fp32 temporaries are a few heads' (an MC-Sparse
    residual is 1.5 GB in fp32 at Wan 14B's 720p). ``residual_values`` is its inverse."""
    qmax = 127.0 if dtype == torch.int8 else FP8_MAX
    B, H, S, D = x.shape
    codes = torch.empty(B, H, S, D, device=x.device, dtype=dtype)
    scale = torch.empty(B, H, S, device=x.device, dtype=torch.float32)
    for h0 in range(0, H, heads):
        r = x[:, h0:h0 + heads].float()
        s = safe_scale(r.abs().amax(dim=-1), qmax)
        scale[:, h0:h0 + heads] = s
        y = (r / s.unsqueeze(-1)).clamp(-qmax, qmax)
        codes[:, h0:h0 + heads] = (torch.round(y) if dtype == torch.int8 else y).to(dtype)
    return codes, scale


def residual_values(residual, res_scale):
    """The residual R in fp32 from how it is kept: a 16/32-bit tensor, or 8-bit codes times their per-token scale
    ``res_scale`` [B, H, S] (the gather kernels' epilogue computes the same product in fp32); None stays None."""
    if residual is None:
        return None
    if res_scale is None:
        return residual.float()
    return residual.float() * res_scale.float().unsqueeze(-1)


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


def lse_correction(q: torch.Tensor, k_mean: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Base-2 LSE shift removed by K smoothing: ``(q . k_mean) * sm_scale * log2 e``, [B, H, S]."""
    return (q.float() @ k_mean.unsqueeze(-1)).squeeze(-1) * (sm_scale * LOG2E)


def default_clusters(S: int, block: int = BLOCK_V, cap: int = 256) -> int:
    """One cluster per V block of 128 rows, at most ``cap`` (flash-kmeans' 40 x 32760 x 128 benchmark
    uses K = 256)."""
    return max(1, min(cap, (S + block - 1) // block))


def sample_stride(S: int, K: int, stride: int, rows_per_cluster: int = 32) -> int:
    """The row stride of k-means' iterations: ``stride``, lowered so that the sampled rows keep at least
    ``rows_per_cluster`` per cluster (1: every row)."""
    return max(1, min(int(stride), S // max(1, rows_per_cluster * K)))


def init_centroids(x: torch.Tensor, K: int) -> torch.Tensor:
    S = x.shape[2]
    idx = (torch.arange(K, device=x.device) * S) // K
    return x[:, :, idx].float().clone()


def start_vector(D: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(0x5EED)
    return torch.randn(D, generator=g).to(device)


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
