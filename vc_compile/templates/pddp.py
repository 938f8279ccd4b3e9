"""Fast PDDP query grouping on the GPU (SPEC 3.4 step 1): recursive principal-direction median splits
into groups of exactly C queries, all (b, h) and all segments of a tree level at once.

Contract: ``vc_compile/reference/pddp.py`` (same split rule, start vector, iteration count).

Notation
--------
q           [B, H, S, D] queries (any float dtype, last dim contiguous); BH = B * H.
C, G        group size; G = ceil(S / C); the last group may be partial.
sigma       [BH, S] int64, the current order (positions -> token ids); the result, [B, H, S].
segment     a run of g groups of the current order (positions [g0*C, min(S, (g0+g)*C))). Level d holds
            every node of depth d of the split tree; a segment with g > 1 is *active*: centre its rows,
            power-iterate ``v <- X^T X v / ||.||`` (n_iters times from the reference's start vector),
            project, stable-sort; the floor(g/2)*C smallest go left. Every segment of a level is
            processed at once, the tree is walked level by level (ceil(log2 G) levels).
sid         a segment's index within its level's partition (increases with position).
key         int64 ``sid << 32 | (order-preserving int32 of the projection) + 2^31``: one stable
            torch.sort of [BH, S] keys sorts every segment of a level in place.

Two paths per active segment, chosen by its size:
* big (rows * D > 16384): work items of up to CHUNK = 2048 rows. ``_seg_sum`` (row sums, atomics),
  ``_seg_cov`` (centred X^T X on tensor cores, tf32, atomics when a segment spans several chunks),
  ``_power`` (n_iters mat-vecs on the D x D matrix held in registers), ``_proj_key`` (projection ->
  sort key), then torch.sort of the keys and a gather of sigma. The covariance form reads X twice per
  level instead of 2 * n_iters + 1 times; it equals the reference's X^T (X v) up to rounding.
* small (rows * D <= 16384, e.g. the last levels at C = 64, D = 128: 2 groups): ``_small_seg`` holds
  the centred segment in registers, runs the reference's X-form power iteration, and sorts in-kernel
  (rank of ``proj_bits << 32 | local index`` by counting, i.e. a stable sort), scattering each token to
  its rank in the new sigma.

Grids: work-item kernels ``(n_work, BH)``; per-segment kernels ``(n_active, BH)``.
Duplicate queries: centred X = 0 (up to rounding) -> v = 0 (norm clamped at 1e-30) -> constant
projection -> the stable sort keeps the order: no NaN.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..reference.pddp import start_vector
from .sparse_attn import interpret_bound

CHUNK = 2048
BLOCK_R = 64
SMALL_ELEMS = 16384  # rows * D held in registers by _small_seg (8 warps: 64 fp32 per thread)


@triton.jit
def _load_rows(X, SIGMA, bh, H, S, pos, pmask, sxb, sxh, sxs, d):
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    tok = tl.load(SIGMA + bh.to(tl.int64) * S + pos, mask=pmask, other=0)
    x = tl.load(X + b * sxb + h * sxh + tok[:, None] * sxs + d[None, :], mask=pmask[:, None], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _seg_sum_kernel(X, SIGMA, SUM, W_SLOT, W_R0, W_R1, sxb, sxh, sxs, H, S, n_slots,
                    NB, D: tl.constexpr, BLOCK_R: tl.constexpr, NB_I: tl.constexpr):
    w = tl.program_id(0)
    bh = tl.program_id(1)
    slot = tl.load(W_SLOT + w)
    r0 = tl.load(W_R0 + w)
    r1 = tl.load(W_R1 + w)
    d = tl.arange(0, D)
    acc = tl.zeros([D], dtype=tl.float32)
    for i in range(0, NB_I if NB_I > 0 else NB):  # NB_I: see sparse_attn.interpret_bound
        pos = r0 + i * BLOCK_R + tl.arange(0, BLOCK_R)
        x = _load_rows(X, SIGMA, bh, H, S, pos, pos < r1, sxb, sxh, sxs, d)
        acc += tl.sum(x, 0)
    tl.atomic_add(SUM + (bh.to(tl.int64) * n_slots + slot) * D + d, acc)


@triton.jit
def _seg_cov_kernel(X, SIGMA, SUM, CNT, COV, W_SLOT, W_R0, W_R1, W_MULTI, sxb, sxh, sxs, H, S, n_slots,
                    NB, D: tl.constexpr, BLOCK_R: tl.constexpr, NB_I: tl.constexpr):
    w = tl.program_id(0)
    bh = tl.program_id(1)
    slot = tl.load(W_SLOT + w)
    r0 = tl.load(W_R0 + w)
    r1 = tl.load(W_R1 + w)
    multi = tl.load(W_MULTI + w)
    d = tl.arange(0, D)
    seg = bh.to(tl.int64) * n_slots + slot
    mean = tl.load(SUM + seg * D + d) / tl.load(CNT + slot)
    acc = tl.zeros([D, D], dtype=tl.float32)
    for i in range(0, NB_I if NB_I > 0 else NB):  # NB_I: see sparse_attn.interpret_bound
        pos = r0 + i * BLOCK_R + tl.arange(0, BLOCK_R)
        pm = pos < r1
        x = _load_rows(X, SIGMA, bh, H, S, pos, pm, sxb, sxh, sxs, d)
        xc = tl.where(pm[:, None], x - mean[None, :], 0.0)
        acc = tl.dot(tl.trans(xc), xc, acc)
    ptr = COV + seg * D * D + d[:, None] * D + d[None, :]
    many = (tl.zeros([D, D], dtype=tl.int32) + multi) != 0  # segment split over several work items
    tl.atomic_add(ptr, acc, mask=many)
    tl.store(ptr, acc, mask=~many)


@triton.jit
def _power_kernel(COV, V0, VOUT, n_slots, D: tl.constexpr, N_ITERS: tl.constexpr):
    slot = tl.program_id(0)
    bh = tl.program_id(1)
    d = tl.arange(0, D)
    seg = bh.to(tl.int64) * n_slots + slot
    c = tl.load(COV + seg * D * D + d[:, None] * D + d[None, :])
    v = tl.load(V0 + d)
    for _ in range(N_ITERS):
        v = tl.sum(c * v[None, :], 1)
        v = v / tl.maximum(tl.sqrt(tl.sum(v * v, 0)), 1e-30)
    tl.store(VOUT + seg * D + d, v)


@triton.jit
def _ordered_bits(p):
    """int32 whose signed order is the float order of p (-0.0 folded into +0.0)."""
    bits = (p + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _proj_key_kernel(X, SIGMA, SUM, CNT, VDIR, KEY, W_SLOT, W_R0, W_R1, SLOT_SID, sxb, sxh, sxs,
                     H, S, n_slots, NB, D: tl.constexpr, BLOCK_R: tl.constexpr, NB_I: tl.constexpr):
    w = tl.program_id(0)
    bh = tl.program_id(1)
    slot = tl.load(W_SLOT + w)
    r0 = tl.load(W_R0 + w)
    r1 = tl.load(W_R1 + w)
    sid = tl.load(SLOT_SID + slot).to(tl.int64)
    d = tl.arange(0, D)
    seg = bh.to(tl.int64) * n_slots + slot
    mean = tl.load(SUM + seg * D + d) / tl.load(CNT + slot)
    v = tl.load(VDIR + seg * D + d)
    for i in range(0, NB_I if NB_I > 0 else NB):  # NB_I: see sparse_attn.interpret_bound
        pos = r0 + i * BLOCK_R + tl.arange(0, BLOCK_R)
        pm = pos < r1
        x = _load_rows(X, SIGMA, bh, H, S, pos, pm, sxb, sxh, sxs, d)
        proj = tl.sum((x - mean[None, :]) * v[None, :], 1)
        key = (sid << 32) + _ordered_bits(proj).to(tl.int64) + 2147483648
        tl.store(KEY + bh.to(tl.int64) * S + pos, key, mask=pm)


@triton.jit
def _small_seg_kernel(X, SIG_IN, SIG_OUT, SS_R0, SS_CNT, V0, sxb, sxh, sxs, H, S,
                      D: tl.constexpr, BLOCK_L: tl.constexpr, N_ITERS: tl.constexpr):
    slot = tl.program_id(0)
    bh = tl.program_id(1)
    r0 = tl.load(SS_R0 + slot)
    cnt = tl.load(SS_CNT + slot)
    loc = tl.arange(0, BLOCK_L)
    lm = loc < cnt
    d = tl.arange(0, D)
    x = _load_rows(X, SIG_IN, bh, H, S, r0 + loc, lm, sxb, sxh, sxs, d)
    mean = tl.sum(x, 0) / cnt.to(tl.float32)
    xc = tl.where(lm[:, None], x - mean[None, :], 0.0)
    v = tl.load(V0 + d)
    for _ in range(N_ITERS):
        u = tl.sum(xc * v[None, :], 1)
        v = tl.sum(xc * u[:, None], 0)
        v = v / tl.maximum(tl.sqrt(tl.sum(v * v, 0)), 1e-30)
    proj = tl.sum(xc * v[None, :], 1)
    key = (_ordered_bits(proj).to(tl.int64) << 32) | loc.to(tl.int64)  # unique: stable order
    key = tl.where(lm, key, 9223372036854775807)  # padding ranks last (> any key, +inf included)
    # NOTE rank by counting (BLOCK_L^2 compares, 64 per thread at 128 rows) instead of tl.sort: the
    # interpreter runs tl.sort's bitonic network ~50x slower than the rest of the level.
    rank = tl.sum((key[None, :] < key[:, None]).to(tl.int32), 1)
    tok = tl.load(SIG_IN + bh.to(tl.int64) * S + r0 + loc, mask=lm, other=0)
    tl.store(SIG_OUT + bh.to(tl.int64) * S + r0 + rank, tok, mask=lm)


class _Level:
    """Host plan of one tree level (depends on S, C, D only; cached)."""

    def __init__(self, part, S, C, D, device):
        big, small = [], []
        base = []
        for sid, (g0, g) in enumerate(part):
            r0, r1 = g0 * C, min(S, (g0 + g) * C)
            base.append(torch.full((r1 - r0,), (sid << 32) + (1 << 31), dtype=torch.int64))
            if g > 1:
                (small if (r1 - r0) * D <= SMALL_ELEMS else big).append((sid, r0, r1))
        i32 = dict(dtype=torch.int32, device=device)
        self.n_big = len(big)
        if big:
            self.key_base = torch.cat(base).to(device)
            w = []
            for slot, (_, r0, r1) in enumerate(big):  # equal chunks of <= CHUNK rows
                n = triton.cdiv(r1 - r0, CHUNK)
                step = BLOCK_R * triton.cdiv(triton.cdiv(r1 - r0, n), BLOCK_R)
                w += [(slot, a, min(a + step, r1), int(n > 1)) for a in range(r0, r1, step)]
            self.n_work = len(w)
            self.nb = triton.cdiv(max(b - a for _, a, b, _ in w), BLOCK_R)  # row blocks per item
            self.w_slot, self.w_r0, self.w_r1, self.w_multi = (torch.tensor(c, **i32) for c in zip(*w))
            self.any_multi = any(m for *_, m in w)
            self.slot_sid = torch.tensor([s for s, _, _ in big], **i32)
            self.cnt = torch.tensor([float(r1 - r0) for _, r0, r1 in big], dtype=torch.float32, device=device)
        self.n_small = len(small)
        if small:
            self.ss_r0 = torch.tensor([r0 for _, r0, _ in small], **i32)
            self.ss_cnt = torch.tensor([r1 - r0 for _, r0, r1 in small], **i32)
            self.block_l = triton.next_power_of_2(max(r1 - r0 for _, r0, r1 in small))


@functools.lru_cache(maxsize=32)
def _plan(S: int, C: int, D: int, device: str):
    G = (S + C - 1) // C
    part, levels = [(0, G)], []
    while any(g > 1 for _, g in part):
        levels.append(_Level(part, S, C, D, device))
        part = [c for g0, g in part for c in (((g0, g // 2), (g0 + g // 2, g - g // 2)) if g > 1 else ((g0, g),))]
    return levels


def pddp_perm(q: torch.Tensor, group_size: int, n_iters: int = 8) -> torch.Tensor:
    """sigma [B, H, S] int64: a permutation per (b, h) whose consecutive C-chunks are the groups."""
    B, H, S, D = q.shape
    C = int(group_size)
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"pddp_perm: head dim must be a power of two in [16, 256], got {D}")
    if C < 1:
        raise ValueError(f"pddp_perm: group_size must be >= 1, got {C}")
    x = q if q.stride(-1) == 1 else q.contiguous()
    BH = B * H
    dev = q.device
    sigma = torch.arange(S, device=dev, dtype=torch.int64).expand(BH, S).contiguous()
    v0 = start_vector(D, dev).float().contiguous()
    strides = (x.stride(0), x.stride(1), x.stride(2))
    for lv in _plan(S, C, D, str(dev)):
        if lv.n_big:
            n = lv.slot_sid.numel()
            sums = torch.zeros(BH, n, D, device=dev, dtype=torch.float32)
            _seg_sum_kernel[(lv.n_work, BH)](x, sigma, sums, lv.w_slot, lv.w_r0, lv.w_r1, *strides, H, S, n, lv.nb,
                                            D=D, BLOCK_R=BLOCK_R, NB_I=interpret_bound(lv.nb), num_warps=4)
            cov = (torch.zeros if lv.any_multi else torch.empty)(BH, n, D, D, device=dev, dtype=torch.float32)
            _seg_cov_kernel[(lv.n_work, BH)](x, sigma, sums, lv.cnt, cov, lv.w_slot, lv.w_r0, lv.w_r1,
                                            lv.w_multi, *strides, H, S, n, lv.nb,
                                            D=D, BLOCK_R=BLOCK_R, NB_I=interpret_bound(lv.nb), num_warps=8)
            vdir = torch.empty(BH, n, D, device=dev, dtype=torch.float32)
            _power_kernel[(n, BH)](cov, v0, vdir, n, D=D, N_ITERS=int(n_iters), num_warps=8)
            del cov
            key = lv.key_base.expand(BH, S).contiguous()
            _proj_key_kernel[(lv.n_work, BH)](x, sigma, sums, lv.cnt, vdir, key, lv.w_slot, lv.w_r0, lv.w_r1,
                                             lv.slot_sid, *strides, H, S, n, lv.nb,
                                             D=D, BLOCK_R=BLOCK_R, NB_I=interpret_bound(lv.nb), num_warps=4)
            order = torch.sort(key, dim=1, stable=True).indices
            sigma = torch.gather(sigma, 1, order)
        if lv.n_small:
            out = sigma.clone()  # leaves (g = 1) keep their rows
            _small_seg_kernel[(lv.n_small, BH)](x, sigma, out, lv.ss_r0, lv.ss_cnt, v0, *strides, H, S,
                                               D=D, BLOCK_L=lv.block_l, N_ITERS=int(n_iters), num_warps=8)
            sigma = out
    return sigma.view(B, H, S)
