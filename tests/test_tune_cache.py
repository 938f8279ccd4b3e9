"""The autotuning cache: keys, atomic and concurrent writes, corrupt files, hits in a second process."""
import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import pytest

from vc_compile.tune import cache as C

ARCH = C.Arch("NVIDIA H200", (9, 0), "13.0", "3.6.0")
CANDS = [{"BLOCK_M": 128, "num_warps": 4}, {"BLOCK_M": 64, "num_warps": 4}, {"BLOCK_M": 128, "num_warps": 8}]


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def key(S=32760, variant="vsmooth"):
    return C.make_key("vsmooth_attn", [C.__file__], "torch.bfloat16", 128, S, variant)


def test_key_construction():
    k = key()
    assert k.bucket == 32768 and k.dtype == "bfloat16" and k.entry == "bfloat16|d128|s32768|vsmooth"
    assert key(S=32000).entry == k.entry and key(S=40000).entry != k.entry
    assert C.seq_bucket(10) == 1024 and C.seq_bucket(75600) == 131072
    assert ARCH.dirname == "NVIDIA_H200-sm90-cuda13.0-triton3.6.0" and ARCH.family == "sm90"
    assert len(k.src_hash) == 16 and k.filename().startswith("vsmooth_attn-")


def test_tunes_once_then_hits_cache(tmp_path):
    calls = []

    def bench(cfg):
        calls.append(cfg)
        return {128: 2.0, 64: 1.0}[cfg["BLOCK_M"]] + cfg["num_warps"] / 100

    cfg, src = C.get_config(key(), CANDS, bench, arch=ARCH, directory=str(tmp_path), shipped=False, quiet=True)
    assert src == "tuned" and cfg == CANDS[1] and len(calls) == 3
    cfg2, src2 = C.get_config(key(), CANDS, bench, arch=ARCH, directory=str(tmp_path), shipped=False)
    assert src2 == "cache" and cfg2 == cfg and len(calls) == 3


def test_failing_candidates_are_skipped(tmp_path):
    def bench(cfg):
        if cfg["num_warps"] == 4:
            raise RuntimeError("out of shared memory")
        return 1.0

    cfg, src = C.get_config(key(), CANDS, bench, arch=ARCH, directory=str(tmp_path), shipped=False, quiet=True)
    assert cfg == CANDS[2] and src == "tuned"


def test_never_tunes_without_bench(tmp_path):
    """No ``bench`` (the caller cannot time kernels: dispatch passes none under TRITON_INTERPRET or off CUDA):
    the first candidate, nothing written."""
    cfg, src = C.get_config(key(), CANDS, None, arch=ARCH, directory=str(tmp_path), shipped=False)
    assert (cfg, src) == (CANDS[0], "default")
    assert not any(tmp_path.rglob("*.json"))


def test_corrupt_file_is_reported_and_ignored(tmp_path):
    path = tmp_path / ARCH.dirname / key().filename()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring tuning cache file"):
        cfg, src = C.get_config(key(), CANDS, lambda c: float(c["num_warps"]), arch=ARCH,
                                directory=str(tmp_path), shipped=False, quiet=True)
    assert src == "tuned"
    assert json.loads(path.read_text())["entries"][key().entry]["config"] == cfg  # rewritten, valid


def test_env_var_and_default_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv("VCATTN_CACHE_DIR", str(tmp_path))
    assert C.cache_dir() == str(tmp_path)
    assert C.cache_dir("/x") == "/x"
    monkeypatch.delenv("VCATTN_CACHE_DIR")
    assert C.cache_dir().endswith(os.path.join("vc_compile", "tune"))  # the per-user cache (tests/test_package.py)


def _writer(args):
    directory, i = args
    path = os.path.join(directory, "f.json")
    for j in range(20):
        C.store(path, f"w{i}-{j}", {"config": {"i": i, "j": j}})


def test_concurrent_writers_keep_every_entry(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        pool.map(_writer, [(str(tmp_path), i) for i in range(4)])
    entries = C.load(str(tmp_path / "f.json"))
    assert len(entries) == 80
    assert not list(tmp_path.glob(".tmp-*"))


def test_cache_hit_in_second_process_without_tuning(tmp_path):
    code = textwrap.dedent(f"""
        import json, os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        from vc_compile.tune import cache as C
        arch = C.Arch("NVIDIA H200", (9, 0), "13.0", "3.6.0")
        calls = []
        def bench(cfg):
            calls.append(1)
            return float(cfg["num_warps"])
        k = C.make_key("vsmooth_attn", [C.__file__], "torch.bfloat16", 128, 32760, "vsmooth")
        cfg, src = C.get_config(k, {CANDS!r}, bench, arch=arch, directory={str(tmp_path)!r}, shipped=False, quiet=True)
        print(json.dumps({{"src": src, "calls": len(calls), "cfg": cfg}}))
    """)
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["src"] == "tuned" and runs[0]["calls"] == 3
    assert runs[1] == {"src": "cache", "calls": 0, "cfg": runs[0]["cfg"]}


def test_shipped_table_wins(tmp_path, monkeypatch):
    table = {"vsmooth_attn": {key().entry: {"BLOCK_M": 64, "num_warps": 8}}}
    monkeypatch.setattr(C, "_shipped", lambda family: table if family == "sm90" else {})
    cfg, src = C.get_config(key(), CANDS, lambda c: pytest.fail("tuned a shipped shape"), arch=ARCH,
                            directory=str(tmp_path))
    assert src == "shipped" and cfg == {"BLOCK_M": 64, "num_warps": 8}
