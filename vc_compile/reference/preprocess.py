"""Reference preprocessing (docs/methods.md, Preprocessing): K smoothing, Hadamard, per-block Q/K quantisation, V-Smooth.

This is the oracle of ``vc_compile/kernels/preprocess.py``; both return the same named tuples.

Notation (the fields of QKQuant / VQuant, the tile constants and the "sm90" layout: ``vc_compile/formats.py``)
--------
B, H, S, D      batch, heads, tokens, head dim; inputs are [B, H, S, D] (any strides).
perm            [B, H, S] int64 key/value permutation (the V-Smooth cluster order), or None = identity.
q_scale         one per query token. Why per token: with one scale per 128 tokens, a query 100x its
                neighbours' norm sets the scale of all 128 and rounds their codes to a few levels, flattening
                their logits (error 0.28 vs 0.04, tests/test_hostile.py). Per token costs S floats per head
                and, in the attention kernel, nothing per score (the row scale folds into the FMA of the exp2
                argument). ``preprocess_qk(q_block=128)`` emulates the old per-128 scales (still [B, H, S]).
rope            None, or a ``formats.RopeArgs``: q and k are un-rotated and the RoPE is applied
                first (fp32, rounded once to the input dtype, like the models; prologue fusion).
k_mean          the mean removed from K, over a sample of the tokens (``k_mean_mask``). Softmax ignores any
                vector removed from every key, so only the quantisation range depends on it; the sample
                spares the kernels a full second read of K (12% of K at S = 32760, 5% at 75600).

Non-finite inputs (NaN/Inf; propagated like SDPA, never rounded away, never into another (b, h)):
* Q row i non-finite          -> q_scale[b, h, i] = NaN: output row i NaN (SDPA: row i NaN).
* any K element non-finite    -> k_mean non-finite -> every q_scale of the head NaN (and the K blocks'
                                 scales): the whole (b, h) output NaN. SDPA: all NaN for a NaN; for
                                 +-Inf NaN on the rows whose logit is +Inf and finite elsewhere -- we
                                 give NaN on every row of the head (the K mean smooths Inf into all keys).
* V element (t, d) non-finite -> v_scale[b, h, d] = NaN (and the block mean): column d of every output
                                 row NaN (SDPA: column d NaN for NaN, +-Inf for Inf).
Codes: Q/K rows/blocks holding a non-finite value get all-zero codes (``quant.quantize_blocks``); V
channels get the codes of their finite part (non-finite values replaced by 0, ``quant.finite_part``);
the scale is made NaN either way.
"""
from __future__ import annotations

from typing import Optional

import torch

from vc_compile.formats import (BLOCK_K, BLOCK_Q, BLOCK_V, FP8_MAX, LOG2E, QKQuant, VQuant, hadamard_matrix,
                                k_mean_stride, natural_layout)

from vc_compile.torch_ops import safe_scale

from .quant import expand_blocks, finite_part, flush_tiny, poison, quantize_blocks, quantize_fp8_rcp


def apply_perm(x: torch.Tensor, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows of [B, H, S, D] in the order ``perm`` ([B, H, S]): out[..., t, :] = x[..., perm[t], :]."""
    if perm is None:
        return x
    return torch.gather(x, 2, perm.long().unsqueeze(-1).expand(*perm.shape, x.shape[-1]))


def k_mean_mask(S: int, device=None) -> torch.Tensor:
    """[S] bool: the tokens whose mean is removed from K (see ``k_mean`` in the module doc)."""
    t = torch.arange(S, device=device)
    return (t // BLOCK_K) % k_mean_stride(S) == 0


def preprocess_qk(q, k, perm=None, *, sm_scale: float, hadamard: bool = False,
                  qk_format: str = "int8", q_block: int = BLOCK_Q, rope=None) -> QKQuant:
    """``q_block``: tokens sharing one Q scale (default 1 = per token). Larger values emulate coarser
    scales (tests, accuracy studies); q_scale is [B, H, S] either way (repeated within a block).
    ``rope``: q and k arrive un-rotated; the RoPE is applied first (torch_ops.apply_rope)."""
    if rope is not None:  # prologue RoPE (torch_ops.apply_rope): q, k arrive un-rotated
        from vc_compile.torch_ops import apply_rope

        q, k = apply_rope(q, rope), apply_rope(k, rope)
    qf = q.float()
    kf = k.float()
    k_mean = kf[:, :, k_mean_mask(kf.shape[2], kf.device)].mean(dim=2)
    kf = kf - k_mean.unsqueeze(2)
    if hadamard:
        Hd = hadamard_matrix(q.shape[-1], device=q.device)
        qf = qf @ Hd
        kf = kf @ Hd
    kf = apply_perm(kf, perm)
    q8, q_scale = quantize_blocks(qf, q_block, qk_format)
    q_scale = expand_blocks(q_scale, q_block, q.shape[2])
    # a non-finite K element makes k_mean non-finite, hence every smoothed key: all logits of the head
    k_bad = ~torch.isfinite(k_mean).all(dim=-1, keepdim=True)  # [B, H, 1]
    q_scale = poison(q_scale, k_bad)
    k8, k_scale = quantize_blocks(kf, BLOCK_K, qk_format)
    return QKQuant(q8, q_scale * (sm_scale * LOG2E), k8, k_scale, k_mean, float(sm_scale))


def block_means(v: torch.Tensor, block: int = BLOCK_V) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, ceil(S/block), D] means over the valid rows of each block."""
    B, H, S, D = v.shape
    nb = (S + block - 1) // block
    pad = nb * block - S
    vp = torch.nn.functional.pad(v, (0, 0, 0, pad)) if pad else v
    sums = vp.unflatten(2, (nb, block)).sum(dim=3)
    counts = torch.full((nb,), float(block), device=v.device)
    counts[-1] = block - pad
    return sums / counts.view(1, 1, nb, 1)


def preprocess_v(v, perm=None, *, smooth: bool = True) -> VQuant:
    B, H, S, D = v.shape
    vf = apply_perm(v.float(), perm)
    nb = (S + BLOCK_V - 1) // BLOCK_V
    if smooth:
        mu = block_means(vf)
    else:
        mu = torch.zeros(B, H, nb, D, device=v.device)
    resid = vf - mu.repeat_interleave(BLOCK_V, dim=2)[:, :, :S]
    resid, bad = finite_part(resid)
    bad = bad.any(dim=2)  # [B, H, D] channels with a non-finite value
    amax = resid.abs().amax(dim=2)  # [B, H, D]
    amax, inv = flush_tiny(torch.where(bad, torch.zeros_like(amax), amax), FP8_MAX)
    v_scale = safe_scale(amax, FP8_MAX)  # (1 for a NaN channel: codes of its finite part, as the kernel)
    v8 = quantize_fp8_rcp(resid, inv.unsqueeze(2))
    v_scale = poison(v_scale, bad)
    S_pad = nb * BLOCK_V
    v8t = torch.zeros(B, H, D, S_pad, dtype=v8.dtype, device=v.device)
    v8t[..., :S] = v8.transpose(-1, -2)
    return VQuant(v8t, v_scale, mu, S, zero_mean=not smooth)


def preprocess(q, k, v, perm=None, *, sm_scale: float, hadamard: bool = False, qk_format: str = "int8",
               smooth: bool = True, rope=None):
    """(QKQuant, VQuant) of q, k, v: ``preprocess_qk`` and ``preprocess_v`` (V in the "natural" layout; the
    kernel may write the "sm90" one, the same codes in another key order)."""
    return (preprocess_qk(q, k, perm, sm_scale=sm_scale, hadamard=hadamard, qk_format=qk_format, rope=rope),
            preprocess_v(v, perm, smooth=smooth))


def dequantize_v(vq: VQuant) -> torch.Tensor:
    """The V' (permuted) that the attention kernel effectively multiplies by: fp32 [B, H, S, D]."""
    vq = natural_layout(vq)
    S = vq.S
    r = vq.v8t[..., :S].float().transpose(-1, -2) * vq.v_scale.unsqueeze(2)
    return r + vq.v_mean.repeat_interleave(BLOCK_V, dim=2)[:, :, :S]
