"""Kernels shipped built (runtime/shipped.py, scripts/ship_kernels.py): a shipped binary is found by the launch
that would have built it; the shipped manifest names current sources; layouts and families are matched as the
launches see them; nothing is loaded where it cannot serve (another Triton, another GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_cuda
from offline_sm90 import result_line
from vc_compile.runtime import shipped
from scripts.ship_kernels import request

ROOT = Path(__file__).parent.parent


def test_a_shipped_kernel_is_what_its_launch_finds(tmp_path):
    """Offline for sm_90 (scripts/codegen_stats.py's fake driver): the preprocessing's kernels are built, shipped
    (cubin + manifest entry, as ``record`` writes them), dropped from every cache; loaded back, the same
    launches build nothing (Triton's post-compile hook never fires) and find the loaded kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    code = f"""
import json, os
from scripts import codegen_stats as cs
import torch
from triton import knobs
cs._install()
from vc_compile.runtime import prebuild, shipped
from scripts import ship_kernels as sk
from vc_compile.templates import preprocess as tpre
q = torch.empty(1, 1000, 2, 64, dtype=torch.bfloat16).permute(0, 2, 1, 3)
perm = torch.empty(1, 2, 1000, dtype=torch.int64)
def call():
    try:
        tpre.preprocess(q, q, q, perm, sm_scale=0.1, hadamard=True, qk_format="int8", v_layout="sm90")
    except Exception:
        pass
with prebuild.launches_turned_away() as found:
    call()
prebuild.build_parallel(found, device=0, workers=2)
out = {str(tmp_path / 'ship')!r}
os.makedirs(out)
kernels = {{}}
ids = [sk.add_kernel(kernels, fn, spec, 0, out, "fam") for fn, spec in found]
for fn, _ in found:
    fn.device_caches.clear()
knobs.cache.dir = {str(tmp_path / 'empty')!r}
built = []
knobs.runtime.jit_post_compile_hook = lambda **kw: built.append(kw["fn"].name)
n = shipped.load_entries(list(kernels.values()), 0, out)
call()
print("ids", sorted(e["name"] for e in kernels.values()), "loaded", n, "built", built,
      "files", sorted(os.listdir(out)) == sorted(e["file"] for e in kernels.values()))
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if "No module named" in r.stderr or (r.returncode != 0 and "GPUTarget" in r.stderr):
        pytest.skip(f"offline sm_90 compile unavailable here: {r.stderr.strip()[-300:]}")
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("ids")), "")
    assert line == "ids ['_quant_kernel', '_stats_kernel'] loaded 2 built [] files True", r.stdout + r.stderr[-3000:]


def test_the_shipped_manifest_names_current_sources():
    """Every shipped kernel's function exists and its source hash is the recorded one (a kernel edited since it
    was recorded would never be loaded: re-run ``python -m scripts.ship_kernels record`` on an sm_90 GPU), its
    cubin is there, and every recorded layout names shipped kernels."""
    if not os.path.exists(shipped.MANIFEST):
        pytest.skip("no shipped kernels in this tree")
    man = json.load(open(shipped.MANIFEST))
    assert man["arch"] == "sm_90" and man["kernels"] and man["requests"]
    ids = {e["id"] for e in man["kernels"]}
    for e in man["kernels"]:
        assert os.path.exists(os.path.join(shipped.DIR, e["file"])) and e["families"]
        assert json.loads(e["spec"])["name"].endswith(e["name"])
    # source hashes are the JIT's (not the interpreter's): checked by the script, outside TRITON_INTERPRET
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "scripts.ship_kernels", "check"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "0 stale, 0 missing" in r.stdout, \
        r.stdout + r.stderr[-2000:] + "\n(a kernel edited since it was shipped: re-run " \
        "`python -m scripts.ship_kernels record` on an sm_90 GPU)"
    for key, rec in man["requests"].items():
        assert rec["kernels"] and set(rec["kernels"]) <= ids, key
        assert key.startswith(rec["family"] + "|")


_FORGET = r"""
import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from scripts import codegen_stats as cs
driver.set_active(cs._FakeDriver())
from scripts import ship_kernels as sk
from vc_compile.templates import preprocess as tpre
from vc_compile.templates.launch import FAST_LAUNCH
knobs.runtime.launch_enter_hook = None  # as at record time: no launch hook, so launches are remembered
orig = JITFunction.run
def run(self, *a, grid, warmup, **kw):  # build, then hand the launcher to a no-op (nothing is launched)
    k = orig(self, *a, grid=grid, warmup=True, **kw)
    if k._run is None:
        k._run = lambda *args: None
    return orig(self, *a, grid=grid, warmup=False, **kw)
JITFunction.run = run
q = torch.randn(1, 1000, 2, 64, dtype=torch.bfloat16).permute(0, 2, 1, 3)
perm = torch.stack([torch.randperm(1000) for _ in range(2)]).view(1, 2, 1000)
call = lambda: tpre.preprocess(q, q, q, perm, sm_scale=0.1, qk_format="int8", v_layout="sm90")
seen = []
knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"])
call(); call()  # the first family's chain: built, then remembered
fns = sorted({f.jit_function for f in seen}, key=lambda f: f.__name__)
names = lambda: sorted({f.name for f in seen})
seen.clear()
for fn in fns:  # what the recorder did before: the functions' caches only
    fn.device_caches.clear()
call()
caches_only = names()
seen.clear()
sk.forget_launches(fns)
call()
print("RESULT caches only", caches_only, "forgotten", names(), "remembered", FAST_LAUNCH.fast > 0)
"""


def test_a_later_chain_sees_the_kernels_an_earlier_one_remembered(tmp_path):
    """Offline for sm_90: between two families' chains the recorder forgets the launches the first remembered, so
    the second's launches of the same kernels pass Triton's compile hook (and are listed under the second
    family). Clearing the functions' caches alone, as before, let the remembered launch run them unseen: the
    shipped ExpCast layouts lacked the preprocessing kernels that V-Smooth's chain had remembered."""
    line, tails = result_line(_FORGET, tmp_path)
    assert line == ("RESULT caches only [] forgotten ['_quant_kernel', '_stats_kernel'] remembered True"), tails


_PREP = {"_stats_kernel", "_quant_kernel"}


def test_every_method_layout_ships_its_preprocessing_kernels():
    """Every shipped call layout of an 8-bit method (V-Smooth, ExpCast, MC-Sparse's warm-up) lists the
    preprocessing's two kernels, so a fresh process of any method builds neither at its first call."""
    if not os.path.exists(shipped.MANIFEST):
        pytest.skip("no shipped kernels in this tree")
    man = json.load(open(shipped.MANIFEST))
    name = {e["id"]: e["name"] for e in man["kernels"]}
    lacking = {key: sorted(_PREP - {name[i] for i in rec["kernels"]}) for key, rec in man["requests"].items()}
    assert not {k: v for k, v in lacking.items() if v}


def test_layouts_match_as_launches_see_them():
    """The match key keeps what a launch specialises on (shapes, stride classes, dtype, method, softmax) and
    nothing else: the [B, S, H, D] projection's view and a contiguous [B, H, S, D] tensor are one layout, another
    length or head count is not; the family names method, ExpCast, dtype and head dim."""
    a = request({"method": "vsmooth", "expcast": True}, 1, 12, 32760, 128)
    assert shipped.family(a) == "vsmooth+expcast:bfloat16:D128"
    assert shipped.family(request({"method": "mcsparse"}, 1, 12, 32760, 64, "float16")) == "mcsparse:float16:D64"
    contig = json.loads(json.dumps(a))
    for n in ("q", "k", "v"):
        contig[n]["stride"] = [12 * 32760 * 128, 32760 * 128, 128, 1]
    assert shipped.match_key(contig) == shipped.match_key(a)
    ident = {"shape": [1536, 1536], "stride": [1536, 1], "dtype": "bfloat16", "device": "cuda", "offset": 0}
    assert shipped.match_key(dict(a, ident=ident, scale=0.088)) == shipped.match_key(a)  # compared, not launched
    assert shipped.match_key(request({"method": "vsmooth", "expcast": True}, 1, 12, 32768, 128)) \
        != shipped.match_key(a)
    assert shipped.match_key(request({"method": "vsmooth", "expcast": True}, 1, 40, 32760, 128)) \
        != shipped.match_key(a)
    assert shipped.match_key(request({"method": "vsmooth"}, 1, 12, 32760, 128)) != shipped.match_key(a)


def test_nothing_is_loaded_where_it_cannot_serve(monkeypatch):
    """Another Triton or no sm_90 GPU: nothing loaded, every request left to the helpers, and report()'s line
    says why."""
    monkeypatch.setattr(shipped, "_STATE", dict(shipped._STATE, families=set(), loaded=0, stale=0, why=None))
    monkeypatch.setattr(shipped, "_manifest", lambda: {"triton": "0.0.0", "kernels": [], "requests": {}})
    covered, line = shipped.load([request({"method": "vsmooth"}, 1, 12, 32760, 128)], device=0)
    assert covered == [] and "triton 0.0.0" in line


_RUN = """
import json, os, sys, torch
import vc_compile
from vc_compile.runtime import prebuild, shipped
from scripts.ship_kernels import request
from triton import knobs
req = request({"method": "vsmooth", "expcast": True}, 1, 12, 32760, 128)
built = []
knobs.runtime.jit_post_compile_hook = lambda **kw: built.append(kw["fn"].name)
covered = shipped.load([req])[0] if sys.argv[1] == "shipped" else []
t = prebuild.inputs(req)
outs = []
with torch.no_grad(), vc_compile.sampling(num_steps=4) as loop:
    for i in range(4):
        loop.step(i)
        outs.append(torch.ops.vcattn.attention(t["q"], t["k"], t["v"], None, 1, req["config"], None, None, None, ""))
torch.save(torch.stack(outs).cpu(), sys.argv[2])
print(json.dumps({"covered": len(covered), "built": built, "line": shipped.summary()}))
"""


@requires_cuda
@pytest.mark.skipif(not os.path.exists(shipped.MANIFEST), reason="no shipped kernels in this tree")
def test_gpu_shipped_kernels_give_the_built_results(tmp_path):
    """A fresh process on an sm_90 GPU with the shipped kernels of Wan 2.1 1.3B's layout builds none of the
    kernels its V-Smooth + ExpCast steps launch, and its outputs equal, bit for bit, those of a fresh process
    that built them."""
    import torch
    if torch.cuda.get_device_capability() != shipped.ARCH:
        pytest.skip("the shipped kernels are sm_90's")
    said = {}
    for mode in ("shipped", "built"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton_{mode}")
        r = subprocess.run([sys.executable, "-c", _RUN, mode, str(tmp_path / f"{mode}.pt")], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        said[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert said["shipped"]["covered"] == 1 and said["shipped"]["built"] == [], said
    assert said["built"]["built"], said  # the other process did build them
    assert "loaded" in said["shipped"]["line"]
    a, b = torch.load(tmp_path / "shipped.pt"), torch.load(tmp_path / "built.pt")
    assert torch.equal(a, b)


def test_an_unreadable_shipped_kernel_is_skipped(tmp_path, monkeypatch):
    """A damaged cubin file or entry never fails a compile: that kernel is counted, said in report()'s line, and
    built at its launch; the others still load."""
    monkeypatch.setattr(shipped, "_STATE", dict(shipped._STATE, families=set(), loaded=0, stale=0, why=None,
                                                unreadable=0))

    class Fn:  # a Triton function as the loader sees it: its source hash and per-device caches
        cache_key = "abc"
        device_caches = {0: ({},)}

    monkeypatch.setattr(shipped, "_function", lambda path: Fn)
    entry = {"fn": "m:f", "cache_key": "abc", "file": "missing.cubin.xz", "name": "k", "spec": "{}", "metadata": {}}
    assert shipped.load_entries([entry], 0, str(tmp_path)) == 0
    assert shipped._STATE["unreadable"] == 1 and Fn.device_caches[0][0] == {}
    shipped._STATE["loaded"] = 1  # as if another kernel had loaded: the line reports both
    assert "1 shipped kernel(s) unreadable" in shipped.summary()

