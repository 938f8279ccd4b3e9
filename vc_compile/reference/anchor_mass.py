"""Reference MC-Sparse pass 2 on the 8-bit preprocessed Q/K ("cheap anchors"): group key masses
from the INT8 codes, scales and LSE that the 8-bit V-Smooth attention consumed and returned in pass 1.

Oracle of ``vc_compile/kernels/anchor_mass.py``.

Notation
--------
qk          ``formats.QKQuant`` of pass 1: q8 [B, H, S, D] int8, q_scale [B, H, S] (per token,
            ``sm_scale * log2 e`` folded in), k8 [B, H, Sk, D] int8 in KEY ORDER pi (rows ``k8[t] =
            K_smoothed[pi[t]]``), k_scale [B, H, ceil(Sk/64)] per 64 rows of k8.
pi          ``key_perm`` [B, H, Sk] int64 (the V-Smooth cluster order that pass 1 ran with) or None.
s~_it       ``(q8_i . k8_t) * k_scale(t)``: the K-scaled INT8 score; the smoothed base-2 logit is
            ``qs_i * s~_it``.
lse_s       [B, H, S] fp32: pass 1's base-2 LSE of the SMOOTHED logits (``vsmooth_attention(return_lse=True)``).
            K smoothing shifts every logit of row i by the same ``q_i . k_mean``, so
            ``p_it = 2^(qs_i s~_it - lse_s_i)`` is row i's softmax probability of key pi[t] -- exact up to the
            8-bit rounding of q and k (and pass 1's FP8 rounding of the row sum inside lse_s).
sigma, C    PDDP query order [B, H, S] and group size; group g = queries ``sigma[g*C:(g+1)*C]``, G = ceil(S/C).
mass        [B, H, G, Sk] (fp32 or bf16) in ORIGINAL key order: ``mass[g, pi[t]] = sum_{i in g} p_it``.
exp         how 2^x is formed:
            "exact"  torch.exp2 (the kernel: MUFU.EX2).
            "shift"  Schraudolph's exponent-field construction on the FMA/INT pipes: with the gap
                     x = qs s~ - lse (<= ~0), n = rne(2^13 (x + 127 - BETA)) clamped to >= 0 and the float
                     with bits ``n << 10`` -- i.e. 2^floor(y) * (1 + frac(y)), y = x - BETA, to 2^-13 in y.
                     (1 + f) / 2^f lies in [1, 1.0615]; BETA = log2 of its mean over f (0.05753) centres the
                     factor to [0.961, 1.020] so sums of many terms are unbiased. Below x ~ -127 the value is
                     a subnormal or 0 (ignorable against any kept mass).
"""
from __future__ import annotations

from typing import Optional

import torch

from vc_compile.formats import BLOCK_K, SHIFT_BETA, SHIFT_FRAC_BITS, QKQuant

from vc_compile.torch_ops import gather_rows

from .quant import expand_blocks

EXP_MODES = ("exact", "shift")


def shift_exp2(x: torch.Tensor) -> torch.Tensor:
    """The "shift" approximation of 2^x (fp32 in, fp32 out), as the kernel forms it from the same x."""
    n = torch.round((x.double() + (127.0 - SHIFT_BETA)) * (1 << SHIFT_FRAC_BITS))  # rne, like the FMA
    n = torch.nan_to_num(n, nan=0.0).clamp(0.0, float((1 << 21) - 1)).to(torch.int32)
    return (n << (23 - SHIFT_FRAC_BITS)).view(torch.float32)


def exp2_mode(x: torch.Tensor, exp: str) -> torch.Tensor:
    if exp == "exact":
        return torch.exp2(x)
    if exp == "shift":
        return shift_exp2(x)
    raise ValueError(f"exp must be one of {EXP_MODES}, got {exp!r}")


def scores_q8(qk: QKQuant, rows: torch.Tensor) -> torch.Tensor:
    """s~ [B, H, n, Sk] fp32 of the query rows ``rows`` [B, H, n] (k8 order), exact int products."""
    q = gather_rows(qk.q8.float(), rows)
    Sk = qk.k8.shape[2]
    ks = expand_blocks(qk.k_scale, BLOCK_K, Sk)
    # exact in fp32: every partial sum is an integer of magnitude <= D * 127^2 < 2^24 for D <= 1040 (so the
    # summation order does not matter); fp64 only for D above that
    wide = torch.float64 if q.shape[-1] * 127 * 127 >= 2 ** 24 else torch.float32
    dot = q.to(wide) @ qk.k8.to(wide).transpose(-1, -2)
    return (dot.double() * ks.double().unsqueeze(2)).float()


def group_key_mass_q8(qk: QKQuant, lse_s: torch.Tensor, sigma: torch.Tensor, *, group_size: int,
                      key_perm: Optional[torch.Tensor] = None, exp: str = "exact",
                      mass_dtype: torch.dtype = torch.float32, chunk_groups: Optional[int] = None) -> torch.Tensor:
    """mass [B, H, G, Sk] in original key order (see the module doc). ``chunk_groups`` query groups at a time
    (default: one group on a CPU -- 3x faster than 8 at S = 4096 on 2 cores -- and 8 on a GPU)."""
    if exp not in EXP_MODES:
        raise ValueError(f"exp must be one of {EXP_MODES}, got {exp!r}")
    B, H, S, _ = qk.q8.shape
    Sk = qk.k8.shape[2]
    C = int(group_size)
    G = (S + C - 1) // C
    chunk_groups = chunk_groups or (1 if qk.q8.device.type == "cpu" else 8)
    sig = sigma.long()
    qs = torch.gather(qk.q_scale.float(), 2, sig)
    ls = torch.gather(lse_s.float(), 2, sig)
    mass = torch.zeros(B, H, G, Sk, dtype=torch.float32, device=qk.q8.device)
    for g0 in range(0, G, chunk_groups):
        g1 = min(G, g0 + chunk_groups)
        r0, r1 = g0 * C, min(S, g1 * C)
        st = scores_q8(qk, sig[:, :, r0:r1])
        x = st * qs[:, :, r0:r1, None] - ls[:, :, r0:r1, None]
        p = exp2_mode(x, exp)
        n = r1 - r0
        pad = (g1 - g0) * C - n
        if pad:
            p = torch.nn.functional.pad(p, (0, 0, 0, pad))
        mass[:, :, g0:g1] = p.unflatten(2, (g1 - g0, C)).sum(dim=3)
    if key_perm is not None:  # column t of k8 is key pi[t]
        out = torch.empty_like(mass)
        out.scatter_(3, key_perm.long().unsqueeze(2).expand_as(mass), mass)
        mass = out
    return mass.to(mass_dtype)


def lse_q8(qk: QKQuant, chunk: int = 1024) -> torch.Tensor:
    """[B, H, S] exact base-2 LSE of the smoothed 8-bit logits ``qs_i s~_it`` (fp64 sums): what pass 1's LSE
    approximates (it sums FP8-rounded probabilities). For tests that isolate pass 2 from pass 1."""
    B, H, S, _ = qk.q8.shape
    out = torch.empty(B, H, S, dtype=torch.float32, device=qk.q8.device)
    rows = torch.arange(S, device=qk.q8.device).expand(B, H, S)
    for i0 in range(0, S, chunk):
        i1 = min(S, i0 + chunk)
        s = scores_q8(qk, rows[:, :, i0:i1]).double() * qk.q_scale[:, :, i0:i1, None].double()
        out[:, :, i0:i1] = (torch.logsumexp(s * 0.6931471805599453, dim=-1) * 1.4426950408889634).float()
    return out


def anchor_select_q8(qk: QKQuant, lse_s: torch.Tensor, sigma: torch.Tensor, *, group_size: int, keep: int,
                     key_perm: Optional[torch.Tensor] = None, exp: str = "exact",
                     mass_dtype: torch.dtype = torch.float32, max_mass_bytes: int = 1 << 30,
                     run: int = 1) -> torch.Tensor:
    """idx [B, H, G, keep] int32 ascending: pass 2 + top-K (``reference.topk``), a chunk of heads at a time;
    ``run`` > 1: [B, H, G, keep / run], the top runs of ``run`` keys by their summed masses."""
    from vc_compile.torch_ops import run_mass

    from .topk import select_topk

    B, H, S, _ = qk.q8.shape
    Sk = qk.k8.shape[2]
    G = (S + group_size - 1) // group_size
    hc = max(1, min(H, max_mass_bytes // max(1, B * G * Sk * 4)))
    parts = []
    for h0 in range(0, H, hc):
        sl = slice(h0, h0 + hc)
        sub = QKQuant(qk.q8[:, sl], qk.q_scale[:, sl], qk.k8[:, sl], qk.k_scale[:, sl], qk.k_mean[:, sl],
                      qk.sm_scale)
        mass = group_key_mass_q8(sub, lse_s[:, sl], sigma[:, sl], group_size=group_size,
                                 key_perm=None if key_perm is None else key_perm[:, sl], exp=exp,
                                 mass_dtype=mass_dtype)
        parts.append(select_topk(run_mass(mass, run), keep // run))
    return torch.cat(parts, dim=1)
