"""Option validation: every bad key or value is refused at compile time with a message naming it."""
import dataclasses

import pytest
import torch

from vc_compile.backend import inductor_patches
from vc_compile.config import Method, QKFormat, VCConfig, VCConfigError


def test_defaults_and_roundtrip():
    cfg = VCConfig.from_options({})
    assert cfg.resolved_method == Method.VSMOOTH and cfg.qk_format == QKFormat.INT8
    assert cfg.group_fraction == 0.0 and cfg.group_interval == 25 and cfg.share_grouping
    cfg2 = VCConfig.from_options({"method": "mcsparse", "density": 0.25, "anchor_steps": [3, 9]})
    assert VCConfig.from_json(cfg2.to_json()) == cfg2
    assert cfg2.anchor_steps == (3, 9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.density = 0.5


def test_unknown_key_lists_accepted():
    with pytest.raises(VCConfigError, match=r"unknown vcattn option\(s\) \['densty'\].*accepted options.*density"):
        VCConfig.from_options({"densty": 0.2})


def test_a_typo_gets_the_closest_name():
    """A misspelt option, experimental knob or choice names the closest accepted one first (not only the list of
    33); a name close to nothing gets no guess."""
    with pytest.raises(VCConfigError, match=r"did you mean 'densty' -> 'density'\?"):
        VCConfig.from_options({"densty": 0.2})
    with pytest.raises(VCConfigError, match=r"did you mean 'kernel' -> 'kernels'\?"):
        VCConfig.from_options({"experimental": {"kernel": "triton"}})
    with pytest.raises(VCConfigError, match=r"did you mean 'vsmoth' -> 'vsmooth'\?"):
        VCConfig.from_options({"method": "vsmoth"})
    with pytest.raises(VCConfigError) as e:
        VCConfig.from_options({"zzzzzz": 1})
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("key,value,accepted", [
    ("method", "sparse", "auto"),
    ("density", 0.0, r"\(0, 1\]"),
    ("density", 1.5, r"\(0, 1\]"),
    ("density", "high", "a number"),
    ("group_fraction", -0.1, r"\[0, 1\]"),
    ("group_interval", -1, "an int >= 0"),
    ("qk_format", "int4", "int8"),
    ("expcast", "yes", "True or False"),
    ("group_size", 32, "64 or 128"),
    ("kmeans_iters", 0, ">= 1"),
    ("warmup_steps", -1, "None or an int >= 0"),
    ("anchor_interval", 0, "None or an int >= 1"),
    ("anchor_steps", "10,26", "a tuple of ints"),
    ("residual", "fp4", "['bf16', 'fp8', 'none']"),
    ("min_seq_len", 0, ">= 1"),
    ("head_dims", (), "non-empty"),
    ("mode", "fast", "max-autotune"),
    ("num_steps", 0, ">= 1"),
    # values that used to pass validation or escape it with another error
    ("residual_budget_gb", 10 ** 400, "within float range"),  # was OverflowError
    ("anchor_steps", {10: 1, 26: 1}, "a tuple"),  # a dict passed as its keys
    ("head_dims", (d for d in (64, 128)), "a tuple"),  # a generator was consumed and reported as ()
    ("kmeans_iters", 10 ** 6, "at most 100"),  # no upper bound: a grouping step of a million passes over V
    ("tune_cache_dir", "/tmp/a\x00b", "without NUL"),  # passed, then raised ValueError inside the tuner
])
def test_bad_values_name_key_and_accepted(key, value, accepted):
    with pytest.raises(VCConfigError, match=key) as e:
        VCConfig.from_options({key: value})
    assert e.match(accepted)


@pytest.mark.parametrize("key,value,accepted", [
    ("kernels", "cuda", "triton"),
    ("compiler", "aot", "inductor"),
    ("smooth_v", 1, "True or False"),
    ("kmeans_init_iters", 0, ">= 1"),
    ("selection", "topk", "exact"),
])
def test_bad_experimental_values_name_key_and_accepted(key, value, accepted):
    with pytest.raises(VCConfigError, match=rf"experimental\['{key}'\]") as e:
        VCConfig.from_options({"experimental": {key: value}})
    assert e.match(accepted)


def test_experimental_knobs_live_in_one_option():
    """The ablation / debug knobs are given as one ``experimental={...}`` option: validated, round-tripped, and
    refused at the top level with an error that says where they go."""
    cfg = VCConfig.from_options({"experimental": {"kernels": "reference", "compiler": "eager", "smooth_v": False}})
    assert cfg.experimental.kernels.value == "reference" and cfg.experimental.smooth_v is False
    assert VCConfig.from_json(cfg.to_json()) == cfg
    assert VCConfig(experimental={"compiler": "eager"}).experimental.compiler.value == "eager"
    for key in ("kernels", "compiler", "smooth_v", "kmeans_init_iters", "selection", "selection_unit",
                "query_grouping", "selection_refresh"):
        with pytest.raises(VCConfigError, match=rf"\['{key}'\] are experimental knobs: give them as experimental="):
            VCConfig.from_options({key: VCConfig().experimental.to_dict()[key]})
    with pytest.raises(VCConfigError, match=r"unknown vcattn experimental option\(s\) \['kernel'\]"):
        VCConfig.from_options({"experimental": {"kernel": "triton"}})
    with pytest.raises(VCConfigError, match="a dict of"):
        VCConfig.from_options({"experimental": "reference"})


def test_merge_options_merges_experimental():
    from vc_compile.config import merge_options

    ladder = {"method": "mcsparse", "residual": "none", "experimental": {"selection": "mean_pool"}}
    got = merge_options(ladder, {"experimental": {"compiler": "eager"}, "density": 0.25})
    assert got == {"method": "mcsparse", "residual": "none", "density": 0.25,
                   "experimental": {"selection": "mean_pool", "compiler": "eager"}}
    assert ladder["experimental"] == {"selection": "mean_pool"}  # inputs untouched
    assert merge_options(None, {"method": "dense"}) == {"method": "dense"}


def test_group_size_default_has_one_source():
    """MC-Sparse's query-group size: VCConfig's default is what the stateless op's schema, the tune CLI and the
    sparse kernel's shipped table assume (the tune CLI used 64 while the runtime used 128)."""
    import json

    import vc_compile  # noqa: F401  (registers torch.ops.vcattn)
    from vc_compile import tune_cli
    from vc_compile.tune.cache import SHIPPED_DIR

    C = VCConfig().group_size
    schema = torch.ops.vcattn.sparse_attention.default._schema
    assert next(a for a in schema.arguments if a.name == "group_size").default_value == C
    args = tune_cli.parser().parse_args(["--method", "mcsparse", "--heads", "1", "--head-dim", "128", "--seq", "64"])
    assert args.group_size == C and args.density == VCConfig().density and args.sparse_qk == VCConfig().sparse_qk
    vs = tune_cli.parser().parse_args(["--method", "vsmooth", "--heads", "1", "--head-dim", "128", "--seq", "64"])
    assert vs.qk_format == VCConfig().qk_format.value and vs.expcast == VCConfig().expcast
    with open(f"{SHIPPED_DIR}/shipped_sm90.json") as f:
        assert any(f"-c{C}-" in key for key in json.load(f)["sparse_attn"])
    # the head dims rewritten by default are the ones the 8-bit kernels take
    from vc_compile.kernels.configs import VSMOOTH_HEAD_DIMS
    assert VCConfig().head_dims == VSMOOTH_HEAD_DIMS


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

    readme = open(os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")).read()
    for f in dataclasses.fields(VCConfig):
        assert f"| `{f.name}` |" in readme, f"docs/usage.md options table lacks {f.name}"


def _default_repr(f):
    import enum

    d = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if dataclasses.is_dataclass(d):
        return "{}"  # experimental: every knob at its default
    return repr(d.value if isinstance(d, enum.Enum) else d)


def test_readme_options_rows_match_option_docs():
    """Each README row is exactly ``| `name` | `default` | OPTION_DOCS[name] |`` in docs/usage.md (the table is generated
    from OPTION_DOCS; a stale row fails here), and likewise the experimental knobs' table."""
    import os

    from vc_compile.config import EXPERIMENTAL_DOCS, OPTION_DOCS, Experimental

    readme = open(os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")).read()
    for cls, docs in ((VCConfig, OPTION_DOCS), (Experimental, EXPERIMENTAL_DOCS)):
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(cls):
            row = f"| `{f.name}` | `{_default_repr(f)}` | {docs[f.name]} |"
            assert row in readme, f"docs/usage.md options row for {f.name} differs from its docs table: want {row}"


def test_every_choice_is_an_enum_and_every_field_has_a_rule():
    """Options are typed end to end: a choice among named values is a str Enum (no string compared against a
    tuple downstream), and coercion follows each field's annotation: no field passes through unchecked."""
    import dataclasses
    import enum
    import typing

    from vc_compile import config as cfgmod
    for cls in (cfgmod.VCConfig, cfgmod.Experimental):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if f.name in ("mode", "tune_cache_dir"):  # torch.compile's mode string; a path
                continue
            assert tp is not str, f"{cls.__name__}.{f.name} is a bare str: make it an Enum"
            default = getattr(cls(), f.name)
            if isinstance(default, enum.Enum):
                assert isinstance(cfgmod._coerce(f.name, default.value, default, cls=cls), type(default))
    c = cfgmod.VCConfig.from_options({"sparse_qk": "fp8", "residual": "none", "anchor_dense": "q8"})
    assert (c.sparse_qk, c.residual, c.anchor_dense) == (cfgmod.SparseQK.FP8, cfgmod.Residual.NONE,
                                                          cfgmod.AnchorDense.Q8)
    assert cfgmod.VCConfig.from_json(c.to_json()) == c and '"residual": "none"' in c.to_json()

    @dataclasses.dataclass(frozen=True)
    class Odd:
        blob: bytes = b""
    with pytest.raises(TypeError, match="no coercion rule"):
        cfgmod._coerce("blob", b"x", b"", cls=Odd)


def test_a_bad_option_through_torch_compile_is_a_usage_error():
    """Through ``torch.compile(..., backend='vcattn', options=...)`` the options are read inside Dynamo's compile,
    which wrapped our error in ``BackendCompilerFailed`` with PyTorch's bug-report text. It now arrives as the
    ``VCConfigError`` itself (a ``ValueError``), naming the closest option and saying it is a usage error."""
    import vc_compile  # noqa: F401  (registers the backend)

    torch._dynamo.reset()
    f = torch.compile(torch.nn.Linear(4, 4), backend="vcattn", options={"methd": "vsmooth"})
    with pytest.raises(VCConfigError, match=r"did you mean 'methd' -> 'method'\?.*not a PyTorch bug") as e:
        f(torch.randn(2, 4))
    assert isinstance(e.value, ValueError)
    torch._dynamo.reset()
