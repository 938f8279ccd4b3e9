"""templates/dispatch.py's kernel table (``KERNELS``): every kernel module is a row, and what follows from the
rows (import check, tuning sources, tuning classes, the report's labels) stays consistent with them."""
import ast
import importlib
import os
import pathlib

import pytest
import torch

from vc_compile.templates import configs as C
from vc_compile.templates import dispatch

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
        if name == "vc_compile.templates.topk":
            raise ImportError("no module named 'triton'")
        return real(name, *a, **kw)
    monkeypatch.setattr(importlib, "import_module", fake)
    try:
        err = dispatch.triton_error()
    finally:
        dispatch.triton_error.cache_clear()
    assert err == "ImportError: no module named 'triton'"
    rows = [f"vc_compile.templates.{r.module}" for r in dispatch.KERNELS.values() if r.core]
    assert seen == rows[:rows.index("vc_compile.templates.topk") + 1]  # in table order, up to the failure
    # the Gluon kernels are not part of the check: a Triton without Gluon keeps the Triton kernels
    assert {r.name for r in dispatch.KERNELS.values() if not r.core} == {"vsmooth_attn_sm90", "sparse_attn_sm90"}
    assert "vc_compile.templates.vsmooth_attn_sm90" not in seen


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
    assert vsmooth.path_label("triton", None, cfg, cpu) == "triton"
    assert vsmooth.path_label("reference", None, cfg, cpu) == "reference"
