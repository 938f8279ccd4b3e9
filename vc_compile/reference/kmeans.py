"""Reference k-means grouping of V rows (docs/methods.md, V-Smooth step 1): labels -> stable argsort -> permutation.

Oracle of ``vc_compile/kernels/kmeans.py``.

Notation
--------
x           [B, H, S, D] the rows to cluster (V), clustered per (b, h) in fp32.
K           number of clusters; ``c`` [B, H, K, D] centroids (fp32).
init        when no centroids are given (first grouping step of a generation): the rows at the strided
            positions ``floor(j * S / K)``, j = 0..K-1 (deterministic, no k-means++ sampling).
iteration   assign every row to its nearest centroid (squared L2, ties -> lowest index), then move each
            centroid to the mean of its rows; an empty cluster keeps its previous centroid.
labels      the assignment of the *last* iteration; ``perm = argsort(labels, stable=True)`` so rows of one
            cluster are contiguous and keep their original order inside the cluster.
sample      stride ``st`` of the rows the iterations see (``sample_stride``): with st > 1 the iterations run
            on rows 0, st, 2 st, ... and one last assignment of every row to the final centroids gives the
            labels (mini-batch Lloyd; the grouping is a heuristic, any ordering is exact).
"""
from __future__ import annotations

from typing import Optional

import torch

from vc_compile.formats import KMeansResult
from vc_compile.torch_ops import init_centroids


def assign(x: torch.Tensor, c: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Nearest centroid per row: [B, H, S] int64."""
    c2 = (c * c).sum(-1)  # [B, H, K]
    out = []
    for i0 in range(0, x.shape[2], chunk):
        xs = x[:, :, i0:i0 + chunk].float()
        d = c2.unsqueeze(2) - 2.0 * (xs @ c.transpose(-1, -2))  # ||x||^2 is constant per row
        out.append(d.argmin(dim=-1))
    return torch.cat(out, dim=2)


def update(x: torch.Tensor, labels: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    B, H, S, D = x.shape
    K = c.shape[2]
    sums = torch.zeros(B, H, K, D, device=x.device, dtype=torch.float32)
    sums.scatter_add_(2, labels.unsqueeze(-1).expand(B, H, S, D), x.float())
    counts = torch.zeros(B, H, K, device=x.device, dtype=torch.float32)
    counts.scatter_add_(2, labels, torch.ones(B, H, S, device=x.device))
    new = sums / counts.clamp_min(1.0).unsqueeze(-1)
    return torch.where(counts.unsqueeze(-1) > 0, new, c)


def kmeans_perm(x: torch.Tensor, n_clusters: int, n_iters: int,
                init: Optional[torch.Tensor] = None, sample: int = 1) -> KMeansResult:
    if n_iters < 1:
        raise ValueError(f"kmeans needs at least one iteration, got n_iters={n_iters}")
    if sample < 1:
        raise ValueError(f"kmeans needs a row stride >= 1, got sample={sample}")
    c = init.float() if init is not None else init_centroids(x, n_clusters)
    xs = x[:, :, ::sample]
    labels = None
    for _ in range(n_iters):
        labels = assign(xs, c)
        c = update(xs, labels, c)
    if sample > 1:
        labels = assign(x, c)
    perm = torch.sort(labels, dim=-1, stable=True).indices
    return KMeansResult(perm, c, labels)
