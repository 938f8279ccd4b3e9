"""SageAttention2's published numerics (sm_90 INT8-QK / FP8-PV kernel), emulated in plain PyTorch.

The fidelity anchor: no SageAttention2 wheel runs on our
machines, so benchmarks and tests compare V-Smooth against this emulation. It follows, and cites,
thu-ml/SageAttention (paper: arXiv 2411.10958, "SageAttention2: Efficient Attention with Thorough Outlier
Smoothing and Per-thread INT4 Quantization"; code: ``sageattention/core.py::sageattn_qk_int8_pv_fp8_cuda_sm90``,
``sageattention/triton/quant_per_thread.py``, ``sageattention/quant.py::per_channel_fp8``,
``csrc/qattn/qk_int_sv_f8_cuda_sm90.cuh``, ``csrc/qattn/attn_utils.cuh``); no code is copied.

What it reproduces (sm_90 defaults: ``qk_quant_gran="per_thread"``, ``pv_accum_dtype="fp32+fp32"``)
--------
* K smoothing: ``K - mean_tokens(K)`` (all tokens, per (b, h, channel)).
* Q smoothing (the paper's Sec. 3.2, optional, ``smooth_q``): ``Q - mean(Q_blk)`` per block of ``Q_BLOCK`` = 64
  query rows (the sm_90 kernel's CTA_Q), and the term ``dS = mean(Q_blk) . (K - mean K)^T`` added back to the
  logits in fp32 (a GEMV over the unquantised smoothed K). The released sm_90 INT8 path does not smooth Q
  (``smooth_q=False`` gives exactly that path).
* Per-thread INT8 Q and K: one scale per group of rows that one thread of the MMA touches. Q: in every
  16-row warp tile (4 warps x 16 rows = the 64-row CTA block) the rows {r, r + 8} (r = 0..7) share a scale (a
  thread holds rows lane/4 and lane/4 + 8 of the wgmma accumulator); K: in every 128-key block the keys with
  the same ``(key % 8) // 2`` share a scale (a thread holds columns 2 (lane % 4) + {0, 1} + 8 i), 32 keys each.
  ``scale = amax / 127 + 1e-7``, codes ``x / scale`` rounded half away from zero.
* Logits ``s = (q8 . k8) q_scale k_scale sm_scale log2(e)`` (+ ``dS`` in base 2) in fp32.
* P: online softmax over 128-key blocks (CTA_K) with the running row max m; ``P = exp2(s - m + 8.807)`` in fp32
  (``S_FP8_OFFSET`` = log2 448: the row max maps to 448), cast to FP8 E4M3 (round to nearest, saturating).
* Row sum: the fp32 P (before the FP8 cast), not the decoded FP8 values.
* V: FP8 E4M3 with one scale per channel over all tokens of the head (``per_channel_fp8``, ``smooth_v=False``
  on sm_90): ``v_scale = amax / 448``; O = acc * v_scale / l.
* Two-level accumulation ("fp32+fp32"): each 128-key block's FP8 PV goes into a fresh accumulator of the
  Hopper FP8 MMA, which keeps ~22 bits (1 + 8 + 13: the paper's Sec. 3.4); it is then added to an fp32
  accumulator (rescaled by 2^(m_old - m_new) each block). Emulated as: the exact sum of each k = 32 slice
  (one wgmma k-step) is added to the block accumulator and the result truncated toward zero to
  ``ACC_MANTISSA_BITS`` = 13 mantissa bits (``fp22_block_sums``). The exact hardware alignment rule is not
  published; this model is the paper's description. Its effect here is ~1e-4 relative, far below the FP8
  P/V rounding (~2e-2 per element).

Everything runs in fp32/fp64 on any device; queries are processed in chunks so that at most
``chunk x S`` scores are held. Inputs [B, H, S, D] (any float dtype); the output is fp32 unless asked.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from vc_compile.formats import FP8_DTYPE, FP8_MAX, LOG2E

Q_BLOCK = 64  # CTA_Q of the sm_90 kernel: the Q-smoothing block
K_BLOCK = 128  # CTA_K: the online-softmax block and the K scale block
S_FP8_OFFSET = 8.807  # log2(448): P's row max maps to 448
ACC_MANTISSA_BITS = 13  # FP8 MMA accumulator on sm_90: ~22 bits (1 sign, 8 exponent, 13 mantissa)
MMA_K = 32  # keys per wgmma k-step of the FP8 PV product


class Sage2Quant(NamedTuple):
    q8: torch.Tensor  # [B, H, S, D] int8
    q_scale: torch.Tensor  # [B, H, S] fp32 (per-thread group scale, repeated per row)
    k8: torch.Tensor  # [B, H, Sk, D] int8
    k_scale: torch.Tensor  # [B, H, Sk] fp32 (per-thread group scale, repeated per key)
    q_mean: Optional[torch.Tensor]  # [B, H, S, D] fp32 block mean of Q per row (smooth_q), else None
    k_smooth: Optional[torch.Tensor]  # [B, H, Sk, D] fp32 smoothed K (for dS; smooth_q only)
    v8: torch.Tensor  # [B, H, Sk, D] float8_e4m3fn
    v_scale: torch.Tensor  # [B, H, D] fp32
    sm_scale: float


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.trunc(x + 0.5 * torch.sign(x))


def _group_quant(x: torch.Tensor, groups: torch.Tensor, n_groups: int) -> tuple:
    """INT8 codes and per-row scales of x [B, H, S, D] with rows grouped by ``groups`` [S] (ids < n_groups)."""
    B, H, S, D = x.shape
    amax_row = x.abs().amax(dim=-1)  # [B, H, S]
    amax = torch.zeros(B, H, n_groups, dtype=x.dtype, device=x.device)
    amax.scatter_reduce_(2, groups.expand(B, H, S), amax_row, reduce="amax", include_self=True)
    scale = amax / 127.0 + 1e-7
    s_row = scale.gather(2, groups.expand(B, H, S))
    codes = _round_half_away(x / s_row.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return codes, s_row


def q_groups(S: int, device=None) -> torch.Tensor:
    """Per-thread Q groups: rows {16 w + r, 16 w + r + 8} of each 16-row warp tile share one scale."""
    t = torch.arange(S, device=device)
    return (t // 16) * 8 + t % 8


def k_groups(S: int, device=None) -> torch.Tensor:
    """Per-thread K groups: in each 128-key block, keys with the same (key % 8) // 2 share one scale."""
    t = torch.arange(S, device=device)
    return (t // K_BLOCK) * 4 + (t % 8) // 2


def quantize(q, k, v, *, sm_scale: Optional[float] = None, smooth_q: bool = True) -> Sage2Quant:
    """Q, K, V [B, H, S, D] -> Sage2Quant (module doc)."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    sm = D ** -0.5 if sm_scale is None else float(sm_scale)
    qf, kf, vf = q.float(), k.float(), v.float()
    kf = kf - kf.mean(dim=2, keepdim=True)
    q_mean = k_smooth = None
    if smooth_q:
        nb = (S + Q_BLOCK - 1) // Q_BLOCK
        pad = nb * Q_BLOCK - S
        qp = torch.nn.functional.pad(qf, (0, 0, 0, pad))
        cnt = torch.full((nb,), float(Q_BLOCK), device=q.device)
        cnt[-1] = Q_BLOCK - pad
        qm = qp.unflatten(2, (nb, Q_BLOCK)).sum(dim=3) / cnt.view(1, 1, nb, 1)
        q_mean = qm.repeat_interleave(Q_BLOCK, dim=2)[:, :, :S]
        qf = qf - q_mean
        k_smooth = kf
    nq = (S + 15) // 16 * 8
    nk = (Sk + K_BLOCK - 1) // K_BLOCK * 4
    q8, qs = _group_quant(qf, q_groups(S, q.device), nq)
    k8, ks = _group_quant(kf, k_groups(Sk, q.device), nk)
    amax = vf.abs().amax(dim=2)  # [B, H, D]
    v_scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    v8 = (vf / v_scale.unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Sage2Quant(q8, qs, k8, ks, q_mean, k_smooth, v8, v_scale, sm)


def logits(sq: Sage2Quant, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Base-2 logits the kernel works with, [B, H, n, Sk] fp32, for query ``rows`` (all when None)."""
    q8 = sq.q8 if rows is None else sq.q8[:, :, rows]
    qs = sq.q_scale if rows is None else sq.q_scale[:, :, rows]
    s = (q8.float() @ sq.k8.float().transpose(-1, -2)) * qs.unsqueeze(-1) * sq.k_scale.unsqueeze(-2)
    s = s * (sq.sm_scale * LOG2E)
    if sq.q_mean is not None:
        qm = sq.q_mean if rows is None else sq.q_mean[:, :, rows]
        s = s + (qm @ sq.k_smooth.transpose(-1, -2)) * (sq.sm_scale * LOG2E)
    return s


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 x with the mantissa cut to ``bits`` bits, toward zero (bits >= 23: unchanged)."""
    if bits >= 23:
        return x
    drop = 23 - bits
    xi = x.float().contiguous().view(torch.int32)
    return (xi & ~((1 << drop) - 1)).view(torch.float32)


def fp22_block_sums(p: torch.Tensor, v: torch.Tensor, block: int = K_BLOCK,
                    bits: int = ACC_MANTISSA_BITS) -> torch.Tensor:
    """Per-key-block products of p [.., n, nb*block] and v [.., nb*block, D] as the FP8 MMA forms them:
    [.., nb, n, D]. Within a block, k = 32 slices are summed exactly (fp64) and added to the block
    accumulator, which is truncated to ``bits`` mantissa bits after each slice (module doc)."""
    *lead, n, L = p.shape
    D = v.shape[-1]
    nb = L // block
    ns = block // MMA_K
    # fp32 slice sums: FP8 x FP8 products are exact in fp32; 32 of them sum to ~2^-24 relative
    ps = p.float().reshape(-1, n, nb * ns, MMA_K).transpose(1, 2).reshape(-1, n, MMA_K)  # [G*nb*ns, n, 32]
    vs = v.float().reshape(-1, nb * ns, MMA_K, D).reshape(-1, MMA_K, D)
    part = torch.bmm(ps, vs).reshape(*lead, nb, ns, n, D)
    acc = truncate_mantissa(part[..., 0, :, :], bits)
    for i in range(1, ns):
        acc = truncate_mantissa(acc + part[..., i, :, :], bits)
    return acc


def online_combine(block_sums: torch.Tensor, m_blocks: torch.Tensor) -> torch.Tensor:
    """sum_j 2^(m_j - m_last) block_sums_j: the fp32 accumulator after the kernel's per-block rescaling by
    alpha = 2^(m_old - m_new) (one fp32 product per block here; the kernel's chain of products differs by
    ~1e-7)."""
    w = torch.exp2(m_blocks - m_blocks[..., -1:]).float()  # [.., n, nb]
    return (block_sums * w.transpose(-1, -2).unsqueeze(-1)).sum(dim=-3).double()


def attention(sq: Sage2Quant, *, rows: Optional[torch.Tensor] = None, chunk: int = 256,
              acc_bits: int = ACC_MANTISSA_BITS, return_parts: bool = False):
    """SageAttention2 output for query ``rows`` (all when None): fp32 [B, H, n, D].

    ``return_parts``: also a dict with ``p_eff`` (the effective probabilities the kernel applied to V_q,
    [B, H, n, Sk]: P8 2^(m_j - m) / l) and ``v_eff`` (V_q = v8 v_scale, [B, H, Sk, D]) for error
    decompositions (memory: n x Sk per head)."""
    B, H, S, D = sq.q8.shape
    Sk = sq.k8.shape[2]
    idx = torch.arange(S, device=sq.q8.device) if rows is None else rows
    nb = (Sk + K_BLOCK - 1) // K_BLOCK
    pad = nb * K_BLOCK - Sk
    v8 = torch.nn.functional.pad(sq.v8.float(), (0, 0, 0, pad))
    outs, peffs = [], []
    for i0 in range(0, idx.numel(), chunk):
        r = idx[i0:i0 + chunk]
        s = torch.nn.functional.pad(logits(sq, r), (0, pad), value=float("-inf"))
        sb = s.unflatten(-1, (nb, K_BLOCK))  # [B, H, n, nb, 128]
        m = torch.cummax(sb.amax(dim=-1), dim=-1).values  # running max after each block [B, H, n, nb]
        p = torch.exp2(sb - m.unsqueeze(-1) + S_FP8_OFFSET)  # fp32, row max -> 448
        l = (p.double().sum(-1) * torch.exp2((m - m[..., -1:]).double())).sum(-1)  # fp32 P sums (unrounded)
        p8 = p.clamp(max=FP8_MAX).to(FP8_DTYPE).float().flatten(-2)
        acc = online_combine(fp22_block_sums(p8, v8, bits=acc_bits), m)
        outs.append((acc * sq.v_scale.unsqueeze(2).double() / l.unsqueeze(-1)).float())
        if return_parts:
            w = torch.exp2((m - m[..., -1:]).double()).repeat_interleave(K_BLOCK, -1)
            peffs.append((p8.double() * w / l.unsqueeze(-1))[..., :Sk].float())
    out = torch.cat(outs, dim=2)
    if not return_parts:
        return out
    return out, {"p_eff": torch.cat(peffs, dim=2), "v_eff": sq.v8.float() * sq.v_scale.unsqueeze(2)}


def sage2_attention(q, k, v, *, sm_scale: Optional[float] = None, smooth_q: bool = True,
                    rows: Optional[torch.Tensor] = None, out_dtype=torch.float32):
    """Convenience: quantise and attend. Returns [B, H, n, D] in ``out_dtype``."""
    return attention(quantize(q, k, v, sm_scale=sm_scale, smooth_q=smooth_q), rows=rows).to(out_dtype)
