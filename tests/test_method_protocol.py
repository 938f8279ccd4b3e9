"""The op knows no method by name: a toy method module that follows ``methods.protocol.AttentionMethod`` runs
through ``vcattn::attention`` with its own schedule, metadata slots, identity need and report label."""
import types

import torch

import vc_compile.ops  # noqa: F401  (registers vcattn::attention)
from vc_compile import reset
from vc_compile.config import Method, VCConfig
from vc_compile.methods import METHODS, AttentionMethod, Phase, Plan
from vc_compile.runtime import report as _report
from vc_compile.runtime import state


def _toy():
    seen = []

    def plan(cfg, step, n, slot, q, k, v, impl):
        meta = slot(("toy",))
        phase = Phase.GROUP if meta is None else Phase.REUSE
        return Plan(phase, meta, ("toy",))

    def run(q, k, v, *, phase, meta, cfg, sm_scale, impl, **kw):
        seen.append((phase, meta))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v) * 0 + (meta or 0) + 1
        return out, (meta or 0) + 1  # metadata: how many calls this block has seen

    m = types.SimpleNamespace(USES_KERNELS=True, FUSES_ROPE=False, NEEDS_IDENTITY=False,
                              needs_fp8=lambda cfg: False, ineligible=lambda q, k, v: None, plan=plan, run=run,
                              path_label=lambda path, phase, cfg, q, v: f"toy:{phase.value}",
                              replayable=lambda phase, cfg: False)
    return m, seen


def test_a_toy_method_runs_through_the_op(monkeypatch):
    reset()
    toy, seen = _toy()
    assert isinstance(toy, AttentionMethod)
    monkeypatch.setitem(METHODS, Method.VSMOOTH, toy)
    cfg = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 16, "max_logit_std": 0,
                                 "experimental": {"kernels": "reference"}}).to_json()
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    outs = [torch.ops.vcattn.attention(q, q, q, None, 901, cfg, None) for _ in range(3)]
    assert [o.flatten()[0].item() for o in outs] == [1.0, 2.0, 3.0]  # its metadata kept in its own slot
    assert [p for p, _ in seen] == [Phase.GROUP, Phase.REUSE, Phase.REUSE]
    rec = _report.site(901)
    assert rec.kernel_path["toy:group"] == 1 and rec.kernel_path["toy:reuse"] == 2
    assert any(key[-1] == "toy" for key in state.keys())  # the slot the plan named
    reset()
