"""Reliability without a compile: the step API's misuse, the tuning cache's error handling, numpy / 0-d
tensor scalars and small sizes in messages, the report's placeholders.

What needs a compiled graph (dynamic shapes, grad-mode site identity, the fallback warning, module paths,
the reference-path note) is in ``tests/test_reliability_compile.py``.
"""
import collections
import json
import os
import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import vc_compile
from vc_compile.config import VCConfig, VCConfigError
from vc_compile.runtime import runtime as _runtime
from vc_compile.runtime import steps as _steps
from vc_compile.runtime.steps import TRACKER
from vc_compile.tune import cache as C

SHAPE = ((1, 2, 256, 64), (1, 2, 256, 64))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    vc_compile.reset(report=True)
    counters.clear()
    monkeypatch.setattr(_runtime.current(), "said", collections.defaultdict(set))  # one-time notes due again
    yield
    vc_compile.reset(report=True)


def _op_call(key=(1, 0), n=50):
    """What vcattn::attention does: one tracker query from inside the caller's stack."""
    return TRACKER.current(key, n, shape=SHAPE)


# ---- reset() inside sampling(), step() outside it ----------------------------------------------------
def test_reset_inside_sampling_keeps_its_step_count():
    """Before: reset() dropped sampling()'s num_steps (50 assumed) and its explicit mode."""
    with vc_compile.sampling(num_steps=10):
        vc_compile.step(0)
        assert _op_call().num_steps == 10
        vc_compile.reset()  # e.g. between two generations inside one sampling() block
        vc_compile.step(3)
        info = _op_call()
        assert (info.step, info.num_steps, info.source) == (3, 10, "explicit")
        vc_compile.reset()
        info = _op_call()  # no step declared since the reset: the fallbacks, still with n = 10
        assert info.num_steps == 10 and info.source != "explicit"
    # leaving the block restores the state before it
    assert not TRACKER.explicit_active and TRACKER.explicit_steps is None


def test_reset_outside_sampling_still_drops_everything():
    vc_compile.step(4, num_steps=8)
    vc_compile.reset()
    info = _op_call()
    assert info.source != "explicit" and info.num_steps == 50


def test_step_outside_sampling_pins_and_warns_once():
    """step(i) outside sampling() stays in force (a step spans every block's and every CFG branch's
    calls; nothing else marks its end), and says so once, naming the fix."""
    with pytest.warns(UserWarning, match=r"outside .*sampling\(num_steps=n\).*until the next .*step\(\)"):
        vc_compile.step(5)
    assert [_op_call().step for _ in range(2)] == [5, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vc_compile.step(6)  # once per process
        with vc_compile.sampling(num_steps=4):
            vc_compile.step(0)  # inside sampling(): quiet


def test_diffusers_callback_declares_quietly():
    class Pipe:
        _num_timesteps = 4

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vc_compile.diffusers_callback(Pipe(), 0, None, {})
    assert _op_call().step == 1


def test_stale_declared_step_warns_at_run_time():
    """One step(5) and then many forwards: every call became another CFG branch of step 5 (no metadata:
    every call re-anchors, metadata piles up). Before: silent."""
    with vc_compile.sampling(num_steps=10):
        vc_compile.step(5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            branches = [_op_call().branch for _ in range(_steps.MAX_BRANCHES)]  # CFG-like: quiet
        assert branches == list(range(_steps.MAX_BRANCHES))
        with pytest.warns(UserWarning, match=r"step 5 .* call vc_compile\.step\(i\) before every step"):
            _op_call()
        assert counters["vcattn"]["stale_explicit_step"] == 1
        vc_compile.step(6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _op_call().branch == 0  # a new step: fine again


# ---- numpy and 0-d tensor scalars -----------------------------------------------------------------
@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), torch.tensor(3), torch.tensor(3, dtype=torch.int32)])
def test_step_accepts_numpy_and_tensor_ints(value):
    with vc_compile.sampling(num_steps=np.int64(8)):
        vc_compile.step(value, num_steps=value + 5 if not isinstance(value, torch.Tensor) else None)
        info = _op_call()
    assert info.step == 3 and type(info.step) is int


@pytest.mark.parametrize("bad", [torch.tensor(3.0), np.float32(3.0), True, torch.tensor([3]), 3.0])
def test_step_refuses_non_integers(bad):
    with pytest.raises(ValueError, match="step index"):
        vc_compile.step(bad)


def test_options_accept_numpy_and_tensor_scalars():
    cfg = VCConfig.from_options({"density": np.float32(0.2), "group_fraction": torch.tensor(0.5),
                                 "num_steps": np.int64(20), "min_seq_len": torch.tensor(64),
                                 "warmup_steps": np.int16(2), "anchor_interval": torch.tensor(3),
                                 "expcast": np.bool_(True), "hadamard": torch.tensor(False),
                                 "residual_budget_gb": np.float64(1.5)})
    assert abs(cfg.density - 0.2) < 1e-7 and type(cfg.density) is float
    assert cfg.group_fraction == 0.5 and cfg.num_steps == 20 and type(cfg.num_steps) is int
    assert cfg.min_seq_len == 64 and cfg.warmup_steps == 2 and cfg.anchor_interval == 3
    assert cfg.expcast is True and cfg.hadamard is False and cfg.residual_budget_gb == 1.5
    VCConfig.from_json(cfg.to_json())  # JSON-serialisable: plain Python values
    for bad in ({"num_steps": np.float32(2.0)}, {"num_steps": torch.tensor(2.5)}, {"density": torch.ones(2)},
                {"expcast": np.int64(1)}, {"num_steps": np.bool_(True)}):
        with pytest.raises(VCConfigError):
            VCConfig.from_options(bad)


def test_residual_budget_error_uses_readable_units():
    """Before: a small residual printed as '0.00 GiB'."""
    from vc_compile.methods import mcsparse

    cfg = VCConfig(method="mcsparse", residual_budget_gb=1e-6)  # ~1 KiB
    why = mcsparse._over_budget(1 * 2 * 256 * 64 * 2, cfg)  # a bf16 [1, 2, 256, 64]
    assert "64.0 KiB" in why and "0.00 GiB" not in why and "stock SDPA until its next anchor" in why


# ---- the tuning cache -----------------------------------------------------------------------------
ARCH = C.Arch("NVIDIA H200", (9, 0), "13.0", "3.6.0")
CANDS = [{"BLOCK_M": 128, "num_warps": 4}, {"BLOCK_M": 64, "num_warps": 4}]


def _key():
    return C.make_key("vsmooth_attn", [C.__file__], "torch.bfloat16", 128, 4096, "vsmooth")


@pytest.fixture
def tuning(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_runtime.current(), "said", collections.defaultdict(set))  # one-time notes due again


def _bench(cfg):
    return float(cfg["BLOCK_M"])


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_unusable_cache_dir_tunes_without_caching(tmp_path, tuning, where):
    """Before: NotADirectoryError / FileExistsError out of store()."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    directory = blocker if where == "file" else blocker / "sub"
    with pytest.warns(RuntimeWarning, match=r"cannot write the tuning cache .*tuned without caching") as rec:
        cfg, src = C.get_config(_key(), CANDS, _bench, arch=ARCH, directory=str(directory), shipped=False,
                                quiet=True)
    assert (cfg, src) == (CANDS[1], "tuned")
    assert len([w for w in rec if "cannot write" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per directory, not one per key
        C.get_config(C.make_key("sparse_attn", [C.__file__], "torch.bfloat16", 64, 4096), CANDS, _bench,
                     arch=ARCH, directory=str(directory), shipped=False, quiet=True)
    assert blocker.read_text() == "not a directory"


def test_read_only_cache_dir_tunes_without_caching(tmp_path, tuning, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(C.tempfile, "mkstemp", refuse)
    with pytest.warns(RuntimeWarning, match="cannot write the tuning cache"):
        assert C.get_config(_key(), CANDS, _bench, arch=ARCH, directory=str(tmp_path), shipped=False,
                            quiet=True) == (CANDS[1], "tuned")


@pytest.mark.parametrize("bogus", [{"BLOCK_M": 96, "num_warps": 4}, {"BLOCK_M": 128}, {}])
def test_cached_config_outside_the_candidates_is_retuned(tmp_path, tuning, bogus):
    """Before: a well-formed entry with a bogus config was returned as is."""
    path = tmp_path / ARCH.dirname / _key().filename()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "entries": {_key().entry: {"config": bogus, "ms": 1.0}}}))
    with pytest.warns(RuntimeWarning, match="not one of the kernel's candidate configurations.*re-tuning"):
        cfg, src = C.get_config(_key(), CANDS, _bench, arch=ARCH, directory=str(tmp_path), shipped=False,
                                quiet=True)
    assert (cfg, src) == (CANDS[1], "tuned")
    assert C.load(str(path))[_key().entry]["config"] == CANDS[1]  # the bad entry is replaced
    assert C.get_config(_key(), CANDS, _bench, arch=ARCH, directory=str(tmp_path), shipped=False) == (
        CANDS[1], "cache")


def test_cached_config_in_the_candidates_is_a_hit(tmp_path, tuning):
    path = tmp_path / ARCH.dirname / _key().filename()
    path.parent.mkdir(parents=True)
    # JSON turns tuples into lists and may reorder keys: still the same candidate
    path.write_text(json.dumps({"version": 1, "entries": {_key().entry: {"config": {"num_warps": 4, "BLOCK_M": 128}}}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert C.get_config(_key(), CANDS, lambda c: pytest.fail("re-tuned"), arch=ARCH,
                            directory=str(tmp_path), shipped=False) == (CANDS[0], "cache")


def test_lookup_survives_an_unusable_cache_dir(tmp_path, tuning, monkeypatch):
    """The kernel launcher's lookup (tune/lookup.py) gets a config, never an OSError."""
    from vc_compile.tune import lookup

    blocker = tmp_path / "f"
    blocker.write_text("x")
    monkeypatch.setattr(lookup, "_arch", lambda index: ARCH)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    class _Dev:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(torch.cuda, "device", _Dev)
    lookup.clear_memo()
    with pytest.warns(RuntimeWarning, match="cannot write the tuning cache"):
        out = lookup._lookup("vsmooth_attn", [C.__file__], CANDS, torch.bfloat16, 128, 4096, "v",
                             torch.device("cuda", 0), 0, True, _bench, directory=str(blocker))
    assert out == (CANDS[1], "tuned")
    assert os.path.isfile(blocker)


def test_report_says_not_timed_and_not_counted_instead_of_zeros():
    """Before: the ms column read 0.00 with profile off and a stock-SDPA site read 0 calls, as if it never ran;
    now '-' and a line that says how to time the calls."""
    from vc_compile.runtime.report import Report, SiteRecord
    kw = dict(graph="g", node="n", module="m", shape="1x2x64x64", dtype="bf16")
    rw = SiteRecord(site=1, method="vsmooth", rewritten=True, calls=3, **kw)
    fb = SiteRecord(site=2, method="vsmooth", rewritten=False, reason="masked", **kw)
    text = str(Report(sites=[rw, fb], graphs_without_sdpa=[]))
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")] for line in text.splitlines())
            if c[0] in ("1", "2")}
    assert "0.00" not in text and "not timed" in text and "'profile': True" in text
    assert rows["1"][4] == "3" and rows["2"][4] == "-" and rows["1"][9] == "-", rows
    rw.time_ms = 1.25
    assert "attention time 1.25 ms" in str(Report(sites=[rw, fb], graphs_without_sdpa=[]))


def test_report_says_the_int8_qk_path_is_measured_as_a_kernel_only():
    """``sparse_qk='int8'`` runs the gather kernel's 8-bit QK, timed as a kernel but not yet end to end:
    report() says so for the sites that ran it, and only for them."""
    from vc_compile.runtime.report import Report, SiteRecord
    kw = dict(graph="g", node="n", module="m", shape="1x2x64x64", dtype="bf16", method="mcsparse", rewritten=True)
    a = SiteRecord(site=1, calls=2, **kw)
    a.kernel_path["gluon_sm90_gather+int8_qk"] += 2
    b = SiteRecord(site=2, calls=2, **kw)
    b.kernel_path["gluon_sm90_gather"] += 2
    text = str(Report(sites=[a, b], graphs_without_sdpa=[]))
    assert "sparse_qk='int8' at sites 1:" in text and "not yet timed or checked end to end" in text
    assert "sparse_qk='int8'" not in str(Report(sites=[b], graphs_without_sdpa=[]))


@torch.no_grad()
def test_report_after_reset_report_names_sites_called_again(fresh_vcattn):
    """Before: after ``vc_compile.reset(report=True)`` a site of a still-compiled graph that was called again
    showed '?' for its module, shape and method; now its fresh record names them, with counts from zero."""
    import tiny_dit

    m, x, ctx = tiny_dit.make(seq=64)
    cm = torch.compile(m, backend="vcattn", options={"min_seq_len": 16, "method": "vsmooth",
                                                     "experimental": {"compiler": "eager"}})
    cm(x, ctx)
    before = {s.site: (s.module, s.shape, s.method, s.rewritten) for s in vc_compile.report().sites}
    vc_compile.reset(report=True)
    assert not vc_compile.report().sites
    cm(x, ctx)
    after = vc_compile.report()
    rw = [s for s in after.sites if s.calls]
    assert rw and all(s.calls == 1 for s in rw)
    for s in rw:
        assert (s.module, s.shape, s.method, s.rewritten) == before[s.site]
    assert "?" not in str(after)
