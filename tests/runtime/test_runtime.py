"""The process's run-time state in one object (runtime/runtime.py): ``Runtime.reset`` forgets what
``vc_compile.reset`` forgot, and each ``vc_compile.sampling()`` block is a loop of its own (step tracker and
metadata store): two loops in two threads, or in two interleaved generators, never share a step.

Everything runs on the CPU reference path (``kernels="reference"``), no compile."""
import contextvars
import threading

import pytest
import torch

import vc_compile
from vc_compile import ops
from vc_compile.config import VCConfig
from vc_compile.runtime import report as _report
from vc_compile.runtime import runtime as _runtime
from vc_compile.runtime import state
from vc_compile.runtime.steps import TRACKER
from vc_compile.tune import lookup

SHAPE = ((1, 2, 256, 64), (1, 2, 256, 64))
CFG = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 16,
                             "experimental": {"kernels": "reference"}}).to_json()


pytestmark = pytest.mark.usefixtures("fresh_vcattn")  # conftest: no vcattn state, sites or counters


def _site(name):
    return _report.register_site(graph="runtime", node=name, module=name, shape="?", dtype="bf16", method="vsmooth",
                                 rewritten=True).site


def _inputs(seed, S=160):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, S, 64, generator=g).to(torch.bfloat16) for _ in range(3)]


def _run_threads(*targets):
    """Run each target in a thread of its own; re-raise the first failure."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


# ---- one loop per sampling() block ------------------------------------------------------------------------
def test_two_threads_each_see_their_own_steps():
    """Thread A declares steps 0..3 of 4, thread B steps 10..13 of 20, interleaved call by call (a barrier
    between every declaration and every call): each sees exactly its own (step, num_steps), one generation."""
    barrier = threading.Barrier(2)
    seen = {"a": [], "b": []}

    def loop(name, steps, n):
        with vc_compile.sampling(num_steps=n):
            for i in steps:
                vc_compile.step(i)
                barrier.wait()  # both declared: with one shared tracker the later declaration would win
                seen[name].append(TRACKER.current((1, 0), 50, shape=SHAPE))
                seen[name].append(TRACKER.current((1, 0), 50, shape=SHAPE))  # CFG: branch 1
                barrier.wait()

    _run_threads(lambda: loop("a", range(4), 4), lambda: loop("b", range(10, 14), 20))
    for name, steps, n in (("a", range(4), 4), ("b", range(10, 14), 20)):
        got = [(s.step, s.branch, s.num_steps, s.source) for s in seen[name]]
        assert got == [(i, b, n, "explicit") for i in steps for b in (0, 1)], name
        assert len({s.generation for s in seen[name]}) == 1, name
    assert seen["a"][0].generation != seen["b"][0].generation


def _generation(site, seed, steps, n, barrier=None):
    """``steps`` declared steps of an n-step generation at ``site`` through the op; the outputs."""
    outs = []
    with vc_compile.sampling(num_steps=n):
        for i in steps:
            vc_compile.step(i)
            if barrier is not None:
                barrier.wait()
            q, k, v = _inputs(seed + i)
            outs.append(torch.ops.vcattn.attention(q, k, v, None, site, CFG, None))
            if barrier is not None:
                barrier.wait()
    return outs


def test_two_threads_through_the_op_keep_steps_and_metadata_apart():
    """The same two loops as alone, then concurrently in two threads at one call site (one model in two
    threads): each thread's outputs are bit-identical to its run alone (its own steps, its own V-Smooth
    grouping), and the report counts the phases of both schedules."""
    site = _site("shared")
    alone_a = _generation(site, 0, range(8), 8)
    alone_b = _generation(site, 100, [6, 7, 6, 7, 6, 7, 6, 7], 8)
    phases_alone = dict(_report.site(site).phases)
    _report.reset_counts()
    barrier = threading.Barrier(2)
    got = {}
    _run_threads(lambda: got.setdefault("a", _generation(site, 0, range(8), 8, barrier)),
                 lambda: got.setdefault("b", _generation(site, 100, [6, 7, 6, 7, 6, 7, 6, 7], 8, barrier)))
    for i, (x, y) in enumerate(zip(got["a"], alone_a)):
        assert torch.equal(x, y), f"thread a, step {i}"
    for i, (x, y) in enumerate(zip(got["b"], alone_b)):
        assert torch.equal(x, y), f"thread b, call {i}"
    assert dict(_report.site(site).phases) == phases_alone
    # A: GROUP on step 0 (every 25th step: group_interval), REUSE after; B: steps 6 and 7 only, each a new
    # generation after the first (6 < 7): the first call of each generation has no grouping cached, so GROUP
    assert phases_alone == {"group": 1 + 4, "reuse": 7 + 4}


def test_two_threads_at_two_sites_report_their_own_phases():
    sa, sb = _site("a"), _site("b")
    barrier = threading.Barrier(2)
    _run_threads(lambda: _generation(sa, 0, range(4), 4, barrier), lambda: _generation(sb, 7, [3, 3, 3, 3], 4, barrier))
    assert dict(_report.site(sa).phases) == {"group": 1, "reuse": 3}
    # B pins step 3 (REUSE in the schedule): its first call groups (nothing cached), the next three are new
    # branches of step 3, each with nothing cached of its own: they reuse the first branch's grouping
    # (share_grouping), so only the first call runs k-means
    assert dict(_report.site(sb).phases) == {"group": 1, "reuse": 3}
    assert dict(_report.site(sa).step_sources) == {"explicit": 4} == dict(_report.site(sb).step_sources)


def test_interleaved_generators_find_their_loop_through_the_handle():
    """Two generators, one thread: each declares its steps on its own ``sampling()`` handle, which makes its
    loop the active one again after the other ran."""
    def gen(n, first):
        with vc_compile.sampling(num_steps=n) as loop:
            for i in range(first, first + 3):
                loop.step(i)
                yield TRACKER.current((1, 0), 50, shape=SHAPE)

    a, b = gen(4, 0), gen(9, 5)
    seen = [(next(a), next(b)) for _ in range(3)]
    assert [(x.step, x.num_steps) for x, _ in seen] == [(0, 4), (1, 4), (2, 4)]
    assert [(y.step, y.num_steps) for _, y in seen] == [(5, 9), (6, 9), (7, 9)]
    assert len({x.generation for x, _ in seen}) == 1 and len({y.generation for _, y in seen}) == 1
    a.close()
    b.close()
    assert not TRACKER.explicit_active  # back to the default loop
    assert _runtime.active_loop() is _runtime.current().default


def test_generators_in_contexts_of_their_own_need_no_handle():
    def gen(n, first):
        with vc_compile.sampling(num_steps=n):
            for i in range(first, first + 2):
                vc_compile.step(i)
                yield TRACKER.current((1, 0), 50, shape=SHAPE).step

    ca, cb = contextvars.copy_context(), contextvars.copy_context()
    a, b = gen(4, 0), gen(9, 5)
    assert [(ca.run(next, a), cb.run(next, b)) for _ in range(2)] == [(0, 5), (1, 6)]
    assert not TRACKER.explicit_active


def test_a_nested_block_leaves_the_outer_loop_alone():
    with vc_compile.sampling(num_steps=6):
        vc_compile.step(2)
        outer = TRACKER.current((1, 0), 50, shape=SHAPE)
        state.put((1, 0, 0) + SHAPE + ("cpu",), {"perm": torch.zeros(8)})
        with vc_compile.sampling(num_steps=3):
            vc_compile.step(0)
            inner = TRACKER.current((1, 0), 50, shape=SHAPE)
            assert (inner.step, inner.num_steps) == (0, 3) and state.keys() == []
        again = TRACKER.current((1, 0), 50, shape=SHAPE)
        assert (again.step, again.num_steps, again.generation) == (2, 6, outer.generation)
        assert len(state.keys()) == 1  # the outer loop's metadata survived the inner block


def test_a_loop_hands_its_metadata_to_the_default_loop_at_its_end():
    """As with one shared store before: a sampling loop's metadata is held after the block until the next
    generation starts (the next call outside a block, or the next block)."""
    site = _site("handover")
    _generation(site, 0, range(2), 4)
    assert [k[0] for k in state.keys()] == [site] and state.bytes_held() > 0
    assert _report.site(site).bytes_held == state.bytes_held()
    assert TRACKER.pending_generation
    with vc_compile.sampling(num_steps=2):
        assert state.bytes_held() == 0  # the next block dropped the held metadata on entry
    assert state.keys() == [] and _report.site(site).bytes_held == 0


def test_bytes_held_counts_every_loop():
    """``state.bytes_held()`` (MC-Sparse's residual budget) covers the loops of other threads too."""
    started, done = threading.Event(), threading.Event()
    key = (5, 0, 0) + SHAPE + ("cpu",)

    def other():
        with vc_compile.sampling(num_steps=2):
            state.put(key, {"x": torch.zeros(256)})
            started.set()
            done.wait(30)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert started.wait(30)
        assert state.keys() == [] and state.bytes_held() == 1024
        state.drop_sites([5])  # a freed graph: dropped in every loop
        assert state.bytes_held() == 0
    finally:
        done.set()
        t.join(30)


# ---- Runtime.reset ---------------------------------------------------------------------------------------------
def _populate(site):
    """Everything vc_compile.reset() forgets: a pinned step, tracker tables, metadata, the op's per-site
    memory (identities, an unstable site, sharpness readings, warnings), report counts."""
    vc_compile.step(3, num_steps=7)
    TRACKER.current((site, 0), 50, shape=SHAPE)
    state.put((site, 0, 0) + SHAPE + ("cpu",), {"perm": torch.zeros(8)})
    ops._IDENTS[(site, 1)] = (0, None)
    ops._UNSTABLE[site] = ops.UNSTABLE_IDENTITY
    ops._IDENT_WARNED.add((site, ops.UNSTABLE_IDENTITY))
    ops._SHARP[(site, 1)] = 3.0
    ops._SHARP_WORST[site] = (1, 3.0)
    ops._SHARP_WARNED.add(site)
    ops._NONFINITE_WARNED.add(site)
    rec = _report.site(site)
    rec.calls, rec.phases["group"] = 5, 5


def _assert_forgotten(site, rt):
    t = rt.tracker
    assert t.explicit_step is None and t.explicit_steps is None and not t.branch_seen and not t.call_counts
    assert state.keys() == [] and state.bytes_held() == 0
    c = rt.checks
    assert not (c.idents or c.unstable or c.ident_warned or c.sharp or c.sharp_worst or c.sharp_warned
                or c.nonfinite_warned)
    assert ops._IDENTS is c.idents and ops._UNSTABLE is c.unstable  # the op's names are the runtime's data


@pytest.mark.parametrize("how", ["vc_compile.reset", "Runtime.reset"])
def test_runtime_reset_forgets_what_vc_compile_reset_forgot(how):
    import warnings

    site = _site("reset")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step() outside sampling(): its one-time warning
        _populate(site)
    rt = _runtime.current()
    gen = rt.tracker.generation
    vc_compile.reset() if how == "vc_compile.reset" else rt.reset()
    _assert_forgotten(site, rt)
    assert rt.tracker.generation > gen
    rec = _report.site(site)
    assert rec.calls == 0 and not rec.phases and rec.module == "reset"  # counts zeroed, the site kept
    vc_compile.reset(report=True) if how == "vc_compile.reset" else rt.reset(report=True)
    assert _report.report().sites == [] and _report.site(site).module == "reset"  # forgotten, still named


def test_reset_reaches_the_loops_open_in_other_threads():
    """reset() drops all metadata and step declarations, also those of sampling loops open elsewhere (each
    keeps its num_steps, as a reset inside one block always did)."""
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    got = {}

    def other():
        with vc_compile.sampling(num_steps=9):
            vc_compile.step(4)
            state.put((6, 0, 0) + SHAPE + ("cpu",), {"perm": torch.zeros(8)})
            ready.set()
            go.wait(30)
            got["keys"] = state.keys()
            got["info"] = TRACKER.current((6, 0), 50, shape=SHAPE)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert ready.wait(30)
    vc_compile.reset()
    go.set()
    t.join(30)
    assert got["keys"] == [] and got["info"].num_steps == 9 and got["info"].source != "explicit"


def test_a_fresh_runtime_is_independent_of_the_process_one():
    rt = _runtime.Runtime()
    assert rt is not _runtime.current() and rt.tracker is not _runtime.current().tracker
    rt.sites.register_site(graph="g", node="n", module="m", shape="?", dtype="?", method="vsmooth", rewritten=True)
    rt.tuning.configure(shipped=False)
    assert len(rt.sites.report().sites) == 1 and _report.report().sites == []
    assert _runtime.current().tuning.shipped
    rt.reset(report=True)
    assert rt.sites.report().sites == []


# ---- the tuning policy -------------------------------------------------------------------------------------
def test_resolve_takes_a_policy_explicitly():
    """``resolve(policy=...)`` answers from and memoises into that policy, not the process's; a
    ``recording`` counts the launches of its own context only."""
    pol = lookup.TunePolicy()
    cands = [{"BN": 64}, {"BN": 128}]
    kw = dict(dtype=torch.bfloat16, head_dim=64, seq_len=128, variant="", device=torch.device("cpu"))
    with lookup.recording() as rec:
        assert lookup.resolve("k_explicit", [], cands, policy=pol, **kw) == ({"BN": 64}, "default")
        seen_elsewhere = []
        t = threading.Thread(target=lambda: seen_elsewhere.append(lookup.resolve("k_explicit", [], cands, **kw)))
        t.start()
        t.join(30)
    assert rec == {"k_explicit:default": 1}  # the other thread's launch is not this call's
    assert len(pol.memo) == 1 and pol.last["k_explicit"] == {"BN": 64}
    assert lookup.last_config("k_explicit") == {"BN": 64}  # the process policy answered the thread
