"""Fidelity metrics for generated clips: PSNR, SSIM, relative L2 and cosine similarity.

Conventions: clips are float tensors in [-1, 1] (the model's pixel space), shaped [..., C, H, W]
(leading dims, e.g. frames, are averaged over); ``data_range`` defaults to 2.0. PSNR of [-1, 1]
images with range 2 equals PSNR of the same images mapped to [0, 1] with range 1.

SSIM follows ``skimage.metrics.structural_similarity(gaussian_weights=True, sigma=1.5,
use_sample_covariance=False, data_range=...)`` (Wang et al. 2004): an 11 x 11 Gaussian window
(sigma 1.5, truncated at 3.5 sigma, radius 5), K1 = 0.01, K2 = 0.03, and the mean of the SSIM map
over the pixels at least 5 from every border. Because the window radius equals that crop, no padded
pixel ever reaches the mean, so a "valid" convolution gives skimage's number exactly (no padding
mode to match). Multichannel images: mean over channels; videos: mean over frames. Each image must
be at least 11 x 11.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SSIM_SIGMA = 1.5
SSIM_RADIUS = 5  # int(3.5 * sigma + 0.5), as in skimage / scipy's truncate=3.5


def psnr(x: torch.Tensor, ref: torch.Tensor, data_range: float = 2.0) -> float:
    """Peak signal-to-noise ratio in dB over all elements (``inf`` for identical inputs)."""
    mse = torch.mean((x.double() - ref.double()) ** 2).item()
    return math.inf if mse == 0 else 10.0 * math.log10(data_range ** 2 / mse)


def gaussian_window(sigma: float = SSIM_SIGMA, radius: int = SSIM_RADIUS) -> torch.Tensor:
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    w = torch.exp(-0.5 * (x / sigma) ** 2)
    return w / w.sum()


def _filter_valid(img: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Separable 'valid' filtering of [N, 1, H, W] float64 images."""
    k = w.numel()
    img = F.conv2d(img, w.view(1, 1, k, 1))
    return F.conv2d(img, w.view(1, 1, 1, k))


def ssim_map(x: torch.Tensor, ref: torch.Tensor, data_range: float = 2.0) -> torch.Tensor:
    """Per-pixel SSIM of [N, H, W] images over the valid region -> [N, H - 10, W - 10] (float64)."""
    w = gaussian_window().to(x.device)
    a = x.double().unsqueeze(1)
    b = ref.double().unsqueeze(1)
    mu_a, mu_b = _filter_valid(a, w), _filter_valid(b, w)
    var_a = _filter_valid(a * a, w) - mu_a * mu_a
    var_b = _filter_valid(b * b, w) - mu_b * mu_b
    cov = _filter_valid(a * b, w) - mu_a * mu_b
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return s[:, 0]


def ssim(x: torch.Tensor, ref: torch.Tensor, data_range: float = 2.0) -> float:
    """Mean SSIM of images/clips shaped [..., C, H, W] (or [H, W]); 1.0 for identical inputs."""
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch {tuple(x.shape)} vs {tuple(ref.shape)}")
    if x.shape[-1] < 2 * SSIM_RADIUS + 1 or x.shape[-2] < 2 * SSIM_RADIUS + 1:
        raise ValueError(f"SSIM needs images of at least 11 x 11, got {tuple(x.shape[-2:])}")
    h, w = x.shape[-2:]
    return ssim_map(x.reshape(-1, h, w), ref.reshape(-1, h, w), data_range).mean().item()


def video_ssim(x: torch.Tensor, ref: torch.Tensor, data_range: float = 2.0) -> float:
    """SSIM of clips [B, C, F, H, W] (the model's layout): per frame and channel, then the mean."""
    return ssim(x.transpose(1, 2), ref.transpose(1, 2), data_range)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.vector_norm((x.double() - ref.double()).flatten())
            / torch.linalg.vector_norm(ref.double().flatten()).clamp_min(1e-30)).item()


def cos_sim(x: torch.Tensor, ref: torch.Tensor) -> float:
    return F.cosine_similarity(x.double().flatten(), ref.double().flatten(), dim=0).item()


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """All metrics of clip ``x`` against ``ref`` ([B, C, F, H, W] in [-1, 1]), as a dict."""
    x, ref = x.float().clamp(-1, 1).cpu(), ref.float().clamp(-1, 1).cpu()
    return {"psnr": psnr(x, ref), "ssim": video_ssim(x, ref), "rel_l2": rel_l2(x, ref), "cos_sim": cos_sim(x, ref)}
