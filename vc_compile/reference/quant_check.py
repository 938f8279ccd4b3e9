"""What 8-bit quantisation would cost a call site, read on a small sample of its q, k, v before its first 8-bit call.

Notation
--------
r_qk    the error of the 8-bit logits (per-token Q codes x per-64-key-block K codes of the smoothed K, the
        preprocessing's arithmetic: reference/preprocess.py) against the exact logits of the smoothed K, root mean
        square over the head's keys (estimated from the sampled blocks: the typical blocks' mean square plus the
        worst block's excess once per block of the sequence) and the sampled query rows, divided by the root mean
        square spread of the typical keys' exact logits (their deviation from each row's mean). Scale-free: a clean
        head reads the same at any magnitude (INT8: 1.2e-2 to 1.3e-2 on random and on structured inputs).
r_v     the error of the FP8 V codes (after V-Smooth's block means, one scale per channel over the whole head)
        against V, root mean square over the sampled typical blocks, divided by the spread of V there (FP8:
        about 2.6e-2 on clean inputs).

What it catches: a K channel far larger than the others (its per-block INT8 scale leaves the other channels a few
codes: r_qk x4 at a channel x10, x6 at x100), one key token far larger than its block (that block's other keys
lose their precision: at x1000 its keys' logit error outweighs the rest of the head), one value token far larger
than its channel (every other token of the channel loses precision; E4M3's exponent absorbs x1000), values beyond
``V_RANGE`` (the V statistics overflow near the bf16 maximum: r_v is inf). The sample
always holds the K block and the V block with the largest element of each head, so a lone outlier is not missed.

The action (``decide``): a reading within ``LIMIT`` x the clean format's reading keeps the 8-bit path; above it,
for K, the Hadamard rotation (which spreads a channel over all channels: r_qk back to the clean value for a
channel outlier at any size) where it brings r_qk within the limit; else stock SDPA for the site.
Cost: one pass over K and V for their per-token maxima (``torch.linalg.vector_norm``, no copy) and a
64 x 384 logit product per head, once per (site, block, shape) like the sharpness check (ops.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from vc_compile.formats import BLOCK_K, BLOCK_V, hadamard_matrix
from vc_compile.reference.preprocess import k_mean_mask
from vc_compile.reference.quant import quantize_blocks

# r_qk / r_v of clean inputs per format, the units of the limit: INT8 Q / K 1.27e-2 (worst of 8 sampled blocks,
# random and structured inputs, S = 2048, D = 128), FP8 Q / K and the FP8 V codes as measured by
# tests/reference/test_quant_check.py::test_clean_readings (the test keeps these values honest)
CLEAN_QK = {"int8": 1.3e-2, "fp8": 3.8e-2}
CLEAN_V = 2.7e-2
# a reading above LIMIT x its clean value acts (ops.py); 2.5: the output error of V-Smooth stays within ~3x its
# clean error where the logit error does (tests/reference/test_quant_check.py measures both on the cases it guards)
LIMIT = 2.5
# |V| beyond this overflows the 8-bit paths' V statistics (NaN from ~3e35 on; 1e34 measured clean): stock SDPA
V_RANGE = 1e33
ROWS = 64  # sampled query rows
BLOCKS = 5  # evenly spaced K blocks (64 keys) and V blocks (128 keys) besides the worst one


@dataclasses.dataclass(frozen=True)
class Reading:
    r_qk: float  # as configured
    r_qk_hadamard: Optional[float]  # with the Hadamard rotation (None: not read, the site already rotates)
    r_v: float

    def action(self, qk_format: str, hadamard: bool) -> str:
        """"8bit" (as configured), "hadamard" (rotate this site's Q / K) or "sdpa" (stock SDPA here)."""
        lim_qk, lim_v = LIMIT * CLEAN_QK[qk_format], LIMIT * CLEAN_V
        if self.r_v > lim_v:
            return "sdpa"
        if self.r_qk <= lim_qk:
            return "8bit"
        if not hadamard and self.r_qk_hadamard is not None and self.r_qk_hadamard <= lim_qk:
            return "hadamard"
        return "sdpa"


def _blocks(x: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """[B, H, m] row indices: ``n`` evenly spaced whole blocks of ``block`` rows, then the block holding each
    head's largest element (the last ``block`` rows where that element is in a partial tail block; a neighbour
    of it replaces an evenly spaced block that is the same block): m = (n + 1) x block, fewer blocks where the
    sequence has fewer."""
    B, H, S, _ = x.shape
    nb = S // block
    if nb == 0:
        return torch.arange(S, device=x.device).expand(B, H, S)
    peak = torch.linalg.vector_norm(x, float("inf"), dim=-1)  # [B, H, S], no copy of x
    nbc = -(-S // block)
    peak = torch.nn.functional.pad(peak, (0, nbc * block - S))
    worst = peak.unflatten(-1, (nbc, block)).amax(-1).argmax(-1, keepdim=True)  # [B, H, 1], of nbc blocks
    even = torch.linspace(0, nb - 1, min(n, nb), device=x.device).round().long().expand(B, H, -1)
    if nb > 1:  # an evenly spaced block that is the worst one: its neighbour instead (it stands for the typical)
        even = torch.where(even == worst, torch.where(worst > 0, worst - 1, worst + 1), even)
    starts = torch.cat([even * block, (worst * block).clamp(max=S - block)], dim=-1)  # [B, H, n + 1]
    return (starts.unsqueeze(-1) + torch.arange(block, device=x.device)).flatten(-2)


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])).float()


def qk_error(q: torch.Tensor, k: torch.Tensor, qk_format: str, hadamard: bool) -> float:
    """r_qk (module doc): the worst sampled K block of the worst head (scale-free: no softmax scale needed)."""
    S = q.shape[2]
    qi = torch.linspace(0, S - 1, min(S, ROWS), device=q.device).round().long()
    qf = q.index_select(2, qi).float()
    ki = _blocks(k, BLOCK_K, BLOCKS)
    k_mean = k[:, :, k_mean_mask(k.shape[2], k.device)].float().mean(dim=2, keepdim=True)
    kf = _take(k, ki) - k_mean
    if hadamard:
        Hd = hadamard_matrix(q.shape[-1], device=q.device)
        qf, kf = qf @ Hd, kf @ Hd
    q8, qs = quantize_blocks(qf, 1, qk_format)
    k8, ks = quantize_blocks(kf, BLOCK_K, qk_format)  # the sample's blocks are whole blocks of the sequence
    exact = qf @ kf.transpose(-1, -2)
    codes = (q8.float() * qs.unsqueeze(-1)) @ (k8.float() * ks.repeat_interleave(BLOCK_K, -1).unsqueeze(-1)
                                               [..., :kf.shape[2], :]).transpose(-1, -2)
    # the spread of the typical keys' logits (the evenly spaced blocks): one huge key would otherwise set it
    typical = exact[..., :max(kf.shape[2] - BLOCK_K, 1)] if kf.shape[2] > BLOCK_K else exact
    spread = (typical - typical.mean(-1, keepdim=True)).pow(2).mean(dim=(-1, -2)).sqrt()  # [B, H]
    err = (codes - exact).pow(2)
    m = err.shape[-1] // BLOCK_K * BLOCK_K
    if m > BLOCK_K:
        # the head's logit error over all its keys: the typical blocks' mean square, plus the worst block's excess
        # over it once in every nb blocks (one huge key spoils its own block only)
        sq = err[..., :m].unflatten(-1, (-1, BLOCK_K)).mean(dim=(-1, -3))  # [B, H, blocks]: the last is the worst
        typ = sq[..., :-1].mean(-1)
        nb = max(k.shape[2] // BLOCK_K, 1)
        total = (typ + (sq[..., -1] - typ).clamp_min(0) / nb).sqrt()
    else:
        total = err.mean(dim=(-1, -2)).sqrt()
    r = total / spread.clamp_min(torch.finfo(torch.float32).tiny)
    r = torch.where(spread > 0, r, torch.zeros_like(r))  # a head of constant logits: nothing to lose
    return float(torch.nan_to_num(r, nan=0.0, posinf=0.0).amax())


def v_error(v: torch.Tensor) -> float:
    """r_v (module doc): the FP8 codes' error on the sampled typical V blocks of the worst head, with each
    channel's scale from the whole head (the sampled blocks and the one with the head's largest element)."""
    from vc_compile.formats import FP8_MAX
    from vc_compile.reference.quant import quantize_fp8_rcp
    vi = _blocks(v, BLOCK_V, BLOCKS)
    vs = _take(v, vi)  # [B, H, (n + 1) x 128, D]: the typical blocks, then the worst
    if float(torch.nan_to_num(vs, nan=0.0, posinf=0.0, neginf=0.0).abs().amax()) > V_RANGE:
        return float("inf")  # beyond the range the 8-bit path can hold: never a reading it would keep
    nb = vs.shape[2] // BLOCK_V
    if nb == 0:
        return 0.0
    blocks = vs[:, :, :nb * BLOCK_V].unflatten(2, (nb, BLOCK_V))
    resid = blocks - blocks.mean(dim=3, keepdim=True)
    resid = torch.nan_to_num(resid, nan=0.0, posinf=0.0, neginf=0.0)
    amax = resid.abs().amax(dim=(2, 3), keepdim=True)  # per channel, the worst block included
    inv = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    deq = quantize_fp8_rcp(resid, inv).float() / inv
    typical = slice(0, max(nb - 1, 1))  # the evenly spaced blocks: what every other token keeps
    err = (deq - resid)[:, :, typical].pow(2).mean(dim=(2, 3, 4)).sqrt()
    spread = resid[:, :, typical].pow(2).mean(dim=(2, 3, 4)).sqrt()
    r = torch.where(spread > 0, err / spread.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(err))
    return float(torch.nan_to_num(r, nan=0.0, posinf=0.0).amax())


def read(q, k, v, qk_format: str, hadamard: bool) -> Reading:
    """The readings of one call's q, k, v [B, H, S, D] (no gradient, no state)."""
    with torch.no_grad():
        r = qk_error(q, k, qk_format, hadamard)
        rh = None
        if not hadamard and r > LIMIT * CLEAN_QK[qk_format] and q.shape[-1] in (64, 128):
            rh = qk_error(q, k, qk_format, True)
        return Reading(r, rh, v_error(v))
