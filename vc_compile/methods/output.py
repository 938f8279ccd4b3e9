"""What every method does to a kernel's output before the op returns it (fp16 saturation)."""
from __future__ import annotations

import torch

FP16_MAX = 65504.0


def kernel_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to ask a kernel for when the op must return ``dtype``: fp32 for fp16 (see
    ``finish_output``), else ``dtype`` itself."""
    return torch.float32 if dtype == torch.float16 else dtype


def finish_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The op's output in ``dtype`` from a kernel output in ``kernel_out_dtype(dtype)``.

    fp16 saturates: an attention output row is a convex combination of V rows, so with finite inputs
    SDPA never exceeds max|V| <= 65504. The approximate paths add rounding on top (V-Smooth's FP8
    residual can round up by 1/16 of its scale; MC-Sparse adds a residual cached at another step to the
    sparse output), so a value at 65504 - eps can land above 65520 and become inf in fp16. For fp16 inputs
    the fp32 math itself cannot overflow, so an inf in the fp32 output comes from an Inf input and is kept
    (like SDPA); finite values are clamped to +-65504; NaN stays NaN."""
    if dtype == torch.float16 and out.dtype != torch.float16:
        out = torch.where(torch.isinf(out), out, out.clamp(-FP16_MAX, FP16_MAX))
    return out.to(dtype)
