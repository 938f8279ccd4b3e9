"""The formats shared by the kernels (``kernels/``) and their references (``reference/``): tile and numeric
constants, the quantised-tensor records with their layouts, and the RoPE conventions of the op.

Both layers import this module and neither imports the other, so the oracle does not depend on the code it
checks. Nothing here computes attention: it says what the tensors passed between kernels hold. Plain Python and
torch, importable without Triton.

QKQuant / VQuant (``preprocess_qk`` / ``preprocess_v``; inputs [B, H, S, D])
--------
BLOCK_Q         tokens per Q scale (1: one scale per query token, docs/methods.md, Preprocessing step 4);
                BLOCK_K tokens per K scale (64);  BLOCK_V rows per V mean (128).
q8, k8          [B, H, S, D] int8 (or float8_e4m3fn when qk_format == "fp8"); k8 in *permuted* order.
q_scale         [B, H, S] fp32, one per query token, with ``sm_scale * log2(e)`` folded in, so
                ``(q8 . k8) * q_scale * k_scale`` is the base-2 logit (why per token: reference/preprocess.py).
k_scale         [B, H, ceil(S/BLOCK_K)] fp32 (blocks of the permuted K).
k_mean          [B, H, D] fp32, the mean removed from K (before rotation), taken over a SAMPLE of the
                tokens: every ``k_mean_stride(S)``-th 64-token block (all tokens up to S = 8191; at least
                K_MEAN_TOKENS = 4096 tokens, spread over the whole sequence). The log-sum-exp depends on it:
                ``lse_true = lse_smoothed + (q . k_mean) * sm_scale``.
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

Numeric constants: FP8 means E4M3 (max 448); P~ is the probability scaled so that the row maximum is
2^P_SCALE_LOG2 = 256; ExpCast writes ``c(u) = round(8 u + EXPCAST_OFFSET)``; MC-Sparse keeps keys in
KV_TILE = 64 tiles (``n_keep``); the "shift" exp of the cheap anchor uses SHIFT_FRAC_BITS / SHIFT_BETA
(reference/anchor_mass.py).
"""
from __future__ import annotations

import functools
import json
import math
from typing import NamedTuple, Optional

import torch

# ---- numeric constants ------------------------------------------------------------------------------------
LOG2E = 1.4426950408889634
INT8_MAX = 127.0
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
# P~ is the probability scaled so that the row maximum is 2^8 = 256 (docs/methods.md, ExpCast-FP8): every probability
# >= 2^-14 of the row max then lands in the normal E4M3 range.
P_SCALE_LOG2 = 8.0
# ExpCast: c(u) = clip(round(8 u + 8*8 + 56 + beta), 0, 120) with beta = -0.35, i.e. 8u + 119.65.
EXPCAST_OFFSET = 8.0 * P_SCALE_LOG2 + 56.0 - 0.35
SHIFT_FRAC_BITS = 13  # fractional bits of the exponent ("shift" exp): ulp of y = 2^-13
SHIFT_BETA = 0.05753274588978041  # log2 E_f[(1 + f) / 2^f], f ~ U[0, 1)

# ---- tile constants ---------------------------------------------------------------------------------------
BLOCK_Q = 1  # tokens per Q scale
BLOCK_K = 64  # tokens per K scale
BLOCK_V = 128  # rows per V mean = keys per V-Smooth key block of the attention kernels
K_MEAN_TOKENS = 4096  # the K mean is taken over at least this many tokens (every st-th 64-token block)
KV_TILE = 64  # MC-Sparse: keys are kept per group in multiples of this tile


# ---- quantised-tensor records -----------------------------------------------------------------------------
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
    # [B*H*nb, D] fp32 mu / v_scale: "sm90" always, "natural" where the preprocessing was asked for it
    mu_prime: Optional[torch.Tensor] = None
    mu_groups: Optional[torch.Tensor] = None  # "sm90" only


V_LAYOUTS = ("natural", "sm90")


class KMeansResult(NamedTuple):
    perm: torch.Tensor  # [B, H, S] int64
    centroids: torch.Tensor  # [B, H, K, D] fp32
    labels: torch.Tensor  # [B, H, S] int64


def k_mean_stride(S: int) -> int:
    """Every ``st``-th 64-token block of K enters its mean (st = 1, all tokens, up to S = 8191)."""
    return max(1, S // K_MEAN_TOKENS)


def n_keep(Sk: int, density: float, tile: int = KV_TILE) -> int:
    """Keys kept per group: round(density * Sk) rounded up to the KV tile, in [tile, Sk]."""
    k = int(round(density * Sk))
    k = tile * math.ceil(max(k, 1) / tile)
    return int(min(Sk, k))


def hadamard_matrix(D: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix H_D / sqrt(D) (symmetric, H @ H = I). D a power of 2."""
    if D <= 0 or D & (D - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head dim, got {D}")
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < D:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return (H / math.sqrt(D)).to(device=device, dtype=dtype)


# ---- the "sm90" layout of VQuant --------------------------------------------------------------------------
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
    return vq._replace(v8t=v8t, layout="natural", mu_groups=None)  # mu' is per block: the same in both orders


# ---- RoPE of the prologue fusion: the op-side conventions -------------------------------------------------
# When ``passes/rope_fuse.py`` folds a model's RoPE into ``vcattn::attention``, the op receives q and k
# *before* the rotation, in the model's own layout, plus the model's cos/sin tables and a spec (JSON):
#
#     {"form": "interleaved" | "rotate-half", "layout": "BSHD" | "BHSD" | "BSC", "heads": H,
#      "start": int | null, "stop": int | null, "pass": <rope_fuse.uuid()>}
#
# * ``interleaved``: pairs (2i, 2i+1), ``out = x*cos + rot(x)*sin`` with ``rot(x)[2i] = -x[2i+1]``,
#   ``rot(x)[2i+1] = x[2i]``. ``rotate-half``: pairs (i, i + D/2), ``rot(x) = cat([-x2, x1])``.
# * tables: cos/sin broadcast (from the right, like the model's own ``x * cos``) against the rotated
#   region in the source layout; their last dim is D ("full" table, one value per channel: HunyuanVideo,
#   LTX, CogVideoX, Cosmos) or D/2 for ``interleaved`` ("pair" table, one value per pair: Wan, SkyReels,
#   tests/tiny_dit.py). For ``BSC`` the channel dim C = H * D is split into heads like the model's
#   ``unflatten(2, (H, -1))`` that follows the rotation.
# * ``start``/``stop``: the rotated tokens (a Python slice along S, negative values from the end, None =
#   open); the other tokens pass through unrotated (CogVideoX's text head).
# The rotation itself (fp32, one rounding) is ``torch_ops.apply_rope``.
ROPE_FORMS = ("interleaved", "rotate-half")
ROPE_LAYOUTS = ("BSHD", "BHSD", "BSC")


class RopeSpec(NamedTuple):
    form: str
    layout: str
    heads: int
    start: Optional[int]
    stop: Optional[int]

    def to_json(self, pass_uuid: str = "") -> str:
        return json.dumps({"form": self.form, "layout": self.layout, "heads": self.heads, "start": self.start,
                           "stop": self.stop, "pass": pass_uuid}, sort_keys=True)


@functools.lru_cache(maxsize=256)
def parse_spec(s: str) -> RopeSpec:
    d = json.loads(s)
    spec = RopeSpec(d["form"], d["layout"], int(d["heads"]), d.get("start"), d.get("stop"))
    if spec.form not in ROPE_FORMS or spec.layout not in ROPE_LAYOUTS:
        raise ValueError(f"vcattn: bad RoPE spec {s!r} (form in {ROPE_FORMS}, layout in {ROPE_LAYOUTS})")
    return spec


class RopeArgs(NamedTuple):
    """What the kernels need: tables as [B, H, S_rot, Dc] views (stride 0 where broadcast), the form and
    the rotated token range [lo, hi) along S."""
    cos: torch.Tensor
    sin: torch.Tensor
    form: str
    lo: int
    hi: int

    def pair_table(self, D: int) -> bool:
        """One table value per pair (2i, 2i+1) (last dim D/2), else one per channel."""
        return self.cos.shape[-1] * 2 == D


def to_bhsd(x: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """The model's q/k in its layout -> the [B, H, S, D] view SDPA saw (no copy)."""
    if spec.layout == "BSHD":
        return x.permute(0, 2, 1, 3)
    if spec.layout == "BHSD":
        return x
    return x.unflatten(-1, (spec.heads, -1)).permute(0, 2, 1, 3)


def _table(t: torch.Tensor, spec: RopeSpec, B: int, H: int, S_rot: int, D: int) -> torch.Tensor:
    Dc = t.shape[-1]
    if spec.layout == "BSHD":
        return t.expand(B, S_rot, H, Dc).permute(0, 2, 1, 3)
    if spec.layout == "BHSD":
        return t.expand(B, H, S_rot, Dc)
    return t.expand(B, S_rot, Dc).unflatten(-1, (H, Dc // H)).permute(0, 2, 1, 3)


def rope_args(cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, shape) -> RopeArgs:
    """Normalise the model's tables for a [B, H, S, D] ``shape``; raises ValueError for tables that do not
    broadcast the way the kernels read them (the pass runs this on fake values before it fuses)."""
    B, H, S, D = shape
    lo, hi, step = slice(spec.start, spec.stop).indices(S)
    if step != 1 or hi <= lo:
        raise ValueError(f"empty or strided rotated token range {spec.start}:{spec.stop} of {S}")
    tabs = []
    for t in (cos, sin):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 1:
            raise ValueError("cos/sin are not floating-point tensors")
        Dc = t.shape[-1] if spec.layout != "BSC" else t.shape[-1] // H
        if spec.layout == "BSC" and t.shape[-1] % H:
            raise ValueError("a [B, S, C] table whose C is not split evenly into heads")
        if not (Dc == D or (Dc * 2 == D and spec.form == "interleaved")):
            raise ValueError(f"table last dim {t.shape[-1]} is neither D={D} nor (interleaved) D/2")
        try:
            tabs.append(_table(t, spec, B, H, hi - lo, D))
        except RuntimeError as e:
            raise ValueError(f"table of shape {tuple(t.shape)} does not broadcast: {e}") from None
    if tabs[0].shape != tabs[1].shape:
        raise ValueError("cos and sin tables differ in shape")
    return RopeArgs(tabs[0], tabs[1], spec.form, lo, hi)
