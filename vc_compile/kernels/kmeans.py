"""k-means grouping of V rows on the GPU (docs/methods.md, V-Smooth step 1): labels -> stable argsort -> permutation.

Contract: ``vc_compile/reference/kmeans.py`` (same init, tie rule, empty-cluster rule, result tuple).

Notation
--------
x            [B, H, S, D] rows to cluster (V), any strides; bf16/fp16 (fp32 also works, slower).
K, c         clusters, centroids [B*H, K, D] fp32 (the state), c2 = |c|^2 per centroid.
c_hi, c_lo   c split into two 16-bit parts in x's dtype (c ~= c_hi + c_lo to ~16 mantissa bits), so
             ``x . c = x . c_hi + x . c_lo`` runs as two 16-bit MMAs with exact products and fp32
             accumulation (relative error ~2^-17 against the reference's fp32 matmul: labels differ only
             on near-ties).
BS, BKC      rows per program, centroids per chunk.

Kernels and grids (one Lloyd iteration = assign + update_partial + update_final)
----------------------------------------------------------------------------
* ``_assign_kernel`` grid (ceil(S/BS), B*H): fused distance + argmin. A program holds its BS rows and
  streams the centroids in BKC chunks: d = c2 - 2 x.c (|x|^2 is constant per row), running (min, argmin)
  with ties to the lowest index; no S x K matrix is ever written. Labels int32.
* ``_update_partial_kernel`` grid (ceil(K/BKC), n_split, B*H): per-cluster sums of the rows of one token
  chunk as a one-hot MMA, ``onehot[BKC, BS] @ x[BS, D]`` (exact products, fp32 accumulation), plus
  counts; partials [B*H, n_split, K, D]. Deterministic (no atomics).
* ``_update_final_kernel`` grid (ceil(K/BKC), B*H): adds the partials, c = sums / counts, an empty
  cluster keeps its centroid; writes c, c_hi, c_lo, c2 for the next assign.
* perm = ``torch.sort(labels, stable=True)`` (CUB segmented radix sort; uint8 keys where K <= 256).
* ``sample`` = st > 1: the iterations read the strided view ``x[:, :, ::st]`` (no copy), then one more
  ``_assign_kernel`` over every row gives the labels (the reference's mini-batch rule).

Cost per iteration and head: assign 4 S K D FLOPs (two MMAs) + S D x-bytes; update 2 S K D FLOPs.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from vc_compile.formats import KMeansResult
from vc_compile.kernels.compat import assembled
from vc_compile.kernels.configs import pow2_head_dim_error
from vc_compile.kernels.interpret import interpreting, loop_bound
from vc_compile.torch_ops import init_centroids


@triton.jit
def _assign_kernel(X, CHI, CLO, C2, LABELS, S, H, K, sxb, sxh, sxs, sxd, n_kc, N_KC_C: tl.constexpr,
                   D: tl.constexpr, BS: tl.constexpr, BKC: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    rows = pid * BS + tl.arange(0, BS)
    rmask = rows < S
    x = tl.load(X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + rows[:, None].to(tl.int64) * sxs
                + d[None, :] * sxd, mask=rmask[:, None], other=0.0)
    if INTERPRET:
        x = x.to(tl.float32)  # NOTE the 3.6 interpreter's tl.dot mis-multiplies bf16
    best_d = tl.full([BS], float("inf"), tl.float32)
    best_i = tl.zeros([BS], tl.int32)
    c_base = bh.to(tl.int64) * K
    for kc in tl.range(0, N_KC_C if N_KC_C >= 0 else n_kc):
        cols = kc * BKC + tl.arange(0, BKC)
        cmask = cols < K
        cptr = (c_base + cols[:, None]) * D + d[None, :]
        chi = tl.load(CHI + cptr, mask=cmask[:, None], other=0.0)
        if INTERPRET:
            chi = chi.to(tl.float32)
        dot = tl.dot(x, tl.trans(chi), input_precision=DOT_PREC)
        if SPLIT:
            clo = tl.load(CLO + cptr, mask=cmask[:, None], other=0.0)
            if INTERPRET:
                clo = clo.to(tl.float32)
            dot = tl.dot(x, tl.trans(clo), dot)
        c2 = tl.load(C2 + c_base + cols, mask=cmask, other=float("inf"))
        dist = c2[None, :] - 2.0 * dot
        if INTERPRET:  # NOTE Triton 3.8+'s interpreter argmin (numpy's nanargmin) raises on an all-NaN row; a NaN
            dist = tl.where(dist == dist, dist, float("inf"))  # distance never updates the row's best anyway
        dmin = tl.min(dist, 1)
        imin = tl.argmin(dist, 1).to(tl.int32) + kc * BKC
        upd = dmin < best_d  # strict: an earlier chunk wins ties (lowest index)
        best_d = tl.where(upd, dmin, best_d)
        best_i = tl.where(upd, imin, best_i)
    tl.store(LABELS + bh.to(tl.int64) * S + rows, best_i, mask=rmask)


@triton.jit
def _update_partial_kernel(X, LABELS, PSUM, PCNT, S, H, K, sxb, sxh, sxs, sxd, rows_per_split, n_sub,
                           N_SUB_C: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                           BKC: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    kc = tl.program_id(0)
    sp = tl.program_id(1)
    bh = tl.program_id(2)
    n_split = tl.num_programs(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    cols = kc * BKC + tl.arange(0, BKC)
    x_base = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    acc = tl.zeros([BKC, D], tl.float32)
    cnt = tl.zeros([BKC], tl.int32)
    for i in tl.range(0, N_SUB_C if N_SUB_C >= 0 else n_sub):
        rows = sp * rows_per_split + i * BS + tl.arange(0, BS)
        rmask = rows < S
        lab = tl.load(LABELS + bh.to(tl.int64) * S + rows, mask=rmask, other=-1)
        x = tl.load(x_base + rows[:, None].to(tl.int64) * sxs + d[None, :] * sxd, mask=rmask[:, None],
                    other=0.0)
        hit = lab[None, :] == cols[:, None]  # [BKC, BS] one-hot
        if INTERPRET:
            acc = tl.dot(hit.to(tl.float32), x.to(tl.float32), acc)
        else:
            acc = tl.dot(hit.to(x.dtype), x, acc, input_precision=DOT_PREC)
        cnt += tl.sum(hit.to(tl.int32), 1)
    cmask = cols < K
    part = (bh * n_split + sp).to(tl.int64) * K + cols
    tl.store(PSUM + part[:, None] * D + d[None, :], acc, mask=cmask[:, None])
    tl.store(PCNT + part, cnt, mask=cmask)


@triton.jit
def _update_final_kernel(PSUM, PCNT, C, CHI, CLO, C2, K, n_split, N_SPLIT_C: tl.constexpr,
                         D: tl.constexpr, BKC: tl.constexpr, SPLIT: tl.constexpr):
    kc = tl.program_id(0)
    bh = tl.program_id(1)
    d = tl.arange(0, D)
    cols = kc * BKC + tl.arange(0, BKC)
    cmask = cols < K
    sums = tl.zeros([BKC, D], tl.float32)
    cnt = tl.zeros([BKC], tl.int32)
    for sp in tl.range(0, N_SPLIT_C if N_SPLIT_C >= 0 else n_split):
        part = (bh * n_split + sp).to(tl.int64) * K + cols
        sums += tl.load(PSUM + part[:, None] * D + d[None, :], mask=cmask[:, None], other=0.0)
        cnt += tl.load(PCNT + part, mask=cmask, other=0)
    cptr = (bh.to(tl.int64) * K + cols[:, None]) * D + d[None, :]
    old = tl.load(C + cptr, mask=cmask[:, None], other=0.0)
    new = tl.math.div_rn(sums, tl.maximum(cnt, 1).to(tl.float32)[:, None])
    new = tl.where((cnt > 0)[:, None], new, old)
    tl.store(C + cptr, new, mask=cmask[:, None])
    hi = new.to(CHI.dtype.element_ty)
    tl.store(CHI + cptr, hi, mask=cmask[:, None])
    if SPLIT:
        tl.store(CLO + cptr, (new - hi.to(tl.float32)).to(CLO.dtype.element_ty), mask=cmask[:, None])
    tl.store(C2 + bh.to(tl.int64) * K + cols, tl.sum(new * new, 1), mask=cmask)


def kmeans_perm(x: torch.Tensor, n_clusters: int, n_iters: int,
                init: Optional[torch.Tensor] = None, sample: int = 1) -> KMeansResult:
    """k-means of the rows of x [B, H, S, D] per (b, h): ``n_iters`` Lloyd iterations from ``init``
    [B, H, K, D] (or the reference's strided rows) over every ``sample``-th row, then (sample > 1) one
    assignment of every row; returns (perm, centroids fp32, labels int64)."""
    if n_iters < 1:
        raise ValueError(f"kmeans needs at least one iteration, got n_iters={n_iters}")
    if sample < 1:
        raise ValueError(f"kmeans needs a row stride >= 1, got sample={sample}")
    B, H, S, D = x.shape
    K = int(n_clusters)
    err = pow2_head_dim_error(D)
    if err:
        raise ValueError(f"kmeans_perm: {err}")
    dev = x.device
    c = (init.float().clone() if init is not None else init_centroids(x, K)).reshape(B * H, K, D)
    c = c.contiguous()
    split = x.dtype in (torch.bfloat16, torch.float16)
    cdt = x.dtype if split else torch.float32
    prec = None if split else "ieee"
    c_hi = c.to(cdt)
    c_lo = (c - c_hi.float()).to(cdt) if split else c_hi
    c2 = (c * c).sum(-1)
    xs = x[:, :, ::sample]
    Ss = xs.shape[2]
    labels = torch.empty(B * H, S, device=dev, dtype=torch.int32)
    lab_s = labels if sample == 1 else torch.empty(B * H, Ss, device=dev, dtype=torch.int32)
    # NOTE the kernel against flash-kmeans: docs/design/kmeans-kernel.md.
    BS_A, BKC_A = 128, min(128, max(16, triton.next_power_of_2(K)))
    BS_U, BKC_U = 64, min(128, max(16, triton.next_power_of_2(K)))
    n_kc = triton.cdiv(K, BKC_A)
    n_kcu = triton.cdiv(K, BKC_U)
    n_split = max(1, min(triton.cdiv(Ss, 1024), triton.cdiv(264, n_kcu * B * H)))
    rows_per_split = triton.cdiv(triton.cdiv(Ss, n_split), BS_U) * BS_U
    n_split = triton.cdiv(Ss, rows_per_split)
    n_sub = rows_per_split // BS_U
    psum = torch.empty(B * H, n_split, K, D, device=dev, dtype=torch.float32)
    pcnt = torch.empty(B * H, n_split, K, device=dev, dtype=torch.int32)
    itp = interpreting()

    def assign(rows, out):
        _assign_kernel[(triton.cdiv(rows.shape[2], BS_A), B * H)](
            rows, c_hi, c_lo, c2, out, rows.shape[2], H, K, *rows.stride(), n_kc, loop_bound(n_kc),
            D=D, BS=BS_A, BKC=BKC_A, SPLIT=split, DOT_PREC=prec, INTERPRET=itp, num_warps=8)

    for _ in range(n_iters):
        assign(xs, lab_s)
        _update_partial_kernel[(n_kcu, n_split, B * H)](
            xs, lab_s, psum, pcnt, Ss, H, K, *xs.stride(), rows_per_split, n_sub, loop_bound(n_sub),
            D=D, BS=BS_U, BKC=BKC_U, DOT_PREC=prec, INTERPRET=itp, num_warps=8)
        _update_final_kernel[(n_kcu, B * H)](
            psum, pcnt, c, c_hi, c_lo, c2, K, n_split, loop_bound(n_split), D=D, BKC=BKC_U,
            SPLIT=split, num_warps=4)
    if sample > 1:
        assign(x, labels)  # every row to the final centroids
    # NOTE labels below 256 sort as uint8 keys: the same stable order, one radix pass instead of four
    # (design/kmeans-kernel.md)
    perm = torch.sort(labels.to(torch.uint8) if K <= 256 else labels, dim=-1, stable=True).indices
    return KMeansResult(perm.view(B, H, S), c.view(B, H, K, D), labels.long().view(B, H, S))


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
