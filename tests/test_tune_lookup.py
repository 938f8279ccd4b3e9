"""The kernels' config lookup (vc_compile/tune/lookup.py), the shipped sm90 table, report()'s config
column and ``python -m vc_compile tune``. CPU tests use a fake tuner; the GPU test tunes for real."""
import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import requires_cuda
from vc_compile.tune import cache as C
from vc_compile.tune import lookup, shipped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = C.Arch("NVIDIA H200", (9, 0), "13.0", "3.6.0")
UNKNOWN = C.Arch("Future GPU", (13, 0), "14.0", "3.9.0")
CANDS = [{"BN": 64}, {"BN": 128}, {"BN": 32}]
FAST = {64: 3.0, 128: 1.0, 32: 2.0}  # the fake tuner's timings: BN=128 wins


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """resolve() on a pretend CUDA device: no interpreter, no capture, a fixed arch, a temp cache."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda i: contextlib.nullcontext())
    arch = {"a": ARCH}
    monkeypatch.setattr(lookup, "_arch", lambda index: arch["a"])
    lookup.configure(cache_dir=str(tmp_path), shipped=True, force=False)
    yield arch
    lookup.configure(cache_dir="", shipped=True, force=False, progress=False)


def resolve(bench, kernel="fake_kernel", S=32760):
    return lookup.resolve(kernel, C.__file__, CANDS, dtype=torch.bfloat16, head_dim=128, seq_len=S,
                          variant="v", device=torch.device("cuda", 0), bench=bench)


def counting_bench(calls):
    def bench(cfg):
        calls.append(cfg["BN"])
        return FAST[cfg["BN"]]
    return bench


def test_order_shipped_beats_cache_beats_tune(fake_gpu, monkeypatch):
    calls = []
    assert resolve(counting_bench(calls)) == ({"BN": 128}, "tuned") and calls == [64, 128, 32]
    lookup.clear_memo()
    assert resolve(counting_bench(calls)) == ({"BN": 128}, "cache") and len(calls) == 3
    entry = C.make_key("fake_kernel", [C.__file__], torch.bfloat16, 128, 32760, "v").entry
    monkeypatch.setattr(C, "_shipped", lambda fam: {"fake_kernel": {entry: {"BN": 32}}} if fam == "sm90" else {})
    lookup.clear_memo()
    assert resolve(counting_bench(calls)) == ({"BN": 32}, "shipped") and len(calls) == 3
    # an unknown GPU ignores sm90's table and tunes; configure(shipped=False) ignores it on an sm90 too
    fake_gpu["a"] = UNKNOWN
    lookup.clear_memo()
    assert resolve(counting_bench(calls)) == ({"BN": 128}, "tuned") and len(calls) == 6
    fake_gpu["a"] = ARCH
    lookup.configure(shipped=False)
    assert resolve(counting_bench(calls))[1] == "cache"
    lookup.configure(shipped=True, force=True)  # --force: re-tunes a shipped and cached key, once
    assert resolve(counting_bench(calls))[1] == "tuned" and len(calls) == 9
    assert resolve(counting_bench(calls))[1] == "tuned" and len(calls) == 9


def test_memoised_no_file_io_per_call(fake_gpu, monkeypatch):
    calls = []
    resolve(counting_bench(calls))
    monkeypatch.setattr(C, "load", lambda path: pytest.fail("file read on a memoised key"))
    monkeypatch.setattr(C, "_shipped", lambda fam: pytest.fail("shipped table read on a memoised key"))
    for _ in range(3):
        assert resolve(counting_bench(calls)) == ({"BN": 128}, "tuned")
    assert len(calls) == 3
    assert lookup.last_config("fake_kernel") == {"BN": 128}


def test_interpreter_and_cpu_never_tune_nor_touch_disk(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(C, "load", lambda path: pytest.fail("file read under the interpreter"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve(lambda c: pytest.fail("tuned under TRITON_INTERPRET")) == (CANDS[0], "default")
    monkeypatch.delenv("TRITON_INTERPRET")
    got = lookup.resolve("k2", C.__file__, CANDS, dtype=torch.float32, head_dim=64, seq_len=100, variant="",
                         device=torch.device("cpu"), bench=lambda c: pytest.fail("tuned on the CPU"))
    assert got == (CANDS[0], "default") and not list(tmp_path.rglob("*.json"))


def test_all_candidates_failing_is_not_fatal(fake_gpu):
    def bench(cfg):
        raise ValueError("output differs")
    with pytest.warns(RuntimeWarning, match="using its default"):
        assert resolve(bench) == (CANDS[0], "default")


def test_validated_bench_rejects_nan_and_wrong_outputs(monkeypatch):
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    ref = torch.randn(4, 1000)
    outs = {"ok": ref + 1e-3 * torch.randn_like(ref), "nan": ref.clone(), "far": ref + 0.1 * torch.randn_like(ref)}
    outs["nan"][0, 0] = float("nan")
    bench = lookup.validated_bench(lambda c: ref if c == "first" else outs[c])
    assert bench("first") == 1.0 and bench("ok") == 1.0
    for bad in ("nan", "far"):
        with pytest.raises(ValueError):
            bench(bad)


def test_recording_counts_sources(fake_gpu):
    with lookup.recording() as rec:
        resolve(counting_bench([]))
        resolve(counting_bench([]))
    assert rec == {"fake_kernel:tuned": 2}
    resolve(counting_bench([]))  # outside a recording: nothing collected
    assert rec == {"fake_kernel:tuned": 2}



def test_option_cache_dir_wins_for_its_calls(fake_gpu, tmp_path):
    """``tune_cache_dir`` (passed by the op as ``recording(directory)``) overrides the process cache dir
    for the calls it wraps: a tune there is a cache hit there, and not seen by the default directory."""
    opt_dir = tmp_path / "option-dir"
    calls = []
    with lookup.recording(str(opt_dir)):
        assert resolve(counting_bench(calls)) == ({"BN": 128}, "tuned")
    assert any(opt_dir.rglob("*.json")) and len(calls) == 3
    lookup.clear_memo()
    with lookup.recording(str(opt_dir)):
        assert resolve(counting_bench(calls))[1] == "cache" and len(calls) == 3
    assert resolve(counting_bench(calls))[1] == "tuned" and len(calls) == 6  # the default dir had nothing
    from vc_compile.config import VCConfig, VCConfigError
    assert VCConfig.from_options({"tune_cache_dir": opt_dir}).tune_cache_dir == str(opt_dir)
    for bad in ("", 3):
        with pytest.raises(VCConfigError, match="tune_cache_dir"):
            VCConfig.from_options({"tune_cache_dir": bad})

# ---- the kernels' candidates and the shipped table ---------------------------------------------------

def test_first_candidate_is_the_measured_default():
    from vc_compile.templates import sparse_attn as tsa
    from vc_compile.templates import vsmooth_attn as tva

    assert set(tva.CANDIDATES) == set(tva.DEFAULT_VARIANTS)
    for key, cands in tva.CANDIDATES.items():
        assert cands[0] == tva.DEFAULT_VARIANTS[key] and len(set(cands)) == len(cands)
        # the NaN-prone family (exp2 + MEAN=1, docs/kernels_notes.md) only as the tested default
        assert all(key[1] or c[2] != 1 for c in cands[1:])
    for fmt in ("bf16", "fp8"):
        for D in (64, 128):
            for Cg in (64, 128):
                cands = tsa.candidates(fmt, D, Cg)
                assert cands[0] == tsa.as_config(tsa.default_config(fmt, D, Cg))
                assert {tuple(c.values()) for c in cands} == set(tsa.SWEPT) and len(cands) == len(tsa.SWEPT)


ENTRY = re.compile(r"^(\*|bfloat16|float16|float32)\|d(\*|\d+)\|s(\*|\d+)\|(.+)$")


def test_shipped_json_is_generated_from_the_default_tables():
    with open(shipped.PATH) as f:
        data = json.load(f)
    assert data == json.loads(json.dumps(shipped.build_sm90())), \
        "shipped_sm90.json is stale: run python -m vc_compile.tune.shipped"


def test_shipped_entries_are_well_formed_candidates():
    from vc_compile.templates import sparse_attn as tsa
    from vc_compile.templates import vsmooth_attn as tva

    data = C._shipped("sm90")
    assert set(data) == {"_note", "vsmooth_attn", "sparse_attn"}
    for entry, cfg in data["vsmooth_attn"].items():
        m = ENTRY.match(entry)
        assert m and m.group(2) != "*" and re.fullmatch(r"(exp2|expcast)-(int8|fp8)", m.group(4)), entry
        assert cfg in tva.candidates(int(m.group(2)), m.group(4).startswith("expcast")), entry
    for entry, cfg in data["sparse_attn"].items():
        m = ENTRY.match(entry)
        v = re.fullmatch(r"(bf16|fp8)-c(\*|\d+)-p(\*|\d+)", m.group(4)) if m else None
        assert v, entry
        D = 128 if m.group(2) == "*" else int(m.group(2))
        Cg = 64 if v.group(2) == "*" else int(v.group(2))
        assert cfg in tsa.candidates(v.group(1), D, Cg), entry


@pytest.mark.parametrize("S", [1000, 32760, 75600, 300000])
def test_shipped_sm90_is_what_ran_before_the_tuner(S):
    """On an H100/H200 every key the kernels ask for is shipped, with their pre-tuner default."""
    from vc_compile.templates import sparse_attn as tsa
    from vc_compile.templates import vsmooth_attn as tva

    for (D, ec), variant in tva.DEFAULT_VARIANTS.items():
        for dt in (torch.bfloat16, torch.float32):
            for fp8 in (False, True):
                key = C.make_key("vsmooth_attn", [tva.__file__], dt, D, S, tva.tune_variant(ec, fp8))
                assert C.shipped_config(key, "sm90") == tva.as_config(variant), key
    for fmt in ("bf16", "fp8"):
        for D in (32, 64, 128, 256):
            for Cg in (64, 128):
                for dens in (0.05, 0.15, 0.5, 1.0):
                    keep = max(1, int(dens * S))
                    key = C.make_key("sparse_attn", [tsa.__file__], torch.bfloat16, D, S,
                                     tsa.tune_variant(fmt, Cg, keep, S))
                    assert C.shipped_config(key, "sm90") == tsa.as_config(tsa.default_config(fmt, D, Cg)), key


def test_shipped_json_is_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pkg = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "tune/*.json" in pkg["vc_compile"]


# ---- kernels under the interpreter, report() --------------------------------------------------------

def test_report_config_column_under_interpreter(fresh_vcattn):
    """The op records, per call site, where each kernel's config came from: under the interpreter the
    first candidate, "default" (sm90 shipped / cache / tuned need a GPU: the GPU test below)."""
    import vc_compile
    from vc_compile.config import VCConfig
    from vc_compile.runtime import report as _report

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU interpreter test")
    s = _report.register_site(graph="g", node="n", module="blocks.0.attn", shape="?", dtype="bf16",
                              method="vsmooth", rewritten=True).site
    cfg = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 16, "kernels": "triton",
                                  "smooth_v": False}).to_json()
    q, k, v = (torch.randn(1, 1, 160, 64, dtype=torch.bfloat16) for _ in range(3))
    torch.ops.vcattn.attention(q, k, v, None, s, cfg, None)
    rec = vc_compile.report().sites[0]
    assert rec.config_sources == {"vsmooth_attn:default": 1}
    assert vc_compile.report().to_dict()["sites"][0]["config_sources"] == {"vsmooth_attn:default": 1}
    table = str(vc_compile.report())
    assert "vsmooth_attn=default" in table and re.search(r"\| config +\|", table.splitlines()[0])


def test_sparse_kernel_goes_through_the_lookup():
    from vc_compile.templates import sparse_attn as tsa

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU interpreter test")
    B, H, S, D, Cg = 1, 1, 64, 16, 64
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    sigma = torch.arange(S).expand(B, H, S)
    idx = torch.arange(32, dtype=torch.int32).expand(B, H, 1, 32)
    with lookup.recording() as rec:
        tsa.sparse_attention(q, k, v, sigma, idx, sm_scale=0.25, group_size=Cg)
    assert rec == {"sparse_attn:default": 1}
    assert lookup.last_config("sparse_attn") == tsa.candidates("bf16", D, Cg)[0]


# ---- CLI ------------------------------------------------------------------------------------------------

def cli(*args, env=None):
    e = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", "vc_compile", *args], capture_output=True, text=True,
                          env={k: v for k, v in e.items() if v is not None}, cwd=ROOT, timeout=300)


def test_cli_argument_errors_and_no_cuda_message():
    r = cli()
    assert r.returncode == 2 and "tune" in r.stderr
    r = cli("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr
    base = ["tune", "--heads", "40", "--head-dim", "128", "--seq", "75600"]
    r = cli(*base)  # --method missing
    assert r.returncode == 2 and "--method" in r.stderr and "Traceback" not in r.stderr
    r = cli(*base[:4], "96", *base[5:], "--method", "vsmooth")
    assert r.returncode == 2 and "64 and 128" in r.stderr
    r = cli(*base, "--method", "mcsparse", "--density", "1.5")
    assert r.returncode == 2 and "density" in r.stderr
    if torch.cuda.is_available():
        return
    for env, why in (({"TRITON_INTERPRET": None, "CUDA_VISIBLE_DEVICES": ""}, "no CUDA GPU"),
                     ({"TRITON_INTERPRET": "1"}, "TRITON_INTERPRET")):
        r = cli(*base, "--method", "vsmooth", env=env)
        assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- GPU ----------------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("method", ["vsmooth", "mcsparse"])
def test_gpu_tuned_at_least_as_fast_as_shipped(method, tmp_path):
    """Force-tune on the benchmark shape (S = 32760, H = 40, D = 128, bf16; mcsparse at density 0.15),
    then time the tuned and the shipped default config in one process.

    NOTE 3% tolerance: the tuner keeps the fastest of one do_bench median per candidate, and the shipped
    default is always a candidate, so tuned > default only when two configs are within the run-to-run
    noise of a median (1-2% on the H200 at these sizes, docs/kernels_notes.md treats +-1% as noise)."""
    from vc_compile.tune import cli as tcli

    args = tcli.parser().parse_args(["--method", method, "--heads", "40", "--head-dim", "128", "--seq",
                                     "32760", "--density", "0.15", "--force", "--cache-dir", str(tmp_path)])
    try:
        rows = tcli.run(args)
    finally:
        lookup.configure(cache_dir="", force=False, progress=False)
    chosen, default = rows
    assert chosen["source"] == "tuned" and list(tmp_path.rglob("*.json"))
    assert chosen["ms"] <= 1.03 * default["ms"], rows


def test_bench_tune_arguments_and_time_guard():
    """The benchmark's own plumbing on CPU: --help, and --budget 0 skips every run (the time guard)."""
    bench = [sys.executable, "-m", "benchmarks.bench_tune"]
    r = subprocess.run(bench + ["--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "--budget" in r.stdout
    r = subprocess.run(bench + ["--smoke", "--budget", "0"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("time guard: skipping") == 8 and "nothing saved" in r.stdout
