"""The MC-Sparse quality guard (methods/mcsparse_guard.py): its pure pieces, the estimate it reads, and its
trigger through the op (a fast-drifting trajectory re-anchors, a slow one does not). CPU: the reference
path (the probe kernel itself: tests/kernels/test_finite_flags.py); GPU: no host sync on reuse steps."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import requires_cuda
import vc_compile
from vc_compile.config import VCConfig, VCConfigError
from vc_compile.methods import mcsparse_guard as G
from vc_compile.reference import finite_flags as ref
from vc_compile.runtime import report as _report


# ---- pure pieces -----------------------------------------------------------------------------------------
def test_sample_rows():
    r = G.sample_rows(2, 3, 4096)
    assert r.shape == (2, 3, G.ROWS) and r.dtype == torch.int32
    assert int(r.min()) >= 0 and int(r.max()) < 4096
    assert torch.equal(r, G.sample_rows(2, 3, 4096))  # deterministic per shape
    assert not torch.equal(r[0, 0], r[0, 1])  # heads sample different rows
    assert len({int(x) % 256 for x in r[0, 0]}) > 4  # not one position per 16 x 16 frame (stride 256)
    small = G.sample_rows(1, 1, 5)
    assert int(small.max()) < 5  # fewer queries than rows: repeats, in range


def test_rel_error_and_decision():
    assert G.rel_error(4.0, 100.0) == pytest.approx(0.2)
    assert math.isnan(G.rel_error(float("nan"), 1.0)) and math.isnan(G.rel_error(1.0, float("inf")))
    assert G.rel_error(0.25, 0.0) == pytest.approx(0.5)  # all-zero exact rows: the absolute error
    gap = G.MIN_GAP - 1
    assert G.should_reanchor(0.2, 0.1, gap)
    assert not G.should_reanchor(0.05, 0.1, gap)
    assert not G.should_reanchor(0.2, 0.0, gap)  # threshold 0: the guard is off
    assert not G.should_reanchor(None, 0.1, gap) and not G.should_reanchor(float("nan"), 0.1, gap)
    assert not G.should_reanchor(float("inf"), 0.1, gap)  # a non-finite reading comes from NaN/Inf inputs
    assert not G.should_reanchor(0.2, 0.1, gap - 1)  # too soon after the anchor: dearer than dense


def test_guard_state_poll_cpu():
    st = G.GuardState.new(torch.zeros(1, 2, 100, 64))
    assert st.rows.shape == (1, 2, G.ROWS) and st.poll() is None
    st.record(torch.tensor([1.0, 100.0]))
    st.record(torch.tensor([9.0, 100.0]))
    assert st.reuse_steps == 2
    assert st.poll() == pytest.approx(0.3)  # the newest reading
    assert st.errors == pytest.approx([0.1, 0.3]) and st.poll() is None


def test_option_validation():
    assert VCConfig.from_options({"guard_threshold": 0.1}).guard_threshold == 0.1
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(VCConfigError, match="guard_threshold"):
            VCConfig.from_options({"guard_threshold": bad})


# ---- the estimate ----------------------------------------------------------------------------------------
def test_estimate_tracks_the_true_error():
    """16 sampled rows per head estimate the reuse output's relative error over all rows: within a factor
    1.5 on an output with a known, spatially varying error (rows near the end 4x worse)."""
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 1, 4, 2048, 64
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    exact_all = F.scaled_dot_product_attention(q, k, v)
    scale = torch.linspace(1.0, 4.0, S)[None, None, :, None]
    for size in (0.01, 0.1):
        out = exact_all + size * scale * exact_all.std() * torch.randn(exact_all.shape, generator=g)
        true = ((out - exact_all).norm() / exact_all.norm()).item()
        rows = G.sample_rows(B, H, S)
        num, den = ref.probe_error(out, rows, ref.probe_rows(q, k, v, rows, D ** -0.5)).tolist()
        est = G.rel_error(num, den)
        assert true / 1.5 < est < true * 1.5, (size, true, est)


# ---- the trigger, through the op -------------------------------------------------------------------------
def walk(steps, drift, S=256, H=2, D=64, seed=0):
    """A random walk: x_t = x_{t-1} + drift * N(0, 1) (x_0 ~ N(0, 1)), bf16."""
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(1, H, S, D, generator=g) for _ in range(3)]
    for t in range(steps):
        if t:
            x = [a + drift * torch.randn(a.shape, generator=g) for a in x]
        yield [a.bfloat16() for a in x]


def run(traj, threshold, steps=14, **options):
    """The guard's runs: without the reuse check unless ``options`` turn it on (guard off: the unguarded method)."""
    site = _report.register_site(graph="guard", node="n", module="m", shape="?", dtype="?", method="mcsparse",
                                 rewritten=True).site
    cj = VCConfig.from_options({"method": "mcsparse", "warmup_steps": 0, "anchor_steps": (0,), "density": 0.25,
                                "group_size": 64, "min_seq_len": 1, "experimental": {"kernels": "reference"},
                                "guard_threshold": threshold, "reuse_check": False, **options}).to_json()
    outs, errs, anchors = [], [], []
    with vc_compile.sampling(num_steps=steps):
        for t, (q, k, v) in enumerate(traj):
            vc_compile.step(t)
            before = _report.site(site).phases["anchor"]
            o = torch.ops.vcattn.attention(q, k, v, None, site, cj, None)
            if _report.site(site).phases["anchor"] > before:
                anchors.append(t)
            ref_o = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            outs.append(o)
            errs.append(((o.float() - ref_o).norm() / ref_o.norm()).item())
    return outs, errs, anchors, _report.site(site)


def test_fast_drift_reanchors():
    from torch._dynamo.utils import counters

    from vc_compile.methods.mcsparse_guard import _warn_unreachable

    counters["vcattn"].clear()
    _warn_unreachable.cache_clear()
    steps, tau = 14, 0.08
    _, errs0, anchors0, _ = run(walk(steps, 0.05), 0.0, steps)
    with pytest.warns(RuntimeWarning, match="re-anchoring cannot meet it at density=0.25"):
        _, errs, anchors, rec = run(walk(steps, 0.05), tau, steps)
    assert errs[1] > tau  # (the first reuse step is already over: hence the warning)
    assert anchors0 == [0]
    assert rec.guard_anchors >= 2 and counters["vcattn"]["guard_anchor"] == rec.guard_anchors
    assert anchors[0] == 0 and len(anchors) == 1 + rec.guard_anchors
    for a, b in zip(anchors, anchors[1:]):
        assert b - a >= G.MIN_GAP  # never dearer than dense
        assert errs[b - 1] > tau  # the lagged decision: the step before each guard anchor was over
    assert errs0[-1] > 2 * tau  # without the guard the error keeps growing
    assert sum(errs) < 0.6 * sum(errs0)
    assert rec.guard_readings == steps - len(anchors) - 1  # every reuse reading but the last is read back
    assert "guard" in str(_report.report())


def test_slow_drift_does_not_reanchor():
    import warnings

    from vc_compile.methods.mcsparse_guard import _warn_unreachable

    _warn_unreachable.cache_clear()
    steps = 14
    outs0, errs0, _, _ = run(walk(steps, 0.002), 0.0, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        outs, errs, anchors, rec = run(walk(steps, 0.002), 0.08, steps)
    assert anchors == [0] and rec.guard_anchors == 0
    assert rec.guard_readings >= steps - 2 and 0 < rec.guard_err_max < 0.08
    assert max(errs) < 0.08
    for a, b in zip(outs, outs0):  # the guard only watches: the outputs are those of the guard off
        assert torch.equal(a, b)


def test_nonfinite_reading_does_not_reanchor():
    """A NaN key on a reuse step makes the reading NaN: no anchor (it would cache nothing)."""
    steps = 8
    traj = list(walk(steps, 0.002))
    for t in range(1, steps):
        traj[t][1] = traj[t][1].clone()
        traj[t][1][0, 0, 5, 0] = float("nan")
    _, _, anchors, rec = run(traj, 0.01, steps)
    assert anchors == [0] and rec.guard_anchors == 0 and rec.guard_readings == 0


# ---- GPU: no host sync on reuse steps ---------------------------------------------------------------------
@requires_cuda
def test_reuse_steps_do_not_sync_cuda():
    """Steps 2..7 are reuse steps with the guard measuring (threshold never reached): any device->host
    sync in them (an .item(), a blocking copy) raises under sync debug mode "error"."""
    S, steps = 4096, 8
    site = _report.register_site(graph="guard", node="n", module="m", shape="?", dtype="?", method="mcsparse",
                                 rewritten=True).site
    cj = VCConfig.from_options({"method": "mcsparse", "warmup_steps": 0, "anchor_steps": (0,), "min_seq_len": 1,
                                "guard_threshold": 10.0}).to_json()
    traj = [[x.cuda() for x in t] for t in walk(steps, 0.01, S=S, H=4, D=128)]
    with vc_compile.sampling(num_steps=steps):
        for t in range(steps):
            vc_compile.step(t)
            if t == 2:  # after the anchor (one sync: its finite check) and the first reuse step (tuning)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                torch.ops.vcattn.attention(*traj[t], None, site, cj, None)
            except Exception:
                torch.cuda.set_sync_debug_mode(0)
                raise
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    rec = _report.site(site)
    assert rec.phases["reuse"] == steps - 1 and rec.guard_readings >= steps - 3 and rec.guard_anchors == 0


# ---- the reuse check (option reuse_check, on by default) ------------------------------------------------
def test_worse_than_previous_rule():
    assert G.worse_than_previous(0.10, 0.07)  # the finding's case: 9.7e-2 against the previous output's 7.0e-2
    assert not G.worse_than_previous(0.04, 0.01)  # under the floor: within the 8-bit paths' own error
    assert not G.worse_than_previous(0.10, 0.12)  # better than the previous output
    assert not G.worse_than_previous(float("nan"), 0.01) and not G.worse_than_previous(0.2, float("inf"))


def noisy(steps, noise, S=1024, H=2, D=64, seed=0, sharp=1.0):
    """Diffuse (Gaussian q, k, v) or, with ``sharp``, peaked attention, plus fresh noise of ``noise`` * t at step t."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(1, H, S, D, generator=g) for _ in range(3)]
    base[0], base[1] = base[0] * sharp, base[1] * sharp
    for t in range(steps):
        yield [(b + noise * t * torch.randn(b.shape, generator=g)).bfloat16() for b in base]


def test_reuse_check_sends_a_site_worse_than_its_previous_output_to_stock_sdpa():
    """Diffuse, noisy inputs: the first reuse step is further from exact attention (0.16) than the anchor's output
    would be (0.085). From the next call on the site runs stock SDPA (its output bit for bit) until its next anchor,
    with one warning and the reason counted; without the check the reuse steps stay 3-10x further from the truth."""
    from vc_compile.methods.mcsparse import REUSE_WORSE

    steps = 6
    traj = list(noisy(steps, 0.05))
    _, errs0, _, rec0 = run(traj, 0.0, steps)  # the check off
    assert errs0[1] > 0.1 and not rec0.runtime_fallbacks
    with pytest.warns(RuntimeWarning, match=r"first reuse step after the anchor is further from exact attention "
                                            r"\(rel. L2 0\.1\d\d .*\(0\.0[6-9]\d\).*reuse_check"):
        outs, errs, anchors, rec = run(traj, 0.0, steps, reuse_check=True)
    assert anchors == [0] and rec.phases["reuse"] == 1 and rec.phases["dense"] == steps - 2
    assert rec.runtime_fallbacks[REUSE_WORSE] == steps - 2
    assert errs[1] == errs0[1]  # the checked step itself is the unchecked method's
    for t in range(2, steps):
        q, k, v = traj[t]
        assert torch.equal(outs[t], F.scaled_dot_product_attention(q, k, v))
        assert errs[t] < errs0[t] / 3
    assert REUSE_WORSE in str(_report.report())


def test_reuse_check_keeps_a_site_that_beats_its_previous_output():
    """Peaked attention (q, k x 8) with the same noise, and a slow random walk: reuse steps far better than the
    previous output; the check only watches (outputs equal to the check off, no warning, no fallback)."""
    import warnings

    steps = 6
    for traj in (list(noisy(steps, 0.05, sharp=8.0)), list(walk(steps, 0.002))):
        outs0, _, _, _ = run(traj, 0.0, steps)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            outs, errs, anchors, rec = run(traj, 0.0, steps, reuse_check=True)
        assert anchors == [0] and rec.phases["reuse"] == steps - 1 and not rec.runtime_fallbacks
        for a, b in zip(outs, outs0):
            assert torch.equal(a, b)


def test_reuse_check_runs_again_at_the_next_anchor():
    """anchor_steps (0, 3) on the diffuse noisy inputs: step 1 is checked and fails, step 2 runs stock SDPA, step 3
    anchors again, step 4 is checked again (and fails again: step 5 stock)."""
    from vc_compile.methods.mcsparse import REUSE_WORSE

    steps = 6
    with pytest.warns(RuntimeWarning, match="reuse_check"):
        _, _, anchors, rec = run(list(noisy(steps, 0.05)), 0.0, steps, reuse_check=True, anchor_steps=(0, 3))
    assert anchors == [0, 3] and rec.phases["reuse"] == 2 and rec.runtime_fallbacks[REUSE_WORSE] == 2


def test_the_guard_replaces_the_reuse_check():
    """With guard_threshold > 0 the guard reads every reuse step and re-anchors; the check does not also run."""
    steps = 6
    _, _, _, rec = run(list(noisy(steps, 0.05)), 10.0, steps, reuse_check=True)
    assert rec.phases["reuse"] == steps - 1 and not rec.runtime_fallbacks and rec.guard_readings >= steps - 2


def test_reuse_check_option():
    assert VCConfig.from_options({}).reuse_check is True
    with pytest.raises(VCConfigError, match="reuse_check"):
        VCConfig.from_options({"reuse_check": 1})


@requires_cuda
def test_reuse_check_on_cuda_no_sync_and_the_reference_decision():
    """The check's reuse step (the first after each anchor) and the steps after it make no host sync (sync debug
    mode "error" on every reuse step but the first, whose kernels are tuned); on the diffuse noisy inputs the
    Triton path decides as the reference does: stock SDPA from the call after the reading finished."""
    from vc_compile.methods.mcsparse import REUSE_WORSE

    S, steps = 4096, 8
    opts = {"method": "mcsparse", "warmup_steps": 0, "anchor_steps": (0, 4), "min_seq_len": 1}
    cj = VCConfig.from_options(opts).to_json()
    site = _report.register_site(graph="check", node="n", module="m", shape="?", dtype="?", method="mcsparse",
                                 rewritten=True).site
    traj = [[x.cuda() for x in t] for t in walk(steps, 0.002, S=S, H=4, D=128)]
    with vc_compile.sampling(num_steps=steps):
        for t in range(steps):
            vc_compile.step(t)
            if t in (2, 5):  # reuse steps after the first (t = 5: the check after the anchor at 4)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                torch.ops.vcattn.attention(*traj[t], None, site, cj, None)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    rec = _report.site(site)
    assert rec.phases["anchor"] == 2 and rec.phases["reuse"] == steps - 2 and not rec.runtime_fallbacks

    site = _report.register_site(graph="check", node="n2", module="m2", shape="?", dtype="?", method="mcsparse",
                                 rewritten=True).site
    cj = VCConfig.from_options({**opts, "anchor_steps": (0,), "density": 0.25, "group_size": 64}).to_json()
    with pytest.warns(RuntimeWarning, match="reuse_check"), vc_compile.sampling(num_steps=5):
        for t, (q, k, v) in enumerate(noisy(5, 0.05)):
            vc_compile.step(t)
            out = torch.ops.vcattn.attention(q.cuda(), k.cuda(), v.cuda(), None, site, cj, None)
            torch.cuda.synchronize()  # the reading is ready at the next call
    rec = _report.site(site)
    assert rec.phases["reuse"] == 1 and rec.runtime_fallbacks[REUSE_WORSE] == 3
    assert torch.equal(out, F.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda()))
