"""The MC-Sparse quality guard (methods/mcsparse_guard.py): its pure pieces, the estimate it reads, and its
trigger through the op (a fast-drifting trajectory re-anchors, a slow one does not). CPU: the reference
path (the probe kernel itself: tests/test_finite_flags.py); GPU: no host sync on reuse steps."""
import math

import pytest
import torch
import torch.nn.functional as F

from vc_compile.methods import mcsparse_guard as G
from vc_compile.reference import finite_flags as ref


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
