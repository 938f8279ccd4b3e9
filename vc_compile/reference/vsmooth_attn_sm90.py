"""The sm_90 kernel's numerics, emulated in plain PyTorch (oracle of ``kernels/vsmooth_attn_sm90.py``'s rounding).

``reference/vsmooth_attn.py`` is the contract's oracle (final row max, one rounding of P~). This module follows
the production kernel operation by operation, so that fidelity questions (why ExpCast's error grows
with S; where V-Smooth's error comes from) can be answered on a CPU:

* Online softmax over 128-key blocks: block j is quantised against the running max m_j (the kernel's
  ``m_new = max(m_i, max(mt0 a0, mt1 a1))``, mt the exact integer maxima of the two 64-key halves, a = ks qs
  in fp32), and the accumulator is rescaled by 2^(m_{j-1} - m_j) (combined exactly here: ``sage2.online_combine``).
* P~ (``p_mode``):
  - ``"exp2"``: fp8(2^y), y = fma(t, a, b), t = C + qk (C = 1.5 * 2^23), b = fma(-C, a, 8 - m): the folded FFMA.
  - ``"expcast"`` mode 3: code = fma(t, A', K) rounded by the FFMA itself (``mode3_codes``), clamped at 0,
    reinterpreted as E4M3 (codes 1-7 decode as the subnormals c 2^-9, as the MMA reads them).
  - the masked key-tail block (when S % 128 != 0) always takes the unfolded path (mode 2 for ExpCast).
* Row sums of the decoded P~ (MS: an FP8 MMA with an all-ones B tile; ``rowsum="mma"`` applies the same ~22-bit
  accumulator model as PV; ``"exact"`` sums in fp64; ``"fp16"``: the non-MS kernels' fp16 block sums).
* PV: per block a fresh FP8 accumulator (``sage2.fp22_block_sums``), then fp32 (``pv_window``: per window of
  blocks, ``fp22_window_sums``); the V-Smooth mean term
  r_j mu_j exactly (hi/lo tf32 in the kernel, ~2^-20); O = acc v_scale / l, rounded to ``out_dtype``.

``EXPCAST_OFFSET`` (quant.py) is the kernel's 119.65 = 8 * 8 + 56 - 0.35 (row max -> code 120 = 256). The
``offset`` argument lets studies move it (docs/methods.md).
"""
from __future__ import annotations

from typing import Optional

import torch

from vc_compile.formats import BLOCK_K, BLOCK_V, EXPCAST_OFFSET, FP8_DTYPE, FP8_MAX, P_SCALE_LOG2, QKQuant, VQuant

from . import sage2

C = 12582912.0  # 1.5 * 2^23: t = C + qk is the magic-number int -> float conversion of the INT8 scores
TWO23 = 8388608.0
BN = BLOCK_V  # keys per block of the sm_90 kernel


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round to fp32 (IEEE round to nearest even)."""
    return x.float()


def _fma(a, b, c) -> torch.Tensor:
    """fp32 fused multiply-add: a*b + c with ONE rounding. Exact in fp64 for the operands here (a*b of two fp32
    fits 48 bits; c within 2^26 of it), then rounded once to fp32."""
    a = a.double() if torch.is_tensor(a) else a
    b = b.double() if torch.is_tensor(b) else b
    c = c.double() if torch.is_tensor(c) else c
    return (a * b + c).float()


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """E4M3 round trip (round to nearest even, saturating at 448), fp32 out."""
    return x.float().clamp(max=FP8_MAX).to(FP8_DTYPE).float()


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..126 (any dtype) -> E4M3 values (fp32), subnormal codes 1-7 included."""
    return codes.to(torch.uint8).view(FP8_DTYPE).float()


def mode3_coeffs(a_half: torch.Tensor, m_new: torch.Tensor, offset: float = EXPCAST_OFFSET):
    """(A', K) of mode 3 per (row, half): a_half [.., 2] = ks qs (fp32), m_new [..] (fp32). The kernel's ops:
    X = offset - 8 m; fl = floor X; fx = X - fl; n = floor(fma(a, 8 C, -fx) + 0.5) (ptxas contracts the
    multiply-add; unfused, n differs by 1 at ties only); A' = (n + fx) (1 / C); K = (2^23 + fl) - n."""
    X = torch.tensor(offset, dtype=torch.float32) - 8.0 * m_new.float()
    fl = torch.floor(X)
    fx = X - fl
    n = torch.floor(_fma(a_half, 8.0 * C, -fx.unsqueeze(-1)) + 0.5)
    A = (n + fx.unsqueeze(-1)) * torch.tensor(1.0 / C, dtype=torch.float32)
    K = (TWO23 + fl.unsqueeze(-1)) - n
    return A, K


def mode3_codes(qk: torch.Tensor, a_half: torch.Tensor, m_new: torch.Tensor, *, offset: float = EXPCAST_OFFSET,
                floor_code: float = 0.0) -> torch.Tensor:
    """ExpCast mode 3 codes (fp32 integers >= ``floor_code``; the kernel clamps at 0: ``max(y, 2^23)``).

    qk [.., n, nb, 128] exact integer scores (fp32), a_half [.., n, nb, 2] the scales a = ks qs of the two
    64-key halves (fp32), m_new [.., n, nb] the running max. y = fma(t, A', K) with t = C + qk, rounded once:
    in [2^23, 2^24) the ulp is 1, so the FFMA's rounding is the code's (``mode3_coeffs``)."""
    A, K = mode3_coeffs(a_half, m_new, offset)
    half = qk.shape[-1] // 2
    Ae = A.double().repeat_interleave(half, dim=-1)
    # t A' + K = qk A' + (C A' + K): both parts exact in fp64, so one rounding to fp32 is the FFMA's
    y = (qk.double() * Ae + (C * A.double() + K.double()).repeat_interleave(half, dim=-1)).float()
    return torch.clamp(y, min=TWO23 + floor_code) - TWO23


def _half_scales(qs: torch.Tensor, ks: torch.Tensor, nb: int) -> torch.Tensor:
    """[.., n] row scales x [.., nb * 128] per-key scales -> a [.., n, nb, 2] = ks_half * qs in fp32."""
    ksh = ks.reshape(*ks.shape[:-1], nb, 2, BLOCK_K)[..., 0]  # one K scale per 64 keys
    return qs.float()[..., :, None, None] * ksh.float().unsqueeze(-3)


def block_probs(qk: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, Sk: int, *, p_mode: str = "expcast",
                offset: Optional[float] = None, floor_code: float = 0.0, block_ref: Optional[float] = None,
                code_fn=None):
    """P~ of every key block as the kernel forms it, and the running maxima.

    qk [.., n, nb*128] exact integer scores (fp32), qs [.., n], ks [.., nb*128] (0 past Sk). Returns
    (p [.., n, nb*128] fp32 decoded P~ (0 on padded keys), m [.., n, nb] the running max after each block).
    ``offset``: the code of u = 0 (ExpCast; default 119.65) or log2 of P~'s row max (exp2; default 8).
    ``floor_code``: the lowest ExpCast code (the clamp; 0 in the kernel). ``code_fn(u, full)``: a study hook
    returning P~ for the exact fp32 u = s - m (full: not the masked tail block); tests/fidelity_decompose.py
    uses it to isolate error sources. ``block_ref`` = L: block j is quantised against its
    own maximum b_j, floored at L below the running max (ref_j = max(b_j, m_j - L)) instead of the running
    max m_j; the accumulator recurrence is unchanged with alpha = 2^(ref_{j-1} - ref_j), which may exceed 1."""
    *lead, n, L = qk.shape
    nb = L // BN
    a = _half_scales(qs, ks, nb)  # [.., n, nb, 2]
    qkb = qk.float().reshape(*lead, n, nb, BN)
    bm = (qkb.reshape(*lead, n, nb, 2, BLOCK_K).amax(dim=-1) * a).amax(dim=-1)  # [.., n, nb]
    full = torch.ones(nb, dtype=torch.bool)
    s_tail = None
    if Sk % BN:  # the masked tail block: s = fma(t, ks, -C ks) * qs per key, -inf past Sk, max over keys
        full[-1] = False
        kst = ks.reshape(*ks.shape[:-1], nb, BN)[..., -1, :].float().unsqueeze(-2)  # [.., 1, 128]
        s_tail = _fma(qkb[..., -1, :] + C, kst, -C * kst) * qs.float().unsqueeze(-1)
        valid = torch.arange(BN, device=qk.device) < Sk - (nb - 1) * BN
        s_tail = torch.where(valid, s_tail, torch.full_like(s_tail, float("-inf")))
        bm[..., -1] = s_tail.amax(dim=-1)
    m = torch.cummax(bm, dim=-1).values
    if block_ref is not None:
        m = torch.maximum(bm, m - block_ref)
    ofs = (EXPCAST_OFFSET if p_mode == "expcast" else P_SCALE_LOG2) if offset is None else offset
    pb = torch.zeros_like(qkb)
    nf = int(full.sum())
    qf, mf, af = qkb[..., :nf, :], m[..., :nf], a[..., :nf, :]
    if code_fn is not None:
        pb[..., :nf, :] = code_fn(qf * af.repeat_interleave(BLOCK_K, dim=-1) - mf.unsqueeze(-1), True).float()
    elif p_mode == "expcast":
        pb[..., :nf, :] = decode_codes(mode3_codes(qf, af, mf, offset=ofs, floor_code=floor_code))
    else:  # exp2: y = fma(t, a, b), b = fma(-C, a, ofs - m): 2^y cast to E4M3
        b = _fma(-C, af, (ofs - mf).unsqueeze(-1)).repeat_interleave(BLOCK_K, dim=-1)
        pb[..., :nf, :] = _e4m3(torch.exp2(_fma(qf + C, af.repeat_interleave(BLOCK_K, dim=-1), b)))
    if s_tail is not None:
        mt = m[..., -1:]
        if code_fn is not None:
            pb[..., -1, :] = code_fn(s_tail - mt, False).float()
        elif p_mode == "expcast":  # mode 2: y = fma(s, 8, ofs - 8 m), rounded by the magic add, clamped
            y = _fma(s_tail, 8.0, ofs - 8.0 * mt)
            pb[..., -1, :] = decode_codes((y + TWO23).clamp(min=TWO23 + floor_code) - TWO23)
        else:
            pb[..., -1, :] = _e4m3(torch.exp2(s_tail - (mt - ofs)))
    p = pb.flatten(-2)
    if L > Sk:
        p[..., Sk:] = 0.0
    return p, m


def fp22_row_sums(p: torch.Tensor, bits: int = sage2.ACC_MANTISSA_BITS) -> torch.Tensor:
    """MS row sums: P~ [.., n, nb*128] times an all-ones B tile in the FP8 MMA -> [.., n, nb] (the accumulator
    model of ``sage2.fp22_block_sums``)."""
    *lead, n, L = p.shape
    part = p.float().reshape(*lead, n, L // BN, BN // sage2.MMA_K, sage2.MMA_K).sum(-1)
    acc = sage2.truncate_mantissa(part[..., 0], bits)
    for i in range(1, part.shape[-1]):
        acc = sage2.truncate_mantissa(acc + part[..., i], bits)
    return acc


def fp22_window_sums(p: torch.Tensor, v: torch.Tensor, m: torch.Tensor, window: int,
                     bits: int = sage2.ACC_MANTISSA_BITS) -> torch.Tensor:
    """PV as the kernel's ``pv_window`` forms it: P~ [.., n, nb*128], V [.., nb*128, D], the running max of each
    block m [.., n, nb]. Within a window of ``window`` blocks the FP8 MMA's accumulator carries the sum, rescaled
    in fp32 by 2^(m_{j-1} - m_j) before each block; at each window's end it is added to the fp64 total at the
    current max. Returns [.., n, D] fp64 at the last block's max.

    The accumulator model here is per term: each 32-key slice's products and the running sum are aligned to the
    largest of them and truncated toward zero to ``bits`` mantissa bits below it, then added. It reproduces the
    error growth the GPU shows over a window on unsmoothed V, where truncating only the slice's sum
    (``sage2.fp22_block_sums``, right for a fresh block accumulator) does not: once the running sum outgrows the
    products, every product loses its low bits (figures: docs/design/pv-window.md)."""
    *lead, n, L = p.shape
    D = v.shape[-1]
    K = sage2.MMA_K
    nb, ns = L // BN, BN // K
    pd = p.double().reshape(*lead, n, nb, ns, K)
    vd = v.double().reshape(*lead, nb, ns, K, D)
    total = torch.zeros(*lead, n, D, dtype=torch.float64, device=p.device)
    m_total = None  # the max the total is expressed at
    accm = None
    for j in range(nb):
        mj = m[..., j].unsqueeze(-1)
        if j % window == 0:
            accm = torch.zeros_like(total)
        else:
            accm = (accm.float() * torch.exp2((m[..., j - 1] - m[..., j]).unsqueeze(-1).float())).double()
        for i in range(ns):
            prods = pd[..., j, i, :].unsqueeze(-1) * vd[..., j, i, :, :].unsqueeze(-3)  # [.., n, K, D], exact
            top = torch.maximum(prods.abs().amax(-2), accm.abs())
            quantum = torch.exp2(torch.floor(torch.log2(top.clamp_min(1e-300))) - bits)
            accm = (torch.trunc(accm / quantum) * quantum
                    + (torch.trunc(prods / quantum.unsqueeze(-2)) * quantum.unsqueeze(-2)).sum(-2))
        if j % window == window - 1 or j == nb - 1:
            scale = 0.0 if m_total is None else torch.exp2((m_total - mj).double())
            total = total * scale + accm
            m_total = mj
    return total


def attention(qk: QKQuant, vq: VQuant, *, p_mode: str = "expcast", offset: Optional[float] = None,
              floor_code: float = 0.0, block_ref: Optional[float] = None, rows: Optional[torch.Tensor] = None,
              chunk: int = 128, acc_bits: int = sage2.ACC_MANTISSA_BITS, rowsum: str = "mma",
              out_dtype=torch.bfloat16, code_fn=None, return_parts: bool = False, pv_window: int = 1):
    """The kernel's output for query ``rows`` (all when None), [B, H, n, D] in ``out_dtype`` (the kernel writes
    the input dtype; fp32 to see the emulation unrounded). Arguments: see ``block_probs``; ``return_parts``:
    also {"p_eff": P~ 2^(m_j - m) / l [B, H, n, Sk], "v_eff": V_q [B, H, Sk, D]} for error decompositions.
    ``pv_window``: the launch field of that name (``fp22_window_sums``); like the kernel, 1 when V carries no
    block means (``vq.zero_mean``)."""
    from vc_compile.formats import natural_layout

    from .preprocess import dequantize_v

    vq = natural_layout(vq)
    B, H, S, D = qk.q8.shape
    Sk = qk.k8.shape[2]
    nb = (Sk + BN - 1) // BN
    L = nb * BN
    idx = torch.arange(S, device=qk.q8.device) if rows is None else rows
    kf = torch.nn.functional.pad(qk.k8.float(), (0, 0, 0, L - Sk))
    ks = torch.nn.functional.pad(qk.k_scale.repeat_interleave(BLOCK_K, -1)[..., :Sk], (0, L - Sk))
    vs = vq.v_scale.double()
    r8 = vq.v8t[..., :L].float().transpose(-1, -2)  # [B, H, L, D] residual codes (zero padded)
    mu = vq.v_mean.double()  # [B, H, nb, D]
    outs, peffs = [], []
    for i0 in range(0, idx.numel(), chunk):
        r = idx[i0:i0 + chunk]
        qk_int = qk.q8[:, :, r].float() @ kf.transpose(-1, -2)  # exact in fp32: |qk| < 2^22
        p, m = block_probs(qk_int, qk.q_scale[:, :, r], ks, Sk, p_mode=p_mode, offset=offset,
                           floor_code=floor_code, block_ref=block_ref, code_fn=code_fn)
        w = torch.exp2((m - m[..., -1:]).double())  # [B, H, n, nb]
        rblk = p.unflatten(-1, (nb, BN)).double().sum(-1)  # exact block row sums r_j
        if rowsum == "mma":
            rsum = fp22_row_sums(p, acc_bits).double()
        elif rowsum == "fp16":
            rsum = rblk.half().double()
        else:
            rsum = rblk
        l = (rsum * w).sum(-1)
        if pv_window > 1 and not vq.zero_mean:
            acc = fp22_window_sums(p, r8, m, pv_window, acc_bits)
        else:
            acc = sage2.online_combine(sage2.fp22_block_sums(p, r8, bits=acc_bits), m)  # units of v_scale
        acc = acc * vs.unsqueeze(2) + torch.einsum("bhnj,bhjd->bhnd", rblk * w, mu)  # + r_j mu_j
        outs.append((acc / l.unsqueeze(-1)).to(out_dtype))
        if return_parts:
            peffs.append((p.double() * w.repeat_interleave(BN, -1) / l.unsqueeze(-1))[..., :Sk].float())
    out = torch.cat(outs, dim=2)
    if not return_parts:
        return out
    return out, {"p_eff": torch.cat(peffs, dim=2), "v_eff": dequantize_v(vq)}
