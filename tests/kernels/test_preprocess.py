"""Triton preprocessing (``kernels/preprocess.py``) against the reference (``reference/preprocess.py``).

Inputs are permuted views of [B, S, H, D] tensors (the model's layout), structured (channel-biased K,
clustered V with token outliers), with S not a multiple of the 128/64-token blocks.

Exactness: without Hadamard the arithmetic is the (CPU) reference's (IEEE divisions, same rounding), so
Q codes must match exactly; K and V codes depend on a mean summed in another order, so a code may move
by one step where a value sits on a rounding boundary (allowed on <= 0.5% of the codes). With Hadamard
the kernel computes ``(x @ Hpm) / sqrt(D) - kbar @ Hd`` instead of ``(x - kbar) @ Hd``: same tolerance.
Under the interpreter the FP8 cast is done on values rounded in software first, so FP8 codes are
compared code for code as well (one step allowed as above).
"""
import functools

import pytest
import torch

from conftest import KERNEL_DEVICE, requires_cuda, pinned_codegen
from vc_compile import formats
from vc_compile.reference import preprocess as ref
from vc_compile.kernels import preprocess as tpl
from vc_compile.kernels.configs import PreprocessConfig

FP8 = torch.float8_e4m3fn
# Code-for-code only against the CPU reference: on CUDA, torch divides by a Python scalar as a multiply
# by its reciprocal (``amax / 127`` in safe_scale), an ulp away from the kernel's IEEE division, so
# the GPU reference's scales differ by an ulp and codes on a rounding boundary by one step (measured on
# the H200: 7.7e-5 of the INT8 Q codes, 1.2e-3 of the FP8 ones).
EXACT = KERNEL_DEVICE == "cpu"


def make_qkv(B, H, S, D, dtype, device=KERNEL_DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, 3 * D, generator=g)
    q, k, v = x.split(D, dim=-1)
    k = k + 4.0 * torch.randn(H, D, generator=g)  # channel-biased K
    centers = 2.0 * torch.randn(8, D, generator=g)
    v = 0.3 * v + centers[torch.randint(0, 8, (B, S, H), generator=g)]  # clustered V
    out = torch.rand(B, S, H, generator=g) < 0.01
    v = v + out[..., None] * 20.0 * torch.randn(B, S, H, D, generator=g)  # token outliers
    to = lambda t: t.to(dtype).to(device).permute(0, 2, 1, 3)  # noqa: E731  [B,H,S,D] strided view
    return to(q), to(k), to(v)


def random_perm(B, H, S, device=KERNEL_DEVICE, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(S, generator=g) for _ in range(B * H)]).view(B, H, S).to(device)


def code_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in code steps between two code tensors (int8: integer distance; E4M3: ordinal distance
    of the bit patterns, sign-magnitude)."""
    if a.dtype == FP8:
        def ordinal(t):
            u = t.view(torch.uint8).int()
            return torch.where(u >= 128, -(u - 128), u)
        return (ordinal(a) - ordinal(b)).abs()
    return (a.int() - b.int()).abs()


def assert_codes(a, b, exact: bool, what: str):
    steps = code_steps(a.cpu(), b.cpu())
    if exact:
        assert int(steps.max()) == 0, f"{what}: {int((steps > 0).sum())} codes differ"
    else:
        assert int(steps.max()) <= 1, f"{what}: a code differs by {int(steps.max())} steps"
        frac = (steps > 0).float().mean().item()
        assert frac <= 5e-3, f"{what}: {frac:.2%} of the codes differ by one step"


D_DTYPES = [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float16)]
QK_CASES = [("int8", False), ("int8", True), ("fp8", False), ("fp8", True)]


@pytest.mark.parametrize("S", [200, 300])
@pytest.mark.parametrize("D,dtype", D_DTYPES)
@pytest.mark.parametrize("fmt,hadamard", QK_CASES)
def test_qk_matches_reference(S, D, dtype, fmt, hadamard):
    B, H = 1, 2
    q, k, _ = make_qkv(B, H, S, D, dtype)
    perm = random_perm(B, H, S) if S == 300 else None
    sm = D ** -0.5
    a = tpl.preprocess_qk(q, k, perm, sm_scale=sm, hadamard=hadamard, qk_format=fmt)
    b = ref.preprocess_qk(q, k, perm, sm_scale=sm, hadamard=hadamard, qk_format=fmt)
    assert a.q8.dtype == b.q8.dtype and a.q8.shape == b.q8.shape and a.k8.shape == b.k8.shape
    assert a.q_scale.shape == b.q_scale.shape and a.k_scale.shape == b.k_scale.shape
    assert a.sm_scale == b.sm_scale
    assert_codes(a.q8, b.q8, exact=EXACT and not hadamard, what="q8")
    assert_codes(a.k8, b.k8, exact=False, what="k8")
    torch.testing.assert_close(a.q_scale, b.q_scale, rtol=0 if EXACT and not hadamard else 2e-6, atol=0)
    torch.testing.assert_close(a.k_scale, b.k_scale, rtol=2e-6, atol=0)
    torch.testing.assert_close(a.k_mean, b.k_mean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S", [200, 300])
@pytest.mark.parametrize("D,dtype", D_DTYPES)
@pytest.mark.parametrize("smooth", [True, False])
def test_v_matches_reference(S, D, dtype, smooth):
    B, H = 1, 2
    _, _, v = make_qkv(B, H, S, D, dtype)
    perm = random_perm(B, H, S) if S == 300 else None
    a = tpl.preprocess_v(v, perm, smooth=smooth)
    b = ref.preprocess_v(v, perm, smooth=smooth)
    assert a.S == b.S == S
    assert a.v8t.shape == b.v8t.shape and a.v8t.dtype == FP8
    assert_codes(a.v8t, b.v8t, exact=EXACT and not smooth, what="v8t")
    assert int(a.v8t[..., S:].view(torch.uint8).abs().sum()) == 0, "padding must be zero codes"
    torch.testing.assert_close(a.v_scale, b.v_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(a.v_mean, b.v_mean, rtol=1e-5, atol=1e-6)
    assert a.zero_mean == b.zero_mean == (not smooth)


def test_zero_blocks_get_scale_one():
    B, H, S, D = 1, 1, 300, 64
    q, k, v = make_qkv(B, H, S, D, torch.bfloat16)
    q = q.clone()
    q[:, :, 128:256] = 0  # one all-zero Q block
    v = v.clone()
    v[..., 5] = 0  # an all-zero V channel
    a = tpl.preprocess_qk(q, k, sm_scale=D ** -0.5)
    assert a.q_scale.shape == (B, H, S)  # one scale per query token
    torch.testing.assert_close(a.q_scale[0, 0, 128:256].cpu(),
                               torch.full((128,), D ** -0.5 * 1.4426950408889634), rtol=1e-6, atol=0)
    assert int(a.q8[:, :, 128:256].abs().sum()) == 0
    vq = tpl.preprocess_v(v, smooth=False)
    assert vq.v_scale[0, 0, 5].item() == 1.0
    assert int(vq.v8t[0, 0, 5].view(torch.uint8).sum()) == 0


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_tiny_rows_quantise_as_zero(fmt):
    """A Q row / V channel whose qmax / amax overflows fp32 (127 / 2e-37 = 6e38; reference.quant.flush_tiny)
    gets scale 1 and zero codes instead of inf/NaN codes."""
    B, H, S, D = 1, 1, 200, 64
    q, k, v = (t.clone() for t in make_qkv(B, H, S, D, torch.bfloat16))
    q[:, :, 10] = 2e-37
    q[:, :, 11] = 0.0
    q[:, :, 11, ::2] = -3e-38
    v[..., 7] = 2e-37 * torch.randn(S).to(v.device).sign().to(v.dtype)
    a = tpl.preprocess_qk(q, k, sm_scale=D ** -0.5, qk_format=fmt)
    b = ref.preprocess_qk(q, k, sm_scale=D ** -0.5, qk_format=fmt)
    sm = D ** -0.5 * 1.4426950408889634
    for x in (a, b):
        assert torch.isfinite(x.q_scale).all()
        torch.testing.assert_close(x.q_scale[0, 0, 10:12].cpu(), torch.full((2,), sm), rtol=1e-6, atol=0)
        assert int(x.q8[0, 0, 10:12].float().abs().sum()) == 0
    assert_codes(a.q8, b.q8, exact=EXACT, what="q8")
    va, vb = tpl.preprocess_v(v), ref.preprocess_v(v)
    for x in (va, vb):
        assert x.v_scale[0, 0, 7].item() == 1.0 and x.v8t[0, 0, 7].float().abs().sum().item() == 0  # +-0


@functools.lru_cache(maxsize=None)
def clean_kernel_outputs(B, H, S, D, fmt, hadamard):
    """The kernels' outputs on the clean inputs of the case below: the same for its six poisonings, so
    computed once per (D, fmt, hadamard) (interpreter time). The tests only read them."""
    q, k, v = (t.contiguous() for t in make_qkv(B, H, S, D, torch.bfloat16))
    perm = random_perm(B, H, S)
    qk = tpl.preprocess_qk(q, k, perm, sm_scale=D ** -0.5, hadamard=hadamard, qk_format=fmt)
    return qk, tpl.preprocess_v(v, perm)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("fmt,hadamard", [("int8", False), ("fp8", True)])
@pytest.mark.parametrize("which,bad", [("q", "nan"), ("q", "-inf"), ("k", "nan"), ("k", "inf"), ("v", "nan"),
                                       ("v", "-inf")])
def test_nonfinite_inputs_poison_their_scales(which, bad, fmt, hadamard, D):
    """Regression: tl.max / atomic_max (and GPU min/max) drop NaN, so a NaN input vanished into a finite
    scale. Now, as in the reference: a Q row with NaN/Inf gets q_scale NaN (that row only), a non-finite K
    element makes every q_scale of its head NaN (the K mean spreads it to every smoothed key), a V channel
    with one gets v_scale NaN; codes are those of the finite part. Nothing outside that (b, h) changes."""
    B, H, S = 2, 2, 200
    q, k, v = (t.contiguous() for t in make_qkv(B, H, S, D, torch.bfloat16))
    clean = [t.clone() for t in (q, k, v)]
    t = (q, k, v)["qkv".index(which)]
    t[1, 0, 150, 3] = float(bad)
    perm = random_perm(B, H, S)
    c, vc = clean_kernel_outputs(B, H, S, D, fmt, hadamard)
    # NOTE the kernel whose inputs stay clean is not run again: its outputs are the fixture's, on the same inputs
    a = tpl.preprocess_qk(q, k, perm, sm_scale=D ** -0.5, hadamard=hadamard, qk_format=fmt) if which != "v" else c
    b = ref.preprocess_qk(q, k, perm, sm_scale=D ** -0.5, hadamard=hadamard, qk_format=fmt)
    va, vb = tpl.preprocess_v(v, perm) if which == "v" else vc, ref.preprocess_v(v, perm)
    for x, y in ((a.q_scale, b.q_scale), (a.k_scale, b.k_scale), (va.v_scale, vb.v_scale)):
        assert torch.equal(x.isnan().cpu(), y.isnan().cpu())
        assert not x.isinf().any()
    nq, nk, nv = (int(x.isnan().sum()) for x in (a.q_scale, a.k_scale, va.v_scale))
    assert (nq, nk, nv) == {"q": (1, 0, 0), "k": (S, a.k_scale.shape[-1], 0), "v": (0, 0, 1)}[which]
    for x, y in ((a.q8, b.q8), (a.k8, b.k8), (va.v8t, vb.v8t)):  # codes stay finite and as the reference's
        assert not x.float().isnan().any()
        assert_codes(x, y, exact=False, what="codes")
    assert all(torch.equal(x, y) for x, y in zip(clean, make_qkv(B, H, S, D, torch.bfloat16)))  # its inputs
    other = torch.ones(B, H, dtype=torch.bool)
    other[1, 0] = False
    for x, y in ((a.q_scale, c.q_scale), (a.k_scale, c.k_scale), (va.v_scale, vc.v_scale), (a.q8, c.q8),
                 (a.k8, c.k8), (va.v8t, vc.v8t), (va.v_mean, vc.v_mean)):
        assert torch.equal(x[other].float(), y[other].float())


def test_launch_options_are_validated():
    """Pass 2's register cap and warps: only the measured values (a wrong cap would fail to compile or spill
    on the GPU, with no error on the CPU, where it is ignored)."""
    for bad in (dict(quant_regs=72), dict(quant_regs=-1), dict(quant_warps=2), dict(stats_regs=112),
                dict(stats_regs=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PreprocessConfig(**bad)
    assert PreprocessConfig(quant_regs=0, quant_warps=16).quant_warps == 16


def test_default_launch_compiles_for_sm90():
    """Every pass-2 specialisation the runtime launches with the default config (INT8 / FP8 codes, with and
    without Hadamard, D = 64 / 128, Q/K with V) compiles for sm_90 offline (tests/codegen_stats.py's fake
    driver). Regression: the register cap made ptxas refuse the Hadamard rotation's wgmma (C7602, needs
    >= 90 registers) on the GPU, where the interpreter ignores the cap."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    code = """
import codegen_stats as cs
import torch
cs._install()
from vc_compile.kernels import preprocess as tpre
for D in (64, 128):
    q = torch.empty(1, 1000, 2, D, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    perm = torch.empty(1, 2, 1000, dtype=torch.int64)
    for had in (False, True):
        for fmt in ("int8", "fp8"):
            cs.COMPILED.clear()
            try:
                tpre.preprocess(q, q, q, perm, sm_scale=0.1, hadamard=had, qk_format=fmt, v_layout="sm90")
            except Exception as e:
                if not cs.COMPILED or "ptxas" in str(e) or "Insufficient" in str(e):
                    print("FAIL", D, had, fmt, type(e).__name__, str(e)[:300])
            names = [n for n, _ in cs.COMPILED]
            print("ok" if "_quant_kernel" in names else "FAIL", D, had, fmt, names)
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    if "No module named" in r.stderr or (r.returncode != 0 and "GPUTarget" in r.stderr):
        pytest.skip(f"offline sm_90 compile unavailable here: {r.stderr.strip()[-300:]}")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("ok", "FAIL"))]
    assert r.returncode == 0 and len(lines) == 8 and not [ln for ln in lines if ln.startswith("FAIL")], \
        r.stdout[-2000:] + r.stderr[-2000:]


@pinned_codegen
def test_pass2_spills_no_more_with_many_splits():
    """Offline sm_90 compile (tests/codegen_stats.py's fake driver) of pass 2 at 12 heads x 8192 tokens, where
    pass 1 splits a head 64 ways: pass 2 reads the partials 32 rows a step, so at its 80-register cap it spills
    what it spills at 40 heads (88-96 bytes), not the 768 bytes the whole [64, D] tile of partials cost. And
    ``PreprocessConfig.stats_regs`` caps pass 1's registers (40 x 32760)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    code = """
import codegen_stats as cs
import torch
cs._install()
from vc_compile.kernels import preprocess as tpre
q = torch.empty(1, 8192, 12, 128, dtype=torch.bfloat16).permute(0, 2, 1, 3)
tpre.preprocess(q, q, q, torch.empty(1, 12, 8192, dtype=torch.int64), sm_scale=0.1, v_layout="sm90")
for n, k in cs.COMPILED:
    st = cs.stats(k)
    print("STATS", n, st["registers"], st["spill_bytes"])
from vc_compile.kernels.configs import PreprocessConfig
cs.COMPILED.clear()
q = torch.empty(1, 32760, 40, 128, dtype=torch.bfloat16).permute(0, 2, 1, 3)
tpre.preprocess(q, q, q, torch.empty(1, 40, 32760, dtype=torch.int64), sm_scale=0.1, v_layout="sm90",
                launch=PreprocessConfig(stats_regs=168))
for n, k in cs.COMPILED:
    st = cs.stats(k)
    print("STATS", n + "@168", st["registers"], st["spill_bytes"])
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    if "No module named" in r.stderr or (r.returncode != 0 and "GPUTarget" in r.stderr):
        pytest.skip(f"offline sm_90 compile unavailable here: {r.stderr.strip()[-300:]}")
    stats = {ln.split()[1]: [int(x) for x in ln.split()[2:]] for ln in r.stdout.splitlines() if ln.startswith("STATS")}
    assert r.returncode == 0 and "_quant_kernel" in stats, r.stdout[-2000:] + r.stderr[-2000:]
    regs, spill = stats["_quant_kernel"]
    assert regs <= 80 and 0 <= spill <= 128, stats
    # the stats_regs option reaches pass 1's compile (40 x 32760: 185 registers uncapped, 12 bytes spilled at 168)
    regs, spill = stats["_stats_kernel@168"]
    assert regs <= 168 and 0 <= spill <= 64, stats


def test_rejects_bad_args():
    q, k, v = make_qkv(1, 1, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="qk_format"):
        tpl.preprocess_qk(q, k, sm_scale=0.1, qk_format="int4")


@requires_cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("hadamard", [False, True])
def test_gpu_large(D, hadamard):
    B, H, S = 1, 4, 4173
    q, k, v = make_qkv(B, H, S, D, torch.bfloat16, device="cuda")
    perm = random_perm(B, H, S, device="cuda")
    for fmt in ("int8", "fp8"):
        a = tpl.preprocess_qk(q, k, perm, sm_scale=D ** -0.5, hadamard=hadamard, qk_format=fmt)
        b = ref.preprocess_qk(q, k, perm, sm_scale=D ** -0.5, hadamard=hadamard, qk_format=fmt)
        assert_codes(a.q8, b.q8, exact=False, what=f"q8 {fmt}")
        assert_codes(a.k8, b.k8, exact=False, what=f"k8 {fmt}")
        assert a.q_scale.shape == b.q_scale.shape == (B, H, S)  # per token
        torch.testing.assert_close(a.q_scale, b.q_scale, rtol=2e-6, atol=0)
        torch.testing.assert_close(a.k_scale, b.k_scale, rtol=2e-6, atol=0)
    for smooth in (True, False):
        a = tpl.preprocess_v(v, perm, smooth=smooth)
        b = ref.preprocess_v(v, perm, smooth=smooth)
        assert_codes(a.v8t, b.v8t, exact=False, what="v8t")
        torch.testing.assert_close(a.v_scale, b.v_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(a.v_mean, b.v_mean, rtol=1e-5, atol=1e-5)



def test_k_mean_is_the_mean_of_the_sampled_blocks():
    """Above S = 8191 the K mean is taken over every st-th 64-token block (reference.k_mean_mask): the
    kernel's colsum pass reads exactly those rows (S = 8200: st = 2, the last sampled block holds 8)."""
    B, H, S, D = 1, 2, 8200, 64
    _, k, _ = make_qkv(B, H, S, D, torch.bfloat16)
    assert formats.k_mean_stride(S) == 2 and formats.k_mean_stride(8191) == 1
    mask = ref.k_mean_mask(S)
    assert int(mask.sum()) == 64 * 64 + 8 and bool(mask[8199]) and not bool(mask[64])
    want = k.float().cpu()[:, :, mask].double().mean(dim=2)
    got = tpl._token_mean(k).double().cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # fp32 sums of ~4100 terms of |x| ~ 5


def test_sampled_k_mean_smooths_as_well_as_the_full_mean():
    """The sampled mean is an estimate of the channel bias; softmax ignores it either way, so it only has
    to remove the bias as well as the exact mean for the INT8 codes. Channel-biased K (bias 4 sigma),
    S = 32760 (st = 7, 4736 tokens): K reconstruction error with the sample within 2% of the exact mean's,
    both far below quantising without smoothing."""
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 1, 2, 32760, 128
    k = torch.randn(B, H, S, D, generator=g) + 4.0 * torch.randn(1, H, 1, D, generator=g)
    k = k + 0.5 * torch.sin(torch.arange(S) / 3000.0)[None, None, :, None]  # a slow drift along the tokens
    from vc_compile.reference import quant as Qn

    def err(mean):
        codes, scale = Qn.quantize_blocks(k - mean, formats.BLOCK_K, "int8")
        return ((Qn.dequantize_blocks(codes, scale, formats.BLOCK_K) + mean - k).norm() / k.norm()).item()

    full = k.mean(dim=2, keepdim=True)
    sampled = k[:, :, ref.k_mean_mask(S)].mean(dim=2, keepdim=True)
    e_full, e_samp, e_none = err(full), err(sampled), err(torch.zeros_like(full))
    assert e_samp <= 1.02 * e_full, (e_samp, e_full)
    assert e_none >= 2.0 * e_full, (e_none, e_full)


# ---- the fused two-launch preprocessing (``tpl.preprocess``) -------------------------------------------------
@pytest.mark.parametrize("S,D,dtype", [(300, 64, torch.bfloat16), (1100, 128, torch.bfloat16),
                                       (517, 128, torch.float16)])
@pytest.mark.parametrize("layout", ["natural", "natural+mu", "sm90"])
def test_fused_matches_reference(S, D, dtype, layout):
    """Q, K and V in two launches (pass 1: K's sampled sums, V's block means and partial amaxes; pass 2: every
    code, with K's mean and V's scale reduced from the partials in each program) give the reference's codes and
    scales; the "sm90" layout is the reference's V^T with each 128-column block in ``sm90_key_order`` and
    mu' / its tf32 groups as ``to_sm90_layout`` makes them; "natural+mu" (``mu_prime=True``) the natural layout
    with mu' as that division makes it. S = 1100: 9 V blocks, a partial last mean window."""
    B, H = 2, 2
    q, k, v = make_qkv(B, H, S, D, dtype)
    perm = random_perm(B, H, S)
    sm = D ** -0.5
    with_mu = layout == "natural+mu"
    layout = "natural" if with_mu else layout
    qk, vq = tpl.preprocess(q, k, v, perm, sm_scale=sm, v_layout=layout, mu_prime=with_mu)
    rq, rv = ref.preprocess_qk(q, k, perm, sm_scale=sm), ref.preprocess_v(v, perm)
    assert_codes(qk.q8, rq.q8, exact=EXACT, what="q8")
    assert_codes(qk.k8, rq.k8, exact=False, what="k8")
    torch.testing.assert_close(qk.q_scale, rq.q_scale, rtol=0 if EXACT else 2e-6, atol=0)
    torch.testing.assert_close(qk.k_scale, rq.k_scale, rtol=2e-6, atol=0)
    torch.testing.assert_close(qk.k_mean, rq.k_mean, rtol=1e-5, atol=1e-5)
    assert vq.layout == layout and vq.S == S
    nat = formats.natural_layout(vq)
    assert_codes(nat.v8t, rv.v8t, exact=False, what="v8t")
    assert int(nat.v8t[..., S:].view(torch.uint8).abs().sum()) == 0, "padding must be zero codes"
    torch.testing.assert_close(vq.v_scale, rv.v_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(vq.v_mean, rv.v_mean, rtol=1e-5, atol=1e-6)
    if layout == "sm90":
        want = formats.to_sm90_layout(vq._replace(layout="natural", v8t=nat.v8t))  # mu' from the kernel's own means
        assert torch.equal(vq.v8t.view(torch.uint8), want.v8t.view(torch.uint8))
        assert torch.equal(vq.mu_prime, want.mu_prime) and torch.equal(vq.mu_groups, want.mu_groups)
    elif with_mu:  # the same IEEE division of the kernel's own means and scales as the eager one it replaces
        assert vq.mu_groups is None
        assert torch.equal(vq.mu_prime, (vq.v_mean / vq.v_scale.unsqueeze(2)).contiguous().view(-1, D))
    else:
        assert vq.mu_prime is None and vq.mu_groups is None


def test_fused_reduces_more_than_32_partials_in_steps():
    """Pass 2 reduces pass 1's partials 32 rows a step (the whole [NSP, D] tile spilled at the register cap):
    with 36 splits a head (one head, S = 4500: 36 V blocks) K's mean and V's scale are the reference's, through
    two steps of which the second is partly masked."""
    B, H, S, D = 1, 1, 4500, 128
    assert tpl._split_count(-(-S // formats.BLOCK_V), B * H, tpl.PREPROCESS_DEFAULT.stats_per_sm,
                            tpl.sm_count(torch.device(KERNEL_DEVICE))) == 36
    q, k, v = make_qkv(B, H, S, D, torch.bfloat16)
    perm = random_perm(B, H, S)
    qk, vq = tpl.preprocess(q, k, v, perm, sm_scale=D ** -0.5, v_layout="natural")
    rq, rv = ref.preprocess_qk(q, k, perm, sm_scale=D ** -0.5), ref.preprocess_v(v, perm)
    torch.testing.assert_close(qk.k_mean, rq.k_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qk.k_scale, rq.k_scale, rtol=2e-6, atol=0)
    assert_codes(qk.k8, rq.k8, exact=False, what="k8")
    torch.testing.assert_close(vq.v_scale, rv.v_scale, rtol=1e-6, atol=0)
    assert_codes(vq.v8t, rv.v8t, exact=False, what="v8t")


def test_sm90_layout_round_trip_and_attention_unchanged():
    """``to_sm90_layout`` / ``natural_layout`` are inverse, and the reference attention reads either layout
    to the same output (a layout is a storage order, never a different V)."""
    from vc_compile.reference import vsmooth_attn as ref_attn
    B, H, S, D = 1, 2, 300, 64
    q, k, v = make_qkv(B, H, S, D, torch.bfloat16, device="cpu")
    qk, vq = ref.preprocess_qk(q, k, sm_scale=D ** -0.5), ref.preprocess_v(v)
    s9 = formats.to_sm90_layout(vq)
    assert s9.layout == "sm90" and not torch.equal(s9.v8t.view(torch.uint8), vq.v8t.view(torch.uint8))
    back = formats.natural_layout(s9)  # mu' is per block: kept
    assert torch.equal(back.v8t.view(torch.uint8), vq.v8t.view(torch.uint8)) and back.mu_groups is None
    assert torch.equal(back.mu_prime, s9.mu_prime)
    assert torch.equal(ref_attn.vsmooth_attention(qk, s9), ref_attn.vsmooth_attention(qk, vq))
    with pytest.raises(ValueError, match="layout"):
        formats.natural_layout(vq._replace(layout="tiled"))
    with pytest.raises(ValueError, match="v_layout"):
        tpl.preprocess(q, k, v, sm_scale=0.1, v_layout="tiled")


def test_fused_is_two_launches_and_no_torch_compute():
    """A reuse step's preprocessing is the two Triton launches and nothing else: no torch op that computes
    (only allocations) runs between or around them (each eager op is a kernel launch and host time on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.inside = [], False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.inside:  # (the CPU interpreter's own tensor traffic during a launch is not ours)
                self.ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    launches = []
    real = {n: getattr(tpl, n) for n in ("_stats_kernel", "_quant_kernel")}

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*a, **kw):
                launches.append(self.name)
                mode.inside = True
                try:
                    return real[self.name][grid](*a, **kw)
                finally:
                    mode.inside = False
            return launch
    mode = Ops()
    B, H, S, D = 1, 2, 300, 64
    q, k, v = make_qkv(B, H, S, D, torch.bfloat16)
    perm = random_perm(B, H, S)
    mp = pytest.MonkeyPatch()
    tpl._PLANS.clear()  # a call recorded by another test would replay the real kernels, not the spies
    try:
        for n in real:
            mp.setattr(tpl, n, Spy(n))
        with mode:
            tpl.preprocess(q, k, v, perm, sm_scale=D ** -0.5, v_layout="sm90")  # computed and recorded
            tpl.preprocess(q, k, v, perm, sm_scale=D ** -0.5, v_layout="sm90")  # replayed
    finally:
        mp.undo()
        tpl._PLANS.clear()
    assert launches == ["_stats_kernel", "_quant_kernel"] * 2
    assert set(mode.ops) <= {"empty", "empty_strided"}, mode.ops


@pytest.mark.parametrize("case", ["sm90", "natural_noperm", "qk_only", "v_only", "hadamard_fp8", "aliased"])
def test_a_replayed_call_equals_a_computed_one(case, monkeypatch):
    """A call recorded on one set of tensors and replayed on another of the same key (shapes, strides, dtypes,
    alignment, aliasing, arguments) gives what computing it gives, bit for bit; a key that differs (here: the
    inputs aliased in one call and not in the next) is computed, not replayed."""
    B, H, S, D = 1, 2, 333, 64
    kw = dict(sm_scale=D ** -0.5, v_layout="natural" if case == "natural_noperm" else "sm90",
              hadamard=case == "hadamard_fp8", qk_format="fp8" if case == "hadamard_fp8" else "int8")
    first, second = make_qkv(B, H, S, D, torch.bfloat16), make_qkv(B, H, S, D, torch.bfloat16)
    perm = None if case == "natural_noperm" else random_perm(B, H, S)

    def args(t):
        q, k, v = t
        if case == "qk_only":
            return q, k, None
        if case == "v_only":
            return None, None, v
        return q, k, v
    if case == "aliased":
        first = (first[0], first[0], first[0])
    computed = []
    real = tpl._preprocess
    monkeypatch.setattr(tpl, "_preprocess", lambda *a, **k: computed.append(1) or real(*a, **k))
    tpl._PLANS.clear()
    tpl.preprocess(*args(first), perm, **kw)
    got = tpl.preprocess(*args(second), perm, **kw)
    want = real(*args(second), perm, rope=None, smooth=True, launch=tpl.PREPROCESS_DEFAULT, rec=None, **kw)
    assert len(computed) == (2 if case == "aliased" else 1)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is None:
            continue
        assert type(g) is type(w)
        for a, b in zip(g, w):
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
            else:
                assert a == b
    tpl._PLANS.clear()


def test_no_replay_with_the_remembered_launches_off(monkeypatch):
    """``FAST_LAUNCH.enabled = False`` (the host-time A/B of bench_op_overhead --ab-launch) also turns the recorded
    preprocessing off: every call is computed."""
    from vc_compile.kernels.launch import FAST_LAUNCH

    B, H, S, D = 1, 2, 200, 64
    q, k, v = make_qkv(B, H, S, D, torch.bfloat16)
    computed = []
    real = tpl._preprocess
    monkeypatch.setattr(tpl, "_preprocess", lambda *a, **k: computed.append(1) or real(*a, **k))
    monkeypatch.setattr(FAST_LAUNCH, "enabled", False)
    tpl._PLANS.clear()
    for _ in range(2):
        tpl.preprocess(q, k, v, None, sm_scale=0.1)
    assert len(computed) == 2 and not tpl._PLANS
