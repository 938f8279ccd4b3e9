"""The speed gate (tune/gate.py): measured on the GPU, not guessed; the shipped table is what its generator writes
from the benchmark rows; the op leaves a gated call to stock SDPA with the reason in report()."""
import json

import pytest
import torch

from conftest import requires_cuda
from vc_compile.config import SpeedGate, VCConfig
from vc_compile.tune import gate


def test_shipped_table_is_generated_from_the_benchmark_rows():
    from tools import gen_gate_table

    assert gen_gate_table.main(["--check"]) == 0


@pytest.mark.speed_gate
def test_h200_gates_small_vsmooth_calls_and_not_large_or_sparse_ones():
    gpu = "NVIDIA H200"
    small, large = 12 * 8192 ** 2 * 128.0, 12 * 32760 ** 2 * 128.0
    gate.slower_than_stock.cache_clear()
    r = gate.slower_than_stock(gpu, "vsmooth", small)
    measured = gate.estimate(gate.table()[gpu]["vsmooth"], small)  # the shipped rows' figure (0.85x at writing)
    assert measured < 1.0
    assert r is not None and r.startswith("stock is faster at this shape") and f"x{measured:.2f}" in r
    assert gate.slower_than_stock(gpu, "vsmooth+expcast", small) is not None  # ExpCast 0.98x there
    assert gate.slower_than_stock(gpu, "vsmooth", large) is None
    assert gate.slower_than_stock(gpu, "mcsparse@0.25", small) is None  # 3.0x: nearest density 0.15
    assert gate.slower_than_stock("Some Other GPU", "vsmooth", small) is None  # unmeasured: no gate
    assert gate.slower_than_stock(gpu, "dense", small) is None


def test_a_label_finds_its_row_or_the_nearest_number_of_its_name():
    labels = {"vsmooth": 0, "vsmooth+expcast": 0, "mcsparse@0.15": 0, "mcsparse@0.3": 0}
    assert gate.table_label("vsmooth+expcast", labels) == "vsmooth+expcast"
    assert gate.table_label("mcsparse@0.2", labels) == "mcsparse@0.15"
    assert gate.table_label("mcsparse@0.28", labels) == "mcsparse@0.3"
    assert gate.table_label("toy@0.2", labels) is None and gate.table_label("dense", labels) is None


@pytest.mark.speed_gate
def test_op_consults_the_gate_on_cuda_only(monkeypatch):
    """On a CPU (the reference path) the op never asks the gate; the conftest fixture leaves it on here."""
    import vc_compile
    import vc_compile.ops as ops

    asked = []
    monkeypatch.setattr(gate, "slower_than_stock", lambda *a: asked.append(a) or "stock is faster at this shape")
    q = torch.randn(1, 2, 64, 64).bfloat16()
    cfg = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 16, "max_logit_std": 0}).to_json()
    vc_compile.reset(report=True)
    torch.ops.vcattn.attention(q, q, q, None, 992_003, cfg, None)
    assert asked == [] and ops._gate is gate


def test_interpolation_is_log_log_and_held_beyond_the_ends():
    pts = [(1e11, 0.5), (4e11, 2.0)]
    assert gate.estimate(pts, 1e10) == 0.5 and gate.estimate(pts, 1e13) == 2.0
    assert gate.estimate(pts, 2e11) == pytest.approx(1.0)  # halfway in log work: sqrt(0.5 * 2)


def test_option_and_missing_table(tmp_path):
    assert VCConfig().speed_gate == SpeedGate.AUTO
    with pytest.raises(ValueError, match="speed_gate"):
        VCConfig.from_options({"speed_gate": "maybe"})
    assert gate.table(str(tmp_path / "absent.json")) == {}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert gate.table(str(bad)) == {}
    good = tmp_path / "t.json"
    good.write_text(json.dumps({"gpus": {"G": {"vsmooth": [[2e11, 1.5], [1e11, 0.5]]}}}))
    assert gate.table(str(good))["G"]["vsmooth"][0] == (1e11, 0.5)  # sorted by work


@pytest.mark.speed_gate
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_op_leaves_a_gated_call_to_stock_sdpa(monkeypatch):
    import vc_compile
    import vc_compile.ops as ops

    monkeypatch.setattr(ops, "_gpu_name", lambda device: "NVIDIA H200")
    vc_compile.reset(report=True)
    q, k, v = (torch.randn(1, 12, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = VCConfig.from_options({"method": "vsmooth", "max_logit_std": 0}).to_json()
    out = torch.ops.vcattn.attention(q, k, v, None, 992_001, cfg, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, ref)
    rec = next(s for s in vc_compile.report().sites if s.site == 992_001)
    assert any(r.startswith("stock is faster at this shape") for r in rec.runtime_fallbacks)
    off = VCConfig.from_options({"method": "vsmooth", "max_logit_std": 0, "speed_gate": "off"}).to_json()
    assert not torch.equal(torch.ops.vcattn.attention(q, k, v, None, 992_002, off, None), ref)


@pytest.mark.speed_gate
def test_a_gpu_without_measurements_is_named_in_the_report(monkeypatch):
    """On a GPU the table has no rows for, nothing is gated: ``ungated_gpu`` names it (not the H200, not with the
    gate off), and report() says so per site with the two ways out (measure it, or ``speed_gate='off'``)."""
    import vc_compile
    import vc_compile.ops as ops
    from vc_compile.runtime import report as report_mod

    assert gate.measured("NVIDIA H200") and not gate.measured("Some Other GPU")
    on = VCConfig.from_options({"method": "vsmooth"})
    off = VCConfig.from_options({"method": "vsmooth", "speed_gate": "off"})
    for name, cfg, said in (("NVIDIA H200", on, ""), ("Some Other GPU", on, "Some Other GPU"),
                            ("Some Other GPU", off, "")):
        monkeypatch.setattr(ops, "_gpu_name", lambda device, name=name: name)
        assert ops.ungated_gpu(cfg, torch.device("cuda", 0)) == said
    vc_compile.reset(report=True)
    for _ in range(2):
        rec = report_mod.register_site(graph="g", node="n", module="blocks.0.attn1", shape="[1, 12, 8192, 128]",
                                       dtype="bfloat16", method="vsmooth", rewritten=True)
        rec.ungated_gpu = "Some Other GPU"
    text = str(vc_compile.report())
    line = next(ln for ln in text.splitlines() if ln.startswith("speed gate:"))
    sites = sorted(str(s.site) for s in vc_compile.report().sites)
    assert line.startswith(f"speed gate: no measurements for the Some Other GPU (sites {', '.join(sites)}):")
    assert "gen_gate_table" in line and "speed_gate='off'" in line
    vc_compile.reset(report=True)
    assert "speed gate:" not in str(vc_compile.report())


@pytest.mark.speed_gate
@requires_cuda
def test_gpu_op_names_a_gpu_without_measurements(monkeypatch):
    """The op on a GPU the gate has no rows for runs our kernels at a size the H200's rows would gate, and its
    site's record names that GPU."""
    import vc_compile
    import vc_compile.ops as ops

    monkeypatch.setattr(ops, "_gpu_name", lambda device: "Some Other GPU")
    vc_compile.reset(report=True)
    q, k, v = (torch.randn(1, 12, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = VCConfig.from_options({"method": "vsmooth", "max_logit_std": 0}).to_json()
    torch.ops.vcattn.attention(q, k, v, None, 992_004, cfg, None)
    rec = next(s for s in vc_compile.report().sites if s.site == 992_004)
    assert rec.ungated_gpu == "Some Other GPU" and not rec.runtime_fallbacks
    assert "speed gate: no measurements for the Some Other GPU (sites 992004)" in str(vc_compile.report())
