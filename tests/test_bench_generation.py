"""CPU smoke of benchmarks/bench_generation.py (the op's real phase schedule over a generation on drifting
inputs, per-phase sums, the reuse-step breakdown) and of the shared baseline/input helpers it uses."""
import os

import pytest
import torch

from benchmarks import bench_generation as bg
from benchmarks import common

pytestmark = pytest.mark.usefixtures("fresh_vcattn")


def test_smoke_phase_schedule_sums_and_fidelity():
    csv = os.path.join(common.RESULTS_DIR, "bench_generation.csv")
    before = os.path.getsize(csv) if os.path.exists(csv) else None
    rows = bg.main(["--smoke", "--methods", "vsmooth,mcsparse@0.15"])
    assert (os.path.getsize(csv) if os.path.exists(csv) else None) == before  # --smoke appends nothing
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["sdpa_cudnn", "vsmooth", "vsmooth:reuse_breakdown", "mcsparse@0.15",
                        "mcsparse@0.15:reuse_breakdown"]
    steps = 6
    for v in ("sdpa_cudnn", "vsmooth", "mcsparse@0.15"):
        r = by[v]
        per_step = [float(t) for t in r["step_ms"].split()]
        assert len(per_step) == steps and r["ms"] == pytest.approx(sum(per_step), abs=0.01 * steps)
        assert r["speedup_vs_cudnn"] == pytest.approx(by["sdpa_cudnn"]["ms"] / r["ms"])
        assert r["first_generation_s"] > 0 and r["steps"] == steps
    assert by["sdpa_cudnn"]["rel_l2"] < 5e-3  # bf16 SDPA vs the fp32 reference
    assert by["vsmooth"]["rel_l2"] < 0.06 and by["vsmooth"]["cos_sim"] > 0.99
    assert by["mcsparse@0.15"]["rel_l2"] < 0.5  # 64 of 256 keys + residual on near-uniform attention
    for v in ("vsmooth", "mcsparse@0.15"):
        r = by[v]
        assert sum(r[f"n_{p}"] for p in bg.PHASES) == steps
        assert sum(r[f"ms_{p}"] for p in bg.PHASES) == pytest.approx(r["ms"])
    # the schedule over 6 steps: V-Smooth groups on step 0 (every 25th step); MC-Sparse: 1 warm-up step
    # (round(0.2 * 6)), anchors at steps 1 and round(0.52 * 6) = 3, reuse elsewhere
    assert (by["vsmooth"]["n_group"], by["vsmooth"]["n_reuse"]) == (1, 5)
    r = by["mcsparse@0.15"]
    assert (r["n_dense"], r["n_warmup"], r["n_anchor"], r["n_reuse"]) == (0, 1, 2, 3)  # V-Smooth warm-up
    for v in ("vsmooth", "mcsparse@0.15"):
        b = by[f"{v}:reuse_breakdown"]
        assert b["host_ms"] > 0 and b["ms"] > 0 and "no CUDA kernels" in b["note"]


def test_fa4_is_optional():
    func, note = common.fa4_status()
    if not torch.cuda.is_available():
        assert func is None and note.startswith("fa4-bf16 skipped")
        q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
        assert common.fa4_fn(q, q, q) is None


def test_drift_is_deterministic_and_moves_a_little_each_step():
    a, b = common.Drift(1, 2, 64, 64, seed=3), common.Drift(1, 2, 64, 64, seed=3)
    x0, y0 = a.step(), b.step()
    x1, y1 = a.step(), b.step()
    for u, w in zip(x0 + x1, y0 + y1):
        assert torch.equal(u, w)
    for u0, u1 in zip(x0, x1):  # rate 0.05 of the spread per step
        rel = ((u1.float() - u0.float()).norm() / u0.float().norm()).item()
        assert 0.02 < rel < 0.1
    q, k, v = x0
    assert q.shape == (1, 64, 2, 64) and q.dtype == torch.bfloat16


def test_add_speedup_matches_shapes():
    rows = [{"variant": "base", "H": 2, "S": 8, "ms": 4.0}, {"variant": "x", "H": 2, "S": 8, "ms": 2.0},
            {"variant": "x", "H": 2, "S": 16, "ms": 2.0}, {"variant": "y", "H": 2, "S": 8, "ms": float("nan")}]
    common.add_speedup(rows, "base", "speedup_vs_base", keys=("H", "S"))
    assert [r["speedup_vs_base"] for r in rows] == [1.0, 2.0, "", ""]


def test_kernel_times_from_device_events_or_attached_kernels():
    from types import SimpleNamespace as NS

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def span(us):
        return NS(elapsed_us=lambda: us)
    dev = NS(events=lambda: [NS(device_type=cuda, name="_sparse_attn_kernel", time_range=span(7000.0)),
                             NS(device_type=cuda, name="_sparse_attn_kernel", time_range=span(1000.0)),
                             NS(device_type=cpu, name="vcattn::attention", time_range=span(9000.0), kernels=[])])
    assert common.kernel_times(dev) == {"_sparse_attn_kernel": 8.0}
    att = NS(events=lambda: [NS(device_type=cpu, name="op", kernels=[NS(name="k", duration=500.0)])])
    assert common.kernel_times(att) == {"k": 0.5}
