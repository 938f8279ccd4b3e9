"""Sampler-step tracking (runtime/steps.py): every step signal, generations, branches, the schedule seen
through compiled graphs (no recompiles, symbolic lengths), CUDA-graph modes.

The tracker is exercised directly through ``_op_call`` (what ``vcattn::attention`` does: one
``TRACKER.current`` call from inside the model's call stack), so most tests compile nothing. The
compiled checks use ``compiler="eager"`` (Dynamo + our rewrite + the op, no Inductor) except one
Inductor test for ``mode="reduce-overhead"`` on CPU, and one GPU test.
"""
import math

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import vc_compile
from vc_compile.config import VCConfig, VCConfigError
from vc_compile.runtime import report as _report
from vc_compile.runtime import state
from vc_compile.methods import Phase, mcsparse, vsmooth
from vc_compile.runtime.steps import TRACKER

from conftest import requires_cuda
import tiny_dit

SHAPE = ((1, 2, 256, 64), (1, 2, 256, 64))


@pytest.fixture(autouse=True)
def _fresh():
    vc_compile.reset(report=True)
    counters.clear()
    yield
    vc_compile.reset(report=True)


def _op_call(key=(1, 0), n=50, shape=SHAPE):
    """What vcattn::attention does: ask the tracker from inside the caller's stack."""
    return TRACKER.current(key, n, shape=shape)


# ---- a diffusers-like pipeline and model, no diffusers needed -----------------------------------------
class Model(nn.Module):
    """forward(x, timestep): the attention 'op' runs inside, twice (two call sites)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, timestep, shape=SHAPE):
        self.seen.append((_op_call((1, 0), shape=shape), _op_call((2, 0), shape=shape)))
        return x


class NoTimestepModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, shape=SHAPE):
        self.seen.append(_op_call((1, 0), shape=shape))
        return x


class FakeScheduler:
    def __init__(self):
        self.timesteps = None


class FakePipe:
    """The shape of every diffusers 0.42 denoising loop: ``for i, t in enumerate(timesteps)``."""

    def __init__(self, model, calls_per_step=2):
        self.scheduler = FakeScheduler()
        self.model = model
        self.calls_per_step = calls_per_step
        self._current_timestep = None

    def __call__(self, num_inference_steps=4, matrix_steps=None, callback_on_step_end=None):
        timesteps = torch.linspace(999, 1, num_inference_steps).long()
        self.scheduler.timesteps = timesteps
        loop = timesteps if matrix_steps is None else torch.arange(matrix_steps)  # diffusion forcing
        self._num_timesteps = len(loop)
        for i, t in enumerate(loop):
            self._current_timestep = t
            ts = t.expand(1)
            for _ in range(self.calls_per_step):
                self.model(torch.zeros(1), ts)
            if callback_on_step_end is not None:
                callback_on_step_end(self, i, t, {})
        self._current_timestep = None


class OpaqueLoopPipe(FakePipe):
    """A pipeline loop the frame probe cannot read (no ``i``): the callback helper must be used."""

    def __call__(self, num_inference_steps=4, callback_on_step_end=None):
        timesteps = torch.linspace(999, 1, num_inference_steps).long()
        self._num_timesteps = len(timesteps)
        for k, t in enumerate(timesteps):
            self.model(torch.zeros(1), float(t))  # a Python-number timestep: no storage identity
            if callback_on_step_end is not None:
                callback_on_step_end(self, k, t, {})


def _steps(seen, site=0):
    return [(c[site].step, c[site].branch) for c in seen]


# ---- explicit ----------------------------------------------------------------------------------------
def test_explicit_sampling_and_step_win():
    with vc_compile.sampling(num_steps=3):
        gen = TRACKER.generation
        for i in range(3):
            vc_compile.step(i)
            a, b = _op_call(), _op_call()  # CFG as two forwards: branches 0 and 1
            assert (a.step, a.branch, a.num_steps, a.source) == (i, 0, 3, "explicit")
            assert (b.step, b.branch) == (i, 1)
        assert TRACKER.generation == gen
        vc_compile.step(0)  # going back: a new generation
        assert _op_call().generation == gen + 1
    # explicit beats the diffusers frame
    model = Model()
    vc_compile.step(7, num_steps=9)
    FakePipe(model, calls_per_step=1)(num_inference_steps=2)
    assert {(c[0].step, c[0].num_steps, c[0].source) for c in model.seen} == {(7, 9, "explicit")}


def test_sampling_num_steps_overrides_frame_count():
    model = Model()
    with vc_compile.sampling(num_steps=10):
        FakePipe(model, calls_per_step=1)(num_inference_steps=3)
    assert [(c[0].step, c[0].num_steps, c[0].source) for c in model.seen] == [
        (0, 10, "diffusers"), (1, 10, "diffusers"), (2, 10, "diffusers")]


def test_step_validation():
    with pytest.raises(ValueError, match="step index"):
        vc_compile.step(-1)
    with pytest.raises(ValueError, match="num_steps"):
        vc_compile.step(1, num_steps=0)
    with pytest.raises(ValueError, match="num_steps"):
        with vc_compile.sampling(num_steps=2.5):
            pass


# ---- diffusers frame ---------------------------------------------------------------------------------
def test_diffusers_frame_steps_branches_generations():
    model = Model()
    pipe = FakePipe(model)
    pipe(num_inference_steps=4)
    assert _steps(model.seen) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert _steps(model.seen, 1) == _steps(model.seen)
    assert {c[0].num_steps for c in model.seen} == {4}
    assert {c[0].source for c in model.seen} == {"diffusers"}
    gen = model.seen[-1][0].generation
    assert {c[0].generation for c in model.seen} == {gen}
    # a second call, even a one-step one twice in a row, is a new generation each time
    model.seen.clear()
    pipe(num_inference_steps=1)
    pipe(num_inference_steps=1)
    assert [c[0].generation for c in model.seen] == [gen + 1, gen + 1, gen + 2, gen + 2]
    assert [c[0].num_steps for c in model.seen] == [1, 1, 1, 1]


def test_diffusers_frame_prefers_declared_num_timesteps():
    """SkyReels diffusion forcing loops over a step matrix longer than ``timesteps``."""
    model = Model()
    FakePipe(model, calls_per_step=1)(num_inference_steps=2, matrix_steps=5)
    assert [(c[0].step, c[0].num_steps) for c in model.seen] == [(i, 5) for i in range(5)]


def test_diffusers_frame_loop_restart_in_same_call_is_new_generation():
    """Wan-Animate / FramePack: one pipeline call runs the loop once per segment."""
    model = Model()

    class SegmentPipe(FakePipe):
        def __call__(self, segments=2, num_inference_steps=3):
            timesteps = torch.linspace(999, 1, num_inference_steps).long()
            self._num_timesteps = len(timesteps)
            for _seg in range(segments):
                for i, t in enumerate(timesteps):
                    self._current_timestep = t
                    self.model(torch.zeros(1), t)

    SegmentPipe(model)(segments=2)
    gens = [c[0].generation for c in model.seen]
    assert [c[0].step for c in model.seen] == [0, 1, 2, 0, 1, 2]
    assert gens[:3] == [gens[0]] * 3 and gens[3:] == [gens[0] + 1] * 3


def test_new_generation_drops_metadata():
    model = Model()
    pipe = FakePipe(model, calls_per_step=1)
    pipe(num_inference_steps=2)
    state.put((1, 0, 0, SHAPE[0], SHAPE[1], "cpu"), {"perm": torch.zeros(4)})
    assert len(state.keys()) == 1
    pipe(num_inference_steps=2)
    assert state.keys() == []


def test_diffusers_callback_for_unreadable_loops():
    model = Model()
    pipe = OpaqueLoopPipe(model)
    pipe(num_inference_steps=4, callback_on_step_end=vc_compile.diffusers_callback)
    seen = model.seen
    assert [c[0].step for c in seen] == [0, 1, 2, 3]
    assert [c[0].source for c in seen] == ["timestep", "explicit", "explicit", "explicit"]
    assert [c[0].num_steps for c in seen[1:]] == [4, 4, 4]
    gen = seen[-1][0].generation
    model.seen.clear()
    pipe(num_inference_steps=3, callback_on_step_end=vc_compile.diffusers_callback)
    assert [c[0].step for c in model.seen] == [0, 1, 2]
    assert model.seen[0][0].generation == gen + 1
    assert len({c[0].generation for c in model.seen}) == 1


# ---- the timestep fallback ---------------------------------------------------------------------------
def _loop(model, ts, calls=1, fresh=False):
    for t in ts:
        tt = t.expand(2) if isinstance(t, torch.Tensor) else t
        for _ in range(calls):
            model(torch.zeros(1), tt.clone() if fresh else tt)


def test_timestep_unipc_repeated_values():
    model = Model()
    _loop(model, torch.tensor([999, 999, 950, 900, 800, 600]))
    assert [c[0].step for c in model.seen] == [0, 1, 2, 3, 4, 5]
    assert {c[0].source for c in model.seen} == {"timestep"}
    assert len({c[0].generation for c in model.seen}) == 1
    assert counters["vcattn"]["timestep_sync"] == 0  # CPU timesteps: no device read


def test_timestep_cfg_two_forwards_share_a_step():
    model = Model()
    _loop(model, torch.tensor([999, 999, 950, 900]), calls=2)  # the same tensor object twice
    assert _steps(model.seen) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    model.seen.clear()
    vc_compile.reset()
    # t.expand(B) twice: two objects on one storage -> still one step
    for t in torch.tensor([999, 950, 900]):
        model(torch.zeros(1), t.expand(2))
        model(torch.zeros(1), t.expand(2))
    assert _steps(model.seen) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_timestep_fresh_copies_learn_forwards_per_step():
    """Freshly allocated equal timesteps per forward (CFG as two forwards, no shared storage) are
    ambiguous with a repeated value; the forwards per step learned from earlier steps decide."""
    model = Model()
    _loop(model, torch.tensor([999, 950, 900]), calls=2)  # shared object: learns 2 forwards per step
    model.seen.clear()
    _loop(model, torch.tensor([999, 950, 900]), calls=2, fresh=True)  # restart at 999: new generation
    assert _steps(model.seen) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert len({c[0].generation for c in model.seen}) == 1


def test_timestep_mochi_increasing_and_sigma_generations():
    model = Model()
    mochi = torch.linspace(0, 578, 8)
    _loop(model, mochi)
    assert [c[0].step for c in model.seen] == list(range(8))
    g0 = model.seen[0][0].generation
    model.seen.clear()
    _loop(model, mochi)  # 578 -> 0 reverses the direction: a new generation, whose n is now known
    assert [c[0].step for c in model.seen] == list(range(8))
    assert {c[0].generation for c in model.seen} == {g0 + 1}
    assert {c[0].num_steps for c in model.seen} == {8}
    model.seen.clear()
    sigmas = torch.linspace(1.0, 0.05, 6)  # Cosmos-style sigma inputs in [0, 1]
    _loop(model, sigmas, calls=2)
    _loop(model, sigmas, calls=2)
    steps = [c[0].step for c in model.seen]
    assert steps == [s for s in range(6) for _ in range(2)] * 2
    gens = [c[0].generation for c in model.seen]
    assert gens[11] + 1 == gens[12] and len(set(gens[:12])) == 1 and len(set(gens[12:])) == 1
    assert {c[0].num_steps for c in model.seen[12:]} == {6}
    assert counters["vcattn"]["generation:timestep_restart"] >= 2


def test_timestep_restart_at_first_value_and_batch_change():
    model = Model()
    _loop(model, torch.tensor([999, 800, 600]))
    _loop(model, torch.tensor([999, 700]))
    assert [c[0].step for c in model.seen] == [0, 1, 2, 0, 1]
    g = [c[0].generation for c in model.seen]
    assert g[3] == g[2] + 1
    model.seen.clear()
    model(torch.zeros(1), torch.tensor([650, 650]))  # same batch, continues: step 2
    model(torch.zeros(1), torch.tensor([600, 600, 600, 600]))  # new batch: new generation
    assert [c[0].step for c in model.seen] == [2, 0]
    assert counters["vcattn"]["generation:batch_change"] == 1


def test_shape_change_starts_a_generation_in_fallbacks():
    model = Model()
    other = ((1, 2, 512, 64), (1, 2, 512, 64))
    ts = torch.tensor([999, 900, 800])
    model(torch.zeros(1), ts[0].expand(1))
    model(torch.zeros(1), ts[1].expand(1))
    model(torch.zeros(1), ts[2].expand(1), shape=other)  # new resolution
    assert [c[0].step for c in model.seen] == [0, 1, 0]
    assert model.seen[2][0].generation == model.seen[1][0].generation + 1
    nt = NoTimestepModel()
    nt(torch.zeros(1))
    nt(torch.zeros(1))
    nt(torch.zeros(1), shape=other)
    assert [c.step for c in nt.seen] == [0, 1, 0]


def test_call_count_fallback():
    nt = NoTimestepModel()
    for _ in range(3):
        nt(torch.zeros(1))
    assert [(c.step, c.branch, c.source, c.num_steps) for c in nt.seen] == [
        (0, 0, "call-count", 50), (1, 0, "call-count", 50), (2, 0, "call-count", 50)]


def test_call_count_wraps_at_num_steps():
    """Without any step signal, n calls of a site make one generation: the next call starts a new one
    (fresh metadata) instead of running on with the last steps' metadata."""
    seen = [_op_call(n=3) for _ in range(7)]
    assert [c.step for c in seen] == [0, 1, 2, 0, 1, 2, 0]
    assert [c.generation - seen[0].generation for c in seen] == [0, 0, 0, 1, 1, 1, 2]
    assert counters["vcattn"]["generation:wrap"] == 2


def test_constant_timestep_wraps_at_num_steps():
    """A timestep that never changes (a context-parallel rank holding only t = 0 tokens) still steps,
    and wraps after n steps."""
    model = Model()
    with vc_compile.sampling(num_steps=3):  # no step() calls: the timestep input, n from sampling()
        for _ in range(4):
            model(torch.zeros(1), torch.zeros(2, 16))
    assert [c[0].step for c in model.seen] == [0, 1, 2, 0]
    assert [c[0].source for c in model.seen] == ["timestep"] * 4
    assert model.seen[3][0].generation == model.seen[0][0].generation + 1


def test_plain_function_timestep_argument():
    seen = []

    def denoise(x, t):  # a custom sampler function compiled as a whole: no module call on the stack
        seen.append(_op_call())
        return x

    for t in (0.9, 0.5, 0.1):
        denoise(None, t)
    assert [(c.step, c.source) for c in seen] == [(0, "timestep"), (1, "timestep"), (2, "timestep")]


# ---- the schedules (each method owns its own: methods/<method>.py phase_for) ---------------------------------
def test_schedule_tables():
    vs = VCConfig(method="vsmooth")
    assert [vsmooth.phase_for(vs, s, 8, s > 0).value for s in range(8)] == ["group"] + ["reuse"] * 7
    # the default re-groups every 25th step; group_fraction re-groups a window at the start instead / as well
    assert [s for s in range(50) if vsmooth.phase_for(vs, s, 50, True) == Phase.GROUP] == [0, 25]
    window = VCConfig(method="vsmooth", group_fraction=0.25, group_interval=0)  # the schedule before 2026-12-04
    assert [s for s in range(50) if vsmooth.phase_for(window, s, 50, True) == Phase.GROUP] == list(range(13))
    both = VCConfig(method="vsmooth", group_fraction=0.1, group_interval=20)
    assert [s for s in range(50) if vsmooth.phase_for(both, s, 50, True) == Phase.GROUP] == [0, 1, 2, 3, 4, 20, 40]
    never = VCConfig(method="vsmooth", group_fraction=0.0, group_interval=0)  # only a call with nothing cached
    assert [vsmooth.phase_for(never, s, 8, True) for s in range(8)] == [Phase.REUSE] * 8
    assert vsmooth.phase_for(never, 3, 8, False) == Phase.GROUP
    mc = VCConfig(method="mcsparse")
    assert [mcsparse.phase_for(mc, s, 10, s > 2).value for s in range(10)] == (
        ["warmup"] * 2 + ["anchor"] + ["reuse"] * 2 + ["anchor"] + ["reuse"] * 4)
    sdpa_warmup = VCConfig(method="mcsparse", warmup_attention="sdpa")  # the paper's dense warm-up
    assert [mcsparse.phase_for(sdpa_warmup, s, 10, s > 2).value for s in range(3)] == ["dense"] * 2 + ["anchor"]
    assert mcsparse.anchor_steps(mc, 50) == (10, 26)  # the paper's schedule
    # a reuse step without metadata (e.g. the second expert's first step) never reuses
    assert mcsparse.phase_for(mc, 4, 10, False) == Phase.ANCHOR
    assert vsmooth.phase_for(vs, 5, 8, False) == Phase.GROUP
    # naive 8-bit has nothing to group; V-Smooth's warm-up steps are dense; dense is dense
    naive = VCConfig(method="vsmooth", experimental={"smooth_v": False})
    assert [vsmooth.phase_for(naive, s, 4, False) for s in range(4)] == [Phase.REUSE] * 4
    assert vsmooth.phase_for(VCConfig(warmup_steps=2), 1, 8, True) == Phase.DENSE
    from vc_compile.methods import METHODS, dense
    assert dense.phase_for(VCConfig(method="dense"), 3, 8, True) == Phase.DENSE
    # every method provides the interface the op calls (methods/protocol.py)
    from vc_compile.methods import AttentionMethod
    for m in METHODS.values():
        assert isinstance(m, AttentionMethod), m.__name__
        assert all(callable(getattr(m, f)) for f in ("phase_for", "needs_fp8", "ineligible", "path_label", "plan"))
    assert not dense.USES_KERNELS and dense.plan(VCConfig(method="dense"), 3, 8, lambda s: None, None, None, None,
                                                 None).phase == Phase.DENSE  # the op's own SDPA call


def test_tracker_subscribers_are_explicit():
    """runtime/state.py subscribes nothing on import: ops.py wires the store to the tracker, once."""
    import vc_compile.ops as ops
    from vc_compile.runtime import state

    assert state.clear in TRACKER._subscribers and ops._forget_watched in TRACKER._subscribers
    n = len(TRACKER._subscribers)
    TRACKER.subscribe(state.clear)
    assert len(TRACKER._subscribers) == n


# ---- through compiled graphs -------------------------------------------------------------------------
class TDiT(nn.Module):
    """tests/tiny_dit.py with a timestep input (the diffusers forward signature)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, timestep, ctx):
        S = x.shape[1]
        h = x + timestep.to(x.dtype).reshape(-1, 1, 1) * 1e-3
        for b in self.m.blocks:
            h = b(h, ctx, self.m.cos[:S], self.m.sin[:S])
        return h


def _phases(rep):
    return [dict(s.phases) for s in rep.rewritten]


@torch.no_grad()
def test_compiled_no_recompiles_and_schedule():
    m, x, ctx = tiny_dit.make()
    model = TDiT(m)
    # the grouping window of the first 25% of the steps (not the default schedule): its length shows the n each
    # generation found; each CFG branch groups itself (share_grouping off), so both count it
    cm = torch.compile(model, backend="vcattn",
                       options={"min_seq_len": 64, "method": "vsmooth", "kmeans_iters": 1, "group_fraction": 0.25,
                                "group_interval": 0, "share_grouping": False,
                                "experimental": {"compiler": "eager", "kmeans_init_iters": 2}})
    # generation 1: explicit, 4 steps, CFG as two forwards
    with vc_compile.sampling(num_steps=4):
        for i, t in enumerate(torch.tensor([999, 750, 500, 250])):
            vc_compile.step(i)
            cm(x, t.expand(2), ctx)
            cm(x, t.expand(2), ctx)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1
    rep = vc_compile.report()
    assert len(rep.rewritten) == 2  # the two self-attention sites; cross-attention stays SDPA
    assert _phases(rep) == [{"group": 2, "reuse": 6}] * 2  # ceil(0.25 * 4) = 1 grouping step x 2 branches
    keys = state.keys()
    assert sorted({k[2] for k in keys}) == [0, 1]  # one entry per CFG branch
    # generation 2: no signal but the timestep input (6 steps; n unknown -> option num_steps=50)
    vc_compile.reset()
    for t in torch.tensor([999, 999, 900, 800, 700, 600]):
        cm(x, t.expand(2), ctx)
    rep = vc_compile.report()
    assert [dict(s.step_sources) for s in rep.rewritten] == [{"timestep": 6}] * 2
    assert _phases(rep) == [{"group": 6}] * 2  # 6 < ceil(0.25 * 50): all group
    # generation 3 (t back at 999: a restart) runs with the learned n = 6: 2 grouping steps, then reuse
    _report.reset_counts()
    for t in torch.tensor([999, 900, 800, 700, 600, 500]):
        cm(x, t.expand(2), ctx)
    assert _phases(vc_compile.report()) == [{"group": 2, "reuse": 4}] * 2
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile from steps, phases, branches


@torch.no_grad()
def test_dynamic_lengths_defer_min_seq_len_to_run_time():
    m, x, ctx = tiny_dit.make(seq=512)
    x = torch.randn(2, 512, 128, dtype=torch.bfloat16)
    cm = torch.compile(TDiT(m), backend="vcattn", dynamic=True,
                       options={"experimental": {"compiler": "eager"}, "min_seq_len": 64, "method": "dense"})
    for S in (256, 32, 128):
        cm(x[:, :S], torch.tensor([999.0, 999.0]), ctx)
    assert counters["stats"]["unique_graphs"] == 1
    rep = vc_compile.report()
    selfattn = [s for s in rep.sites if "Sk" not in s.shape]
    assert len(selfattn) == 2 and all(s.rewritten for s in selfattn)
    assert all(not s.shape.split("x")[2].isdigit() for s in selfattn)  # symbolic S in the graph
    for s in selfattn:
        assert s.runtime_fallbacks == {"sequence too short": 1}
        assert s.phases == {"dense": 2}
    # the cross-attention sites have a symbolic text length too: decided at run time as well
    cross = [s for s in rep.sites if "Sk" in s.shape]
    assert all(s.rewritten and s.runtime_fallbacks["cross-attention too short"] >= 2 for s in cross)


def test_cudagraph_modes_partition_or_refuse(monkeypatch):
    from vc_compile import backend

    for mode in ("reduce-overhead", "max-autotune"):
        patches = backend.inductor_patches(VCConfig(mode=mode))
        assert patches["triton.cudagraphs"] is True and patches["graph_partition"] is True
    assert "graph_partition" not in backend.inductor_patches(VCConfig(mode="max-autotune-no-cudagraphs"))
    monkeypatch.setattr(backend, "cudagraph_partition_supported", lambda: False)
    with pytest.raises(VCConfigError, match="max-autotune-no-cudagraphs"):
        backend.inductor_patches(VCConfig(mode="reduce-overhead"))


@torch.no_grad()
def test_reduce_overhead_on_cpu_inductor():
    """The one Inductor compile here: mode='reduce-overhead' on CPU (Inductor skips CUDA graphs on CPU)
    runs, matches eager within V-Smooth's tolerance, and phases advance."""
    m, x, ctx = tiny_dit.make()
    ref = m(x, ctx).float()
    cm = torch.compile(m, backend="vcattn", options={"mode": "reduce-overhead", "min_seq_len": 64})
    with vc_compile.sampling(num_steps=4):
        for i in range(4):
            vc_compile.step(i)
            out = cm(x, ctx)
    assert _phases(vc_compile.report()) == [{"group": 1, "reuse": 3}] * 2
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.05
    assert counters["stats"]["unique_graphs"] == 1


@requires_cuda
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@torch.no_grad()
def test_reduce_overhead_phases_advance_gpu(mode):
    """Under CUDA graphs the op must run its Python on every call: phases follow the schedule (a frozen
    op would report the phases of its recorded call only), the output stays close to eager, and a
    CUDA timestep is read once per forward, not per attention call."""
    m, x, ctx = tiny_dit.make()
    m, x, ctx = m.cuda(), x.cuda(), ctx.cuda()
    model = TDiT(m).cuda()
    ts = torch.tensor([999, 800, 600, 400, 200, 100], device="cuda")
    ref = model(x, ts[-1].expand(2), ctx).float()
    # reference kernels: this test is about the op's Python running under CUDA graphs, not the kernels
    cm = torch.compile(model, backend="vcattn", options={
        "mode": mode, "min_seq_len": 64, "method": "mcsparse", "density": 0.5, "warmup_steps": 1,
        "warmup_attention": "sdpa",
        "anchor_steps": (1, 3), "experimental": {"kernels": "reference"}})
    calls = 0
    with vc_compile.sampling(num_steps=6):
        for i, t in enumerate(ts):
            vc_compile.step(i)
            torch.compiler.cudagraph_mark_step_begin()
            out = cm(x, t.expand(2), ctx).clone()
            calls += 1
    # CUDA graphs were really recorded (not skipped), in pieces around the two ops (H200, torch 2.11:
    # cudagraph_partitions = 5, no skips)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"]["cudagraph_partitions"] >= 3
    # 6 steps: dense 0, anchors 1 and 3, reuse 2, 4, 5
    assert _phases(vc_compile.report()) == [{"dense": 1, "anchor": 2, "reuse": 3}] * 2
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.1
    # the timestep fallback on CUDA: one host read per forward
    vc_compile.reset()
    counters["vcattn"]["timestep_sync"] = 0
    for t in ts:
        torch.compiler.cudagraph_mark_step_begin()
        cm(x, t.expand(2), ctx)
    assert counters["vcattn"]["timestep_sync"] == len(ts)
    assert [dict(s.step_sources) for s in vc_compile.report().rewritten] == [{"timestep": len(ts)}] * 2
