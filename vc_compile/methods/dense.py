"""``method="dense"``: stock SDPA math (the baseline, and the warm-up phase of the other methods)."""
from __future__ import annotations

import torch.nn.functional as F


def run(q, k, v, *, sm_scale, **_):
    return F.scaled_dot_product_attention(q, k, v, scale=sm_scale).contiguous(), None
