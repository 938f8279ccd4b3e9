"""CPU smoke of benchmarks/bench_e2e.py on the fidelity model: clip rows with their floors, the clip grid, and
the attention rows (top-15% key mass per head, attention error by phase on captured inputs)."""
import csv

import pytest

from benchmarks import bench_e2e
from vc_compile.demo.model import FIDELITY_WEIGHTS

pytestmark = pytest.mark.usefixtures("fresh_vcattn")


def test_smoke_rows_grid_and_attention(tmp_path):
    if not FIDELITY_WEIGHTS.is_file():
        pytest.skip(f"no fidelity weights at {FIDELITY_WEIGHTS}")
    out = tmp_path / "bench_e2e.csv"
    rows = bench_e2e.main(["--sizes", "1k", "--steps", "3", "--weights", "fidelity", "--methods", "vsmooth",
                           "--warmup", "1", "--compiler", "eager", "--attention", "--grid", str(tmp_path / "g.png"),
                           "--csv", str(out)])
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["dense", "vsmooth", "floor:bf16-vs-fp32", "floor:seed-to-seed"]
    assert by["floor:seed-to-seed"]["psnr"] < by["vsmooth"]["psnr"] < float("inf")
    assert (tmp_path / "g.png").stat().st_size > 0
    att = list(csv.DictReader(open(tmp_path / "bench_e2e_attention.csv")))
    mass = [r for r in att if r["variant"] == "mass"]
    assert len(mass) == 3 * 4 * 3  # layers x heads x the 3 distinct steps of a 3-step run
    assert all(0.15 <= float(r["top15_mass"]) <= 1.0 for r in mass)
    err = {(r["variant"], r["phase"]): float(r["rel_l2"]) for r in att if r["variant"].startswith("attn:")}
    assert set(err) == {("attn:dense", "call"), ("attn:vsmooth", "group"), ("attn:vsmooth", "reuse")}
    assert err[("attn:dense", "call")] < 5e-3 < err[("attn:vsmooth", "reuse")] < 0.05
