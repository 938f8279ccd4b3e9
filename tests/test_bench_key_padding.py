"""benchmarks/bench_key_padding.py without a GPU (--smoke: tiny shape, reference path, no rows written): both stock
baselines and every method give a row, the methods on the kept keys (report: the key padding), with their error
against fp32 on the kept keys at the level of the reference path."""
import math

import pytest

from benchmarks import bench_key_padding as bk

pytestmark = pytest.mark.usefixtures("fresh_vcattn")


def test_smoke_rows(monkeypatch):
    monkeypatch.setattr(bk, "append_rows", lambda *a, **k: pytest.fail("--smoke appends no rows"))
    rows = {r["variant"]: r for r in bk.main(["--smoke"])}
    assert set(rows) == {"sdpa_masked", "sdpa_kept_cudnn", "vsmooth", "vsmooth+expcast", "mcsparse@0.15"}
    for name in ("vsmooth", "vsmooth+expcast", "mcsparse@0.15"):
        r = rows[name]
        assert r["kernel_path"] == "reference" and r["note"] == "" and math.isfinite(r["ms"])
        assert 0 < r["rel_l2"] < 5e-2  # the 8-bit reference (MC-Sparse's reuse: bf16) on the kept keys
        assert r["speedup_vs_masked"] == pytest.approx(rows["sdpa_masked"]["ms"] / r["ms"])
    assert rows["sdpa_masked"]["S"] == 112 and rows["sdpa_masked"]["kept"] == 5
