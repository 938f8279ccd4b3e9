"""Quantisation primitives shared by the reference path and the kernels' tests.

Notation
--------
* ``amax``: largest absolute value inside one scale block.
* ``scale``: what one quantised unit is worth: ``x ~= x_q * scale``.  A block whose ``amax`` is 0 gets
  ``scale = 1`` (all codes 0), never 0 or NaN: a zero block must not poison the softmax.
* ``inv``: ``qmax / amax`` (1 for a zero block), one IEEE division per block; codes are ``x * inv``
  rounded, never ``x / scale``: a division per element (``div_rn``, ~10 instructions with its slow-path
  check) was a third of the Q/K preprocessing kernel's instructions (sm_90 SASS,
  ``tests/codegen_stats.py``).
* Non-finite inputs (NaN, +-Inf): a block holding one gets ``scale = NaN`` and all-zero codes
  (``quantize_blocks``). So the NaN reaches the output through the scale, like SDPA propagates it, and no
  NaN/Inf ever goes through a float -> int8/e4m3 cast. The kernels find such a block from a
  NaN-propagating amax (one max per element, no per-element finiteness test).
* INT8 codes are ``x * inv`` rounded to nearest, ties to even, from the EXACT product (what one FMA
  ``fma(x, inv, 1.5 * 2^23)`` gives in a kernel, whose low byte is then the two's-complement code):
  ``quantize_int8`` forms the product in float64, where it is exact. |x| <= amax keeps them in
  [-127, 127], so the reference and the kernels agree code for code.
* FP8 means E4M3 (``torch.float8_e4m3fn``, max 448): ``x * inv`` (fp32), rounded to nearest even by the
  cast.

Everything here is plain PyTorch and runs on any device.
"""
from __future__ import annotations

import torch

from vc_compile.formats import EXPCAST_OFFSET, FP8_DTYPE, FP8_MAX, INT8_MAX
from vc_compile.torch_ops import safe_scale


def recip_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``qmax / amax`` (one IEEE division, as the kernels' ``div_rn``), or 1 where the block is all zero.
    Can be +inf for amax below ~qmax / 3.4e38 (bf16 reaches 1e-40): see ``flush_tiny``."""
    a = torch.where(amax == 0, torch.full_like(amax, qmax), amax)
    return torch.full_like(a, qmax) / a


def flush_tiny(amax: torch.Tensor, qmax: float):
    """(amax, inv) with the blocks whose ``qmax / amax`` overflows fp32 treated as all zero (amax 0, inv 1:
    their values, < ~1e-36, round to code 0). The kernels apply the same rule to the same IEEE quotient."""
    inv = recip_scale(amax, qmax)
    tiny = torch.isinf(inv)
    return torch.where(tiny, torch.zeros_like(amax), amax), torch.where(tiny, torch.ones_like(inv), inv)


def finite_part(x: torch.Tensor):
    """(x with NaN/Inf replaced by 0, mask of the non-finite elements)."""
    bad = ~torch.isfinite(x)
    return torch.where(bad, torch.zeros_like(x), x), bad


def poison(scale: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``scale`` with NaN where ``bad`` (a block that held a non-finite input)."""
    return torch.where(bad, torch.full_like(scale, float("nan")), scale)


def quantize_int8(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Codes of fp32 ``x`` times ``inv`` (= qmax / amax, broadcast): round to nearest even of the exact
    product (float64 holds a product of two fp32 exactly), as the kernels' one FMA."""
    return torch.round(x.double() * inv.double()).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_fp8_rcp(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of fp32 ``x * inv`` (one fp32 multiply, then the cast's round to nearest even)."""
    return (x * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``x / scale`` (the MC-Sparse FP8-QK kernel's IEEE division per element)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block amax over dim -2 (tokens) and -1 (channels): [..., S, D] -> [..., ceil(S/block)].
    (Also works on a bool mask: then "any".)"""
    S = x.shape[-2]
    nb = (S + block - 1) // block
    pad = nb * block - S
    xa = x.abs() if x.dtype != torch.bool else x
    if pad:
        xa = torch.nn.functional.pad(xa, (0, 0, 0, pad))
    return xa.unflatten(-2, (nb, block)).amax(dim=(-1, -2))


def expand_blocks(s: torch.Tensor, block: int, S: int) -> torch.Tensor:
    """[..., nb] per-block values -> [..., S] per-token values."""
    return s.repeat_interleave(block, dim=-1)[..., :S]


def quantize_blocks(x: torch.Tensor, block: int, fmt: str):
    """Quantise [..., S, D] with one scale per ``block`` tokens (block = 1: per token). Returns
    (codes, scale[..., nb]); a block with a non-finite element gets scale NaN (see the module doc)."""
    qmax = INT8_MAX if fmt == "int8" else FP8_MAX
    xf = x.float()
    amax = block_amax(xf, block)  # NaN if the block holds a NaN, +inf if an Inf (torch.amax propagates)
    bad = ~torch.isfinite(amax)
    amax, inv = flush_tiny(torch.where(bad, torch.zeros_like(amax), amax), qmax)
    badt = expand_blocks(bad, block, x.shape[-2]).unsqueeze(-1)
    xf = torch.where(badt, torch.zeros_like(xf), xf)  # all-zero codes in a non-finite block
    inv = expand_blocks(inv, block, x.shape[-2]).unsqueeze(-1)
    codes = quantize_int8(xf, inv) if fmt == "int8" else quantize_fp8_rcp(xf, inv)
    return codes, poison(safe_scale(amax, qmax), bad)


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    st = expand_blocks(scale, block, codes.shape[-2]).unsqueeze(-1)
    return codes.float() * st


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """Value of x after a round trip through E4M3 (fp32 out)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()


def expcast_codes(u: torch.Tensor, offset: float = EXPCAST_OFFSET) -> torch.Tensor:
    """ExpCast-FP8 (docs/methods.md, ExpCast-FP8): E4M3 codes of 256 * 2^u for u = s - m <= 0, as uint8. ``offset``: the code of
    u = 0 (119.65: P~ max 256; the fidelity study tried 126.0: P~ max 448, docs/methods.md)."""
    c = torch.floor(8.0 * u + offset + 0.5).clamp(0.0, 126.0)
    return c.to(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bit patterns -> fp32 values."""
    return codes.view(FP8_DTYPE).float()
