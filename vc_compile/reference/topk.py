"""Reference top-K key selection per row of the group masses (MC-Sparse anchor step, docs/methods.md, MC-Sparse step 2).

Oracle of ``vc_compile/kernels/topk.py``.

Notation
--------
mass        [..., N] fp32 or bf16, one row per (b, h, group); meant to be >= 0 and NaN-free.
key         the order used: the value's bit pattern read as a signed integer, with every negative pattern
            (negative values, -0.0) mapped to 0 (= +0.0). For non-negative floats the integer order IS the
            float order, so the selection is the K largest masses; negatives count as zero; a NaN (positive
            bit pattern above +inf) would rank first -- deterministic, not an error.
K           ``keep``, 1 <= K <= N.
tie rule    rows are ranked by (key descending, index ascending): of the keys equal to the K-th largest,
            the lowest indices are kept. Exactly K indices per row.
idx         [..., K] int32, sorted ascending.
"""
from __future__ import annotations

import torch


def order_key(mass: torch.Tensor) -> torch.Tensor:
    """int32 (fp32) / int16 (bf16, fp16) sort key: bits, negatives -> 0."""
    if mass.dtype == torch.float32:
        bits = mass.view(torch.int32)
    elif mass.dtype in (torch.bfloat16, torch.float16):
        bits = mass.view(torch.int16)
    else:
        raise ValueError(f"top-K: masses must be fp32, bf16 or fp16, got {mass.dtype}")
    return torch.where(bits < 0, torch.zeros_like(bits), bits)


def select_topk(mass: torch.Tensor, keep: int) -> torch.Tensor:
    N = mass.shape[-1]
    if not 1 <= keep <= N:
        raise ValueError(f"top-K: keep must be in [1, {N}], got {keep}")
    key = order_key(mass).to(torch.int64)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :keep]
    return torch.sort(order, dim=-1).values.to(torch.int32)
