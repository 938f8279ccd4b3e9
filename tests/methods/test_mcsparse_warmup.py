"""MC-Sparse's warm-up steps on the 8-bit V-Smooth path (``warmup_attention``, ExpCast's softmax by default).

The warm-up's outputs are exactly what ``method="vsmooth"`` (with ``expcast=True`` for the default warm-up)
returns on the same inputs (same k-means warm start, same kernels), its grouping lives apart from the sparse metadata (dropped at the anchor), and ``warmup_attention="sdpa"``
keeps the paper's stock-SDPA warm-up bit for bit. Reference kernels (the CPU path): the Triton path runs the
same method code through the kernels' dispatch.
"""
import torch
import torch.nn.functional as F

import vc_compile
from vc_compile.config import VCConfig
from vc_compile.runtime import report as _report
from vc_compile.runtime import state

S, D = 160, 64
BASE = {"num_steps": 10, "min_seq_len": 1, "experimental": {"kernels": "reference"}, "density": 0.3}


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, S, D, generator=g).to(torch.bfloat16) for _ in range(3)]


def _site(name):
    return _report.register_site(graph="warmup", node=name, module="m", shape="?", dtype="?", method="mcsparse",
                                 rewritten=True).site


def _run(opts, steps, name, held=None):
    """``steps`` steps of a 10-step generation at a new site; ``held`` (a list) receives the metadata types
    the site holds before the generation ends (the end of ``sampling()`` drops them)."""
    cfg = VCConfig.from_options({**BASE, **opts})
    site, outs = _site(name), []
    with vc_compile.sampling(num_steps=10):
        for i in range(steps):
            vc_compile.step(i)
            q, k, v = _inputs(i)
            outs.append(torch.ops.vcattn.attention(q, k, v, None, site, cfg.to_json(), None))
        if held is not None:
            held.extend(type(m).__name__ for key, m in state.items() if key[0] == site)
    return site, outs


def test_warmup_runs_vsmooth_and_keeps_its_grouping_apart():
    vc_compile.reset(report=True)
    held = []
    site, mc = _run({"method": "mcsparse"}, 3, "mc", held)  # warm-up = 2 of 10 steps, step 2 anchors
    _, vs = _run({"method": "vsmooth", "expcast": True}, 2, "vs")  # the default warm-up: ExpCast's softmax
    for a, b in zip(mc[:2], vs):  # the same k-means warm start and kernels as method="vsmooth"
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    rec = _report.site(site)
    assert rec.phases["warmup"] == 2 and rec.phases["anchor"] == 1 and rec.phases["dense"] == 0
    assert held == ["SparseMeta"]  # the anchor dropped the warm-up's grouping
    during = []
    _run({"method": "mcsparse"}, 2, "mc-warm", during)
    assert during == ["VSmoothMeta"]  # the warm-up's grouping, in a slot of its own
    q, k, v = _inputs(0)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = ((mc[0].float() - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.05  # 8-bit, not SDPA: a V-Smooth-sized error (random inputs, D = 64)


def test_sdpa_warmup_is_stock_sdpa():
    vc_compile.reset(report=True)
    site, mc = _run({"method": "mcsparse", "warmup_attention": "sdpa"}, 2, "sdpa")
    for i, out in enumerate(mc):
        q, k, v = _inputs(i)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)
    assert _report.site(site).phases["dense"] == 2


def _warmup_groupings(opts, steps, name):
    """Outputs and, after each step, the warm-up's groupings (``VSmoothMeta``) the site holds (kept alive here,
    so that identity means the same grouping)."""
    cfg = VCConfig.from_options({**BASE, **opts})
    site, outs, ids = _site(name), [], []
    with vc_compile.sampling(num_steps=10):
        for i in range(steps):
            vc_compile.step(i)
            q, k, v = _inputs(i)
            outs.append(torch.ops.vcattn.attention(q, k, v, None, site, cfg.to_json(), None))
            ids.append([m for key, m in state.items() if key[0] == site and type(m).__name__ == "VSmoothMeta"])
    return outs, ids


def test_warmup_regroups_on_vsmooth_schedule_only():
    """A warm-up longer than ``group_fraction``'s window re-groups V on the window's steps and reuses that
    grouping after it, as method="vsmooth" does on the same steps (same outputs, bit for bit)."""
    vc_compile.reset(report=True)
    opts = {"warmup_steps": 5, "group_fraction": 0.2}  # 10 steps: group at 0, 1; reuse at 2, 3, 4
    mc, ids = _warmup_groupings({"method": "mcsparse", **opts}, 5, "mc-sched")
    _, vs = _run({"method": "vsmooth", "expcast": True, "group_fraction": 0.2}, 5, "vs-sched")
    for a, b in zip(mc, vs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(len(x) == 1 for x in ids)
    g = [x[0] for x in ids]
    assert g[0] is not g[1] and g[1] is g[2] is g[3] is g[4]  # re-grouped at step 1, then reused
    _, every = _warmup_groupings({"method": "mcsparse", "warmup_steps": 5, "group_fraction": 1.0}, 5, "mc-every")
    assert len({id(x[0]) for x in every}) == 5  # group_fraction = 1: a new grouping at every warm-up step


def test_expcast_warmup_is_vsmooth_expcast():
    """``warmup_attention="expcast"``: the warm-up runs what method="vsmooth" with expcast=True returns, bit for
    bit, and differs from the plain V-Smooth warm-up (ExpCast's codes are not exp2's)."""
    vc_compile.reset(report=True)
    _, mc = _run({"method": "mcsparse", "warmup_attention": "expcast"}, 2, "mc-ec")
    _, vs = _run({"method": "vsmooth", "expcast": True}, 2, "vs-ec")
    _, plain = _run({"method": "mcsparse", "warmup_attention": "vsmooth", "expcast": False}, 2, "mc-plain")
    for a, b, c in zip(mc, vs, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.equal(a, c)


def _layers(opts, n_sites, steps=10, tag="plan"):
    """A 10-step generation over ``n_sites`` sites (layers) called in order each step; outputs per site."""
    cfg = VCConfig.from_options({**BASE, **opts}).to_json()
    sites = [_site(f"{tag}{i}") for i in range(n_sites)]
    outs = {s: [] for s in sites}
    with vc_compile.sampling(num_steps=10):
        for i in range(steps):
            vc_compile.step(i)
            for j, s in enumerate(sites):
                q, k, v = _inputs(10 * i + j)
                outs[s].append(torch.ops.vcattn.attention(q, k, v, None, s, cfg, None))
    return sites, outs


def test_memory_plan_keeps_what_fits_and_runs_the_rest_dense_8bit():
    """Over the residual budget, the generation's first anchor plans: the first blocks in call order keep their
    metadata and run sparse, the rest run the warm-up's dense 8-bit path to the end (not stock SDPA), one warning
    says so with the figures, report() counts it per site, and nothing raises. The plan is per generation."""
    import pytest

    from vc_compile.methods import mcsparse as M

    vc_compile.reset(report=True)
    cfg = VCConfig.from_options({**BASE, "method": "mcsparse"})
    key = (0, 0, 0, (1, 2, S, D), (1, 2, S, D), "cpu")
    per_block = M.metadata_bytes(key, cfg)
    # 2 heads x (2 groups x 64 key ids, int16; int8 residual + its fp32 scale, int32 order a token)
    assert per_block == 2 * (2 * 64 * 2 + S * (D + 4 + 4))
    budget = 2.5 * per_block / 2**30
    with pytest.warns(RuntimeWarning, match="memory plan") as w:
        sites, outs = _layers({"method": "mcsparse", "residual_budget_gb": budget, "reuse_check": False}, 3)
    assert sum("memory plan" in str(x.message) for x in w) == 1
    msg = str(next(x.message for x in w if "memory plan" in str(x.message)))
    # no run fits all three: runs of 8 (the most blocks), 2 of them
    need = 3 * M.metadata_bytes(key, cfg, 8)
    assert "3 blocks" in msg and f"needs {_report.fmt_bytes(need)}" in msg
    assert "in runs of 8 keys" in msg and "2 keep it" in msg and "1 run the dense 8-bit" in msg
    recs = [_report.site(s) for s in sites]
    for rec in recs[:2]:
        assert rec.phases["anchor"] == 2 and rec.phases["reuse"] == 6 and not rec.method_notes
    assert recs[2].phases["warmup"] == 10 and recs[2].method_notes[M.NO_PLAN_ROOM] == 8
    assert not recs[2].runtime_fallbacks  # never stock SDPA for lack of room
    q, k, v = _inputs(10 * 9 + 2)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = ((outs[sites[2]][-1].float() - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.05  # the 8-bit V-Smooth path's error, not a sparse one
    assert "memory plan" in str(vc_compile.report())
    # the next generation plans again: with room for all, every block runs sparse
    vc_compile.reset(report=True)
    sites, _ = _layers({"method": "mcsparse", "reuse_check": False}, 3, tag="roomy")
    assert all(_report.site(s).phases["anchor"] == 2 and not _report.site(s).method_notes for s in sites)


def test_schedule_is_the_phases_the_op_runs():
    """``methods.schedule(cfg, n)``: the phase of every step, as the op records it over a generation (benchmarks
    extrapolate a partial run with it)."""
    from vc_compile import methods

    for opts in ({"method": "mcsparse", "reuse_check": False}, {"method": "vsmooth"}, {"method": "dense"}):
        vc_compile.reset(report=True)
        cfg = VCConfig.from_options({**BASE, **opts})
        site, seen = _site(f"sched-{opts['method']}"), []
        with vc_compile.sampling(num_steps=10):
            for i in range(10):
                vc_compile.step(i)
                before = dict(_report.site(site).phases)
                torch.ops.vcattn.attention(*_inputs(i), None, site, cfg.to_json(), None)
                after = _report.site(site).phases
                seen.append(next(p for p in after if after[p] > before.get(p, 0)))
        assert seen == [p.value for p in methods.schedule(cfg, 10)], opts


def test_an_anchor_out_of_memory_is_not_an_exception(monkeypatch):
    """An anchor step that runs out of GPU memory returns stock SDPA's output and keeps nothing; its block runs
    stock SDPA with one warning until the next anchor, which tries again (before: the OutOfMemoryError ended the
    generation)."""
    import pytest

    from vc_compile.methods import mcsparse as M

    vc_compile.reset(report=True)
    real = M.query_order

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.07 GiB")

    cfg = VCConfig.from_options({**BASE, "method": "mcsparse", "reuse_check": False, "warmup_steps": 0,
                                 "anchor_steps": [0, 2]}).to_json()
    site = _site("oom")
    with vc_compile.sampling(num_steps=4):
        vc_compile.step(0)
        monkeypatch.setattr(M, "query_order", oom)
        q, k, v = _inputs(0)
        out = torch.ops.vcattn.attention(q, k, v, None, site, cfg, None)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
        assert state.bytes_held() == 0
        monkeypatch.setattr(M, "query_order", real)
        vc_compile.step(1)
        with pytest.warns(RuntimeWarning, match="ran out of GPU memory"):
            out = torch.ops.vcattn.attention(*_inputs(1), None, site, cfg, None)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(*_inputs(1)))
        vc_compile.step(2)
        torch.ops.vcattn.attention(*_inputs(2), None, site, cfg, None)  # the next anchor keeps its metadata
        assert state.bytes_held() > 0
    rec = _report.site(site)
    assert rec.phases["anchor"] == 2 and rec.runtime_fallbacks[M.NO_ROOM] == 1


def test_stock_sdpa_out_of_memory_too_releases_the_metadata(monkeypatch):
    """Three blocks anchor at one step: the first keeps its metadata; the second's anchor runs out of memory and
    so does stock SDPA after it (what the 14B model's first anchor step did on an 80 GB GPU): every block's
    metadata is released and stock SDPA runs in what is left, no exception; the third block, holding nothing,
    skips this anchor step (stock SDPA, no anchor attempted) and anchors at the next one."""
    from vc_compile.methods import mcsparse as M

    vc_compile.reset(report=True)
    real_order, real_sdpa = M.query_order, F.scaled_dot_product_attention
    calls = {"order": 0, "sdpa_oom": 0}

    def order(*a, **kw):
        calls["order"] += 1
        if calls["order"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 740.00 MiB")
        return real_order(*a, **kw)

    def sdpa(*a, **kw):
        if calls["order"] == 2 and calls["sdpa_oom"] == 0:
            calls["sdpa_oom"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 740.00 MiB")
        return real_sdpa(*a, **kw)

    cfg = VCConfig.from_options({**BASE, "method": "mcsparse", "reuse_check": False, "warmup_steps": 0,
                                 "anchor_steps": [0, 2]}).to_json()
    sites = [_site(f"shed{i}") for i in range(3)]
    monkeypatch.setattr(M, "query_order", order)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    import pytest

    with pytest.warns(RuntimeWarning, match="released") as w, vc_compile.sampling(num_steps=4):
        for step in range(4):
            vc_compile.step(step)
            for i, site in enumerate(sites):
                q, k, v = _inputs(10 * step + i)
                out = torch.ops.vcattn.attention(q, k, v, None, site, cfg, None)
                if step == 0 and i == 0:
                    assert state.bytes_held() > 0
                if step == 0 and i >= 1:
                    torch.testing.assert_close(out, real_sdpa(q, k, v))
                    assert state.bytes_held() == 0  # the first block's metadata went to make room
        assert state.bytes_held() > 0  # step 2's anchors keep theirs again
    assert calls["order"] == 2 + 3 and calls["sdpa_oom"] == 1  # the third block tried no anchor at step 0
    recs = [_report.site(s) for s in sites]
    assert [r.phases.get("anchor", 0) for r in recs] == [2, 2, 1]
    assert all(r.runtime_fallbacks[M.NO_ROOM] >= 1 for r in recs)
    assert sum("ran out of GPU memory" in str(x.message) for x in w) >= 1


def test_anchor_memory_check_counts_the_driver_and_the_metadata_pool_not_the_models_cache(monkeypatch):
    """Kept metadata is allocated from a pool of its own (``_keep_apart``), so what it can take is the driver's free
    memory plus that pool's unused blocks, less a 5% margin. torch's allocator's unused cache belongs to the model's
    activations: counting it (before) let the anchors of a 14B model's first generation keep metadata until the
    FFN's 1.95 GiB buffer found no room (9.2 GiB of the cache unused but split by metadata)."""
    from vc_compile.methods import mcsparse as M

    GiB = 2**30
    cuda = torch.device("cuda", 0)
    mem = {"free": 5.5 * GiB, "pool_free": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (int(mem["free"]), 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 30 * GiB)  # 10 GiB of it unused
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 20 * GiB)
    monkeypatch.setattr(M, "_pool_free", lambda d: int(mem["pool_free"]))
    need = int(1.88 * GiB)  # one 14B block-branch: selection, query order, bf16 residual
    why = M._no_gpu_room(need, cuda)  # 5.5 GiB free < 1.88 + 4 GiB: the model's 10 GiB cache not counted
    assert why is not None and "5.5 GiB free for it" in why
    mem["pool_free"] = 2 * GiB  # a previous generation's metadata, unused in the pool: 7.5 GiB in all
    assert M._no_gpu_room(need, cuda) is None
    mem["free"], mem["pool_free"] = 0, 6 * GiB  # the pool alone
    assert M._no_gpu_room(need, cuda) is None
    assert M._no_gpu_room(need, torch.device("cpu")) is None  # host memory is not checked


def test_memory_plan_first_returns_torchs_unused_cache_to_the_driver(monkeypatch):
    """The plan (once a generation, at its first anchor) returns torch's unused cache to the driver
    (``empty_cache``) before it reads the driver's free memory. At 14B the model's own cache held 30+ GB unused
    after the first generation's anchors, and the plan that could not count it kept 4 of 80 block-branches."""
    from vc_compile.methods import mcsparse as M

    GiB = 2**30
    vc_compile.reset(report=True)
    cfg = VCConfig.from_options({**BASE, "method": "mcsparse", "residual_budget_gb": 1000, "density": 0.15})
    mem = {"free": 6 * GiB, "cached": 30 * GiB, "calls": []}

    def empty_cache():
        mem["calls"].append("empty_cache")
        mem["free"], mem["cached"] = mem["free"] + mem["cached"], 0

    def mem_get_info(d=None):
        mem["calls"].append("mem_get_info")
        return int(mem["free"]), 80 * GiB
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(M, "_pool_free", lambda d: 0)
    shape = (1, 40, 75600, 128)  # Wan 14B at 720p: 1.39 GiB a block-branch key by key, 0.45 in runs of 8
    keys = [(site, 0, branch, shape, shape, "cuda:0") for site in range(40) for branch in range(2)]
    cuda = torch.device("cuda", 0)
    with vc_compile.sampling(num_steps=50):
        for key in keys:
            state.put(key + M.WARMUP_SLOT, torch.zeros(1))
        plan = M.memory_plan(cfg, keys[0], cuda)
        again = M.memory_plan(cfg, keys[1], cuda)
    assert mem["calls"] == ["empty_cache", "mem_get_info"]  # once a generation, the cache first
    # no run of 1, 2 or 4 keys fits all 80; in runs of 8, 36 GiB free less the largest block (a re-anchor beside the
    # old) and the 5% margin keep 70 of 0.45 GiB
    per_block = M.metadata_bytes(keys[0], cfg, plan.run)
    assert plan.run == 8 and per_block == 40 * (591 * (11392 // 8) * 2 + 75600 * (128 + 4 + 4))
    assert len(plan.keep) == int((36 * GiB - per_block - 0.05 * 80 * GiB) // per_block) == 70
    assert again is plan and len(plan.planned) == 80


def test_memory_plan_selects_in_the_shortest_run_with_which_every_block_fits(monkeypatch):
    """``key_run=None`` (the default): the plan keeps the selection key by key where every block's metadata fits the
    GPU, else in the shortest run of 2, 4, 8 with which all do (one report note per generation, its anchors counted),
    else in runs of 8 (the most blocks). Wan 14B at 720p, 80 block-branches: the room of an H200, of an H100 beside
    the weights (about 40 GiB: runs of 8, every block sparse) and less. A key_run given is kept as is."""
    from vc_compile.methods import mcsparse as M

    GiB = 2**30
    shape = (1, 40, 75600, 128)
    keys = [(site, 0, branch, shape, shape, "cuda:0") for site in range(40) for branch in range(2)]
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(M, "_pool_free", lambda d: 0)

    def plan_at(free_gib, **opts):
        vc_compile.reset(report=True)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (int(free_gib * GiB), 80 * GiB))
        cfg = VCConfig.from_options({**BASE, "method": "mcsparse", "residual_budget_gb": 1000, "density": 0.15,
                                     **opts})
        with vc_compile.sampling(num_steps=50):
            for key in keys:
                state.put(key + M.WARMUP_SLOT, torch.zeros(1))
            return M.memory_plan(cfg, keys[0], cuda)
    sizes = {r: M.metadata_bytes(keys[0], VCConfig(), r) / GiB for r in (1, 2, 4, 8)}
    assert [round(sizes[r], 2) for r in (1, 2, 4, 8)] == [1.39, 0.88, 0.51, 0.45]  # runs of 2: int32 numbers
    for free, run, kept in ((130, 1, 80), (50, 4, 80), (42, 8, 80), (30, 8, 57)):
        plan = plan_at(free)
        assert (plan.run, len(plan.keep)) == (run, kept), (free, plan.run, len(plan.keep))
    fixed = plan_at(42, key_run=1)
    assert fixed.run == 1 and len(fixed.keep) == 26
    # at an anchor step the plan's run reaches the anchor, with the note that says why the selection is coarser
    # (CPU tensors: the budget alone plans; all 80 fit in runs of 8, 35.7 GiB, not in runs of 4, 40.7 GiB)
    vc_compile.reset(report=True)
    cfg = VCConfig.from_options({**BASE, "method": "mcsparse", "residual_budget_gb": 37, "density": 0.15,
                                 "num_steps": 50})

    class Slot:
        key = keys[0]

        def __call__(self, sub):
            return state.get(self.key + tuple(sub))
    q = torch.zeros(1, 1, 8, 64)
    with vc_compile.sampling(num_steps=50):
        for key in keys:
            state.put(key + M.WARMUP_SLOT, torch.zeros(1))
        p = M.plan(cfg, 10, 50, Slot(), q, q, q, "reference")
    assert p.phase == M.Phase.ANCHOR and p.meta.run == 8
    assert p.note[0] == M.KEY_RUNS and "runs of 8" in p.note[1] and "key_run=1" in p.note[1]


def test_an_anchor_without_gpu_room_runs_the_dense_8bit_path_to_its_next_anchor(monkeypatch):
    """An anchor that finds too little free GPU memory for its metadata (the plan's estimate can miss: at 14B 3 of
    the 23 blocks it kept) keeps nothing; until its next anchor its block runs the warm-up's dense 8-bit path, as
    a block the plan left out does, not stock SDPA (before: stock, about twice the 8-bit path's time at 14B). One
    warning; report() counts the calls as a method note, not a fallback; the next anchor tries again."""
    import pytest

    from vc_compile.methods import mcsparse as M

    vc_compile.reset(report=True)
    calls = []

    def no_room(need, device):
        calls.append(need)
        return "the GPU has 5.3 GiB free for it" if len(calls) == 1 else None
    monkeypatch.setattr(M, "_no_gpu_room", no_room)
    with pytest.warns(RuntimeWarning, match="5.3 GiB free") as w:
        site, outs = _run({"method": "mcsparse", "reuse_check": False}, 10, "mc-no-room")
    assert sum("5.3 GiB free" in str(x.message) for x in w) == 1
    rec = _report.site(site)
    first, second = M.anchor_steps(VCConfig.from_options({**BASE, "method": "mcsparse"}), 10)
    assert len(calls) == 2 and rec.phases["anchor"] == 2  # the second anchor tried again and kept
    assert rec.phases["warmup"] == first + (second - first - 1)  # the warm-up, then 8-bit to the next anchor
    assert rec.method_notes[M.NO_ANCHOR_ROOM] == second - first - 1 and not rec.runtime_fallbacks
    assert rec.phases["reuse"] == 10 - second - 1
    q, k, v = _inputs(first + 1)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = ((outs[first + 1].float() - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.05  # the 8-bit path's error: not stock SDPA's output, not a sparse one


def test_kept_metadata_is_copied_into_its_own_pool(monkeypatch):
    """On a GPU the tensors an anchor keeps are copies made inside ``torch.cuda.use_mem_pool`` of the metadata
    pool (the originals are the anchor's temporaries); the output is unchanged."""
    import contextlib

    from vc_compile.methods import mcsparse as M

    vc_compile.reset(report=True)
    site, plain = _run({"method": "mcsparse"}, 4, "mc-plain")
    kept_plain = [m for key, m in state.items() if key[0] == site]
    vc_compile.reset(report=True)
    inside, copies = [False], []
    real_clone = torch.Tensor.clone

    def clone(t, *a, **kw):
        c = real_clone(t, *a, **kw)
        if inside[0]:
            copies.append(c)
        return c

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        assert pool == "the pool"
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False
    monkeypatch.setattr(M, "_metadata_pool", lambda device: "the pool")
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    held = []
    site, pooled = _run({"method": "mcsparse"}, 4, "mc-pooled", held)
    metas = [m for key, m in state.items() if key[0] == site]
    assert held == ["SparseMeta"] and len(metas) == 1
    meta = metas[0]
    kept = [t for t in (meta.sigma, meta.idx, meta.residual, meta.res_scale) if t is not None]
    assert len(kept) == 4 and all(any(t is c for c in copies) for t in kept)  # the int8 residual's scales too
    for a, b in zip(plain, pooled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(meta.idx, kept_plain[0].idx, rtol=0, atol=0)
