"""Synthetic video data: moving, textured, occluding sprites, generated on the fly from a seed.

A clip has 2 or 3 sprites (circle, square, triangle, diamond) of distinct colours over a static
textured background. Each sprite moves at constant speed in the direction its conditioning token
names (right, left, down, up), wrapping around the frame edges (a torus, so it stays visible), and
carries a stripe texture in its own coordinates, so the texture moves with it. Sprites are drawn back
to front in slot order, so later slots occlude earlier ones; the conditioning token of slot i
describes sprite i (see ``model.SpriteTextEncoder``).

Determinism: all random parameters come from a CPU ``torch.Generator`` seeded with ``seed``, then the
clips are rendered with plain tensor math on the requested device. The same seed gives the same
parameters on every machine and the same pixels up to float rounding of the device.
Sizes and speeds scale with ``min(height, width)`` (tuned at 32 x 32: radius 5-8 px, 0.6-1.4 px/frame).
"""
from __future__ import annotations

import functools
import math

import torch

from .model import COLOUR_RGB, COLOURS, DIRECTION_XY, DIRECTIONS, SHAPES

_RGB = torch.tensor([COLOUR_RGB[c] for c in COLOURS])            # [8, 3]
_DXY = torch.tensor([DIRECTION_XY[d] for d in DIRECTIONS])       # [4, 2]


def sample_params(seed: int, batch: int, max_sprites: int = 3, camera: bool = False) -> dict:
    """All random choices of a batch (CPU tensors), as fractions of the frame size.

    ``camera``: also a camera pan per clip (``"camera"``, drawn from a second generator so the other choices
    of a seed stay the same): 0.2-0.8 px / frame at size 32 in a random direction, still in 30% of the clips.
    """
    g = torch.Generator().manual_seed(int(seed))
    B, N = batch, max_sprites
    extra = {}
    if camera:
        gc = torch.Generator().manual_seed(int(seed) ^ 0x5EED_CA3E)
        ang = 2 * math.pi * torch.rand(B, generator=gc)
        speed = (0.2 + 0.6 * torch.rand(B, generator=gc)) / 32 * (torch.rand(B, generator=gc) >= 0.3)
        extra["camera"] = torch.stack([torch.cos(ang), torch.sin(ang)], -1) * speed[:, None]

    def u(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    n_sprites = torch.randint(2, N + 1, (B,), generator=g) if N >= 2 else torch.ones(B, dtype=torch.long)
    return {
        "present": torch.arange(N)[None] < n_sprites[:, None],                       # [B, N]
        "colour": torch.argsort(torch.rand(B, len(COLOURS), generator=g), 1)[:, :N],  # distinct
        "shape": torch.randint(0, len(SHAPES), (B, N), generator=g),
        "direction": torch.randint(0, len(DIRECTIONS), (B, N), generator=g),
        "radius": u(B, N, lo=0.16, hi=0.25),
        "pos": u(B, N, 2),                      # start centre (x, y), fraction of (W, H)
        "speed": u(B, N, lo=0.6 / 32, hi=1.4 / 32),
        "tex_angle": u(B, N, hi=math.pi), "tex_freq": u(B, N, lo=1.5, hi=3.5), "tex_phase": u(B, N, hi=6.3),
        "tex_amp": u(B, N, lo=0.15, hi=0.35),
        "bg": u(B, 3, lo=-0.9, hi=-0.3),
        "bg_wave": u(B, 2, 2, lo=-1.0, hi=1.0),  # two wave vectors, in cycles per 16 px at size 32
        "bg_phase": u(B, 2, hi=6.3), "bg_amp": u(B, 2, lo=0.04, hi=0.12),
        **extra,
    }


def tokens_from_params(p: dict) -> torch.Tensor:
    """Conditioning tokens [B, N, 3] (colour, shape, direction; 1-based, 0 = absent sprite)."""
    toks = torch.stack([p["colour"].long() + 1, p["shape"].long() + 1, p["direction"].long() + 1], -1)
    return toks * p["present"].long()[..., None]


def params_to(p: dict, device) -> dict:
    """Move a parameter dict to ``device``. On CUDA: one pinned, non-blocking copy, because a copy
    from pageable memory synchronises the stream (the training loop would stall every iteration)."""
    device = torch.device(device)
    if device.type != "cuda" or any(v.device.type != "cpu" for v in p.values()):
        return {k: v.to(device) for k, v in p.items()}
    keys = sorted(p)
    flat = torch.cat([p[k].reshape(-1).to(torch.float32) for k in keys]).pin_memory()
    flat = flat.to(device, non_blocking=True)
    out, o = {}, 0
    for k in keys:  # small ints and bools are exact in float32
        n = p[k].numel()
        out[k] = flat[o:o + n].view(p[k].shape).to(p[k].dtype)
        o += n
    return out


@functools.lru_cache(maxsize=8)
def _tables(device: str):
    return _RGB.to(device), _DXY.to(device)


def _sdf(shape_idx, u, v):
    """Signed distance (in units of the radius, > 0 inside) of the 4 shapes, picked per sprite."""
    au, av = u.abs(), v.abs()
    circle = 1.0 - torch.sqrt(u * u + v * v)
    square = 0.85 - torch.maximum(au, av)
    up = -v  # image y grows downwards
    triangle = torch.minimum(up + 0.7, (0.9 - up - 1.6 * au) / 1.887)
    diamond = (1.0 - au - av) / math.sqrt(2.0)
    stacked = torch.stack([circle, square, triangle, diamond])                   # [4, B, N, F, H, W]
    idx = shape_idx[None, :, :, None, None, None].expand(1, *u.shape)
    return torch.gather(stacked, 0, idx)[0]


def render(p: dict, frames: int, height: int, width: int, device="cpu") -> torch.Tensor:
    """Render the clips of ``p`` -> video [B, 3, F, H, W], float32 in [-1, 1]."""
    p = params_to(p, device)
    rgb_table, dxy_table = _tables(str(torch.device(device)))
    B, N = p["shape"].shape
    scale = float(min(height, width))
    f = torch.arange(frames, device=device, dtype=torch.float32)
    ys = torch.arange(height, device=device, dtype=torch.float32) + 0.5
    xs = torch.arange(width, device=device, dtype=torch.float32) + 0.5

    # background: base colour + two plane waves, static unless the camera pans
    k = p["bg_wave"] * (2 * math.pi / 16.0) * (32.0 / scale)                        # [B, 2, 2]
    phase = (k[..., 0, None, None] * xs[None, None, None, :] + k[..., 1, None, None] * ys[None, None, :, None]
             + p["bg_phase"][..., None, None])                                       # [B, 2, H, W]
    cam = p.get("camera")
    if cam is None:
        wave = (p["bg_amp"][..., None, None] * torch.sin(phase)).sum(1)              # [B, H, W]
        img = (p["bg"][:, :, None, None, None] + wave[:, None, None]).expand(B, 3, frames, height, width)
        shift = torch.zeros(B, 1, 2, device=device)
    else:  # the camera moves by cam * scale px / frame: the scene moves the other way on screen
        shift = cam[:, None, :] * scale * f[None, :, None]                           # [B, F, 2]
        drift = k[..., 0, None] * shift[:, None, :, 0] + k[..., 1, None] * shift[:, None, :, 1]  # [B, 2, F]
        wave = (p["bg_amp"][..., None, None, None]
                * torch.sin(phase[:, :, None] + drift[..., None, None])).sum(1)     # [B, F, H, W]
        img = p["bg"][:, :, None, None, None] + wave[:, None]

    # sprite geometry, [B, N, F, H, W]
    vel = dxy_table[p["direction"]] * (p["speed"] * scale)[..., None]          # px / frame
    cx = p["pos"][..., 0, None] * width + vel[..., 0, None] * f - shift[:, None, :, 0]   # [B, N, F]
    cy = p["pos"][..., 1, None] * height + vel[..., 1, None] * f - shift[:, None, :, 1]
    dx = torch.remainder(xs[None, None, None, None, :] - cx[..., None, None] + width / 2, width) - width / 2
    dy = torch.remainder(ys[None, None, None, :, None] - cy[..., None, None] + height / 2, height) - height / 2
    r = (p["radius"] * scale)[..., None, None, None]
    u, v = torch.broadcast_tensors(dx / r, dy / r)                                 # [B, N, F, H, W]
    alpha = torch.clamp(_sdf(p["shape"], u, v) * r + 0.5, 0.0, 1.0) * p["present"][..., None, None, None]
    ang = p["tex_angle"][..., None, None, None]
    stripes = torch.sin(2 * math.pi * p["tex_freq"][..., None, None, None] * (u * torch.cos(ang) + v * torch.sin(ang))
                        + p["tex_phase"][..., None, None, None])
    shade = 1.0 + p["tex_amp"][..., None, None, None] * stripes                    # [B, N, F, H, W]
    rgb = rgb_table[p["colour"]]                                              # [B, N, 3]
    for n in range(N):  # back to front
        a = alpha[:, n, None]
        col = torch.clamp(rgb[:, n, :, None, None, None] * shade[:, n, None], -1.0, 1.0)
        img = img * (1 - a) + col * a
    return img.clamp(-1.0, 1.0).contiguous()


def make_batch(seed: int, batch: int, frames: int = 16, height: int = 32, width: int = 32,
               device="cpu", max_sprites: int = 3, camera: bool = False):
    """(video [B, 3, F, H, W] in [-1, 1], tokens [B, max_sprites, 3]) — a pure function of its arguments."""
    p = params_to(sample_params(seed, batch, max_sprites, camera), device)
    return render(p, frames, height, width, device), tokens_from_params(p)
