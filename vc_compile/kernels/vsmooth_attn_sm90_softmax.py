"""The Gluon sm_90 V-Smooth kernel's arithmetic on one key block (``vsmooth_attn_sm90.py`` is the kernel): the
INT8 scores' conversion, the online softmax into FP8 P~ (exp2 + cast, or the ExpCast code in one FFMA), the
register relabelling that makes P~ the PV MMA's A operand, and the row-sum / mean-term pieces of the MMA path
(MS). Pure functions of their tensors and a ``Tile``; the pipeline around them is ``vsmooth_attn_sm90_steps.py``.

Notation (as ``vsmooth_attn.py``)
--------
BM, BN      query rows of the tile, keys per block (BN = 128 = BLOCK_V).
t           = bits(qk + 0x4B400000) = qk + C, C = 1.5 * 2^23: the magic-number int32 -> float conversion of the
            INT8 scores (no I2F). ks: one K scale per 64 keys, two scalars per block (ks0, ks1), loaded one step
            ahead. exp2 path, full block: the base-2 logit (t - C) ks qs, the max subtraction and the P~ scale are
            ONE FFMA inside the exponent, with coefficients per (row, 64-key half); the row max comes from the
            exact integer maxima of the two halves.
qs          [BM] per-token Q scale (sm_scale * log2 e folded in); the base-2 logit is (t - C) ks qs_i.
P~          fp8(256 * 2^(s - m_i)) (exp2 + cast) or the ExpCast E4M3 code: on full blocks formed and rounded by
            ONE FFMA (``softmax_block``); the masked key-tail block rounds as the reference (s, then the code).
r           the row sum of the decoded P~ (fp16 sum on the ALUs; MS: an MMA, ``row_sum_mma``).
R_w         MS: the mean term's window, r_j at the current max for the 8 key blocks of window w (slot j % 8).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma
from triton.language.core import _aggregate as aggregate

from vc_compile.formats import sm90_key_order

# NOTE ``from __future__ import annotations`` must not be used here: the aggregate checks its fields' types.


@aggregate
class Tile:
    """What the softmax of one [BM, BN] score tile needs besides the scores: the rows' Q scales, the head's K
    scales, the MMA layouts (S and O accumulators), the block geometry and the ExpCast switch."""
    qs: gl.tensor
    KS_bh: gl.tensor
    s_layout: gl.constexpr
    o_layout: gl.constexpr
    BN: gl.constexpr
    BKS: gl.constexpr
    EXPCAST: gl.constexpr
    BYTEMASK: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, qs, KS_bh, s_layout, o_layout, BN, BKS, EXPCAST, BYTEMASK=0):
        self.qs = qs
        self.KS_bh = KS_bh
        self.s_layout = gl.constexpr(s_layout)
        self.o_layout = gl.constexpr(o_layout)
        self.BN = gl.constexpr(BN)
        self.BKS = gl.constexpr(BKS)
        self.EXPCAST = gl.constexpr(EXPCAST)
        self.BYTEMASK = gl.constexpr(BYTEMASK)


@gluon.jit
def half_scales_max(t, lo, qs, m_i, ks0, ks1):
    """Per (row, 64-key half) logit scales a_h = ks_h qs and the new row max from the exact integer maxima of the
    two halves of t (= C + qk), scaled by the same a_h."""
    mt0 = gl.max(gl.where(lo, t, float("-inf")), 1) - 12582912.0
    mt1 = gl.max(gl.where(lo, float("-inf"), t), 1) - 12582912.0
    a0 = ks0 * qs
    a1 = ks1 * qs
    return a0, a1, gl.maximum(m_i, gl.maximum(mt0 * a0, mt1 * a1))


@gluon.jit
def k_scales(tile: Tile, blk, Sk):
    """The two K scales of key block ``blk`` (keys [0, BKS) and [BKS, BN) of it; 0 past Sk)."""
    BN: gl.constexpr = tile.BN
    BKS: gl.constexpr = tile.BKS
    ks0 = gl.load(tile.KS_bh + blk * (BN // BKS), mask=blk * BN < Sk, other=0.0)
    ks1 = gl.load(tile.KS_bh + blk * (BN // BKS) + 1, mask=blk * BN + BKS < Sk, other=0.0)
    return ks0, ks1


@gluon.jit
def softmax_block(tile: Tile, s_i32, j, Sk, m_i, ks0, ks1, MASK: gl.constexpr, PREG: gl.constexpr,
                  ROWSUM: gl.constexpr = True):
    """One key block's online-softmax step: (P~ fp8 [BM, BN], alpha [BM], r [BM], m_new [BM]). ``ks0``,
    ``ks1``: the block's two K scales (keys [0, BKS) and [BKS, BN)), loaded a step ahead by the caller. MASK:
    the key-tail block. PREG: P~ comes back as the PV MMA's register A operand (keys relabelled, ``p_operand``).
    ROWSUM = 0: r is not formed here (the MMA sums P~, ``row_sum_mma``)."""
    BN: gl.constexpr = tile.BN
    BKS: gl.constexpr = tile.BKS
    EXPCAST: gl.constexpr = tile.EXPCAST
    s_layout: gl.constexpr = tile.s_layout
    qs = tile.qs
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    lo = (cols < BKS)[None, :]  # constant per register in the MMA layout: selects, not per-element work
    t = (s_i32 + 0x4B400000).to(gl.float32, bitcast=True)  # 1.5 * 2^23 + qk, exact (|qk| < 2^22)
    if MASK:
        # the key-tail block: s = (t - C) ks, then the row scale, as the Triton kernel and the reference (NOTE:
        # for ExpCast the exp2-style fold alone measured slower than this unfolded form; the full-block ExpCast
        # below also moves the rounding into the FFMA. docs/design/sm90-gluon-kernel.md)
        s = t * gl.where(lo, ks0, ks1) + gl.where(lo, ks0 * -12582912.0, ks1 * -12582912.0)
        # scale the rows BEFORE the -inf mask (qs = 0: 0 * -inf)
        s = gl.where((j * BN + cols < Sk)[None, :], s * qs[:, None], float("-inf"))
        qr = gl.full(qs.shape, 1.0, gl.float32, qs.type.layout)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qr)
        if EXPCAST:  # code = 8 (logit - m) + 119.65
            y = s * (8.0 * qr)[:, None] + (119.65 - 8.0 * m_new)[:, None]
        else:
            y = s * qr[:, None] - (m_new - 8.0)[:, None]
    elif EXPCAST:
        # ExpCast on a full block, folded: code = 8 (t - C) ks qs - 8 m + 119.65 rounded to an integer by ONE
        # FFMA, fma(t, A', K) in [2^23, 2^24) (ulp 1: the FFMA's own rounding is the round-to-nearest-even of
        # the code), then one clamp at 2^23 (code 0). K = 2^23 + floor(X) - n must be an integer for that,
        # X = 119.65 - 8 m, so the fraction of X rides in the product: A' = (n + frac X) / C with
        # n = round(C A - frac X), A = 8 ks qs, and C A' + K - 2^23 = X (to ~1e-3 code units, the fp32
        # rounding of n + frac X); |C A' - C A| <= 1/2, so a score's code moves by <= |qk| / (2 C) <= 0.08
        # (|qk| <= 127^2 * 128), a shift common to the scores of similar qk (near the row max: < 1e-3).
        # Exact while |K| < 2^24, i.e. 8 ks qs < ~0.6 (one INT8 step of QK < 1/13 of a log2 unit). Per score:
        # IADD, FMNMX (row max on t), FFMA, FMNMX -- against IADD, FFMA, FMNMX, FFMA, FADD, FMNMX (the
        # reference's two roundings, as the key tail above).
        a0, a1, m_new = half_scales_max(t, lo, qs, m_i, ks0, ks1)
        X = 119.65 - 8.0 * m_new
        fl = gl.floor(X)
        fx = X - fl
        n0 = gl.floor(a0 * (8.0 * 12582912.0) - fx + 0.5)
        n1 = gl.floor(a1 * (8.0 * 12582912.0) - fx + 0.5)
        A0 = (n0 + fx) * (1.0 / 12582912.0)
        A1 = (n1 + fx) * (1.0 / 12582912.0)
        K0 = (8388608.0 + fl) - n0
        K1 = (8388608.0 + fl) - n1
        y = gl.fma(t, gl.where(lo, A0[:, None], A1[:, None]), gl.where(lo, K0[:, None], K1[:, None]))
        if not tile.BYTEMASK:
            y = gl.maximum(y, 8388608.0)  # code 0 below (the row's underflow tail); BYTEMASK: in the packing
    else:
        # exp2 on a full block: the base-2 logit (t - C) ks qs, the max subtraction and the P~ scale 2^8 as
        # ONE FFMA inside the exponent, with coefficients per (row, 64-key half) a = ks qs, b = 8 - m - C a;
        # the row max from the exact integer maxima of the two halves, scaled by the same a.
        # NOTE folded only together with the K-scale prefetch: the softmax waited on the K-scale load, and the
        # fold alone was slower because it needs the scales early; docs/design/sm90-gluon-kernel.md
        a0, a1, m_new = half_scales_max(t, lo, qs, m_i, ks0, ks1)
        b0 = (8.0 - m_new) - 12582912.0 * a0
        b1 = (8.0 - m_new) - 12582912.0 * a1
        y = t * gl.where(lo, a0[:, None], a1[:, None]) + gl.where(lo, b0[:, None], b1[:, None])
    alpha = gl.exp2(m_i - m_new)
    if PREG:  # fp32: a renaming of registers; the fp8 packing below then lands in the A operand's registers
        y = p_operand(y, tile.o_layout)
    if EXPCAST:
        p8 = pack_codes(tile, y, MASK)
    elif PREG:
        p8 = e4m3x4(gl.exp2(y))  # MUFU + cast, packed without ptxas's F2FP.MERGE_C chain (see e4m3x4)
    else:
        p8 = gl.exp2(y).to(gl.float8e4nv)  # MUFU + cast
    if ROWSUM:
        r = gl.sum(p8.to(gl.float16), 1).to(gl.float32)  # decoded P~, fp16 sum (2^-11 relative)
        if PREG:
            r = gl.convert_layout(r, gl.SliceLayout(1, s_layout))
    else:
        r = 0.0
    return p8, alpha, r, m_new


@gluon.jit
def pack_codes(tile: Tile, y, MASK: gl.constexpr):
    """ExpCast's codes y (fp32, ``softmax_block``'s) as E4M3 P~: the key-tail block rounds and clamps them here
    (the reference's second rounding), full blocks are clamped by the byte mask (``codes_masked``) or were
    clamped by an FMNMX already."""
    if MASK:
        y = gl.maximum(y + 8388608.0, 8388608.0)  # round to the integer code (magic add), clamp at 0
    if tile.BYTEMASK and not MASK:
        p8 = codes_masked(y)  # the clamp at code 0 as a byte mask, while packing
    else:
        p8 = y.to(gl.int32, bitcast=True).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    return p8


# $1..$4: four codes y (fp32 bits), $0: their four E4M3 bytes. PRMT selectors: one nibble per result byte (byte
# 0 first), bits 0-2 the source byte (0-3 the first operand, 4-7 the second), bit 3 = replicate that byte's top
# bit. tests/kernels/test_vsmooth_attn_sm90.py emulates this text instruction by instruction.
CODES_MASKED_PTX = gl.constexpr(
    "{ .reg .b32 a, b, c, m;\n"
    "prmt.b32 a, $1, $2, 0xEA40;\n"  # [y0.b0, y1.b0, sign(y0.b2), sign(y1.b2)]
    "prmt.b32 b, $3, $4, 0xEA40;\n"
    "prmt.b32 c, a, b, 0x5410;\n"  # the four codes
    "prmt.b32 m, a, b, 0x7632;\n"  # their masks (0xFF: below code 0)
    "not.b32 m, m;\n"
    "and.b32 $0, c, m; }")


@gluon.jit
def codes_masked(y):
    """ExpCast's unclamped codes y (fp32, ``fma(t, A', K)``) -> E4M3 bytes, four consecutive register elements
    per 32-bit word, a code below 0 read as 0: the clamp ``max(y, 2^23)`` done on the packed bytes. A code
    c >= 0 is y = 2^23 + c (bits 0x4B000000 + c: byte 0 the code, bit 23 clear); a code in [-2^22, 0) is
    y in [2^22, 2^23) (exponent 149: bit 23, byte 2's top bit, set), so byte 0 AND NOT (byte 2's sign
    replicated by PRMT) is the clamped code. 5 instructions per 4 scores (4 PRMT, 1 LOP3) against 7 (4 FMNMX,
    3 PRMT). Needs every code >= -2^22: ``bytemask_ok`` checks 8 ks qs <= 1 for the whole tile first."""
    return gl.inline_asm_elementwise(CODES_MASKED_PTX, "=r,r,r,r,r", [y], dtype=gl.float8e4nv, is_pure=True,
                                     pack=4)


@gluon.jit
def e4m3x4(x):
    """fp32 -> E4M3 (round to nearest even, saturating), four consecutive register elements per 32-bit word.
    ``.to(gl.float8e4nv)`` emits a 16-bit cvt per pair and ``mov.b32 {lo, hi}``, which ptxas may fuse into
    ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C`` chains; every register-P~ exp2 compile with such a chain (C not
    RZ) returned wrong or NaN rows on sm_90 (those with F2FP + PRMT did not; docs/design/e4m3x4-packing.md). Here each
    pair is widened to 32 bits and the halves joined by an explicit PRMT."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 l, h; .reg .b32 l32, h32;\n"
        "cvt.rn.satfinite.e4m3x2.f32 l, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h, $4, $3;\n"
        "cvt.u32.u16 l32, l;\n"
        "cvt.u32.u16 h32, h;\n"
        "prmt.b32 $0, l32, h32, 0x5410; }",
        "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def p_operand(x, o_layout: gl.constexpr):
    """P~ [BM, 128] (the QK accumulator's layout) as the PV MMA's register A operand, without moving data:
    each thread holds the same rows in both layouts, and 32 keys of each row; relabelling the keys
    n = 32 c + 16 h + 8 i1 + 2 q + e (accumulator: q = lane % 4) as k = 32 c + 16 h + 4 q + 2 i1 + e (A
    operand: 4 consecutive k per register) makes the conversion a byte permute within registers. V^T's key
    columns are stored in the same order (``key_order_sm90``), so P~ V is unchanged."""
    BM: gl.constexpr = x.shape[0]
    BN: gl.constexpr = x.shape[1]
    x = x.reshape([BM, BN // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([BM, BN])
    return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))


def key_order_sm90(BN: int = 128):
    """k -> n: the key stored in column k of each BN-key block of V^T for ``p_operand``'s relabelling (the
    "sm90" layout of ``formats.VQuant``, which the preprocessing writes)."""
    return sm90_key_order(BN)


@gluon.jit
def fold_pv(acc, alpha, r, pv, mu, o_layout: gl.constexpr, MEAN: gl.constexpr):
    """acc = acc * alpha + PV (two-level: PV came from a fresh accumulator), + r mu' (V-Smooth's mean term,
    ``mu``: the block's mu' row [1, D], staged by TMA with its V)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv
    if MEAN:
        acc += gl.convert_layout(r, row_o)[:, None] * mu
    return acc


@gluon.constexpr_function
def rs_layout(o_layout):
    """MS: the layout of the row-sum MMA's [BM, 8] accumulator (and of the mean window Rb)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=o_layout.warps_per_cta, instr_shape=[16, 8, 32])


@gluon.jit
def row_sum_mma(p8, ones_smem, o_layout: gl.constexpr):
    """MS: r_j = P~_j 1 on the tensor cores, issued beside PV_j (same register A operand, N = 8 columns of ones
    in shared memory): [BM, 8] fp32 in the MMA layout (``rs_layout``), every column the row sum of the decoded
    P~."""
    BM: gl.constexpr = p8.shape[0]
    r_layout: gl.constexpr = rs_layout(o_layout)
    a = gl.convert_layout(p8, gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=4))
    return warpgroup_mma(a, ones_smem.permute((1, 0)), gl.zeros([BM, 8], gl.float32, r_layout), use_acc=False,
                         is_async=True)


@gluon.jit
def mean_slot(Rb, rs, alpha, i):
    """MS: the deferred mean term's weights: every buffered r moves to the current max (x alpha_j) and r_j (rs)
    takes window slot i = j % 8. Slot i is accumulator column 2 (i % 4) + i // 4, which ``MeanWindow.flush``'s
    relabelling turns into tf32 A-operand column i (the row of block 8 w + i's mu' in the group tile)."""
    r_layout: gl.constexpr = rs.type.layout
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, r_layout))
    a = gl.convert_layout(alpha, gl.SliceLayout(1, r_layout))[:, None]
    return gl.where((cols == 2 * (i % 4) + i // 4)[None, :], rs, Rb * a)
