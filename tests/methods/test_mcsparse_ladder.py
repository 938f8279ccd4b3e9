"""MC-Sparse ablation switches (the ladder of the paper's Table 5): selection variants against brute force,
'none' grouping, density 1.0 of every rung, residual 'none' vs 'bf16', options and the runner's ladder.

Brute force = the full S x Sk logits / probabilities in fp64 with explicit per-group, per-block loops and
the block rule written out in Python (rank blocks by score, take the first n_keep keys in that order).
Selections are compared as sets; a difference is accepted only for an exact near-tie of the scores
(fp32 scoring vs fp64 brute force), as in tests/kernels/test_select.py.
"""
import dataclasses

import pytest
import torch

from conftest import KERNEL_DEVICE, requires_cuda
from vc_compile.config import (QueryGrouping, Selection, SelectionRefresh, SelectionUnit, VCConfig,
                               VCConfigError)
from vc_compile import formats, torch_ops
from vc_compile.methods import Phase
from vc_compile.methods import mcsparse as M
from vc_compile.reference import select as R
from vc_compile.reference.dense import dense_attention_lse
from vc_compile.kernels import dispatch

DEV = KERNEL_DEVICE
BLK = formats.KV_TILE


assert dispatch.triton_error() is None, dispatch.triton_error()
IMPLS = [("reference", dispatch.Impl.REFERENCE), ("triton", dispatch.Impl.TRITON)]


def inputs(S, Sk, D, dtype, seed=0, perm=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, S, D, generator=g) * 1.5
    k = torch.randn(1, 2, Sk, D, generator=g) + 2.0 * torch.randn(1, 1, 1, D, generator=g)
    v = torch.randn(1, 2, Sk, D, generator=g)
    sigma = (torch.stack([torch.randperm(S, generator=g) for _ in range(2)]).view(1, 2, S) if perm
             else torch_ops.identity_perm(1, 2, S, "cpu"))
    return q.to(dtype), k.to(dtype), v.to(dtype), sigma


def block_rule(scores_row, keep, Sk):
    """Python statement of the block rule: blocks by descending score, their keys in order, first keep."""
    ranked = sorted(range(len(scores_row)), key=lambda b: -float(scores_row[b]))
    toks = [j for b in ranked for j in range(b * BLK, min((b + 1) * BLK, Sk))]
    return set(toks[:keep])


def check_blocks(idx, scores, keep, Sk, C, S, tol):
    """idx [1, 2, G, keep] against the brute-force rule on fp64 ``scores[h][g] -> per-block list``."""
    G = -(-S // C)
    assert idx.shape == (1, 2, G, keep) and idx.dtype == torch.int32
    assert (idx[..., 1:] > idx[..., :-1]).all()  # ascending, distinct
    for h in range(2):
        for g in range(G):
            got = set(idx[0, h, g].cpu().tolist())
            want = block_rule(scores[h][g], keep, Sk)
            if got != want:  # only near-ties of block scores may swap
                sc = torch.tensor(scores[h][g])
                thr = torch.sort(sc, descending=True).values[keep // BLK - 1]
                for j in got ^ want:
                    assert abs(sc[j // BLK] - thr) <= tol * abs(thr), (h, g, j)


def brute_mean_pool(q, k, sigma, C, sm_scale):
    S, Sk = q.shape[2], k.shape[2]
    NB = -(-Sk // BLK)
    out = []
    for h in range(2):
        rows = []
        for g in range(-(-S // C)):
            qm = q[0, h, sigma[0, h, g * C:(g + 1) * C]].double().mean(0)
            rows.append([float(qm @ k[0, h, b * BLK:(b + 1) * BLK].double().mean(0)) * sm_scale
                         for b in range(NB)])
        out.append(rows)
    return out


def brute_exact_block(q, k, sigma, C, sm_scale):
    S, Sk = q.shape[2], k.shape[2]
    NB = -(-Sk // BLK)
    p = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * sm_scale, dim=-1)
    out = []
    for h in range(2):
        rows = []
        for g in range(-(-S // C)):
            m = p[0, h, sigma[0, h, g * C:(g + 1) * C]].sum(0)
            rows.append([float(m[b * BLK:(b + 1) * BLK].sum()) for b in range(NB)])
        out.append(rows)
    return out


@pytest.mark.parametrize("name,impl", IMPLS, ids=[n for n, _ in IMPLS])
@pytest.mark.parametrize("S,Sk,density,perm", [(200, 256, 0.25, False), (333, 333, 0.3, True),
                                               (130, 330, 0.2, False)])
def test_mean_pool_block_selection_is_bruteforce(name, impl, S, Sk, density, perm):
    D, C = 64, 64
    q, k, _, sigma = inputs(S, Sk, D, torch.bfloat16, perm=perm)
    keep = formats.n_keep(Sk, density)
    dev = DEV if name == "triton" else "cpu"
    idx = M.select(impl, q.to(dev), k.to(dev), sigma.to(dev), None, sm_scale=D ** -0.5, group_size=C,
                   keep=keep, selection=Selection.MEAN_POOL, unit=SelectionUnit.BLOCK)
    check_blocks(idx, brute_mean_pool(q, k, sigma, C, D ** -0.5), keep, Sk, C, S, tol=1e-4)


@pytest.mark.parametrize("name,impl", IMPLS, ids=[n for n, _ in IMPLS])
@pytest.mark.parametrize("S,Sk,density,perm", [(200, 256, 0.25, False), (333, 333, 0.3, True)])
def test_exact_block_selection_is_bruteforce(name, impl, S, Sk, density, perm):
    D, C = 64, 64
    q, k, v, sigma = inputs(S, Sk, D, torch.bfloat16, perm=perm)
    _, lse2 = dense_attention_lse(q, k, v, sm_scale=D ** -0.5)
    keep = formats.n_keep(Sk, density)
    dev = DEV if name == "triton" else "cpu"
    idx = M.select(impl, q.to(dev), k.to(dev), sigma.to(dev), lse2.to(dev), sm_scale=D ** -0.5,
                   group_size=C, keep=keep, selection=Selection.EXACT, unit=SelectionUnit.BLOCK)
    check_blocks(idx, brute_exact_block(q, k, sigma, C, D ** -0.5), keep, Sk, C, S, tol=1e-4)


def test_mean_pool_token_selection_is_bruteforce():
    S, D, C = 200, 64, 64
    q, k, _, sigma = inputs(S, S, D, torch.float32)
    keep = formats.n_keep(S, 0.3)
    idx = M.select(dispatch.Impl.REFERENCE, q, k, sigma, None, sm_scale=D ** -0.5, group_size=C, keep=keep,
                   selection=Selection.MEAN_POOL, unit=SelectionUnit.TOKEN)
    for h in range(2):
        for g in range(-(-S // C)):
            s = k[0, h].double() @ q[0, h, sigma[0, h, g * C:(g + 1) * C]].double().mean(0)
            assert set(idx[0, h, g].tolist()) == set(torch.topk(s, keep).indices.tolist())


def test_expand_blocks_partial_block_rule():
    # Sk = 150: blocks [0, 64), [64, 128), [128, 150) (22 keys); keep = 128
    scores = torch.tensor([[[[0.1, 0.5, 0.9]]]])
    idx = torch_ops.expand_blocks(scores, 128, 150)
    # blocks by score: 2 (22 keys), 1 (64 keys), then the first 42 keys of block 0
    want = list(range(0, 42)) + list(range(64, 128)) + list(range(128, 150))
    assert idx.shape == (1, 1, 1, 128) and idx[0, 0, 0].tolist() == want
    assert torch_ops.expand_blocks(scores, 150, 150)[0, 0, 0].tolist() == list(range(150))  # keep = Sk: all keys
    idx = torch_ops.expand_blocks(torch.tensor([[[[0.9, 0.1, 0.5]]]]), 64, 150)
    assert idx[0, 0, 0].tolist() == list(range(64))  # a full block: exactly that block


def test_block_mass_and_group_means():
    mass = torch.rand(1, 2, 3, 150)
    bm = torch_ops.block_mass(mass, 64)
    assert bm.shape == (1, 2, 3, 3)
    assert torch.allclose(bm[..., 2], mass[..., 128:].sum(-1)) and torch.allclose(bm.sum(-1), mass.sum(-1))


@pytest.mark.parametrize("name,impl", IMPLS, ids=[n for n, _ in IMPLS])
def test_none_grouping_is_identity(name, impl):
    q = torch.randn(1, 2, 200, 64, dtype=torch.bfloat16, device=DEV if name == "triton" else "cpu")
    cfg = VCConfig(method="mcsparse", experimental={"query_grouping": QueryGrouping.NONE})
    sigma = M.query_order(impl, q, cfg)
    assert sigma.dtype == torch.int64 and sigma.shape == (1, 2, 200)
    assert torch.equal(sigma.cpu(), torch.arange(200).expand(1, 2, 200))
    pd = M.query_order(impl, q, VCConfig(method="mcsparse"))  # the default is PDDP, not the identity
    assert torch.equal(pd.sort(-1).values.cpu(), torch.arange(200).expand(1, 2, 200))
    assert not torch.equal(pd.cpu(), sigma.cpu())


def rung(residual=None, **experimental):
    """A rung's options: the residual (a user option) and the ablation knobs (``experimental``)."""
    return {**({"residual": residual} if residual else {}), **({"experimental": experimental} if experimental else {})}


RUNGS = {
    "1-bsa-meanpool": rung("none", selection="mean_pool", selection_unit="block", query_grouping="none",
                           selection_refresh="every_step"),
    "1b-bsa-meanpool-reused": rung("none", selection="mean_pool", selection_unit="block", query_grouping="none"),
    "2-bsa-exact": rung("none", selection_unit="block", query_grouping="none"),
    "3-token": rung("none", query_grouping="none"),
    "4-pddp": rung("none"),
    "5-residual": rung(),
    "mean_pool-token-pddp-residual": rung(selection="mean_pool"),
}


def _anchor_then_reuse(impl, q, k, v, cfg, sm):
    out_a, meta = M.run(q, k, v, phase=Phase.ANCHOR, meta=None, cfg=cfg, sm_scale=sm, impl=impl)
    out_r, meta2 = M.run(q, k, v, phase=Phase.REUSE, meta=meta, cfg=cfg, sm_scale=sm, impl=impl)
    assert meta2 is meta
    return out_a, out_r, meta


@pytest.mark.parametrize("rung", list(RUNGS))
@pytest.mark.parametrize("name,impl", IMPLS, ids=[n for n, _ in IMPLS])
def test_density_one_equals_dense(rung, name, impl):
    """At density 1 every rung keeps every key: anchor and reuse outputs are dense attention.

    Tolerances: reference path in fp32 vs fp64 dense, 1e-5 (fp32 accumulation over <= 330 keys).
    Triton (interpreter) in bf16: the output is rounded to bf16 (rel. 2^-9) and P is cast to bf16 before
    the PV product (rel. 2^-9 per term), so 2e-2 absolute on O(1) outputs (values ~N(0, 1))."""
    S, Sk, D = 130, 330, 64
    dtype = torch.float32 if name == "reference" else torch.bfloat16
    dev = "cpu" if name == "reference" else DEV
    q, k, v, _ = inputs(S, Sk, D, dtype)
    ref = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * D ** -0.5, -1) @ v.double()
    cfg = VCConfig.from_options({"method": "mcsparse", "density": 1.0, **RUNGS[rung]})
    out_a, out_r, meta = _anchor_then_reuse(impl, *(t.to(dev) for t in (q, k, v)), cfg, D ** -0.5)
    assert meta.idx.shape[-1] == Sk and meta.density == 1.0
    tol = 1e-5 if name == "reference" else 2e-2
    for o in (out_a, out_r):
        assert o.dtype == dtype and o.shape == (1, 2, S, D)
        assert (o.double().cpu() - ref).abs().max() <= tol


@pytest.mark.parametrize("name,impl", IMPLS, ids=[n for n, _ in IMPLS])
def test_residual_none_vs_bf16(name, impl):
    """Same selection either way; 'none' caches no residual and its reuse step is the plain sparse output;
    'bf16' adds R = O_dense - O_sparse, so reusing on the anchor's own inputs gives O_dense back (up to R's
    bf16 rounding: |R| <~ 1, rel. 2^-9, and the bf16 output rounding)."""
    S, D = 200, 64
    dtype = torch.float32 if name == "reference" else torch.bfloat16
    dev = "cpu" if name == "reference" else DEV
    q, k, v, _ = inputs(S, S, D, dtype)
    q, k, v = (t.to(dev) for t in (q, k, v))
    sm = D ** -0.5
    base = {"method": "mcsparse", "density": 0.3, "residual": "bf16", "experimental": {"query_grouping": "none"}}
    a_none, r_none, m_none = _anchor_then_reuse(impl, q, k, v, VCConfig.from_options({**base, "residual": "none"}), sm)
    a_res, r_res, m_res = _anchor_then_reuse(impl, q, k, v, VCConfig.from_options(base), sm)
    assert m_none.residual is None and m_res.residual is not None and m_res.residual.dtype == torch.bfloat16
    assert torch.equal(m_none.idx, m_res.idx) and torch.equal(m_none.sigma, m_res.sigma)
    assert torch.equal(a_none, a_res)  # the anchor returns O_dense either way
    C = VCConfig.from_options(base).group_size
    sparse = dispatch.sparse_attention(impl, q, k, v, m_none.sigma, m_none.idx, sm_scale=sm, group_size=C,
                                       run=m_none.run)
    assert torch.allclose(r_none.float(), sparse.float(), atol=1e-6)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    assert (r_res.float() - a_res.float()).abs().max() <= tol  # O_sparse + R == O_dense
    assert (r_none.float() - a_none.float()).abs().max() > 10 * tol  # without R it is not dense
    want_r = (r_res.float() - r_none.float())
    assert torch.allclose(want_r, m_res.residual.float(), atol=tol)


def test_residual_storage_int8_is_closer_than_fp8():
    """The residual kept as 8-bit codes with one scale a token: on the anchor's own inputs a reuse step is O_sparse +
    R's stored form, so its distance from the anchor's output is the storage error alone. int8 (the default) keeps
    it well below FP8 E4M3's (3 mantissa bits: up to 2^-4 relative per element, against half a step of amax / 127),
    and within 5x bf16's (a step of amax / 127 against bf16's 2^-9 relative: 3.8x measured); fp64 reference path,
    so nothing else rounds."""
    S, D = 256, 64
    q, k, v, _ = inputs(S, S, D, torch.float64)
    errs = {}
    for res in ("bf16", "int8", "fp8"):
        cfg = VCConfig.from_options({"method": "mcsparse", "density": 0.25, "residual": res, "key_run": 8})
        a, r, meta = _anchor_then_reuse(dispatch.Impl.REFERENCE, q, k, v, cfg, D ** -0.5)
        assert meta.run == 8 and meta.idx.dtype == torch.int16 and meta.sigma.dtype == torch.int32
        errs[res] = ((r.double() - a.double()).norm() / a.double().norm()).item()
    assert errs["int8"] < 0.5 * errs["fp8"], errs
    assert errs["int8"] < 5 * errs["bf16"], errs


def test_key_runs_where_the_keys_are_whole_runs():
    """Key by key by default where no memory plan says otherwise; 8-key runs where asked (key_run, or the plan's
    run) and Sk and the kept count are whole runs; key by key otherwise; the 64-key block ablation as runs of 64
    (the same keys its blocks expanded to ids give) where the blocks are whole, key ids otherwise; run numbers in
    int16 while they fit."""
    assert M.run_for(VCConfig(), 304, 128) == 1 and M.run_for(VCConfig(), 304, 128, run=8) == 8
    cfg = VCConfig(key_run=8)
    assert M.run_for(cfg, 304, 128) == 8 and M.run_for(cfg, 300, 128) == 1 and M.run_for(cfg, 304, 100) == 1
    assert M.run_for(VCConfig(key_run=1), 304, 128) == 1 and M.run_for(VCConfig(key_run=64), 320, 128) == 64
    block = VCConfig.from_options({"experimental": {"selection_unit": "block"}})
    assert M.run_for(block, 304, 128) == 1 and M.run_for(block, 320, 128) == M.run_for(block, 320, 128, 8) == 64
    q, k, _, sigma = inputs(256, 256, 64, torch.float32)
    kw = dict(sm_scale=0.125, group_size=64, keep=128, selection=Selection.MEAN_POOL, unit=SelectionUnit.BLOCK)
    ids = M.select(dispatch.Impl.REFERENCE, q, k, sigma, None, **kw)
    runs = M.select(dispatch.Impl.REFERENCE, q, k, sigma, None, run=64, **kw)
    assert runs.shape[-1] == 2 and torch.equal(torch_ops.expand_runs(runs, 64), ids.long())
    assert torch_ops.run_id_dtype(75600, 8) == torch.int16 and torch_ops.run_id_dtype(75600, 1) == torch.int32
    assert torch_ops.run_id_dtype(8 * 32767, 8) == torch.int16 and torch_ops.run_id_dtype(8 * 32768, 8) == torch.int32


def test_every_step_reselects_from_current_inputs():
    impl = dispatch.Impl.REFERENCE
    S, D = 256, 64
    q, k, v, _ = inputs(S, S, D, torch.float32)
    cfg = VCConfig.from_options({"method": "mcsparse", "density": 0.25, **RUNGS["1-bsa-meanpool"]})
    _, meta = M.run(q, k, v, phase=Phase.ANCHOR, meta=None, cfg=cfg, sm_scale=D ** -0.5, impl=impl)
    q2, k2, v2, _ = inputs(S, S, D, torch.float32, seed=1)
    out, meta2 = M.run(q2, k2, v2, phase=Phase.REUSE, meta=meta, cfg=cfg, sm_scale=D ** -0.5, impl=impl)
    assert meta.run == 64  # the blocks, as runs of 64 keys
    idx2 = M.select(impl, q2, k2, meta.sigma, None, sm_scale=D ** -0.5, group_size=cfg.group_size,
                    keep=meta.idx.shape[-1] * meta.run, selection=Selection.MEAN_POOL, unit=SelectionUnit.BLOCK,
                    run=meta.run)
    assert not torch.equal(idx2, meta.idx)
    want = dispatch.sparse_attention(impl, q2, k2, v2, meta.sigma, idx2, sm_scale=D ** -0.5,
                                     group_size=cfg.group_size, run=meta.run)
    assert torch.allclose(out, want, atol=1e-6)
    # 'anchor' refresh reuses the anchor's selection instead
    cfg_a = dataclasses.replace(cfg, experimental=dataclasses.replace(cfg.experimental,
                                                                      selection_refresh=SelectionRefresh.ANCHOR))
    out_a, _ = M.run(q2, k2, v2, phase=Phase.REUSE, meta=meta, cfg=cfg_a, sm_scale=D ** -0.5, impl=impl)
    want_a = dispatch.sparse_attention(impl, q2, k2, v2, meta.sigma, meta.idx, sm_scale=D ** -0.5,
                                       group_size=cfg.group_size, run=meta.run)
    assert torch.allclose(out_a, want_a, atol=1e-6)


def test_options_defaults_validation_and_roundtrip():
    cfg = VCConfig()
    ex = cfg.experimental
    assert (ex.selection, ex.selection_unit, ex.query_grouping, ex.selection_refresh, cfg.residual, cfg.key_run) == (
        Selection.EXACT, SelectionUnit.TOKEN, QueryGrouping.PDDP, SelectionRefresh.ANCHOR, "int8", None)
    for bad in (0, 3, 128):
        with pytest.raises(VCConfigError, match="key_run"):
            VCConfig(key_run=bad)
    assert all(isinstance(e, str) for e in (Selection.EXACT, SelectionUnit.BLOCK, QueryGrouping.NONE))
    for rung in RUNGS.values():
        c = VCConfig.from_options({"method": "mcsparse", **rung})
        assert VCConfig.from_json(c.to_json()) == c
    for key, bad in (("selection", "topk"), ("selection_unit", "tile"), ("query_grouping", "kmeans"),
                     ("selection_refresh", "always")):
        with pytest.raises(VCConfigError, match=key):
            VCConfig.from_options({"experimental": {key: bad}})
    with pytest.raises(VCConfigError, match="needs experimental\\['selection'\\]='mean_pool'"):
        VCConfig.from_options({"experimental": {"selection_refresh": "every_step"}, "residual": "none"})
    with pytest.raises(VCConfigError, match="needs residual='none'"):
        VCConfig.from_options({"experimental": {"selection_refresh": "every_step", "selection": "mean_pool"}})


def test_path_label_names_torch_parts():
    trit = "triton"
    full = VCConfig(method="mcsparse")
    assert M.path_label(trit, Phase.ANCHOR, full) == trit and M.path_label(trit, Phase.REUSE, full) == trit
    bsa = VCConfig.from_options({"method": "mcsparse", **RUNGS["1-bsa-meanpool"]})
    assert M.path_label(trit, Phase.REUSE, bsa) == "triton+torch:mean_pool_select"
    blk = VCConfig.from_options({"method": "mcsparse", **RUNGS["2-bsa-exact"]})
    assert M.path_label(trit, Phase.ANCHOR, blk) == "triton+torch:block_select"
    assert M.path_label(trit, Phase.REUSE, blk) == trit  # reuse: the gather kernel only
    assert M.path_label("reference", Phase.ANCHOR, bsa) == "reference"


def test_runner_ladder_rungs():
    from vc_compile.demo.runner import LADDER, ladder_methods

    rows = ladder_methods((0.15, 0.25))
    assert len(rows) == 2 * len(LADDER)
    labels = [lab for lab, _ in rows]
    assert len(set(labels)) == len(labels)
    for lab, opts in rows:
        VCConfig.from_options(opts)  # valid
    # the last rung is the full method: the default options
    full = dict(rows)[[lab for lab in labels if lab.startswith("L5")][0]]
    assert VCConfig.from_options(full) == VCConfig.from_options({"method": "mcsparse", "density": full["density"]})


@requires_cuda
def test_ladder_rungs_run_triton_on_cuda():
    """Every rung runs the gather kernel on CUDA (no reference fallback)."""
    S, D = 1024, 128
    q, k, v, _ = inputs(S, S, D, torch.bfloat16)
    q, k, v = (t.cuda() for t in (q, k, v))
    for rung, opts in RUNGS.items():
        cfg = VCConfig.from_options({"method": "mcsparse", "density": 0.25, **opts})
        impl, path = dispatch.choose("mcsparse", cfg.experimental.kernels, M.needs_fp8(cfg), q.device)
        assert path == "triton"
        out_a, out_r, meta = _anchor_then_reuse(impl, q, k, v, cfg, D ** -0.5)
        assert torch.isfinite(out_r).all() and meta.idx.is_cuda
