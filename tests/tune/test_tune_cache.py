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


# ---- hostile cache files and directories: never a hang, never an escape, never another user's entries ------
def _get(tmp_path):
    return C.get_config(key(), CANDS, lambda c: float(c["num_warps"]), arch=ARCH, directory=str(tmp_path),
                        shipped=False, quiet=True)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep_json", "huge", "version_999", "binary"])
def test_hostile_cache_file_is_ignored_not_fatal(tmp_path, kind):
    """A FIFO at the cache path (blocked ``get_config`` forever), a link to /dev/zero (read without bound:
    MemoryError), JSON nested 100000 deep (RecursionError), a file over the size bound, another format version,
    undecodable bytes: each is reported once and tuned past, within seconds."""
    if kind in ("fifo", "dev_zero") and not hasattr(os, "mkfifo"):
        pytest.skip("POSIX only")
    path = tmp_path / ARCH.dirname / key().filename()
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "deep_json":
        path.write_text("[" * 100000 + "]" * 100000)
    elif kind == "huge":
        path.write_text('{"version": 1, "entries": {}, "pad": "' + "x" * (C.MAX_FILE_BYTES + 10) + '"}')
    elif kind == "version_999":
        path.write_text(json.dumps({"version": 999, "entries": {key().entry: {"config": CANDS[2]}}}))
    else:
        path.write_bytes(b"\xff\xfe\x00garbage")
    import time
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="ignoring tuning cache file"):
        cfg, src = _get(tmp_path)
    assert time.monotonic() - t0 < 10
    assert src == "tuned" and cfg == CANDS[0]  # the cached CANDS[2] of another version was not used


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX only")
def test_shared_tmp_fallback_is_per_uid_and_checked(monkeypatch, tmp_path):
    """Without a home directory the cache falls back to the shared temporary folder: per user id (not $USER,
    which anyone can set), and a folder there that another user could write is neither read nor written."""
    for var in ("VCATTN_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", "/")
    monkeypatch.setenv("USER", "someone-else")
    monkeypatch.setattr(C.tempfile, "gettempdir", lambda: str(tmp_path))
    d = C.cache_dir()
    assert d == os.path.join(str(tmp_path), f"vc_compile-{os.getuid()}", "tune")
    top = tmp_path / f"vc_compile-{os.getuid()}"
    top.mkdir(mode=0o777)
    os.chmod(top, 0o777)  # a planted, world-writable folder
    assert not C._private_ok(os.path.join(d, "arch"))
    path = os.path.join(d, ARCH.dirname, key().filename())
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"version": 1, "entries": {key().entry: {"config": CANDS[2]}}}, f)
    with pytest.warns(RuntimeWarning):
        cfg, src = C.get_config(key(), CANDS, lambda c: float(c["num_warps"]), arch=ARCH, shipped=False,
                                quiet=True)
    assert src == "tuned" and cfg == CANDS[0]  # the planted entry was not used
    os.chmod(top, 0o700)
    assert C._private_ok(os.path.join(d, "arch"))
