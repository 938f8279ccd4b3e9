"""MC-Sparse exact token selection at anchor steps (docs/methods.md, MC-Sparse step 2): pass 1 (dense + LSE), pass 2
(group key mass), top-K.

Contract: ``vc_compile/reference/select.py`` (mass, ``n_keep``) and ``reference/dense.py`` (LSE convention).

Notation
--------
q, k        [B, H, S, D], [B, H, Sk, D]; bf16 / fp16 (fp32 is accepted: IEEE fp32 dots).
C           group size; G = ceil(S / C); group g = queries sigma[g*C : (g+1)*C] (last one partial).
sigma       [B, H, S] int64 query order (PDDP).
lse2        [B, H, S] fp32 base-2 LSE of the true logits s = (q . k) * sm_scale * log2(e)
            (``dense_with_lse`` gives it; add the K-smoothing correction when pass 1 ran on smoothed K).
mass        [B, H, G, Sk] fp32, ``mass[g, j] = sum_{i in g} 2^(s_ij - lse2_i)``: exact probabilities summed
            over the group's rows; never an S x S matrix.
keep        n_keep keys per group (``formats.n_keep``); idx [B, H, G, keep] int32 ascending.

Grid (group_key_mass)
---------------------
``(G, B*H)``, group fastest (head-major: a head's K stays in L2). Each program gathers its C query rows
and their lse2 through sigma once, then loops over all Sk keys in BLOCK_N tiles: s = q k^T (fp32
accumulate), p = exp2(s - lse2) (padded rows: lse2 = +inf -> p = 0), sums over the C rows ->
BLOCK_N masses, stored (keys are the MMA's M side: s^T = k q^T, so the group sum is a cheap row
reduction). Cost per head: 2 * S * Sk * D FLOPs (half a dense attention, no PV) + S * Sk
exp2; it writes G * Sk * 4 bytes (16 MB per head at S = Sk = 32760, C = 64), which is why the caller
(``methods/mcsparse.select``) passes heads in chunks. Top-K (``torch_ops.select_topk``) is torch on
every device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vc_compile.formats import LOG2E
from vc_compile.kernels.compat import assembled
from .configs import pow2_head_dim_error
from .interpret import dot_upcast, loop_bound


@triton.jit
def _group_mass_kernel(Q, K, SIGMA, LSE, MASS, sqb, sqh, sqs, skb, skh, sks,
                       H, S, Sk, qk_scale,
                       C: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SK_I: tl.constexpr,
                       UPCAST: tl.constexpr, IEEE: tl.constexpr):
    g = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = g * C + tl.arange(0, C)
    mrow = offs_m < S
    rows = tl.load(SIGMA + bh.to(tl.int64) * S + offs_m, mask=mrow, other=0).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + d[None, :], mask=mrow[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * S + rows, mask=mrow, other=float("inf"))
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * skb + h * skh
    m_base = MASS + (bh.to(tl.int64) * tl.num_programs(0) + g) * Sk
    for n0 in range(0, SK_I if SK_I >= 0 else Sk, BLOCK_N):  # SK_I: interpret.loop_bound
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < Sk
        kt = tl.load(k_base + offs_n[:, None].to(tl.int64) * sks + d[None, :], mask=nmask[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        # keys on the MMA's M side: s^T [BLOCK_N, C], so the sum over the group's rows is a row
        # reduction of the accumulator (in-thread + quad shuffles, no shared-memory round trip)
        if IEEE:
            st = tl.dot(kt, tl.trans(q), input_precision="ieee")
        else:
            st = tl.dot(kt, tl.trans(q))
        p = tl.exp2(st * qk_scale - lse[None, :])
        tl.store(m_base + offs_n, tl.sum(p, 1), mask=nmask)


# NOTE BLOCK_N 64 / 4 warps / 3 stages: 64 keys = one wgmma M for one warpgroup, N = C = 64 queries;
# timed by benchmarks/bench_sparse_attn.py ("pass2_mass" rows).
_MASS_CONFIG = (64, 4, 3)


def group_key_mass(q, k, sigma, lse2, *, sm_scale: float, group_size: int) -> torch.Tensor:
    """mass [B, H, G, Sk] fp32: exact probabilities exp2(s - lse2) summed over each group's rows."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    C = int(group_size)
    if C < 16 or C & (C - 1):
        raise ValueError(f"group_key_mass: group_size must be a power of two >= 16, got {C}")
    err = pow2_head_dim_error(D)
    if err:
        raise ValueError(f"group_key_mass: {err}")
    G = triton.cdiv(S, C)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    sigma = sigma.to(torch.int64).contiguous()
    lse2 = lse2.to(torch.float32).reshape(B, H, S).contiguous()
    mass = torch.empty(B, H, G, Sk, device=q.device, dtype=torch.float32)
    BLOCK_N, warps, stages = _MASS_CONFIG
    _group_mass_kernel[(G, B * H)](
        q, k, sigma, lse2, mass, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), H, S, Sk, float(sm_scale) * LOG2E,
        C=C, D=D, BLOCK_N=BLOCK_N, SK_I=loop_bound(Sk), UPCAST=dot_upcast(q.dtype, k.dtype),
        IEEE=(q.dtype == torch.float32), num_warps=warps, num_stages=stages)
    return mass


def dense_with_lse(q, k, v, sm_scale: float):
    """Pass 1: dense attention and its base-2 LSE ``lse2 [B, H, S] fp32`` (reference/dense.py).

    On CUDA: SDPA's cuDNN kernel (the fastest bf16 SDPA backend on sm_90; docs/performance.md) with the flash kernel as
    fallback; both return the natural-log LSE, converted here (x log2 e). NOTE the convention is checked
    on the GPU against reference/dense.py by tests/kernels/test_select.py::test_dense_with_lse_cuda. On CPU:
    ``_scaled_dot_product_flash_attention_for_cpu`` (also natural log)."""
    B, H, S, _ = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # aten kernels need unit last stride
    if q.is_cuda:
        try:
            r = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, False, False, scale=float(sm_scale))
        except Exception:
            r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False,
                                                                   scale=float(sm_scale))
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=float(sm_scale))
    out, lse = r[0], r[1]
    return out, lse.float().reshape(B, H, S) * LOG2E


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
