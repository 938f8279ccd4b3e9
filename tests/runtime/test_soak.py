"""State and memory over many generations: nothing vcattn keeps outlives the model or the
generation it belongs to, and nothing grows with the number of generations.

The CI run is short (``VC_SOAK_GENERATIONS``, default 4, of 3 steps on a 2-block TinyDiT, eager
compiler, reference kernels); ``benchmarks/bench_soak.py`` is the long version that prints memory per
generation.
"""
import gc
import os

import pytest
import torch

import vc_compile
from vc_compile import ops
from vc_compile.config import VCConfig
from vc_compile.runtime import report as _report
from vc_compile.runtime import state
from vc_compile.methods import mcsparse as M_mcsparse
from vc_compile.runtime.steps import TRACKER

import tiny_dit  # noqa: E402

GENERATIONS = int(os.environ.get("VC_SOAK_GENERATIONS", "4"))
STEPS = 3
OPTS = {"experimental": {"compiler": "eager", "kernels": "reference"}, "min_seq_len": 64}
METHOD_OPTS = {
    "vsmooth": {"method": "vsmooth", "group_fraction": 0.34},
    "mcsparse": {"method": "mcsparse", "warmup_steps": 0, "anchor_steps": (0,), "density": 0.3},
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def site_keys(sites):
    sites = set(sites)
    return [k for k in state.keys() if k[0] in sites]


def new_sites(before):
    return [s.site for s in vc_compile.report().sites if s.site not in before and s.rewritten]


def make_model(method, seed=0, seq=160, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    m, x, ctx = tiny_dit.make(dtype=dtype, seq=seq)
    if seed:  # other weights than tiny_dit's fixed seed
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * torch.randn_like(p))
    before = {s.site for s in vc_compile.report().sites}
    cm = torch.compile(m, backend="vcattn", options={**OPTS, **METHOD_OPTS[method]})
    return m, cm, x, ctx, before


def generate(cm, x, ctx, steps=STEPS):
    with torch.no_grad(), vc_compile.sampling(num_steps=steps):
        for i in range(steps):
            vc_compile.step(i)
            y = cm(x, ctx)
    return y


@pytest.fixture(autouse=True)
def _fresh():
    vc_compile.reset()
    torch._dynamo.reset()
    gc.collect()
    yield
    vc_compile.reset()


@pytest.mark.parametrize("method", list(METHOD_OPTS))
def test_many_generations_hold_flat_memory(method):
    """After every generation the metadata, the tracker's tables, the report and the process RSS are the
    same size as after the first: nothing accumulates per generation."""
    m, cm, x, ctx, before = make_model(method)
    rows = []
    for g in range(GENERATIONS):
        y = generate(cm, x, ctx)
        assert torch.isfinite(y).all()
        gc.collect()
        rows.append(dict(bytes=state.bytes_held(), keys=len(state.keys()), sites=len(vc_compile.report().sites),
                         branch=len(TRACKER.branch_seen), watched=len(ops._WATCHED),
                         cfg_cache=ops._config.cache_info().currsize, rss=rss_bytes()))
    first = rows[0]
    assert first["bytes"] > 0 and first["keys"] == 2  # 2 self-attention blocks, one branch each
    for g, r in enumerate(rows[1:], 1):
        for key in ("bytes", "keys", "sites", "branch", "watched", "cfg_cache"):
            assert r[key] == first[key], f"generation {g}: {key} {first[key]} -> {r[key]}"
    # RSS: allocator noise only. Each generation allocates and frees ~0.5 MB of metadata; 32 MB of growth
    # over the run would be a leak of ~all of it every generation.
    growth = rows[-1]["rss"] - rows[1]["rss"]
    assert growth < 32 * 2**20, f"RSS grew by {growth / 2**20:.1f} MB over {GENERATIONS - 1} generations"
    sites = set(new_sites(before))
    rec = [s for s in vc_compile.report().sites if s.site in sites]
    assert len(rec) == 2 and all(s.calls == GENERATIONS * STEPS for s in rec)
    assert sum(s.bytes_held for s in rec) == state.bytes_held()  # the report's per-site bytes agree


def test_two_models_never_share_metadata():
    """Two models with other weights compiled alike share Dynamo's graph (and so its call sites): their
    metadata is kept apart by the block identity, so interleaving them changes nothing for either."""
    mA, cA, x, ctx, _ = make_model("mcsparse", seed=0)
    mB, cB, _, _, _ = make_model("mcsparse", seed=1)

    def steps(models):
        outs = []
        with torch.no_grad(), vc_compile.sampling(num_steps=STEPS):
            for i in range(STEPS):
                vc_compile.step(i)
                outs.append([cm(x, ctx) for cm in models])
        return outs

    alone_a = [o[0] for o in steps([cA])]
    alone_b = [o[0] for o in steps([cB])]
    both = steps([cA, cB])
    for i in range(STEPS):
        assert torch.equal(both[i][0], alone_a[i]) and torch.equal(both[i][1], alone_b[i]), f"step {i}"
    assert not torch.equal(alone_a[-1], alone_b[-1])
    idents = {k[1] for k in state.keys()}
    assert len(idents) == 4  # 2 blocks x 2 models, each keyed by its own weight

def test_deleting_the_model_frees_its_metadata():
    """Regression: a deleted model's metadata (MC-Sparse residuals: GBs on a real model) stayed until
    some later call started a new generation, e.g. while the next model was being loaded. Now the
    block's weight dying drops it at once."""
    m, cm, x, ctx, before = make_model("mcsparse")
    m2, cm2, _, _, _ = make_model("mcsparse", seed=1)
    with torch.no_grad(), vc_compile.sampling(num_steps=STEPS):
        for i in range(STEPS):
            vc_compile.step(i)
            cm(x, ctx)
            cm2(x, ctx)
    ptrs1 = {b.q.weight.data_ptr() for b in m.blocks}
    ptrs2 = {b.q.weight.data_ptr() for b in m2.blocks}
    held_2 = sum(state.nbytes(state.get(k)) for k in state.keys() if k[1] in ptrs2)
    assert state.bytes_held() > held_2 > 0
    del m, cm
    gc.collect()
    assert state.bytes_held() == held_2, "the deleted model's metadata is still held"
    sites = set(new_sites(before))
    assert sum(s.bytes_held for s in vc_compile.report().sites if s.site in sites) == held_2
    del m2, cm2
    gc.collect()
    assert state.bytes_held() == 0
    # no entry of these blocks is left, nor one whose weight is dead (models of other tests may still live)
    assert not [b for b in ops._WATCHED if b[1] in ptrs1 | ptrs2]
    assert not [b for b, e in ops._WATCHED.items() if e.ref() is None]


def test_a_late_finalizer_spares_the_newer_weight_at_its_address():
    """A weight freed while the state lock was held has its finalizer queued; if a new weight has
    meanwhile been watched at the same (site, address), draining the queue must not drop the new
    weight's entry or metadata, and the new weight's own deletion must still free them."""
    old = torch.nn.Parameter(torch.zeros(4))
    new = torch.nn.Parameter(torch.zeros(4))
    block = (987654, 11)
    key_old, key_new = block + ("old",), block + ("new",)
    state.put(key_old, torch.zeros(8))
    ops._watch(old, key_old)
    stale = ops._WATCHED[block]
    # the old weight's death is queued, not drained (as under a held lock); the new one takes its place
    ops._FREED.append((block, stale))
    state.put(key_new, torch.zeros(8))
    ops._watch(new, key_new)
    assert ops._WATCHED[block] is not stale and ops._WATCHED[block].ref() is new
    assert state.get(key_old) is None, "the replaced weight's metadata outlived it"
    ops._drain_freed()
    assert ops._WATCHED[block].ref() is new and state.get(key_new) is not None
    del new
    gc.collect()
    assert block not in ops._WATCHED and state.get(key_new) is None

def test_dynamo_reset_and_recompile():
    """After ``torch._dynamo.reset()`` the model recompiles into the same call sites (site identity is
    the call site, ``passes/sdpa_rewrite._site_keys``), so the metadata held neither grows nor leaves
    orphaned sites behind, however often it recompiles."""
    m, cm, x, ctx, before = make_model("vsmooth")
    generate(cm, x, ctx)
    one = state.bytes_held()
    sites = set(new_sites(before))
    assert sites and one > 0
    for _ in range(2):
        torch._dynamo.reset()
        n_before = len(vc_compile.report().sites)
        cm = torch.compile(m, backend="vcattn", options={**OPTS, **METHOD_OPTS["vsmooth"]})
        generate(cm, x, ctx)
        assert len(vc_compile.report().sites) == n_before, "a recompile registered new call sites"
        assert state.bytes_held() == one and {k[0] for k in state.keys()} == sites


def test_new_generation_and_new_resolution_free_the_old():
    """A new generation drops the previous one's metadata; a generation at another resolution holds only
    its own shapes."""
    site = _report.register_site(graph="soak", node="n", module="m", shape="?", dtype="?", method="mcsparse",
                                 rewritten=True).site
    cj = VCConfig.from_options({**METHOD_OPTS["mcsparse"], "min_seq_len": 1,
                                "experimental": {"kernels": "reference"}}).to_json()
    sizes = []
    for S in (160, 130, 160, 100):
        q, k, v = (torch.randn(1, 2, S, 64, dtype=torch.bfloat16) for _ in range(3))
        with vc_compile.sampling(num_steps=3):
            for i in range(3):
                vc_compile.step(i)
                torch.ops.vcattn.attention(q, k, v, None, site, cj, None)
        shapes = {k[3] for k in site_keys([site])}
        assert shapes == {(1, 2, S, 64)}
        sizes.append(state.bytes_held())
    assert sizes[0] == sizes[2] and sizes[1] < sizes[0] and sizes[3] < sizes[1]


def test_op_outside_any_sampling_context_counts_calls():
    """No ``sampling``, no ``step``, no diffusers loop, no timestep argument: every call of a site is one
    step (runtime/steps.py, signal 4), ``num_steps`` from the option, and the phases follow the schedule."""
    site = _report.register_site(graph="soak", node="n", module="m", shape="?", dtype="?", method="mcsparse",
                                 rewritten=True).site
    opts = {"method": "mcsparse", "num_steps": 5, "min_seq_len": 1, "experimental": {"kernels": "reference"},
            "density": 0.3}
    cfg = VCConfig.from_options(opts)
    q, k, v = (torch.randn(1, 2, 130, 64, dtype=torch.bfloat16) for _ in range(3))
    expected = []
    for i in range(5):
        out = torch.ops.vcattn.attention(q, k, v, None, site, cfg.to_json(), None)
        assert torch.isfinite(out).all()
        expected.append(M_mcsparse.phase_for(cfg, i, 5, i > 1).value)  # step 0 warm-up, 1 anchor, ...
    rec = _report.site(site)
    assert dict(rec.step_sources) == {"call-count": 5}
    assert sorted(rec.phases.elements()) == sorted(expected)
    assert rec.phases["warmup"] == 1 and rec.phases["anchor"] >= 1 and rec.phases["reuse"] >= 1


def test_exception_inside_the_op_leaves_the_state_usable(monkeypatch):
    """A kernel that raises (here: k-means) propagates its error; the store keeps what it had, and the next call
    runs normally and caches its metadata. An MC-Sparse anchor over the memory budget raises nothing: it keeps no
    metadata, and its reuse steps run stock SDPA until the next anchor (one warning, counted in report())."""
    from vc_compile.reference import kmeans

    site = _report.register_site(graph="soak", node="n", module="m", shape="?", dtype="?", method="vsmooth",
                                 rewritten=True).site
    cj = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 1,
                                "experimental": {"kernels": "reference"}}).to_json()
    q, k, v = (torch.randn(1, 2, 130, 64, dtype=torch.bfloat16) for _ in range(3))
    real = kmeans.kmeans_perm
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real(*a, **kw)

    monkeypatch.setattr(kmeans, "kmeans_perm", flaky)
    with vc_compile.sampling(num_steps=4):
        vc_compile.step(0)
        with pytest.raises(RuntimeError, match="simulated"):
            torch.ops.vcattn.attention(q, k, v, None, site, cj, None)
        assert site_keys([site]) == [] and state.bytes_held() == 0
        vc_compile.step(1)
        out = torch.ops.vcattn.attention(q, k, v, None, site, cj, None)
        assert torch.isfinite(out).all() and len(site_keys([site])) == 1
    held = state.bytes_held()
    # the residual budget: no exception, nothing held; stock SDPA until the next anchor
    site2 = _report.register_site(graph="soak", node="n", module="m", shape="?", dtype="?", method="mcsparse",
                                  rewritten=True).site
    cj2 = VCConfig.from_options({"method": "mcsparse", "warmup_steps": 0, "min_seq_len": 1, "anchor_steps": [0],
                                 "experimental": {"kernels": "reference"}, "residual_budget_gb": 1e-6}).to_json()
    with vc_compile.sampling(num_steps=4):
        vc_compile.step(0)
        out0 = torch.ops.vcattn.attention(q, k, v, None, site2, cj2, None)  # the anchor: the exact output
        assert torch.isfinite(out0).all() and state.bytes_held() == 0  # nothing kept
        vc_compile.step(1)
        with pytest.warns(RuntimeWarning, match="residual_budget_gb"):
            out1 = torch.ops.vcattn.attention(q, k, v, None, site2, cj2, None)
        torch.testing.assert_close(out1, torch.nn.functional.scaled_dot_product_attention(q, k, v))
        assert _report.site(site2).runtime_fallbacks[M_mcsparse.NO_ROOM] == 1 and state.bytes_held() == 0
        vc_compile.step(2)
        cj3 = VCConfig.from_options({"method": "mcsparse", "warmup_steps": 0, "min_seq_len": 1,
                                     "experimental": {"kernels": "reference"}, "residual": "none"}).to_json()
        out = torch.ops.vcattn.attention(q, k, v, None, site2, cj3, None)
        assert torch.isfinite(out).all() and len(site_keys([site2])) == 1


def test_exception_inside_a_compiled_model_then_recovers(monkeypatch):
    """The same through torch.compile: a failing step raises out of the compiled model, the next
    generation runs and matches a clean run bit for bit."""
    from vc_compile.reference import vsmooth_attn

    m, cm, x, ctx, _ = make_model("vsmooth")
    clean = generate(cm, x, ctx)
    real = vsmooth_attn.vsmooth_attention
    state_calls = {"n": 0}

    def flaky(*a, **kw):
        state_calls["n"] += 1
        if state_calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real(*a, **kw)

    monkeypatch.setattr(vsmooth_attn, "vsmooth_attention", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        generate(cm, x, ctx)
    assert torch.equal(generate(cm, x, ctx), clean)
