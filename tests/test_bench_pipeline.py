"""CPU smoke of benchmarks/bench_pipeline.py: the whole script on a tiny WanPipeline (eager compiler,
reference kernels, 2 steps), its phase accounting, and the budget planner."""
import os

import pytest

from benchmarks import bench_pipeline as bp
from benchmarks.common import RESULTS_DIR

pytestmark = pytest.mark.usefixtures("fresh_vcattn")
CSV = os.path.join(RESULTS_DIR, "bench_pipeline.csv")


def _csv_state():
    return os.path.getsize(CSV) if os.path.exists(CSV) else None


def test_smoke_regional_every_method_phase_split_and_no_rows_appended():
    before = _csv_state()
    rows = bp.main(["--smoke", "--methods", "vsmooth,mcsparse@0.15", "--timed", "1"])
    assert _csv_state() == before  # --smoke appends nothing
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["stock", "vsmooth", "mcsparse@0.15"]
    for r in rows:
        assert r["compile"] == "regional" and r["steps"] == 2 and r["guidance"] == 5.0
        assert (r["S"], r["H"], r["D"], r["layers"]) == (192, 2, 64, 2)  # 3 x 8 x 8 latent patches
        assert bp.RANDOM_NOTE in r["note"] and r["timed_generations"] == 1
        assert r["first_generation_s"] > 0 and r["ms"] > 0
        assert r["speedup_vs_stock"] == pytest.approx(by["stock"]["ms"] / r["ms"])
    assert by["stock"]["first_generation_extra_s"] == 0.0 and "rel_l2" not in by["stock"]
    for v in ("vsmooth", "mcsparse@0.15"):
        r = by[v]
        # self-attention rewritten; the 8-token cross-attention stays SDPA, with its reason
        assert r["sites"] == "1 rewritten; stock SDPA: 1 cross-attention too short"
        # the same computation as stock up to the 8-bit / sparse error (reference kernels, 192 tokens)
        assert 0 < r["rel_l2"] < 0.05 and r["cos_sim"] > 0.99
        assert r["attn_ms"] > 0
        assert sum(r[f"attn_{p}_ms"] for p in bp.PHASES) == pytest.approx(r["attn_ms"])
        assert sum(r[f"step_{p}_ms"] for p in bp.PHASES) > 0
    # 2 steps: V-Smooth groups on step 0 (every 25th step); MC-Sparse anchors at round(0.2 * 2) = 0 and
    # round(0.52 * 2) = 1 (no warm-up step)
    assert by["vsmooth"]["phases"] == "group:1 reuse:1"
    assert by["vsmooth"]["attn_group_ms"] > 0 and by["vsmooth"]["attn_reuse_ms"] > 0
    assert by["mcsparse@0.15"]["phases"] == "anchor:2"
    assert by["mcsparse@0.15"]["attn_anchor_ms"] == pytest.approx(by["mcsparse@0.15"]["attn_ms"])


def test_smoke_whole_model_compile():
    rows = bp.main(["--smoke", "--compile", "whole", "--methods", "mcsparse@0.25", "--timed", "1",
                    "--no-profiled", "--layers", "1"])
    assert [(r["variant"], r["compile"]) for r in rows] == [("stock", "whole"), ("mcsparse@0.25", "whole")]
    r = rows[1]
    assert r["sites"] == "1 rewritten; stock SDPA: 1 cross-attention too short"
    assert r["layers"] == 1 and "cut to 1 of 2 layers" in r["note"]
    assert 0 < r["rel_l2"] < 0.05
    assert "attn_ms" not in r and r["phases"] == "anchor:2"


def test_estimator_is_calibrated_to_issue_20_stock_step():
    spec = bp.SIZES["1.3b-480p"]
    assert bp.tokens(spec) == 32760 and bp.tokens(bp.SIZES["14b-720p"]) == 75600
    est = bp.Estimator(spec["cfg"], 30, 32760, 50, 5.0, cuda=True)
    assert 0.95 < est.step_s < 1.10  # measured (H200): 1.04 s per CFG step with stock Inductor + cuDNN
    est.observe("stock", "regional", first_s=80.0, gen_s=50.0)
    assert est.item_s("timed", "stock", "regional") == 50.0
    assert est.item_s("cold", "stock", "regional") == 80.0
    assert est.item_s("timed", "vsmooth", "regional") == pytest.approx(50.0 / 1.18)


def test_plan_keeps_every_first_generation_before_extras():
    est = bp.Estimator(bp.SIZES["1.3b-480p"]["cfg"], 30, 32760, 50, 5.0, cuda=True)
    labels = ["stock", "vsmooth", "mcsparse@0.15"]
    ess = sum(est.item_s("cold", lab, "regional") + est.item_s("timed", lab, "regional") for lab in labels)
    lines, total = bp.plan_items(est, labels, ["regional"], 2, True, est.build_s + ess + 1.0, 0.0)
    assert total > ess
    assert not any("LEFT OUT" in line for line in lines)  # every variant's essentials fit...
    assert lines[1].endswith("left out: timed 2")  # ...and nothing more (stock has no profiled generation)
    assert all(line.endswith("left out: timed 2, profiled") for line in lines[2:])
    lines, _ = bp.plan_items(est, labels, ["regional"], 2, True, est.build_s + ess / 2, 0.0)
    assert "LEFT OUT" in lines[-1]
    lines, _ = bp.plan_items(est, labels, ["regional"], 2, True, None, 0.0)
    assert all("left out" not in line.lower() for line in lines)


def test_peers_are_left_out_with_the_reason_on_a_machine_without_them(capsys):
    """Peers (torchao FP8, SageAttention, FA4) are optional: without a GPU (or their package) each is skipped with
    why, and the methods still run against stock."""
    rows = bp.main(["--smoke", "--methods", "vsmooth", "--timed", "1", "--no-profiled"])
    assert [r["variant"] for r in rows] == ["stock", "vsmooth"]
    # the attention error of each variant on inputs captured from the run (fp32 truth on sampled rows): stock is
    # bf16 rounding (~2e-3), the 8-bit path adds its quantisation on top
    by = {r["variant"]: r for r in rows}
    assert 0 < by["stock"]["attn_rel_l2"] < 5e-3 < by["vsmooth"]["attn_rel_l2"] < 5e-2
    assert "inputs captured at layer 1, step 0" in by["vsmooth"]["note"]
    out = capsys.readouterr().out
    for p in bp.PEERS:
        assert f"{p} skipped: needs a CUDA GPU" in out
    with pytest.raises(SystemExit):
        bp.parse_args(["--smoke", "--peers", "xformers"])


class _Base:
    def __init__(self):
        self.calls = []

    def set_attention_backend(self, name):
        self.calls.append(("set", name))

    def reset_attention_backend(self):
        self.calls.append(("reset",))


class _Pipe:
    transformer = None


def test_peer_scope_undoes_what_it_does(monkeypatch):
    """sage: diffusers' backend set for the variant and reset after, also when the variant fails; torchao: its
    wrapper is the pipeline's transformer during the variant only, and the global Inductor pre-grad pass it
    installs is restored."""
    import sys
    import types

    import torch._inductor.config as ic
    base, pipe = _Base(), _Pipe()
    pipe.transformer = base
    with pytest.raises(RuntimeError):
        with bp.peer_scope("sage", pipe, base):
            assert base.calls == [("set", "sage")]
            raise RuntimeError("boom")
    assert base.calls == [("set", "sage"), ("reset",)]

    def apply(model):
        ic.pre_grad_custom_pass = "torchao-rope-fusion"
        return ("wrapped", model)
    fake = types.ModuleType("torchao.prototype.attention")
    fake.apply_low_precision_attention = apply
    for name in ("torchao", "torchao.prototype"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torchao.prototype.attention", fake)
    prev = ic.pre_grad_custom_pass
    with bp.peer_scope("torchao-fp8", pipe, base):
        assert pipe.transformer == ("wrapped", base) and ic.pre_grad_custom_pass == "torchao-rope-fusion"
    assert pipe.transformer is base and ic.pre_grad_custom_pass == prev


def test_stack_suffixes_parse_and_are_validated():
    assert bp.stacks("mcsparse@0.15+f8lin+dbcache") == ("+f8lin", "+dbcache")
    assert bp.base_label("mcsparse@0.15+f8lin+dbcache") == "mcsparse@0.15" and bp.stacks("vsmooth") == ()
    assert bp.is_method("vsmooth+expcast+dbcache") and not bp.is_method("stock+f8lin")
    a = bp.parse_args(["--methods", "stock+dbcache,vsmooth+expcast+f8lin+dbcache", "--plan-only"])
    assert a.methods == ["stock+dbcache", "vsmooth+expcast+f8lin+dbcache"]
    for bad in ("vsmooth+dbcache+f8lin", "stock", "nope+f8lin"):  # wrong order, stock alone, unknown base
        with pytest.raises(SystemExit):
            bp.parse_args(["--methods", bad, "--plan-only"])


def test_smoke_partial_schedule_is_extrapolated_by_phase():
    """``--steps 3 --schedule 12``: three steps of a 12-step schedule run (the pipeline stops there), and ``ms`` is
    each phase's median step time over the phases of all 12 steps, said in the note; memory columns are filled."""
    rows = bp.main(["--smoke", "--methods", "mcsparse@0.15", "--peers", "", "--timed", "1", "--steps", "3",
                    "--schedule", "12", "--no-profiled", "--no-attn-error"])
    by = {r["variant"]: r for r in rows}
    r = by["mcsparse@0.15"]
    assert r["schedule"] == 12 and r["phases"] == "warmup:2 anchor:1"  # 20% of 12 steps warm up, then the anchor
    assert "extrapolated: 3 of 12 steps" in r["note"] and r["metadata_gb"] > 0
    assert r["ms"] > 0 and r["ms_per_step"] == pytest.approx(r["ms"] / 12)
    assert by["stock"]["ms"] > 0 and r["speedup_vs_stock"] == pytest.approx(by["stock"]["ms"] / r["ms"])


def test_partial_schedule_labels_steps_by_the_schedule():
    """Under a memory plan most blocks of an anchor or reuse step run the dense 8-bit path, so the op records
    'warmup' as the step's main phase; the extrapolation still prices the schedule's reuse steps at the run's
    reuse step (before: every step at the warm-up's median, the 14B row 825 s)."""
    from types import SimpleNamespace

    cfg = bp.vc_compile.VCConfig.from_options(bp.METHODS["mcsparse@0.15"])
    sched = [p.value for p in bp.methods.schedule(cfg, 50)]
    first_reuse = sched.index("reuse")
    n = first_reuse + 1
    step_ms = [10.0] * (n - 2) + [20.0, 4.0]  # warm-up steps, the anchor, one reuse step
    res = SimpleNamespace(label="mcsparse@0.15", gens_s=[sum(step_ms) / 1e3], step_ms=step_ms, phases=["warmup"] * n)
    a = SimpleNamespace(schedule=50, steps=n)
    want = sum({"warmup": 10.0, "anchor": 20.0, "reuse": 4.0}[p] for p in sched)
    assert bp.schedule_ms(res, a) == pytest.approx(want)
