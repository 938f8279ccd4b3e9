"""The quantisation check (``vc_compile/reference/quant_check.py``, option ``quant_check``).

Readings against their clean values (the constants the limit is expressed in), the action on each outlier
kind, and through the op (CPU reference kernels, the kernels' arithmetic) that the action keeps V-Smooth's
error within 3x its clean error where the unchecked 8-bit path is far beyond it. The reference for every
error is fp64 SDPA on the same bf16 / fp16 inputs; "clean" is the same method on the same inputs without the
outlier. Inputs: the kernel benchmark's structured q, k, v (channel-biased K, clustered V with 1% token
outliers; benchmarks/common.structured_inputs) and Gaussian ones; lengths not multiples of the blocks.
"""
import warnings

import pytest
import torch

import vc_compile
from benchmarks.common import structured_inputs
from test_hostile import new_site, run_op
from vc_compile.reference import quant_check as qc
from vc_compile.runtime import report as _report


def _inputs(S=2048, D=128, dtype=torch.bfloat16, kind="structured", seed=0):
    if kind == "structured":
        return tuple(t.transpose(1, 2).contiguous().to(dtype) for t in structured_inputs(1, 2, S, D, seed=seed))
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, S, D, generator=g).to(dtype) for _ in range(3))


def _scaled(x, f, channel=None, token=None):
    x = x.clone()
    if channel is not None:
        x[..., channel] = (x[..., channel].float() * f).to(x.dtype)
    else:
        x[:, :, token] = (x[:, :, token].float() * f).to(x.dtype)
    return x


def _err(o, q, k, v):
    t = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    return ((o.double() - t).norm() / t.norm()).item()


@pytest.mark.parametrize("kind", ["structured", "gaussian"])
@pytest.mark.parametrize("D", [64, 128])
def test_clean_readings(kind, D):
    """Clean inputs read within 15% of the constants the limit is measured in (and not far below them: a
    constant set too high would hide outliers), at two magnitudes (the readings are scale-free)."""
    q, k, v = _inputs(3001, D, kind=kind)
    for f in (1.0, 8.0):
        qf, kf, vf = (q.float() * f).bfloat16(), (k.float() * f).bfloat16(), (v.float() * f).bfloat16()
        for fmt in ("int8", "fp8"):
            r = qc.qk_error(qf, kf, fmt, False)
            assert 0.6 * qc.CLEAN_QK[fmt] <= r <= 1.15 * qc.CLEAN_QK[fmt], (fmt, f, r)
        rv = qc.v_error(vf)
        assert 0.6 * qc.CLEAN_V <= rv <= 1.15 * qc.CLEAN_V, (f, rv)


@pytest.mark.parametrize("D", [64, 128])
def test_actions_by_outlier_kind(D):
    q, k, v = _inputs(2048 + 77, D)
    act = lambda q, k, v: qc.read(q, k, v, "int8", False).action("int8", False)  # noqa: E731
    assert act(q, k, v) == "8bit"
    assert act(q, _scaled(k, 3, token=700), v) == "8bit"  # measured below: 1.6x the clean error
    assert act(q, _scaled(k, 100, channel=5), v) == "hadamard"
    assert act(q, _scaled(k, 10, channel=5), v) == "hadamard"
    assert act(q, _scaled(k, 1000, token=700), v) == "sdpa"
    assert act(q, k, _scaled(v, 1000, token=700)) == "8bit"  # E4M3's exponent holds the rest of the channel
    assert act(q, k, _scaled(v, 1e6, token=700)) == "sdpa"  # it does not at x1e6: the rest flushes to 0
    r = qc.read(q, _scaled(k, 100, channel=5), v, "int8", False)
    assert r.r_qk_hadamard < qc.LIMIT * qc.CLEAN_QK["int8"] < r.r_qk


def test_the_outlier_block_is_always_sampled():
    """One key 1000x anywhere in a long head is found: the sample holds the block with each head's largest
    element, not only evenly spaced blocks."""
    q, k, v = _inputs(8192 + 5)
    for tok in (3, 4444, 8195):
        assert qc.read(q, _scaled(k, 1000, token=tok), v, "int8", False).action("int8", False) == "sdpa", tok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_the_check_keeps_vsmooth_within_3x_its_clean_error(dtype, D):
    """Through the op on the CPU reference path: a K channel x100 is 15-17x V-Smooth's clean error unchecked and
    <= 3x with the check (the site rotates); one key token x1000 is ~4x unchecked and stock SDPA's own error with
    the check (the site refuses; the sharpness check off, which can see the token first); one value token x1000
    stays 8-bit and within 1.5x."""
    q, k, v = _inputs(2048 + 77, D, dtype)
    clean = _err(run_op(q, k, v, "vsmooth", steps=1)[0], q, k, v)
    kc = _scaled(k, 100, channel=5)
    off = _err(run_op(q, kc, v, "vsmooth", steps=1, quant_check=False)[0], q, kc, v)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        site = new_site("vsmooth")
        on = _err(run_op(q, kc, v, "vsmooth", steps=2, site=site)[-1], q, kc, v)
    assert off > 5 * clean and on <= 3 * clean, (clean, off, on)
    rec = _report.current().sites.sites[site]
    assert rec.runtime_fallbacks["outlier K channel: Hadamard rotation on"] == 2
    assert sum("Hadamard rotation" in str(x.message) for x in w) == 1  # one warning for the site
    kt = _scaled(k, 1000, token=700)
    site = new_site("vsmooth")
    # (the sharpness check, which may see the token's logits first, is off: this is the quantisation check's case)
    with pytest.warns(RuntimeWarning, match="stock SDPA"):
        out = run_op(q, kt, v, "vsmooth", steps=1, site=site, max_logit_std=0)[0]
    stock = torch.nn.functional.scaled_dot_product_attention(q, kt, v)
    assert torch.equal(out, stock)
    assert _report.current().sites.sites[site].runtime_fallbacks["outlier keys or values for 8-bit"] == 1
    vt = _scaled(v, 1000, token=700)
    assert _err(run_op(q, k, vt, "vsmooth", steps=1)[0], q, k, vt) <= 1.5 * clean


def test_quant_check_off_keeps_the_8bit_path_and_reset_forgets():
    q, k, v = _inputs(1000)
    kc = _scaled(k, 100, channel=5)
    site = new_site("vsmooth")
    run_op(q, kc, v, "vsmooth", steps=1, site=site, quant_check=False)
    assert not _report.current().sites.sites[site].runtime_fallbacks
    site = new_site("vsmooth")
    with pytest.warns(RuntimeWarning):
        run_op(q, kc, v, "vsmooth", steps=1, site=site)
    from vc_compile import ops
    assert ops._QUANT
    vc_compile.reset()
    assert not ops._QUANT and not ops._QUANT_WARNED


def test_a_head_dim_the_rotation_cannot_take_refuses_instead():
    """D = 96 (no Hadamard matrix): an outlier K channel leaves the site on stock SDPA."""
    q, k, v = _inputs(1000, 128)
    q, k, v = (t[..., :96].contiguous() for t in (q, k, v))
    kc = _scaled(k, 100, channel=5)
    r = qc.read(q, kc, v, "int8", False)
    assert r.r_qk_hadamard is None and r.action("int8", False) == "sdpa"


def test_values_near_the_bf16_maximum_run_stock_sdpa():
    """|V| up to ~1e36 overflows V-Smooth's V statistics (NaN where SDPA is finite, from ~3e35 on; shown with the
    check off): the check reads it as out of range and the site runs stock SDPA, finite as SDPA is; V up to 1e33
    (``V_RANGE``) stays 8-bit."""
    q, k, v = _inputs(1000, 64, kind="gaussian")
    to = lambda top: (v.float() / v.float().abs().amax() * top).to(torch.bfloat16)  # noqa: E731
    big = to(1e36)
    assert not torch.isfinite(run_op(q, k, big, "vsmooth", steps=1, quant_check=False)[0]).all()
    site = new_site("vsmooth")
    with pytest.warns(RuntimeWarning, match="stock SDPA"):
        out = run_op(q, k, big, "vsmooth", steps=1, site=site)[0]
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, big))
    assert _report.current().sites.sites[site].runtime_fallbacks["outlier keys or values for 8-bit"] == 1
    assert qc.read(q, k, to(qc.V_RANGE), "int8", False).action("int8", False) == "8bit"
