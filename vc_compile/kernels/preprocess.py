"""Preprocessing kernels of the 8-bit attention (docs/methods.md, Preprocessing; V-Smooth steps 2-3): Q/K smoothing, rotation and
INT8/FP8 quantisation, and V-Smooth (gather, block means, FP8 residual written K-major).

Contract: ``vc_compile/reference/preprocess.py`` (same named tuples, same conventions).

Notation
--------
B, H, S, D   batch, heads, tokens, head dim (64 or 128); inputs [B, H, S, D] with ANY strides (e.g. the
             permuted view of a [B, S, H, D] tensor), read through their strides.
perm         [B, H, S] int64 key/value order (V-Smooth clusters) or None; row t of K' / V' is row perm[t].
TQ           Q tokens per program (128); q_scale is per token (formats.BLOCK_Q = 1).
BK, BV       tokens per K scale (64), rows per V mean (128) -- BLOCK_* of formats.py.
kbar         [B, H, D] mean of K (fp32) over a token sample (reference ``k_mean_mask``: every st-th
             64-token block, >= 4096 tokens), removed before rotation (softmax ignores it).
Hd           orthonormal D x D Hadamard matrix = Hpm / sqrt(D), Hpm its +-1 version.
q8, k8       int8 ([-127, 127]) or E4M3 codes of ``x * inv``, inv = qmax / amax (one IEEE division per
             row/block; reference.quant), one scale per Q token / per 64-token K block (amax / qmax, 1 for
             an all-zero block); ``sm_scale * log2 e`` folded into q_scale [B, H, S].
non-finite   (NaN/Inf inputs, the reference's rules) a Q row / K block holding one gets all-zero codes
             and scale NaN, found from a NaN-propagating amax (``max.NaN``; no per-element test); a
             non-finite K mean makes every q_scale of the head NaN; a non-finite V channel gets v_scale
             NaN (carried through ``atomic_max`` as +inf, the one value that wins it: tl.max /
             atomic_max / GPU min-max drop NaN) and the codes of its finite part.
mu_j         [D] mean of V' block j (valid rows only); R = V' - mu, quantised per channel to E4M3 with
             v_scale[d] = amax_t |R[t, d]| / 448 over the whole head; stored transposed v8t [B, H, D, S_pad].

Kernels and grids (``preprocess``: two launches; ``preprocess_qk`` / ``preprocess_v`` run the same two passes
for Q/K or V alone)
-----------------
* ``_stats_kernel`` (pass 1) grid (splits, B*H): partial column sums of K over its share of the sampled
  64-token blocks (the K mean must be known before any block is quantised), and, with V, the block means mu_j
  (stored) and the residual's per-channel amax over its share of V's 128-row blocks (rows gathered through
  perm; +inf marks a channel with a non-finite value). Splits: ``PreprocessConfig.stats_per_sm`` x SMs / heads.
* ``_quant_kernel`` (pass 2) grid (ceil(S/128), B*H): one program = V' block pid (quantised to E4M3 with the
  head's per-channel scale, the max of pass 1's partial amaxes, stored transposed and zero-padded to S_pad;
  ``v_layout="sm90"``: the key order of the sm_90 kernel's register P~, plus mu' and its tf32 groups), then 128
  Q tokens (one scale each) and the two 64-token K' blocks at the same positions, K's mean reduced from pass
  1's partial sums in a fixed order (every program gets the same bits). One read + one write per tensor (V is
  read twice: once per pass).
  Rotation: ``x @ Hpm`` as one ``tl.dot`` in the input dtype (the products by +-1 are exact, fp32
  accumulation), times 1/sqrt(D); for K the rotated mean ``kbar @ Hd`` is subtracted (H(k - kbar) =
  Hk - H kbar), which matches the reference up to fp32 rounding (rare one-code differences).
* RoPE prologue (``rope=`` a ``formats.RopeArgs``): both passes rotate the Q/K rows they load
  (``kernels/rope.py``: the jit helpers, their layouts and the measurements behind them), so q and k are read
  un-rotated from the model's tensor and never written rotated. With RoPE the grid of pass 2 is
  (B*H, ceil(S/128)) (``PreprocessConfig.rope_head_fast``) and the Q tile runs as two 64-row halves (register
  pressure).
NOTE two passes, because K's mean must be known before any K block is quantised: they replaced 14 launches at a
fraction of their time, and one persistent launch reading V from DRAM once was slower (docs/design/preprocess-launch.md).

Exactness: the per-row/block divisions are ``div_rn`` (IEEE, like torch), INT8 codes are the low byte
of ``fma(x, inv, 1.5 * 2^23)`` (round to nearest even of the exact product, = the reference's float64
product rounded), so q8 matches the reference code for code;
k8, v8t may differ by one code where the mean (summed in another order) moves a value across a
rounding boundary. Under TRITON_INTERPRET=1 the fp32 -> e4m3 cast of Triton 3.6 mis-rounds (ties,
carries into the exponent, subnormals), so values are first rounded to the E4M3 grid in fp32
(``round_e4m3``) and the cast then only sees exact values; the GPU path uses the hardware cast (RNE).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from vc_compile.formats import (BLOCK_K, BLOCK_Q, BLOCK_V, LOG2E, V_LAYOUTS, QKQuant, VQuant, hadamard_matrix,
                                k_mean_stride)
from vc_compile.kernels.compat import assembled
from vc_compile.kernels.configs import PREPROCESS_DEFAULT, PreprocessConfig, vsmooth_head_dim_error
from vc_compile.kernels.interpret import interpreting, loop_bound
from vc_compile.kernels.launch import OFFLINE_SMS, sm_count
from vc_compile.kernels.soft_round import round_e4m3
from vc_compile.kernels.rope import colsum_rope_kwargs, pair_words_ok, rope_kwargs, rope_pairs_packed, rope_rows

FP8 = torch.float8_e4m3fn
PART_ROWS = tl.constexpr(32)  # pass 1's partials pass 2 reduces a step (see _k_mean_cols)
TILE_Q = 128  # Q tokens per program of _quant_kernel (its two 64-token K blocks sit at the same rows)
assert BLOCK_Q == 1, "the kernel writes one Q scale per token"


MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: fp32 x + MAGIC (|x| < 2^22) is round-to-nearest-even(x) in the low bits


@triton.jit
def _nanmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _codes(x, inv, bad, FP8_OUT: tl.constexpr, INTERPRET: tl.constexpr):
    """Codes of fp32 ``x * inv`` (inv = QMAX / amax, |x| <= amax, broadcast like ``bad``); 0 where ``bad``.
    INT8: one FMA ``fma(x, inv, MAGIC)`` rounds the EXACT product to nearest even (the reference's
    ``quant.quantize_int8``), its low byte is the two's-complement code (no clamp: |x * inv| <= 127, no
    F2I conversion). FP8: one multiply and the cast (round to nearest even)."""
    if FP8_OUT:
        y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        y = tl.where(bad, 0.0, y)
        if INTERPRET:
            y = round_e4m3(y)
        codes = y.to(tl.float8e4nv)
    else:
        if INTERPRET:  # no fused multiply-add there: the product in fp64 (exact) + MAGIC, then to fp32
            t = (x.to(tl.float64) * inv.to(tl.float64) + MAGIC).to(tl.float32)
        else:
            t = tl.fma(x, inv, MAGIC)
        t = tl.where(bad, MAGIC, t)
        codes = t.to(tl.int32, bitcast=True).to(tl.int8)
    return codes


@triton.jit
def _scales(amax, QMAX: tl.constexpr):
    """amax (NaN-propagating: NaN / +inf when the row/block holds a non-finite value) -> (scale, inv, bad):
    scale = amax / QMAX (NaN when bad, 1 for an all-zero row), inv = QMAX / amax (1 when bad or zero), one
    IEEE division each per row/block. A row whose QMAX / amax overflows counts as zero (reference
    ``quant.flush_tiny``)."""
    bad = ~(amax < float("inf"))
    a = tl.where(bad | (amax == 0.0), QMAX, amax)
    inv = tl.math.div_rn(tl.full(a.shape, QMAX, tl.float32), a)
    tiny = ~(inv < float("inf"))  # QMAX / amax overflows (amax < ~1e-36): all-zero codes, scale 1
    scale = tl.where(bad, float("nan"), tl.where(tiny, 1.0, tl.math.div_rn(a, tl.full(a.shape, QMAX, tl.float32))))
    return scale, tl.where(tiny, 1.0, inv), bad


@triton.jit
def _quant_tile(x, QMAX: tl.constexpr, FP8_OUT: tl.constexpr, INTERPRET: tl.constexpr,
                PER_ROW: tl.constexpr = False):
    """fp32 tile (padding rows already 0) -> (codes, scale): one scale for the whole tile, or one per row
    ([rows]) when PER_ROW. A row/tile holding a non-finite value gets all-zero codes and scale NaN (module
    doc). Per element: one max, one FMA (or multiply), one select and the byte packing."""
    amax = tl.reduce(tl.abs(x), 1, _nanmax)
    if PER_ROW:
        scale, inv, bad = _scales(amax, QMAX)
        codes = _codes(x, inv[:, None], bad[:, None], FP8_OUT, INTERPRET)
    else:
        scale, inv, bad = _scales(tl.reduce(amax, 0, _nanmax), QMAX)
        codes = _codes(x, inv, bad, FP8_OUT, INTERPRET)
    return codes, scale


@triton.jit
def _quant_pair(xe, xo, QMAX: tl.constexpr, FP8_OUT: tl.constexpr, INTERPRET: tl.constexpr,
                PER_ROW: tl.constexpr = False):
    """``_quant_tile`` of the tile whose even / odd channels are ``xe`` / ``xo`` [R, D/2] (same scale, same
    codes), returned as the two codes packed little-endian into int16 [R, D/2] (= the int8 [R, D] row)."""
    amax = tl.reduce(_nanmax(tl.abs(xe), tl.abs(xo)), 1, _nanmax)
    if PER_ROW:
        scale, inv, bad = _scales(amax, QMAX)
        ce = _codes(xe, inv[:, None], bad[:, None], FP8_OUT, INTERPRET)
        co = _codes(xo, inv[:, None], bad[:, None], FP8_OUT, INTERPRET)
    else:
        scale, inv, bad = _scales(tl.reduce(amax, 0, _nanmax), QMAX)
        ce = _codes(xe, inv, bad, FP8_OUT, INTERPRET)
        co = _codes(xo, inv, bad, FP8_OUT, INTERPRET)
    ce = ce.to(tl.int8, bitcast=True).to(tl.int16)
    co = co.to(tl.int8, bitcast=True).to(tl.int16)
    return (ce & 255) | (co << 8), scale


@triton.jit
def _source_rows(PERM, b, h, rows, rmask, spb, sph, sps, HAS_PERM: tl.constexpr):
    """The input rows that rows ``rows`` of K' / V' hold: perm[b, h, rows] (the V-Smooth key order), or the rows
    themselves without a permutation."""
    if HAS_PERM:
        src = tl.load(PERM + b.to(tl.int64) * spb + h.to(tl.int64) * sph + rows * sps, mask=rmask, other=0)
    else:
        src = rows
    return src


@triton.jit
def _slice_sources(PERM, b, h, blk, S, spb, sph, sps, RS: tl.constexpr, HAS_PERM: tl.constexpr):
    """The source rows of the 4 RS-row slices of V' block ``blk`` (``_source_rows``; rows past S masked)."""
    r = blk * (4 * RS) + tl.arange(0, RS)
    s0 = _source_rows(PERM, b, h, r, r < S, spb, sph, sps, HAS_PERM)
    s1 = _source_rows(PERM, b, h, r + RS, r + RS < S, spb, sph, sps, HAS_PERM)
    s2 = _source_rows(PERM, b, h, r + 2 * RS, r + 2 * RS < S, spb, sph, sps, HAS_PERM)
    s3 = _source_rows(PERM, b, h, r + 3 * RS, r + 3 * RS < S, spb, sph, sps, HAS_PERM)
    return s0, s1, s2, s3


@triton.jit
def _slice_stats(v_base, src, row0, S, svs, svd, acc, vmax, vmin, RS: tl.constexpr, D: tl.constexpr):
    """One RS-row slice of a V' block (rows row0 + [0, RS), gathered from rows ``src``) into the running column
    sums, maxima and minima (NaN kept by both)."""
    rows = row0 + tl.arange(0, RS)
    rmask = rows < S
    d = tl.arange(0, D)
    x = tl.load(v_base + src[:, None].to(tl.int64) * svs + d[None, :] * svd, mask=rmask[:, None],
                other=0.0).to(tl.float32)
    acc += x
    vmax = _nanmax(vmax, tl.where(rmask[:, None], x, float("-inf")))
    vmin = tl.minimum(vmin, tl.where(rmask[:, None], x, float("inf")), propagate_nan=tl.PropagateNan.ALL)
    return acc, vmax, vmin


@triton.jit
def _stats_kernel(X, OUT, S, H, sxb, sxh, sxs, sxd, blk_stride, n_samp, per_split, n_sub, N_SUB_C: tl.constexpr,
                  D: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                  V=None, PERM=None, VMEAN=None, VPART=None, svb=0, svh=0, svs=0, svd=0, spb=0, sph=0, sps=0,
                  nbv=0, per_v=0, PER_V_C: tl.constexpr = -1, BV: tl.constexpr = 128,
                  DO_K: tl.constexpr = True, DO_V: tl.constexpr = False, HAS_PERM: tl.constexpr = False,
                  SMOOTH: tl.constexpr = True,
                  COS=None, SIN=None, scb=0, sch=0, scs=0, scd=0, ssb=0, ssh=0, sss=0, ssd=0, lo=0, hi=0,
                  ROPE: tl.constexpr = 0, PAIR_TABLE: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    # Pass 1 of the preprocessing, program (split sp, head bh):
    # DO_K: OUT[bh, sp, :] = sum of the rows of the sampled BK-token blocks j = s * blk_stride of X[b, h] = K,
    #       s in [sp * per_split, (sp + 1) * per_split) (reference.preprocess.k_mean_mask), BS rows a step;
    # DO_V: V' blocks [sp * per_v, (sp + 1) * per_v) (rows gathered through PERM): block means -> VMEAN, and
    #       the residual's per-channel amax over those blocks -> VPART[bh, sp, :] (NaN -> +inf, which max keeps).
    sp = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    n_split = tl.num_programs(0)
    if DO_K:
        base = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
        acc = tl.zeros([BS, D], tl.float32)
        for i in tl.range(0, N_SUB_C if N_SUB_C >= 0 else n_sub):
            smp = sp * per_split + i // (BK // BS)
            rows = smp * blk_stride * BK + (i % (BK // BS)) * BS + tl.arange(0, BS)
            if INTERPRET:  # NOTE Triton 3.9's interpreter refuses a block mask and-ed with a scalar one
                ok = (rows < S) & (tl.zeros([BS], tl.int32) + smp < n_samp)
            else:
                ok = (rows < S) & (smp < n_samp)
            x = tl.load(base + rows[:, None].to(tl.int64) * sxs + d[None, :] * sxd, mask=ok[:, None], other=0.0)
            if ROPE != 0:
                x = rope_rows(x, base + rows[:, None].to(tl.int64) * sxs, rows, ok, sxd, COS, SIN,
                               b.to(tl.int64) * scb + h.to(tl.int64) * sch,
                               b.to(tl.int64) * ssb + h.to(tl.int64) * ssh,
                               scs, scd, sss, ssd, lo, hi, D, ROPE, PAIR_TABLE, INTERPRET)
            acc += x.to(tl.float32)
        tl.store(OUT + (bh * n_split + sp).to(tl.int64) * D + d, tl.sum(acc, 0))
    if DO_V:
        # One sweep per block: column sums, maxima and minima of V' over RS-row slices accumulated in registers,
        # reduced once; the residual's amax is max(vmax - mu, mu - vmin), exactly max_t |fl(v_t - mu)| (rounding
        # is monotone and symmetric), so no second pass over the block's elements.
        # NOTE one sweep, not two: the two-pass form (mean, then |v - mu| over the whole fp32 tile) held too many
        # registers for occupancy and stalled on the gathered loads; docs/design/preprocess-launch.md
        # NOTE the block's 4 slices gather through indices loaded one block ahead (``_slice_sources``), so the four
        # row gathers of a block issue together instead of each waiting for its own index load first.
        amax = tl.zeros([D], tl.float32)
        RS: tl.constexpr = 32
        tl.static_assert(BV == 4 * RS, "pass 1 sweeps a V block as 4 slices of RS rows")
        v_base = V + b.to(tl.int64) * svb + h.to(tl.int64) * svh
        s0, s1, s2, s3 = _slice_sources(PERM, b, h, sp * per_v, S, spb, sph, sps, RS, HAS_PERM)
        for i in tl.range(0, PER_V_C if PER_V_C >= 0 else per_v):
            blk = sp * per_v + i
            n0, n1, n2, n3 = _slice_sources(PERM, b, h, blk + 1, S, spb, sph, sps, RS, HAS_PERM)
            if blk < nbv:
                acc = tl.zeros([RS, D], tl.float32)
                vmax = tl.full([RS, D], float("-inf"), tl.float32)
                vmin = tl.full([RS, D], float("inf"), tl.float32)
                acc, vmax, vmin = _slice_stats(v_base, s0, blk * BV, S, svs, svd, acc, vmax, vmin, RS, D)
                acc, vmax, vmin = _slice_stats(v_base, s1, blk * BV + RS, S, svs, svd, acc, vmax, vmin, RS, D)
                acc, vmax, vmin = _slice_stats(v_base, s2, blk * BV + 2 * RS, S, svs, svd, acc, vmax, vmin, RS, D)
                acc, vmax, vmin = _slice_stats(v_base, s3, blk * BV + 3 * RS, S, svs, svd, acc, vmax, vmin, RS, D)
                vmax = tl.reduce(vmax, 0, _nanmax)
                vmin = -tl.reduce(-vmin, 0, _nanmax)
                if SMOOTH:
                    cnt = tl.minimum(S - blk * BV, BV).to(tl.float32)
                    mu = tl.math.div_rn(tl.sum(acc, 0), cnt)
                else:
                    mu = tl.zeros([D], tl.float32)
                tl.store(VMEAN + (bh * nbv + blk).to(tl.int64) * D + d, mu)
                ra = _nanmax(vmax - mu, mu - vmin)
                ra = tl.where(ra < float("inf"), ra, float("inf"))  # NaN (or inf - inf) -> +inf: max keeps it
                amax = tl.maximum(amax, ra)
            s0, s1, s2, s3 = n0, n1, n2, n3
        tl.store(VPART + (bh * n_split + sp).to(tl.int64) * D + d, amax)


def _split_count(n_blocks: int, BH: int, per_sm: int, sms: int) -> int:
    """Programs per head of a pass that splits ``n_blocks`` blocks over the heads: about ``per_sm`` x ``sms``
    programs in all (the device's SMs), at least one block each."""
    return max(1, min(n_blocks, triton.cdiv(sms * per_sm, BH)))


def _token_mean(x: torch.Tensor, rope=None) -> torch.Tensor:
    """[B, H, S, D] (any strides) -> [B, H, D] fp32 mean over the sampled tokens of
    ``reference.preprocess.k_mean_mask`` (of the rotated x when ``rope``): pass 1 alone, reduced by torch (for
    tests; ``preprocess`` reduces the partial sums inside pass 2)."""
    B, H, S, D = x.shape
    part, n_split, count = _k_partials(x, rope)
    return (part.view(B * H, n_split, D).sum(dim=1) / count).view(B, H, D)


def _k_geometry(S: int, BH: int, n_split: Optional[int] = None, sms: int = OFFLINE_SMS):
    """(stride of the sampled blocks, samples, samples per split, splits, sampled tokens) of K's mean."""
    st = k_mean_stride(S)
    n_samp = triton.cdiv(triton.cdiv(S, BLOCK_K), st)
    count = (n_samp - 1) * BLOCK_K + min(BLOCK_K, S - (n_samp - 1) * st * BLOCK_K)
    if n_split is None:
        n_split = _split_count(n_samp, BH, 2, sms)
    per_split = triton.cdiv(n_samp, n_split)
    return st, n_samp, per_split, n_split, count


def _k_partials(x, rope=None):
    """Pass 1 over K alone: ([B*H, n_split, D] fp32 partial column sums of the sampled tokens, n_split, count)."""
    B, H, S, D = x.shape
    st, n_samp, per_split, n_split, count = _k_geometry(S, B * H, sms=sm_count(x.device))
    n_split = triton.cdiv(n_samp, per_split)
    BS = 32
    n_sub = per_split * (BLOCK_K // BS)
    part = torch.empty(B * H, n_split, D, device=x.device, dtype=torch.float32)
    _stats_kernel[(n_split, B * H)](x, part, S, H, *x.stride(), st, n_samp, per_split, n_sub,
                                    loop_bound(n_sub), D=D, BS=BS, BK=BLOCK_K, num_warps=4,
                                    **colsum_rope_kwargs(rope, D))
    return part, n_split, count


@triton.jit
def _k_mean_cols(KPART, bh, cols, n_split, NSP: tl.constexpr, D: tl.constexpr, k_count):
    """K's mean at channels ``cols`` from pass 1's partial sums KPART[bh, 0:n_split, :] (summed in a fixed
    order: every program of the head gets the same bits), divided by the sampled token count.

    NOTE read PART_ROWS partials a step, not all NSP at once: the [NSP, D] tile at pass 2's 80-register cap
    spilled from NSP = 64 on (12 heads: 64-88 splits a head); docs/design/preprocess-launch.md."""
    s = tl.arange(0, PART_ROWS if NSP > PART_ROWS else NSP)
    acc = tl.load(KPART + (bh * n_split + s[:, None]).to(tl.int64) * D + cols[None, :],
                  mask=(s < n_split)[:, None], other=0.0)
    for i in tl.static_range(1, NSP // PART_ROWS if NSP > PART_ROWS else 1):
        acc += tl.load(KPART + (bh * n_split + i * PART_ROWS + s[:, None]).to(tl.int64) * D + cols[None, :],
                       mask=(s + i * PART_ROWS < n_split)[:, None], other=0.0)
    return tl.math.div_rn(tl.sum(acc, 0), tl.full(cols.shape, k_count, tl.float32))


@triton.jit
def _quant_kernel(Q, K, PERM, KPART, HPM, Q8, K8, QS, KS, KMEAN,
                  S, H, sqb, sqh, sqs, sqd, skb, skh, sks, skd, spb, sph, sps,
                  q_fold, h_norm, k_count, n_split,
                  D: tl.constexpr, TQ: tl.constexpr, BK: tl.constexpr, NSP: tl.constexpr, HAS_PERM: tl.constexpr,
                  HADAMARD: tl.constexpr, FP8_OUT: tl.constexpr, INTERPRET: tl.constexpr,
                  DOT_PREC: tl.constexpr,
                  V=None, VMEAN=None, VPART=None, V8T=None, VSCALE=None, MUP=None, MUG=None,
                  svb=0, svh=0, svs=0, svd=0, S_pad=0, nbv=0, nsv=0, ng=0,
                  BV: tl.constexpr = 128, NSV: tl.constexpr = 1, DO_QK: tl.constexpr = True,
                  DO_V: tl.constexpr = False, SM90: tl.constexpr = False, MUP_NAT: tl.constexpr = False,
                  COS=None, SIN=None, scb=0, sch=0, scs=0, scd=0, ssb=0, ssh=0, sss=0, ssd=0, lo=0, hi=0,
                  ROPE: tl.constexpr = 0, PAIR_TABLE: tl.constexpr = False, HEAD_FAST: tl.constexpr = False,
                  PACKED: tl.constexpr = False, TAB_WORDS: tl.constexpr = False):
    # Pass 2 of the preprocessing, program (token block pid, head bh): Q tokens [pid TQ, (pid + 1) TQ) (DO_QK),
    # the two BK-token blocks of K' at the same positions (rows gathered through perm) with K's mean reduced from
    # pass 1's partial sums, and V' block pid (DO_V: TQ = BV).
    # PACKED (interleaved RoPE, 16-bit q/k with unit channel stride and even strides, no Hadamard): rows
    # are handled as their even / odd channel halves [R, D/2] from one 32-bit load per pair
    # (_rope_pairs_packed) and the codes stored as int16 pairs, so loads, tables and stores share one
    # register layout (sm_90: no layout conversion through shared memory, like the no-RoPE path).
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    if HEAD_FAST:  # RoPE prologue: the heads of one token block run back to back, so the cos/sin rows
        pid = tl.program_id(1)  # (2x the bytes of a bf16 q tile with fp32 pair tables) are L2 hits
        bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    if DO_V:
        _quant_v_block(V, PERM, VMEAN, VPART, V8T, VSCALE, MUP, MUG, pid, bh, b, h, d, S, S_pad, nbv, nsv, ng,
                       svb, svh, svs, svd, spb, sph, sps, D, BV, NSV, HAS_PERM, INTERPRET, SM90, MUP_NAT)
    if DO_QK:
        _quant_qk_block(Q, K, PERM, KPART, HPM, Q8, K8, QS, KS, KMEAN, pid, bh, b, h, d,
                        S, sqb, sqh, sqs, sqd, skb, skh, sks, skd, spb, sph, sps,
                        q_fold, h_norm, k_count, n_split, D, TQ, BK, NSP, HAS_PERM, HADAMARD, FP8_OUT, INTERPRET,
                        DOT_PREC, COS, SIN, scb, sch, scs, scd, ssb, ssh, sss, ssd, lo, hi, ROPE, PAIR_TABLE,
                        PACKED, TAB_WORDS)


@triton.jit
def _quant_qk_block(Q, K, PERM, KPART, HPM, Q8, K8, QS, KS, KMEAN, pid, bh, b, h, d,
                    S, sqb, sqh, sqs, sqd, skb, skh, sks, skd, spb, sph, sps,
                    q_fold, h_norm, k_count, n_split, D: tl.constexpr, TQ: tl.constexpr, BK: tl.constexpr,
                    NSP: tl.constexpr, HAS_PERM: tl.constexpr, HADAMARD: tl.constexpr, FP8_OUT: tl.constexpr,
                    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr,
                    COS, SIN, scb, sch, scs, scd, ssb, ssh, sss, ssd, lo, hi,
                    ROPE: tl.constexpr, PAIR_TABLE: tl.constexpr, PACKED: tl.constexpr, TAB_WORDS: tl.constexpr):
    """Q codes of TQ tokens (one scale each) and the two BK-token K' blocks at the same rows."""
    QMAX: tl.constexpr = 448.0 if FP8_OUT else 127.0
    if HADAMARD:
        hpm = tl.load(HPM + d[:, None] * D + d[None, :])  # +-1, in the input dtype
        if INTERPRET:
            hpm = hpm.to(tl.float32)  # NOTE the 3.6 interpreter's tl.dot mis-multiplies bf16
    nbk = tl.cdiv(S, BK)
    out_bh = bh.to(tl.int64) * S * D
    k_mean = _k_mean_cols(KPART, bh, d, n_split, NSP, D, k_count)
    if pid == 0:
        tl.store(KMEAN + bh * D + d, k_mean)
    if HADAMARD:  # H (k - kbar) = H k - H kbar: the rotated mean, from the same +-1 matrix
        kbar = tl.sum(k_mean[:, None] * hpm.to(tl.float32), 0) * h_norm
    else:
        kbar = k_mean
    # a non-finite K mean poisons every smoothed key, hence every logit of the head: its Q scales -> NaN
    k_bad = tl.min((tl.abs(k_mean) < float("inf")).to(tl.int32), 0) == 0
    i2 = tl.arange(0, D // 2)
    if PACKED:
        kbar_e = _k_mean_cols(KPART, bh, 2 * i2, n_split, NSP, D, k_count)
        kbar_o = _k_mean_cols(KPART, bh, 2 * i2 + 1, n_split, NSP, D, k_count)

    # ---- Q: TQ tokens, one scale per token; with RoPE in two 64-row halves (rows are independent):
    # half the live registers (sm_90: 128 instead of 181-197 per thread, 2 CTAs/SM like the no-RoPE path)
    QR: tl.constexpr = BK if ROPE != 0 else TQ
    for jq in tl.static_range(TQ // QR):
        rows = pid * TQ + jq * QR + tl.arange(0, QR)
        rmask = rows < S
        if PACKED:
            qe, qo = rope_pairs_packed(Q, b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows.to(tl.int64) * sqs,
                                        rows, rmask, COS, SIN, b.to(tl.int64) * scb + h.to(tl.int64) * sch,
                                        b.to(tl.int64) * ssb + h.to(tl.int64) * ssh, scs, scd, sss, ssd, lo, hi,
                                        D, PAIR_TABLE, INTERPRET, TAB_WORDS)
            codes, scale = _quant_pair(qe, qo, QMAX, FP8_OUT, INTERPRET, PER_ROW=True)
            tl.store(Q8.to(tl.pointer_type(tl.int16)) + out_bh // 2 + rows[:, None].to(tl.int64) * (D // 2)
                     + i2[None, :], codes, mask=rmask[:, None])
        else:
            q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows[:, None].to(tl.int64) * sqs
                        + d[None, :] * sqd, mask=rmask[:, None], other=0.0)
            if ROPE != 0:  # prologue RoPE: q arrives un-rotated
                q = rope_rows(q, Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
                               + rows[:, None].to(tl.int64) * sqs,
                               rows, rmask, sqd, COS, SIN, b.to(tl.int64) * scb + h.to(tl.int64) * sch,
                               b.to(tl.int64) * ssb + h.to(tl.int64) * ssh, scs, scd, sss, ssd, lo, hi,
                               D, ROPE, PAIR_TABLE, INTERPRET)
            if HADAMARD:
                if INTERPRET:
                    q = q.to(tl.float32)
                qf = tl.dot(q, hpm, input_precision=DOT_PREC) * h_norm
            else:
                qf = q.to(tl.float32)
            codes, scale = _quant_tile(qf, QMAX, FP8_OUT, INTERPRET, PER_ROW=True)
            tl.store(Q8 + out_bh + rows[:, None].to(tl.int64) * D + d[None, :], codes, mask=rmask[:, None])
        tl.store(QS + bh.to(tl.int64) * S + rows, tl.where(k_bad, float("nan"), scale * q_fold), mask=rmask)

    # ---- K': two BK-token blocks at the same positions, rows gathered through perm
    k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    for j in tl.static_range(TQ // BK):
        rows = pid * TQ + j * BK + tl.arange(0, BK)
        rmask = rows < S
        src = _source_rows(PERM, b, h, rows, rmask, spb, sph, sps, HAS_PERM)
        if PACKED:
            ke, ko = rope_pairs_packed(K, b.to(tl.int64) * skb + h.to(tl.int64) * skh + src.to(tl.int64) * sks,
                                        src, rmask, COS, SIN, b.to(tl.int64) * scb + h.to(tl.int64) * sch,
                                        b.to(tl.int64) * ssb + h.to(tl.int64) * ssh, scs, scd, sss, ssd, lo, hi,
                                        D, PAIR_TABLE, INTERPRET, TAB_WORDS)
            ke = tl.where(rmask[:, None], ke - kbar_e[None, :], 0.0)
            ko = tl.where(rmask[:, None], ko - kbar_o[None, :], 0.0)
            codes, scale = _quant_pair(ke, ko, QMAX, FP8_OUT, INTERPRET)
            tl.store(K8.to(tl.pointer_type(tl.int16)) + out_bh // 2 + rows[:, None].to(tl.int64) * (D // 2)
                     + i2[None, :], codes, mask=rmask[:, None])
        else:
            k = tl.load(k_base + src[:, None].to(tl.int64) * sks + d[None, :] * skd, mask=rmask[:, None],
                        other=0.0)
            if ROPE != 0:  # rotated at its own token position src (before the perm gather moved it)
                k = rope_rows(k, k_base + src[:, None].to(tl.int64) * sks, src, rmask, skd, COS, SIN,
                               b.to(tl.int64) * scb + h.to(tl.int64) * sch,
                               b.to(tl.int64) * ssb + h.to(tl.int64) * ssh,
                               scs, scd, sss, ssd, lo, hi, D, ROPE, PAIR_TABLE, INTERPRET)
            if HADAMARD:
                if INTERPRET:
                    k = k.to(tl.float32)
                kf = tl.dot(k, hpm, input_precision=DOT_PREC) * h_norm - kbar[None, :]
            else:
                kf = k.to(tl.float32) - kbar[None, :]
            kf = tl.where(rmask[:, None], kf, 0.0)
            codes, scale = _quant_tile(kf, QMAX, FP8_OUT, INTERPRET)
            tl.store(K8 + out_bh + rows[:, None].to(tl.int64) * D + d[None, :], codes, mask=rmask[:, None])
        kb = pid * (TQ // BK) + j
        tl.store(KS + bh * nbk + kb, scale, mask=kb < nbk)


@triton.jit
def _sm90_rows(t):
    """Position c -> key n of the "sm90" V^T layout (``formats.sm90_key_order``), per 128 keys."""
    return (t // 32) * 32 + ((t // 16) % 2) * 16 + ((t // 2) % 2) * 8 + ((t // 4) % 4) * 2 + t % 2


@triton.jit
def _load_v_block(V, PERM, b, h, blk, S, svb, svh, svs, svd, spb, sph, sps,
                  D: tl.constexpr, BV: tl.constexpr, HAS_PERM: tl.constexpr, SM90: tl.constexpr):
    """V' block ``blk`` as fp32 [BV, D] (rows gathered through PERM; SM90: row c holds key sm90_key_order[c]
    of the block, so the transposed codes are stored in the "sm90" layout) and its valid-row mask."""
    t = tl.arange(0, BV)
    if SM90:
        t = _sm90_rows(t)
    rows = blk * BV + t
    rmask = rows < S
    src = _source_rows(PERM, b, h, rows, rmask, spb, sph, sps, HAS_PERM)
    d = tl.arange(0, D)
    v = tl.load(V + b.to(tl.int64) * svb + h.to(tl.int64) * svh + src[:, None].to(tl.int64) * svs
                + d[None, :] * svd, mask=rmask[:, None], other=0.0)
    return v.to(tl.float32), rmask


@triton.jit
def _quant_v_block(V, PERM, VMEAN, VPART, V8T, VSCALE, MUP, MUG, blk, bh, b, h, d, S, S_pad, nbv, nsv, ng,
                   svb, svh, svs, svd, spb, sph, sps, D: tl.constexpr, BV: tl.constexpr, NSV: tl.constexpr,
                   HAS_PERM: tl.constexpr, INTERPRET: tl.constexpr, SM90: tl.constexpr, MUP_NAT: tl.constexpr):
    """V' block ``blk``: the residual V' - mu quantised to E4M3 with the head's per-channel scale (the max of
    pass 1's partial amaxes) and stored transposed ([D, BV], K-major; SM90: the "sm90" layout, and mu' with its
    tf32 hi / lo groups; MUP_NAT: the natural layout with mu')."""
    if blk < nbv:
        v, rmask = _load_v_block(V, PERM, b, h, blk, S, svb, svh, svs, svd, spb, sph, sps, D, BV, HAS_PERM, SM90)
        mu = tl.load(VMEAN + (bh * nbv + blk).to(tl.int64) * D + d)
        s = tl.arange(0, PART_ROWS if NSV > PART_ROWS else NSV)  # PART_ROWS a step (_k_mean_cols' NOTE)
        am = tl.load(VPART + (bh * nsv + s[:, None]).to(tl.int64) * D + d[None, :], mask=(s < nsv)[:, None],
                     other=0.0)
        for i in tl.static_range(1, NSV // PART_ROWS if NSV > PART_ROWS else 1):
            am = tl.maximum(am, tl.load(VPART + (bh * nsv + i * PART_ROWS + s[:, None]).to(tl.int64) * D
                                        + d[None, :], mask=(s + i * PART_ROWS < nsv)[:, None], other=0.0))
        amax = tl.max(am, 0)
        bad = amax == float("inf")  # a non-finite value in this channel: scale NaN, codes of the finite part
        a = tl.where((amax == 0.0) | bad, 448.0, amax)
        inv = tl.math.div_rn(tl.full(a.shape, 448.0, tl.float32), a)  # per channel; a multiply per element
        tiny = ~(inv < float("inf"))  # 448 / amax overflows: the channel quantises as zero, scale 1
        a = tl.where(tiny, 448.0, a)
        inv = tl.where(tiny, 1.0, inv)
        scale = tl.math.div_rn(a, tl.full(a.shape, 448.0, tl.float32))
        r = v - mu[None, :]
        r = tl.where(rmask[:, None] & (tl.abs(r) < float("inf")), r, 0.0)
        y = tl.minimum(tl.maximum(r * inv[None, :], -448.0), 448.0)
        if INTERPRET:
            y = round_e4m3(y)
        codes = tl.trans(y.to(tl.float8e4nv))  # [D, BV]: K-major for the PV MMA
        t = blk * BV + tl.arange(0, BV)
        tl.store(V8T + bh.to(tl.int64) * D * S_pad + d[:, None].to(tl.int64) * S_pad + t[None, :], codes)
        scale = tl.where(bad, float("nan"), scale)
        if blk == 0:
            tl.store(VSCALE + bh * D + d, scale)
        if SM90 or MUP_NAT:  # mu' = mu / v_scale (IEEE, as torch divides)
            mup = tl.math.div_rn(mu, scale)
            tl.store(MUP + (bh * nbv + blk).to(tl.int64) * D + d, mup)
        if SM90:  # and its tf32 split, window blk // 8, column blk % 8
            mhi = (mup.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            g = (bh * ng + blk // 8).to(tl.int64) * 2
            tl.store(MUG + (g * D + d) * 8 + blk % 8, mhi)
            tl.store(MUG + ((g + 1) * D + d) * 8 + blk % 8, mup - mhi)
            if blk == nbv - 1:  # the last window's columns past nbv are zero
                z = tl.zeros([D], tl.float32)
                for c in tl.static_range(1, 8):
                    if blk % 8 + c < 8:
                        tl.store(MUG + (g * D + d) * 8 + blk % 8 + c, z)
                        tl.store(MUG + ((g + 1) * D + d) * 8 + blk % 8 + c, z)


def _check_qk(q, k, qk_format):
    if qk_format not in ("int8", "fp8"):
        raise ValueError(f"qk_format must be 'int8' or 'fp8', got {qk_format!r}")
    if k.shape != q.shape:
        raise ValueError(f"preprocess_qk needs q and k of one shape (self-attention), got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    err = vsmooth_head_dim_error(q.shape[-1])
    if err:
        raise ValueError(err)


def preprocess(q=None, k=None, v=None, perm=None, *, sm_scale: float = 1.0, hadamard: bool = False,
               qk_format: str = "int8", smooth: bool = True, rope=None, v_layout: str = "natural",
               mu_prime: bool = False, launch: PreprocessConfig = PREPROCESS_DEFAULT):
    """The whole preprocessing in two launches: (QKQuant or None, VQuant or None), each as the reference's
    ``preprocess_qk`` / ``preprocess_v``. q, k, v [B, H, S, D] (any strides; q and k or v may be None).
    Pass 1 (``_stats_kernel``, grid (splits, B*H)): K's sampled column sums and V's block means and partial
    amaxes; pass 2 (``_quant_kernel``, grid (ceil(S/128), B*H)): every code and scale, K's mean and V's scale
    reduced from pass 1's partials inside each program (no torch op between the two launches).
    ``v_layout="sm90"``: V^T in the sm_90 kernel's key order with mu' and its tf32 groups
    (``formats.VQuant``); ``mu_prime`` (natural layout, smoothed V): mu' = mu / v_scale too, which the sm_90
    kernel's shared-memory-P~ path reads (else it divides eagerly: one more launch and a torch op per call).
    ``rope``: q and k arrive un-rotated (prologue fusion).
    Host side: a call is recorded per key (the inputs' shapes, strides, dtypes, devices, alignment and aliasing,
    and every other argument) as its allocations and its two launches with the tensors' places marked
    (``_Recorder``); a later call with the key replays that (``_Plan``): the same launches on its own tensors,
    without the geometry, checks and argument building. Without RoPE only (its tables are tensors of their own).
    NOTE recorded because the preprocessing's host code was a third of a small reuse call; docs/design/host-overhead.md."""
    from vc_compile.kernels.launch import FAST_LAUNCH
    inputs = (q, k, v, perm)
    key = None
    if rope is None and FAST_LAUNCH.enabled:  # off with the remembered launches (their A/B turns both off)
        key = (tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0,
                                              next(j for j, u in enumerate(inputs) if u is t)) for t in inputs),
               float(sm_scale), hadamard, qk_format, smooth, v_layout, mu_prime, launch)
        plan = _PLANS.get(key)
        if plan is not None:
            return plan.run(inputs)
    rec = _Recorder(inputs) if key is not None else None
    out = _preprocess(q, k, v, perm, sm_scale=sm_scale, hadamard=hadamard, qk_format=qk_format, smooth=smooth,
                      rope=rope, v_layout=v_layout, mu_prime=mu_prime, launch=launch, rec=rec)
    if rec is not None:
        plan = rec.plan(out)
        if plan is not None:
            if len(_PLANS) >= 256:
                _PLANS.clear()
            _PLANS[key] = plan
    return out


class _Recorder:
    """One call of ``_preprocess`` as data (see ``preprocess``): each tensor it allocates or is given gets a slot
    (an input's index, an allocation's index, or a constant of the key such as the Hadamard matrix); a tensor
    argument in no slot (a view, say) makes the call unrecordable."""

    def __init__(self, inputs):
        self.slots = {id(t): ("in", i) for i, t in reversed(list(enumerate(inputs))) if t is not None}
        self.allocs, self.launches, self.keep = [], [], list(inputs)

    def empty(self, *shape, device, dtype):
        t = torch.empty(*shape, device=device, dtype=dtype)
        self.slots[id(t)] = ("alloc", len(self.allocs))
        self.allocs.append((shape, dtype, device))
        self.keep.append(t)  # alive while recording: ids stay unique
        return t

    def const(self, t):
        self.slots[id(t)] = ("const", t)
        self.keep.append(t)
        return t

    def launch(self, fn, grid, key, args, kw):
        self.launches.append((fn, grid, key, args, dict(kw)))

    def _template(self, values):
        """(values with tensors as None, [(position, slot)]) or None when a tensor has no slot."""
        vals, holes = list(values), []
        for i, x in enumerate(vals):
            if isinstance(x, torch.Tensor):
                slot = self.slots.get(id(x))
                if slot is None:
                    return None
                vals[i], holes = None, holes + [(i, slot)]
        return vals, holes

    def plan(self, out):
        launches = []
        for fn, grid, key, args, kw in self.launches:
            a, k = self._template(args), self._template(kw.values())
            if a is None or k is None:
                return None
            names = list(kw)
            launches.append((fn, grid, key, tuple(a[0]), tuple(a[1]), dict(zip(names, k[0])),
                             tuple((names[i], s) for i, s in k[1])))
        outs = []
        for o in out:
            t = None if o is None else self._template(o)
            if o is not None and t is None:
                return None
            outs.append(None if o is None else (type(o), tuple(t[0]), tuple(t[1])))
        return _Plan(tuple(self.allocs), tuple(launches), tuple(outs))


class _Plan:
    """A recorded ``_preprocess`` call replayed on new tensors of the same key (see ``preprocess``)."""

    def __init__(self, allocs, launches, outs):
        self.allocs, self.launches, self.outs = allocs, launches, outs

    def run(self, inputs):
        made = [torch.empty(*shape, device=device, dtype=dtype) for shape, dtype, device in self.allocs]

        def get(slot):
            kind, x = slot
            return inputs[x] if kind == "in" else made[x] if kind == "alloc" else x
        for fn, grid, key, args, holes, kw, kw_holes in self.launches:
            a = list(args)
            for i, slot in holes:
                a[i] = get(slot)
            kw = dict(kw)
            for name, slot in kw_holes:
                kw[name] = get(slot)
            _launch(fn, grid, key, *a, **kw)
        res = []
        for o in self.outs:
            if o is None:
                res.append(None)
                continue
            cls, vals, holes = o
            vals = list(vals)
            for i, slot in holes:
                vals[i] = get(slot)
            res.append(cls._make(vals))
        return tuple(res)


_PLANS: dict = {}


def _preprocess(q, k, v, perm, *, sm_scale, hadamard, qk_format, smooth, rope, v_layout, launch, rec,
                mu_prime=False):
    """``preprocess``'s work (``rec``: a ``_Recorder`` noting it, or None)."""
    from vc_compile.kernels.launch import aligned
    empty = rec.empty if rec is not None else torch.empty
    do_qk, do_v = q is not None, v is not None
    if not (do_qk or do_v):
        raise ValueError("preprocess needs q and k, or v")
    if v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout={v_layout!r}; accepted: {V_LAYOUTS}")
    x = q if do_qk else v
    B, H, S, D = x.shape
    dev = x.device
    if do_qk:
        _check_qk(q, k, qk_format)
    else:
        err = vsmooth_head_dim_error(D)
        if err:
            raise ValueError(err)
    if do_v and do_qk and v.shape != q.shape:
        raise ValueError(f"preprocess needs v of q's shape, got {tuple(v.shape)} and {tuple(q.shape)}")
    BH = B * H
    nbv = triton.cdiv(S, BLOCK_V)
    S_pad = nbv * BLOCK_V
    p = perm if perm is not None else x  # any pointer when unused
    pstr = perm.stride() if perm is not None else (0, 0, 0)
    interp = interpreting()
    # ---- pass 1
    sms = sm_count(x.device)
    st, n_samp, per_k, nsk, count = _k_geometry(S, BH, _split_count(nbv, BH, launch.stats_per_sm, sms) if do_v else None,
                                                sms)
    if do_v:
        nsv = nsk
        per_v = triton.cdiv(nbv, nsv)
    nsk = triton.cdiv(n_samp, per_k) if not do_v else nsk
    BS = 32
    n_sub = per_k * (BLOCK_K // BS)
    kpart = empty(BH, nsk, D, device=dev, dtype=torch.float32) if do_qk else None
    kw = {}
    if do_v:
        v_mean = empty(B, H, nbv, D, device=dev, dtype=torch.float32)
        vpart = empty(BH, nsv, D, device=dev, dtype=torch.float32)
        kw = dict(V=v, PERM=p, VMEAN=v_mean, VPART=vpart, svb=v.stride(0), svh=v.stride(1), svs=v.stride(2),
                  svd=v.stride(3), spb=pstr[0], sph=pstr[1], sps=pstr[2], nbv=nbv, per_v=per_v,
                  PER_V_C=loop_bound(per_v), BV=BLOCK_V, DO_K=do_qk, DO_V=True, HAS_PERM=perm is not None,
                  SMOOTH=smooth)
    kx = k if do_qk else v
    # the launches' key (kernels/launch.py): what their specialisation depends on besides our own allocations
    # (16-byte aligned); with RoPE (table tensors of their own) every launch takes the binder
    lkey = None if rope is not None else (
        tuple(x.shape), tuple(t.stride() if t is not None else None for t in (q, k, v, perm)),
        tuple(t.dtype if t is not None else None for t in (q, k, v, perm)), aligned(q, k, v, perm),
        hadamard, qk_format, smooth, v_layout, mu_prime, launch)
    _launch(_stats_kernel, (nsk, BH), lkey, kx, kpart if do_qk else v_mean, S, H, *kx.stride(), st, n_samp, per_k,
            n_sub, loop_bound(n_sub), D=D, BS=BS, BK=BLOCK_K,
            num_warps=launch.stats_warps if do_v and D == 128 else 4, **kw,
            **({'maxnreg': launch.stats_regs} if launch.stats_regs and do_v and D == 128 and not interp else {}),
            rec=rec, **(colsum_rope_kwargs(rope, D) if do_qk else ({"INTERPRET": True} if interp else {})))
    # ---- pass 2
    qk = vq = None
    args = []
    kw = dict(D=D, TQ=TILE_Q, BK=BLOCK_K, INTERPRET=interp, num_warps=launch.quant_warps * D // 128,
              # the cap where it was measured (no Hadamard: its wgmma needs >= 90 registers; no RoPE; D = 128)
              **({'maxnreg': launch.quant_regs} if launch.quant_regs and not interp and not hadamard
                 and rope is None and D == 128 else {}),
              HAS_PERM=perm is not None)
    if do_qk:
        hpm, h_norm = x, 1.0  # hpm: any pointer when unused
        if hadamard:
            Hd = hadamard_matrix(D, device=dev)
            h_norm = float(D) ** -0.5
            hpm = (Hd * (float(D) ** 0.5)).round().to(q.dtype).contiguous()
            if rec is not None:
                rec.const(hpm)  # the same +-1 matrix for every call of the key
        code_dtype = FP8 if qk_format == "fp8" else torch.int8
        q8 = empty(B, H, S, D, device=dev, dtype=code_dtype)
        k8 = empty(B, H, S, D, device=dev, dtype=code_dtype)
        q_scale = empty(B, H, S, device=dev, dtype=torch.float32)
        k_scale = empty(B, H, triton.cdiv(S, BLOCK_K), device=dev, dtype=torch.float32)
        k_mean = empty(B, H, D, device=dev, dtype=torch.float32)
        # NOTE INT8 codes only: on sm_90 with Triton 3.6 the packed path's FP8 codes were wrong in
        # whole channels (e.g. channel 2 of every row stored as 0, or as one constant code), where the [R, D]
        # path's were right (tests/passes/test_rope_fuse.py, packed vs unpacked); the CPU interpreter agreed with both
        packed = (launch.rope_packed and rope is not None and rope.form == "interleaved" and not hadamard
                  and qk_format != "fp8" and q.dtype in (torch.bfloat16, torch.float16) and pair_words_ok(q, k))
        args = [q, k, p, kpart, hpm, q8, k8, q_scale, k_scale, k_mean, S, H, *q.stride(), *k.stride(), *pstr,
                float(sm_scale) * LOG2E, h_norm, float(count), nsk]
        kw.update(NSP=triton.next_power_of_2(nsk), HADAMARD=hadamard, FP8_OUT=qk_format == "fp8",
                  DOT_PREC="ieee" if q.dtype == torch.float32 else None, **rope_kwargs(rope, D))
        if rope is not None:
            kw.update(HEAD_FAST=launch.rope_head_fast, PACKED=packed,
                      TAB_WORDS=packed and not rope.pair_table(D) and pair_words_ok(rope.cos, rope.sin))
        qk = QKQuant(q8, q_scale, k8, k_scale, k_mean, float(sm_scale))
    else:
        args = [v] * 10 + [S, H] + [0] * 11 + [1.0, 1.0, 1.0, 1]
        kw.update(NSP=1, HADAMARD=False, FP8_OUT=False, DOT_PREC=None, DO_QK=False)
    if do_v:
        sm90 = v_layout == "sm90"
        mup_nat = bool(mu_prime) and not sm90 and smooth
        ng = triton.cdiv(nbv, 8)
        v8t = empty(B, H, D, S_pad, device=dev, dtype=FP8)
        v_scale = empty(B, H, D, device=dev, dtype=torch.float32)
        mup = empty(BH * nbv, D, device=dev, dtype=torch.float32) if sm90 or mup_nat else None
        mug = empty(BH * ng * 2 * D, 8, device=dev, dtype=torch.float32) if sm90 else None
        kw.update(V=v, VMEAN=v_mean, VPART=vpart, V8T=v8t, VSCALE=v_scale, MUP=mup if mup is not None else v_scale,
                  MUG=mug if sm90 else v_scale, svb=v.stride(0), svh=v.stride(1), svs=v.stride(2), svd=v.stride(3),
                  S_pad=S_pad, nbv=nbv, nsv=nsv, ng=ng, BV=BLOCK_V, NSV=triton.next_power_of_2(nsv), DO_V=True,
                  SM90=sm90, MUP_NAT=mup_nat)
        if not do_qk:
            args[2] = p
            args[20:23] = list(pstr)
        vq = VQuant(v8t, v_scale, v_mean, S, zero_mean=not smooth, layout=v_layout, mu_prime=mup, mu_groups=mug)
    nbq = triton.cdiv(S, TILE_Q)
    grid = (BH, nbq) if do_qk and rope is not None and launch.rope_head_fast else (nbq, BH)
    _launch(_quant_kernel, grid, lkey, *args, rec=rec, **kw)
    return qk, vq


def _launch(fn, grid, key, *args, rec=None, **kw):
    """``fn[grid](*args, **kw)``; with a key, remembered (kernels/launch.py: later launches skip the binder);
    noted by ``rec``."""
    from vc_compile.kernels.launch import FAST_LAUNCH
    if rec is not None:
        rec.launch(fn, grid, key, args, kw)
    if key is None:
        return fn[grid](*args, **kw)
    return FAST_LAUNCH(fn, grid, key, *args, **kw)


def preprocess_qk(q, k, perm=None, *, sm_scale: float, hadamard: bool = False,
                  qk_format: str = "int8", rope=None, launch: PreprocessConfig = PREPROCESS_DEFAULT) -> QKQuant:
    """Q, K [B, H, S, D] (any strides; bf16/fp16/fp32) -> QKQuant, like the reference (``preprocess`` without
    V). ``rope``: a ``formats.RopeArgs`` when q and k arrive un-rotated (prologue fusion): both passes
    rotate what they load (K's mean is of the rotated K), so q and k are read from the model's tensors;
    ``launch`` says how (``configs.PreprocessConfig``)."""
    _check_qk(q, k, qk_format)
    return preprocess(q, k, None, perm, sm_scale=sm_scale, hadamard=hadamard, qk_format=qk_format, rope=rope,
                      launch=launch)[0]


def preprocess_v(v, perm=None, *, smooth: bool = True, v_layout: str = "natural",
                 launch: PreprocessConfig = PREPROCESS_DEFAULT) -> VQuant:
    """V [B, H, S, D] (any strides) -> VQuant, like the reference (``preprocess`` without Q, K).
    ``smooth=False``: zero means (plain per-channel FP8 V, our "naive 8-bit"), ``zero_mean`` set: the attention
    skips the mean term."""
    return preprocess(None, None, v, perm, smooth=smooth, v_layout=v_layout, launch=launch)[1]


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
