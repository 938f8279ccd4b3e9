"""Attention inputs for the fidelity studies (tests/fidelity_decompose.py, tests/test_fidelity_*.py).

Every builder returns (q, k, v) as [B, H, S, D] bf16 tensors (the model's dtype), deterministic per seed.

* ``structured``: benchmarks/bench_vsmooth_attn.py's inputs (channel-biased K, V from 64 centres scattered over
  the tokens + 1% token outliers x12) -- the benchmark's fidelity rows.
* ``video``: tokens on a (frames x height x width) latent grid with Wan's 3D RoPE (D split 44/42/42 for
  D = 128): q = c + n_q, k = c + n_k, so q . k = |c|^2 * (a kernel of the 3D offset, peaked at 0) + content
  noise. ``peak`` (base-2 units) is the logit of a token against itself above the far field; the far field has
  the content noise (std ``noise`` base-2 units). More tokens at the same frames -> the same local peak and a
  far field that grows with S: attention gets more diffuse with S, as between Wan's 480p (32760 tokens = 21
  x 30 x 52) and 720p (75600 = 21 x 45 x 80) latents. ``frames`` = 21 by default, height x width ~ 9:16.
  V: a smooth spatio-temporal field (the values of nearby tokens alike, a per-region mean) + noise + per-token
  outliers (``outliers``: fraction of tokens; each gets 4-16 random channels x ``outlier_gain``): they follow
  no fixed channel and no fixed position (the paper's value statistics, SPEC 3.2).
* ``value_dominated``: the paper's value statistics with a large per-channel offset: V = ``v_bias`` x (a
  per-channel offset common to the head's tokens) + the smooth field + noise + per-token outliers in random
  channels (2%, x20), and a moderately peaked attention, so that the value term P_q (V - V_q) dominates the
  output error of a per-channel FP8 V (Sage2's: >= 80%) -- the regime of the paper's Wan 2.2 measurement
  (82% of the error in that term).
* ``far_field``: a synthetic of the video family's mechanism for unit tests (a few keys per query ``gap``
  octaves above all others).
* ``gaussian``: q, k, v ~ N(0, 1) (the benign case).
"""
from __future__ import annotations

import math

import torch


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def grid_shape(S: int, frames: int = 21):
    """(T, Y, X) with T * Y * X >= S, T = frames (fewer for short sequences), Y : X ~ 9 : 16."""
    T = max(1, min(frames, S // 256))
    per = math.ceil(S / T)
    Y = max(1, round(math.sqrt(per * 9 / 16)))
    X = math.ceil(per / Y)
    return T, Y, X


def positions(S: int, frames: int = 21) -> torch.Tensor:
    """[S, 3] (t, y, x) integer coordinates of the first S tokens of the grid, row-major."""
    T, Y, X = grid_shape(S, frames)
    t, y, x = torch.meshgrid(torch.arange(T), torch.arange(Y), torch.arange(X), indexing="ij")
    return torch.stack([t, y, x], -1).reshape(-1, 3)[:S].double()


def rope_3d(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Wan-style 3D RoPE of x [B, H, S, D] (fp64): D split (D - 4 (D // 6), 2 (D // 6), 2 (D // 6)) channels
    for (t, y, x), each part rotated in pairs by pos * theta^(-2 i / d)."""
    D = x.shape[-1]
    dh = 2 * (D // 6)
    parts = (D - 2 * dh, dh, dh)
    out, c0 = [], 0
    for axis, d in enumerate(parts):
        xs = x[..., c0:c0 + d]
        freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos[:, axis:axis + 1] * freqs  # [S, d/2]
        cos, sin = torch.cos(ang), torch.sin(ang)
        a, b = xs[..., 0::2], xs[..., 1::2]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
        out.append(rot)
        c0 += d
    return torch.cat(out, -1)


def smooth_field(pos: torch.Tensor, H: int, D: int, g, modes: int = 12, scale=(3.0, 8.0, 8.0)) -> torch.Tensor:
    """A random spatio-temporal field [1, H, S, D]: ``modes`` low-frequency Fourier modes of the position with
    random channel loadings (nearby tokens alike; every channel varies over the video)."""
    S = pos.shape[0]
    w = torch.randn(H, modes, 3, generator=g, dtype=torch.float64) / torch.tensor(scale, dtype=torch.float64)
    ph = 2 * math.pi * torch.rand(H, modes, 1, generator=g, dtype=torch.float64)
    basis = torch.cos(torch.einsum("hmc,sc->hms", w, pos) + ph)  # [H, modes, S]
    load = torch.randn(H, modes, D, generator=g, dtype=torch.float64) / math.sqrt(modes)
    return torch.einsum("hms,hmd->hsd", basis, load).unsqueeze(0) * math.sqrt(2.0)


def token_outliers(B, H, S, D, g, frac: float, gain: float) -> torch.Tensor:
    """Per-token outliers: a fraction ``frac`` of the tokens (any position), each with 4-16 channels (any
    channel, different per token) of N(0, gain^2)."""
    hit = torch.rand(B, H, S, 1, generator=g) < frac
    nch = torch.randint(4, 17, (B, H, S, 1), generator=g)
    rank = torch.rand(B, H, S, D, generator=g).argsort(-1).argsort(-1)
    chans = rank < nch
    return (hit & chans).double() * gain * torch.randn(B, H, S, D, generator=g, dtype=torch.float64)


def structured(S, D=128, H=2, seed=0):
    g = _gen(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = 1.5 * r(1, S, H, D)
    k = r(1, S, H, D) + 3.0 * r(1, 1, H, D)
    centers = 2.0 * r(H, 64, D)
    lab = torch.randint(0, 64, (1, S, H), generator=g)
    v = centers[torch.arange(H).view(1, 1, H), lab] + 0.4 * r(1, S, H, D)
    out = torch.rand(1, S, H, 1, generator=g) < 0.01
    v = v + out * 12.0 * r(1, S, H, D)
    return [t.bfloat16().permute(0, 2, 1, 3).contiguous() for t in (q, k, v)]


def video(S, D=128, H=2, seed=0, *, peak=18.0, noise=2.0, frames=21, v_mean=3.0, outliers=0.01,
          outlier_gain=10.0, v_bias=0.0):
    """See the module doc. ``peak`` and ``noise`` in base-2 logit units."""
    g = _gen(seed)
    pos = positions(S, frames)
    sm = D ** -0.5
    # |c|^2 sm log2 e = peak; content noise: n_q . n_k sm log2 e ~ N(0, noise^2) with |n_q| = |n_k|
    c = torch.randn(1, H, 1, D, generator=g, dtype=torch.float64)
    c = c / c.norm(dim=-1, keepdim=True) * math.sqrt(peak / (sm * math.log2(math.e)))
    ns = math.sqrt(noise / (sm * math.log2(math.e) * math.sqrt(D)))
    nq = ns * torch.randn(1, H, S, D, generator=g, dtype=torch.float64)
    nk = ns * torch.randn(1, H, S, D, generator=g, dtype=torch.float64)
    kb = 2.0 * torch.randn(1, H, 1, D, generator=g, dtype=torch.float64)  # a channel bias on K (smoothed away)
    q = rope_3d(c + nq, pos)
    k = rope_3d(c + nk, pos) + kb
    v = v_mean * smooth_field(pos, H, D, g) + torch.randn(1, H, S, D, generator=g, dtype=torch.float64)
    v = v + token_outliers(1, H, S, D, g, outliers, outlier_gain)
    if v_bias:  # a per-channel offset common to all tokens of the head (drawn after, so the rest is unchanged)
        v = v + v_bias * torch.randn(1, H, 1, D, generator=g, dtype=torch.float64)
    return [t.bfloat16().contiguous() for t in (q, k, v)]


def value_dominated(S, D=128, H=2, seed=0, *, peak=10.0, noise=2.0, v_mean=3.0, v_bias=8.0, outliers=0.02,
                    outlier_gain=20.0):
    """Video-like attention (a moderate local peak) on values with a per-channel offset ``v_bias`` common to
    all tokens (x a N(0, 1) per channel), a smooth field, and per-token outliers in random channels (module
    doc): the output error of a per-channel FP8 V (Sage2's) is then mostly the value term (>= 80% with the
    defaults, as the paper reports for Wan 2.2), which V-Smooth's block means remove."""
    return video(S, D, H, seed, peak=peak, noise=noise, v_mean=v_mean, outliers=outliers,
                 outlier_gain=outlier_gain, v_bias=v_bias)


def far_field(S, D=128, H=2, seed=0, *, group=4, gap=16.0, v_gain=3.0):
    """Each token belongs to a group of ``group`` tokens (random positions) sharing a random unit direction u_g:
    q = k = a u_g (a^2 sm log2 e = ``gap``), so a query sees its group ``gap`` octaves above every other key, and
    the other keys spread as N(-gap, (gap / sqrt(D))^2) (random directions' dot products). The far field's
    mass grows with S: the mechanism of the video family in a few thousand tokens (unit tests).
    V: ``v_gain`` x a random vector per group + N(0, 1)."""
    g = _gen(seed)
    ng = (S + group - 1) // group
    lab = torch.randperm(S, generator=g) % ng
    sm = D ** -0.5
    a = math.sqrt(gap / (sm * math.log2(math.e)))
    u = torch.randn(1, H, ng, D, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True)
    x = a * u[:, :, lab]
    q = x + 0.05 * torch.randn(1, H, S, D, generator=g, dtype=torch.float64)
    k = x + 0.05 * torch.randn(1, H, S, D, generator=g, dtype=torch.float64)
    vc = v_gain * torch.randn(1, H, ng, D, generator=g, dtype=torch.float64)
    v = vc[:, :, lab] + torch.randn(1, H, S, D, generator=g, dtype=torch.float64)
    return [t.bfloat16().contiguous() for t in (q, k, v)]


def gaussian(S, D=128, H=2, seed=0):
    g = _gen(seed)
    return [torch.randn(1, H, S, D, generator=g).bfloat16() for _ in range(3)]


FAMILIES = {"structured": structured, "video": video, "value_dominated": value_dominated, "far_field": far_field,
            "gaussian": gaussian}
