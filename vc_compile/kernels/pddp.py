"""Fast PDDP query grouping on the GPU (docs/methods.md, MC-Sparse step 1): recursive principal-direction median splits
into groups of exactly C queries, all (b, h) and all segments of a tree level at once.

Contract: ``vc_compile/reference/pddp.py`` (same split rule, start vector, iteration count).

Notation
--------
q           [B, H, S, D] queries (any float dtype, last dim contiguous); BH = B * H.
C, G        group size; G = ceil(S / C); the last group may be partial.
sigma       [BH, S] int64, the current order (positions -> token ids); the result, [B, H, S].
segment     a run of g groups of the current order (positions [g0*C, min(S, (g0+g)*C))). Level d holds
            every node of depth d of the split tree; a segment with g > 1 is *active*: centre its rows,
            power-iterate ``v <- X^T X v / ||.||`` (n_iters times from ``torch_ops.start_vector``),
            project, stable-sort; the floor(g/2)*C smallest go left. Every segment of a level is
            processed at once, the tree is walked level by level (ceil(log2 G) levels).
sid         a segment's index within its level's partition (increases with position).
key         int64 ``sid << 32 | (order-preserving int32 of the projection) + 2^31``: one stable
            torch.sort of [BH, S] keys sorts every segment of a level in place.

Two paths per active segment, chosen by its size:
* big (rows * D > 16384): work items of up to CHUNK = 2048 rows. ``_moment`` gathers the rows once and
  accumulates the sum and the second moment of ``x - shift`` (shift = the parent segment's mean, so
  centring cancels little; three bf16 MMAs on a hi/lo split, ~2^-17 relative). When every segment of the level is one work item it also
  centres, power-iterates (n_iters mat-vecs on the D x D covariance in registers) and writes the mean
  and direction; otherwise it adds into buffers and ``_power`` finishes. ``_proj_key`` projects (second
  gather) and writes the sort key; one torch.sort of the keys and a gather of sigma end the level. The
  covariance form (X^T X) v equals the reference's X^T (X v) up to rounding and reads X twice per level
  instead of 2 * n_iters + 1 times.
* small (rows * D <= 16384, e.g. 2 groups at C = 64, D = 128): ``_small_seg`` holds the centred
  segment in registers, runs the reference's X-form power iteration, and ranks
  ``proj_bits << 32 | local index`` by counting (a stable sort), scattering each token to its rank.

Grids: work-item kernels ``(n_work, BH)``; per-segment kernels ``(n_active, BH)``.
Duplicate queries: centred X = 0 (up to rounding) -> v = 0 (norm clamped at 1e-30) -> constant
projection -> the stable sort keeps the order: no NaN.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from vc_compile.kernels.compat import assembled
from vc_compile.torch_ops import start_vector

from .configs import pow2_head_dim_error
from .interpret import dot_upcast, loop_bound

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
def _power(cov, v, N_ITERS: tl.constexpr):
    """n_iters steps of v <- cov v / max(||cov v||, 1e-30) (the reference's X^T (X v) with cov = X^T X)."""
    for _ in range(N_ITERS):
        v = tl.sum(cov * v[None, :], 1)
        v = v / tl.maximum(tl.sqrt(tl.sum(v * v, 0)), 1e-30)
    return v


@triton.jit
def _moment_kernel(X, SIGMA, SHIFT, CNT, SUM, MOM, MEAN, VDIR, V0, W_SLOT, W_R0, W_R1,
                   sxb, sxh, sxs, H, S, n_slots, NB,
                   D: tl.constexpr, BLOCK_R: tl.constexpr, NB_I: tl.constexpr, FUSED: tl.constexpr,
                   N_ITERS: tl.constexpr, UPCAST: tl.constexpr):
    """Shifted moments of one work item's rows: s = sum(x - shift), M = sum (x - shift)(x - shift)^T
    (bf16 hi/lo MMAs, ~2^-17 relative). shift = the parent segment's mean, so the centring M - s s^T / n
    cancels little. FUSED (every segment of the level is one work item): centre, power-iterate and write
    the segment's mean and direction here; else add into SUM / MOM for _power_kernel."""
    w = tl.program_id(0)
    bh = tl.program_id(1)
    slot = tl.load(W_SLOT + w)
    r0 = tl.load(W_R0 + w)
    r1 = tl.load(W_R1 + w)
    d = tl.arange(0, D)
    seg = bh.to(tl.int64) * n_slots + slot
    shift = tl.load(SHIFT + seg * D + d)
    acc_s = tl.zeros([D], dtype=tl.float32)
    acc_m = tl.zeros([D, D], dtype=tl.float32)
    for i in range(0, NB_I if NB_I >= 0 else NB):  # NB_I: interpret.loop_bound
        pos = r0 + i * BLOCK_R + tl.arange(0, BLOCK_R)
        pm = pos < r1
        x = _load_rows(X, SIGMA, bh, H, S, pos, pm, sxb, sxh, sxs, d)
        xs = tl.where(pm[:, None], x - shift[None, :], 0.0)
        acc_s += tl.sum(xs, 0)
        # NOTE x^T x as three bf16 MMAs on a hi/lo split (~2^-17 relative): fp32 operands cannot be fed
        # transposed to wgmma, so the tf32x3 form spent its time in layout conversions; bf16 ones can
        # (docs/design/pddp-kernel.md)
        hi = xs.to(tl.bfloat16)
        lo = (xs - hi.to(tl.float32)).to(tl.bfloat16)
        if UPCAST:  # interpreter: see sparse_attn.dot_upcast
            hi = hi.to(tl.float32)
            lo = lo.to(tl.float32)
        hit = tl.trans(hi)
        acc_m = tl.dot(hit, hi, acc_m)
        acc_m = tl.dot(hit, lo, acc_m)
        acc_m = tl.dot(tl.trans(lo), hi, acc_m)
    if FUSED:
        n = tl.load(CNT + slot)
        m = acc_s / n
        v = _power(acc_m - (acc_s / n)[:, None] * acc_s[None, :], tl.load(V0 + d), N_ITERS)
        tl.store(MEAN + seg * D + d, shift + m)
        tl.store(VDIR + seg * D + d, v)
    else:
        tl.atomic_add(SUM + seg * D + d, acc_s)
        tl.atomic_add(MOM + seg * D * D + d[:, None] * D + d[None, :], acc_m)


@triton.jit
def _power_kernel(SHIFT, CNT, SUM, MOM, MEAN, VDIR, V0, n_slots, D: tl.constexpr, N_ITERS: tl.constexpr):
    slot = tl.program_id(0)
    bh = tl.program_id(1)
    d = tl.arange(0, D)
    seg = bh.to(tl.int64) * n_slots + slot
    s = tl.load(SUM + seg * D + d)
    n = tl.load(CNT + slot)
    mom = tl.load(MOM + seg * D * D + d[:, None] * D + d[None, :])
    v = _power(mom - (s / n)[:, None] * s[None, :], tl.load(V0 + d), N_ITERS)
    tl.store(MEAN + seg * D + d, tl.load(SHIFT + seg * D + d) + s / n)
    tl.store(VDIR + seg * D + d, v)


@triton.jit
def _ordered_bits(p):
    """int32 whose signed order is the float order of p (-0.0 folded into +0.0)."""
    bits = (p + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _proj_key_kernel(X, SIGMA, MEAN, VDIR, KEY, W_SLOT, W_R0, W_R1, SLOT_SID, sxb, sxh, sxs,
                     H, S, n_slots, NB, D: tl.constexpr, BLOCK_R: tl.constexpr, NB_I: tl.constexpr):
    w = tl.program_id(0)
    bh = tl.program_id(1)
    slot = tl.load(W_SLOT + w)
    r0 = tl.load(W_R0 + w)
    r1 = tl.load(W_R1 + w)
    sid = tl.load(SLOT_SID + slot).to(tl.int64)
    d = tl.arange(0, D)
    seg = bh.to(tl.int64) * n_slots + slot
    mean = tl.load(MEAN + seg * D + d)
    v = tl.load(VDIR + seg * D + d)
    for i in range(0, NB_I if NB_I >= 0 else NB):  # NB_I: interpret.loop_bound
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

    def __init__(self, part, prev_slots, S, C, D, device):
        big, small, base = [], [], []
        for sid, (g0, g) in enumerate(part):
            r0, r1 = g0 * C, min(S, (g0 + g) * C)
            base.append(torch.full((r1 - r0,), (sid << 32) + (1 << 31), dtype=torch.int64))
            if g > 1:
                (small if (r1 - r0) * D <= SMALL_ELEMS else big).append((sid, r0, r1, g0, g))
        i32 = dict(dtype=torch.int32, device=device)
        self.slots = {}  # (g0, g) -> slot of a big segment: the children's parent mean
        self.n_big = len(big)
        if big:
            self.key_base = torch.cat(base).to(device)
            # parent of each big segment: a big segment of the previous level (slot 0: the root)
            self.parent = torch.tensor([prev_slots.get(_parent(g0, g, prev_slots), 0)
                                        for _, _, _, g0, g in big], dtype=torch.int64, device=device)
            self.slots = {(g0, g): i for i, (_, _, _, g0, g) in enumerate(big)}
            w = []
            for slot, (_, r0, r1, _, _) in enumerate(big):  # equal chunks of <= CHUNK rows
                n = triton.cdiv(r1 - r0, CHUNK)
                step = BLOCK_R * triton.cdiv(triton.cdiv(r1 - r0, n), BLOCK_R)
                w += [(slot, a, min(a + step, r1)) for a in range(r0, r1, step)]
            self.n_work = len(w)
            self.fused = len(w) == len(big)  # every segment is one work item
            self.nb = triton.cdiv(max(b - a for _, a, b in w), BLOCK_R)  # row blocks per work item
            self.w_slot, self.w_r0, self.w_r1 = (torch.tensor(c, **i32) for c in zip(*w))
            self.slot_sid = torch.tensor([b[0] for b in big], **i32)
            self.cnt = torch.tensor([float(b[2] - b[1]) for b in big], dtype=torch.float32, device=device)
        self.n_small = len(small)
        if small:
            self.ss_r0 = torch.tensor([b[1] for b in small], **i32)
            self.ss_cnt = torch.tensor([b[2] - b[1] for b in small], **i32)
            self.block_l = triton.next_power_of_2(max(b[2] - b[1] for b in small))


def _parent(g0, g, prev_slots):
    """The previous level's segment (g0', g') that split into (g0, g)."""
    for (p0, pg) in prev_slots:
        if p0 <= g0 and g0 + g <= p0 + pg:
            return (p0, pg)
    return None


@functools.lru_cache(maxsize=32)
def _plan(S: int, C: int, D: int, device: str):
    G = (S + C - 1) // C
    part, levels, prev = [(0, G)], [], {}
    while any(g > 1 for _, g in part):
        lv = _Level(part, prev, S, C, D, device)
        levels.append(lv)
        prev = lv.slots
        part = [c for g0, g in part for c in (((g0, g // 2), (g0 + g // 2, g - g // 2)) if g > 1 else ((g0, g),))]
    return levels


def _mark(marks, name):
    if marks is not None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, ev))


def pddp_perm(q: torch.Tensor, group_size: int, n_iters: int = 8, *, marks: Optional[list] = None) -> torch.Tensor:
    """sigma [B, H, S] int64: a permutation per (b, h) whose consecutive C-chunks are the groups. ``marks``: a
    list that receives (stage, recorded cuda.Event) pairs (benchmarks/bench_sparse_attn.py times the stages)."""
    B, H, S, D = q.shape
    C = int(group_size)
    err = pow2_head_dim_error(D)
    if err:
        raise ValueError(f"pddp_perm: {err}")
    if C < 1:
        raise ValueError(f"pddp_perm: group_size must be >= 1, got {C}")
    x = q if q.stride(-1) == 1 else q.contiguous()
    BH = B * H
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    sigma = torch.arange(S, device=dev, dtype=torch.int64).expand(BH, S).contiguous()
    v0 = start_vector(D, dev).float().contiguous()
    strides = (x.stride(0), x.stride(1), x.stride(2))
    _mark(marks, "start")
    mean = torch.mean(x, dim=2, dtype=torch.float32).reshape(BH, 1, D)  # the root's shift
    for li, lv in enumerate(_plan(S, C, D, str(dev))):
        if lv.n_big:
            n = lv.cnt.numel()
            shift = mean.index_select(1, lv.parent).contiguous()
            mean, vdir = torch.empty(BH, n, D, **f32), torch.empty(BH, n, D, **f32)
            if lv.fused:
                sums = mom = mean  # unused
            else:
                sums, mom = torch.zeros(BH, n, D, **f32), torch.zeros(BH, n, D, D, **f32)
            _moment_kernel[(lv.n_work, BH)](x, sigma, shift, lv.cnt, sums, mom, mean, vdir, v0,
                                            lv.w_slot, lv.w_r0, lv.w_r1, *strides, H, S, n, lv.nb,
                                            D=D, BLOCK_R=BLOCK_R, NB_I=loop_bound(lv.nb), FUSED=lv.fused,
                                            N_ITERS=int(n_iters), UPCAST=dot_upcast(torch.bfloat16), num_warps=8)
            if not lv.fused:
                _power_kernel[(n, BH)](shift, lv.cnt, sums, mom, mean, vdir, v0, n, D=D,
                                       N_ITERS=int(n_iters), num_warps=8)
            _mark(marks, f"L{li} moments+power ({n} big)")
            key = lv.key_base.expand(BH, S).contiguous()
            _proj_key_kernel[(lv.n_work, BH)](x, sigma, mean, vdir, key, lv.w_slot, lv.w_r0, lv.w_r1,
                                             lv.slot_sid, *strides, H, S, n, lv.nb,
                                             D=D, BLOCK_R=BLOCK_R, NB_I=loop_bound(lv.nb), num_warps=4)
            _mark(marks, f"L{li} proj")
            order = torch.sort(key, dim=1, stable=True).indices
            sigma = torch.gather(sigma, 1, order)
            _mark(marks, f"L{li} sort")
        if lv.n_small:
            out = sigma.clone()  # leaves (g = 1) keep their rows
            _small_seg_kernel[(lv.n_small, BH)](x, sigma, out, lv.ss_r0, lv.ss_cnt, v0, *strides, H, S,
                                               D=D, BLOCK_L=lv.block_l, N_ITERS=int(n_iters),
                                               num_warps=8 if lv.block_l * D <= 16384 else 16)
            sigma = out
            _mark(marks, f"L{li} small ({lv.n_small} segs)")
    return sigma.view(B, H, S)


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
