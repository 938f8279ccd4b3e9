"""MC-Sparse pass 2 on the 8-bit preprocessed Q/K: exact group key masses from pass 1's INT8 codes, scales
and LSE ("cheap anchors"; docs/methods.md, MC-Sparse step 2).

Contract: ``vc_compile/reference/anchor_mass.py`` (notation, the "exact" / "shift" exp, key order).

Notation (reference/anchor_mass.py has the full contract)
--------
q8, qs      pass 1's INT8 query codes [B, H, S, D] and per-token scales (sm_scale * log2 e folded in).
k8, ks      INT8 key codes in the V-Smooth key order pi (k8[t] = smoothed key pi[t]) and one scale per 64
            rows: BK = 64 keys per step = one K scale (a scalar per step).
lse         pass 1's base-2 LSE of the smoothed logits [B, H, S] (``vsmooth_attention(return_lse=True)``).
sigma, C    PDDP order and group size (64 or 128); G = ceil(S / C); NG groups per program.
t           = bits(dot + 0x4B400000) = 1.5 * 2^23 + dot (|dot| < 2^22): the INT8 MMA's int32 score as a float
            with one IADD (no I2F); s~ = fma(t, ks, -1.5 * 2^23 ks) = dot * ks.
a, b        per query (in sigma order, prepared once by ``_prep_kernel``):
            "exact": a = qs, b = -lse; p = exp2(fma(s~, a, b)).
            "shift": a = 2^13 qs, b = 2^13 (127 - BETA - lse) + 1.5 * 2^23; z = max(fma(s~, a, b), 1.5 * 2^23)
            holds n = rne(2^13 (gap + 127 - BETA)) in its low bits, and p = float(bits(z) << 10): the
            1.5 * 2^23 prefix shifts out, n lands in the exponent field (reference ``shift_exp2``).
            Padded queries of the last group: a = 0 and b = -inf / 0, so p = 0.
mass        [B, H, G, Sk] fp32 or bf16, ORIGINAL key order: the masses of k8 row t are stored at column pi[t].

Per score: exact  IADD, FFMA, FFMA, MUFU.EX2, FADD         (MUFU 16/clk/SM: 8 cycles per warp instruction)
           shift  IADD, FFMA, FFMA, FMNMX, SHL, FADD      (6 issue cycles, INT pipe 4, FP pipe 4)
The sum over the group's C queries is a row sum of the transposed tile S^T = K8 Q8_g^T [BK, C] (keys on
the MMA's M side): in-thread adds and two quad shuffles.

Parallelisation: ``_prep_kernel`` grid (ceil(Sp / 128), B*H) gathers Q8 rows, qs and lse through sigma into
the group-major q8s [B*H, Sp, D] (Sp = G rounded up to NG groups, times C; zero rows past S) and writes a, b.
``_mass_kernel`` grid (Sp / (NG C), B*H), head-major (program_id(0) fastest: a head's K8, 4.2 MB at S =
32760, stays in L2): one program holds NG x C queries (TMA-loaded once) and streams every 64-key K8 tile
(TMA, ``num_stages`` deep); per tile and group one INT8 MMA [64, C] x D, the exp, the row sums, and BK masses
stored (scattered through pi when K is permuted). L2 -> SM traffic: (S / (NG C)) Sk D bytes per head
(0.54 GB at S = 32760, NG C = 256), MMA 2 S Sk D per head; exps S Sk per head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vc_compile.formats import BLOCK_K, SHIFT_BETA, SHIFT_FRAC_BITS, QKQuant
from vc_compile.kernels.compat import assembled
from vc_compile.kernels.configs import (TOPK_DEFAULT, AnchorMassConfig, ExpMode, TopKConfig,
                                         anchor_mass_default)
from vc_compile.kernels.interpret import interpreting, loop_bound
from vc_compile.kernels.soft_round import round_bf16

MAGIC_F = 12582912.0  # 1.5 * 2^23
PREP_ROWS = 128


@triton.jit
def _prep_kernel(Q8, QS, LSE, SIGMA, Q8S, CA, CB, S, Sp, D: tl.constexpr, TR: tl.constexpr,
                 SHIFT: tl.constexpr, SC: tl.constexpr, BETA: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pos = pid * TR + tl.arange(0, TR)
    inb = pos < Sp
    valid = pos < S
    tok = tl.load(SIGMA + bh * S + pos, mask=valid, other=0).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(Q8 + (bh * S + tok)[:, None] * D + d[None, :], mask=valid[:, None], other=0)
    tl.store(Q8S + (bh * Sp + pos)[:, None] * D + d[None, :], q, mask=inb[:, None])
    qs = tl.load(QS + bh * S + tok, mask=valid, other=0.0)
    lse = tl.load(LSE + bh * S + tok, mask=valid, other=0.0)
    if SHIFT:
        a = tl.where(valid, qs * SC, 0.0)
        b = tl.where(valid, (127.0 - BETA - lse) * SC + 12582912.0, 0.0)
    else:
        a = tl.where(valid, qs, 0.0)
        b = tl.where(valid, -lse, float("-inf"))
    tl.store(CA + bh * Sp + pos, a, mask=inb)
    tl.store(CB + bh * Sp + pos, b, mask=inb)


@triton.jit
def _coefs(CA, CB, crow, C: tl.constexpr):
    c = tl.arange(0, C)
    return tl.load(CA + crow + c), tl.load(CB + crow + c)


@triton.jit
def _group_mass(k, q, ks, a, b, m_ptr, cols, smask, SHIFT: tl.constexpr, FRAC: tl.constexpr,
                OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """One K8 tile [BK, D] against one group's Q8 [C, D] (coefficients a, b [C]): BK masses at m_ptr + cols."""
    acc = tl.dot(k, tl.trans(q), out_dtype=tl.int32)  # S^T [BK, C]: keys on M, the group sum is a row sum
    t = (acc + 0x4B400000).to(tl.float32, bitcast=True)  # (the compiler folds the add into the MMA's init)
    s = t * ks - 12582912.0 * ks  # one FFMA: dot * ks
    if SHIFT:
        z = tl.maximum(s * a[None, :] + b[None, :], 12582912.0)
        p = (z.to(tl.int32, bitcast=True) << (23 - FRAC)).to(tl.float32, bitcast=True)
    else:
        p = tl.exp2(s * a[None, :] + b[None, :])
    m = tl.sum(p, 1)
    if OUT_BF16:
        if INTERPRET:
            m = round_bf16(m)  # the interpreter's fp32 -> bf16 cast truncates
        m = m.to(tl.bfloat16)
    tl.store(m_ptr + cols, m, mask=smask)


@triton.jit
def _mass_kernel(desc_q, desc_k, KS, CA, CB, PERM, MASS, bh0, Sk, Skp, Sp, G, nks, n_kt, NKT_C: tl.constexpr,
                 C: tl.constexpr, BK: tl.constexpr, NG: tl.constexpr, SHIFT: tl.constexpr, FRAC: tl.constexpr,
                 HAS_PERM: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    hl = tl.program_id(1)  # head within this launch (MASS holds the launch's heads only)
    bh = bh0 + hl
    g0 = pid * NG
    qrow = bh * Sp + g0 * C
    crow = bh.to(tl.int64) * Sp + g0 * C
    # the NG groups' Q8 tiles and coefficients stay on chip for the whole key loop (loaded in a blocked layout
    # and converted to the MMA's column layout once, not per step)
    q0 = desc_q.load([qrow, 0])
    a0, b0 = _coefs(CA, CB, crow, C)
    if NG >= 2:
        q1 = desc_q.load([qrow + C, 0])
        a1, b1 = _coefs(CA, CB, crow + C, C)
    if NG >= 4:
        q2 = desc_q.load([qrow + 2 * C, 0])
        a2, b2 = _coefs(CA, CB, crow + 2 * C, C)
        q3 = desc_q.load([qrow + 3 * C, 0])
        a3, b3 = _coefs(CA, CB, crow + 3 * C, C)
    m_base = MASS + (hl.to(tl.int64) * G + g0) * Skp  # rows padded to Skp (a multiple of 64)
    for kt in range(0, NKT_C if NKT_C >= 0 else n_kt):  # NKT_C: see interpret.loop_bound
        k = desc_k.load([bh * Sk + kt * BK, 0])
        ks = tl.load(KS + bh * nks + kt)
        keys = kt * BK + tl.arange(0, BK)
        kmask = keys < Sk
        if HAS_PERM:
            cols = tl.load(PERM + bh.to(tl.int64) * Sk + keys, mask=kmask, other=0)
        else:
            cols = keys.to(tl.int64)
        if INTERPRET:  # NOTE Triton 3.9's interpreter refuses a block mask and-ed with a scalar one
            gk = tl.zeros([BK], tl.int32) + g0
        else:
            gk = g0
        _group_mass(k, q0, ks, a0, b0, m_base, cols, kmask & (gk < G), SHIFT, FRAC, OUT_BF16, INTERPRET)
        if NG >= 2:
            _group_mass(k, q1, ks, a1, b1, m_base + Skp, cols, kmask & (gk + 1 < G), SHIFT, FRAC, OUT_BF16,
                        INTERPRET)
        if NG >= 4:
            _group_mass(k, q2, ks, a2, b2, m_base + 2 * Skp, cols, kmask & (gk + 2 < G), SHIFT, FRAC, OUT_BF16,
                        INTERPRET)
            _group_mass(k, q3, ks, a3, b3, m_base + 3 * Skp, cols, kmask & (gk + 3 < G), SHIFT, FRAC, OUT_BF16,
                        INTERPRET)


@dataclass
class PreparedQueries:
    """Pass-2 queries in sigma order (``prepare_queries``): q8s [B*H, Sp, D] int8, a / b [B*H, Sp] fp32."""
    q8s: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    S: int
    C: int
    G: int
    Sp: int
    exp: ExpMode


def _check(qk: QKQuant, lse_s, sigma, C: int):
    B, H, S, D = qk.q8.shape
    if qk.q8.dtype != torch.int8 or qk.k8.dtype != torch.int8:
        raise ValueError(f"anchor mass: needs pass 1's INT8 Q/K codes (qk_format='int8'), got {qk.q8.dtype}")
    if D not in (64, 128):
        raise ValueError(f"anchor mass: head dim {D} is not supported (64 or 128)")
    if C not in (64, 128):
        raise ValueError(f"anchor mass: group_size must be 64 or 128 (the sparse kernel's query tile), got {C}")
    if tuple(lse_s.shape) != (B, H, S) or tuple(sigma.shape) != (B, H, S):
        raise ValueError(f"anchor mass: lse_s and sigma must be [B, H, S] = {[B, H, S]}, got "
                         f"{list(lse_s.shape)} and {list(sigma.shape)}")


def prepare_queries(qk: QKQuant, lse_s: torch.Tensor, sigma: torch.Tensor, *, group_size: int,
                    launch: AnchorMassConfig) -> PreparedQueries:
    """Gather Q8, qs and lse through sigma once (all heads): S D + 8 S bytes per head (0.1 ms at S = 32760)."""
    C = int(group_size)
    _check(qk, lse_s, sigma, C)
    B, H, S, D = qk.q8.shape
    NG = launch.groups_per_program
    G = triton.cdiv(S, C)
    Sp = triton.cdiv(G, NG) * NG * C
    dev = qk.q8.device
    q8s = torch.empty(B * H, Sp, D, device=dev, dtype=torch.int8)
    a = torch.empty(B * H, Sp, device=dev, dtype=torch.float32)
    b = torch.empty(B * H, Sp, device=dev, dtype=torch.float32)
    shift = launch.exp == ExpMode.SHIFT
    _prep_kernel[(triton.cdiv(Sp, PREP_ROWS), B * H)](
        qk.q8.contiguous(), qk.q_scale.float().contiguous(), lse_s.float().contiguous(),
        sigma.to(torch.int64).contiguous(), q8s, a, b, S, Sp, D=D, TR=PREP_ROWS, SHIFT=shift,
        SC=float(1 << SHIFT_FRAC_BITS), BETA=SHIFT_BETA, num_warps=4)
    return PreparedQueries(q8s, a, b, S, C, G, Sp, launch.exp)


def mass_heads(prep: PreparedQueries, qk: QKQuant, bh0: int, bh1: int, *, key_perm: Optional[torch.Tensor],
               launch: AnchorMassConfig, mass_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Masses of the flattened heads [bh0, bh1): [bh1 - bh0, G, Sk] in ``mass_dtype`` (fp32 or bf16), a view of
    rows padded to a multiple of 64 keys."""
    if mass_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"anchor mass: mass_dtype must be float32 or bfloat16, got {mass_dtype}")
    if launch.exp != prep.exp:
        raise ValueError("anchor mass: the queries were prepared for another exp mode")
    B, H, S, D = qk.q8.shape
    Sk = qk.k8.shape[2]
    BH = B * H
    C, G, Sp, NG = prep.C, prep.G, prep.Sp, launch.groups_per_program
    if Sp % (NG * C):
        raise ValueError("anchor mass: the queries were prepared for another groups_per_program")
    k8 = qk.k8.contiguous()
    nks = triton.cdiv(Sk, BLOCK_K)
    ks = qk.k_scale.float().contiguous()
    if tuple(ks.shape) != (B, H, nks):
        raise ValueError(f"anchor mass: k_scale must be [B, H, ceil(Sk/64)] = {[B, H, nks]}, got {list(ks.shape)}")
    n = bh1 - bh0
    Skp = nks * BLOCK_K  # rows padded to 64 keys: 16-byte aligned rows let the top-K loads vectorise
    mass = torch.empty(n, G, Skp, device=k8.device, dtype=mass_dtype)[..., :Sk]
    if key_perm is not None:
        if tuple(key_perm.shape) != (B, H, Sk):
            raise ValueError(f"anchor mass: key_perm must be [B, H, Sk] = {[B, H, Sk]}, got {list(key_perm.shape)}")
        perm = key_perm.to(torch.int64).contiguous()
    else:
        perm = ks  # never read
    desc_q = TensorDescriptor.from_tensor(prep.q8s.view(BH * Sp, D), [C, D])
    desc_k = TensorDescriptor.from_tensor(k8.view(BH * Sk, D), [BLOCK_K, D])
    n_kt = nks
    _mass_kernel[(Sp // (NG * C), n)](
        desc_q, desc_k, ks, prep.a, prep.b, perm, mass, bh0, Sk, Skp, Sp, G, nks, n_kt, loop_bound(n_kt),
        C=C, BK=BLOCK_K, NG=NG, SHIFT=launch.exp == ExpMode.SHIFT, FRAC=SHIFT_FRAC_BITS,
        HAS_PERM=key_perm is not None, OUT_BF16=mass_dtype == torch.bfloat16, INTERPRET=interpreting(),
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return mass


def group_key_mass_q8(qk: QKQuant, lse_s: torch.Tensor, sigma: torch.Tensor, *, group_size: int,
                      key_perm: Optional[torch.Tensor] = None, launch: Optional[AnchorMassConfig] = None,
                      mass_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """mass [B, H, G, Sk] in original key order, all heads at once (reference ``group_key_mass_q8``)."""
    launch = launch or anchor_mass_default(group_size)
    B, H, S, _ = qk.q8.shape
    prep = prepare_queries(qk, lse_s, sigma, group_size=group_size, launch=launch)
    mass = mass_heads(prep, qk, 0, B * H, key_perm=key_perm, launch=launch, mass_dtype=mass_dtype)
    return mass.unflatten(0, (B, H))


def anchor_select_q8(qk: QKQuant, lse_s: torch.Tensor, sigma: torch.Tensor, *, group_size: int, keep: int,
                     key_perm: Optional[torch.Tensor] = None, launch: Optional[AnchorMassConfig] = None,
                     topk_launch: TopKConfig = TOPK_DEFAULT, mass_dtype: torch.dtype = torch.bfloat16,
                     max_mass_bytes: int = 1 << 30, run: int = 1) -> torch.Tensor:
    """Pass 2 + top-K: idx [B, H, G, keep] int32 ascending (``run`` > 1: [B, H, G, keep / run], the top runs of
    ``run`` keys by their summed masses, ``torch_ops.run_mass``). The queries are gathered through sigma once; the
    masses of as many heads as fit in ``max_mass_bytes`` are computed and reduced to their top-K before the next
    chunk (bf16 masses: 0.42 GB per head-chunk of 25 heads at S = 32760, C = 128)."""
    from vc_compile.kernels.topk import select_topk
    from vc_compile.torch_ops import run_mass

    launch = launch or anchor_mass_default(group_size)
    B, H, S, _ = qk.q8.shape
    Sk = qk.k8.shape[2]
    prep = prepare_queries(qk, lse_s, sigma, group_size=group_size, launch=launch)
    per_head = prep.G * triton.cdiv(Sk, BLOCK_K) * BLOCK_K * torch.finfo(mass_dtype).bits // 8
    hc = max(1, min(B * H, max_mass_bytes // max(per_head, 1)))
    out = torch.empty(B * H, prep.G, keep // run, device=qk.q8.device, dtype=torch.int32)
    for bh0 in range(0, B * H, hc):
        bh1 = min(B * H, bh0 + hc)
        mass = mass_heads(prep, qk, bh0, bh1, key_perm=key_perm, launch=launch, mass_dtype=mass_dtype)
        if run > 1:
            mass = run_mass(mass, run)
        out[bh0:bh1] = select_topk(mass, keep // run, launch=topk_launch)
        del mass
    return out.view(B, H, prep.G, keep // run)


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
