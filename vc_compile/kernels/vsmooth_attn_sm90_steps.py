"""The Gluon sm_90 V-Smooth kernel's pipeline (``vsmooth_attn_sm90.py`` is the kernel): the K / V stage ring,
one key block per step in the two step orders, and the loop over a program's key blocks (``attend_rows``).

State is grouped: ``KVRing`` (the K / V / mu' stages: shared memory, barriers, TMA descriptors; who refills
them), ``Head`` (where the program's head starts in the flattened tensors), ``MeanWindow`` (MS: the row-sum
operand and the double-buffered mu' group tiles) and the softmax's ``Tile`` (``vsmooth_attn_sm90_softmax``).
The loop-carried values (acc, l_i, m_i, the next S or alpha / r, the window Rb, the next K scales) stay plain.

Step orders:
* shared-memory P~ (``pipelined_step``): S_j and PV_{j-1} on the tensor cores while the softmax of S_j runs;
  P~_j goes through a shared-memory double buffer.
* register P~ (``register_step``): softmax(S_j) -> PV_j (P~ straight from the softmax's registers) and S_{j+1}
  issued together -> PV_j retired (S_{j+1} still running) -> fold -> S_{j+1} retired. Every MMA is retired within
  its step (one in flight across the loop's back edge makes ptxas serialise them all). MS: the row sum is a third
  MMA beside PV_j and the mean term waits in R_w for 8 blocks, added by tf32 MMAs (``MeanWindow.flush``).
* register P~ with PV windows (``window_step``, ``pv_window`` = G > 1): as the register order, but PV_j goes into
  the MMA's accumulator of the current window (rescaled by alpha before the MMA) and is folded into fp32 once
  per G blocks, not per block.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from vc_compile.kernels.compat import barrier, tma_load
from vc_compile.kernels.vsmooth_attn_sm90_softmax import (Tile, fold_pv, k_scales, mean_slot, row_sum_mma,
                                                            rs_layout, softmax_block)

# NOTE ``from __future__ import annotations`` must not be used here: the aggregates check their fields' types.


@aggregate
class Head:
    """Where head ``program_id(1)`` starts: its K rows, its V^T rows and its mu' rows in the flat tensors."""
    kv_row: gl.tensor
    vt_row: gl.tensor
    m_row: gl.tensor

    @gluon.constexpr_function
    def __init__(self, kv_row, vt_row, m_row):
        self.kv_row = kv_row
        self.vt_row = vt_row
        self.m_row = m_row


@aggregate
class KVRing:
    """The STAGES-deep ring of K [BN, D], V^T [D, BN] and mu' [1, D] stages, one mbarrier per stage and tensor
    (``kbar`` / ``vbar``: the TMA landed). WS = 0: the program refills a stage itself once it is read; WS = 1: a
    producer warp does, and the consumers free stages through ``kempty`` / ``vempty``."""
    desc_k: tma.tensor_descriptor
    desc_v: tma.tensor_descriptor
    desc_m: tma.tensor_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    m_smem: gl.shared_memory_descriptor
    kbar: gl.shared_memory_descriptor
    vbar: gl.shared_memory_descriptor
    kempty: gl.shared_memory_descriptor
    vempty: gl.shared_memory_descriptor
    BN: gl.constexpr
    STAGES: gl.constexpr
    WS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, desc_k, desc_v, desc_m, k_smem, v_smem, m_smem, kbar, vbar, kempty, vempty, BN, STAGES, WS):
        self.desc_k = desc_k
        self.desc_v = desc_v
        self.desc_m = desc_m
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.m_smem = m_smem
        self.kbar = kbar
        self.vbar = vbar
        self.kempty = kempty
        self.vempty = vempty
        self.BN = gl.constexpr(BN)
        self.STAGES = gl.constexpr(STAGES)
        self.WS = gl.constexpr(WS)

    @gluon.jit
    def load_k(self, head: Head, slot, blk, pred):
        """TMA of K block ``blk`` into stage ``slot``."""
        mbarrier.expect(self.kbar.index(slot), self.desc_k.block_type.nbytes, pred=pred)
        tma_load(self.desc_k, [head.kv_row + blk * self.BN, 0], self.kbar.index(slot),
                                        self.k_smem.index(slot), pred=pred)

    @gluon.jit
    def load_v(self, head: Head, slot, blk, pred, MEAN: gl.constexpr):
        """TMA of V^T block ``blk`` (and its mean row mu', when MEAN) into stage ``slot``."""
        if MEAN:
            mbarrier.expect(self.vbar.index(slot), self.desc_v.block_type.nbytes + self.desc_m.block_type.nbytes,
                            pred=pred)
            tma_load(self.desc_m, [head.m_row + blk, 0], self.vbar.index(slot),
                                            self.m_smem.index(slot), pred=pred)
        else:
            mbarrier.expect(self.vbar.index(slot), self.desc_v.block_type.nbytes, pred=pred)
        tma_load(self.desc_v, [head.vt_row, blk * self.BN], self.vbar.index(slot),
                                        self.v_smem.index(slot), pred=pred)

    @gluon.jit
    def load_mu(self, vslot, o_layout: gl.constexpr, MEAN: gl.constexpr):
        """The mu' row [1, D] of V stage ``vslot`` (MEAN), else a placeholder."""
        if MEAN:
            return self.m_smem.index(vslot).load(o_layout)
        else:
            return 0.0

    @gluon.jit
    def release_k(self, head: Head, j, nb, slot):
        """K stage ``slot`` (block j) is no longer read: WS = 0 refills it with block j + STAGES itself, WS = 1
        frees it to the producer warp."""
        if self.WS == 0:
            nk = j + self.STAGES
            self.load_k(head, slot, nk, nk < nb)
        else:
            mbarrier.arrive(self.kempty.index(slot), count=1)

    @gluon.jit
    def release_v(self, head: Head, j, nb, slot, MEAN: gl.constexpr):
        """V stage ``slot`` (block j: PV_j retired, mu'_j read) is free: WS = 0 refills it (the compiler puts a
        barrier before, for mu'), WS = 1 frees it to the producer warp once every warp of this group has read
        mu'_j."""
        if self.WS == 0:
            nv = j + self.STAGES
            self.load_v(head, slot, nv, nv < nb, MEAN)
        elif MEAN:  # mu'_j was read from the stage by every warp: all reads done before the producer refills it
            fence_async_shared()
            barrier()
            mbarrier.arrive(self.vempty.index(slot), count=1)
        else:
            # only the PV MMA read the stage, and its wait has returned: nothing of this warp group still reads
            # it. NOTE no fence here: its MEMBAR.ALL.CTA waited every step for the in-flight global loads (the
            # next block's K scales, issued a step ahead to stay off the softmax's path)
            mbarrier.arrive(self.vempty.index(slot), count=1)


@aggregate
class MeanWindow:
    """MS: the [8, BN] fp8 ones of the row-sum MMA and two buffers of mu' group tiles (hi, lo: [2, D, 8] fp32
    each, one window of 8 key blocks) with their barriers; ``desc_g`` reads the tiles ``_mean_groups`` built."""
    desc_g: tma.tensor_descriptor
    ones_smem: gl.shared_memory_descriptor
    mg_smem: gl.shared_memory_descriptor
    mgbar: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, desc_g, ones_smem, mg_smem, mgbar):
        self.desc_g = desc_g
        self.ones_smem = ones_smem
        self.mg_smem = mg_smem
        self.mgbar = mgbar

    @gluon.jit
    def fill_ones(self):
        """All ones into this warp group's row-sum operand, visible to its MMAs (every warp's part written).
        The bytes are written as 0x38 (E4M3 1.0): a converted constant ``gl.full(1.0).to(gl.float8e4nv)`` read back
        wrong by the MMA on sm_90 (row sums off by 0.5-100x; the same tile loaded from memory was exact)."""
        fill: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
        self.ones_smem.store(gl.full(self.ones_smem.shape, 0x38, gl.uint8, fill).to(gl.float8e4nv, bitcast=True))
        fence_async_shared()
        barrier()

    @gluon.jit
    def load_group(self, g_row, w, ng, D: gl.constexpr):
        """TMA of window w's mu' group tile (hi, lo: [2, D, 8] fp32) into buffer w % 2 (when w < ng)."""
        buf = w % 2
        pred = w < ng
        mbarrier.expect(self.mgbar.index(buf), 2 * self.desc_g.block_type.nbytes, pred=pred)
        for h in gl.static_range(2):
            tma_load(self.desc_g, [(g_row + w * 2 + h) * D, 0], self.mgbar.index(buf),
                                            self.mg_smem.index(2 * buf + h), pred=pred)

    @gluon.jit
    def flushed(self, acc, Rb, w, o_layout: gl.constexpr):
        """``flush`` and its wait: acc + R_w mu'_w, back in the MMA layout ``o_layout``."""
        return gl.convert_layout(warpgroup_mma_wait(0, deps=[self.flush(acc, Rb, w, o_layout)]), o_layout)

    @gluon.jit
    def flush(self, acc, Rb, w, o_layout: gl.constexpr):
        """acc += R_w mu'_w for window w (8 key blocks) as tf32 MMAs, async: R [BM, 8] the blocks' row sums at the
        current max (``mean_slot``), mu'_w [8, D] their mean rows (buffer w % 2, K-major: [D, 8], hi and lo tf32
        parts). Three MMAs, R_hi mu_hi + R_lo mu_hi + R_hi mu_lo, keep ~2^-20 relative (one tf32 MMA alone
        truncates both to 11 bits)."""
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
        mbarrier.wait(self.mgbar.index(buf), (w // 2) & 1)
        mhi = self.mg_smem.index(2 * buf).permute((1, 0))
        acc = gl.convert_layout(acc, t_layout)  # the same registers: the MMA takes its K step from the layout
        acc = warpgroup_mma(hi, mhi, acc, is_async=True)
        acc = warpgroup_mma(lo, mhi, acc, is_async=True)
        return warpgroup_mma(hi, self.mg_smem.index(2 * buf + 1).permute((1, 0)), acc, is_async=True)


@gluon.jit
def pipelined_step(j, nb, Sk, acc, l_i, m_i, alpha, r, ks0, ks1, q_smem, p_smem, zero_s, zero_o, tile: Tile,
                   ring: KVRing, head: Head, MEAN: gl.constexpr, MASK: gl.constexpr):
    """Shared-memory P~, key block j: S_j (async) and PV_{j-1} (async) on the tensor cores while the softmax of
    S_j runs; returns (acc, l_i, m_i, alpha_j, r_j, block j+1's K scales)."""
    STAGES: gl.constexpr = ring.STAGES
    o_layout: gl.constexpr = tile.o_layout
    ks_slot = j % STAGES
    mbarrier.wait(ring.kbar.index(ks_slot), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, ring.k_smem.index(ks_slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    vslot = (j - 1) % STAGES
    mbarrier.wait(ring.vbar.index(vslot), ((j - 1) // STAGES) & 1)
    pv_tok = warpgroup_mma(p_smem.index((j - 1) % 2), ring.v_smem.index(vslot).permute((1, 0)), zero_o,
                           use_acc=False, is_async=True)
    s_i = warpgroup_mma_wait(1, deps=[s_tok])  # S_j ready; PV_{j-1} still in flight
    # block j+1's K scales, a step ahead: loaded here they would stall the softmax (global-load latency)
    ks0n, ks1n = k_scales(tile, j + 1, Sk)
    p8n, alpha_n, r_n, m_i = softmax_block(tile, s_i, j, Sk, m_i, ks0, ks1, MASK, False)
    p_smem.index(j % 2).store(p8n)  # read by PV_j in the next step (PV_{j-2}, its last reader, is done)
    fence_async_shared()
    nk = j + STAGES  # K stage ks_slot is free (S_j done): refill it
    ring.load_k(head, ks_slot, nk, nk < nb)
    # the softmax results go through the wait so that the compiler cannot sink the softmax below it
    # (it did: the whole softmax ran after the PV wait, serialising the step again)
    pv, alpha_n, r_n, m_i = warpgroup_mma_wait(0, deps=[pv_tok, alpha_n, r_n, m_i])
    barrier()  # every warp's rows of P~_j are in shared memory before PV_j is issued
    acc = fold_pv(acc, alpha, r, pv, ring.load_mu(vslot, o_layout, MEAN), o_layout, MEAN)
    nv = j - 1 + STAGES  # V stage vslot is free (PV_{j-1} done): refill it
    ring.load_v(head, vslot, nv, nv < nb, MEAN)
    l_i = l_i * alpha_n + r_n
    return acc, l_i, m_i, alpha_n, r_n, ks0n, ks1n


@gluon.jit
def finish_step(j, acc, Rb, rs, alpha, s_tok, s_i, win: MeanWindow, g_row, ng, o_layout: gl.constexpr,
                MEAN: gl.constexpr, NEXT: gl.constexpr):
    """The end of a register-P~ MS step: r_j into the mean window Rb, R_w mu'_w added by tf32 MMAs after every 8th
    block (behind S_{j+1}) and after the last, and S_{j+1} (``s_tok``, NEXT) retired. Returns (acc, Rb, S_{j+1} or
    ``s_i``)."""
    if MEAN:
        Rb = mean_slot(Rb, rs, alpha, j % 8)
        if NEXT:
            if j % 8 == 7:  # the window's last block: R_w mu'_w on the tensor cores, behind S_{j+1}
                acc = win.flush(acc, Rb, j // 8, o_layout)
                s_n, acc = warpgroup_mma_wait(0, deps=[s_tok, acc])
                acc = gl.convert_layout(acc, o_layout)
                Rb = gl.zeros([acc.shape[0], 8], gl.float32, rs_layout(o_layout))
                win.load_group(g_row, j // 8 + 2, ng, acc.shape[1])  # its buffer is free
            else:
                s_n = warpgroup_mma_wait(0, deps=[s_tok])
        else:  # the last block: whatever the window holds
            acc = win.flushed(acc, Rb, j // 8, o_layout)
            s_n = s_i
    elif NEXT:
        s_n = warpgroup_mma_wait(0, deps=[s_tok])
    else:
        s_n = s_i
    return acc, Rb, s_n


@gluon.jit
def register_step(j, nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile: Tile, ring: KVRing,
                  head: Head, win: MeanWindow, g_row, ng, MEAN: gl.constexpr, MS: gl.constexpr, MASK: gl.constexpr,
                  NEXT: gl.constexpr):
    """Register P~, key block j (module doc): enters with S_j computed (``s_i``), returns (acc, l_i, m_i,
    S_{j+1} (NEXT) or ``s_i``, the window Rb, block j+1's K scales). MS = 1: l_i is [BM, 8] (every column the
    running sum) and the mean term waits in Rb, flushed with the last S wait of every 8th step."""
    STAGES: gl.constexpr = ring.STAGES
    o_layout: gl.constexpr = tile.o_layout
    slot = j % STAGES
    nslot = (j + 1) % STAGES
    MU: gl.constexpr = MEAN and not MS  # mu'_j rows staged with V and added per step
    p8, alpha, r, m_i = softmax_block(tile, s_i, j, Sk, m_i, ks0, ks1, MASK, True, not MS)
    ring.release_k(head, j, nb, slot)  # S_j retired last step
    # block j+1's K scales: in flight during the MMAs
    ks0n, ks1n = k_scales(tile, j + 1, Sk)
    mbarrier.wait(ring.vbar.index(slot), (j // STAGES) & 1)
    if NEXT:
        mbarrier.wait(ring.kbar.index(nslot), ((j + 1) // STAGES) & 1)
    pv_tok = warpgroup_mma(p8, ring.v_smem.index(slot).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    if MS:
        rs_tok = row_sum_mma(p8, win.ones_smem, o_layout)
    if NEXT:
        s_tok = warpgroup_mma(q_smem, ring.k_smem.index(nslot).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
    if not MS:
        l_i = l_i * alpha + r
    if MS:
        pv, rs = warpgroup_mma_wait(1 if NEXT else 0, deps=[pv_tok, rs_tok])  # S_{j+1} may still run
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, rs_layout(o_layout)))[:, None] + rs
    else:
        pv = warpgroup_mma_wait(1 if NEXT else 0, deps=[pv_tok])  # PV_j done (groups retire in order)
    mu = ring.load_mu(slot, o_layout, MU)
    acc = fold_pv(acc, alpha, r, pv, mu, o_layout, MU)
    ring.release_v(head, j, nb, slot, MU)
    if MS:
        acc, Rb, s_n = finish_step(j, acc, Rb, rs, alpha, s_tok if NEXT else s_i, s_i, win, g_row, ng, o_layout,
                                   MEAN, NEXT)
    elif NEXT:
        s_n = warpgroup_mma_wait(0, deps=[s_tok])
    else:
        s_n = s_i
    return acc, l_i, m_i, s_n, Rb, ks0n, ks1n


@gluon.jit
def register_loop(nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile: Tile, ring: KVRing,
                  head: Head, win: MeanWindow, g_row, ng, MEAN: gl.constexpr, MS: gl.constexpr,
                  HAS_TAIL: gl.constexpr):
    """Register P~: every key block of the program's rows, S_0 given (``s_i``); returns (acc, l_i, m_i, Rb)."""
    for j in range(0, nb - 1):
        acc, l_i, m_i, s_i, Rb, ks0, ks1 = register_step(
            j, nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile, ring, head, win, g_row,
            ng, MEAN, MS, False, True)
    acc, l_i, m_i, s_i, Rb, ks0, ks1 = register_step(  # the last block: masked when it holds the key tail
        nb - 1, nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile, ring, head, win, g_row,
        ng, MEAN, MS, HAS_TAIL, False)
    return acc, l_i, m_i, Rb


@gluon.jit
def window_step(j, nb, Sk, acc, accm, ap, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, tile: Tile, ring: KVRing,
                head: Head, win: MeanWindow, g_row, ng, MEAN: gl.constexpr, MASK: gl.constexpr, NEXT: gl.constexpr,
                G: gl.constexpr):
    """Register P~, MS, PV accumulated in the MMA's accumulator ``accm`` over windows of G key blocks (rescaled by
    alpha before each block's MMA; fresh at each window's first block) and promoted into the fp32 ``acc`` at each
    window's end: acc = acc * ap + accm, ap the product of the window's alphas. The FP8 MMA keeps ~13 mantissa
    bits of its running sum: on smoothed V (block means removed, the residual changes sign within a block) the
    error does not move up to G = 8, on unsmoothed V it doubles, so the host runs G = 1 there. G divides 8: the
    mean term's flush follows a promotion. Returns (acc, accm, ap, l_i, m_i, S_{j+1} or ``s_i``, Rb, block j+1's
    K scales)."""
    STAGES: gl.constexpr = ring.STAGES
    o_layout: gl.constexpr = tile.o_layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    slot = j % STAGES
    nslot = (j + 1) % STAGES
    p8, alpha, r, m_i = softmax_block(tile, s_i, j, Sk, m_i, ks0, ks1, MASK, True, False)
    ring.release_k(head, j, nb, slot)  # S_j retired last step
    ks0n, ks1n = k_scales(tile, j + 1, Sk)
    mbarrier.wait(ring.vbar.index(slot), (j // STAGES) & 1)
    if NEXT:
        mbarrier.wait(ring.kbar.index(nslot), ((j + 1) // STAGES) & 1)
    accm = accm * gl.convert_layout(alpha, row_o)[:, None]
    ap = ap * alpha
    pv_tok = warpgroup_mma(p8, ring.v_smem.index(slot).permute((1, 0)), accm, use_acc=j % G != 0, is_async=True)
    rs_tok = row_sum_mma(p8, win.ones_smem, o_layout)
    if NEXT:
        s_tok = warpgroup_mma(q_smem, ring.k_smem.index(nslot).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
    accm, rs = warpgroup_mma_wait(1 if NEXT else 0, deps=[pv_tok, rs_tok])  # S_{j+1} may still run
    accm = gl.convert_layout(accm, o_layout)
    l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, rs_layout(o_layout)))[:, None] + rs
    if NEXT:
        if j % G == G - 1:  # the window's end: promote into fp32
            acc = acc * gl.convert_layout(ap, row_o)[:, None] + accm
            ap = gl.full(ap.shape, 1.0, gl.float32, ap.type.layout)
    else:
        acc = acc * gl.convert_layout(ap, row_o)[:, None] + accm
    ring.release_v(head, j, nb, slot, False)
    # (G divides 8: at a mean window's last block acc was just promoted, at the max m_j)
    acc, Rb, s_n = finish_step(j, acc, Rb, rs, alpha, s_tok if NEXT else s_i, s_i, win, g_row, ng, o_layout, MEAN,
                               NEXT)
    return acc, accm, ap, l_i, m_i, s_n, Rb, ks0n, ks1n


@gluon.jit
def window_loop(nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile: Tile, ring: KVRing,
                head: Head, win: MeanWindow, g_row, ng, MEAN: gl.constexpr, HAS_TAIL: gl.constexpr, G: gl.constexpr):
    """``window_step`` over every key block, S_0 given; returns (acc, l_i, m_i, Rb)."""
    accm = zero_o
    ap = gl.full([acc.shape[0]], 1.0, gl.float32, gl.SliceLayout(1, tile.s_layout))
    for j in range(0, nb - 1):
        acc, accm, ap, l_i, m_i, s_i, Rb, ks0, ks1 = window_step(
            j, nb, Sk, acc, accm, ap, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, tile, ring, head, win, g_row, ng,
            MEAN, False, True, G)
    acc, accm, ap, l_i, m_i, s_i, Rb, ks0, ks1 = window_step(
        nb - 1, nb, Sk, acc, accm, ap, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, tile, ring, head, win, g_row, ng,
        MEAN, HAS_TAIL, False, G)
    return acc, l_i, m_i, Rb


@gluon.jit
def key_loop(nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile: Tile, ring: KVRing, head: Head,
             win: MeanWindow, g_row, ng, MEAN: gl.constexpr, MS: gl.constexpr, HAS_TAIL: gl.constexpr,
             PVW: gl.constexpr):
    """Register P~: every key block, with PV windows of PVW blocks (``window_loop``, MS only) or a fold per block
    (``register_loop``); returns (acc, l_i, m_i, Rb)."""
    if PVW > 1:
        gl.static_assert(MS == 1, "PV windows are built on the MS structure")
        acc, l_i, m_i, Rb = window_loop(nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile, ring,
                                        head, win, g_row, ng, MEAN, HAS_TAIL, PVW)
    else:
        acc, l_i, m_i, Rb = register_loop(nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile,
                                          ring, head, win, g_row, ng, MEAN, MS, HAS_TAIL)
    return acc, l_i, m_i, Rb


@gluon.jit
def bytemask_ok(qs, KS_bh, nks):
    """Whether ExpCast's byte-mask clamp (``softmax.codes_masked``) is exact for these rows (``qs``, 0 on padding
    rows) against all nks K scales of the head: every code >= -2^22, i.e. 8 ks qs <= 1 (|qk_max - qk| <=
    2 * 127^2 * D <= 4.13e6 at D <= 128). Once per program: ~nks loads; NaN / Inf scales answer False."""
    L: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    mk = gl.max(gl.load(KS_bh + gl.arange(0, 1024, layout=L), mask=gl.arange(0, 1024, layout=L) < nks, other=0.0),
                0)
    for c in range(1024, nks, 1024):
        offs = c + gl.arange(0, 1024, layout=L)
        mk = gl.maximum(mk, gl.max(gl.load(KS_bh + offs, mask=offs < nks, other=0.0), 0))
    return 8.0 * gl.max(qs, 0) * mk <= 1.0


@gluon.jit
def attend_rows(desc_q, q_smem, p_smem, qbar, ring: KVRing, win: MeanWindow, QS, KS, VS, OUT, LSE, S, Sk, nb,
                start_m, BM: gl.constexpr, D: gl.constexpr, BKS: gl.constexpr, BV: gl.constexpr,
                EXPCAST: gl.constexpr, MEAN: gl.constexpr, HAS_TAIL: gl.constexpr, RETURN_LSE: gl.constexpr,
                PREG: gl.constexpr, MS: gl.constexpr, BYTEMASK: gl.constexpr = 0, PVW: gl.constexpr = 1):
    """BM query rows from ``start_m`` of head ``program_id(1)`` through all key blocks; O (and the LSE) stored.
    ring.WS = 0: the warps also load K / V; ring.WS = 1 (PREG only): a producer warp does and this is one of two
    consumer warp groups. MS = 1 (PREG only): row sums and the mean term on the tensor cores (``register_step``),
    ``win`` this group's mu' group buffers."""
    WS: gl.constexpr = ring.WS
    BN: gl.constexpr = ring.BN
    STAGES: gl.constexpr = ring.STAGES
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
    head = Head(bh * Sk, bh * D, bh * gl.cdiv(Sk, BV))
    ng = gl.cdiv(nb, 8)  # MS: mu' groups (windows of 8 key blocks)
    g_row = bh * ng * 2

    mbarrier.expect(qbar, desc_q.block_type.nbytes)
    tma_load(desc_q, [bh * S + start_m, 0], qbar, q_smem)
    if WS == 0:
        for i in gl.static_range(STAGES):
            ring.load_k(head, i, i, i < nb)
            ring.load_v(head, i, i, i < nb, MEAN and not MS)
    if MS:
        win.fill_ones()
        if MEAN:
            for w in gl.static_range(2):
                win.load_group(g_row, w, ng, D)

    rows = start_m + gl.arange(0, BM, layout=row_s)
    qs = gl.load(QS + bh.to(gl.int64) * S + rows, mask=rows < S, other=1.0)
    dcol = gl.arange(0, D, layout=col_o)
    tile = Tile(qs, KS + bh * gl.cdiv(Sk, BKS), s_layout, o_layout, BN, BKS, EXPCAST)
    zero_s = gl.zeros([BM, BN], gl.int32, s_layout)
    zero_o = gl.zeros([BM, D], gl.float32, o_layout)

    mbarrier.wait(qbar, 0)
    mbarrier.wait(ring.kbar.index(0), 0)
    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    ks0 = gl.load(tile.KS_bh)  # block 0's (it always has keys)
    ks1 = gl.load(tile.KS_bh + 1, mask=BKS < Sk, other=0.0)
    acc = zero_o
    n_full = Sk // BN
    if PREG:
        s_tok = warpgroup_mma(q_smem, ring.k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_i = warpgroup_mma_wait(0, deps=[s_tok])
        # alpha = 0 at block 0 (m_i = -inf): acc, l_i (and MS's window Rb) start at 0
        Rb = gl.zeros([BM, 8], gl.float32, rs_layout(o_layout))
        if MS:
            l_i = Rb
        else:
            l_i = gl.zeros([BM], gl.float32, row_s)
        if EXPCAST and BYTEMASK:
            # the byte-mask clamp where every code of the tile is >= -2^22, else the FMNMX clamp (one loop each)
            tile_b = Tile(qs, KS + bh * gl.cdiv(Sk, BKS), s_layout, o_layout, BN, BKS, EXPCAST, 1)
            if bytemask_ok(gl.where(rows < S, qs, 0.0), tile.KS_bh, gl.cdiv(Sk, BKS)):
                acc, l_i, m_i, Rb = key_loop(nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile_b,
                                             ring, head, win, g_row, ng, MEAN, MS, HAS_TAIL, PVW)
            else:
                acc, l_i, m_i, Rb = key_loop(nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile,
                                             ring, head, win, g_row, ng, MEAN, MS, HAS_TAIL, PVW)
        else:
            acc, l_i, m_i, Rb = key_loop(nb, Sk, acc, l_i, m_i, s_i, Rb, ks0, ks1, q_smem, zero_s, zero_o, tile,
                                         ring, head, win, g_row, ng, MEAN, MS, HAS_TAIL, PVW)
        if MS:  # every column holds the row sum
            l_i = gl.convert_layout(gl.max(l_i, 1), row_s)
    else:
        # block 0: S_0 and its softmax (nothing to overlap with yet); masked when it may hold the key tail
        s_tok = warpgroup_mma(q_smem, ring.k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_i = warpgroup_mma_wait(0, deps=[s_tok])
        p8, alpha, r, m_i = softmax_block(tile, s_i, 0, Sk, m_i, ks0, ks1, HAS_TAIL, False)
        ks0, ks1 = k_scales(tile, 1, Sk)  # block 1's, for the first loop step
        l_i = r
        p_smem.index(0).store(p8)
        fence_async_shared()
        barrier()
        ring.load_k(head, 0, STAGES, STAGES < nb)
        for j in range(1, n_full):
            acc, l_i, m_i, alpha, r, ks0, ks1 = pipelined_step(
                j, nb, Sk, acc, l_i, m_i, alpha, r, ks0, ks1, q_smem, p_smem, zero_s, zero_o, tile, ring, head,
                MEAN, False)
        if HAS_TAIL:
            if n_full > 0:
                acc, l_i, m_i, alpha, r, ks0, ks1 = pipelined_step(
                    n_full, nb, Sk, acc, l_i, m_i, alpha, r, ks0, ks1, q_smem, p_smem, zero_s, zero_o, tile, ring,
                    head, MEAN, True)

        # the last block's PV
        vslot = (nb - 1) % STAGES
        mbarrier.wait(ring.vbar.index(vslot), ((nb - 1) // STAGES) & 1)
        pv_tok = warpgroup_mma(p_smem.index((nb - 1) % 2), ring.v_smem.index(vslot).permute((1, 0)), zero_o,
                               use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(0, deps=[pv_tok])
        acc = fold_pv(acc, alpha, r, pv, ring.load_mu(vslot, o_layout, MEAN), o_layout, MEAN)

    l_i = gl.where(qs < float("inf"), l_i, float("nan"))  # undefined logits (NaN/Inf in q or K): NaN row
    vs = gl.load(VS + bh * D + dcol)
    o = acc * (vs[None, :] / gl.convert_layout(l_i, row_o)[:, None])
    rows_o = start_m + gl.arange(0, BM, layout=row_o)
    gl.store(OUT + (bh.to(gl.int64) * S + rows_o[:, None]) * D + dcol[None, :],
             o.to(OUT.dtype.element_ty), mask=(rows_o < S)[:, None])
    if RETURN_LSE:
        gl.store(LSE + bh.to(gl.int64) * S + rows, m_i + gl.log2(l_i) - 8.0, mask=rows < S)
