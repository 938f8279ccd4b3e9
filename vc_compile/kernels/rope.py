"""The RoPE prologue of the Q/K preprocessing kernels (``kernels/preprocess.py``): the jit helpers that
rotate the rows those kernels load, and the launch arguments of a ``formats.RopeArgs``.

Contract: ``vc_compile/torch_ops.py`` (``apply_rope``: ``x*cos + rot(x)*sin`` in fp32, rounded once to
the input dtype, like the models).

The prologue (``rope=`` a ``formats.RopeArgs``): the preprocessing's ``_stats_kernel`` (K's mean) and
``_quant_kernel`` rotate the rows they load (``x*cos + rot(x)*sin`` in fp32, rounded once to the input
dtype like the models), so q and k are read un-rotated from the model's tensor and never written
rotated. K rows are rotated at their own token position (before the perm gather). With RoPE the Q/K grid
is (B*H, ceil(S/128)) (``PreprocessConfig.rope_head_fast``): the heads of one token block run back to back and
the table rows come from L2; the Q tile runs as two 64-row halves (register pressure).
Every load and store must stay a 16-byte vector in ONE register layout, as in the no-RoPE path:
- interleaved, 16-bit q/k with unit channel stride, no Hadamard, INT8 codes (``PACKED``, ``PreprocessConfig.rope_packed``;
  Wan/Hunyuan/LTX/tiny_dit): a pair (2i, 2i+1) is read as one 32-bit word (``load_pairs``), tables as
  [R, D/2] (pair table) or as 64-bit pair words (full fp32 table), the rotation done on the [R, D/2]
  even/odd halves and the codes stored as int16 pairs (``preprocess._quant_pair``): x, partner, tables and
  codes share one layout;
- otherwise interleaved: reshape [R, D/2, 2] + split/join of the loaded [R, D] tile (``rope_rows``;
  vectorised, but sm_90 adds shared-memory layout conversions);
- rotate-half: the partner ``x[(d + D/2) % D]`` is a second load of the same rows (L1/L2 hits), which
  Triton proves contiguous in D/2 runs (vectorised).
NOTE why the vector layouts: a partner load ``x[d ^ 1]`` or a pair-table gather at column ``d // 2`` has no
provable contiguity, so it compiles to scalar loads, shared-memory layout conversions and twice the registers,
which made the first fused prologue several times slower than RoPE and preprocessing apart;
docs/design/rope-fusion.md.

NOTE one program per head: rotating several heads' rows per program from one read of the shared table rows was
tried and was slower (the heads' load, compute and store phases serialised in one CTA per SM);
docs/design/rope-fusion.md, Alternatives.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vc_compile.kernels.interpret import interpreting
from vc_compile.kernels.soft_round import round_bf16


@triton.jit
def load_pairs(P, row_off, mask, D: tl.constexpr):
    """Rows of P (16- or 32-bit floats, unit channel stride) at element offsets ``row_off`` [R] (even, the
    row start 2x-element aligned): each pair (2i, 2i+1) is loaded as ONE word of twice the width, so both
    halves land in the same thread. Returns fp32 (even, odd) channels [R, D/2]; masked rows read 0."""
    i = tl.arange(0, D // 2)
    if P.dtype.element_ty.primitive_bitwidth == 16:
        w = tl.load(P.to(tl.pointer_type(tl.int32)) + (row_off // 2)[:, None] + i[None, :], mask=mask[:, None],
                    other=0)
        if P.dtype.element_ty == tl.bfloat16:
            e = (w << 16).to(tl.float32, bitcast=True)
            o = (w & -65536).to(tl.float32, bitcast=True)
        else:
            e = (w & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            o = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        w = tl.load(P.to(tl.pointer_type(tl.int64)) + (row_off // 2)[:, None] + i[None, :], mask=mask[:, None],
                    other=0)
        e = w.to(tl.int32).to(tl.float32, bitcast=True)
        o = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return e, o


@triton.jit
def rope_pair_math(xe, xo, t, inr, COS, SIN, c_off, s_off, scs, scd, sss, ssd,
                    D: tl.constexpr, PAIR_TABLE: tl.constexpr, TAB_WORDS: tl.constexpr = False):
    """Interleaved RoPE on the even / odd channels xe, xo [R, D/2] (fp32) of rows at table rows t: fp32
    (ye, yo), not rounded. Tables read as contiguous row segments ([R, D/2] pair table, or [R, D] split
    in registers, or as pair words when TAB_WORDS). Rows outside the rotated range read cos 1, sin 0
    (except with TAB_WORDS: 0, 0); callers select x there."""
    R: tl.constexpr = xe.shape[0]
    if PAIR_TABLE:
        i = tl.arange(0, D // 2)
        ce = tl.load(COS + c_off + t[:, None] * scs + i[None, :] * scd, mask=inr[:, None],
                     other=1.0).to(tl.float32)
        se = tl.load(SIN + s_off + t[:, None] * sss + i[None, :] * ssd, mask=inr[:, None],
                     other=0.0).to(tl.float32)
        co = ce
        so = se
    elif TAB_WORDS:  # full table, unit channel stride: (cos[2i], cos[2i+1]) as one word, like x
        ce, co = load_pairs(COS, c_off + t * scs, inr, D)
        se, so = load_pairs(SIN, s_off + t * sss, inr, D)
    else:
        d = tl.arange(0, D)
        c = tl.load(COS + c_off + t[:, None] * scs + d[None, :] * scd, mask=inr[:, None], other=1.0)
        sn = tl.load(SIN + s_off + t[:, None] * sss + d[None, :] * ssd, mask=inr[:, None], other=0.0)
        ce, co = tl.split(tl.reshape(c.to(tl.float32), [R, D // 2, 2]))
        se, so = tl.split(tl.reshape(sn.to(tl.float32), [R, D // 2, 2]))
    # rot(x)[2i] = -x[2i+1], rot(x)[2i+1] = x[2i]; x*cos first, like the models and the reference
    return xe * ce + (-xo) * se, xo * co + xe * so


@triton.jit
def rope_pairs_packed(X, row_off, src, rmask, COS, SIN, c_off, s_off, scs, scd, sss, ssd, lo, hi,
                       D: tl.constexpr, PAIR_TABLE: tl.constexpr, INTERPRET: tl.constexpr,
                       TAB_WORDS: tl.constexpr):
    """Interleaved RoPE of the rows of a 16-bit X (unit channel stride) at element offsets ``row_off`` [R]
    (even): each pair (2i, 2i+1) is loaded as ONE 32-bit word (X viewed as int32 [.., D/2]), so x, its
    partner and the pair tables are [R, D/2] tiles of one register layout (no second load, no shuffle).
    Returns the even / odd channels of the rotated rows, rounded to X's dtype, as fp32 [R, D/2]."""
    xe, xo = load_pairs(X, row_off, rmask, D)
    inr = rmask & (src >= lo) & (src < hi)
    ye, yo = rope_pair_math(xe, xo, (src - lo).to(tl.int64), inr, COS, SIN, c_off, s_off, scs, scd, sss, ssd,
                             D, PAIR_TABLE, TAB_WORDS)
    if INTERPRET:
        if X.dtype.element_ty == tl.bfloat16:
            ye = round_bf16(ye)
            yo = round_bf16(yo)
    ye = ye.to(X.dtype.element_ty).to(tl.float32)
    yo = yo.to(X.dtype.element_ty).to(tl.float32)
    return tl.where(inr[:, None], ye, xe), tl.where(inr[:, None], yo, xo)


@triton.jit
def rope_rows(x, ptr, src, rmask, sxd, COS, SIN, c_off, s_off, scs, scd, sss, ssd, lo, hi,
               D: tl.constexpr, ROPE: tl.constexpr, PAIR_TABLE: tl.constexpr, INTERPRET: tl.constexpr):
    """Prologue RoPE (torch_ops.apply_rope) of rows ``x`` [R, D] = X[src, :] loaded from ``ptr`` (row base
    pointers [R, 1]): ``x*cos + rot(x)*sin`` in fp32 for the tokens src in [lo, hi), rounded once to x's
    dtype. ROPE 1: interleaved pairs (2i, 2i+1); 2: rotate-half (i, i + D/2). PAIR_TABLE: one table
    value per pair (last dim D/2).

    Every load here is a contiguous row segment (16-byte vectors), as in the no-RoPE path:
    * interleaved: a pair (2i, 2i+1) sits in one thread's vector of x, so x is split in registers
      (reshape [R, D/2, 2] + split, no second load) and joined back; the tables are read as [R, D/2] (pair
      table) or [R, D] split the same way. The [R, D/2] tiles get another thread layout than x's, so sm_90
      converts through shared memory; the PACKED path of preprocess._quant_kernel avoids that.
    * rotate-half: the partner x[(d + D/2) % D] is a second load of the same rows (L1/L2 hits); Triton
      proves that offset contiguous in 64-channel runs, so it is vectorised too.
    NOTE the measurements that motivated this are in the module doc (RoPE prologue)."""
    R: tl.constexpr = x.shape[0]
    inr = rmask & (src >= lo) & (src < hi)
    t = (src - lo).to(tl.int64)
    if ROPE == 1:
        xe, xo = tl.split(tl.reshape(x.to(tl.float32), [R, D // 2, 2]))  # x[:, 0::2], x[:, 1::2]
        ye, yo = rope_pair_math(xe, xo, t, inr, COS, SIN, c_off, s_off, scs, scd, sss, ssd, D, PAIR_TABLE)
        y = tl.reshape(tl.join(ye, yo), [R, D])
    else:
        d = tl.arange(0, D)
        dp = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)
        xp = tl.load(ptr + dp[None, :] * sxd, mask=rmask[:, None], other=0.0)
        c = tl.load(COS + c_off + t[:, None] * scs + d[None, :] * scd, mask=inr[:, None], other=1.0)
        sn = tl.load(SIN + s_off + t[:, None] * sss + d[None, :] * ssd, mask=inr[:, None], other=0.0)
        y = x.to(tl.float32) * c.to(tl.float32) + (xp.to(tl.float32) * sign[None, :]) * sn.to(tl.float32)
    if INTERPRET:
        if x.dtype == tl.bfloat16:
            y = round_bf16(y)
    return tl.where(inr[:, None], y.to(x.dtype), x)


def rope_kwargs(rope, D: int) -> dict:
    """Kernel arguments of the prologue RoPE (``formats.RopeArgs`` or None = no RoPE)."""
    if rope is None:
        return {}
    return dict(COS=rope.cos, SIN=rope.sin, scb=rope.cos.stride(0), sch=rope.cos.stride(1),
                scs=rope.cos.stride(2), scd=rope.cos.stride(3), ssb=rope.sin.stride(0), ssh=rope.sin.stride(1),
                sss=rope.sin.stride(2), ssd=rope.sin.stride(3), lo=int(rope.lo), hi=int(rope.hi),
                ROPE=1 if rope.form == "interleaved" else 2, PAIR_TABLE=rope.pair_table(D))


def pair_words_ok(*ts) -> bool:
    """Each (2i, 2i+1) channel pair of these [B, H, S, D] views can be read as one word of twice the
    element width: 16/32-bit floats, unit channel stride, even other strides, 2x-element aligned base."""
    return all(t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.stride(3) == 1
               and all(st % 2 == 0 for st in t.stride()[:3]) and t.data_ptr() % (2 * t.element_size()) == 0
               for t in ts)


def colsum_rope_kwargs(rope, D: int) -> dict:
    """The K column-sum pass's RoPE arguments, and ``INTERPRET`` where the interpreter runs it (a GPU launch
    without RoPE passes none: its default)."""
    if rope is not None:
        return dict(rope_kwargs(rope, D), INTERPRET=interpreting())
    return {"INTERPRET": True} if interpreting() else {}
