"""The op knows no method by name: a toy method module that follows ``methods.protocol.AttentionMethod`` runs
through ``vcattn::attention`` with its own schedule, metadata slots, identity need and report label."""
import ast
import re
import types
from pathlib import Path

import pytest
import torch

import vc_compile

import vc_compile.ops  # noqa: F401  (registers vcattn::attention)
from vc_compile import reset
from vc_compile.config import Method, VCConfig
from vc_compile.methods import METHODS, AttentionMethod, MethodSpec, Phase, Plan
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

    spec = MethodSpec(label=lambda cfg: f"toy@{cfg.density:g}", variants=(("toy@0.5", {"method": "vsmooth"}),),
                      warmup=("toy@0.5",), helpers=3, tune=lambda a: "the toy has a fixed launch",
                      head_dim_error=lambda D: None if D == 64 else "the toy takes head dim 64")
    m = types.SimpleNamespace(SPEC=spec, USES_KERNELS=True, FUSES_ROPE=False, NEEDS_IDENTITY=False,
                              needs_fp8=lambda cfg: False, ineligible=lambda q, k, v: None, plan=plan, run=run,
                              schedule=lambda cfg, n: (Phase.GROUP,) + (Phase.REUSE,) * (n - 1),
                              path_label=lambda path, phase, cfg, q, v: f"toy:{phase.value}",
                              replayable=lambda phase, cfg: False, main_kernel=lambda q, v, cfg: None)
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


def test_a_toy_method_reaches_every_consumer_through_its_spec(monkeypatch, capsys):
    """A method is its module, its row in ``METHODS`` and its ``config.Method`` value: the demo, the warm-up, the
    kernel-build helpers, the speed gate and the tuning CLI read its ``SPEC`` (here the toy takes V-Smooth's row)."""
    import vc_compile.backend as backend
    import vc_compile.ops as ops
    from vc_compile import methods, tune_cli
    from vc_compile.config import Prebuild
    from vc_compile.demo import __main__ as demo_main
    from vc_compile.runtime.runtime import current

    toy, _ = _toy()
    monkeypatch.setitem(METHODS, Method.VSMOOTH, toy)
    assert ("toy@0.5", {"method": "vsmooth"}) in methods.variants()  # the demo's and benchmarks' rows
    assert methods.warmup_variants()["toy@0.5"] == {"method": "vsmooth"}  # python -m vc_compile warmup
    a = demo_main.parse_args(["--methods", "toy@0.5"])
    assert a.method_list == [methods.BASELINE_LABEL, "toy@0.5"]
    # the kernel-build helpers enable() starts ahead
    import vc_compile.prebuild.helpers  # noqa: F401

    started = []
    monkeypatch.setattr(current().prebuilds, "warm", lambda n: started.append(n) or n)
    monkeypatch.setattr(backend, "_auto_builds", lambda cuda, cfg: True)
    assert backend.warm_prebuild(VCConfig(method=Method.VSMOOTH, prebuild=Prebuild.ON)) == 3 and started == [3]
    # the speed gate looks the toy's label up
    asked = []
    monkeypatch.setattr(ops._gate, "slower_than_stock", lambda gpu, label, work: asked.append(label))
    monkeypatch.setattr(ops, "_gpu_name", lambda dev: "Some GPU")
    ops.gate_reason(VCConfig(method=Method.VSMOOTH, density=0.5), None, (1, 2, 64, 64), 64)
    assert asked == ["toy@0.5"]
    # the tuning CLI: its head dims, and what its tune says
    assert tune_cli.main(["--method", "vsmooth", "--heads", "1", "--head-dim", "64", "--seq", "64"]) == 0
    assert "the toy has a fixed launch" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune_cli.main(["--method", "vsmooth", "--heads", "1", "--head-dim", "128", "--seq", "64"])
    assert "the toy takes head dim 64" in capsys.readouterr().err


def _code_strings(tree):
    """String constants of a module that are not docstrings, and ``Method.X`` attributes."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "Method":
            yield n.lineno, f"Method.{n.attr}"


def test_no_consumer_names_a_method():
    """Outside the method modules, the options (``config.py``) and the kernel layer (whose table rows say which
    kernels serve which method), no code names a method or one of its variant labels: everything reads specs."""
    names = [m.value for m in Method if m != Method.AUTO]
    label = re.compile(rf"^({'|'.join(names)})([+@].*)?$")
    attrs = {f"Method.{m.name}" for m in Method if m != Method.AUTO}
    pkg = Path(vc_compile.__file__).parent
    own = ("methods", "kernels", "reference")
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if rel.parts[0] in own or rel.as_posix() == "config.py":
            continue
        for line, text in _code_strings(ast.parse(path.read_text())):
            if label.match(text) or text in attrs:
                bad.append(f"{rel}:{line}: {text!r}")
    assert bad == []
