"""Reference preprocessing (SPEC 3.1): K smoothing, Hadamard, per-block Q/K quantisation, V-Smooth.

This is the oracle of ``vc_compile/templates/preprocess.py``; both return the same named tuples.

Notation
--------
B, H, S, D      batch, heads, tokens, head dim; inputs are [B, H, S, D] (any strides).
perm            [B, H, S] int64 key/value permutation (the V-Smooth cluster order), or None = identity.
BLOCK_Q         tokens per Q scale (1: one scale per query token, SPEC 3.1 step 4 "finer is allowed");
                BLOCK_K tokens per K scale (64);  BLOCK_V rows per V mean (128).
q8, k8          [B, H, S, D] int8 (or float8_e4m3fn when qk_format == "fp8"); k8 in *permuted* order.
q_scale         [B, H, S] fp32, one per query token, with ``sm_scale * log2(e)`` folded in, so
                ``(q8 . k8) * q_scale * k_scale`` is the base-2 logit. Why per token: with one scale per
                128 tokens, a query 100x its neighbours' norm sets the scale of all 128 and rounds their
                codes to a few levels, flattening their logits (error 0.28 vs 0.04,
                tests/test_hostile.py). Per token costs S floats per head and, in the attention kernel,
                nothing per score (the row scale folds into the FMA of the exp2 argument).
                ``preprocess_qk(q_block=128)`` emulates the old per-128 scales (still [B, H, S]).
k_scale         [B, H, ceil(S/BLOCK_K)] fp32 (blocks of the permuted K).
rope            None, or a ``reference.rope.RopeArgs``: q and k are un-rotated and the RoPE is applied
                first (fp32, rounded once to the input dtype, like the models; prologue fusion).
k_mean          [B, H, D] fp32, the mean removed from K (before rotation), taken over a SAMPLE of the
                tokens: every ``k_mean_stride(S)``-th 64-token block (all tokens up to S = 8191; at least
                K_MEAN_TOKENS = 4096 tokens, spread over the whole sequence). Softmax ignores any vector
                removed from every key, so only the quantisation range depends on it; the sample spares the
                kernels a full second read of K (12% of K at S = 32760, 5% at 75600). The
                log-sum-exp does depend on it: ``lse_true = lse_smoothed + (q . k_mean) * sm_scale``.
v8t             [B, H, D, S_pad] float8_e4m3fn: the residual ``V' - mu`` quantised, K-major (transposed),
                S_pad = ceil(S/BLOCK_V) * BLOCK_V, padded with zeros.
v_scale         [B, H, D] fp32 per-channel scale of the residual (over all tokens of the head).
v_mean          [B, H, ceil(S/BLOCK_V), D] fp32 block means ``mu_j`` of the permuted V (zeros when
                smoothing is off: then this is plain per-channel FP8 V, our "naive 8-bit").
layout          "natural" (v8t's columns in key order) or "sm90": within every BLOCK_V-column block, column c
                holds key ``sm90_key_order()[c]`` (the order in which the sm_90 kernel's register P~ meets the
                keys), and ``mu_prime`` / ``mu_groups`` hold that kernel's mean-term operands (below).
                ``natural_layout`` turns either into "natural"; the sm_90 preprocessing kernel writes "sm90"
                directly, so the attention needs no extra pass over V.
mu_prime        "sm90" only: [B*H*nb, D] fp32 ``v_mean / v_scale`` (the mean in units of v_scale).
mu_groups       "sm90" only: [B*H*ng*2*D, 8] fp32, ng = ceil(nb/8): per window of 8 blocks the tf32 hi part
                (low 13 mantissa bits cleared) and the lo part (mu' - hi) of mu'^T [D, 8], zero-padded.

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

from typing import NamedTuple, Optional

import torch

from .quant import (
    FP8_MAX,
    LOG2E,
    expand_blocks,
    finite_part,
    flush_tiny,
    hadamard_matrix,
    poison,
    quantize_blocks,
    quantize_fp8_rcp,
    safe_scale,
)

BLOCK_Q = 1
BLOCK_K = 64
BLOCK_V = 128
K_MEAN_TOKENS = 4096  # the K mean is taken over at least this many tokens (every st-th 64-token block)


class QKQuant(NamedTuple):
    q8: torch.Tensor
    q_scale: torch.Tensor
    k8: torch.Tensor
    k_scale: torch.Tensor
    k_mean: torch.Tensor
    sm_scale: float


class VQuant(NamedTuple):
    v8t: torch.Tensor
    v_scale: torch.Tensor
    v_mean: torch.Tensor
    S: int
    zero_mean: bool = False  # smooth=False: v_mean is all zeros and the attention kernels skip the mean term
    layout: str = "natural"  # or "sm90" (module doc)
    mu_prime: Optional[torch.Tensor] = None  # "sm90" only
    mu_groups: Optional[torch.Tensor] = None  # "sm90" only


V_LAYOUTS = ("natural", "sm90")


def sm90_key_order(BN: int = BLOCK_V) -> list:
    """c -> n: the key stored in column c of every BN-key block of a "sm90" v8t. The sm_90 kernel relabels the
    keys of its QK accumulator n = 32 a + 16 h + 8 i + 2 q + e (q = lane % 4) as c = 32 a + 16 h + 4 q + 2 i + e,
    which makes the accumulator's registers the PV MMA's register A operand without moving data."""
    order = []
    for c in range(BN):
        a, h, q, i, e = c // 32, (c // 16) % 2, (c // 4) % 4, (c // 2) % 2, c % 2
        order.append(32 * a + 16 * h + 8 * i + 2 * q + e)
    return order


def sm90_mean_groups(mu_prime: torch.Tensor) -> torch.Tensor:
    """mu' [BH, nb, D] fp32 -> ``mu_groups`` (module doc): per window of 8 blocks the hi and lo tf32 parts of
    mu'^T [D, 8]."""
    BH, nb, D = mu_prime.shape
    ng = -(-nb // 8)
    m = torch.nn.functional.pad(mu_prime, (0, 0, 0, ng * 8 - nb)).view(BH, ng, 8, D).transpose(-1, -2)
    hi = (m.contiguous().view(torch.int32) & -8192).view(torch.float32)
    return torch.stack((hi, m - hi), dim=2).contiguous().view(-1, 8)


def to_sm90_layout(vq: "VQuant") -> "VQuant":
    """A VQuant in the "sm90" layout (eager torch: a gather of v8t's columns, mu' and its groups); the
    sm_90 preprocessing writes this layout itself."""
    if vq.layout == "sm90":
        return vq
    B, H, D, S_pad = vq.v8t.shape
    nb = S_pad // BLOCK_V
    order = torch.tensor(sm90_key_order(), device=vq.v8t.device)
    v8t = vq.v8t.view(B, H, D, nb, BLOCK_V)[..., order].reshape(B, H, D, S_pad)
    mup = (vq.v_mean / vq.v_scale.unsqueeze(2)).contiguous()
    return vq._replace(v8t=v8t, layout="sm90", mu_prime=mup.view(-1, D),
                       mu_groups=sm90_mean_groups(mup.view(B * H, nb, D)))


def natural_layout(vq: "VQuant") -> "VQuant":
    """A VQuant whose v8t columns are in key order (the Triton kernel's and the reference's input)."""
    if vq.layout == "natural":
        return vq
    if vq.layout != "sm90":
        raise ValueError(f"VQuant.layout={vq.layout!r}; accepted: {V_LAYOUTS}")
    B, H, D, S_pad = vq.v8t.shape
    inv = torch.empty(BLOCK_V, dtype=torch.long)
    inv[torch.tensor(sm90_key_order())] = torch.arange(BLOCK_V)
    v8t = vq.v8t.view(B, H, D, S_pad // BLOCK_V, BLOCK_V)[..., inv.to(vq.v8t.device)].reshape(B, H, D, S_pad)
    return vq._replace(v8t=v8t, layout="natural", mu_prime=None, mu_groups=None)


def apply_perm(x: torch.Tensor, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows of [B, H, S, D] in the order ``perm`` ([B, H, S]): out[..., t, :] = x[..., perm[t], :]."""
    if perm is None:
        return x
    return torch.gather(x, 2, perm.long().unsqueeze(-1).expand(*perm.shape, x.shape[-1]))


def k_mean_stride(S: int) -> int:
    """Every ``st``-th 64-token block of K enters its mean (st = 1, all tokens, up to S = 8191)."""
    return max(1, S // K_MEAN_TOKENS)


def k_mean_mask(S: int, device=None) -> torch.Tensor:
    """[S] bool: the tokens whose mean is removed from K (see ``k_mean`` in the module doc)."""
    t = torch.arange(S, device=device)
    return (t // BLOCK_K) % k_mean_stride(S) == 0


def preprocess_qk(q, k, perm=None, *, sm_scale: float, hadamard: bool = False,
                  qk_format: str = "int8", q_block: int = BLOCK_Q, rope=None) -> QKQuant:
    """``q_block``: tokens sharing one Q scale (default 1 = per token). Larger values emulate coarser
    scales (tests, accuracy studies); q_scale is [B, H, S] either way (repeated within a block).
    ``rope``: q and k arrive un-rotated; the RoPE is applied first (reference/rope.py)."""
    if rope is not None:  # prologue RoPE (reference/rope.py): q, k arrive un-rotated
        from .rope import apply_rope

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


def dequantize_v(vq: VQuant) -> torch.Tensor:
    """The V' (permuted) that the attention kernel effectively multiplies by: fp32 [B, H, S, D]."""
    vq = natural_layout(vq)
    S = vq.S
    r = vq.v8t[..., :S].float().transpose(-1, -2) * vq.v_scale.unsqueeze(2)
    return r + vq.v_mean.repeat_interleave(BLOCK_V, dim=2)[:, :, :S]
