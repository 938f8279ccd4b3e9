"""Reference token-gather sparse attention with 8-bit QK (``qk_format="fp8"``).

Oracle of ``vc_compile/kernels/sparse_attn.py`` with ``qk_format="fp8"``. ``reference/sparse_attn.py``
is the 16-bit contract and stays frozen; this module only quantises Q and K and calls it.

Notation
--------
Q scale     one per query group tile: ``amax`` over the group's C rows x D channels (rows taken in
            sigma order; the partial last group uses only its real rows) / 448.
K scale     one per key token: ``amax`` over its D channels / 448.
codes       E4M3 (``torch.float8_e4m3fn``), ``clamp(x / scale, -448, 448)`` rounded to nearest even;
            an all-zero block gets scale 1 (``torch_ops.safe_scale``).
PV          unchanged: V stays in its 16-bit type (the kernel feeds P in V's dtype to the MMA).
The logits are ``(q_codes . k_codes) * q_scale * k_scale * sm_scale * log2(e)``, i.e. the 16-bit
reference run on the dequantised Q and K.
"""
from __future__ import annotations

from typing import Optional

import torch

from vc_compile.formats import FP8_MAX
from vc_compile.torch_ops import gather_rows, safe_scale

from .quant import expand_blocks, quantize_fp8
from .sparse_attn import sparse_attention


def quantize_q_groups(q: torch.Tensor, sigma: torch.Tensor, group_size: int):
    """Q [B, H, S, D] -> (codes in sigma order [B, H, S, D], scale per group [B, H, G])."""
    B, H, S, D = q.shape
    C = group_size
    G = (S + C - 1) // C
    qs = gather_rows(q.float(), sigma)
    amax = torch.nn.functional.pad(qs.abs().amax(-1), (0, G * C - S)).unflatten(-1, (G, C)).amax(-1)
    scale = safe_scale(amax, FP8_MAX)
    codes = quantize_fp8(qs, expand_blocks(scale, C, S).unsqueeze(-1))
    return codes, scale


def quantize_k_tokens(k: torch.Tensor):
    """K [B, H, Sk, D] -> (codes [B, H, Sk, D], scale [B, H, Sk])."""
    scale = safe_scale(k.float().abs().amax(-1), FP8_MAX)
    return quantize_fp8(k.float(), scale.unsqueeze(-1)), scale


def dequantized_qk(q, k, sigma, group_size: int):
    """Q and K after the FP8 round trip, fp32, Q back in the original query order."""
    qc, qscale = quantize_q_groups(q, sigma, group_size)
    qd_sorted = qc.float() * expand_blocks(qscale, group_size, q.shape[2]).unsqueeze(-1)
    qd = torch.empty_like(qd_sorted)
    qd.scatter_(2, sigma.long().unsqueeze(-1).expand_as(qd_sorted), qd_sorted)
    kc, kscale = quantize_k_tokens(k)
    return qd, kc.float() * kscale.unsqueeze(-1)


def sparse_attention_q8(q, k, v, sigma, idx, *, sm_scale: float, group_size: int,
                        residual: Optional[torch.Tensor] = None, out_dtype=None, flag=None, run: int = 1,
                        res_scale: Optional[torch.Tensor] = None):
    qd, kd = dequantized_qk(q, k, sigma, group_size)
    return sparse_attention(qd, kd, v, sigma, idx, sm_scale=sm_scale, group_size=group_size,
                            residual=residual, out_dtype=out_dtype or q.dtype, flag=flag, run=run,
                            res_scale=res_scale)


# ---- 8-bit QK of the sm_90 gather kernel (``kernels/sparse_attn_sm90.py`` with int8 K codes) ----
# Q: INT8 codes, one scale per query row, amax / 127, codes = round-to-nearest-even(q x (127 / amax)) (the kernel's
# reciprocal is not IEEE: a code at an exact tie may differ by one). K: smoothed (token mean per head and channel
# subtracted, which softmax ignores), INT8 codes with ONE scale per head. Logits = (q_codes . k_codes) x q_scale x
# k_scale x sm_scale: the 16-bit reference run on the dequantised Q and K (fp32).

def quantize_k_int8_head(k: torch.Tensor):
    """K [B, H, Sk, D] -> (codes int8, scale [B, H] fp32): mean = the token mean per head and channel, amax = the
    largest |k - mean|, scale = amax / 127 (1 for a constant head), codes = round((k - mean) x 127 / amax)."""
    kf = k.float()
    mean = kf.mean(2, keepdim=True)
    km = kf - mean
    amax = km.abs().amax((2, 3))
    ok = amax > 0
    scale = torch.where(ok, amax / 127.0, torch.ones_like(amax))
    inv = torch.where(ok, 127.0 / torch.where(ok, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    codes = torch.round(km * inv[:, :, None, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def quantize_q_int8_rows(q: torch.Tensor):
    """Q [B, H, S, D] -> (codes as fp32 [B, H, S, D], scale [B, H, S, 1]): one scale per row, amax / 127 (1 for an
    all-zero row)."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    ok = amax > 0
    scale = torch.where(ok, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(qf * (127.0 / torch.where(ok, amax, torch.ones_like(amax))))
    return codes, scale


def sparse_attention_qk8(q, k_codes, k_scale, v, sigma, idx, *, sm_scale, group_size, residual=None,
                         out_dtype=None, flag=None, run: int = 1, res_scale=None):
    """The sm_90 gather kernel's 8-bit-QK contract: ``q`` 16-bit (quantised per row here, as in the kernel),
    ``k_codes`` / ``k_scale`` from ``quantize_k_int8_head``; the 16-bit reference on the dequantised Q and K."""
    qc, qs = quantize_q_int8_rows(q)
    kd = k_codes.float() * k_scale.float()[:, :, None, None]
    return sparse_attention(qc * qs, kd, v.float(), sigma, idx, sm_scale=sm_scale, group_size=group_size,
                            residual=residual, out_dtype=out_dtype or q.dtype, flag=flag, run=run,
                            res_scale=res_scale)
