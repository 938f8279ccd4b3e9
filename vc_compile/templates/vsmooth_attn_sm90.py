"""8-bit V-Smooth attention for sm_90 in Gluon: the same contract as ``vsmooth_attn.py`` (reference:
``vc_compile/reference/vsmooth_attn.py``), with the MMAs overlapped with the softmax inside a warp group.

Why a second kernel: in plain Triton every ``tl.dot`` of the key loop is waited for right after it is
issued (SASS: ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each QK and PV group), so a CTA runs QK MMA ->
softmax -> PV MMA strictly in series and only the two CTAs of an SM overlap each other. Gluon exposes
``warpgroup_mma(..., is_async=True)`` and ``warpgroup_mma_wait(num_outstanding)``, so this kernel keeps
the tensor cores busy during the softmax (FA3's intra-warpgroup pipelining):

    iteration j:  issue S_j = Q K_j^T        (async)
                  issue PV_{j-1} = P~_{j-1} V_{j-1}   (async, fresh accumulator: two-level accumulation)
                  wait until 1 group is outstanding    -> S_j is ready, PV_{j-1} still runs
                  softmax of S_j -> P~_j, alpha_j, r_j (while PV_{j-1} runs)
                  wait for PV_{j-1}; acc = acc * alpha_{j-1} + PV_{j-1} + r_{j-1} mu'_{j-1}
                  refill the freed K and V stages (TMA)

Notation (as ``vsmooth_attn.py``)
--------
BM, BN, D   query rows per program, keys per block (BN = 128 = BLOCK_V), head dim.
t           = bits(qk + 0x4B400000) = qk + C, C = 1.5 * 2^23: the magic-number int32 -> float conversion
            of the INT8 scores (no I2F). ks is one K scale per 64 keys: two scalars per block (ks0, ks1),
            loaded one step ahead. exp2 path, full block: the base-2 logit (t - C) ks qs, the max
            subtraction and the P~ scale are ONE FFMA inside the exponent, with coefficients per (row,
            64-key half); the row max comes from the exact integer maxima of the two halves. ExpCast and
            the masked key-tail block (one, after the loop) form s = (t - C) ks first, then scale rows
            (the tail: qs applied before its -inf mask).
qs          [BM] per-token Q scale (sm_scale * log2 e folded in); the base-2 logit is (t - C) ks qs_i.
m_i, l_i    running row max / row sum (of the decoded P~, summed in fp16 as ROWSUM = 2; MS: exact, by an MMA,
            l_i a [BM, 8] tile whose columns all hold the sum).
R_w         MS: the mean term's window, r_j at the current max for the 8 key blocks of window w (slot j % 8),
            added as acc += R_w mu'_w by tf32 MMAs every 8th block.
P~          fp8(256 * 2^(s - m_i)) (exp2 + cast) or the ExpCast E4M3 code: mode 2 rounds as the reference
            (s, then the code), mode 3 (the default) forms and rounds the code in ONE FFMA (``_softmax_block``).
acc         the PV accumulator in units of v_scale; O = acc * v_scale / l_i.

Register P~ (PREG): P~ stays in registers as the PV MMA's A operand (no shared-memory round trip, no barrier
before PV): the keys of each 128-block are relabelled so that the QK accumulator's registers already are
the A operand's (``_p_operand``), V^T's key columns are stored in the same order (``key_order_sm90``), and
the step order changes. PP = 0 (``_prefetch_step``): S_{j+1} is issued before the softmax of S_j, PV_j right after
it; PP = 1 (``_pp_step``): both issued after the softmax, PV_j retired first; PP = 2: as 1, the two consumer
warp groups taking turns at the issue point (FA3's ping-pong; measured slower). MS (PP >= 1): the row sum and
the V-Smooth mean term leave the ALUs for the tensor cores (``_row_sum_mma``, ``_flush_mean``; kernels_notes
v7). Every MMA is retired within its step (one in flight across the loop's back edge makes ptxas serialise
them all). On the exp2 path P~ is packed by ``_e4m3x4`` (ptxas's fused F2FP.MERGE_C packing gave wrong / NaN
rows with the mean term on).

Parallelisation: grid ``(ceil(S / BM), B * H)``; one program = BM query rows of one (b, h), num_warps / 4
warp groups splitting the rows (16 rows per warp); K / V stream through a STAGES-deep TMA ring with one
mbarrier per stage and tensor. Warp-specialised (WS, ExpCast): grid ``(ceil(S / 2 BM), B * H)``, two
consumer warp groups of BM rows and a producer warp that runs the TMA ring (ready / empty mbarriers),
one CTA per SM. sm_90 only (wgmma, TMA); no interpreter path: CPU tests compile it for sm_90 offline, GPU
tests compare it with the reference and with ``vsmooth_attn.py``.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from vc_compile.templates.configs import POperand, VSmoothSm90Config


@gluon.jit
def _half_scales_max(t, lo, qs, m_i, ks0, ks1):
    """Per (row, 64-key half) logit scales a_h = ks_h qs and the new row max from the exact integer maxima of the
    two halves of t (= C + qk), scaled by the same a_h."""
    mt0 = gl.max(gl.where(lo, t, float("-inf")), 1) - 12582912.0
    mt1 = gl.max(gl.where(lo, float("-inf"), t), 1) - 12582912.0
    a0 = ks0 * qs
    a1 = ks1 * qs
    return a0, a1, gl.maximum(m_i, gl.maximum(mt0 * a0, mt1 * a1))


@gluon.jit
def _k_scales(KS_bh, blk, Sk, BN: gl.constexpr, BKS: gl.constexpr):
    """The two K scales of key block ``blk`` (keys [0, BKS) and [BKS, BN) of it; 0 past Sk)."""
    ks0 = gl.load(KS_bh + blk * (BN // BKS), mask=blk * BN < Sk, other=0.0)
    ks1 = gl.load(KS_bh + blk * (BN // BKS) + 1, mask=blk * BN + BKS < Sk, other=0.0)
    return ks0, ks1


@gluon.jit
def _softmax_block(s_i32, j, Sk, qs, m_i, ks0, ks1, s_layout: gl.constexpr, BN: gl.constexpr,
                   BKS: gl.constexpr, EXPCAST: gl.constexpr, MASK: gl.constexpr, o_layout: gl.constexpr,
                   PREG: gl.constexpr, ROWSUM: gl.constexpr = True):
    """One key block's online-softmax step: (P~ fp8 [BM, BN], alpha [BM], r [BM], m_new [BM]). ``ks0``,
    ``ks1``: the block's two K scales (keys [0, BKS) and [BKS, BN)), loaded a step ahead by the caller.
    PREG: P~ comes back as the PV MMA's register A operand (keys relabelled, ``_p_operand``). ROWSUM = 0: r is
    not formed here (the MMA sums P~, ``_row_sum_mma``)."""
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    lo = (cols < BKS)[None, :]  # constant per register in the MMA layout: selects, not per-element work
    t = (s_i32 + 0x4B400000).to(gl.float32, bitcast=True)  # 1.5 * 2^23 + qk, exact (|qk| < 2^22)
    if MASK:
        # the key-tail block: s = (t - C) ks, then the row scale, as the Triton kernel and the reference (NOTE:
        # for ExpCast the exp2-style fold alone measured 35.1 / 35.3 ms against 34.7 / 34.8 ms in the
        # shared-memory-P~ kernel, H200, S = 32760, D = 128; the full-block ExpCast below also moves the
        # rounding into the FFMA)
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
        a0, a1, m_new = _half_scales_max(t, lo, qs, m_i, ks0, ks1)
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
        y = gl.maximum(y, 8388608.0)  # code 0 below (the row's underflow tail)
    else:
        # exp2 on a full block: the base-2 logit (t - C) ks qs, the max subtraction and the P~ scale 2^8 as
        # ONE FFMA inside the exponent, with coefficients per (row, 64-key half) a = ks qs, b = 8 - m - C a;
        # the row max from the exact integer maxima of the two halves, scaled by the same a.
        # NOTE (H200, S = 32760, D = 128, V-Smooth kernel): 33.56 ms unfolded -> 31.86 ms folded with the
        # K-scale prefetch (32.74 prefetch alone, 33.89 fold alone: the fold needs the scales early);
        # naive 31.25 -> 29.80.
        a0, a1, m_new = _half_scales_max(t, lo, qs, m_i, ks0, ks1)
        b0 = (8.0 - m_new) - 12582912.0 * a0
        b1 = (8.0 - m_new) - 12582912.0 * a1
        y = t * gl.where(lo, a0[:, None], a1[:, None]) + gl.where(lo, b0[:, None], b1[:, None])
    alpha = gl.exp2(m_i - m_new)
    if PREG:  # fp32: a renaming of registers; the fp8 packing below then lands in the A operand's registers
        y = _p_operand(y, o_layout)
    if EXPCAST:
        if MASK:
            y = gl.maximum(y + 8388608.0, 8388608.0)  # round to the integer code (magic add), clamp at 0
        p8 = y.to(gl.int32, bitcast=True).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    elif PREG:
        p8 = _e4m3x4(gl.exp2(y))  # MUFU + cast, packed without ptxas's F2FP.MERGE_C chain (see _e4m3x4)
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
def _e4m3x4(x):
    """fp32 -> E4M3 (round to nearest even, saturating), four consecutive register elements per 32-bit word.
    ``.to(gl.float8e4nv)`` emits a 16-bit cvt per pair and ``mov.b32 {lo, hi}``, which ptxas may fuse into
    ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C`` chains; every register-P~ exp2 compile with such a chain (C not
    RZ) returned wrong or NaN rows on the H200 (those with F2FP + PRMT did not; kernels_notes v6). Here each
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
def _p_operand(x, o_layout: gl.constexpr):
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
    """k -> n: the key stored in column k of each BN-key block of V^T for ``_p_operand``'s relabelling."""
    order = []
    for k in range(BN):
        c, h, q, i1, e = k // 32, (k // 16) % 2, (k // 4) % 4, (k // 2) % 2, k % 2
        order.append(32 * c + 16 * h + 8 * i1 + 2 * q + e)
    return order


@gluon.jit
def _load_mu(m_smem, vslot, o_layout: gl.constexpr, MEAN: gl.constexpr):
    """The mu' row [1, D] of V stage ``vslot`` (MEAN), else a placeholder."""
    if MEAN:
        return m_smem.index(vslot).load(o_layout)
    else:
        return 0.0


@gluon.jit
def _load_v(desc_v, desc_m, v_smem, m_smem, vbar, slot, vt_row, m_row, blk, pred, BN: gl.constexpr,
            MEAN: gl.constexpr):
    """TMA of V^T block ``blk`` (and its mean row mu', when MEAN) into stage ``slot``."""
    if MEAN:
        mbarrier.expect(vbar.index(slot), desc_v.block_type.nbytes + desc_m.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc_m, [m_row + blk, 0], vbar.index(slot), m_smem.index(slot), pred=pred)
    else:
        mbarrier.expect(vbar.index(slot), desc_v.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc_v, [vt_row, blk * BN], vbar.index(slot), v_smem.index(slot), pred=pred)


@gluon.jit
def _fold_pv(acc, alpha, r, pv, mu, o_layout: gl.constexpr, MEAN: gl.constexpr):
    """acc = acc * alpha + PV (two-level: PV came from a fresh accumulator), + r mu' (V-Smooth's mean term,
    ``mu``: the block's mu' row [1, D], staged by TMA with its V)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv
    if MEAN:
        acc += gl.convert_layout(r, row_o)[:, None] * mu
    return acc


@gluon.constexpr_function
def _rs_layout(o_layout):
    """MS: the layout of the row-sum MMA's [BM, 8] accumulator (and of the mean window Rb)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=o_layout.warps_per_cta, instr_shape=[16, 8, 32])


@gluon.jit
def _row_sum_mma(p8, ones_smem, o_layout: gl.constexpr):
    """MS: r_j = P~_j 1 on the tensor cores, issued beside PV_j (same register A operand, N = 8 columns of ones
    in shared memory): [BM, 8] fp32 in the MMA layout (``_rs_layout``), every column the row sum of the decoded
    P~."""
    BM: gl.constexpr = p8.shape[0]
    r_layout: gl.constexpr = _rs_layout(o_layout)
    a = gl.convert_layout(p8, gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=4))
    return warpgroup_mma(a, ones_smem.permute((1, 0)), gl.zeros([BM, 8], gl.float32, r_layout), use_acc=False,
                         is_async=True)


@gluon.jit
def _mean_slot(Rb, rs, alpha, i):
    """MS: the deferred mean term's weights: every buffered r moves to the current max (x alpha_j) and r_j (rs)
    takes window slot i = j % 8. Slot i is accumulator column 2 (i % 4) + i // 4, which ``_flush_mean``'s
    relabelling turns into tf32 A-operand column i (the row of block 8 w + i's mu' in the group tile)."""
    r_layout: gl.constexpr = rs.type.layout
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, r_layout))
    a = gl.convert_layout(alpha, gl.SliceLayout(1, r_layout))[:, None]
    return gl.where((cols == 2 * (i % 4) + i // 4)[None, :], rs, Rb * a)


@gluon.jit
def _flush_mean(acc, Rb, mg_smem, mgbar, w, o_layout: gl.constexpr):
    """MS: acc += R_w mu'_w for window w (8 key blocks) as tf32 MMAs, async: R [BM, 8] the blocks' row sums at
    the current max (``_mean_slot``), mu'_w [8, D] their mean rows (shared-memory buffer w % 2, K-major: [D, 8],
    hi and lo tf32 parts). Three MMAs, R_hi mu_hi + R_lo mu_hi + R_hi mu_lo, keep ~2^-20 relative (one tf32 MMA
    alone truncates both to 11 bits)."""
    BM: gl.constexpr = Rb.shape[0]
    D: gl.constexpr = acc.shape[1]
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=o_layout.warps_per_cta,
                                                       instr_shape=[16, D, 8])
    # accumulator column 2 t + e (t = lane % 4) -> A-operand column 4 e + t: a renaming of registers
    ra = gl.convert_layout(Rb.reshape([BM, 4, 2]).permute((0, 2, 1)).reshape([BM, 8]),
                           gl.DotOperandLayout(operand_index=0, parent=t_layout, k_width=1))
    hi = (ra.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)  # the 11 bits tf32 keeps
    lo = ra - hi
    buf = w % 2
    mbarrier.wait(mgbar.index(buf), (w // 2) & 1)
    mhi = mg_smem.index(2 * buf).permute((1, 0))
    acc = gl.convert_layout(acc, t_layout)  # the same registers: the MMA takes its K step from the layout
    acc = warpgroup_mma(hi, mhi, acc, is_async=True)
    acc = warpgroup_mma(lo, mhi, acc, is_async=True)
    return warpgroup_mma(hi, mg_smem.index(2 * buf + 1).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _load_mean_group(desc_g, mg_smem, mgbar, g_row, w, ng, D: gl.constexpr):
    """MS: TMA of window w's mu' group tile (hi, lo: [2, D, 8] fp32) into buffer w % 2 (when w < ng)."""
    buf = w % 2
    pred = w < ng
    mbarrier.expect(mgbar.index(buf), 2 * desc_g.block_type.nbytes, pred=pred)
    for h in gl.static_range(2):
        tma.async_copy_global_to_shared(desc_g, [(g_row + w * 2 + h) * D, 0], mgbar.index(buf),
                                        mg_smem.index(2 * buf + h), pred=pred)


@gluon.jit
def _release_k(j, nb, slot, k_smem, kbar, kempty, desc_k, kv_row, BN: gl.constexpr, STAGES: gl.constexpr,
               WS: gl.constexpr):
    """K stage ``slot`` (block j) is no longer read: WS = 0 refills it with block j + STAGES itself, WS = 1 frees
    it to the producer warp."""
    if WS == 0:
        nk = j + STAGES
        mbarrier.expect(kbar.index(slot), desc_k.block_type.nbytes, pred=nk < nb)
        tma.async_copy_global_to_shared(desc_k, [kv_row + nk * BN, 0], kbar.index(slot), k_smem.index(slot),
                                        pred=nk < nb)
    else:
        mbarrier.arrive(kempty.index(slot), count=1)


@gluon.jit
def _release_v(j, nb, slot, v_smem, m_smem, vbar, vempty, desc_v, desc_m, vt_row, m_row, BN: gl.constexpr,
               STAGES: gl.constexpr, MEAN: gl.constexpr, WS: gl.constexpr):
    """V stage ``slot`` (block j: PV_j retired, mu'_j read) is free: WS = 0 refills it (the compiler puts a barrier
    before, for mu'), WS = 1 frees it to the producer warp once every warp of this group has read mu'_j."""
    if WS == 0:
        nv = j + STAGES
        _load_v(desc_v, desc_m, v_smem, m_smem, vbar, slot, vt_row, m_row, nv, nv < nb, BN, MEAN)
    else:
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(vempty.index(slot), count=1)


@gluon.jit
def _pipelined_step(j, nb, acc, l_i, m_i, alpha, r, p_smem, q_smem, k_smem, v_smem, m_smem, kbar, vbar, desc_k,
                    desc_v, desc_m, m_row,
                    kv_row, vt_row, zero_s, zero_o, Sk, KS_bh, qs, ks0, ks1, s_layout: gl.constexpr,
                    o_layout: gl.constexpr, BN: gl.constexpr, BKS: gl.constexpr, STAGES: gl.constexpr,
                    EXPCAST: gl.constexpr, MEAN: gl.constexpr,
                    MASK: gl.constexpr):
    """Key block j: S_j (async) and PV_{j-1} (async) on the tensor cores while the softmax of S_j runs."""
    ks_slot = j % STAGES
    mbarrier.wait(kbar.index(ks_slot), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(ks_slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    vslot = (j - 1) % STAGES
    mbarrier.wait(vbar.index(vslot), ((j - 1) // STAGES) & 1)
    pv_tok = warpgroup_mma(p_smem.index((j - 1) % 2), v_smem.index(vslot).permute((1, 0)), zero_o,
                           use_acc=False, is_async=True)
    s_i = warpgroup_mma_wait(1, deps=[s_tok])  # S_j ready; PV_{j-1} still in flight
    # block j+1's K scales, a step ahead: loaded here they would stall the softmax (global-load latency)
    ks0n, ks1n = _k_scales(KS_bh, j + 1, Sk, BN, BKS)
    p8n, alpha_n, r_n, m_i = _softmax_block(s_i, j, Sk, qs, m_i, ks0, ks1, s_layout, BN, BKS, EXPCAST, MASK,
                                            o_layout, False)
    p_smem.index(j % 2).store(p8n)  # read by PV_j in the next step (PV_{j-2}, its last reader, is done)
    fence_async_shared()
    nk = j + STAGES  # K stage ks_slot is free (S_j done): refill it
    mbarrier.expect(kbar.index(ks_slot), desc_k.block_type.nbytes, pred=nk < nb)
    tma.async_copy_global_to_shared(desc_k, [kv_row + nk * BN, 0], kbar.index(ks_slot), k_smem.index(ks_slot),
                                    pred=nk < nb)
    # the softmax results go through the wait so that the compiler cannot sink the softmax below it
    # (it did: the whole softmax ran after the PV wait, serialising the step again)
    pv, alpha_n, r_n, m_i = warpgroup_mma_wait(0, deps=[pv_tok, alpha_n, r_n, m_i])
    gl.thread_barrier()  # every warp's rows of P~_j are in shared memory before PV_j is issued
    acc = _fold_pv(acc, alpha, r, pv, _load_mu(m_smem, vslot, o_layout, MEAN), o_layout, MEAN)
    nv = j - 1 + STAGES  # V stage vslot is free (PV_{j-1} done): refill it
    _load_v(desc_v, desc_m, v_smem, m_smem, vbar, vslot, vt_row, m_row, nv, nv < nb, BN, MEAN)
    l_i = l_i * alpha_n + r_n
    return acc, l_i, m_i, alpha_n, r_n, ks0n, ks1n


@gluon.jit
def _pp_step(j, nb, acc, l_i, m_i, s_i, Rb, q_smem, k_smem, v_smem, m_smem, kbar, vbar, kempty, vempty, ones_smem,
             mg_smem, mgbar, desc_k, desc_v, desc_m, desc_g, m_row, g_row, ng, kv_row, vt_row, zero_s, zero_o, Sk,
             KS_bh, qs, ks0, ks1, s_layout: gl.constexpr, o_layout: gl.constexpr, BN: gl.constexpr,
             BKS: gl.constexpr, STAGES: gl.constexpr, EXPCAST: gl.constexpr, MEAN: gl.constexpr, MASK: gl.constexpr,
             WS: gl.constexpr, MS: gl.constexpr, NEXT: gl.constexpr):
    """Key block j with P~ in registers, the MMAs batched after the softmax: softmax(S_j) -> issue
    PV_j and S_{j+1} together -> retire PV_j (S_{j+1} still running) -> fold -> retire S_{j+1}. Nothing of
    this warp group's runs on the tensor cores during its softmax (with WS the other consumer warp group's
    softmax overlaps them).
    MS = 1: the row sum r_j = P~_j 1 is a third MMA beside PV_j (``_row_sum_mma``; l_i is then [BM, 8], every
    column the running sum), and the mean term waits in Rb for 8 blocks, added by tf32 MMAs (``_flush_mean``)
    with the last S wait of every 8th step instead of r_j mu'_j per step."""
    slot = j % STAGES
    nslot = (j + 1) % STAGES
    MU: gl.constexpr = MEAN and not MS  # mu'_j rows staged with V and added per step
    p8, alpha, r, m_i = _softmax_block(s_i, j, Sk, qs, m_i, ks0, ks1, s_layout, BN, BKS, EXPCAST, MASK, o_layout,
                                       True, not MS)
    _release_k(j, nb, slot, k_smem, kbar, kempty, desc_k, kv_row, BN, STAGES, WS)  # S_j retired last step
    # block j+1's K scales: in flight during the MMAs
    ks0n, ks1n = _k_scales(KS_bh, j + 1, Sk, BN, BKS)
    mbarrier.wait(vbar.index(slot), (j // STAGES) & 1)
    if NEXT:
        mbarrier.wait(kbar.index(nslot), ((j + 1) // STAGES) & 1)
    pv_tok = warpgroup_mma(p8, v_smem.index(slot).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    if MS:
        rs_tok = _row_sum_mma(p8, ones_smem, o_layout)
    if NEXT:
        s_tok = warpgroup_mma(q_smem, k_smem.index(nslot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if not MS:
        l_i = l_i * alpha + r
    if MS:
        pv, rs = warpgroup_mma_wait(1 if NEXT else 0, deps=[pv_tok, rs_tok])  # S_{j+1} may still run
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, _rs_layout(o_layout)))[:, None] + rs
    else:
        pv = warpgroup_mma_wait(1 if NEXT else 0, deps=[pv_tok])  # PV_j done (groups retire in order)
    mu = _load_mu(m_smem, slot, o_layout, MU)
    acc = _fold_pv(acc, alpha, r, pv, mu, o_layout, MU)
    _release_v(j, nb, slot, v_smem, m_smem, vbar, vempty, desc_v, desc_m, vt_row, m_row, BN, STAGES, MU, WS)
    if MS and MEAN:
        Rb = _mean_slot(Rb, rs, alpha, j % 8)
        if NEXT:
            if j % 8 == 7:  # the window's last block: R_w mu'_w on the tensor cores, behind S_{j+1}
                acc = _flush_mean(acc, Rb, mg_smem, mgbar, j // 8, o_layout)
                s_n, acc = warpgroup_mma_wait(0, deps=[s_tok, acc])
                acc = gl.convert_layout(acc, o_layout)
                Rb = gl.zeros([acc.shape[0], 8], gl.float32, _rs_layout(o_layout))
                _load_mean_group(desc_g, mg_smem, mgbar, g_row, j // 8 + 2, ng, acc.shape[1])  # its buffer is free
            else:
                s_n = warpgroup_mma_wait(0, deps=[s_tok])
        else:  # the last block: whatever the window holds
            acc = _flush_mean(acc, Rb, mg_smem, mgbar, j // 8, o_layout)
            acc = gl.convert_layout(warpgroup_mma_wait(0, deps=[acc]), o_layout)
            s_n = s_i
    elif NEXT:
        s_n = warpgroup_mma_wait(0, deps=[s_tok])
    else:
        s_n = s_i
    return acc, l_i, m_i, s_n, Rb, ks0n, ks1n


@gluon.jit
def _attend_rows(desc_q, desc_k, desc_v, desc_m, desc_g, q_smem, k_smem, v_smem, m_smem, p_smem, ones_smem, mg_smem,
                 qbar, kbar, vbar, kempty, vempty, mgbar, QS, KS, VS, OUT, LSE, S, Sk, nb, start_m,
                 BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, BKS: gl.constexpr, BV: gl.constexpr,
                 STAGES: gl.constexpr, EXPCAST: gl.constexpr, MEAN: gl.constexpr, HAS_TAIL: gl.constexpr,
                 RETURN_LSE: gl.constexpr, WS: gl.constexpr, PREG: gl.constexpr, MS: gl.constexpr):
    """BM query rows from ``start_m`` of head ``program_id(1)`` through all key blocks; O (and the LSE) stored.
    WS = 0: the warps also load K / V; WS = 1 (PREG only): a producer warp does (kbar / vbar filled by it,
    kempty / vempty freed here) and this is one of two consumer warp groups. MS = 1 (PREG only): row sums and
    the mean term on the tensor cores (``_pp_step``); ``mg_smem`` / ``mgbar`` this group's mu' group buffers."""
    gl.static_assert(WS == 0 or PREG == 1, "warp specialisation is built on the register-P~ step")
    gl.static_assert(MS == 0 or PREG == 1, "MMA row sums (MS) are built on the register-P~ step")
    NW: gl.constexpr = gl.num_warps()  # the partition's warps under warp specialisation
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BN, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, D, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    bh = gl.program_id(1)
    kv_row = bh * Sk
    vt_row = bh * D
    m_row = bh * gl.cdiv(Sk, BV)
    ng = gl.cdiv(nb, 8)  # MS: mu' groups (windows of 8 key blocks)
    g_row = bh * ng * 2

    mbarrier.expect(qbar, desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [bh * S + start_m, 0], qbar, q_smem)
    if WS == 0:
        for i in gl.static_range(STAGES):
            mbarrier.expect(kbar.index(i), desc_k.block_type.nbytes, pred=i < nb)
            tma.async_copy_global_to_shared(desc_k, [kv_row + i * BN, 0], kbar.index(i), k_smem.index(i),
                                            pred=i < nb)
            _load_v(desc_v, desc_m, v_smem, m_smem, vbar, i, vt_row, m_row, i, i < nb, BN, MEAN and not MS)
    if MS:
        _fill_ones(ones_smem)
        if MEAN:
            for w in gl.static_range(2):
                _load_mean_group(desc_g, mg_smem, mgbar, g_row, w, ng, D)

    rows = start_m + gl.arange(0, BM, layout=row_s)
    qs = gl.load(QS + bh.to(gl.int64) * S + rows, mask=rows < S, other=1.0)
    dcol = gl.arange(0, D, layout=col_o)
    KS_bh = KS + bh * gl.cdiv(Sk, BKS)
    zero_s = gl.zeros([BM, BN], gl.int32, s_layout)
    zero_o = gl.zeros([BM, D], gl.float32, o_layout)

    mbarrier.wait(qbar, 0)
    mbarrier.wait(kbar.index(0), 0)
    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    ks0 = gl.load(KS_bh)  # block 0's (it always has keys)
    ks1 = gl.load(KS_bh + 1, mask=BKS < Sk, other=0.0)
    acc = zero_o
    n_full = Sk // BN
    if PREG:
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_i = warpgroup_mma_wait(0, deps=[s_tok])
        # alpha = 0 at block 0 (m_i = -inf): acc, l_i (and MS's window Rb) start at 0
        Rb = gl.zeros([BM, 8], gl.float32, _rs_layout(o_layout))
        if MS:
            l_i = Rb
        else:
            l_i = gl.zeros([BM], gl.float32, row_s)
        for j in range(0, nb - 1):
            acc, l_i, m_i, s_i, Rb, ks0, ks1 = _pp_step(
                j, nb, acc, l_i, m_i, s_i, Rb, q_smem, k_smem, v_smem, m_smem, kbar, vbar, kempty, vempty,
                ones_smem, mg_smem, mgbar, desc_k, desc_v, desc_m, desc_g, m_row, g_row, ng, kv_row, vt_row, zero_s,
                zero_o, Sk, KS_bh, qs, ks0, ks1, s_layout, o_layout, BN, BKS, STAGES, EXPCAST, MEAN, False, WS,
                MS, True)
        acc, l_i, m_i, s_i, Rb, ks0, ks1 = _pp_step(  # the last block: masked when it holds the key tail
            nb - 1, nb, acc, l_i, m_i, s_i, Rb, q_smem, k_smem, v_smem, m_smem, kbar, vbar, kempty, vempty,
            ones_smem, mg_smem, mgbar, desc_k, desc_v, desc_m, desc_g, m_row, g_row, ng, kv_row, vt_row, zero_s,
            zero_o, Sk, KS_bh, qs, ks0, ks1, s_layout, o_layout, BN, BKS, STAGES, EXPCAST, MEAN, HAS_TAIL, WS, MS,
            False)
        if MS:  # every column holds the row sum
            l_i = gl.convert_layout(gl.max(l_i, 1), row_s)
    else:
        # block 0: S_0 and its softmax (nothing to overlap with yet); masked when it may hold the key tail
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_i = warpgroup_mma_wait(0, deps=[s_tok])
        p8, alpha, r, m_i = _softmax_block(s_i, 0, Sk, qs, m_i, ks0, ks1, s_layout, BN, BKS, EXPCAST, HAS_TAIL,
                                             o_layout, False)
        ks0, ks1 = _k_scales(KS_bh, 1, Sk, BN, BKS)  # block 1's, for the first loop step
        l_i = r
        p_smem.index(0).store(p8)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.expect(kbar.index(0), desc_k.block_type.nbytes, pred=STAGES < nb)
        tma.async_copy_global_to_shared(desc_k, [kv_row + STAGES * BN, 0], kbar.index(0), k_smem.index(0),
                                        pred=STAGES < nb)
        for j in range(1, n_full):
            acc, l_i, m_i, alpha, r, ks0, ks1 = _pipelined_step(
                j, nb, acc, l_i, m_i, alpha, r, p_smem, q_smem, k_smem, v_smem, m_smem, kbar, vbar, desc_k, desc_v,
                desc_m, m_row, kv_row, vt_row, zero_s, zero_o, Sk, KS_bh, qs, ks0, ks1, s_layout, o_layout, BN, BKS,
                STAGES, EXPCAST, MEAN, False)
        if HAS_TAIL:
            if n_full > 0:
                acc, l_i, m_i, alpha, r, ks0, ks1 = _pipelined_step(
                    n_full, nb, acc, l_i, m_i, alpha, r, p_smem, q_smem, k_smem, v_smem, m_smem, kbar, vbar, desc_k,
                    desc_v, desc_m, m_row, kv_row, vt_row, zero_s, zero_o, Sk, KS_bh, qs, ks0, ks1, s_layout, o_layout,
                    BN, BKS, STAGES, EXPCAST, MEAN, True)

        # the last block's PV
        vslot = (nb - 1) % STAGES
        mbarrier.wait(vbar.index(vslot), ((nb - 1) // STAGES) & 1)
        pv_tok = warpgroup_mma(p_smem.index((nb - 1) % 2), v_smem.index(vslot).permute((1, 0)), zero_o,
                               use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(0, deps=[pv_tok])
        acc = _fold_pv(acc, alpha, r, pv, _load_mu(m_smem, vslot, o_layout, MEAN), o_layout, MEAN)

    l_i = gl.where(qs < float("inf"), l_i, float("nan"))  # undefined logits (NaN/Inf in q or K): NaN row
    vs = gl.load(VS + bh * D + dcol)
    o = acc * (vs[None, :] / gl.convert_layout(l_i, row_o)[:, None])
    rows_o = start_m + gl.arange(0, BM, layout=row_o)
    gl.store(OUT + (bh.to(gl.int64) * S + rows_o[:, None]) * D + dcol[None, :],
             o.to(OUT.dtype.element_ty), mask=(rows_o < S)[:, None])
    if RETURN_LSE:
        gl.store(LSE + bh.to(gl.int64) * S + rows, m_i + gl.log2(l_i) - 8.0, mask=rows < S)


@gluon.jit
def _ones_operand(BN: gl.constexpr):
    """MS: shared memory for the B operand [8, BN] fp8 of the row-sum MMA (filled by ``_fill_ones``)."""
    return gl.allocate_shared_memory(gl.float8e4nv, [8, BN],
                                     gl.NVMMASharedLayout.get_default_for([8, BN], gl.float8e4nv))


@gluon.jit
def _fill_ones(ones_smem):
    """MS: all ones into this warp group's row-sum operand, visible to its MMAs (every warp's part written).
    The bytes are written as 0x38 (E4M3 1.0): a converted constant ``gl.full(1.0).to(gl.float8e4nv)`` read back
    wrong by the MMA on the H200 (row sums off by 0.5-100x; the same tile loaded from memory was exact)."""
    fill: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
    ones_smem.store(gl.full(ones_smem.shape, 0x38, gl.uint8, fill).to(gl.float8e4nv, bitcast=True))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _mean_group_buffers(desc_g, D: gl.constexpr, MS: gl.constexpr):
    """MS: one consumer's mu' group buffers [2 windows x (hi, lo), D, 8] fp32 and their barriers (a 2-row
    placeholder otherwise)."""
    mg_smem = gl.allocate_shared_memory(gl.float32, [4, D, 8] if MS else [2, 8, 8], desc_g.layout)
    mgbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(mgbar.index(i), count=1)
    return mg_smem, mgbar


@gluon.jit
def _vsmooth_attn_sm90_kernel(desc_q, desc_k, desc_v, desc_m, desc_g, QS, KS, VS, OUT, LSE, S, Sk, nb,
                              BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, BKS: gl.constexpr,
                              BV: gl.constexpr, STAGES: gl.constexpr, EXPCAST: gl.constexpr,
                              MEAN: gl.constexpr, HAS_TAIL: gl.constexpr, RETURN_LSE: gl.constexpr,
                              PREG: gl.constexpr, MS: gl.constexpr, num_warps: gl.constexpr):
    """BM rows per program, num_warps / 4 warp groups that also load K / V (at BM = 64: two CTAs per SM)."""
    p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float8e4nv)
    q_smem = gl.allocate_shared_memory(desc_q.dtype, [BM, D], desc_q.layout)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES, BN, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES, D, BN], desc_v.layout)
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BM, BN], p_shared)  # P~ double buffer (unless PREG)
    m_smem = gl.allocate_shared_memory(desc_m.dtype, [STAGES, 1, D], desc_m.layout)  # mu' rows, with V
    ones_smem = _ones_operand(BN)  # (1 KB; read only when MS)
    mg_smem, mgbar = _mean_group_buffers(desc_g, D, MS)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kbar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vbar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qbar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kbar.index(i), count=1)
        mbarrier.init(vbar.index(i), count=1)
    _attend_rows(desc_q, desc_k, desc_v, desc_m, desc_g, q_smem, k_smem, v_smem, m_smem, p_smem, ones_smem, mg_smem,
                 qbar, kbar, vbar, kbar, vbar, mgbar, QS, KS, VS, OUT, LSE, S, Sk, nb, gl.program_id(0) * BM,
                 BM, BN, D, BKS, BV, STAGES, EXPCAST, MEAN, HAS_TAIL, RETURN_LSE, 0, PREG, MS)
    mbarrier.invalidate(qbar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kbar.index(i))
        mbarrier.invalidate(vbar.index(i))


@gluon.jit
def _ws_producer(desc_k, desc_v, desc_m, k_smem, v_smem, m_smem, kbar, vbar, kempty, vempty, Sk, nb,
                 BN: gl.constexpr, D: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, MEAN: gl.constexpr):
    """The producer warp: K_j, then V_j (and mu'_j, when MEAN), into the STAGES ring once both consumers freed
    the stage."""
    bh = gl.program_id(1)
    kv_row = bh * Sk
    vt_row = bh * D
    m_row = bh * gl.cdiv(Sk, BV)
    for j in range(nb):
        slot = j % STAGES
        ph = ((j // STAGES) & 1) ^ 1  # a fresh barrier counts as phase 1 complete: the first round passes
        mbarrier.wait(kempty.index(slot), ph)
        mbarrier.expect(kbar.index(slot), desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [kv_row + j * BN, 0], kbar.index(slot), k_smem.index(slot))
        mbarrier.wait(vempty.index(slot), ph)
        _load_v(desc_v, desc_m, v_smem, m_smem, vbar, slot, vt_row, m_row, j, True, BN, MEAN)


@gluon.jit
def _vsmooth_attn_sm90_ws_kernel(desc_q, desc_k, desc_v, desc_m, desc_g, QS, KS, VS, OUT, LSE, S, Sk, nb,
                                 BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, BKS: gl.constexpr,
                                 BV: gl.constexpr, STAGES: gl.constexpr, EXPCAST: gl.constexpr,
                                 MEAN: gl.constexpr, HAS_TAIL: gl.constexpr, RETURN_LSE: gl.constexpr,
                                 MS: gl.constexpr, num_warps: gl.constexpr):
    """Warp-specialised (register P~): two consumer warp groups of BM rows each (the default partition and a
    worker) share a K / V ring that a producer warp fills; one CTA (12 warps) per SM."""
    q_smem = gl.allocate_shared_memory(desc_q.dtype, [2, BM, D], desc_q.layout)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES, BN, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES, D, BN], desc_v.layout)
    m_smem = gl.allocate_shared_memory(desc_m.dtype, [STAGES, 1, D], desc_m.layout)
    qbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kbar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vbar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kempty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vempty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ones0 = _ones_operand(BN)  # MS: a row-sum operand and mu' group buffers per consumer
    ones1 = _ones_operand(BN)
    mg0, mgbar0 = _mean_group_buffers(desc_g, D, MS)
    mg1, mgbar1 = _mean_group_buffers(desc_g, D, MS)
    for i in gl.static_range(2):
        mbarrier.init(qbar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kbar.index(i), count=1)
        mbarrier.init(vbar.index(i), count=1)
        mbarrier.init(kempty.index(i), count=2)  # both consumers
        mbarrier.init(vempty.index(i), count=2)
    start = gl.program_id(0) * (2 * BM)
    gl.warp_specialize([
        (_attend_rows, (desc_q, desc_k, desc_v, desc_m, desc_g, q_smem.index(0), k_smem, v_smem, m_smem, q_smem,
                        ones0, mg0, qbar.index(0), kbar, vbar, kempty, vempty, mgbar0, QS, KS, VS, OUT, LSE,
                        S, Sk, nb, start, BM, BN, D, BKS, BV, STAGES, EXPCAST, MEAN, HAS_TAIL, RETURN_LSE, 1, 1,
                        MS)),
        (_attend_rows, (desc_q, desc_k, desc_v, desc_m, desc_g, q_smem.index(1), k_smem, v_smem, m_smem, q_smem,
                        ones1, mg1, qbar.index(1), kbar, vbar, kempty, vempty, mgbar1, QS, KS, VS, OUT, LSE,
                        S, Sk, nb, start + BM, BM, BN, D, BKS, BV, STAGES, EXPCAST, MEAN, HAS_TAIL, RETURN_LSE, 1, 1,
                        MS)),
        (_ws_producer, (desc_k, desc_v, desc_m, k_smem, v_smem, m_smem, kbar, vbar, kempty, vempty, Sk, nb, BN, D,
                        BV, STAGES, MEAN and not MS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# register split of a warp-specialised CTA (12 warps: 3 warp groups of 128 threads): producer 24 + consumer
# 240 (worker) + consumer 240 (the default partition, what is left of 168 x 3) = 504 <= 65536 / 128
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
WS_MAXNREG = 168


_KEY_ORDER = {}


def _key_order_tensor(device, BN: int):
    """``key_order_sm90`` as an index tensor on ``device``, made once (no host-to-device copy per call, which
    CUDA-graph capture would refuse)."""
    key = (str(device), BN)
    if key not in _KEY_ORDER:
        import torch
        _KEY_ORDER[key] = torch.tensor(key_order_sm90(BN), device=device)
    return _KEY_ORDER[key]


def _mean_groups(mu_prime):
    """MS: mu' [BH, nb, D] as the tf32 MMAs' B tiles, [BH * ng * 2 * D, 8] fp32: per window of 8 key blocks
    (zero-padded to ng windows) the hi and lo tf32 parts of mu'^T [D, 8] (K-major, the blocks along the 8)."""
    import torch
    BH, nb, D = mu_prime.shape
    ng = -(-nb // 8)
    m = torch.nn.functional.pad(mu_prime, (0, 0, 0, ng * 8 - nb)).view(BH, ng, 8, D).transpose(-1, -2)
    hi = (m.contiguous().view(torch.int32) & -8192).view(torch.float32)
    return torch.stack((hi, m - hi), dim=2).contiguous().view(-1, 8)


def vsmooth_attention_sm90(qk, vq, *, expcast: bool = False, out_dtype=None, return_lse: bool = False,
                           launch: VSmoothSm90Config):
    """As ``vsmooth_attn.vsmooth_attention`` (INT8 QK only): O [B, H, S, D] (and the base-2 LSE), with the launch
    configuration ``launch``."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from vc_compile.reference.preprocess import BLOCK_K, BLOCK_V
    from vc_compile.templates.vsmooth_attn import check_inputs

    if not isinstance(launch, VSmoothSm90Config):
        raise TypeError(f"launch must be a VSmoothSm90Config, got {type(launch).__name__}")
    out_dtype = out_dtype or torch.bfloat16
    check_inputs(qk, vq)
    q8, q_scale, k8, k_scale = qk.q8, qk.q_scale, qk.k8, qk.k_scale
    B, H, S, D = q8.shape
    Sk = k8.shape[2]
    if q8.dtype != torch.int8 or k8.dtype != torch.int8:
        raise ValueError(f"the sm_90 kernel takes INT8 Q/K codes, got {q8.dtype}, {k8.dtype}")
    BM, nw, stages = launch.block_m, launch.num_warps, launch.stages
    ws, preg, ms = launch.warp_specialize, launch.p_operand == POperand.REGISTERS, launch.mma_sums
    BN = BLOCK_V
    q8, k8, v8t = q8.contiguous(), k8.contiguous(), vq.v8t.contiguous()
    S_pad = v8t.shape[-1]
    if preg:  # V^T's key columns in _p_operand's order within each block: one copy of V^T (S D bytes per head)
        v8t = v8t.view(B, H, D, S_pad // BN, BN)[..., _key_order_tensor(v8t.device, BN)].reshape(B, H, D, S_pad)
    lay = gl.NVMMASharedLayout.get_default_for
    desc_q = TensorDescriptor.from_tensor(q8.view(B * H * S, D), [BM, D], lay([BM, D], gl.int8))
    desc_k = TensorDescriptor.from_tensor(k8.view(B * H * Sk, D), [BN, D], lay([BN, D], gl.int8))
    desc_v = TensorDescriptor.from_tensor(v8t.view(B * H * D, S_pad), [D, BN], lay([D, BN], gl.float8e4nv))
    out = torch.empty(B, H, S, D, device=q8.device, dtype=out_dtype)
    lse = torch.empty(B, H, S, device=q8.device, dtype=torch.float32) if return_lse else out
    mean = 0 if vq.zero_mean else 1
    nb = -(-Sk // BN)
    # mu' = mu / v_scale (the mean in units of v_scale), [B, H, nb, D] fp32: one small op here instead of a
    # [D] reciprocal held in 32 registers per thread through the key loop
    if mean:
        mu_prime = (vq.v_mean / vq.v_scale.unsqueeze(2)).contiguous().view(-1, D)
    else:  # never read (MEAN = 0); any fp32 [rows, D] tensor makes a valid descriptor
        mu_prime = torch.zeros(1, D, device=q8.device)
    desc_m = TensorDescriptor.from_tensor(mu_prime, [1, D], lay([1, D], gl.float32))
    if ms and mean:
        mu_groups = _mean_groups(mu_prime.view(B * H, nb, D))
    else:  # never read; a valid [rows, 8] fp32 descriptor
        mu_groups = torch.zeros(D, 8, device=q8.device)
    desc_g = TensorDescriptor.from_tensor(mu_groups, [D, 8], lay([D, 8], gl.float32))
    args = (desc_q, desc_k, desc_v, desc_m, desc_g, q_scale.contiguous(), k_scale.contiguous(),
            vq.v_scale.contiguous(), out, lse, S, Sk, nb)
    consts = dict(BM=BM, BN=BN, D=D, BKS=BLOCK_K, BV=BLOCK_V, STAGES=stages, EXPCAST=3 if expcast else 0,
                  MEAN=mean, HAS_TAIL=Sk % BN != 0, RETURN_LSE=bool(return_lse), MS=int(ms))
    if ws:
        _vsmooth_attn_sm90_ws_kernel[(-(-S // (2 * BM)), B * H)](*args, **consts, num_warps=4, maxnreg=WS_MAXNREG)
    else:
        _vsmooth_attn_sm90_kernel[(-(-S // BM), B * H)](*args, **consts, PREG=int(preg), num_warps=nw)
    return (out, lse) if return_lse else out
