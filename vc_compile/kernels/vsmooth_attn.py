"""8-bit attention with V-Smooth mean compensation and optional ExpCast-FP8 (docs/methods.md, V-Smooth step 4 and ExpCast-FP8).

Contract: ``vc_compile/reference/vsmooth_attn.py`` (inputs from ``preprocess``'s QKQuant / VQuant).

Notation
--------
BM, BN      query rows per program, keys per inner step (BN = 128 = BLOCK_V: one V mean per step, two
            64-token K scales).
q8, k8      int8 (or E4M3) codes [B, H, S, D]; qs = [BM] q_scale of the program's query rows (one per
            token, ``sm_scale * log2 e`` folded in), ks = k_scale per key (one per 64 keys).
s~          = (q8 . k8) ks, the K-scaled scores of one [BM, BN] tile: ONE scale multiply per element (the
            scalar-per-column K scale, as before per-token Q scales). The base-2 logit is s = qs_i s~;
            qs_i is applied per ROW, never per element on its own: the row max is max_j s~ * qs_i
            (qs_i >= 0), and qs_i joins the FMA that already forms the exp2 argument / the ExpCast code
            (``fma(s~, qs_i, m_i - 8)`` instead of ``s - (m_i - 8)``; ``fma(s~, 8 qs_i, ...)`` instead of
            ``fma(s, 8, ...)``). Cost per score unchanged; the per-block ``ks * qs`` [BN] multiply is gone.
            Exception: the masked key-tail block (one per program) applies qs_i explicitly before the
            -inf mask (qs = 0, i.e. scale=0, would make 0 * -inf).
m_i         running row max of s (online softmax). P~ = fp8(256 * 2^(s - m_i)) (exp2 + cast), or the
            ExpCast E4M3 byte c = clamp(rne(8 (s - m_i) + 119.65), 0, 120): ``fma(s, 8, 119.65 - 8 m_i)``
            plus the 2^23 magic add rounds to the integer code (the fraction 0.65 must be added before the
            magic: a float cannot hold 2^23 + 119.65), one max clamps at 0, and the byte is the low byte
            of the fp32 bits, reinterpreted as float8e4nv (no cvt). (A one-FMA variant with an integer row
            offset was 5-7% less accurate on peaked rows: docs/design/expcast-one-ffma.md.)
r_ij        row sum of the decoded P~ over key block j (what the PV MMA multiplied).
acc         the PV accumulator in units of v_scale: per block (two-level: a fresh MMA accumulator,
            then acc = acc * alpha + P~ R8_j + r_ij (mu_j / v_scale)); O = acc * v_scale / l.
lse         optional base-2 LSE of the *smoothed* logits: m'_i + log2 l_i - 8 (as the reference).
non-finite  (reference/preprocess.py) preprocessing marks a query row whose logits are undefined (a
            NaN/Inf in q row i, or any NaN/Inf in K of the head) with qs_i = NaN, a non-finite V channel
            with v_scale NaN. The epilogue sets l_i = NaN where qs_i is not finite (one select per row):
            the row is NaN whatever the inner loop did with it (ExpCast's max clamp and GPU fmax drop NaN);
            v_scale NaN makes column d NaN through the epilogue multiply (as SDPA: column d).

INT8 QK: the int32 scores (|qk| <= 127^2 * 128 < 2^22) are turned into floats without the
quarter-rate I2F: bits(qk + 0x4B400000) is the float 1.5 * 2^23 + qk, and s = fma(t, ks, -1.5 * 2^23 ks)
(error < 1 unit of qk * ks, far below the INT8 rounding of q and k).

Grid
----
``(ceil(S / BM), B * H)``: program_id(0) = query tile runs fastest, so the tiles of one head run
together and its K/V (2 * S * D bytes) stays in L2. Each program loads its Q tile once (TMA), loops over
the full key blocks (TMA loads of K [BN, D] and of V^T [D, BN], pipelined by ``num_stages``), then one
masked block for the key tail (padded keys get s = -inf, so P~ = 0). Q rows past S read the next head's
rows (finite) and are never stored.

Switches (constexpr; one kernel): QK_FP8 (E4M3 QK instead of INT8), EXPCAST (exp2 + cast, or the ExpCast
code), MEAN (0 for a ``zero_mean`` VQuant: no mean term, the "naive 8-bit" kernel; else ``MeanTerm.code``),
ROWSUM (``RowSum.code``: how r_ij is formed, decoding P~ on the ALUs or ``P~ @ ones[BN, 16]`` on the tensor
cores), RETURN_LSE, INTERPRET (fp32 -> e4m3 rounding done in software: the Triton 3.6 interpreter's cast
mis-rounds).

Launch configuration: a ``configs.VSmoothTritonConfig`` (``launch=``; the measured defaults and the
tuner's candidates are in ``configs.py``, the choice per launch in ``dispatch.py``). docs/autotune.md.

Cost: 4 B H S Sk D FLOPs (half INT8, half FP8 MMA); bytes ~ B H (S D (1 + out bytes) + n_q_tiles Sk 2D)
with K/V re-read per query tile mostly from L2.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vc_compile.formats import BLOCK_K, BLOCK_V, QKQuant, VQuant, natural_layout
from vc_compile.kernels.compat import assembled
from vc_compile.kernels.configs import RowSum, VSmoothTritonConfig, vsmooth_head_dim_error
from vc_compile.kernels.interpret import interpreting, loop_bound
from vc_compile.kernels.soft_round import round_bf16, round_e4m3


@triton.jit
def _attn_step(acc, l_i, m_i, q, qs, desc_k, desc_v, KS, VM, ivs, ones, kv_row, vt_row, start_n, Sk,
               BN: tl.constexpr, D: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
               MASK: tl.constexpr, QK_FP8: tl.constexpr, EXPCAST: tl.constexpr,
               MEAN: tl.constexpr, ROWSUM: tl.constexpr, INTERPRET: tl.constexpr):
    offs_n = start_n + tl.arange(0, BN)
    k = desc_k.load([kv_row + start_n, 0])
    if MASK:
        ks = tl.load(KS + offs_n // BKS, mask=offs_n < Sk, other=0.0)
    else:
        ks = tl.load(KS + offs_n // BKS)
    if QK_FP8:
        s = tl.dot(q, k.T) * ks[None, :]
    else:
        t = (tl.dot(q, k.T, out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)
        s = t * ks[None, :] + (ks * -12582912.0)[None, :]  # one FFMA (enable_fp_fusion)
    # s is s~ (K-scaled); qr [BM] is the row scale still to apply (qs, or 1 once applied)
    if MASK:  # key tail, one block per program: scale the rows before the -inf mask (0 * -inf = NaN)
        s = tl.where((offs_n < Sk)[None, :], s * qs[:, None], float("-inf"))
        qr = tl.full(qs.shape, 1.0, tl.float32)
    else:
        qr = qs
    rmax = tl.max(s, 1) * qr
    if EXPCAST:
        # the reference's rounding: c = rne(8 (s - m) + 119.65), the row max maps to code 120 exactly
        m_new = tl.maximum(m_i, rmax)
        alpha = tl.math.exp2(m_i - m_new)
        x = s * (8.0 * qr)[:, None] + (119.65 - 8.0 * m_new)[:, None]
        x = tl.maximum(x + 8388608.0, 8388608.0)
        p8 = x.to(tl.int32, bitcast=True).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        m_new = tl.maximum(m_i, rmax)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * qr[:, None] - (m_new - 8.0)[:, None])  # one FFMA, as s - m was one FADD
        if INTERPRET:
            p = round_e4m3(p)
        p8 = p.to(tl.float8e4nv)
    if ROWSUM == 1:  # RowSum.MMA: on the tensor cores, P~ @ ones[BN, 16] (ones loaded once, before the loop)
        r = tl.max(tl.dot(p8, ones), 1)
    elif ROWSUM == 2:  # RowSum.FP16: decoded to fp16 (exact), summed in fp16 (2^-11 relative), then fp32
        r = tl.sum(p8.to(tl.float16), 1).to(tl.float32)
    else:  # RowSum.FP32: decoded to fp32 (exact), summed in fp32
        r = tl.sum(p8.to(tl.float32), 1)
    l_i = l_i * alpha + r
    v = desc_v.load([vt_row, start_n])  # [D, BN] K-major
    pv = tl.dot(p8, v.T)  # fresh accumulator: the FP8 MMA's own accumulation stays within one block
    if MEAN == 2:
        # r_ij mu'_j on the tensor cores, in the same fresh accumulator: [r_hi r_hi r_lo 0..] (bf16,
        # [BM, 16]) @ [mu_hi; mu_lo; mu_hi; 0..] (bf16, [16, D]) = r mu' to ~2^-16 (fp32 accumulate)
        c16 = tl.arange(0, 16)
        r_hi = r.to(tl.bfloat16).to(tl.float32)
        a_mu = tl.where(c16[None, :] == 2, (r - r_hi)[:, None], tl.where(c16[None, :] < 2, r_hi[:, None],
                                                                         0.0))
        b_mu = tl.load(VM + ((start_n // BV) * 3 + c16[:, None]) * D + tl.arange(0, D)[None, :],
                       mask=c16[:, None] < 3, other=0.0)
        if INTERPRET:  # NOTE the 3.6 interpreter's tl.dot mis-multiplies bf16
            pv = tl.dot(a_mu.to(tl.bfloat16).to(tl.float32), b_mu.to(tl.float32), pv)
        else:
            pv = tl.dot(a_mu.to(tl.bfloat16), b_mu, pv)
    acc = acc * alpha[:, None] + pv
    if MEAN == 1:
        mu = tl.load(VM + (start_n // BV) * D + tl.arange(0, D)) * ivs
        acc += r[:, None] * mu[None, :]
    return acc, l_i, m_new


@triton.jit
def _vsmooth_attn_kernel(desc_q, desc_k, desc_v, QS, KS, VM, VS, ONES, OUT, LSE,
                         S, Sk, n_full, N_FULL_C: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                         BKS: tl.constexpr, BV: tl.constexpr, HAS_TAIL: tl.constexpr,
                         QK_FP8: tl.constexpr, EXPCAST: tl.constexpr, MEAN: tl.constexpr,
                         ROWSUM: tl.constexpr, RETURN_LSE: tl.constexpr,
                         INTERPRET: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    start_m = pid_m * BM
    q = desc_q.load([bh * S + start_m, 0])
    rows = start_m + tl.arange(0, BM)
    rmask = rows < S
    qs = tl.load(QS + bh.to(tl.int64) * S + rows, mask=rmask, other=1.0)  # [BM] per-token Q scales
    d = tl.arange(0, D)
    vs = tl.load(VS + bh * D + d)
    ivs = 1.0 / vs
    KS_bh = KS + bh * tl.cdiv(Sk, BKS)
    VM_bh = VM + bh.to(tl.int64) * tl.cdiv(Sk, BV) * (3 if MEAN == 2 else 1) * D
    kv_row = bh * Sk
    vt_row = bh * D
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if ROWSUM == 1:
        o16 = tl.arange(0, 16)
        ones = tl.load(ONES + tl.arange(0, BN)[:, None] * 16 + o16[None, :])  # [BN, 16] e4m3 ones
    else:
        ones = 0
    for j in tl.range(0, N_FULL_C if N_FULL_C >= 0 else n_full):
        acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, qs, desc_k, desc_v, KS_bh, VM_bh, ivs, ones,
                                   kv_row, vt_row, j * BN, Sk, BN, D, BKS, BV, False, QK_FP8, EXPCAST,
                                   MEAN, ROWSUM, INTERPRET)
    if HAS_TAIL:
        acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, qs, desc_k, desc_v, KS_bh, VM_bh, ivs, ones,
                                   kv_row, vt_row, n_full * BN, Sk, BN, D, BKS, BV, True, QK_FP8,
                                   EXPCAST, MEAN, ROWSUM, INTERPRET)
    l_i = tl.where(qs < float("inf"), l_i, float("nan"))  # undefined logits (NaN/Inf in q or K): NaN row
    o = acc * (vs[None, :] / l_i[:, None])
    if INTERPRET:
        if OUT.dtype.element_ty == tl.bfloat16:
            o = round_bf16(o)
    tl.store(OUT + (bh.to(tl.int64) * S + rows[:, None]) * D + d[None, :],
             o.to(OUT.dtype.element_ty), mask=rmask[:, None])
    if RETURN_LSE:
        tl.store(LSE + bh.to(tl.int64) * S + rows, m_i + tl.math.log2(l_i) - 8.0, mask=rmask)


_ONES: Dict[Tuple[int, str], torch.Tensor] = {}


def _ones(BN: int, device) -> torch.Tensor:
    key = (BN, str(device))
    if key not in _ONES:
        _ONES[key] = torch.ones(BN, 16, device=device).to(torch.float8_e4m3fn)
    return _ONES[key]


def check_inputs(qk: QKQuant, vq: VQuant) -> None:
    """The contract of ``qk`` / ``vq`` that both V-Smooth kernels rely on (ValueError naming what is wrong)."""
    B, H, S, D = qk.q8.shape
    err = vsmooth_head_dim_error(D)
    if err:
        raise ValueError(err)
    if vq.S != qk.k8.shape[2] or vq.v8t.shape[2] != D:
        raise ValueError("VQuant does not match the keys (S or head dim)")
    if qk.q8.dtype not in (torch.int8, torch.float8_e4m3fn) or qk.k8.dtype != qk.q8.dtype:
        raise ValueError(f"q8/k8 must both be int8 or float8_e4m3fn, got {qk.q8.dtype}, {qk.k8.dtype}")
    if qk.q_scale.shape != (B, H, S):
        raise ValueError(f"q_scale must be per query token [B, H, S] = {[B, H, S]}, got "
                         f"{list(qk.q_scale.shape)}")


def vsmooth_attention(qk: QKQuant, vq: VQuant, *, expcast: bool = False, out_dtype=torch.bfloat16,
                      return_lse: bool = False, launch: VSmoothTritonConfig):
    """8-bit attention: O [B, H, S, D] in ``out_dtype`` (and the base-2 LSE of the smoothed logits,
    [B, H, S] fp32, when ``return_lse``), with the launch configuration ``launch``."""
    if not isinstance(launch, VSmoothTritonConfig):
        raise TypeError(f"launch must be a VSmoothTritonConfig, got {type(launch).__name__}")
    check_inputs(qk, vq)
    vq = natural_layout(vq)  # (a "sm90" VQuant is made for the Gluon kernel; converted, not misread)
    q8, q_scale, k8, k_scale = qk.q8, qk.q_scale, qk.k8, qk.k_scale
    B, H, S, D = q8.shape
    Sk = k8.shape[2]
    qk_fp8 = q8.dtype == torch.float8_e4m3fn
    BM, BN, nw, ns = launch.block_m, launch.block_n, launch.num_warps, launch.num_stages
    rowsum = launch.rowsum.code
    q8 = q8.contiguous()
    k8 = k8.contiguous()
    v8t = vq.v8t.contiguous()
    S_pad = v8t.shape[-1]
    desc_q = TensorDescriptor.from_tensor(q8.view(B * H * S, D), [BM, D])
    desc_k = TensorDescriptor.from_tensor(k8.view(B * H * Sk, D), [BN, D])
    desc_v = TensorDescriptor.from_tensor(v8t.view(B * H * D, S_pad), [D, BN])
    out = torch.empty(B, H, S, D, device=q8.device, dtype=out_dtype)
    lse = torch.empty(B, H, S, device=q8.device, dtype=torch.float32) if return_lse else out
    mean = 0 if vq.zero_mean else launch.mean.code
    if mean == 2:  # [B, H, nb, 3, D] bf16: mu' = mu / v_scale split as (hi, lo, hi)
        mu = vq.v_mean / vq.v_scale.unsqueeze(2)
        hi = mu.to(torch.bfloat16)
        v_mean = torch.stack([hi, (mu - hi.float()).to(torch.bfloat16), hi], dim=3)
    else:
        v_mean = vq.v_mean.contiguous()
    n_full = Sk // BN
    _vsmooth_attn_kernel[(triton.cdiv(S, BM), B * H)](
        desc_q, desc_k, desc_v, q_scale.contiguous(), k_scale.contiguous(), v_mean,
        vq.v_scale.contiguous(), _ones(BN, q8.device) if rowsum == RowSum.MMA.code else out, out, lse, S, Sk,
        n_full, loop_bound(n_full),
        BM=BM, BN=BN, D=D, BKS=BLOCK_K, BV=BLOCK_V, HAS_TAIL=Sk % BN != 0,
        QK_FP8=qk_fp8, EXPCAST=2 if expcast else 0, MEAN=mean, ROWSUM=rowsum,
        RETURN_LSE=bool(return_lse), INTERPRET=interpreting(),
        num_warps=nw, num_stages=ns)
    return (out, lse) if return_lse else out


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
