"""The demo model inside diffusers' ``WanPipeline``: the zero-code path the README leads with.

The shipped transformer *is* a diffusers ``WanTransformer3DModel`` whose latent space is pixel space
(3 channels, patch (1, 2, 2)), so the stock ``WanPipeline`` runs it unchanged:

* no tokenizer, text encoder or VAE: the demo's :class:`~vc_compile.demo.model.SpriteTextEncoder`
  gives ``prompt_embeds`` / ``negative_prompt_embeds``, and ``output_type="latent"`` returns the
  denoised latents, which are the clip's pixels in [-1, 1];
* the initial noise is passed as ``latents`` (``sampler.initial_noise``: a CPU generator, so a seed
  gives the same clip on every device); ``num_frames``/``height``/``width`` are the nominal video sizes
  a Wan VAE would map onto these latents (only the pipeline's input checks read them);
* the scheduler is diffusers' ``FlowMatchEulerDiscreteScheduler`` set up to take the steps of the
  sampler the model was trained and validated with (``sampler.sample``: rectified flow, Euler on
  ``sigmas(steps, shift)``, timestep = 1000 sigma, CFG as two forwards): :func:`flow_scheduler`.

What still differs from ``sampler.sample`` is diffusers' arithmetic, not the method: the pipeline forms
the CFG combination in the transformer's dtype (bf16) and the scheduler casts the latents back to it
after every step, where the sampler keeps both in fp32. ``tests/demo/test_demo.py`` measures the gap.

Step detection needs nothing from the demo: the vcattn op reads the step index and count from the
pipeline's denoising loop (``vc_compile/runtime/steps.py``).
"""
from __future__ import annotations

import torch

from .sampler import initial_noise, sigmas


def flow_scheduler(steps: int, shift: float = 1.0):
    """A ``FlowMatchEulerDiscreteScheduler`` whose ``steps`` sigmas are ``sampler.sigmas(steps, shift)``.

    diffusers spaces its sigmas ``linspace(1, 1/1000, steps)`` before the shift and appends 0, so its last
    step (1/1000 -> 0) does nothing. ``shift_terminal`` stretches that grid so it ends at the sampler's
    last non-zero sigma: for ``shift = 1`` the two grids are then identical (``1 - i/steps``); for other
    shifts the end points agree and the interior differs by the order of ``shift_terminal`` stretching
    (``max_sigma_gap`` reports it).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    target = sigmas(steps, shift)
    terminal = float(target[-2]) if steps > 1 else None  # one step: 1 -> 0 needs no stretching
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift), shift_terminal=terminal)


def max_sigma_gap(steps: int, shift: float = 1.0) -> float:
    """Largest |sigma| difference between :func:`flow_scheduler`'s grid and ``sampler.sigmas``."""
    sch = flow_scheduler(steps, shift)
    sch.set_timesteps(steps)
    return (sch.sigmas.double() - sigmas(steps, shift)).abs().max().item()


def build_pipeline(transformer, steps: int = 50, shift: float = 1.0):
    """``WanPipeline`` around the demo transformer: no tokenizer, text encoder or VAE (see above)."""
    from diffusers import WanPipeline

    return WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                       scheduler=flow_scheduler(steps, shift))


def base_transformer(pipe):
    """The pipeline's transformer without a ``torch.compile`` wrapper."""
    tr = pipe.transformer
    return getattr(tr, "_orig_mod", tr)


def compile_pipe(pipe, options: dict, regional: bool = False):
    """Put the vcattn backend on the pipeline's transformer, the way the README tells users to.

    TODO(packaging branch): this whole function becomes ``vc_compile.enable(pipe, **options)`` (regional by
    default) once ``vc_compile/pipeline.py`` lands; :func:`uncompile_pipe` becomes its undo.
    """
    uncompile_pipe(pipe)
    if regional:  # one graph for all Wan blocks: ~6x less compile time
        pipe.transformer.compile_repeated_blocks(backend="vcattn", options=options)
    else:
        pipe.transformer = torch.compile(pipe.transformer, backend="vcattn", options=options)
    return pipe


def uncompile_pipe(pipe):
    """Undo :func:`compile_pipe` (both forms)."""
    pipe.transformer = base_transformer(pipe)
    for m in pipe.transformer.modules():  # regional compile wraps submodules in place
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    return pipe


def nominal_video_size(pipe, frames: int, height: int, width: int) -> dict:
    """The ``num_frames``/``height``/``width`` a Wan VAE would encode into latents of F x H x W."""
    t, s = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
    return {"num_frames": (frames - 1) * t + 1, "height": height * s, "width": width * s}


def generate(pipe, cond, uncond, *, frames: int, height: int, width: int, steps: int, seed: int = 0,
             guidance: float = 3.0, shift: float = 1.0, progress: bool = True, desc: str | None = None,
             callback=None) -> torch.Tensor:
    """One clip [B, 3, F, H, W] (float32, about [-1, 1]) from text states ``cond``/``uncond`` [B, N, D]
    through ``pipe(...)``: the same noise and sigma grid as ``sampler.sample(..., seed=seed)``."""
    if cond.shape[0] != 1:
        raise ValueError(f"one prompt at a time (prompt_embeds batch 1), got batch {cond.shape[0]}")
    pipe.scheduler = flow_scheduler(steps, shift)
    pipe.set_progress_bar_config(disable=not progress, desc=desc, leave=True)
    channels = base_transformer(pipe).config.in_channels
    noise = initial_noise(seed, cond.shape[0], channels, frames, height, width).to(cond.device)
    out = pipe(prompt_embeds=cond, negative_prompt_embeds=uncond if guidance > 1 else None, latents=noise,
               num_inference_steps=steps, guidance_scale=guidance, output_type="latent", return_dict=False,
               callback_on_step_end=callback, **nominal_video_size(pipe, frames, height, width))[0]
    return out.float()
