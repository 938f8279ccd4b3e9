"""Option validation: every bad key or value is refused at compile time with a message naming it."""
import dataclasses

import pytest
import torch

from vc_compile.backend import inductor_patches
from vc_compile.config import Method, QKFormat, VCConfig, VCConfigError


def test_defaults_and_roundtrip():
    cfg = VCConfig.from_options({})
    assert cfg.resolved_method == Method.VSMOOTH and cfg.qk_format == QKFormat.INT8
    assert cfg.group_fraction == 0.25
    cfg2 = VCConfig.from_options({"method": "mcsparse", "density": 0.25, "anchor_steps": [3, 9]})
    assert VCConfig.from_json(cfg2.to_json()) == cfg2
    assert cfg2.anchor_steps == (3, 9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.density = 0.5


def test_unknown_key_lists_accepted():
    with pytest.raises(VCConfigError, match=r"unknown vcattn option\(s\) \['densty'\].*accepted options.*density"):
        VCConfig.from_options({"densty": 0.2})


@pytest.mark.parametrize("key,value,accepted", [
    ("method", "sparse", "auto"),
    ("density", 0.0, r"\(0, 1\]"),
    ("density", 1.5, r"\(0, 1\]"),
    ("density", "high", "a number"),
    ("group_fraction", -0.1, r"\[0, 1\]"),
    ("qk_format", "int4", "int8"),
    ("expcast", "yes", "True or False"),
    ("group_size", 32, "64 or 128"),
    ("kmeans_iters", 0, ">= 1"),
    ("warmup_steps", -1, "None or an int >= 0"),
    ("anchor_interval", 0, "None or an int >= 1"),
    ("anchor_steps", "10,26", "a tuple of ints"),
    ("residual", "fp4", "'bf16', 'fp8' or 'none'"),
    ("min_seq_len", 0, ">= 1"),
    ("head_dims", (), "non-empty"),
    ("kernels", "cuda", "triton"),
    ("mode", "fast", "max-autotune"),
    ("num_steps", 0, ">= 1"),
])
def test_bad_values_name_key_and_accepted(key, value, accepted):
    with pytest.raises(VCConfigError, match=key) as e:
        VCConfig.from_options({key: value})
    assert e.match(accepted)


def test_anchor_steps_and_interval_exclusive():
    with pytest.raises(VCConfigError, match="not both"):
        VCConfig.from_options({"anchor_steps": (1,), "anchor_interval": 5})


def test_mode_kwarg_and_option_agree():
    assert VCConfig.from_options({}, mode="max-autotune").mode == "max-autotune"
    assert VCConfig.from_options({"mode": "reduce-overhead"}).mode == "reduce-overhead"
    with pytest.raises(VCConfigError, match="disagree"):
        VCConfig.from_options({"mode": "reduce-overhead"}, mode="max-autotune")


def test_mode_maps_to_scoped_inductor_patches():
    assert inductor_patches(VCConfig()) == {}
    p = inductor_patches(VCConfig(mode="max-autotune"))
    assert p.get("max_autotune") is True
    assert p == {**dict(torch._inductor.list_mode_options("max-autotune")), **{k: v for k, v in p.items() if k == "graph_partition"}}
    # nothing is assigned globally
    assert torch._inductor.config.max_autotune is False


def test_bad_option_fails_at_compile_time():
    m = torch.nn.Linear(4, 4)
    cm = torch.compile(m, backend="vcattn", options={"method": "nope"})
    with pytest.raises(Exception, match="method"):
        cm(torch.randn(2, 4))


def test_readme_options_table_lists_every_option():
    import dataclasses
    import os

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for f in dataclasses.fields(VCConfig):
        assert f"| `{f.name}` |" in readme, f"README options table lacks {f.name}"


def test_readme_options_rows_match_option_docs():
    """Each README row is exactly ``| `name` | `default` | OPTION_DOCS[name] |`` (the table is generated
    from OPTION_DOCS; a stale row fails here)."""
    import enum
    import os

    from vc_compile.config import OPTION_DOCS

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    assert set(OPTION_DOCS) == {f.name for f in dataclasses.fields(VCConfig)}
    for f in dataclasses.fields(VCConfig):
        d = f.default.value if isinstance(f.default, enum.Enum) else f.default
        row = f"| `{f.name}` | `{d!r}` | {OPTION_DOCS[f.name]} |"
        assert row in readme, f"README options row for {f.name} differs from OPTION_DOCS: want {row}"
