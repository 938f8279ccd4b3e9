"""Non-finite flags and the guard's probe rows (kernels/finite_flags.py vs reference/finite_flags.py), and
the regression test that NaN/Inf on every MC-Sparse phase propagates as SDPA does.

SDPA's pattern (fp32 math, checked in ``test_sdpa_pattern``): a NaN key -> its whole head; a +-Inf key ->
the rows whose logit against it is +Inf or NaN (about half the head); a V element (j, d) -> column d of
every row; a q row -> that row. Our contract: warm-up steps are stock SDPA (bit for bit); anchor steps
return O_dense, whose pattern is SDPA's own (fp32 on the reference path, the device's SDPA kernel on the
Triton path); reuse steps give SDPA's pattern, except a +-Inf key marks its whole head (a superset).
CPU: reference path and Triton interpreter, small shapes."""
import pytest
import torch
import torch.nn.functional as F

from conftest import KERNEL_DEVICE, requires_cuda
import vc_compile
from vc_compile.config import VCConfig
from vc_compile.reference import finite_flags as ref
from vc_compile.runtime import report as _report
from vc_compile.kernels import dispatch

BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _tpl():
    from vc_compile.kernels import finite_flags as tpl

    return tpl


def _flags(k, v, probe=None):
    """The flags kernel as the runtime launches it (dispatch: its launch config)."""
    return dispatch.finite_flags(dispatch.Impl.TRITON, k, v, probe=probe)


def nf(x):
    return ~torch.isfinite(x)


# ---- the flags kernel against the reference ------------------------------------------------------------
@pytest.mark.parametrize("Sk,D,DV,dtype", [(200, 64, 64, torch.bfloat16), (333, 128, 128, torch.float16),
                                           (77, 64, 128, torch.float32)])
def test_flags_match_reference(Sk, D, DV, dtype):
    B, H = 2, 3
    k = torch.randn(B, H, Sk, D).to(KERNEL_DEVICE, dtype)
    v = torch.randn(B, H, Sk, DV).to(KERNEL_DEVICE, dtype)
    # huge finite values and subnormals are not flags; NaN/Inf anywhere (first/last key, tail) are
    k[0, 0, 0, 0] = torch.finfo(dtype).max
    v[0, 0, 3, 5] = torch.finfo(dtype).tiny / 4
    k[0, 1, Sk - 1, D - 1] = float("nan")
    k[1, 2, Sk // 2, 3] = float("-inf")
    v[1, 0, 0, 7] = float("inf")
    v[1, 0, Sk - 1, DV - 1] = float("nan")
    v[0, 2, 5, 0] = float("-inf")
    flag, part = _flags(k, v)
    want, _ = ref.finite_flags(k, v)
    assert part is None and flag.dtype == torch.int32 and flag.shape == (B, H, DV)
    assert torch.equal(flag.cpu(), want.cpu())
    expect = torch.zeros(B, H, DV, dtype=torch.int32)
    expect[0, 1] = 1
    expect[1, 2] = 1
    expect[1, 0, 7] = expect[1, 0, DV - 1] = expect[0, 2, 0] = 1
    assert torch.equal(want.cpu(), expect)


def test_flags_strided_inputs():
    """k, v as permuted views of a [B, S, H, D] projection (the layout the op receives)."""
    x = torch.randn(1, 300, 2, 64).to(KERNEL_DEVICE, torch.bfloat16)
    y = torch.randn(1, 300, 2, 64).to(KERNEL_DEVICE, torch.bfloat16)
    y[0, 299, 1, 9] = float("nan")
    k, v = x.transpose(1, 2), y.transpose(1, 2)
    flag, _ = _flags(k, v)
    assert torch.equal(flag.cpu(), ref.finite_flags(k, v)[0].cpu())
    assert flag.sum() == 1 and flag[0, 1, 9] == 1


@pytest.mark.parametrize("S,D,dtype", [(200, 64, torch.bfloat16), (333, 128, torch.float16)])
def test_probe_rows_and_error_match_reference(S, D, dtype):
    B, H, R = 1, 2, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(KERNEL_DEVICE, dtype) for _ in range(3))
    k = k + 2.0 * torch.randn(1, 1, 1, D, generator=g).to(KERNEL_DEVICE, dtype)  # channel bias: peaked rows
    rows = torch.stack([torch.randperm(S, generator=g)[:R] for _ in range(B * H)]).view(B, H, R).to(KERNEL_DEVICE)
    sm = D ** -0.5
    tpl = _tpl()
    flag, part = _flags(k, v, probe=(q, rows, sm))
    assert flag.sum() == 0
    exact = tpl.probe_rows(part)
    want = ref.probe_rows(q, k, v, rows, sm)
    # the probe rounds P to v's dtype before PV, as the gather kernel: ~2^-9 relative (bf16)
    assert ((exact - want).norm() / want.norm()).item() < {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=sm)
    out = out * (1 + 0.05 * torch.randn(out.shape, generator=g).to(out.device))  # a "reuse" output 5% off
    e_t = dispatch.probe_error(dispatch.Impl.TRITON, out, rows, part)
    e_r = ref.probe_error(out, rows, want)
    assert e_t.shape == (2,) and torch.allclose(e_t.cpu(), e_r.cpu(), rtol=2e-2)
    rel = (e_r[0] / e_r[1]).sqrt().item()
    assert 0.04 < rel < 0.06  # the measured error is the perturbation's size


def test_flags_launch_configs():
    """Other launch configs (block_n, strip sizing: one program per 32-key strip vs the whole head) give the same
    flags and probe partials combining to the same rows; a bad config is refused by name."""
    from vc_compile.kernels.configs import FiniteFlagsConfig

    g = torch.Generator().manual_seed(2)
    B, H, S, D, R = 1, 2, 130, 64, 16
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(KERNEL_DEVICE, torch.float16) for _ in range(3))
    k[0, 1, 129, 0] = float("nan")
    v[0, 0, 64, 3] = float("inf")
    rows = torch.stack([torch.randperm(S, generator=g)[:R] for _ in range(B * H)]).view(B, H, R).to(KERNEL_DEVICE)
    want, exact = ref.finite_flags(k, v, probe=(q, rows, 0.125))
    for launch in (FiniteFlagsConfig(block_n=32, target_programs=1 << 20, max_strip=32),
                   FiniteFlagsConfig(block_n=16, num_warps=2, target_programs=1)):
        flag, part = _tpl().finite_flags(k, v, probe=(q, rows, 0.125), launch=launch)
        assert torch.equal(flag.cpu(), want.cpu())
        assert part.m.shape[1] == -(-S // launch.strip_len(S, B * H))
        ok = torch.isfinite(exact)  # the flagged heads' rows are non-finite in both
        assert torch.equal(ok.cpu(), torch.isfinite(_tpl().probe_rows(part)).cpu())
        assert torch.allclose(_tpl().probe_rows(part)[ok].cpu(), exact[ok].cpu(), atol=2e-3)
    with pytest.raises(ValueError, match="max_strip"):
        FiniteFlagsConfig(block_n=64, max_strip=32)
    with pytest.raises(TypeError, match="FiniteFlagsConfig"):
        _tpl().finite_flags(k, v, launch=(64, 4))


# ---- SDPA's own pattern ----------------------------------------------------------------------------------
def test_sdpa_pattern():
    """What fp32 SDPA really does (the truth the contract above quotes)."""
    q, k, v = (torch.randn(1, 1, 64, 32) for _ in range(3))
    k2 = k.clone()
    k2[0, 0, 7, 3] = float("nan")
    assert nf(F.scaled_dot_product_attention(q, k2, v)).all()
    k2[0, 0, 7, 3] = float("inf")
    o = F.scaled_dot_product_attention(q, k2, v)
    plus = q[0, 0, :, 3] > 0  # logit +Inf -> inf - inf = NaN in the softmax; -Inf -> p = 0, finite
    assert nf(o[0, 0][plus]).all() and torch.isfinite(o[0, 0][~plus]).all()
    v2 = v.clone()
    v2[0, 0, 7, 3] = float("inf")
    o = F.scaled_dot_product_attention(q, k, v2)
    assert nf(o[..., 3]).all() and torch.isfinite(o[..., [0, 1, 2, 4]]).all()


# ---- through the op: every phase ------------------------------------------------------------------------
def _poison(t, bad):
    t = t.clone()
    t[1, 0, 7, 3] = BAD[bad]
    return t


CASES = [("q", "nan"), ("q", "inf"), ("q", "-inf"), ("k", "nan"), ("k", "inf"), ("k", "-inf"), ("v", "nan"),
         ("v", "inf")]


def _run_phases(which, bad, kernels, S=160, D=64, dtype=torch.bfloat16, device="cpu"):
    """One generation of 5 steps: warm-up (bad), anchor (clean), reuse (bad), anchor (bad), reuse (clean).

    q and k share a bias u and the clean key 7 is zero: its logit (0) is far below every other (~|u|^2 /
    sqrt(D) = 8), so no query group selects key 7 at the anchor and a reuse step never reads key / value 7."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(D, generator=g)
    q, k, v = (torch.randn(2, 2, S, D, generator=g) for _ in range(3))
    q, k = q + u, k + u
    k[:, :, 7] = 0.0
    clean = [t.to(device, dtype) for t in (q, k, v)]
    poisoned = list(clean)
    i = "qkv".index(which)
    poisoned[i] = _poison(clean[i], bad)
    site = _report.register_site(graph="finite", node="n", module="m", shape="?", dtype="?",
                                 method="mcsparse", rewritten=True).site
    # the reuse-step propagation is opt-in (+19% of a reuse step); the warm-up is stock SDPA here, so the
    # warm-up output is checked bit for bit against it (the V-Smooth warm-up propagates like vsmooth's tests show)
    cj = VCConfig.from_options({"method": "mcsparse", "warmup_steps": 1, "anchor_steps": (1, 3), "density": 0.3,
                                "min_seq_len": 1, "propagate_nonfinite": True, "warmup_attention": "sdpa",
                                "experimental": {"kernels": kernels}}).to_json()
    outs = []
    with vc_compile.sampling(num_steps=5):
        for step, x in enumerate([poisoned, clean, poisoned, poisoned, clean]):
            vc_compile.step(step)
            outs.append(torch.ops.vcattn.attention(*x, None, site, cj, None))
    phases = dict(_report.site(site).phases)
    assert phases == {"dense": 1, "anchor": 2, "reuse": 2}, phases
    return poisoned, clean, outs


def _check_phases(which, bad, poisoned, clean, outs):
    stock = F.scaled_dot_product_attention(*poisoned)
    truth = F.scaled_dot_product_attention(*(t.float() for t in poisoned))
    warm, _, reuse, anchor, reuse_clean = outs
    # warm-up: stock SDPA, bit for bit
    assert torch.equal(nf(warm), nf(stock)) and torch.equal(torch.nan_to_num(warm), torch.nan_to_num(stock))
    # anchor: O_dense has SDPA's own pattern (fp32 math, or the device's SDPA kernel on the Triton path)
    assert torch.equal(nf(anchor), nf(truth)) or torch.equal(nf(anchor), nf(stock)), \
        f"anchor: {nf(anchor).sum().item()} non-finite, SDPA fp32 {nf(truth).sum().item()}, stock {nf(stock).sum().item()}"
    # reuse: SDPA's pattern (before the fix: NaN/Inf in keys/values no group selected vanished)
    if which == "k" and bad != "nan":
        want = torch.zeros_like(nf(truth))
        want[1, 0] = True  # the whole head, a superset of SDPA's rows
        assert (want | ~nf(truth)).all()
    else:
        want = nf(truth)
    assert torch.equal(nf(reuse), want), \
        f"reuse: {nf(reuse).sum().item()} non-finite where SDPA (fp32) has {nf(truth).sum().item()}, want {want.sum().item()}"
    assert torch.isfinite(reuse_clean).all(), "the clean reuse step after a bad anchor is not finite"


@pytest.mark.parametrize("which,bad", CASES)
def test_nonfinite_every_phase_reference(which, bad):
    _check_phases(which, bad, *_run_phases(which, bad, "reference"))


@pytest.mark.parametrize("which,bad", CASES)
def test_nonfinite_every_phase_kernels(which, bad):
    _check_phases(which, bad, *_run_phases(which, bad, "triton", S=130, device=KERNEL_DEVICE))


@pytest.mark.parametrize("dtype,D", [(torch.float16, 128)])
def test_nonfinite_reuse_fp16_d128(dtype, D):
    """fp16 (its exponent mask, the fp32 kernel output saturated by finish_output) and D = 128."""
    for which, bad in (("k", "nan"), ("v", "inf")):
        _check_phases(which, bad, *_run_phases(which, bad, "reference", S=200, D=D, dtype=dtype))


@requires_cuda
@pytest.mark.parametrize("which,bad", CASES)
def test_nonfinite_every_phase_cuda_large(which, bad):
    _check_phases(which, bad, *_run_phases(which, bad, "triton", S=4100, D=128, device="cuda"))
