"""The toolchain a user installs (``vc_compile/toolchain.py``, ``kernels/compat.py``, the build-failure
fallback of ``kernels/dispatch.py``): Gluon's renamed APIs resolved by feature detection; a kernel that does
not build falls back once to the next path (Gluon sm_90 -> Triton -> stock SDPA) with one warning naming the
Triton version and the fix, and the reason in ``report()``; a build failure is told from a run failure; the
remembered launches' calling convention read from the installed Triton; an untested Triton warned about at
compile time.

On a CPU the sm_90 path is forced (``dispatch._on_sm90``) and the Gluon kernel made to fail as Triton 3.7 made
it fail (a ``CompilationError`` for the missing ``gl.thread_barrier``): the Triton kernels then run under the
interpreter, so the generation's fallback is exercised end to end. On an sm_90 GPU a Gluon build failure is
real (a kernel helper replaced by a plain Python function, which Gluon refuses to compile).
"""
import os
import warnings

import pytest
import torch

import vc_compile
from conftest import requires_cuda
from tiny_dit import make
from vc_compile import toolchain
from vc_compile.kernels import dispatch

BROKEN = "AttributeError(\"module 'triton.experimental.gluon.language' has no attribute 'thread_barrier'\")"


def _compile_error():
    from triton.compiler.errors import CompilationError
    return CompilationError(None, None, BROKEN)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    dispatch.forget_build_failures()
    yield
    dispatch.forget_build_failures()


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _generate(model, x, ctx, steps=3, compile_only=False, **options):
    """``steps`` denoising calls of the compiled model inside one sampling loop: the last output. ``compile_only``:
    for what the compile itself does (its warnings): where there is no GPU, on the CPU reference path, not the
    interpreter's kernels."""
    options = dict(options, num_steps=steps, min_seq_len=64)
    if compile_only and not torch.cuda.is_available():
        options["experimental"] = dict(options.get("experimental", {}), kernels="reference", compiler="eager")
    elif not torch.cuda.is_available():  # the Triton kernels under the interpreter (the CPU's default: the reference)
        # NOTE the rewritten graph runs eagerly on the CPU: what these tests check happens in the op, and Inductor's
        # C++ build of the tiny model was most of their time (its integration: tests/test_backend.py)
        options["experimental"] = dict(options.get("experimental", {}), kernels="triton", compiler="eager")
    compiled = torch.compile(model, backend="vcattn", options=options)
    with vc_compile.sampling(steps) as loop:
        for i in range(steps):
            loop.step(i)
            with torch.no_grad():
                out = compiled(x, ctx)
    return out


def _force_sm90(monkeypatch, on: bool = True):
    """Take the sm_90 decisions (``on``) on this CPU, or not (``on=False``) on an sm_90 GPU: the Gluon kernels
    are then never tried (the preprocessing writes the other V layout)."""
    monkeypatch.setattr(dispatch, "_on_sm90", lambda device: on)


def _on_device(model, x, ctx):
    """The tiny model where the kernels run: the GPU where there is one, else the CPU (the interpreter)."""
    return (model.cuda(), x.cuda(), ctx.cuda()) if torch.cuda.is_available() else (model, x, ctx)


# On a GPU the tiny model has head dim 128, the Gluon kernel's default path; at head dim 64 the Triton kernel these
# tests fall back to is gated to stock SDPA on Triton 3.9 (toolchain.KNOWN_FAILURES). The interpreter keeps 64.
_HEADS = dict(dim=256) if torch.cuda.is_available() else {}
# NOTE these tests check what a fallback or a warning does, not the kernels' numerics (their own tests): on the
# CPU 128 tokens, half the interpreter's work of 256, still run every kernel of the path
_SEQ = 256 if torch.cuda.is_available() else 128


def _gluon_fails(monkeypatch, calls):
    from vc_compile.kernels import sparse_attn_sm90, vsmooth_attn_sm90

    def fail(*a, **k):
        calls.append(1)
        raise _compile_error()
    monkeypatch.setattr(vsmooth_attn_sm90, "vsmooth_attention_sm90", fail)
    monkeypatch.setattr(sparse_attn_sm90, "sparse_attention_sm90", fail)


def _our_warnings(w):
    return [str(x.message) for x in w if str(x.message).startswith("vcattn: the ")]


# ---- Gluon's moved names ----------------------------------------------------------------------------------
def test_gluon_names_resolve_to_the_installed_tritons_builtins():
    """Each name is the installed Triton's builtin: the new name wherever it exists (3.9 keeps the old ones only
    as functions that raise)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import tma

    from vc_compile.kernels import compat as gc
    assert gc.barrier is (getattr(gl, "barrier", None) or gl.thread_barrier)
    assert gc.cp_async_load is (getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared)
    assert gc.tma_load is (getattr(tma, "async_load", None) or tma.async_copy_global_to_shared)
    for f in (gc.barrier, gc.cp_async_load, gc.tma_load):
        assert getattr(f, "__triton_builtin__", False), f


# ---- the sm_90 assembler ----------------------------------------------------------------------------------
def test_the_sm90_assembler_is_the_bundled_cuda12_ptxas_where_triton_picks_cuda13():
    from types import SimpleNamespace as T

    from vc_compile.kernels import compat
    blackwell, legacy = T(path="/t/ptxas-blackwell", version="13.4"), T(path="/t/ptxas", version="12.9")
    assert compat.choose_ptxas(blackwell, legacy) == "/t/ptxas"  # Triton 3.9
    assert compat.choose_ptxas(legacy, legacy) is None  # Triton 3.6-3.8: sm_90 with the CUDA 12 ptxas already
    assert compat.choose_ptxas(blackwell, T(path="/t/ptxas", version="13.0")) is None  # no CUDA 12 one shipped
    assert compat.choose_ptxas(blackwell, None) is None


def test_assembled_kernels_build_inside_the_assembler(monkeypatch):
    """A kernel module's JIT functions run (launch, build) with Triton's sm_90 ptxas knob pointed at the chosen
    one, restored afterwards; the class's run is looked up at call time (harnesses patch it)."""
    import os

    from triton.runtime.jit import JITFunction

    from vc_compile.kernels import compat

    def k(X):
        pass
    fn, seen = JITFunction(k), []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: seen.append(
        (self is fn, os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"))))
    monkeypatch.setattr(compat, "sm90_ptxas", lambda: "/opt/cuda12/ptxas")
    before = os.environ.get("TRITON_PTXAS_BLACKWELL_PATH")
    compat.assembled({"k": fn, "other": 3})
    fn.run(grid=(1,), warmup=True)
    fn[(1,)](None)
    assert seen == [(True, "/opt/cuda12/ptxas")] * 2
    assert os.environ.get("TRITON_PTXAS_BLACKWELL_PATH") == before


def test_kernels_ask_for_fp_fusion_where_its_default_is_changing(monkeypatch):
    """Where Triton announces that unasked kernels lose FP fusion (3.9: off from 3.10 on), every launch of ours
    asks for it (the arithmetic is written for FMAs); a launch that names the option itself keeps its choice;
    elsewhere (3.6-3.8: fusion on, nothing announced) no wrapper is installed."""
    from triton.runtime.jit import JITFunction

    from vc_compile.kernels import compat

    def k(X):
        pass
    seen = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: seen.append(kw.get("enable_fp_fusion")))
    monkeypatch.setattr(compat, "sm90_ptxas", lambda: None)
    monkeypatch.setattr(compat, "fusion_unpinned", lambda: True)
    fn = JITFunction(k)
    compat.assembled({"k": fn})
    fn.run(grid=(1,), warmup=True)
    fn.run(grid=(1,), warmup=True, enable_fp_fusion=False)
    assert seen == [True, False]
    monkeypatch.setattr(compat, "fusion_unpinned", lambda: False)
    fn2 = JITFunction(k)
    compat.assembled({"k": fn2})
    assert "run" not in vars(fn2)


def test_fusion_unpinned_reads_the_installed_triton():
    import triton

    from vc_compile.kernels import compat
    announced = hasattr(triton.knobs.language, "fp_fusion_enabled")
    assert compat.fusion_unpinned() == announced
    if triton.__version__.startswith("3.9."):
        assert announced  # the release that announced the change


# ---- build failures ---------------------------------------------------------------------------------------
def test_build_errors_are_told_from_run_errors():
    from triton.runtime.errors import OutOfResources, PTXASError
    assert dispatch.is_build_error(_compile_error())
    assert dispatch.is_build_error(OutOfResources(300000, 232448, "shared memory"))
    assert dispatch.is_build_error(PTXASError("ptxas fatal"))
    assert not dispatch.is_build_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not dispatch.is_build_error(ValueError("q8/k8 must both be int8"))
    # anything raised inside Triton's compiler (an MLIR pass failing is a plain RuntimeError)
    ns = {}
    exec(compile("def compile_it():\n    raise RuntimeError('PassManager::run failed')\n",
                 "/site-packages/triton/compiler/compiler.py", "exec"), ns)
    with pytest.raises(RuntimeError) as e:
        ns["compile_it"]()
    assert dispatch.is_build_error(e.value)
    # the JIT refusing a kernel's source (a plain function where a builtin was: Gluon's renamed APIs)
    exec(compile("def record_reference(val):\n    raise RuntimeError(f'Unsupported function referenced: {val}')\n",
                 "/site-packages/triton/runtime/jit.py", "exec"), ns)
    with pytest.raises(RuntimeError) as e:
        ns["record_reference"](print)
    assert dispatch.is_build_error(e.value)
    # ... but not the JIT's launch-time checks
    exec(compile("def run():\n    raise RuntimeError('Global variable x has changed since we compiled this kernel')\n",
                 "/site-packages/triton/runtime/jit.py", "exec"), ns)
    with pytest.raises(RuntimeError) as e:
        ns["run"]()
    assert not dispatch.is_build_error(e.value)


def test_a_row_that_failed_to_build_is_not_tried_again():
    calls = []

    def fail():
        calls.append(1)
        raise _compile_error()
    for _ in range(3):
        with pytest.raises(dispatch.KernelBuildError, match="thread_barrier"):
            dispatch.built("vsmooth_attn_sm90", fail)
    assert len(calls) == 1 and "thread_barrier" in dispatch.build_failure("vsmooth_attn_sm90")
    with pytest.raises(ValueError):  # not a build failure: unchanged, nothing marked
        dispatch.built("vsmooth_attn", lambda: (_ for _ in ()).throw(ValueError("bad input")))
    assert dispatch.build_failure("vsmooth_attn") is None


def test_a_gluon_build_failure_falls_back_to_the_triton_kernel_once(fresh_vcattn, monkeypatch):
    """A V-Smooth generation completes on the Triton kernels with exactly one warning (the Triton version, the
    fix), the output of a run that never tried the Gluon kernel, and ``report()`` says what happened."""
    opts = dict(method="vsmooth", speed_gate="off")
    model, x, ctx = _on_device(*make(seq=_SEQ, **_HEADS))
    _force_sm90(monkeypatch, False)
    ref = _generate(model, x, ctx, **opts)  # the Triton kernels, the Gluon one never tried
    torch._dynamo.reset()
    vc_compile.reset(report=True)
    _force_sm90(monkeypatch)
    calls = []
    _gluon_fails(monkeypatch, calls)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = _generate(model, x, ctx, **opts)
    ours = _our_warnings(w)
    assert len(ours) == 1, ours
    assert "did not build on Triton" in ours[0] and toolchain.triton_version() in ours[0]
    assert "the Triton kernel runs instead" in ours[0]
    assert len(calls) == 1  # tried once, never again
    assert _rel(out, ref) < 1e-3
    text = str(vc_compile.report())
    assert "did not build on Triton" in text and "thread_barrier" in text


def test_a_gluon_gather_kernel_build_failure_falls_back_to_the_triton_gather_kernel(monkeypatch):
    """MC-Sparse's reuse step: the Gluon gather kernel fails to build, the Triton one gives its result; a second
    Gluon kernel failing in the same process adds no warning (``report()`` lists both)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels"))
    from test_sparse_attn import make_inputs  # tests/kernels/
    q, k, v, sigma, idx, res = make_inputs(1, 2, 256, 64, torch.bfloat16, 0.3, C=64)

    def run():
        return dispatch.sparse_attention(dispatch.Impl.TRITON, q, k, v, sigma, idx, sm_scale=0.125, group_size=64,
                                         residual=res)
    _force_sm90(monkeypatch, False)
    ref = run()
    assert dispatch.sparse_kernel(q, v, "bf16", 64) == "sparse_attn"
    _force_sm90(monkeypatch)
    assert dispatch.sparse_kernel(q, v, "bf16", 64) == "sparse_attn_sm90"
    calls = []
    _gluon_fails(monkeypatch, calls)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = run()
        out2 = run()
        with pytest.raises(dispatch.KernelBuildError):  # 8-bit QK exists only on the Gluon kernel
            dispatch.sparse_attention(dispatch.Impl.TRITON, q, k, v, sigma, idx, sm_scale=0.125, group_size=64,
                                      qk_format="int8")
        with pytest.raises(dispatch.KernelBuildError):  # a second Gluon kernel fails: no second warning
            dispatch.built("vsmooth_attn_sm90", lambda: (_ for _ in ()).throw(_compile_error()))
        dispatch._fell_back("vsmooth_attn_sm90", "the Triton kernel", "Gluon sm_90 V-Smooth kernel")
    assert len(_our_warnings(w)) == 1 and "gather kernel" in _our_warnings(w)[0]
    assert len(calls) == 1 and torch.equal(out, ref) and torch.equal(out2, ref)
    assert dispatch.sparse_kernel(q, v, "bf16", 64) == "sparse_attn"  # (the failed row is not tried again)
    assert set(dispatch.build_failures()) == {"sparse_attn_sm90", "vsmooth_attn_sm90"}


def test_when_no_kernel_builds_the_generation_runs_stock_sdpa(fresh_vcattn, monkeypatch):
    """The Gluon and the Triton attention kernels both fail to build: every call runs stock SDPA (the output of
    the model with stock attention), two warnings (the Gluon kernel, then the method), the reason per site."""
    from vc_compile.kernels import vsmooth_attn
    model, x, ctx = _on_device(*make(seq=_SEQ, **_HEADS))
    with torch.no_grad():
        stock = model(x, ctx)
    _force_sm90(monkeypatch)
    calls = []
    _gluon_fails(monkeypatch, calls)
    monkeypatch.setattr(vsmooth_attn, "vsmooth_attention", lambda *a, **k: (_ for _ in ()).throw(_compile_error()))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = _generate(model, x, ctx, method="vsmooth", speed_gate="off")
    ours = _our_warnings(w)
    assert len(ours) == 2 and "stock SDPA runs instead" in ours[1], ours
    assert _rel(out, stock) < 2e-2  # bf16 compiled vs eager
    rep = vc_compile.report()
    fallbacks = {r for s in rep.sites for r in s.runtime_fallbacks}
    assert any(r.startswith("kernel build failed") for r in fallbacks), fallbacks
    assert len(calls) == 1


_REAL_FAILURE = r"""
import json, sys, warnings, torch
sys.path.insert(0, "tests")
import vc_compile
from tiny_dit import make
from vc_compile.kernels import dispatch
from vc_compile.kernels import vsmooth_attn_sm90 as entry, vsmooth_attn_sm90_steps as steps
from test_toolchain import _generate, _our_warnings, _rel
model, x, ctx = make(seq=1024, dim=256)
model, x, ctx = model.cuda(), x.cuda(), ctx.cuda()
on_sm90 = dispatch._on_sm90
dispatch._on_sm90 = lambda device: False  # the reference: the Triton kernel, the Gluon one never compiled
ref = _generate(model, x, ctx, method="vsmooth", speed_gate="off")
dispatch._on_sm90 = on_sm90
torch._dynamo.reset(); vc_compile.reset(report=True)
# helpers Gluon cannot compile (plain functions where its builtins were): the first build fails for real
steps.barrier = steps.tma_load = entry.tma_load = lambda *a, **k: None
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out = _generate(model, x, ctx, method="vsmooth", speed_gate="off")
print("RESULT" + json.dumps({"warnings": _our_warnings(w), "rel": _rel(out, ref),
                             "failed": dispatch.build_failure("vsmooth_attn_sm90"),
                             "paths": sorted({p for s in vc_compile.report().sites for p in s.kernel_path})}))
"""


@requires_cuda
def test_gpu_a_real_gluon_build_failure_falls_back():
    """On an sm_90 GPU, in a fresh process (no Gluon kernel compiled yet): the Gluon kernel's barrier and TMA
    helpers replaced by plain functions, which Gluon refuses to compile; the default V-Smooth path falls back to the
    Triton kernel with one warning and gives the Triton kernel's result."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    import json
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _REAL_FAILURE], capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, r.stderr[-3000:]
    res = json.loads(line[len("RESULT"):])
    assert len(res["warnings"]) == 1 and "Gluon sm_90 V-Smooth kernel" in res["warnings"][0], res
    assert res["failed"] and res["rel"] < 1e-2, res
    assert "triton/gluon_sm90" not in res["paths"], res


# ---- the launch convention and the supported range ----------------------------------------------------------
def test_the_launch_convention_is_read_from_the_installed_triton(monkeypatch):
    from triton.runtime.jit import JITFunction

    from vc_compile.kernels import launch
    assert launch._convention_error() is None  # 3.6-3.9 launch as the remembered launches replay

    def run(self, *args, grid, warmup, **kwargs):  # a JIT that launches another way
        kernel = self.cache[0]
        kernel.launch(grid, *args)
    monkeypatch.setattr(JITFunction, "run", run)
    why = launch._convention_error()
    assert why is not None and "calling convention" in why


def test_an_untested_triton_is_warned_about_once_at_compile_time(monkeypatch, fresh_vcattn):
    monkeypatch.setattr(toolchain, "triton_version", lambda: "3.11.0")
    toolchain.check.cache_clear()
    assert not toolchain.triton_supported()
    assert "3.6-3.9" in toolchain.fix() and "torch" in toolchain.fix()
    model, x, ctx = make(seq=_SEQ)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _generate(model, x, ctx, steps=1, compile_only=True, method="vsmooth", speed_gate="off")
        _generate(model, x, ctx, steps=1, compile_only=True, method="vsmooth", speed_gate="off")
    msgs = [str(x.message) for x in w if "outside the tested range" in str(x.message)]
    toolchain.check.cache_clear()
    assert len(msgs) == 1 and "Triton 3.11.0" in msgs[0]


def test_a_fast_path_off_is_warned_about_at_compile_time(monkeypatch, fresh_vcattn):
    """A Triton whose JIT launches another way: the remembered launches switch off, and the compile says so once
    (not only report())."""
    from vc_compile.kernels import launch
    monkeypatch.setattr(launch, "_CONVENTION_ERROR", "Triton 9.9's JITFunction.run does not launch as the "
                                                     "remembered launches replay (a new calling convention)")
    toolchain.check.cache_clear()
    model, x, ctx = make(seq=_SEQ)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _generate(model, x, ctx, steps=1, compile_only=True, method="vsmooth", speed_gate="off")
    msgs = [str(x.message) for x in w if "remembered kernel launches are off" in str(x.message)]
    toolchain.check.cache_clear()
    assert len(msgs) == 1 and "new calling convention" in msgs[0]


def test_a_supported_triton_says_a_build_failure_is_a_bug(monkeypatch):
    monkeypatch.setattr(toolchain, "triton_version", lambda: "3.9.0")
    assert toolchain.triton_supported() and "bug" in toolchain.fix()
    assert toolchain.untested_reason() is None


def test_a_known_kernel_failure_sends_its_calls_to_stock_sdpa(monkeypatch):
    """toolchain.KNOWN_FAILURES: on the listed Triton, the listed kernel / ExpCast / head dim reads a reason (the
    op then runs stock SDPA on the GPU, warned once per site); other kernels (the Gluon one), head dims, ExpCast
    and releases do not."""
    from vc_compile import ops
    from vc_compile.runtime import report as _report

    monkeypatch.setattr(toolchain, "triton_version", lambda: "3.9.0")
    toolchain.known_failure.cache_clear()
    toolchain.has_known_failures.cache_clear()
    try:
        assert toolchain.has_known_failures()
        assert "head dim 64" in toolchain.known_failure("vsmooth_attn", False, 64)
        assert toolchain.known_failure("vsmooth_attn", True, 64) is None
        assert toolchain.known_failure("vsmooth_attn", False, 128) is None
        assert toolchain.known_failure("vsmooth_attn_sm90", False, 64) is None
        assert toolchain.known_failure("sparse_attn", False, 64) is None
        rec = _report.register_site(graph="g", node="n", module="blocks.0.attn", shape="1x2x300x64", dtype="bf16",
                                    method="vsmooth", rewritten=True)
        with pytest.warns(RuntimeWarning, match="runs stock SDPA: on Triton 3.9"):
            assert ops._known_failure(rec, rec.site, "vsmooth_attn", False, 64) == ops.KNOWN_FAILURE
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per site
            assert ops._known_failure(rec, rec.site, "vsmooth_attn", False, 64) == ops.KNOWN_FAILURE
        monkeypatch.setattr(toolchain, "triton_version", lambda: "3.6.0")
        toolchain.known_failure.cache_clear()
        toolchain.has_known_failures.cache_clear()
        assert toolchain.known_failure("vsmooth_attn", False, 64) is None
        assert not toolchain.has_known_failures()  # the op asks nothing more on 3.6
    finally:
        toolchain.known_failure.cache_clear()
        toolchain.has_known_failures.cache_clear()
