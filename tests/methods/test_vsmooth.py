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


def _cfg_steps(opts, steps, n=10, S=256, sharp_first=()):
    """``steps`` steps of an n-step generation at a new site, two CFG branches a step (the second's V a little
    off the first's, as the two branches of a DiT step are); in the steps of ``sharp_first`` the first branch's
    q is scaled x 64 (too sharp for the 8-bit path: stock SDPA). Returns (site, k-means calls per step, the
    grouping each branch holds after each step, outputs)."""
    import vc_compile
    from vc_compile.runtime import report as _report
    from vc_compile.runtime import state

    cfg = VCConfig.from_options({"method": "vsmooth", "num_steps": n, "min_seq_len": 1,
                                 "experimental": {"kernels": "reference"}, **opts})
    site = _report.register_site(graph="share", node=str(sorted(opts.items())), module="m", shape="?",
                                 dtype="?", method="vsmooth", rewritten=True).site
    calls, held, outs = [], [], []
    real = dispatch.kmeans_perm

    def spy(*a, **kw):
        calls[-1] += 1
        return real(*a, **kw)

    g = torch.Generator().manual_seed(0)
    with pytest.MonkeyPatch.context() as mp, vc_compile.sampling(num_steps=n):
        mp.setattr(dispatch, "kmeans_perm", spy)
        for i in range(steps):
            vc_compile.step(i)
            calls.append(0)
            q, k, v = (torch.randn(1, 2, S, 64, generator=g) for _ in range(3))
            for b in range(2):
                vb = v + 0.1 * b * torch.randn(v.shape, generator=g)
                qb = q * (64 if b == 0 and i in sharp_first else 1)
                outs.append(torch.ops.vcattn.attention(*(x.to(torch.bfloat16) for x in (qb, k, vb)), None, site,
                                                       cfg.to_json(), None))
            metas = {key[2]: m for key, m in state.items() if key[0] == site}
            held.append((metas.get(0), metas.get(1)))
    return site, calls, held, outs


def test_cfg_branches_share_one_grouping_per_grouping_step():
    """``share_grouping`` (the default): a grouping step runs k-means once, in the first CFG branch; the second
    holds that same grouping and reuses it to the next grouping step. Off: one k-means per branch."""
    from vc_compile.runtime import report as _report

    site, calls, held, _ = _cfg_steps({"group_interval": 10}, 12)  # group steps 0 and 10
    assert calls == [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    assert all(a is b for a, b in held)
    assert held[9][0] is held[0][0] and held[10][0] is not held[0][0]
    assert _report.site(site).phases["group"] == 2 and _report.site(site).phases["reuse"] == 22
    _, calls, held, _ = _cfg_steps({"group_interval": 10, "share_grouping": False}, 12)
    assert calls == [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0]
    assert all(a is not b for a, b in held)


def test_a_shared_grouping_is_never_older_than_the_branchs_own():
    """A later branch takes the first branch's grouping only where it is newer than its own (the first re-grouped
    in this step): where the first made none (its grouping dropped, or older), the branch groups its own V."""
    class Slots:
        def __init__(self, branch, own, first):
            self.branch, self.own, self.first = branch, own, first

        def __call__(self, suffix):
            return self.own

        def of_branch(self, b, suffix=()):
            return self.first

    cfg = VCConfig.from_options({"method": "vsmooth", "group_interval": 10})
    old, new = (vsmooth.VSmoothMeta(perm=torch.zeros(1), centroids=torch.zeros(1)) for _ in range(2))
    p = vsmooth.plan(cfg, 10, 50, Slots(1, old, new), None, None, None, None)  # a grouping step, first re-grouped
    assert p.phase == Phase.REUSE and p.meta is new and p.borrowed
    for own, first in ((new, old), (new, new), (old, None)):
        p = vsmooth.plan(cfg, 10, 50, Slots(1, own, first), None, None, None, None)
        assert p.phase == Phase.GROUP and p.meta is own and not p.borrowed
    p = vsmooth.plan(cfg, 10, 50, Slots(0, old, new), None, None, None, None)  # the first branch groups itself
    assert p.phase == Phase.GROUP and p.meta is old
    p = vsmooth.plan(cfg, 11, 50, Slots(1, old, new), None, None, None, None)  # not a grouping step: its own
    assert p.phase == Phase.REUSE and p.meta is old and not p.borrowed
    off = VCConfig.from_options({"method": "vsmooth", "group_interval": 10, "share_grouping": False})
    assert vsmooth.plan(off, 10, 50, Slots(1, old, new), None, None, None, None).phase == Phase.GROUP
