"""Flow-matching Euler sampler for the demo model (rectified flow, velocity prediction).

Convention (the same as training in ``train.py``): ``x_t = (1 - t) x_0 + t * noise`` for t in
[0, 1], the model predicts the velocity ``v = noise - x_0`` and receives ``timestep = 1000 t``
(float32, shape [B]) like Wan. Sampling integrates from t = 1 (pure noise) to t = 0 with Euler steps
on the grid ``sigmas(steps, shift)``: ``x <- x + (t_next - t) * v``.

Classifier-free guidance calls the model twice per step, conditional first, then unconditional, as
diffusers' ``WanPipeline`` does: ``v = v_u + g * (v_c - v_u)``. ``guidance=1`` makes one call.

``step_fn(i)`` runs at the start of step ``i`` (the demo passes ``vc_compile.step``);
``progress(i, n, seconds)`` after it. The initial noise comes from a CPU generator, so a seed gives
the same noise on every device.
"""
from __future__ import annotations

import time

import torch


def sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` noise levels from 1 to 0; ``shift > 1`` spends more steps at high noise (SD3/Wan)."""
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return shift * s / (1 + (shift - 1) * s)


def initial_noise(seed: int, batch: int, channels: int, frames: int, height: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(batch, channels, frames, height, width, generator=g, dtype=torch.float32)


def _call(model, x, t, ehs, dtype):
    timestep = torch.full((x.shape[0],), float(t) * 1000.0, device=x.device, dtype=torch.float32)
    out = model(hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=ehs, return_dict=False)[0]
    return out.float()


@torch.no_grad()
def sample(model, cond, *, frames: int, height: int, width: int, steps: int, seed: int = 0,
           uncond=None, guidance: float = 1.0, shift: float = 1.0, channels: int = 3,
           dtype=torch.bfloat16, step_fn=None, progress=None, noise=None) -> torch.Tensor:
    """Generate clips [B, channels, F, H, W] (float32, about [-1, 1]) from text states ``cond`` [B, N, D].

    ``uncond`` (same shape as ``cond``) is required when ``guidance != 1``.
    """
    device = cond.device
    if noise is None:
        noise = initial_noise(seed, cond.shape[0], channels, frames, height, width)
    x = noise.to(device, torch.float32)
    grid = sigmas(steps, shift).tolist()
    cfg = guidance != 1.0
    if cfg and uncond is None:
        raise ValueError("guidance != 1 needs the unconditional text states `uncond`")
    t0 = time.perf_counter()
    for i in range(steps):
        if step_fn is not None:
            step_fn(i)
        t, t_next = grid[i], grid[i + 1]
        v = _call(model, x, t, cond, dtype)
        if cfg:
            v_u = _call(model, x, t, uncond, dtype)
            v = v_u + guidance * (v - v_u)
        x = x + (t_next - t) * v
        if progress is not None:
            progress(i, steps, time.perf_counter() - t0)
    return x


def print_progress(label: str, every: int = 1):
    """A ``progress`` callback that prints one short line per ``every`` steps."""

    def cb(i, n, seconds):
        if (i + 1) % every == 0 or i + 1 == n:
            print(f"  [{label}] step {i + 1:3d}/{n}  {seconds:7.2f} s", flush=True)

    return cb
