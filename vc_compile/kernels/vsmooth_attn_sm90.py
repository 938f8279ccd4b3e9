"""8-bit V-Smooth attention for sm_90 in Gluon: the same contract as ``vsmooth_attn.py`` (reference:
``vc_compile/reference/vsmooth_attn.py``), with the MMAs overlapped with the softmax. This module is the kernel's
entry points and launch (``vsmooth_attention_sm90(qk, vq, launch=VSmoothSm90Config)``); the softmax and the
conversions around it are ``vsmooth_attn_sm90_softmax.py`` (its notation), the pipeline (the K / V ring, the two
step orders, the loop over key blocks) ``vsmooth_attn_sm90_steps.py``.

Why a second kernel: in plain Triton every ``tl.dot`` of the key loop is waited for right after it is
issued (SASS: ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each QK and PV group), so a CTA runs QK MMA ->
softmax -> PV MMA strictly in series and only the two CTAs of an SM overlap each other. Gluon exposes
``warpgroup_mma(..., is_async=True)`` and ``warpgroup_mma_wait(num_outstanding)``, so this kernel keeps
the tensor cores busy during the softmax (FA3's intra-warpgroup pipelining), shared-memory P~:

    iteration j:  issue S_j = Q K_j^T        (async)
                  issue PV_{j-1} = P~_{j-1} V_{j-1}   (async, fresh accumulator: two-level accumulation)
                  wait until 1 group is outstanding    -> S_j is ready, PV_{j-1} still runs
                  softmax of S_j -> P~_j, alpha_j, r_j (while PV_{j-1} runs)
                  wait for PV_{j-1}; acc = acc * alpha_{j-1} + PV_{j-1} + r_{j-1} mu'_{j-1}
                  refill the freed K and V stages (TMA)

Launch configuration (``configs.VSmoothSm90Config``; the measured defaults per head dim and length there):
* ``p_operand="registers"``: P~ stays in registers as the PV MMA's A operand (no shared-memory round trip, no
  barrier before PV): the keys of each 128-block are relabelled so that the QK accumulator's registers already
  are the A operand's (``p_operand``), V^T's key columns are stored in the same order (``key_order_sm90``), and
  both MMAs are issued after the softmax. On the exp2 path P~ is packed by ``e4m3x4`` (ptxas's fused
  F2FP.MERGE_C packing gave wrong / NaN rows with the mean term on).
* ``rowsum="mma"`` / ``mean="tf32_window"`` ("MS", register P~ only): the row sum and the V-Smooth mean term
  leave the ALUs for the tensor cores (``row_sum_mma``, ``MeanWindow.flush``; docs/design/sm90-vsmooth-structure.md).
* ``pv_window`` (MS, warp-specialised): PV summed by the FP8 MMA in its own accumulator over G blocks (rescaled
  by alpha before each MMA) and folded into fp32 once per window (``steps.window_step``): the fold of every block
  gone at the two-level accumulation's error (docs/design/pv-window.md).
* ``warp_specialize``: two consumer warp groups and a producer warp (below).
* ``byte_mask`` (register P~, ExpCast): the code's clamp at 0 is done on the packed bytes
  (``softmax.codes_masked``) in every program whose scales keep all codes >= -2^22 (``steps.bytemask_ok``,
  checked once per program); the others run the same loop with the FMNMX clamp. Same bits either way.

acc         the PV accumulator in units of v_scale; O = acc * v_scale / l_i (``pv_window`` > 1: acc holds the folded
            windows, the MMA's own accumulator the current one).
m_i, l_i    running row max / row sum (of the decoded P~, summed in fp16; MS: exact, by an MMA, l_i a [BM, 8]
            tile whose columns all hold the sum).

Parallelisation: grid ``(ceil(S / BM), B * H)``; one program = BM query rows of one (b, h), num_warps / 4
warp groups splitting the rows (16 rows per warp); K / V stream through a STAGES-deep TMA ring with one
mbarrier per stage and tensor. Warp-specialised: grid ``(ceil(S / 2 BM), B * H)``, two consumer warp groups of
BM rows and a producer warp that runs the TMA ring (ready / empty mbarriers), one CTA per SM. sm_90 only
(wgmma, TMA); no interpreter path: CPU tests compile it for sm_90 offline, GPU tests compare it with the
reference and with ``vsmooth_attn.py``.
"""
import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from vc_compile.kernels.compat import assembled, tma_load
from vc_compile.kernels.configs import POperand, VSmoothSm90Config
from vc_compile.kernels.vsmooth_attn_sm90_softmax import key_order_sm90
from vc_compile.kernels.vsmooth_attn_sm90_steps import Head, KVRing, MeanWindow, attend_rows

__all__ = ["key_order_sm90", "vsmooth_attention_sm90"]


@gluon.jit
def _ones_operand(BN: gl.constexpr):
    """MS: shared memory for the B operand [8, BN] fp8 of the row-sum MMA (filled by ``MeanWindow.fill_ones``)."""
    return gl.allocate_shared_memory(gl.float8e4nv, [8, BN],
                                     gl.NVMMASharedLayout.get_default_for([8, BN], gl.float8e4nv))


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
                              PREG: gl.constexpr, MS: gl.constexpr, BYTEMASK: gl.constexpr,
                              num_warps: gl.constexpr):
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
    # the program refills its own ring (WS = 0): kbar / vbar stand in for the producer's empty barriers
    ring = KVRing(desc_k, desc_v, desc_m, k_smem, v_smem, m_smem, kbar, vbar, kbar, vbar, BN, STAGES, 0)
    attend_rows(desc_q, q_smem, p_smem, qbar, ring, MeanWindow(desc_g, ones_smem, mg_smem, mgbar), QS, KS, VS, OUT,
                LSE, S, Sk, nb, gl.program_id(0) * BM, BM, D, BKS, BV, EXPCAST, MEAN, HAS_TAIL, RETURN_LSE, PREG, MS,
                BYTEMASK)
    mbarrier.invalidate(qbar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kbar.index(i))
        mbarrier.invalidate(vbar.index(i))


@gluon.jit
def _ws_producer(ring: KVRing, Sk, nb, D: gl.constexpr, BV: gl.constexpr, MEAN: gl.constexpr):
    """The producer warp: K_j, then V_j (and mu'_j, when MEAN), into the STAGES ring once both consumers freed
    the stage."""
    STAGES: gl.constexpr = ring.STAGES
    bh = gl.program_id(1)
    head = Head(bh * Sk, bh * D, bh * gl.cdiv(Sk, BV))
    for j in range(nb):
        slot = j % STAGES
        ph = ((j // STAGES) & 1) ^ 1  # a fresh barrier counts as phase 1 complete: the first round passes
        mbarrier.wait(ring.kempty.index(slot), ph)
        mbarrier.expect(ring.kbar.index(slot), ring.desc_k.block_type.nbytes)
        tma_load(ring.desc_k, [head.kv_row + j * ring.BN, 0], ring.kbar.index(slot),
                                        ring.k_smem.index(slot))
        mbarrier.wait(ring.vempty.index(slot), ph)
        ring.load_v(head, slot, j, True, MEAN)


@gluon.jit
def _vsmooth_attn_sm90_ws_kernel(desc_q, desc_k, desc_v, desc_m, desc_g, QS, KS, VS, OUT, LSE, S, Sk, nb,
                                 BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, BKS: gl.constexpr,
                                 BV: gl.constexpr, STAGES: gl.constexpr, EXPCAST: gl.constexpr,
                                 MEAN: gl.constexpr, HAS_TAIL: gl.constexpr, RETURN_LSE: gl.constexpr,
                                 MS: gl.constexpr, BYTEMASK: gl.constexpr, PVW: gl.constexpr,
                                 num_warps: gl.constexpr):
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
    # NOTE two barriers nothing waits on: the MMA-issue turns of the deleted ping-pong variant (docs/design/
    # sm90-mma-order.md). Without their allocation and init ptxas allocates the key loop's registers differently
    # (same instructions, other order): kept until a GPU A/B shows that costs nothing (the SASS stays as measured).
    _turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ones0 = _ones_operand(BN)  # MS: a row-sum operand and mu' group buffers per consumer
    ones1 = _ones_operand(BN)
    mg0, mgbar0 = _mean_group_buffers(desc_g, D, MS)
    mg1, mgbar1 = _mean_group_buffers(desc_g, D, MS)
    for i in gl.static_range(2):
        mbarrier.init(qbar.index(i), count=1)
        mbarrier.init(_turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kbar.index(i), count=1)
        mbarrier.init(vbar.index(i), count=1)
        mbarrier.init(kempty.index(i), count=2)  # both consumers
        mbarrier.init(vempty.index(i), count=2)
    start = gl.program_id(0) * (2 * BM)
    ring = KVRing(desc_k, desc_v, desc_m, k_smem, v_smem, m_smem, kbar, vbar, kempty, vempty, BN, STAGES, 1)
    win0 = MeanWindow(desc_g, ones0, mg0, mgbar0)
    win1 = MeanWindow(desc_g, ones1, mg1, mgbar1)
    # the q_smem pair stands in for the P~ buffer (register P~ reads none)
    gl.warp_specialize([
        (attend_rows, (desc_q, q_smem.index(0), q_smem, qbar.index(0), ring, win0, QS, KS, VS, OUT, LSE, S, Sk, nb,
                       start, BM, D, BKS, BV, EXPCAST, MEAN, HAS_TAIL, RETURN_LSE, 1, MS, BYTEMASK, PVW)),
        (attend_rows, (desc_q, q_smem.index(1), q_smem, qbar.index(1), ring, win1, QS, KS, VS, OUT, LSE, S, Sk, nb,
                       start + BM, BM, D, BKS, BV, EXPCAST, MEAN, HAS_TAIL, RETURN_LSE, 1, MS, BYTEMASK,
                       PVW)),
        (_ws_producer, (ring, Sk, nb, D, BV, MEAN and not MS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# register split of a warp-specialised CTA (12 warps: 3 warp groups of 128 threads): producer 24 + consumer
# 240 (worker) + consumer 240 (the default partition, what is left of 168 x 3) = 504 <= 65536 / 128
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
WS_MAXNREG = 168


_PLACEHOLDER = {}


def _placeholder(device, D: int):
    """An fp32 [1, D] tensor for a descriptor the kernel never reads, made once per device (no allocation or
    fill launch per call)."""
    key = (str(device), D)
    if key not in _PLACEHOLDER:
        import torch
        _PLACEHOLDER[key] = torch.zeros(8, D, device=device)
    return _PLACEHOLDER[key]


@functools.lru_cache(maxsize=64)
def _smem_layout_t(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _smem_layout(block, dtype):
    """The TMA tiles' shared-memory layout. NOTE memoised: ``get_default_for`` is slow and runs 5 times per launch;
    docs/design/host-overhead.md."""
    return _smem_layout_t(tuple(block), dtype)


def vsmooth_attention_sm90(qk, vq, *, expcast: bool = False, out_dtype=None, return_lse: bool = False,
                           launch: VSmoothSm90Config):
    """As ``vsmooth_attn.vsmooth_attention`` (INT8 QK only): O [B, H, S, D] (and the base-2 LSE), with the launch
    configuration ``launch``."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from vc_compile.formats import BLOCK_K, BLOCK_V, natural_layout, to_sm90_layout
    from vc_compile.kernels.launch import FAST_LAUNCH, aligned, tma_descriptor
    from vc_compile.kernels.vsmooth_attn import check_inputs

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
    mean = 0 if vq.zero_mean else 1
    # register P~ reads V^T in the "sm90" key order with mu' and its tf32 groups, which the sm_90 preprocessing
    # writes directly; a VQuant in the other layout is converted here (eager: one more pass over V)
    vq = to_sm90_layout(vq) if preg else natural_layout(vq)
    q8, k8, v8t = q8.contiguous(), k8.contiguous(), vq.v8t.contiguous()
    S_pad = v8t.shape[-1]
    lay = _smem_layout

    def desc(t, block, dtype):
        return tma_descriptor(TensorDescriptor, t, block, lay(block, dtype))
    desc_q = desc(q8.view(B * H * S, D), [BM, D], gl.int8)
    desc_k = desc(k8.view(B * H * Sk, D), [BN, D], gl.int8)
    desc_v = desc(v8t.view(B * H * D, S_pad), [D, BN], gl.float8e4nv)
    out = torch.empty(B, H, S, D, device=q8.device, dtype=out_dtype)
    lse = torch.empty(B, H, S, device=q8.device, dtype=torch.float32) if return_lse else out
    nb = -(-Sk // BN)
    # mu' = mu / v_scale (the mean in units of v_scale), [B, H, nb, D] fp32, instead of a [D] reciprocal held in
    # 32 registers per thread through the key loop
    if mean and preg:
        mu_prime, mu_groups = vq.mu_prime, vq.mu_groups
    elif mean and vq.mu_prime is not None:  # written by the preprocessing (``preprocess(mu_prime=True)``)
        mu_prime = vq.mu_prime
    elif mean:
        mu_prime = (vq.v_mean / vq.v_scale.unsqueeze(2)).contiguous().view(-1, D)
    if not mean:  # never read (MEAN = 0); any fp32 [rows, D] tensor makes a valid descriptor
        mu_prime = _placeholder(q8.device, D)
    desc_m = desc(mu_prime, [1, D], gl.float32)
    if not (ms and mean):  # never read; a valid [rows, 8] fp32 descriptor
        mu_groups = _placeholder(q8.device, D).view(-1, 8)
    desc_g = desc(mu_groups, [D, 8], gl.float32)
    args = (desc_q, desc_k, desc_v, desc_m, desc_g, q_scale.contiguous(), k_scale.contiguous(),
            vq.v_scale.contiguous(), out, lse, S, Sk, nb)
    consts = dict(BM=BM, BN=BN, D=D, BKS=BLOCK_K, BV=BLOCK_V, STAGES=stages, EXPCAST=3 if expcast else 0,
                  MEAN=mean, HAS_TAIL=Sk % BN != 0, RETURN_LSE=bool(return_lse), MS=int(ms),
                  BYTEMASK=int(launch.byte_mask and preg))
    if ws:
        # the window only on smoothed V (block means removed): without them the FP8 MMA's running sum of V's mean
        # outgrows each block's share and the error doubles at G = 8 (docs/design/pv-window.md)
        consts.update(PVW=launch.pv_window if mean else 1)
    # the launch's key (kernels/launch.py): the descriptors' block shapes and layouts follow from the shapes, the
    # dtypes and the launch; the scale tensors may come from a caller (their alignment is specialised on)
    guard = bool(consts["BYTEMASK"]) and BYTEMASK_GUARD.enabled
    if guard and BYTEMASK_GUARD.spilled.get(_guard_key(consts)):
        consts["BYTEMASK"] = 0  # this Triton spills the byte-mask clamp: the FMNMX clamp, the same bits
    key = (B, H, S, Sk, D, S_pad, out_dtype, launch, tuple(sorted(consts.items())),
           aligned(args[5], args[6], args[7], lse))
    if ws:
        kernel = FAST_LAUNCH(_vsmooth_attn_sm90_ws_kernel, (-(-S // (2 * BM)), B * H), key, *args, **consts,
                             num_warps=4, maxnreg=WS_MAXNREG)
    else:
        kernel = FAST_LAUNCH(_vsmooth_attn_sm90_kernel, (-(-S // BM), B * H), key, *args, **consts, PREG=int(preg),
                             num_warps=nw)
    if guard and consts["BYTEMASK"]:
        BYTEMASK_GUARD.check(_guard_key(consts), kernel)
    return (out, lse) if return_lse else out


def _guard_key(consts: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in consts.items() if k != "BYTEMASK"))


class BytemaskGuard:
    """The byte-mask clamp where the compiler keeps it in registers, the FMNMX clamp where it does not.

    The two clamps give the same bits; the byte mask saves instructions in the key loop when its packing stays in
    registers. Some Triton releases spill it (the measurement: docs/design/toolchain.md), so the first build of
    each configuration is read once it is loaded (``CompiledKernel.n_spills``, known on a GPU only): above
    ``limit`` bytes, later launches of that configuration use the FMNMX clamp. Decided per process from the
    compiled kernel, not from a version number; ``report()`` says where it happened."""

    def __init__(self, limit: int = 64):
        self.enabled = True
        self.limit = limit
        self.spilled: dict = {}  # constexprs but BYTEMASK -> bool
        self.swapped: list = []  # (constexprs, spill bytes) where the FMNMX clamp took over

    def check(self, gkey: tuple, kernel) -> None:
        if gkey in self.spilled:
            return
        words = getattr(kernel, "n_spills", None)  # Triton's loader: local memory in 4-byte words
        if not isinstance(words, int):
            return  # not loaded (an offline build): nothing to read
        spilled = 4 * words > self.limit
        self.spilled[gkey] = spilled
        if spilled:
            self.swapped.append((gkey, 4 * words))

    def summary(self):
        """A line for ``report()``, or None."""
        if not self.swapped:
            return None
        worst = max(b for _, b in self.swapped)
        return (f"ExpCast's byte-mask clamp spilled up to {worst} bytes on this Triton in {len(self.swapped)} "
                "configuration(s): the FMNMX clamp runs there (same output)")

    def clear(self) -> None:
        self.spilled.clear()
        self.swapped.clear()


BYTEMASK_GUARD = BytemaskGuard()


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
