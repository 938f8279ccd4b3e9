"""V-Smooth's method module (``methods/vsmooth.py``): how its grouping step calls k-means."""
import pytest
import torch

from vc_compile.config import VCConfig
from vc_compile.kernels import dispatch
from vc_compile.methods import vsmooth
from vc_compile.methods.phase import Phase


@pytest.mark.parametrize("S, option, stride", [(4096, None, 4), (4096, 1, 1), (4096, 16, 4), (1000, None, 3)])
def test_grouping_iterates_on_the_sampled_rows(monkeypatch, S, option, stride):
    """The group step hands k-means the option's row stride, lowered to keep >= 32 rows a cluster
    (4096 tokens: 32 clusters, stride <= 4; 1000 tokens: 8 clusters, stride <= 3); the reuse step after it
    runs no k-means and keeps the grouping."""
    seen = []
    real = dispatch.kmeans_perm

    def spy(impl, x, n_clusters, n_iters, init=None, sample=1):
        seen.append((n_clusters, n_iters, sample))
        return real(impl, x, n_clusters, n_iters, init=init, sample=sample)

    monkeypatch.setattr(dispatch, "kmeans_perm", spy)
    opts = {"method": "vsmooth", "experimental": {"kernels": "reference"}}
    if option is not None:
        opts["experimental"]["kmeans_sample"] = option
    cfg = VCConfig.from_options(opts)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, S, 64, generator=g, dtype=torch.float32).to(torch.bfloat16) for _ in range(3))
    out, meta = vsmooth.run(q, k, v, phase=Phase.GROUP, meta=None, cfg=cfg, sm_scale=0.125,
                            impl=dispatch.Impl.REFERENCE)
    assert seen == [(cfg.kmeans_clusters or (S + 127) // 128, cfg.experimental.kmeans_init_iters, stride)]
    out2, meta2 = vsmooth.run(q, k, v, phase=Phase.REUSE, meta=meta, cfg=cfg, sm_scale=0.125,
                              impl=dispatch.Impl.REFERENCE)
    assert len(seen) == 1 and meta2 is meta
    assert torch.equal(out2, out)  # same inputs, same grouping: the same output
