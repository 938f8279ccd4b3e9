"""Token-gather sparse attention for sm_90 in Gluon: the bf16 / fp16 contract of ``sparse_attn.py``
(``qk_format="bf16"``; reference ``vc_compile/reference/sparse_attn.py``) with a producer warp group gathering the
selected K / V rows while two consumer warp groups run the MMAs and the softmax. MC-Sparse's gather kernel on
sm_90 GPUs (``dispatch.sparse_kernel``: bf16 / fp16 scores, head dims 64 / 128, C = 64 / 128); measured in
``benchmarks/bench_sparse_attn_sm90.py`` (docs/design/sparse-gather-sm90.md).

Why a second kernel: the Triton kernel runs one warp group per program at 255 registers, so two programs share an
SM, each waits for its own gathered rows (long-scoreboard stalls on the gather) and runs QK -> softmax -> PV in
series. Here the gather has its own warps and the two consumers' MMAs overlap each other's softmax.

Notation (as ``sparse_attn.py``)
--------
q, k, v     [B, H, S, D], [B, H, Sk, D], [B, H, Sk, Dv]; bf16 or fp16, last dim contiguous; D, Dv in {64, 128}.
C           group size (64 or 128); G = ceil(S / C) groups, the last partial; sigma [B, H, S] the query order.
idx         [B, H, G, n] int16 / int32 / int64 kept keys per group, sorted ascending, any strides: key ids
            (RUN = 1), or run numbers r of aligned runs of RUN keys (keys r*RUN .. r*RUN + RUN - 1); n_keep = n *
            RUN keys, key j of the list = idx[j // RUN] * RUN + j % RUN (a shift and a mask: RUN a power of two).
RSCALE      with a residual of 8-bit codes (int8 or FP8 E4M3): its per-token scale [B, H, S] fp32, R = codes x
            scale in fp32.
BN          keys per block (``SparseAttnSm90Config.block_n``); nb = ceil(n_keep / BN), the last block masked.
ring        STAGES stages of K [BN, D] and V [BN, Dv] rows in shared memory (the rows of one block of the
            group's selected keys, in selection order), four mbarriers per stage: kready / vready (the
            producer's cp.async rows landed: every producer thread arrives when its own copies complete,
            ``cp.async.mbarrier.arrive.noinc``; PFENCE: one arrival after the producer waited for its copies
            and fenced) and kempty / vempty (the consumers that read the ring are done).
s           base-2 logits s = (q . k) * sm_scale * log2(e); online softmax with exp2, the scale folded into the
            exponent's FFMA; m_i, l_i the running row max (in scaled units) and row sum; acc the PV accumulator
            (fp32, in the wgmma accumulator's registers, rescaled by alpha before each PV; OVERLAP: after PV_{j-1}
            retired, by alpha_j).
P           exp2(s - m_i) as the PV MMA's A operand in registers (16-bit: the QK accumulator's registers already
            hold the A operand's elements; the conversion is a cast, no shared memory).
QK8         8-bit QK (``k`` int8 codes from ``sparse_attn.quantize_k_int8_head``: K smoothed, one scale per head,
            ``k_scale``): the consumers quantise their Q rows (one scale a row, amax / 127) into the shared Q tile,
            QK is an int8 wgmma (k = 32) into int32, t = bits(qk + 0x4B400000) = 1.5 * 2^23 + qk as a float (one
            IADD), and crow = q_scale x k_scale x sm_scale log2 e folds every scale into the exponent's FFMA:
            p = exp2(t crow - (m + 1.5 * 2^23 crow)). PV unchanged (16-bit P and V).

Parallelisation
---------------
A tile is GPC query groups of one head (GPC = 1 at C = 128, 2 at C = 64): n_gc = ceil(G / GPC) tiles per head,
tile t = CTA group t % n_gc of head t // n_gc (the tiles of one head run together, so its K / V stay in L2). One
CTA (12 warps) per SM; grid: one CTA per tile. The partitions loop over tiles t = program_id, + num_programs, ...
with the ring position counted on across them (every tile has nb blocks); with one CTA per tile the loop runs
once (NOTE kept: it is the code the default was measured with; the grid it served, one CTA per SM, measured
slower and was removed: docs/design/sparse-launch-config.md).
* producer (4 warps, ``producer_regs`` registers): per block, the BN key ids (loaded a block ahead), then K rows
  and V rows by cp.async (16 bytes per thread, 4 threads per 64-byte row segment: full 32-byte sectors) into the
  next free stage; masked (zero-filled) rows past n_keep. C = 64: the blocks of both groups, one ring each.
  The cp.async writes are generic-proxy writes that wgmma reads through the async proxy: a proxy fence sits
  between them. ``producer_fence`` (PFENCE, the C = 128 default): the producer waits for its own copies
  (cp.async.wait_group), fences and releases the stage (K_j once it landed, V_{j-1} once K_j is issued), so
  the consumers' loop has no fence; otherwise every consumer fences after each ready wait.
* two consumers (4 warps each, ``consumer_regs``): 64 query rows each, gathered through sigma into shared memory
  (Q stays there: QK's A operand). C = 128: rows 0-63 and 64-127 of the CTA's group, one shared ring (a K / V
  stage is freed when both consumers are done: the gathered bytes per FLOP halve against C = 64); C = 64: one
  group each, each its own ring. Per block, two orders:
  - ``overlap`` (OVERLAP, FlashAttention-3's order inside a warp group; the C = 128 default): issue S_j =
    Q K_j^T and PV_{j-1} (P_{j-1} from registers, V_{j-1} from the ring) together -> wait for S_j (free K_j)
    -> softmax(S_j) while PV_{j-1} runs -> wait for PV_{j-1} (free V_{j-1}) -> acc *= alpha_j, P_j cast to
    16 bits (only now: a non-wgmma write of a wgmma operand while one is in flight makes ptxas serialise every
    wgmma, C7513). Registers: S 64 + acc 64 + P 32, P_{j-1} live until PV_{j-1} retires.
  - otherwise (S_j given): softmax(S_j) -> acc *= alpha -> issue PV_j and S_{j+1} = Q K_{j+1}^T together ->
    wait until one group is outstanding (PV_j done: free V_j) -> wait for S_{j+1}
    (free K_{j+1}), the order ``vsmooth_attn_sm90_steps.register_step`` measured best for the 8-bit kernel.
  Either way the tensor cores also run one consumer's MMAs during the other's softmax. Both orders do the same
  operations on acc in the same order: the same bits.
* epilogue per consumer: O = acc / l_i (+ residual, gathered through sigma), the flagged columns NaN, the rows
  scattered to sigma.

sm_90 only (wgmma, setmaxnreg); no interpreter path: CPU tests compile it for sm_90 offline
(``tests/codegen_sparse_sm90.py``), GPU tests compare it with the reference and with ``sparse_attn.py``.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from vc_compile.kernels.compat import assembled, barrier, cp_async_load
from vc_compile.formats import LOG2E
from vc_compile.kernels.configs import SparseAttnSm90Config
from vc_compile.kernels.sparse_attn import epilogue_operands, gather_operands

__all__ = ["sparse_attention_sm90"]

WS_MAXNREG = 168  # 12 warps: 168 x 3 = 504 registers per thread slot (consumers + producer)


@gluon.constexpr_function
def _gather_layout(NW, VEC=8):
    """Rows x columns (K's D or V's Dv): VEC contiguous elements (16 bytes: 8 16-bit or 16 8-bit ones) per
    thread, 4 threads per 64-byte segment, 8 rows per warp; warps stacked along the rows. The rows are
    distributed alike for every VEC, so one id vector serves the K and the V gathers."""
    return gl.BlockedLayout([1, VEC], [8, 4], [NW, 1], [1, 0])


@gluon.jit
def _gather_rows(base, kid, row_stride, smem, d, valid, MASK: gl.constexpr):
    """cp.async of the rows ``kid`` (each D elements from ``base + kid * row_stride``) into ``smem`` [BN, D];
    MASK: rows where ``valid`` is false are zero-filled."""
    ptrs = base + kid[:, None] * row_stride + d[None, :]
    if MASK:
        cp_async_load(smem, ptrs, mask=valid[:, None])
    else:
        cp_async_load(smem, ptrs)


@gluon.jit
def _produce_block(it, kid, valid, k_base, v_base, sks, svs, k_smem, v_smem, kready, vready, kempty, vempty,
                   ring: gl.constexpr, STAGES: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                   MASK: gl.constexpr, PFENCE: gl.constexpr, vprev=False):
    """The block at ring position ``it`` (the CTA's blocks counted over its tiles) of ring ``ring``: wait for its
    stage to be free, then the K rows and the V rows by cp.async, each completing on its ready barrier (one noinc
    arrival per producer thread). PFENCE: the producer completes its own copies (cp.async.wait_group), fences
    the generic proxy against the async one and releases the stage with one arrival; V of the block before
    (``vprev``: there is one in flight) is released once K of this block is issued, K of this block once it
    landed, before this block's V is issued (``_produce_flush`` releases a tile's last V)."""
    NW: gl.constexpr = gl.num_warps()
    KVEC: gl.constexpr = 128 // k_smem.dtype.primitive_bitwidth
    slot = ring * STAGES + it % STAGES
    ph = ((it // STAGES) & 1) ^ 1  # a fresh barrier counts as phase 1 complete: the first round passes
    dk = gl.arange(0, D, layout=gl.SliceLayout(0, _gather_layout(NW, KVEC)))
    dv = gl.arange(0, DV, layout=gl.SliceLayout(0, _gather_layout(NW)))
    mbarrier.wait(kempty.index(slot), ph)
    if KVEC == 8:
        _gather_rows(k_base, kid, sks, k_smem.index(slot), dk, valid, MASK)
    else:  # 8-bit K rows: the same rows in the 16-element layout (no data movement)
        krow_l: gl.constexpr = gl.SliceLayout(1, _gather_layout(NW, KVEC))
        _gather_rows(k_base, gl.convert_layout(kid, krow_l), sks, k_smem.index(slot), dk,
                     gl.convert_layout(valid, krow_l), MASK)
    if PFENCE:
        async_copy.commit_group()
        async_copy.wait_group(1)  # V of the block before landed (K of this one may still fly)
        fence_async_shared()
        mbarrier.arrive(vready.index(ring * STAGES + (it + STAGES - 1) % STAGES), count=1, pred=vprev)
        async_copy.wait_group(0)
        fence_async_shared()
        mbarrier.arrive(kready.index(slot), count=1)
    else:
        async_copy.mbarrier_arrive(kready.index(slot), increment_count=False)
    mbarrier.wait(vempty.index(slot), ph)
    _gather_rows(v_base, kid, svs, v_smem.index(slot), dv, valid, MASK)
    if PFENCE:
        async_copy.commit_group()
    else:
        async_copy.mbarrier_arrive(vready.index(slot), increment_count=False)


@gluon.jit
def _produce_flush(it, vready, ring: gl.constexpr, STAGES: gl.constexpr):
    """PFENCE: release V of the block at ring position ``it`` (the last of a tile) once it landed."""
    async_copy.wait_group(0)
    fence_async_shared()
    mbarrier.arrive(vready.index(ring * STAGES + it % STAGES), count=1)


@gluon.jit
def _load_ids(i_base, blk, offs, sin, N_KEEP, OFF64: gl.constexpr, RUN: gl.constexpr):
    """Key ids of block ``blk`` (0 past n_keep), in the gather layout's rows; RUN > 1: from run numbers."""
    pos = blk * offs.shape[0] + offs
    kid = gl.load(i_base + (pos // RUN) * sin, mask=pos < N_KEEP, other=0)
    kid = kid.to(gl.int64) if OFF64 else kid.to(gl.int32)
    if RUN > 1:
        kid = kid * RUN + pos % RUN
    return kid


@gluon.jit
def _produce_tile(K, V, IDX, k_smem, v_smem, kready, vready, kempty, vempty, H, G, N_KEEP, gc, bh, it0,
                  skb, skh, sks, svb, svh, svs, sib, sih, sig, sin,
                  GPC: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
                  HAS_TAIL: gl.constexpr, OFF64: gl.constexpr, PFENCE: gl.constexpr, RUN: gl.constexpr):
    """Tile (gc, bh): block j of every ring (ring r = the tile's group r) at ring position it0 + j, the rings in
    lockstep so that at C = 64 neither consumer waits for the other's blocks; each block's ids loaded a block
    ahead."""
    NW: gl.constexpr = gl.num_warps()
    row_l: gl.constexpr = gl.SliceLayout(1, _gather_layout(NW))
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    nb = gl.cdiv(N_KEEP, BN)
    offs = gl.arange(0, BN, layout=row_l)
    # a C = 64 tile past the last group (odd G) gathers the last group's keys again; its rows store nothing
    ib0 = IDX + b * sib + h * sih + gl.minimum(gc * GPC, G - 1).to(gl.int64) * sig
    kid0 = _load_ids(ib0, 0, offs, sin, N_KEEP, OFF64, RUN)
    if GPC == 2:
        ib1 = IDX + b * sib + h * sih + gl.minimum(gc * GPC + 1, G - 1).to(gl.int64) * sig
        kid1 = _load_ids(ib1, 0, offs, sin, N_KEEP, OFF64, RUN)
    for j in range(0, nb - 1 if HAS_TAIL else nb):
        kn0 = _load_ids(ib0, j + 1, offs, sin, N_KEEP, OFF64, RUN)  # in flight during this block's copies
        _produce_block(it0 + j, kid0, offs < BN, k_base, v_base, sks, svs, k_smem, v_smem, kready, vready, kempty,
                       vempty, 0, STAGES, D, DV, False, PFENCE, j > 0)
        kid0 = kn0
        if GPC == 2:
            kn1 = _load_ids(ib1, j + 1, offs, sin, N_KEEP, OFF64, RUN)
            _produce_block(it0 + j, kid1, offs < BN, k_base, v_base, sks, svs, k_smem, v_smem, kready, vready,
                           kempty, vempty, 1, STAGES, D, DV, False, PFENCE, j > 0)
            kid1 = kn1
    if HAS_TAIL:  # the last block: rows past n_keep zero-filled (no stale or non-finite V row meets p = 0)
        valid = (nb - 1) * BN + offs < N_KEEP
        _produce_block(it0 + nb - 1, kid0, valid, k_base, v_base, sks, svs, k_smem, v_smem, kready, vready, kempty,
                       vempty, 0, STAGES, D, DV, True, PFENCE, nb > 1)
        if GPC == 2:
            _produce_block(it0 + nb - 1, kid1, valid, k_base, v_base, sks, svs, k_smem, v_smem, kready, vready,
                           kempty, vempty, 1, STAGES, D, DV, True, PFENCE, nb > 1)
    if PFENCE:
        _produce_flush(it0 + nb - 1, vready, 0, STAGES)
        if GPC == 2:
            _produce_flush(it0 + nb - 1, vready, 1, STAGES)


@gluon.jit
def _producer(K, V, IDX, k_smem, v_smem, kready, vready, kempty, vempty, H, G, N_KEEP, n_gc, n_tiles,
              skb, skh, sks, svb, svh, svs, sib, sih, sig, sin,
              GPC: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
              HAS_TAIL: gl.constexpr, OFF64: gl.constexpr, PFENCE: gl.constexpr, RUN: gl.constexpr):
    """The producer warp group: the CTA's tiles t = program_id, + num_programs, ... (tile t = CTA group t % n_gc of
    head t // n_gc); the ring position runs on across tiles (module doc: one tile per CTA)."""
    nb = gl.cdiv(N_KEEP, BN)
    it0 = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        _produce_tile(K, V, IDX, k_smem, v_smem, kready, vready, kempty, vempty, H, G, N_KEEP, t % n_gc, t // n_gc,
                      it0, skb, skh, sks, svb, svh, svs, sib, sih, sig, sin, GPC, BN, D, DV, STAGES, HAS_TAIL, OFF64,
                      PFENCE, RUN)
        it0 += nb
    # no producer thread exits with its copies in flight (their noinc arrivals are what the consumers wait on)
    async_copy.commit_group()
    async_copy.wait_group(0)


@gluon.jit
def _consume_block(j, it, s, m_i, l_i, acc, q_smem, k_smem, v_smem, kready, vready, kempty, vempty, N_KEEP,
                   sm_scale_log2, crow, zero_s, ring: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr,
                   PDT: gl.constexpr, MASK: gl.constexpr, NEXT: gl.constexpr, PFENCE: gl.constexpr,
                   QK8: gl.constexpr):
    """Block j (at ring position ``it``) with S_j given: softmax -> PV_j and S_{j+1} (NEXT) issued together ->
    PV_j retired (V_j freed) -> S_{j+1} retired (K_{j+1} freed). Returns (S_{j+1} or s, m_i, l_i, acc)."""
    o_layout: gl.constexpr = acc.type.layout
    slot = ring * STAGES + it % STAGES
    nslot = ring * STAGES + (it + 1) % STAGES
    p, alpha, m_new, l_i = _softmax(s, j, m_i, l_i, N_KEEP, sm_scale_log2, crow, BN, PDT, o_layout, MASK, QK8)
    acc = acc * alpha[:, None]
    p16 = _p_operand(p, PDT, o_layout)
    mbarrier.wait(vready.index(slot), (it // STAGES) & 1)
    if not PFENCE:
        fence_async_shared()  # the rows were written by cp.async (generic proxy); wgmma reads through the async proxy
    pv_tok = warpgroup_mma(p16, v_smem.index(slot), acc, is_async=True)
    if NEXT:
        mbarrier.wait(kready.index(nslot), ((it + 1) // STAGES) & 1)
        if not PFENCE:
            fence_async_shared()
        s_tok = warpgroup_mma(q_smem, k_smem.index(nslot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[pv_tok])  # PV_j done (groups retire in order); S_{j+1} may still run
        mbarrier.arrive(vempty.index(slot), count=1)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(kempty.index(nslot), count=1)
    else:
        acc = warpgroup_mma_wait(0, deps=[pv_tok])
        mbarrier.arrive(vempty.index(slot), count=1)
    return s, m_new, l_i, acc


@gluon.jit
def _softmax(s, j, m_i, l_i, N_KEEP, sm_scale_log2, crow, BN: gl.constexpr, PDT: gl.constexpr,
             o_layout: gl.constexpr, MASK: gl.constexpr, QK8: gl.constexpr):
    """Block j's online-softmax step on S_j: (P_j, fp32, in S's layout; alpha_j in the O layout's rows, the new
    row max, the new row sum). ``_p_operand`` makes P_j PV's register A operand. QK8: S_j is the int32 dot of
    the codes and ``crow`` the row's factor (Q's row scale x K's head scale x sm_scale log2 e)."""
    if QK8:
        # t = 1.5 * 2^23 + qk exactly (|qk| <= 128 x 127^2 < 2^22): the int32 -> float conversion is one IADD,
        # and the offset folds into the exponent's FFMA: p = exp2(t c - (m + 1.5 * 2^23 c))
        t = (s + 0x4B400000).to(gl.float32, bitcast=True)
        if MASK:
            cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
            t = gl.where((cols < N_KEEP)[None, :], t, float("-inf"))
        m_new = gl.maximum(m_i, (gl.max(t, 1) - 12582912.0) * crow)
        p = gl.exp2(t * crow[:, None] - (m_new + 12582912.0 * crow)[:, None])
    else:
        if MASK:
            cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
            s = gl.where((cols < N_KEEP)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * sm_scale_log2)
        p = gl.exp2(s * sm_scale_log2 - m_new[:, None])  # the scale folded into the exponent: one FFMA per score
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), m_new, l_i


@gluon.jit
def _p_operand(p, PDT: gl.constexpr, o_layout: gl.constexpr):
    """P (fp32, S's layout) as the PV MMA's 16-bit register A operand (the same registers' elements: a cast)."""
    return gl.convert_layout(p.to(PDT), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


@gluon.jit
def _overlap_block(j, it, p16, m_i, l_i, acc, q_smem, k_smem, v_smem, kready, vready, kempty, vempty, N_KEEP,
                   sm_scale_log2, crow, zero_s, ring: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr,
                   PDT: gl.constexpr, MASK: gl.constexpr, PFENCE: gl.constexpr, QK8: gl.constexpr):
    """OVERLAP (FlashAttention-3's order in one warp group), block j >= 1 at ring position ``it``, with P_{j-1}
    given (16-bit, PV's register operand) and O rescaled to its max: S_j and PV_{j-1} issued together -> S_j
    retired (K_j freed) -> softmax(S_j) -> PV_{j-1} retired (V_{j-1} freed) -> O rescaled by alpha_j, P_j cast.
    Returns (P_j, m_i, l_i, acc).
    NOTE what ptxas makes of it (offline SASS, C = 128): the wait for PV_{j-1} lands after the row max, before the
    exponentials (P_j is loop-carried in the registers PV_{j-1} reads, and ptxas interleaves the casts with the
    exponentials), so PV_{j-1} overlaps S_j's MMA and the row max, not the exponentials. Casting P_{j-1} at the top
    instead (the softmax then touches only S's registers) moved the same wait to the same place and spilled 232
    bytes; a cast written before the wait serialises every wgmma (ptxas C7513)."""
    o_layout: gl.constexpr = acc.type.layout
    slot = ring * STAGES + it % STAGES
    pslot = ring * STAGES + (it + STAGES - 1) % STAGES
    mbarrier.wait(kready.index(slot), (it // STAGES) & 1)
    if not PFENCE:
        fence_async_shared()
    s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(vready.index(pslot), ((it - 1) // STAGES) & 1)
    if not PFENCE:
        fence_async_shared()
    pv_tok = warpgroup_mma(p16, v_smem.index(pslot), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=[s_tok])  # S_j done (groups retire in order); PV_{j-1} may still run
    mbarrier.arrive(kempty.index(slot), count=1)
    p, alpha, m_i, l_i = _softmax(s, j, m_i, l_i, N_KEEP, sm_scale_log2, crow, BN, PDT, o_layout, MASK, QK8)
    acc, p16 = warpgroup_mma_wait(0, deps=[pv_tok, p16])  # P_{j-1}'s registers are PV's operand until here
    mbarrier.arrive(vempty.index(pslot), count=1)
    return _p_operand(p, PDT, o_layout), m_i, l_i, acc * alpha[:, None]


@gluon.jit
def _consume_tile(Q, SIGMA, KS, RES, RSCALE, OUT, FLAG, q_smem, k_smem, v_smem, kready, vready, kempty, vempty,
                  H, S, N_KEEP, sm_scale_log2, gc, bh, it0, sqb, sqh, sqs, srb, srh, srs, sob, soh, sos,
                  half: gl.constexpr, C: gl.constexpr, GPC: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                  DV: gl.constexpr, STAGES: gl.constexpr, HAS_TAIL: gl.constexpr, HAS_RES: gl.constexpr,
                  HAS_FLAG: gl.constexpr, OFF64: gl.constexpr, PFENCE: gl.constexpr, OVERLAP: gl.constexpr,
                  QK8: gl.constexpr, HAS_RSCALE: gl.constexpr):
    """One consumer warp group on tile (gc, bh): 64 query rows (``half`` of a C = 128 group, or all of group
    2 gc + half at C = 64) through every key block of its ring (ring positions it0 ...), then the epilogue."""
    BM: gl.constexpr = 64
    NW: gl.constexpr = gl.num_warps()
    ring: gl.constexpr = half if GPC == 2 else 0
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BN, 32 if QK8 else 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, DV, 16])
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    PDT: gl.constexpr = Q.dtype.element_ty  # P's 16-bit type (QK8: Q arrives in 16 bits, quantised here)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    if GPC == 2:
        row0 = (gc * 2 + half) * C
    else:
        row0 = gc * C + half * BM

    # Q rows through sigma into shared memory (QK's A operand for the whole loop)
    rq = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, q_layout))
    sq = gl.load(SIGMA + bh.to(gl.int64) * S + rq, mask=rq < S, other=0)
    sq = sq.to(gl.int64) if OFF64 else sq.to(gl.int32)
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(Q + b * sqb + h * sqh + sq[:, None] * sqs + dq[None, :], mask=(rq < S)[:, None], other=0.0)
    if QK8:
        # Q's rows as INT8 codes, one scale a row: amax / 127, codes round-to-nearest-even (the magic-number add)
        qf = q.to(gl.float32)
        amax = gl.max(gl.abs(qf), 1)
        qsc = gl.where(amax > 0.0, amax / 127.0, 1.0)
        y = qf * (127.0 / gl.where(amax > 0.0, amax, 1.0))[:, None]
        q = ((y + 12582912.0) - 12582912.0).to(gl.int8)
        crow = gl.convert_layout(qsc * (gl.load(KS + bh) * sm_scale_log2), gl.SliceLayout(1, s_layout))
    else:
        crow = gl.full([BM], 1.0, gl.float32, gl.SliceLayout(1, s_layout))  # unused
    barrier()  # (a CTA with several tiles) every warp's last QK of the previous tile has retired
    q_smem.store(q)
    fence_async_shared()
    barrier()  # every warp's Q rows are in shared memory before the warp group's first MMA

    nb = gl.cdiv(N_KEEP, BN)
    zero_s = gl.zeros([BM, BN], gl.int32 if QK8 else gl.float32, s_layout)
    acc = gl.zeros([BM, DV], gl.float32, o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
    slot0 = ring * STAGES + it0 % STAGES
    mbarrier.wait(kready.index(slot0), (it0 // STAGES) & 1)
    if not PFENCE:
        fence_async_shared()
    s_tok = warpgroup_mma(q_smem, k_smem.index(slot0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(kempty.index(slot0), count=1)
    if OVERLAP:
        # block 0's softmax masked when there is a tail (exact on a full block too: every column < n_keep)
        p, alpha, m_i, l_i = _softmax(s, 0, m_i, l_i, N_KEEP, sm_scale_log2, crow, BN, PDT, o_layout, HAS_TAIL, QK8)
        p16 = _p_operand(p, PDT, o_layout)
        for j in range(1, nb - 1):
            p16, m_i, l_i, acc = _overlap_block(j, it0 + j, p16, m_i, l_i, acc, q_smem, k_smem, v_smem, kready,
                                                vready, kempty, vempty, N_KEEP, sm_scale_log2, crow, zero_s, ring,
                                                STAGES, BN, PDT, False, PFENCE, QK8)
        if nb > 1:
            p16, m_i, l_i, acc = _overlap_block(nb - 1, it0 + nb - 1, p16, m_i, l_i, acc, q_smem, k_smem, v_smem,
                                                kready, vready, kempty, vempty, N_KEEP, sm_scale_log2, crow, zero_s,
                                                ring, STAGES, BN, PDT, HAS_TAIL, PFENCE, QK8)
        lslot = ring * STAGES + (it0 + nb - 1) % STAGES
        mbarrier.wait(vready.index(lslot), ((it0 + nb - 1) // STAGES) & 1)
        if not PFENCE:
            fence_async_shared()
        pv_tok = warpgroup_mma(p16, v_smem.index(lslot), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[pv_tok])
        mbarrier.arrive(vempty.index(lslot), count=1)
    else:
        for j in range(0, nb - 1):
            s, m_i, l_i, acc = _consume_block(j, it0 + j, s, m_i, l_i, acc, q_smem, k_smem, v_smem, kready, vready,
                                              kempty, vempty, N_KEEP, sm_scale_log2, crow, zero_s, ring, STAGES, BN,
                                              PDT, False, True, PFENCE, QK8)
        s, m_i, l_i, acc = _consume_block(nb - 1, it0 + nb - 1, s, m_i, l_i, acc, q_smem, k_smem, v_smem, kready,
                                          vready, kempty, vempty, N_KEEP, sm_scale_log2, crow, zero_s, ring, STAGES, BN,
                                          PDT, HAS_TAIL, False, PFENCE, QK8)

    # epilogue: O = acc / l, + residual, flagged columns NaN, rows scattered to sigma
    ro = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    mrow = ro < S
    so = gl.load(SIGMA + bh.to(gl.int64) * S + ro, mask=mrow, other=0)
    so = so.to(gl.int64) if OFF64 else so.to(gl.int32)
    dv = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    if HAS_RES:
        r = gl.load(RES + b * srb + h * srh + so[:, None] * srs + dv[None, :], mask=mrow[:, None],
                    other=0.0).to(gl.float32)
        if HAS_RSCALE:  # 8-bit codes, one scale a token
            r = r * gl.load(RSCALE + bh.to(gl.int64) * S + so, mask=mrow, other=0.0)[:, None]
        o = o + r
    if HAS_FLAG:  # NaN/Inf in keys/values this group did not select (kernels/finite_flags.py)
        bad = gl.load(FLAG + bh.to(gl.int64) * DV + dv)
        o = gl.where(bad[None, :] != 0, float("nan"), o)
    gl.store(OUT + b * sob + h * soh + so[:, None] * sos + dv[None, :], o.to(OUT.dtype.element_ty),
             mask=mrow[:, None])


@gluon.jit
def _consumer(Q, SIGMA, KS, RES, RSCALE, OUT, FLAG, q_smem, k_smem, v_smem, kready, vready, kempty, vempty, H, S, N_KEEP,
              sm_scale_log2, n_gc, n_tiles, sqb, sqh, sqs, srb, srh, srs, sob, soh, sos,
              half: gl.constexpr, C: gl.constexpr, GPC: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
              DV: gl.constexpr, STAGES: gl.constexpr, HAS_TAIL: gl.constexpr, HAS_RES: gl.constexpr,
              HAS_FLAG: gl.constexpr, OFF64: gl.constexpr, PFENCE: gl.constexpr, OVERLAP: gl.constexpr,
              QK8: gl.constexpr, HAS_RSCALE: gl.constexpr):
    """One consumer warp group over the CTA's tiles (as ``_producer``)."""
    nb = gl.cdiv(N_KEEP, BN)
    it0 = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        _consume_tile(Q, SIGMA, KS, RES, RSCALE, OUT, FLAG, q_smem, k_smem, v_smem, kready, vready, kempty, vempty, H, S,
                      N_KEEP, sm_scale_log2, t % n_gc, t // n_gc, it0, sqb, sqh, sqs, srb, srh, srs, sob, soh, sos,
                      half, C, GPC, BN, D, DV, STAGES, HAS_TAIL, HAS_RES, HAS_FLAG, OFF64, PFENCE, OVERLAP, QK8,
                      HAS_RSCALE)
        it0 += nb


@gluon.jit
def _sparse_attn_sm90_kernel(Q, K, V, SIGMA, IDX, KS, RES, RSCALE, OUT, FLAG,
                             sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                             sib, sih, sig, sin, srb, srh, srs, sob, soh, sos,
                             H, S, G, N_KEEP, sm_scale_log2, n_gc, n_tiles,
                             C: gl.constexpr, GPC: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                             BN: gl.constexpr, STAGES: gl.constexpr, HAS_TAIL: gl.constexpr,
                             HAS_RES: gl.constexpr, HAS_FLAG: gl.constexpr, OFF64: gl.constexpr,
                             PFENCE: gl.constexpr, OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr, QK8: gl.constexpr, RUN: gl.constexpr,
                             HAS_RSCALE: gl.constexpr, num_warps: gl.constexpr):
    """Two consumer warp groups (the default partition and a worker) and a producer warp group; module doc."""
    dt: gl.constexpr = K.dtype.element_ty  # QK's operands (QK8: int8 codes)
    vt: gl.constexpr = V.dtype.element_ty
    NR: gl.constexpr = GPC  # rings: one per group of the CTA
    q_smem = gl.allocate_shared_memory(dt, [2, 64, D], gl.NVMMASharedLayout.get_default_for([64, D], dt))
    k_smem = gl.allocate_shared_memory(dt, [NR * STAGES, BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], dt))
    v_smem = gl.allocate_shared_memory(vt, [NR * STAGES, BN, DV], gl.NVMMASharedLayout.get_default_for([BN, DV], vt))
    kready = gl.allocate_shared_memory(gl.int64, [NR * STAGES, 1], mbarrier.MBarrierLayout())
    vready = gl.allocate_shared_memory(gl.int64, [NR * STAGES, 1], mbarrier.MBarrierLayout())
    kempty = gl.allocate_shared_memory(gl.int64, [NR * STAGES, 1], mbarrier.MBarrierLayout())
    vempty = gl.allocate_shared_memory(gl.int64, [NR * STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NR * STAGES):
        # every producer thread's noinc cp.async arrival, or (PFENCE) one arrival after the producer's fence
        mbarrier.init(kready.index(i), count=1 if PFENCE else 32 * 4)
        mbarrier.init(vready.index(i), count=1 if PFENCE else 32 * 4)
        mbarrier.init(kempty.index(i), count=2 // NR)  # C = 128: both consumers read the ring; C = 64: one
        mbarrier.init(vempty.index(i), count=2 // NR)
    # NOTE two barriers nothing waits on: the MMA-issue turns of the removed ping-pong variant
    # (docs/design/sparse-launch-config.md). Without their allocation and init ptxas schedules the default's key
    # loops differently (offline sm_90 SASS): kept until a GPU A/B shows that costs nothing.
    _turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(_turn.index(0), count=1)
    mbarrier.init(_turn.index(1), count=1)
    gl.warp_specialize([
        (_consumer, (Q, SIGMA, KS, RES, RSCALE, OUT, FLAG, q_smem.index(0), k_smem, v_smem, kready, vready, kempty, vempty, H, S,
                     N_KEEP, sm_scale_log2, n_gc, n_tiles, sqb, sqh, sqs, srb, srh, srs, sob, soh, sos, 0, C, GPC, BN,
                     D, DV, STAGES, HAS_TAIL, HAS_RES, HAS_FLAG, OFF64, PFENCE, OVERLAP, QK8, HAS_RSCALE)),
        (_consumer, (Q, SIGMA, KS, RES, RSCALE, OUT, FLAG, q_smem.index(1), k_smem, v_smem, kready, vready, kempty, vempty, H, S,
                     N_KEEP, sm_scale_log2, n_gc, n_tiles, sqb, sqh, sqs, srb, srh, srs, sob, soh, sos, 1, C, GPC, BN,
                     D, DV, STAGES, HAS_TAIL, HAS_RES, HAS_FLAG, OFF64, PFENCE, OVERLAP, QK8, HAS_RSCALE)),
        (_producer, (K, V, IDX, k_smem, v_smem, kready, vready, kempty, vempty, H, G, N_KEEP, n_gc, n_tiles, skb, skh,
                     sks, svb, svh, svs, sib, sih, sig, sin, GPC, BN, D, DV, STAGES, HAS_TAIL, OFF64, PFENCE,
                     RUN)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def needs_64bit_offsets(*extents: int) -> bool:
    """Whether an in-head element offset may pass 2^31 (the kernel's OFF64: 64-bit row offsets; int32 otherwise,
    which saves integer work per gathered row). A function so that the offline compile can force either path."""
    return max(extents) >= 2**31


def sparse_attention_sm90(q, k, v, sigma, idx, *, sm_scale, group_size, residual=None, out_dtype=None, flag=None,
                          launch: SparseAttnSm90Config = None, k_scale=None, run: int = 1, res_scale=None):
    """As ``sparse_attn.sparse_attention`` with ``qk_format="bf16"``: O[sigma[g*C+i]] = softmax over the keys
    idx[g] of group g @ V (+ residual; ``flag`` [B, H, Dv] int32: NaN in the flagged columns), [B, H, S, Dv] in
    ``out_dtype`` (default q.dtype), in the original query order. ``launch``: a ``SparseAttnSm90Config`` (None:
    ``configs.sparse_sm90_default(C)``). sm_90 only; C in {64, 128}, D and Dv in {64, 128}.
    8-bit QK: ``k`` int8 codes with one scale per head ``k_scale`` [B, H] fp32 (``quantize_k_int8_head``); q
    stays 16-bit and is quantised in the kernel (one scale per row, amax / 127). ``run``: idx holds run numbers of
    aligned runs of ``run`` keys; ``res_scale``: the per-token scale of a residual of 8-bit codes."""
    from vc_compile.kernels.configs import sparse_sm90_default
    from vc_compile.kernels.launch import FAST_LAUNCH, aligned
    B, H, S, D = q.shape
    Sk, DV = k.shape[2], v.shape[3]
    C = int(group_size)
    if C not in (64, 128):
        raise ValueError(f"sparse_attention_sm90: group_size must be 64 or 128, got {C}")
    launch = sparse_sm90_default(C) if launch is None else launch
    if not isinstance(launch, SparseAttnSm90Config):
        raise TypeError(f"launch must be a SparseAttnSm90Config, got {type(launch).__name__}")
    G = -(-S // C)
    for name, d in (("head dim", D), ("value head dim", DV)):
        if d not in (64, 128):
            raise ValueError(f"sparse_attention_sm90: {name} must be 64 or 128, got {d}")
    qk8 = k.dtype == torch.int8
    if q.dtype not in (torch.bfloat16, torch.float16) or (k.dtype != q.dtype and not qk8) or v.dtype != q.dtype:
        raise ValueError(f"sparse_attention_sm90: q, k, v must share one 16-bit dtype (k may be int8 codes with "
                         f"k_scale), got {q.dtype}, {k.dtype}, {v.dtype}")
    if qk8 != (k_scale is not None):
        raise ValueError("sparse_attention_sm90: k_scale goes with int8 k codes (quantize_k_int8_head) and only "
                         f"with them; got k {k.dtype}, k_scale {'None' if k_scale is None else 'given'}")
    if qk8:
        if tuple(k_scale.shape) != (B, H) or k_scale.dtype != torch.float32:
            raise ValueError(f"sparse_attention_sm90: k_scale must be fp32 [B, H] = {(B, H)}, got "
                             f"{k_scale.dtype} {tuple(k_scale.shape)}")
        k_scale = k_scale.contiguous()
    q, k, v, sigma, idx = gather_operands("sparse_attention_sm90", q, k, v, sigma, idx, G, run)
    launch.check_fits(C, D, DV, q.element_size())
    n_keep = idx.shape[3] * run
    out = torch.empty(B, H, S, DV, device=q.device, dtype=out_dtype or q.dtype)
    has_res = residual is not None
    res, rscale = epilogue_operands("sparse_attention_sm90", residual, flag, out, (B, H, S, DV), res_scale)
    BN = launch.block_n
    GPC = 2 if C == 64 else 1
    off64 = needs_64bit_offsets(S * max(q.stride(2), out.stride(2), res.stride(2)), Sk * max(k.stride(2), v.stride(2)))
    n_gc = triton.cdiv(G, GPC)  # CTA tiles per head
    n_tiles = n_gc * B * H
    grid = n_tiles
    tensors = (q, k, v, sigma, idx, k_scale if qk8 else out, res, rscale, out,
               flag.contiguous() if flag is not None else out)
    ints = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            idx.stride(0), idx.stride(1), idx.stride(2), idx.stride(3),
            res.stride(0), res.stride(1), res.stride(2), out.stride(0), out.stride(1), out.stride(2),
            H, S, G, n_keep)
    # the launch's key (kernels/launch.py): every integer argument, the tensors' dtypes and alignment, the
    # constexprs (from the launch and the shapes)
    key = (ints, n_gc, n_tiles, tuple(t.dtype for t in tensors), aligned(*tensors), launch, C, D, DV, has_res,
           flag is not None, off64, run, res_scale is not None)
    FAST_LAUNCH(
        _sparse_attn_sm90_kernel, (grid,), key, *tensors, *ints, float(sm_scale) * LOG2E, n_gc, n_tiles,
        C=C, GPC=GPC, D=D, DV=DV, BN=BN, STAGES=launch.stages, HAS_TAIL=n_keep % BN != 0, HAS_RES=has_res,
        HAS_FLAG=flag is not None, OFF64=off64, PFENCE=launch.producer_fence, OVERLAP=launch.overlap,
        CONSUMER_REGS=launch.consumer_regs, PRODUCER_REGS=launch.producer_regs, QK8=qk8, RUN=run,
        HAS_RSCALE=res_scale is not None, num_warps=4,
        maxnreg=WS_MAXNREG)
    return out


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
