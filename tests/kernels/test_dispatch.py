"""kernels/dispatch.py's kernel table (``KERNELS``): every kernel module is a row, and what follows from the
rows (import check, tuning sources, tuning classes, the report's labels) stays consistent with them."""
import ast
import dataclasses
import importlib
import os
import pathlib

import pytest
import torch

from vc_compile.kernels import configs as C
from vc_compile.kernels import dispatch

TEMPLATES = pathlib.Path(dispatch.__file__).parent
# helper modules of the kernels (jit helpers, the Gluon kernel's parts, configs, dispatch itself): no rows
HELPERS = {"__init__", "configs", "dispatch", "interpret", "soft_round", "rope", "vsmooth_attn_sm90_softmax",
           "vsmooth_attn_sm90_steps"}


def _has_kernel(path: pathlib.Path) -> bool:
    """Whether a module defines a launchable kernel: a function decorated ``triton.jit`` / ``gluon.jit`` whose
    name starts with ``_`` and ends with ``_kernel`` (the project's naming of launched kernels)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and node.decorator_list:
            return True
    return False


def test_every_kernel_module_is_a_row():
    mods = {p.stem for p in TEMPLATES.glob("*.py") if p.stem not in HELPERS and _has_kernel(p)}
    rows = {r.module for r in dispatch.KERNELS.values()}
    assert mods <= rows, f"kernel modules without a dispatch.KERNELS row: {sorted(mods - rows)}"
    assert rows <= {p.stem for p in TEMPLATES.glob("*.py")}, "a row names a module that does not exist"


def test_rows_are_consistent():
    for name, row in dispatch.KERNELS.items():
        assert row.name == name
        assert row.config is None or (isinstance(row.config, type) and hasattr(row.config, "from_json")
                                      and getattr(C, row.config.__name__) is row.config)
        for f in row.sources:
            assert (TEMPLATES / f).is_file(), f
    tuned = {n for n, r in dispatch.KERNELS.items() if r.tuned}
    assert set(dispatch.SOURCES) == tuned == {"vsmooth_attn", "vsmooth_attn_sm90", "sparse_attn"}
    assert all(os.path.isabs(f) for fs in dispatch.SOURCES.values() for f in fs)
    # the Gluon kernel's three files key its tuning entries: a change of its softmax re-tunes
    assert {os.path.basename(f) for f in dispatch.SOURCES["vsmooth_attn_sm90"]} >= {"vsmooth_attn_sm90_softmax.py"}


def test_triton_error_imports_every_row_and_names_the_failure(monkeypatch):
    dispatch.triton_error.cache_clear()
    seen = []
    real = importlib.import_module

    def fake(name, *a, **kw):
        seen.append(name)
        if name == "vc_compile.kernels.topk":
            raise ImportError("no module named 'triton'")
        return real(name, *a, **kw)
    monkeypatch.setattr(importlib, "import_module", fake)
    try:
        err = dispatch.triton_error()
    finally:
        dispatch.triton_error.cache_clear()
    assert err == "ImportError: no module named 'triton'"
    rows = [f"vc_compile.kernels.{r.module}" for r in dispatch.KERNELS.values() if r.core]
    assert seen == rows[:rows.index("vc_compile.kernels.topk") + 1]  # in table order, up to the failure
    # the Gluon kernels are not part of the check: a Triton without Gluon keeps the Triton kernels
    assert {r.name for r in dispatch.KERNELS.values() if not r.core} == {"vsmooth_attn_sm90", "sparse_attn_sm90"}
    assert "vc_compile.kernels.vsmooth_attn_sm90" not in seen


def test_untuned_kernels_have_no_tuning():
    with pytest.raises(ValueError, match="not tuned"):
        dispatch._resolve("topk", lambda c: None, dtype=torch.float32, head_dim=64, seq_len=64,
                          device=torch.device("cpu"))
    # a tuned row's candidates start with the measured default, for the tuner CLI too
    assert dispatch.vsmooth_candidates("vsmooth_attn_sm90", 128, True, 32760)[0] == C.vsmooth_sm90_default(
        128, True, 32760)
    assert dispatch.sparse_candidates("bf16", 128, 64)[0] == C.sparse_default("bf16", 128, 64)


def test_report_label_is_the_dispatch_decision():
    cpu = torch.device("cpu")
    assert dispatch.vsmooth_label(cpu, "int8") == dispatch.KERNELS[dispatch.vsmooth_kernel(cpu, "int8")].label
    assert dispatch.vsmooth_label(cpu, "int8") == "triton"
    assert dispatch.KERNELS["vsmooth_attn_sm90"].label == "triton/gluon_sm90"
    from vc_compile.config import VCConfig
    from vc_compile.methods import vsmooth
    cfg = VCConfig()
    x = torch.zeros(1, 1, 8, 64)
    assert vsmooth.path_label("triton", None, cfg, x, x) == "triton"
    assert vsmooth.path_label("reference", None, cfg, x, x) == "reference"


def test_every_entry_has_a_kernel_and_a_reference():
    """Each row's entry points exist in its kernel module and in reference/ (the oracle ``call`` runs for
    REFERENCE): a row cannot name a function one side lacks."""
    for name, row in dispatch.KERNELS.items():
        assert set(row.launched) <= set(row.entries), name
        assert not row.launched or row.default_launch is None or isinstance(row.default_launch, row.config), name
        for entry in row.entries:
            assert callable(dispatch.kernel_fn(name, entry)), (name, entry)
            assert callable(dispatch.reference_fn(name, entry)), (name, entry)
    with pytest.raises(ValueError, match="kmeans.*no entry 'kmeans'"):
        dispatch.reference_fn("kmeans", "kmeans")


def test_call_routes_by_impl_and_refuses_a_launch_for_the_reference():
    """``call``: REFERENCE runs the oracle (a launch config names a kernel: refused), TRITON the kernel with the
    row's default launch where the entry takes one (CPU, interpreter: the same function the wrapper used)."""
    from vc_compile.reference import kmeans as ref_kmeans
    R = dispatch.Impl.REFERENCE
    x = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(0))
    got = dispatch.call("kmeans", "kmeans_perm", R, x, 4, 2)
    want = ref_kmeans.kmeans_perm(x, 4, 2)
    assert torch.equal(got.perm, want.perm) and torch.equal(got.labels, want.labels)
    mass = torch.randn(1, 1, 3, 50, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="the reference has none"):
        dispatch.call("topk", "select_topk", R, mass, 5, launch=C.TOPK_DEFAULT)
    with pytest.raises(ValueError, match="the reference has none"):
        dispatch.topk(R, mass, 5, launch=C.TOPK_DEFAULT)
    with pytest.raises(ValueError, match="takes no launch config"):
        dispatch.call("kmeans", "kmeans_perm", dispatch.Impl.TRITON, x, 4, 2, launch=C.TOPK_DEFAULT)


def test_implementation_names_what_runs():
    cpu = torch.device("cpu")
    R, T = dispatch.Impl.REFERENCE, dispatch.Impl.TRITON
    assert dispatch.implementation("vsmooth_attn", R, device=cpu) == "reference"
    assert dispatch.implementation("vsmooth_attn", T, device=cpu) == "triton"
    # a launch config picks its kernel, and the label follows it
    ms_ws = C.vsmooth_sm90_default(128, True, 32760)
    assert dispatch.implementation("vsmooth_attn", T, device=cpu, launch=ms_ws) == "triton/gluon_sm90"
    assert dispatch.implementation("sparse_attn_sm90", T) == "triton/gluon_sm90_gather"
    assert dispatch.implementation("topk", T) == "triton"


def test_the_specialised_kernels_are_rows_of_the_table(monkeypatch):
    """The Gluon sm_90 kernels take their Triton row's calls where their row says they apply (``replaces`` /
    ``applies``); a row that failed to build does not, and a launch config of either row picks that row."""
    spec = {n: r for n, r in dispatch.KERNELS.items() if r.replaces}
    assert set(spec) == {"vsmooth_attn_sm90", "sparse_attn_sm90"}
    assert {b: [r.name for r in rows] for b, rows in dispatch._SPECIALISED.items()} == {
        "vsmooth_attn": ["vsmooth_attn_sm90"], "sparse_attn": ["sparse_attn_sm90"]}  # the table, read once
    assert all(r.replaces in dispatch.KERNELS and r.applies is not None and r.config is not None
               for r in spec.values())
    cpu = torch.device("cpu")
    assert dispatch.row_for("vsmooth_attn", device=cpu, qk_format="int8") == "vsmooth_attn"  # not an sm_90 GPU
    row = dispatch.KERNELS["vsmooth_attn_sm90"]
    monkeypatch.setitem(dispatch._SPECIALISED, "vsmooth_attn",
                        (dataclasses.replace(row, applies=lambda **call: None),))  # as on an sm_90 GPU
    assert dispatch.vsmooth_kernel(cpu, "int8") == "vsmooth_attn_sm90"
    monkeypatch.setitem(dispatch._BUILD_FAILED, "vsmooth_attn_sm90", "a build error")
    assert dispatch.vsmooth_kernel(cpu, "int8") == "vsmooth_attn"  # its base runs instead
    launch = dispatch.KERNELS["vsmooth_attn_sm90"].config()
    assert dispatch.row_for("vsmooth_attn", launch, device=cpu, qk_format="int8") == "vsmooth_attn_sm90"
