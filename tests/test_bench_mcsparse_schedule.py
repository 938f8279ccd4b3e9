"""benchmarks/bench_mcsparse_schedule.py: the schedule it models is the one MC-Sparse runs (its warm-up length
moves the first anchor with it), and its arguments are checked. The study itself needs the demo model's
generations (GPU; on a CPU ~1 min for its --smoke), so the schedule logic runs here, and the open-loop study
and benchmarks/bench_vsmooth_schedule.py in their CPU smoke form."""
import pytest

from benchmarks import bench_mcsparse_schedule as bs


def test_schedule_follows_the_warmup_length():
    phases, cost = bs.schedule_cost(50, 10, 0.15)
    assert phases[:10] == ["warmup"] * 10 and phases.count("anchor") == 2 and phases[10] == "anchor"
    assert cost == pytest.approx(10 * bs.COSTS["warmup"] + 2 * bs.COSTS["anchor"] + 38)
    short, cheaper = bs.schedule_cost(50, 4, 0.15)
    assert short[4] == "anchor" and short.count("warmup") == 4 and cheaper < cost


def test_warmups_must_fit_the_schedule():
    assert bs.parse_args(["--warmups", "0,5", "--steps", "10", "--device", "cpu"]).warmup_list == [0, 5]
    with pytest.raises(SystemExit):
        bs.parse_args(["--warmups", "10", "--steps", "10"])


def test_anchor_sets_are_the_schedules_mcsparse_runs():
    a = bs.parse_args(["--warmups", "10", "--anchor-sets", "10,26;10;10,18,26,34,42", "--device", "cpu"])
    assert a.anchor_list == [(10, 26), (10,), (10, 18, 26, 34, 42)]
    phases, cost = bs.schedule_cost(50, 10, 0.15, (10, 18, 26, 34, 42))
    assert [i for i, p in enumerate(phases) if p == "anchor"] == [10, 18, 26, 34, 42]
    assert cost == pytest.approx(10 * bs.COSTS["warmup"] + 5 * bs.COSTS["anchor"] + 35)
    assert bs.schedule_cost(50, 10, 0.15, (10, 26)) == bs.schedule_cost(50, 10, 0.15)  # the default schedule
    for bad in (["--warmups", "4,10", "--anchor-sets", "10"],  # one warm-up for all schedules
                ["--warmups", "10", "--anchor-sets", "12,26"],  # the first step after the warm-up selects
                ["--warmups", "10", "--anchor-sets", "10,50"], ["--warmups", "10", "--anchor-sets", "10,x"]):
        with pytest.raises(SystemExit):
            bs.parse_args(bad + ["--device", "cpu"])


def test_open_loop_smoke_measures_each_schedule_against_fp64():
    """--open-loop --smoke (CPU, 3 steps, 1024 tokens): one row per warm-up length, each call's error against
    fp64 on the dense trajectory; a warm-up of 0 anchors at step 0 (its selection from the first, least
    denoised step), so its error is the larger one."""
    rows = bs.main(["--open-loop", "--smoke"])
    assert [r["warmup_steps"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 < r["rel_l2"] < 0.2 and r["rel_l2_max"] >= r["rel_l2"]
        assert len(__import__("json").loads(r["per_step"])) == 3
    assert rows[0]["rel_l2"] > rows[1]["rel_l2"]


def test_vsmooth_schedule_smoke_ranks_regrouping_every_step_first():
    """benchmarks/bench_vsmooth_schedule.py --smoke (CPU, 4 steps): re-grouping at every step is the reference
    (x1.0) and a grouping kept from step 0 is no better than it on the same calls."""
    from benchmarks import bench_vsmooth_schedule as vs
    rows = vs.main(["--smoke", "--schedules", "0.02;1"])
    by = {r["group_steps"]: r for r in rows}
    assert set(by) == {1, 4}
    assert by[4]["vs_every_step"] == 1.0 and by[1]["vs_every_step"] >= 1.0
    assert all(0 < r["rel_l2"] < 0.05 for r in rows)
    with pytest.raises(SystemExit):
        vs.parse_args(["--schedules", "0.02,x"])
