"""Reference non-finite flags of K and V, and the guard's probe rows (MC-Sparse reuse steps, docs/methods.md, MC-Sparse step 4).

Oracle of ``vc_compile/kernels/finite_flags.py``.

Why: a reuse step reads only the keys its query groups selected at the anchor, so a NaN/Inf in any other
key or value would vanish, where SDPA turns it into non-finite outputs. The flags say where SDPA's output
is non-finite, so the gather kernel can make ours non-finite in the same places.

Notation
--------
k, v        [B, H, Sk, D], [B, H, Sk, Dv] of one attention call.
flag        [B, H, Dv] int32: 1 where output column d of head (b, h) must be non-finite, else 0:
            ``flag[b, h, d] = any(!isfinite(k[b, h])) or any(!isfinite(v[b, h, :, d]))``.
            SDPA's pattern (fp32 math, the truth): a NaN key makes every logit of its head NaN, so the
            whole head is NaN; a V element (j, d) reaches column d of every row (``p_ij * NaN`` and
            ``0 * Inf`` are NaN even where p_ij underflows to 0), so the whole column. A +-Inf key makes
            NaN only the rows whose logit against it is +Inf (or 0 * Inf) -- about half the head -- and
            bf16 SDPA on CPU returns a finite head: the flag marks the whole head (a superset of SDPA's
            fp32 pattern; telling those rows apart would need every query against that key).
            A query row's NaN/Inf needs no flag: the gather kernel reads every query row.
probe       the MC-Sparse guard's measurement (``methods/mcsparse_guard.py``): the exact attention output
            of R sampled query rows per head, ``rows`` [B, H, R] (query indices), over *all* keys. The
            flags pass reads every key and value anyway, so the probe costs no extra bytes there.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def finite_flags(k: torch.Tensor, v: torch.Tensor, probe: Optional[Tuple[torch.Tensor, torch.Tensor, float]] = None):
    """(flag [B, H, Dv] int32, exact probe rows [B, H, R, Dv] fp32 or None).

    ``probe = (q [B, H, S, D], rows [B, H, R] int, sm_scale)``: also the exact attention output of the
    query rows ``rows`` of each head (softmax over every key, fp32)."""
    kbad = (~torch.isfinite(k)).flatten(2).any(-1)  # [B, H]
    vbad = (~torch.isfinite(v)).any(2)  # [B, H, Dv]
    flag = (vbad | kbad[..., None]).to(torch.int32)
    if probe is None:
        return flag, None
    q, rows, sm_scale = probe
    return flag, probe_rows(q, k, v, rows, sm_scale)


def probe_rows(q, k, v, rows, sm_scale: float) -> torch.Tensor:
    """Exact attention output [B, H, R, Dv] (fp32) of the query rows ``rows`` [B, H, R]."""
    qs = torch.gather(q, 2, rows.long().unsqueeze(-1).expand(*rows.shape, q.shape[-1])).float()
    p = torch.softmax((qs @ k.float().transpose(-1, -2)) * sm_scale, dim=-1)
    return p @ v.float()


def probe_error(out: torch.Tensor, rows: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """[2] fp32 on out's device: (sum of ||out[row] - exact[row]||^2, sum of ||exact[row]||^2) over the
    sampled rows of every (b, h); their ratio's square root is the reuse step's relative L2 error on them."""
    got = torch.gather(out, 2, rows.long().unsqueeze(-1).expand(*rows.shape, out.shape[-1])).float()
    return torch.stack([(got - exact).square().sum(), exact.square().sum()])


def apply_flag(out: torch.Tensor, flag: Optional[torch.Tensor]) -> torch.Tensor:
    """``out`` [B, H, S, Dv] with NaN in the flagged columns of each head (what the gather kernel's
    epilogue does with its ``flag`` argument)."""
    if flag is None:
        return out
    return torch.where(flag.bool()[:, :, None, :], torch.full((), float("nan"), dtype=out.dtype,
                                                              device=out.device), out)
