"""``method="vsmooth"``: 8-bit attention with value smoothing (SPEC 3.1-3.3).

GROUP steps: k-means of V rows per (b, h) (warm-started from this site's previous centroids), labels ->
stable argsort -> permutation pi. Every step: preprocess (K smoothing, optional Hadamard, 8-bit Q/K, K and
V permuted by pi, 128-row block means, FP8 residual) and the 8-bit attention with mean compensation.
Metadata: ``VSmoothMeta(perm, centroids)`` per site/block/branch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..reference.kmeans import default_clusters
from ..runtime.steps import Phase


@dataclass
class VSmoothMeta:
    perm: torch.Tensor  # [B, H, Sk] int64
    centroids: torch.Tensor  # [B, H, K, D] fp32


def run(q, k, v, *, phase, meta: Optional[VSmoothMeta], cfg, sm_scale, impl):
    perm = None
    if cfg.smooth_v:
        if phase == Phase.GROUP or meta is None:
            n_clusters = cfg.kmeans_clusters or default_clusters(k.shape[2])
            init = meta.centroids if meta is not None and meta.centroids.shape[2] == n_clusters else None
            iters = cfg.kmeans_iters if init is not None else cfg.kmeans_init_iters
            km = impl.kmeans.kmeans_perm(v, n_clusters, iters, init=init)
            meta = VSmoothMeta(perm=km.perm, centroids=km.centroids)
        perm = meta.perm
    qk = impl.preprocess.preprocess_qk(q, k, perm, sm_scale=sm_scale, hadamard=cfg.hadamard,
                                       qk_format=cfg.qk_format.value)
    vq = impl.preprocess.preprocess_v(v, perm, smooth=cfg.smooth_v)
    out = impl.vsmooth_attn.vsmooth_attention(qk, vq, expcast=cfg.expcast, out_dtype=q.dtype)
    return out, meta
