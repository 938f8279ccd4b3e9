"""The package as a user installs and imports it: wheel and metadata, lazy import, the CLI, the logger and
progress bar, the tuning cache's home and key, the benchmark harness's rows, the repository's hygiene."""
import ast
import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import vc_compile
from vc_compile import nvml
from vc_compile.table import format_table
from vc_compile.tune import cache as C

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VCATTN_METHOD")}


def py(code: str, timeout=300, env=None, cwd=ROOT) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env=env or ENV, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def has_entry_point() -> bool:
    from importlib.metadata import entry_points

    return "vcattn" in entry_points(group="torch_dynamo_backends").names


# ---- import cost ------------------------------------------------------------------------------------------
def test_import_is_lazy_and_cheap():
    out = json.loads(py(
        "import time, sys, json, torch\n"
        "t = time.process_time(); import vc_compile; dt = time.process_time() - t\n"
        "heavy = [m for m in ('torch._dynamo', 'torch._inductor', 'triton', 'vc_compile.ops', 'vc_compile.backend',"
        " 'diffusers') if m in sys.modules]\n"
        "print(json.dumps({'cpu_s': dt, 'heavy': heavy, 'version': vc_compile.__version__}))").splitlines()[-1])
    assert out["version"] == vc_compile.__version__
    if has_entry_point():  # a source checkout without the entry point registers the backend: Dynamo
        assert out["heavy"] == [], out
        assert out["cpu_s"] < 0.3, out  # the budget, in CPU time (the wall clock here is shared)


def test_public_names_resolve_lazily():
    for name in vc_compile.__all__:
        assert getattr(vc_compile, name) is not None
    assert set(vc_compile.__all__) <= set(dir(vc_compile))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vc_compile.nope  # noqa: B018


def test_cli_version_and_help_import_no_torch():
    out = py("import sys, runpy\n"
             "for argv in (['--version'], ['--help']):\n"
             "    sys.argv = ['vc_compile'] + argv\n"
             "    try:\n"
             "        runpy.run_module('vc_compile', run_name='__main__')\n"
             "    except SystemExit as e:\n"
             "        assert e.code == 0, e.code\n"
             "print('TORCH', 'torch' in sys.modules)")
    assert f"vc_compile {vc_compile.__version__}" in out and "commands:" in out and "tune" in out
    assert out.strip().endswith("TORCH False")
    r = subprocess.run([sys.executable, "-m", "vc_compile", "bogus"], capture_output=True, text=True, env=ENV,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "unknown command 'bogus'" in r.stderr


def test_cli_demo_and_tune_int8_are_commands():
    """``python -m vc_compile demo`` is the demo (its options); ``tune --sparse-qk int8``, an option the table
    offers, says that kernel's launch is fixed (nothing to tune) instead of refusing the value."""
    r = subprocess.run([sys.executable, "-m", "vc_compile", "demo", "--help"], capture_output=True, text=True, env=ENV,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "--methods" in r.stdout, r.stderr[-500:]
    r = subprocess.run([sys.executable, "-m", "vc_compile", "tune", "--method", "mcsparse", "--sparse-qk", "int8",
                        "--heads", "2", "--head-dim", "128", "--seq", "4096"], capture_output=True, text=True,
                       env=ENV, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "nothing to tune" in r.stdout, r.stdout + r.stderr[-500:]


def test_ops_registered_by_the_backend_not_by_import():
    out = py("import torch, vc_compile\n"
             "print('before', hasattr(torch.ops.vcattn, 'attention'))\n"
             "from torch._dynamo.backends.registry import lookup_backend\n"
             "lookup_backend('vcattn')\n"
             "print('after', hasattr(torch.ops.vcattn, 'attention'))")
    assert "before False" in out and "after True" in out


_CACHED = """
import json, torch
from torch._dynamo.utils import counters
import torch.nn.functional as F

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(64, 128, bias=False)
    def forward(self, x):
        q = self.q(x).view(1, -1, 2, 64).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(1, -1, 128)

torch.manual_seed(0)
m = M().to(torch.bfloat16)
x = torch.randn(1, 96, 64, dtype=torch.bfloat16)
f = torch.compile(m, backend="vcattn", options={"method": "dense", "min_seq_len": 16})
with torch.no_grad():
    out = f(x)
print("RESULT" + json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                             "rewrite": counters["vcattn"]["rewrite"], "sum": float(out.float().sum())}))
"""


def test_graph_from_inductors_cache_finds_the_ops_in_a_new_process(tmp_path):
    """A second process loads the compiled graph from Inductor's FX graph cache; its code calls
    torch.ops.vcattn.attention, registered when torch.compile loaded the backend."""
    env = {**ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    res = []
    for _ in range(2):
        out = py(_CACHED, timeout=900, env=env)
        res.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT"))[6:]))
    assert res[0]["rewrite"] == 1 and res[1]["rewrite"] == 1
    assert res[0]["hit"] == 0 and res[1]["hit"] >= 1, res
    assert res[0]["sum"] == res[1]["sum"]


# ---- wheel and metadata -----------------------------------------------------------------------------------
def _tomllib():
    return pytest.importorskip("tomllib")  # Python >= 3.11


def test_pyproject_metadata_and_extras():
    meta = _tomllib().loads((ROOT / "pyproject.toml").read_text())
    proj = meta["project"]
    assert proj["license"] == "Apache-2.0" and "Apache License" in (ROOT / "LICENSE").read_text()
    assert proj["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "vc_compile._version.__version__"}
    core = {d.split(";")[0].split(">")[0].split("=")[0].strip() for d in proj["dependencies"]}
    # numpy: without it torch warns "Failed to initialize NumPy" at every import, before vc_compile can act
    assert core == {"torch", "numpy", "triton", "filelock", "nvidia-ml-py"}
    extras = proj["optional-dependencies"]
    assert set(extras) == {"diffusers", "demo", "test", "bench"}
    (dif,) = [d for d in extras["diffusers"] if d.startswith("diffusers")]
    assert dif == "diffusers>=0.35"  # tested: tests/test_pipeline.py on 0.35.0 and 0.42.1; no exact pin
    for name in ("demo", "test", "bench"):
        assert any(d.startswith("vc_compile[") for d in extras[name])
    test_imports = {"pytest", "pytest-xdist", "scipy", "numpy", "safetensors", "pillow", "matplotlib"}
    assert test_imports <= {d.split(">")[0] for d in extras["test"]}
    assert not (ROOT / "setup.py").exists()


def test_wheel_is_small_licensed_and_without_demo_weights(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip("building needs setuptools >= 77 (PEP 639 license fields)")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True,
                           cwd=ROOT).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    src = tmp_path / "src"
    for f in files:  # a clean copy: no build/ or egg-info left in the checkout
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = (tmp_path / "dist").glob("vc_compile-*.whl")
    # ~0.3 MB of code and tables; no binaries (built kernels live in Triton's cache, never in the package)
    assert whl.stat().st_size <= 1_000_000, whl.stat().st_size
    names = zipfile.ZipFile(whl).namelist()
    assert not [n for n in names if n.endswith((".cubin", ".cubin.xz", ".so"))]
    assert not [n for n in names if n.endswith(".safetensors") or "/weights/" in n]
    assert {"vc_compile/tune/shipped_sm90.json", "vc_compile/passes/README.md", "vc_compile/pipeline.py"} <= set(names)
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "tools/"))]
    info = f"vc_compile-{vc_compile.__version__}.dist-info"
    z = zipfile.ZipFile(whl)
    assert "Apache License" in z.read(f"{info}/licenses/LICENSE").decode()
    md = z.read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in md and f"Version: {vc_compile.__version__}" in md
    core = [ln for ln in md.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert not [ln for ln in core if "diffusers" in ln or "sympy" in ln], core
    assert "vcattn = vc_compile.backend:vcattn" in z.read(f"{info}/entry_points.txt").decode()


# ---- logging, progress, tables ----------------------------------------------------------------------------
_PRINT_OK = {"vc_compile/__main__.py", "vc_compile/tune_cli.py"}  # CLIs


def test_no_print_in_library_code():
    bad = []
    for p in sorted((ROOT / "vc_compile").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("vc_compile/demo/") or rel in _PRINT_OK:
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print":
                bad.append(f"{rel}:{n.lineno}")
    assert not bad, f"print() in library code (use the vc_compile logger): {bad}"


def test_tuning_progress_is_a_bar_and_a_log_line(monkeypatch, caplog, capsys, tmp_path):
    # (get_config tunes whenever given a bench: dispatch decides when tuning is possible)
    key = C.make_key("k", [__file__], "bfloat16", 64, 4096, "v")
    arch = C.Arch("Test GPU", (9, 0), "13.0", "3.6.0")
    cands = [{"BM": 64}, {"BM": 128}, {"BM": 32}]

    def bench(cfg):
        if cfg["BM"] == 32:
            raise RuntimeError("out of shared memory")
        return 1.0 if cfg["BM"] == 128 else 2.0

    with caplog.at_level(logging.INFO, logger="vc_compile"):
        cfg, src = C.get_config(key, cands, bench, arch=arch, directory=str(tmp_path), shipped=False)
    assert (cfg, src) == ({"BM": 128}, "tuned")
    out = capsys.readouterr()
    assert out.out == ""  # nothing on stdout; tqdm draws on stderr
    rec = [r for r in caplog.records if r.name == "vc_compile.tune"]
    assert rec and "3 configs, 1 failed, best 1.000 ms" in rec[-1].getMessage()


def test_progress_without_tqdm_logs(monkeypatch, caplog):
    from vc_compile.log import Progress

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with caplog.at_level(logging.INFO, logger="vc_compile"):
        p = Progress(2, "work")
        p.update()
        p.update(ok=False)
        p.close()
    assert p.bar is None and p.done == 2 and p.failed == 1
    assert "work: 2 to run" in caplog.text


def test_to_stderr_adds_one_handler():
    from vc_compile import log

    h1, h2 = log.to_stderr("INFO"), log.to_stderr("DEBUG")
    try:
        assert h1 is h2 and log.logger.level == logging.DEBUG
        assert log.get_logger("tune").name == "vc_compile.tune"
        assert log.get_logger("vc_compile.x").name == "vc_compile.x"
    finally:
        log.logger.removeHandler(h1)
        log.logger.setLevel(logging.NOTSET)


def test_format_table():
    t = format_table([{"a": 1.234567891, "b": "x"}, {"a": None, "b": "long cell"}], ["a", "b"])
    assert t.splitlines() == ["a       | b        ", "--------+----------", "1.23457 | x        ",
                              "        | long cell"]
    assert format_table([["1", "2"]], ["x", "y"]).splitlines()[-1] == "1 | 2"


# ---- the tuning cache: home and key -----------------------------------------------------------------------
def test_cache_dir_defaults_to_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("VCATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert C.cache_dir() == str(tmp_path / "xdg" / "vc_compile" / "tune")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert C.cache_dir() == str(tmp_path / "home" / ".cache" / "vc_compile" / "tune")
    monkeypatch.setenv("VCATTN_CACHE_DIR", str(tmp_path / "env"))
    assert C.cache_dir() == str(tmp_path / "env")  # the variable still wins
    assert C.cache_dir(str(tmp_path / "arg")) == str(tmp_path / "arg")  # and the argument over it


def test_arch_key_gains_nvml_limits_only_when_known():
    old = C.Arch("NVIDIA H200", (9, 0), "13.0", "3.6.0")
    assert old.dirname == "NVIDIA_H200-sm90-cuda13.0-triton3.6.0"  # entries written before keep their key
    new = C.Arch("NVIDIA H200", (9, 0), "13.0", "3.6.0", "140GB-700W-1980MHz")
    assert new.dirname == "NVIDIA_H200-sm90-cuda13.0-triton3.6.0-140GB-700W-1980MHz"
    assert new.family == old.family == "sm90"  # the shipped table is per family, unchanged


class _FakeNvml:
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 1, 0

    class _Mem:
        total = 150 * 2**30

    def nvmlDeviceGetHandleByUUID(self, uuid):
        assert uuid == "GPU-abc"
        return "h"

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._Mem()

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetMaxClockInfo(self, h, which):
        return (1980, 3201)[which]

    def nvmlDeviceGetClockInfo(self, h, which):
        return (1755, 3201)[which]

    def nvmlDeviceGetUUID(self, h):
        return b"GPU-abc"

    def nvmlSystemGetDriverVersion(self):
        return "580.1"

    def nvmlDeviceGetTemperature(self, h, which):
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        raise RuntimeError("not supported")  # a missing query drops its field only

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 4


def test_nvml_fields_and_tuning_suffix(monkeypatch):
    import torch

    class Props:
        uuid = "abc"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(nvml, "_nvml", lambda: _FakeNvml())
    nvml.limits.cache_clear()
    try:
        assert nvml.limits(0) == {"gpu_uuid": "GPU-abc", "driver": "580.1", "mem_gb": 150, "power_limit_w": 700,
                                  "sm_clock_max_mhz": 1980, "mem_clock_max_mhz": 3201}
        assert nvml.state(0) == {"sm_clock_mhz": 1755, "mem_clock_mhz": 3201, "temp_c": 61, "clock_events": "0x4"}
        assert nvml.tuning_suffix(0) == "150GB-700W-1980MHz"
    finally:
        nvml.limits.cache_clear()


def test_nvml_absent_is_silent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    nvml._nvml.cache_clear()
    nvml.limits.cache_clear()
    try:
        assert nvml.limits(0) is None and nvml.state(0) == {} and nvml.tuning_suffix(0) == ""
    finally:
        nvml._nvml.cache_clear()
        nvml.limits.cache_clear()


# ---- benchmark rows, repository hygiene ------------------------------------------------------------------
def test_every_committed_results_csv_starts_with_the_agreed_columns():
    """Every file in benchmarks/results carries the run facts (date, commit, GPU, torch, Triton, bench, ...)
    first, whatever wrote it (a benchmark or a script)."""
    import glob
    import os

    from benchmarks import common
    files = sorted(glob.glob(os.path.join(common.RESULTS_DIR, "*.csv")))
    assert files
    bad = [f for f in files if next(csv.reader(open(f)))[:len(common.COLUMNS)] != common.COLUMNS]
    assert bad == []


def test_results_csv_gains_gpu_columns(tmp_path):
    from benchmarks import common

    path = tmp_path / "bench_x.csv"
    row = {c: "" for c in common.COLUMNS} | {"variant": "a", "ms": 1.5, "note": "n"}
    common.append_csv(str(path), [row])
    assert next(csv.reader(path.open()))[-1] == "note"
    common.append_csv(str(path), [row | {"variant": "b", "power_limit_w": 700, "temp_c": 60, "junk": 1}])
    rows = list(csv.DictReader(path.open()))
    header = next(csv.reader(path.open()))
    assert header == common.COLUMNS + ["note", "power_limit_w", "temp_c"]  # GPU columns at the end, no junk
    assert [(r["variant"], r["power_limit_w"], r["note"]) for r in rows] == [("a", "", "n"), ("b", "700", "n")]
    new = tmp_path / "bench_y.csv"
    common.append_csv(str(new), [row | {"temp_c": 1}], columns=common.COLUMNS + ["note", "extra"])
    assert next(csv.reader(new.open())) == common.COLUMNS + ["note", "extra", "temp_c"]
    with pytest.raises(RuntimeError, match="agreed columns"):
        bad = tmp_path / "bad.csv"
        bad.write_text("a,b\n")
        common.append_csv(str(bad), [row])


def test_benchmarks_and_tools_run_as_modules_without_sys_path_edits():
    bad = []
    for p in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tools").glob("*.py")]):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and n.attr == "path" and getattr(n.value, "id", None) == "sys":
                bad.append(f"{p.relative_to(ROOT)}:{n.lineno}")
    assert not bad, bad
    assert (ROOT / "benchmarks" / "__init__.py").exists() and (ROOT / "tools" / "__init__.py").exists()
    stale = []
    for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "design").glob("*.md"),
              *(ROOT / "tools").glob("*.sh")]:
        for i, ln in enumerate(p.read_text().splitlines(), 1):
            if ("python" in ln or "torchrun" in ln) and (" benchmarks/" in ln or " tools/" in ln) and ".py" in ln:
                stale.append(f"{p.relative_to(ROOT)}:{i}")
    assert not stale, f"run benchmarks/tools as modules (python -m benchmarks.x): {stale}"


def test_method_from_env(monkeypatch):
    from vc_compile.config import VCConfigError
    from vc_compile.config import apply_env, method_from_env

    monkeypatch.delenv("VCATTN_METHOD", raising=False)
    assert method_from_env() is None and apply_env({"method": "vsmooth"}, "t") == ({"method": "vsmooth"}, False)
    monkeypatch.setenv("VCATTN_METHOD", " ")
    assert method_from_env() is None
    monkeypatch.setenv("VCATTN_METHOD", "OFF")
    assert apply_env({"method": "vsmooth"}, "t") == ({"method": "vsmooth"}, True)
    monkeypatch.setenv("VCATTN_METHOD", "mcsparse")
    assert apply_env({"density": 0.2}, "t") == ({"density": 0.2, "method": "mcsparse"}, False)
    monkeypatch.setenv("VCATTN_METHOD", "sparse")
    with pytest.raises(VCConfigError, match="accepted: off, auto"):
        method_from_env()


def test_the_readme_cpu_example_runs_as_written():
    """The README's small CPU example, run as a user would paste it (a fresh process): its one call site is
    rewritten and its report printed."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- cpu-example:begin -->", 1)[1].split("<!-- cpu-example:end -->", 1)[0]
    code = block.split("```python", 1)[1].split("```", 1)[0]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 of 1 call sites rewritten" in r.stdout and "vsmooth" in r.stdout, r.stdout


def test_the_test_command_installs_into_a_venv_of_its_own():
    """``tools/test.sh`` installs the test-only packages (torchao among them, which makes every ``import
    diffusers`` print warnings) into ``.venv-test`` (over the system's packages, so an installed torch is reused),
    never into the user's environment: the venv is made and ``$PYTHON`` pointed at it before ``tools/setup.sh``
    runs, and every install of setup.sh goes through ``$PYTHON``."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    test_sh = (root / "tools" / "test.sh").read_text()
    made = test_sh.index('-m venv --system-site-packages "$VENV"')
    pointed = test_sh.index('export PYTHON="$PWD/$VENV/bin/python"')
    assert 'VENV=${VC_TEST_VENV:-.venv-test}' in test_sh and made < pointed < test_sh.index("bash tools/setup.sh")
    setup = (root / "tools" / "setup.sh").read_text()
    assert "PY=${PYTHON:-python3}" in setup
    installs = re.findall(r"^.*pip install.*$", setup, flags=re.M)
    assert installs and all("$PY -m pip install" in line for line in installs if not line.lstrip().startswith("#"))
    assert ".venv-test/" in (root / ".gitignore").read_text().split()
