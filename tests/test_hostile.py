"""Hostile inputs: wherever stock SDPA returns a finite result, ``vcattn::attention`` returns a
finite result within its method's tolerance, or falls back to SDPA with the reason recorded.

Every case runs the op directly (a registered site, ``vc_compile.sampling`` + ``step``) for two steps, so
both phases of each method run on the hostile input: V-Smooth GROUP then REUSE of the cached
permutation; MC-Sparse ANCHOR (returns O_dense) then REUSE (sparse kernel + cached residual, here on the
same inputs). A few cases also go through ``torch.compile(..., backend="vcattn")``. The reference is fp32
SDPA on the same (rounded) inputs.

Error metric, per (b, h): ``||o - ref|| / (||ref|| + 1e-3 ||V|| sqrt(Sq/Sk))`` in fp64 (fp32 norms of
1e-30 values underflow). The guard term keeps heads whose exact output is ~0 (zero V, uniform attention
over zero-mean V) from dividing by zero; it is 1000x below the output scale of a normal head.

Tolerances (TOL), and why:
* ``dense`` is stock SDPA: compared bit for bit (NaN == NaN).
* ``mcsparse`` ANCHOR returns O_dense computed in fp32 and rounded once to the output dtype: relative
  error <= the unit roundoff u (2^-8 bf16, 2^-11 fp16), or 2x stock SDPA's own error when pass 1 is a
  16-bit kernel (the Triton path uses SDPA's flash kernel). REUSE on the anchor's inputs returns
  O_sparse + R with R = O_dense - O_sparse stored in bf16: <= u_bf16 |R| + u |O| ~ 3-4 u_bf16; 4 u_bf16
  plus 2x stock SDPA's error (its rounding to the output dtype, e.g. in fp16's subnormal range).
* the 8-bit methods: E4M3 keeps 3 mantissa bits, so P~ and the V residual are each rounded by up to 2^-4
  relative, and INT8 QK moves the logits by up to half a code of a per-block scale. Gaussian inputs give
  0.035 (vsmooth) to 0.05 (x3 logits); 0.08 = 1.6x that, far below what a structural failure costs
  (a flattened block of logits or a lost V mean: 0.1 - 0.5).
Fixed limit (regression tests): INT8 Q scales per 128 tokens let a query 100x the norm of its neighbours
flatten their logits (0.25-0.43); Q scales are now per token.

Kernel variants (``kernels="triton"``, TRITON_INTERPRET=1 on CPU) run a subset of the cases and skip with
the reason while a ``vc_compile/kernels`` module is missing or fails to import.
"""
import contextlib
import importlib.util
import math
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import KERNEL_DEVICE
import vc_compile
from vc_compile import methods
from vc_compile.config import VCConfig, VCConfigError
from vc_compile.runtime import report as _report
from vc_compile.runtime import state
from vc_compile.kernels import dispatch

U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
TOL_8BIT = 0.08
TOL_REUSE = 4 * 2.0 ** -8

METHODS = {
    "dense": dict(method="dense"),
    "vsmooth": dict(method="vsmooth"),
    "expcast": dict(method="vsmooth", expcast=True),
    "naive": dict(method="vsmooth", experimental={"smooth_v": False}),
    "mcsparse": dict(method="mcsparse", warmup_steps=0, anchor_steps=(0,), density=0.3),
}
EIGHT_BIT = ("vsmooth", "expcast", "naive")


# ---- helpers ------------------------------------------------------------------------------------------
def new_site(method="test"):
    return _report.register_site(graph="hostile", node="n", module="m", shape="?", dtype="?",
                                 method=method, rewritten=True).site


def with_kernels(options, kernels):
    """``options`` with ``experimental['kernels']`` set (merged into any experimental knobs they have)."""
    return {**options, "experimental": {**options.get("experimental", {}), "kernels": kernels}}


def cfg_json(name, kernels="reference", **over):
    return VCConfig.from_options(with_kernels({**METHODS[name], "min_seq_len": 1, **over}, kernels)).to_json()


def run_op(q, k, v, name, *, steps=2, kernels="reference", scale=None, inputs=None, site=None, **over):
    """Outputs of ``steps`` consecutive steps of one generation at one site (``inputs[i]`` replaces the
    inputs of step i when given)."""
    cj = cfg_json(name, kernels, **over)
    site = site if site is not None else new_site(name)
    outs = []
    with vc_compile.sampling(num_steps=max(steps, 2)):
        for i in range(steps):
            vc_compile.step(i)
            qi, ki, vi = inputs[i] if inputs and inputs[i] is not None else (q, k, v)
            outs.append(torch.ops.vcattn.attention(qi, ki, vi, None, site, cj, scale))
    return outs


def metas_of(site):
    """The metadata objects cached for one site (all blocks, branches, shapes)."""
    return [m for key, m in state.items() if key[0] == site and m is not None]


def ref_sdpa(q, k, v, scale=None):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)


def head_err(o, ref, v):
    """Per-(b, h) relative L2 error (see the module docstring), fp64."""
    o, ref, v = o.double(), ref.double(), v.double()
    num = (o - ref).flatten(2).norm(dim=-1)
    den = ref.flatten(2).norm(dim=-1) + 1e-3 * v.flatten(2).norm(dim=-1) * math.sqrt(ref.shape[2] / v.shape[2])
    return torch.where(den > 0, num / den.clamp_min(1e-300), num)


def assert_method_ok(name, outs, q, k, v, scale=None, kernels="reference"):
    """Finite where fp32 SDPA is finite, each step within its tolerance."""
    ref = ref_sdpa(q, k, v, scale)
    assert torch.isfinite(ref).all(), "the case itself must be finite under fp32 SDPA"
    for i, o in enumerate(outs):
        assert o.shape == ref.shape and o.dtype == q.dtype and o.is_contiguous()
        bad = (~torch.isfinite(o)).sum().item()
        assert bad == 0, f"{name} step {i}: {bad} non-finite outputs where fp32 SDPA is finite"
    if name == "dense":
        stock = F.scaled_dot_product_attention(q, k, v, scale=scale)
        for o in outs:
            assert torch.equal(o, stock)
        return
    errs = [head_err(o, ref, v).max().item() for o in outs]
    if name == "mcsparse":
        stock_err = head_err(F.scaled_dot_product_attention(q, k, v, scale=scale), ref, v).max().item()
        # (+ 2 stock_err on reuse: rounding to the output dtype -- fp16 subnormals -- is SDPA's too)
        tols = [max(U[q.dtype], 2 * stock_err) + 1e-6, TOL_REUSE + 2 * stock_err]
    else:
        tols = [TOL_8BIT] * len(outs)
    for i, (e, t) in enumerate(zip(errs, tols)):
        assert e <= t, f"{name} ({kernels}) step {i}: per-head relative error {e:.4f} > tolerance {t:.4f}"


def kernels_skip(name):
    """pytest.skip with the reason when the Triton kernels of this method cannot be loaded."""
    method = METHODS[name]["method"]
    if method == "dense":
        return
    err = dispatch.triton_error()
    if err is not None:
        pytest.skip(f"Triton kernels of {method} fail to import: {err}")


def kernels_param(name, kernels):
    """The device of this variant: KERNEL_DEVICE (cuda, or cpu under TRITON_INTERPRET=1) for the Triton
    kernels, after skipping when they cannot be loaded; cpu for the reference."""
    if kernels == "triton":
        kernels_skip(name)
        return KERNEL_DEVICE
    return "cpu"


# ---- hostile cases --------------------------------------------------------------------------------------
def _g(seed):
    return torch.Generator().manual_seed(seed)


def gaussian(B=2, H=2, S=160, D=64, Sk=None, seed=0):
    g = _g(seed)
    Sk = S if Sk is None else Sk
    return (torch.randn(B, H, S, D, generator=g), torch.randn(B, H, Sk, D, generator=g),
            torch.randn(B, H, Sk, D, generator=g))


def case_zero_q_block():  # a whole 128-token Q scale block of zeros: scale 1, codes 0, uniform rows
    q, k, v = gaussian()
    q[0, 1, :128] = 0
    return q, k, v


def case_zero_k_block():
    q, k, v = gaussian()
    k[1, 0, 64:128] = 0
    return q, k, v


def case_zero_v_block():
    q, k, v = gaussian()
    v[0, 0, :128] = 0
    return q, k, v


def case_zero_heads():  # a zero Q head, a zero K head, a zero V head (exact output 0: guard term)
    q, k, v = gaussian()
    q[1, 1] = 0
    k[0, 0] = 0
    v[1, 0] = 0
    return q, k, v


def case_const_v_block():  # zero residual after the block mean
    q, k, v = gaussian()
    v[0, 1, :128] = torch.randn(64)
    return q, k, v


def case_const_v_head():  # every V row equal: the output is that row
    q, k, v = gaussian()
    v[1, 1] = 3.0
    return q, k, v


def case_mean_shifted_v():  # what V-Smooth is for: a large common offset
    q, k, v = gaussian()
    return q, k, v + 1000.0


def case_tiny():  # q.k underflows to 0 in fp32 (uniform rows, as in SDPA); V small but p * v normal
    q, k, v = gaussian()
    return q * 1e-30, k * 1e-30, v * 1e-32


def case_subnormal_scales():
    """bf16 V ~1e-36: the per-channel FP8 scale amax/448 is an fp32 subnormal. (Kernels: not run -- any
    fp32 kernel's p * v products are subnormal here too, fp32 itself loses digits.)"""
    q, k, v = gaussian()
    return q, k, v * 1e-36


def case_huge_token_v():  # one value token 1000x the others
    q, k, v = gaussian()
    v[0, 1, 5] *= 1000
    return q, k, v


def case_huge_token_k():  # one key token 30x (its 64-token K block shares one INT8 scale)
    q, k, v = gaussian()
    k[0, 1, 5] *= 30
    return q, k, v


def case_huge_token_q():  # one query token 10x (the bound for models with QK-norm, see vsmooth.py)
    q, k, v = gaussian()
    q[0, 1, 5] *= 10
    return q, k, v


def case_one_hot():  # every row has one clear winner: softmax is one-hot to fp32 precision
    q, k, v = gaussian()
    j = torch.randint(0, k.shape[2], (2, 2, q.shape[2]), generator=_g(3))
    q = 6.0 * torch.gather(k, 2, j.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1]))
    return q, k, v


def case_peaked():  # sharp but not one-hot softmax (logits x3)
    q, k, v = gaussian()
    return 3 * q, 3 * k, v


def case_batch_rows_differ():  # B = 3 with different content and scale per batch row
    q, k, v = gaussian(B=3, H=2, S=150)
    q[1] *= 3
    v[2] += 50
    k[0] = 0
    return q, k, v


CASES = {n[5:]: f for n, f in globals().items() if n.startswith("case_")}
KERNEL_CASES = ("zero_heads", "huge_token_v", "one_hot", "tiny")


FP16_CASES = ("zero_heads", "const_v_head", "mean_shifted_v", "tiny", "huge_token_v", "one_hot")


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("case,dtype", [(c, torch.bfloat16) for c in CASES]
                         + [(c, torch.float16) for c in FP16_CASES], ids=lambda x: str(x).replace("torch.", ""))
def test_hostile_reference(case, name, dtype):
    if dtype == torch.float16 and case == "tiny":  # fp16's own subnormal range (< 6.1e-5) instead
        q, k, v = (t * 1e-5 for t in gaussian())
    else:
        q, k, v = CASES[case]()
    q, k, v = (t.to(dtype) for t in (q, k, v))
    assert_method_ok(name, run_op(q, k, v, name), q, k, v)


@pytest.mark.parametrize("name", [n for n in METHODS if n != "dense"])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_hostile_kernels(case, name):
    dev = kernels_param(name, "triton")
    q, k, v = (t[:1, :, :130].to(dev, torch.bfloat16) for t in CASES[case]())
    assert_method_ok(name, run_op(q, k, v, name, kernels="triton"), q, k, v, kernels="triton")


def query_outlier_100x(**kw):
    q, k, v = gaussian(**kw)
    q[0, 1, 5] *= 100
    return q, k, v


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_query_outlier_100x(name, kernels):
    """Regression (was a strict xfail): one INT8 Q scale per 128 tokens let a query token 100x its
    neighbours' norm flatten their logits (error 0.28 on that head); Q scales are now per token. The
    kernels run the first batch row and 130 tokens (interpreter time), which keeps the outlier."""
    dev = kernels_param(name, kernels)
    q, k, v = (t.to(dev, torch.bfloat16) for t in query_outlier_100x())
    if kernels == "triton":
        q, k, v = (t[:1, :, :130] for t in (q, k, v))
    assert_method_ok(name, run_op(q, k, v, name, kernels=kernels), q, k, v, kernels=kernels)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("S", [160, 300])
def test_per_token_q_scales_help(S, dtype, D):
    """The accuracy trick: per-token Q scales against per-128-token ones (``q_block=128`` emulates the
    old kernel in the reference) on the 100x query outlier. Measured (S in {160, 300}, D in {64, 128},
    bf16/fp16): outlier head 0.25-0.43 per 128 vs 0.032-0.036 per token; other heads within +-1e-3.
    Asserted: per 128 > 0.2 (the input does hit the limit), per token <= TOL_8BIT and <= 1/4 of it,
    and no head worse than per 128 by more than 2e-3 (per token can only refine the codes; the
    margin is rounding noise)."""
    from vc_compile.reference import preprocess as ref_pre
    from vc_compile.reference import vsmooth_attn as ref_attn

    q, k, v = (t.to(dtype) for t in query_outlier_100x(S=S, D=D))
    ref = ref_sdpa(q, k, v)
    errs = {}
    for q_block in (128, 1):
        qk = ref_pre.preprocess_qk(q, k, sm_scale=D ** -0.5, q_block=q_block)
        assert qk.q_scale.shape == (2, 2, S)
        o = ref_attn.vsmooth_attention(qk, ref_pre.preprocess_v(v), out_dtype=torch.float32)
        errs[q_block] = head_err(o, ref, v)
    coarse, fine = errs[128][0, 1].item(), errs[1][0, 1].item()
    assert coarse > 0.2, f"per-128 error {coarse:.3f}: the case no longer shows the limit"
    assert fine <= TOL_8BIT and fine <= coarse / 4, f"per-token {fine:.3f} vs per-128 {coarse:.3f}"
    assert (errs[1] <= errs[128] + 2e-3).all(), (errs[1], errs[128])


# ---- values near the top of the range ------------------------------------------------------------------
def near_fp16_max_v(seed):
    """V within a few thousand of +-65504 and peaked attention: some rows' exact output is 65503.x, where
    an FP8 residual that rounds up lands above 65520 (fp16 inf)."""
    g = _g(seed)
    S = 256
    q, k = 3 * torch.randn(1, 1, S, 64, generator=g), 3 * torch.randn(1, 1, S, 64, generator=g)
    v = 65504 - torch.rand(1, 1, S, 64, generator=g) * 3000
    v[..., ::3, :] = -65504
    return q.half(), k.half(), v.half()


@pytest.mark.parametrize("name", list(METHODS))
def test_fp16_near_max_values_stay_finite(name):
    """Regression: V-Smooth (and ExpCast) returned inf in fp16 where SDPA returns 65503.9 (up to 1700
    elements per head); outputs now saturate at 65504."""
    for seed in range(3):
        q, k, v = near_fp16_max_v(seed)
        outs = run_op(q, k, v, name)
        assert all(torch.isfinite(o).all() for o in outs), f"seed {seed}"
        assert_method_ok(name, outs, q, k, v)


@pytest.mark.parametrize("name", [n for n in METHODS if n != "dense"])
def test_fp16_near_max_values_kernels(name):
    dev = kernels_param(name, "triton")
    q, k, v = near_fp16_max_v(0)
    q, k, v = (t[:, :, :130].to(dev) for t in (q, k, v))
    assert_method_ok(name, run_op(q, k, v, name, kernels="triton"), q, k, v, kernels="triton")


def test_fp16_near_max_stateless_ops():
    """Regression: the stateless ops (benchmarks, users managing metadata) had the same fp16 overflow."""
    q, k, v = near_fp16_max_v(0)
    ref = ref_sdpa(q, k, v)
    for expcast in (False, True):
        out = torch.ops.vcattn.vsmooth_attention(q, k, v, None, expcast, False, "int8", True, None)
        assert torch.isfinite(out).all() and head_err(out, ref, v).max() <= TOL_8BIT
    S = q.shape[2]
    sigma = torch.arange(S).expand(1, 1, S).contiguous()
    idx = torch.arange(S, dtype=torch.int32).expand(1, 1, S // 64, S).contiguous()
    resid = torch.full((1, 1, S, 64), 100.0, dtype=torch.float16)  # a stale residual pushing past 65504
    out = torch.ops.vcattn.sparse_attention(q, k, v, sigma, idx, resid, 64, None)
    assert torch.isfinite(out).all() and out.max() == 65504


def test_fp16_saturation_keeps_inf_and_nan():
    """The saturation moves only finite overflows: an Inf from an Inf input and NaN stay visible."""
    o = torch.tensor([70000.0, -70000.0, float("inf"), float("nan"), 1.5])
    out = methods.finish_output(o, torch.float16)
    assert out.dtype == torch.float16
    assert out[0] == 65504 and out[1] == -65504 and out[2] == float("inf") and torch.isnan(out[3])
    assert out[4] == 1.5
    assert methods.finish_output(o, torch.bfloat16)[0] == 70000  # bf16 has the range: untouched


@pytest.mark.parametrize("name", list(METHODS))
def test_fp16_near_max_qk_with_small_scale(name):
    """Q, K at +-6e4 (fp16) with scale = 1/|q||k| keep the logits O(1): no overflow in q.k, the K mean
    or the INT8 scales (fp32 math)."""
    q, k, v = gaussian(S=200)
    q, k = q.sign() * 6e4, k.sign() * (6e4 - 1e3 * torch.rand_like(k))
    q, k, v = (t.half() for t in (q, k, v))
    scale = 1.0 / (6e4 * 6e4 * 8)
    assert_method_ok(name, run_op(q, k, v, name, scale=scale), q, k, v, scale=scale)


@pytest.mark.parametrize("name", list(METHODS))
def test_bf16_large_values_in_guaranteed_range(name):
    """bf16 shares fp32's exponent range, so fp32 math has no headroom there. Guaranteed: |V| <= 2^100
    and Q, K large with a matching scale. (Above ~1e35 the V-Smooth sums -- 128-row block means, the
    P~ row sum scaled to 2^8 -- overflow fp32 while SDPA does not: documented, see the final report.)"""
    q, k, v = gaussian()
    q, k, v = q * 1e15, k * 1e15, v * 2.0 ** 100
    q, k, v = (t.bfloat16() for t in (q, k, v))
    assert_method_ok(name, run_op(q, k, v, name, scale=1e-31), q, k, v, scale=1e-31)


# ---- NaN / Inf in one element ----------------------------------------------------------------------------
def poisoned(which, bad, dtype=torch.bfloat16, S=160, device="cpu"):
    q, k, v = (t.to(device, dtype) for t in gaussian(S=S))
    clean = (q.clone(), k.clone(), v.clone())
    t = [q, k, v]["qkv".index(which)]
    t[1, 0, 7, 3] = bad
    return (q, k, v), clean


def check_poisoned(name, outs, bad_in, clean, kernels="reference"):
    """outs[0]: the poisoned step; outs[1:]: clean steps after it."""
    q, k, v = bad_in
    stock = F.scaled_dot_product_attention(q, k, v)  # what the user would get without vcattn
    ref32 = ref_sdpa(q, k, v)
    o = outs[0]
    # 1. nothing outside the poisoned (b=1, h=0) slice is touched: finite and within tolerance
    other = torch.ones(2, 2, dtype=torch.bool, device=o.device)
    other[1, 0] = False
    assert torch.isfinite(o[other]).all(), f"{name}: non-finite values leaked into other heads/batch rows"
    stock_err = head_err(stock, ref32, v)[other].max().item()
    tol = TOL_8BIT if name in EIGHT_BIT else max(U[q.dtype], 2 * stock_err) + 1e-6
    if name == "dense":
        assert torch.equal(torch.nan_to_num(o), torch.nan_to_num(stock))
        assert torch.equal(torch.isnan(o), torch.isnan(stock))
    else:
        assert head_err(o, ref32, v)[other].max() <= tol
    # 2. where stock SDPA and fp32 SDPA both say non-finite, so do we, in the same (b, h) slice
    both = ~torch.isfinite(stock) & ~torch.isfinite(ref32)
    if both.any():
        assert (~torch.isfinite(o[1, 0])).any(), f"{name}: the non-finite input vanished from its head"
    # 3. the clean steps after it are clean: no metadata poisoned by the bad step
    cq, ck, cv = clean
    ref_c = ref_sdpa(cq, ck, cv)
    for i, oc in enumerate(outs[1:], 1):
        assert torch.isfinite(oc).all(), f"{name}: clean step {i} after a NaN/Inf step is not finite"
        if name in EIGHT_BIT:
            assert head_err(oc, ref_c, cv).max() <= TOL_8BIT
        elif name == "mcsparse":
            assert head_err(oc, ref_c, cv).max() <= TOL_REUSE


BADS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.mark.parametrize("which,bad", [("q", "nan"), ("q", "inf"), ("k", "nan"), ("k", "-inf"), ("v", "nan"),
                                       ("v", "inf"), ("v", "-inf")])
@pytest.mark.parametrize("name", list(METHODS))
def test_nonfinite_element(name, which, bad):
    """Regression (mcsparse): a NaN/Inf at the anchor step cached a NaN residual, so every reuse step
    after it returned NaN for that head although its inputs were clean again."""
    bad_in, clean = poisoned(which, BADS[bad])
    steps = [bad_in, clean, clean]  # vsmooth: GROUP(bad), GROUP, REUSE; mcsparse: ANCHOR(bad), ANCHOR, REUSE
    outs = run_op(*clean, name, steps=3, inputs=steps, group_fraction=0.5)
    check_poisoned(name, outs, bad_in, clean)


# Interpreter time (~11 s a case on CPU): a pairwise cover of method x tensor x NaN/Inf, not the 24-case
# product -- every method with q, k and v poisoned and with both NaN and an Inf; every (tensor, value)
# pair of the reference test above under two methods (NaN for vsmooth/naive on q, v and expcast/mcsparse
# on k; an Inf otherwise).
NONFINITE_KERNEL_CASES = [(n, w, ("nan" if (i + j) % 2 == 0 else "-inf" if w == "k" else "inf"))
                          for i, n in enumerate(["vsmooth", "expcast", "naive", "mcsparse"])
                          for j, w in enumerate("qkv")]


@pytest.mark.parametrize("name,which,bad", NONFINITE_KERNEL_CASES)
def test_nonfinite_element_kernels(name, which, bad):
    """Regression (8-bit kernels, was an xfail): kernels/preprocess.py dropped NaN (tl.max / atomic_max
    ignore it), so a NaN in q/k/v gave a finite wrong result where SDPA gives NaN. Now a non-finite
    input makes its scale NaN: q row -> that row, K -> the head, V channel -> that column (SDPA's
    pattern; +-Inf K: the whole head, where SDPA has NaN on the rows whose logit is +Inf)."""
    dev = kernels_param(name, "triton")
    bad_in, clean = poisoned(which, BADS[bad], S=130, device=dev)
    outs = run_op(*clean, name, steps=3, inputs=[bad_in, clean, clean], kernels="triton", group_fraction=0.5)
    check_poisoned(name, outs, bad_in, clean, kernels="triton")
    if name in EIGHT_BIT:  # exactly SDPA's non-finite pattern (rows for q, columns for v, all for NaN k)
        stock = F.scaled_dot_product_attention(*bad_in)
        o = outs[0]
        if which == "k" and bad != "nan":
            assert (~torch.isfinite(o[1, 0])).all()
        else:
            assert torch.equal(~torch.isfinite(o), ~torch.isfinite(stock))


def test_nan_centroids_do_not_steer_the_next_grouping():
    """Regression: a NaN V at a GROUP step left NaN centroids in the metadata and the next step's warm
    start assigned every row to that cluster. Now a non-finite centroid is re-seeded from the current V,
    so the step after a NaN step groups exactly like a cold start on its clean V would."""
    from vc_compile.methods.vsmooth import VSmoothMeta, _warm_start
    from vc_compile.torch_ops import init_centroids

    _, _, v = gaussian(S=200)
    c = init_centroids(v, 2).clone()
    c[1, 0, 1, 5] = float("nan")
    w = _warm_start(c, v)
    assert torch.isfinite(w).all()
    assert torch.equal(w[0], c[0]) and torch.equal(w[1, 1], c[1, 1]) and torch.equal(w[1, 0, 0], c[1, 0, 0])
    assert torch.equal(w[1, 0, 1], init_centroids(v, 2)[1, 0, 1])
    # and through the op: the metadata after a NaN step is finite again one step later
    bad_in, clean = poisoned("v", float("nan"))
    site = new_site()
    run_op(*clean, "vsmooth", steps=3, inputs=[bad_in, clean, clean], group_fraction=1.0, site=site)
    metas = metas_of(site)
    assert metas and all(isinstance(m, VSmoothMeta) and torch.isfinite(m.centroids).all() for m in metas)


# ---- shapes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("S", [1, 5, 63, 129, 257])
def test_sequence_lengths(name, S):
    q, k, v = (t.bfloat16() for t in gaussian(B=1, S=S))
    assert_method_ok(name, run_op(q, k, v, name), q, k, v)


@pytest.mark.parametrize("name", [n for n in METHODS if n != "dense"])
@pytest.mark.parametrize("S", [1, 63, 129])
def test_sequence_lengths_kernels(name, S):
    """Every length is right; a single key (the H200's 8-bit kernels gave a non-finite output there) runs stock
    SDPA through the 8-bit methods, with the reason recorded."""
    dev = kernels_param(name, "triton")
    q, k, v = (t.to(dev, torch.bfloat16) for t in gaussian(B=1, H=1, S=S))
    site = new_site(name)
    assert_method_ok(name, run_op(q, k, v, name, kernels="triton", site=site), q, k, v, kernels="triton")
    single = _report.site(site).runtime_fallbacks["a single key: the 8-bit kernels need 2 or more"]
    assert single == (2 if S == 1 and name in EIGHT_BIT else 0)


@pytest.mark.parametrize("name", list(METHODS))
def test_batch_rows_and_heads_are_independent(name):
    """Each (b, h) output is what the op gives for that slice alone (B = 3, different content per row):
    no statistic, scale or selection is shared across batch rows or heads."""
    q, k, v = (t.bfloat16() for t in case_batch_rows_differ())
    full = run_op(q, k, v, name)
    for b in range(3):
        for h in range(2):
            sl = (slice(b, b + 1), slice(h, h + 1))
            part = run_op(q[sl].clone(), k[sl].clone(), v[sl].clone(), name)
            for o_full, o_part in zip(full, part):
                e = head_err(o_full[sl], o_part.float(), v[sl]).max().item()
                assert e <= 2 * U[torch.bfloat16], f"b={b} h={h}: {e}"


@pytest.mark.parametrize("name", list(METHODS))
def test_single_head(name):
    q, k, v = (t.bfloat16() for t in gaussian(B=2, H=1, S=180))
    assert_method_ok(name, run_op(q, k, v, name), q, k, v)


def strided_inputs(device="cpu"):
    """Non-contiguous layouts: q a permuted [B, S, H, D] view, k with a non-unit last stride (transposed
    [B, H, D, S] storage), v a slice of a wider tensor."""
    g = _g(5)
    q = torch.randn(2, 150, 2, 64, generator=g).to(device, torch.bfloat16).permute(0, 2, 1, 3)
    k = torch.randn(2, 2, 64, 150, generator=g).to(device, torch.bfloat16).transpose(-1, -2)
    v = torch.randn(2, 2, 150, 128, generator=g).to(device, torch.bfloat16)[..., 32:96]
    assert not q.is_contiguous() and k.stride(-1) != 1 and not v.is_contiguous()
    return q, k, v


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("name", list(METHODS))
def test_non_contiguous_inputs(name, kernels):
    if kernels == "triton" and name in ("dense", "expcast"):
        pytest.skip("dense has no kernel; expcast shares vsmooth's memory access")
    dev = kernels_param(name, kernels)
    q, k, v = strided_inputs(dev)
    assert_method_ok(name, run_op(q, k, v, name, kernels=kernels), q, k, v, kernels=kernels)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("Sq,Sk", [(100, 300), (300, 70)])
def test_cross_attention_lengths(name, Sq, Sk):
    """Sq != Sk: the reference runs every method (V-Smooth clusters the Sk value rows; MC-Sparse selects
    among Sk keys)."""
    q, k, v = (t.bfloat16() for t in gaussian(B=1, S=Sq, Sk=Sk))
    assert_method_ok(name, run_op(q, k, v, name), q, k, v)


@pytest.mark.parametrize("name", ["vsmooth", "mcsparse"])
def test_cross_attention_lengths_kernels(name):
    """Regression: the 8-bit Triton preprocessing needs Sq == Sk and raised ValueError inside the op;
    now such a call runs stock SDPA with the reason recorded. MC-Sparse's kernels take Sk != Sq."""
    dev = kernels_param(name, "triton")
    q, k, v = (t.to(dev, torch.bfloat16) for t in gaussian(B=1, H=1, S=70, Sk=130))
    site = new_site(name)
    outs = run_op(q, k, v, name, kernels="triton", site=site)
    assert_method_ok("dense" if name == "vsmooth" else name, outs, q, k, v, kernels="triton")
    rec = _report.site(site)
    if name == "vsmooth":
        assert rec.runtime_fallbacks["cross-attention (Sq != Sk) unsupported by the 8-bit kernels"] == 2
    else:  # the Triton gather kernel, or the Gluon one on an sm_90 GPU
        assert not rec.runtime_fallbacks and sum(rec.kernel_path.values()) == 2
        assert all(p.startswith("triton") for p in rec.kernel_path), rec.kernel_path


@pytest.mark.parametrize("desc,shapes,dtype,reason", [
    ("empty batch", ((0, 2, 130, 64),) * 3, torch.bfloat16, "empty input"),
    ("Dv != D", ((1, 2, 130, 64), (1, 2, 130, 64), (1, 2, 130, 128)), torch.bfloat16, "head_dim unsupported"),
    ("fp32", ((1, 2, 130, 64),) * 3, torch.float32, "dtype unsupported"),
    ("gqa", ((1, 4, 130, 64), (1, 2, 130, 64), (1, 2, 130, 64)), torch.bfloat16, "gqa or shape mismatch"),
])
@pytest.mark.parametrize("name", ["vsmooth", "mcsparse"])
def test_direct_call_outside_the_contract_falls_back(name, desc, shapes, dtype, reason):
    """Regression: an empty batch crashed every method (``max()`` of an empty tensor, a reshape of 0
    elements); inputs the rewrite never sends (other dtypes, Dv != D, GQA) reached the kernels. All now
    run stock SDPA (its result or its own error) with the reason recorded."""
    q, k, v = (torch.randn(*s).to(dtype) for s in shapes)
    site = new_site(name)
    try:
        stock = F.scaled_dot_product_attention(q, k, v)
    except RuntimeError as e:  # SDPA refuses it too: so must we, with the same error
        with pytest.raises(RuntimeError, match=re.escape(str(e)[:30])):
            run_op(q, k, v, name, steps=1, site=site)
    else:
        out = run_op(q, k, v, name, steps=1, site=site)[0]
        assert torch.equal(out, stock)
    assert _report.site(site).runtime_fallbacks[reason] == 1


# ---- groupings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clusters,kernels", [(0, "reference"), (16, "reference"), (1000, "reference"),
                                              (16, "triton")])
def test_kmeans_fewer_distinct_rows_than_clusters(clusters, kernels):
    """3 distinct V rows, 2 or 16 (or 1000 > Sk) clusters: empty clusters keep their centroid, nothing
    NaN, warm starts work; more clusters than keys are capped at Sk."""
    dev = kernels_param("vsmooth", kernels)
    q, k, _ = gaussian(B=1, S=130)
    v = torch.randn(1, 2, 3, 64, generator=_g(7)).repeat_interleave(50, dim=2)[:, :, :130]
    q, k, v = (t.to(dev, torch.bfloat16) for t in (q, k, v))
    site = new_site()
    outs = run_op(q, k, v, "vsmooth", steps=3, kernels=kernels, kmeans_clusters=clusters,
                  group_fraction=1.0, site=site)
    assert_method_ok("vsmooth", outs, q, k, v, kernels=kernels)
    metas = metas_of(site)
    assert metas and all(torch.isfinite(m.centroids).all() for m in metas)
    assert all(m.centroids.shape[2] <= 130 for m in metas)
    for m in metas:
        assert torch.equal(torch.sort(m.perm, dim=-1).values.cpu(), torch.arange(130).expand(1, 2, 130))


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_pddp_duplicate_queries(kernels):
    """Every query identical: the principal direction is 0, sigma must still be a permutation."""
    dev = kernels_param("mcsparse", kernels)
    q, k, v = gaussian(B=1, S=200)
    q = q[:, :, :1].expand(-1, -1, 200, -1).contiguous()
    q, k, v = (t.to(dev, torch.bfloat16) for t in (q, k, v))
    site = new_site()
    outs = run_op(q, k, v, "mcsparse", kernels=kernels, site=site)
    assert_method_ok("mcsparse", outs, q, k, v, kernels=kernels)
    metas = metas_of(site)
    assert metas
    for m in metas:
        assert torch.equal(torch.sort(m.sigma, dim=-1).values.cpu(), torch.arange(200).expand(1, 2, 200))


@pytest.mark.parametrize("residual", ["bf16", "none"])
@pytest.mark.parametrize("Sk", [50, 200])
def test_density_below_one_tile(Sk, residual):
    """density 1e-4: fewer keys than one 64-key tile -> one tile (or all Sk < 64 keys) is kept."""
    q, k, v = (t.bfloat16() for t in gaussian(B=1, S=150, Sk=Sk))
    site = new_site()
    outs = run_op(q, k, v, "mcsparse", density=1e-4, residual=residual, site=site)
    metas = metas_of(site)
    assert metas and metas[0].idx.shape[-1] * metas[0].run == min(64, Sk)  # keys kept (entries x keys a run)
    assert all(torch.isfinite(o).all() for o in outs)
    if residual == "bf16" or Sk <= 64:
        assert_method_ok("mcsparse", outs, q, k, v)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_density_one_equals_dense(kernels):
    """density 1.0 keeps every key: the sparse output alone (no residual) is dense attention, within 2x
    stock SDPA's own error plus one bf16 rounding of P."""
    dev = kernels_param("mcsparse", kernels)
    q, k, v = (t.to(dev, torch.bfloat16) for t in gaussian(B=1, S=150))
    outs = run_op(q, k, v, "mcsparse", kernels=kernels, density=1.0, residual="none", steps=3)
    ref = ref_sdpa(q, k, v)
    stock = head_err(F.scaled_dot_product_attention(q, k, v), ref, v).max().item()
    # + U: the gather kernel feeds P to the PV product in V's 16-bit type (as FlashAttention does on GPUs),
    # one bf16 rounding more than CPU SDPA, which keeps P in fp32
    for o in outs:
        assert head_err(o, ref, v).max() <= 2 * stock + U[torch.bfloat16]


@pytest.mark.parametrize("sched,expect", [
    (dict(anchor_steps=()), {"dense": 2, "anchor": 1, "reuse": 7}),
    (dict(anchor_interval=1), {"dense": 2, "anchor": 8}),
    (dict(anchor_steps=tuple(range(10)), warmup_steps=0), {"anchor": 10}),
])
def test_anchor_schedules(sched, expect):
    """``anchor_steps=()``: no scheduled anchor, so the first step without metadata (right after the
    warm-up) anchors once and every later step reuses it. An anchor on every step: every step returns
    O_dense."""
    q, k, v = (t.bfloat16() for t in gaussian(B=1, S=150))
    site = new_site()
    # stock-SDPA warm-up: TOL_REUSE bounds the sparse steps; the V-Smooth warm-up's 8-bit error on these tiny
    # Gaussian inputs (0.035) is V-Smooth's, tested in its own files
    cj = VCConfig.from_options({"method": "mcsparse", "min_seq_len": 1, "experimental": {"kernels": "reference"},
                                "density": 0.3, "warmup_attention": "sdpa", **sched}).to_json()
    ref = ref_sdpa(q, k, v)
    with vc_compile.sampling(num_steps=10):
        for i in range(10):
            vc_compile.step(i)
            o = torch.ops.vcattn.attention(q, k, v, None, site, cj, None)
            assert head_err(o, ref, v).max() <= TOL_REUSE
    assert dict(_report.site(site).phases) == expect


# ---- through torch.compile ----------------------------------------------------------------------------------
def compiled_tiny(method, dtype=torch.bfloat16, seq=256, zero_q_block=None, **opts):
    import tiny_dit

    m, x, ctx = tiny_dit.make(dtype=dtype, seq=seq)
    if zero_q_block is not None:
        with torch.no_grad():
            m.blocks[zero_q_block].q.weight.zero_()
            m.blocks[zero_q_block].q.bias.zero_()
    options = {**METHODS[method], "min_seq_len": 64, **opts}
    options["experimental"] = {**options.get("experimental", {}), "compiler": "eager", "kernels": "reference"}
    cm = torch.compile(m, backend="vcattn", options=options)
    return m, cm, x, ctx


@pytest.mark.parametrize("method,dtype,seq,zero_q", [
    ("vsmooth", torch.bfloat16, 129, None),  # S one more than a tile multiple
    ("mcsparse", torch.float16, 200, None),  # fp16 model
    ("vsmooth", torch.bfloat16, 256, 0),  # a block whose q projection is zero (zero Q heads)
    ("naive", torch.float16, 129, 1),
])
def test_compiled_tiny_dit(method, dtype, seq, zero_q):
    """End to end through the backend (eager compiler): the rewritten model stays finite and close to the
    uncompiled one (hidden states: the attention error is diluted by the residual stream)."""
    before = {s.site for s in vc_compile.report().sites}
    m, cm, x, ctx = compiled_tiny(method, dtype, seq, zero_q)
    with torch.no_grad(), vc_compile.sampling(num_steps=2):
        ref = m.float()(x.float(), ctx.float())
        m.to(dtype)
        for i in range(2):
            vc_compile.step(i)
            y = cm(x, ctx)
            assert torch.isfinite(y).all()
            rel = ((y.float() - ref).norm() / ref.norm()).item()
            assert rel <= 0.03, f"step {i}: {rel}"
    mine = [s for s in vc_compile.report().sites if s.site not in before]
    rewritten = [s for s in mine if s.rewritten]
    assert len(rewritten) == 2 and len(mine) == 4  # self-attention rewritten, cross-attention (Sk=7) not
    assert all(s.calls == 2 and not s.runtime_fallbacks for s in rewritten)


# ---- options and environment ----------------------------------------------------------------------------------
def test_an_aten_level_sdpa_call_is_rewritten(fresh_vcattn):
    """A model calling torch.ops.aten.scaled_dot_product_attention itself (its overload packet in the graph) was
    left stock, with a warning that blamed "another kernel" named scaled_dot_product_attention."""
    from torch._dynamo.utils import counters

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.aten.scaled_dot_product_attention(q, k, v)
    q, k, v = (torch.randn(1, 2, 128, 64).to(torch.bfloat16) for _ in range(3))
    out = torch.compile(M(), backend="vcattn", options={"min_seq_len": 1, "experimental": {"kernels": "reference"}})(
        q, k, v)
    assert counters["vcattn"]["rewrite"] == 1 and not vc_compile.report().graphs_without_sdpa
    assert rel_l2(out, F.scaled_dot_product_attention(q, k, v)) < 0.08  # the 8-bit tolerance (module doc)


def test_enable_on_a_module_without_attention_says_so():
    """enable(nn.Linear(...)) compiled silently before: now one warning says nothing there looks like attention;
    a model with attention (a module named so, or SDPA in its code) gets none."""
    import warnings

    import tiny_dit
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        vc_compile.enable(torch.nn.Linear(4, 4))
        vc_compile.enable(tiny_dit.make()[0])
        vc_compile.enable(torch.nn.TransformerEncoderLayer(8, 2))
    said = [str(x.message) for x in w if "vc_compile.enable" in str(x.message)]
    assert len(said) == 1 and "Linear" in said[0] and "no attention" in said[0], said


@pytest.mark.parametrize("options,key", [
    ("vsmooth", "options must be a (VCConfig or a )?dict"),
    ({"anchor_steps": [1.5]}, "anchor_steps"),
    ({"anchor_steps": ["3"]}, "anchor_steps"),
    ({"anchor_steps": [True, 5]}, "anchor_steps"),
    ({"head_dims": [64.5]}, "head_dims"),
    ({"residual_budget_gb": float("nan")}, "residual_budget_gb"),
    ({"residual_budget_gb": 0}, "residual_budget_gb"),
    ({"hadamard": True, "head_dims": (64, 96)}, "hadamard"),
    ({"method": ["vsmooth"]}, "method"),
    ({"density": float("nan")}, "density"),
    ({"group_fraction": float("inf")}, "group_fraction"),
    ({"experimental": {"kmeans_init_iters": 0}}, "kmeans_init_iters"),
    ({"smooth_v": False}, "experimental"),
    ({"sparse_qk": "int4"}, "sparse_qk"),
    ({"group_size": 96}, "group_size"),
])
def test_bad_options_fail_at_compile_time(options, key):
    """Regression for the first eight: a non-dict ``options`` failed with "dictionary update sequence";
    ``anchor_steps=[1.5]`` / ``["3"]`` / ``[True]`` and ``head_dims=[64.5]`` were silently truncated by
    int(); ``residual_budget_gb=nan`` was accepted and crashed int(nan) in the first anchor step;
    ``hadamard`` with a non-power-of-two head dim crashed inside the op."""
    with pytest.raises(VCConfigError, match=key):
        VCConfig.from_options(options)
    cm = torch.compile(torch.nn.Linear(4, 4), backend="vcattn", options=options)
    with pytest.raises(Exception, match=key):
        cm(torch.randn(2, 4))


def test_residual_budget_inf_means_no_limit():
    """Regression: ``residual_budget_gb=float('inf')`` passed validation, then int(inf) raised
    OverflowError in the first anchor step."""
    import numpy as np

    cfg = VCConfig.from_options({"residual_budget_gb": float("inf"), "anchor_steps": np.array([0, 2])})
    assert cfg.anchor_steps == (0, 2) and VCConfig.from_json(cfg.to_json()) == cfg
    q, k, v = (t.bfloat16() for t in gaussian(B=1, S=150))
    assert_method_ok("mcsparse", run_op(q, k, v, "mcsparse", residual_budget_gb=float("inf")), q, k, v)


def test_sparse_qk_fp8_on_the_reference_path():
    """Regression: ``sparse_qk="fp8"`` passed ``qk_format`` to the 16-bit reference kernel (TypeError in
    every reuse step on CPU); the reference path now runs ``reference/sparse_attn_q8.py``."""
    if importlib.util.find_spec("vc_compile.reference.sparse_attn_q8") is None:
        pytest.skip("vc_compile/reference/sparse_attn_q8.py not written yet")
    q, k, v = (t.bfloat16() for t in gaussian(B=1, S=150))
    outs = run_op(q, k, v, "mcsparse", sparse_qk="fp8")
    assert_method_ok("mcsparse", outs, q, k, v)


def test_sparse_qk_int8_on_the_reference_path_and_refused_off_sm90():
    """``sparse_qk="int8"`` (the sm_90 gather kernel's 8-bit QK): the reference path runs its contract
    (``reference/sparse_attn_q8.sparse_attention_qk8``, per-head int8 K); a Triton call anywhere but the sm_90
    kernel is refused with the reason and the fix, never run in another format."""
    q, k, v = (t.bfloat16() for t in gaussian(B=1, S=150))
    outs = run_op(q, k, v, "mcsparse", sparse_qk="int8")
    assert_method_ok("mcsparse", outs, q, k, v)
    sig = torch.arange(150).view(1, 1, 150).expand(1, q.shape[1], 150).contiguous()
    idx = torch.arange(64, dtype=torch.int32).view(1, 1, 1, 64).expand(1, q.shape[1], 2, 64).contiguous()
    with pytest.raises(RuntimeError, match="sparse_qk='int8'.*sm_90.*sparse_qk='bf16'"):
        dispatch.sparse_attention(dispatch.Impl.TRITON, q, k, v, sig, idx, sm_scale=0.1, group_size=128,
                                  qk_format="int8")


@contextlib.contextmanager
def fresh_resolve_caches():
    caches = (dispatch.triton_error, dispatch._warn_once, dispatch._capability)
    for c in caches:
        c.cache_clear()
    try:
        yield
    finally:
        for c in caches:
            c.cache_clear()


CUDA = torch.device("cuda")


def choose(method, cfg, device):
    """dispatch's choice for one op call of ``method`` with ``cfg`` (what ``ops.attention`` asks)."""
    return dispatch.choose(method, cfg.experimental.kernels, methods.get(cfg.resolved_method).needs_fp8(cfg), device)


def test_gpu_without_fp8_falls_back_with_a_warning(monkeypatch):
    """Simulated sm_80: V-Smooth (FP8 PV) runs the reference with a warning, not a crash; MC-Sparse with
    bf16 QK needs no FP8 and keeps its kernels (before: it was sent to the slow reference too); forcing
    kernels='triton' where FP8 is needed is a clear error."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with fresh_resolve_caches():
        with pytest.warns(RuntimeWarning, match="no FP8"):
            impl, path = choose("vsmooth", VCConfig(), CUDA)
        assert path == "reference" and impl == dispatch.Impl.REFERENCE
        if dispatch.triton_error() is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert choose("mcsparse", VCConfig(method="mcsparse"), CUDA)[1] == "triton"
        with pytest.warns(RuntimeWarning, match="no FP8"):
            assert choose("mcsparse", VCConfig(method="mcsparse", sparse_qk="fp8"), CUDA)[1] == "reference"
        with pytest.raises(RuntimeError, match="no FP8"):
            choose("vsmooth", VCConfig(experimental={"kernels": "triton"}), CUDA)


def test_without_triton_falls_back_with_a_warning(monkeypatch):
    """Simulated install without Triton (import fails) on an FP8 GPU: the reference, one warning naming
    the import error; kernels='triton' is a clear error."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "triton", None)
    pkg = sys.modules["vc_compile.kernels"]
    for name in list(sys.modules):
        if name.startswith("vc_compile.kernels."):
            monkeypatch.delitem(sys.modules, name)
            # also the package's attribute: `from vc_compile.kernels import kmeans` returns it without an
            # import once an earlier test imported the kernels (test order must not matter)
            monkeypatch.delattr(pkg, name.rsplit(".", 1)[1], raising=False)
    with fresh_resolve_caches():
        for method in ("vsmooth", "mcsparse"):
            with pytest.warns(RuntimeWarning, match="kernels unavailable.*(ModuleNotFound|Import)Error"):
                impl, path = choose(method, VCConfig(method=method), CUDA)
            assert impl == dispatch.Impl.REFERENCE and path.startswith("reference")
            with pytest.raises(RuntimeError, match="failed to load"):
                choose(method, VCConfig(method=method, experimental={"kernels": "triton"}), CUDA)


def test_forced_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        choose("vsmooth", VCConfig(experimental={"kernels": "triton"}), torch.device("cpu"))


# ---- MC-Sparse across blocks: a cached selection never reaches another block ----------------------------
class DequantLinear(torch.nn.Module):
    """A q projection that stores its weight as INT8 codes + per-row scales and dequantises them inside
    ``forward`` before ``F.linear`` (the pattern of diffusers' GGUF linears)."""

    def __init__(self, lin):
        super().__init__()
        w = lin.weight.detach().float()
        s = w.abs().amax(1, keepdim=True) / 127
        self.weight = torch.nn.Parameter((w / s).round().to(torch.int8), requires_grad=False)
        self.scale = torch.nn.Parameter(s, requires_grad=False)
        self.bias = lin.bias

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.scale.to(x.dtype), self.bias)


MCS_BLOCKS = {"method": "mcsparse", "min_seq_len": 64, "warmup_steps": 0, "density": 0.3,
              "experimental": {"compiler": "eager", "kernels": "reference"}}


def tiny_blocks(layers=3, dequant=False):
    import tiny_dit

    m, x, ctx = tiny_dit.make(seq=256, layers=layers)
    if dequant:
        for b in m.blocks:
            b.q = DequantLinear(b.q)
    return m, x, ctx


def run_blocks(m, x, ctx, steps, skip=lambda step, i: False, before_step=None):
    """Per step, every block's output on the same input ``x`` (a block with ``skip(step, block)`` is not
    called: block caching, skip-layer guidance), as the worst rel. L2 against its uncompiled forward. The
    same input each step keeps an MC-Sparse reuse step within a few 1e-3 of exact on its own block's
    metadata; another block's selection and residual are far off."""
    errs = []
    with torch.no_grad(), vc_compile.sampling(num_steps=steps):
        for s in range(steps):
            if before_step is not None:
                before_step(s)
            vc_compile.step(s)
            worst = 0.0
            for i, b in enumerate(m.blocks):
                if not skip(s, i):
                    y = b(x, ctx, m.cos, m.sin)
                    r = b.forward(x, ctx, m.cos, m.sin)  # uncompiled: Module.compile wraps __call__ only
                    worst = max(worst, rel_l2(y - x, r - x))
            errs.append(worst)
    return errs


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dequant", [False, True], ids=["nn.Linear", "dequantising-linear"])
def test_mcsparse_regional_blocks_skipped_keep_their_own_metadata(fresh_vcattn, dequant):
    """Regression: a regionally compiled block whose q projection dequantises its weight in ``forward`` had no
    block identity, so blocks were told apart by call order only; skipping a block from step 2 on (block
    caching, skip-layer guidance) gave the next block its selection and residual (block-output rel. L2
    0.2-0.3). The weight is now followed back to its stored parameter: every block keys its own metadata."""
    m, x, ctx = tiny_blocks(dequant=dequant)
    for b in m.blocks:
        b.compile(backend="vcattn", options=MCS_BLOCKS)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*MC-Sparse.*")
        errs = run_blocks(m, x, ctx, 6, skip=lambda s, i: s >= 2 and i == 0)
    rw = [s for s in vc_compile.report().rewritten if "Sk" not in s.shape]
    assert rw and all(s.has_identity and not s.runtime_fallbacks for s in rw)
    assert sum(s.phases["reuse"] for s in rw) > 0
    assert max(errs) <= 0.02, errs


def test_mcsparse_refuses_a_shared_attention_function_without_identity(fresh_vcattn):
    """Regression: one compiled attention function called by several layers (q, k, v its inputs: no q
    projection in the graph, ``has_identity=False``) kept the layers apart by call order; with one layer
    skipped from step 2 on the next layer got its selection (rel. L2 5e-2) and nothing warned. Now the site
    refuses MC-Sparse: stock SDPA, bit for bit, a warning naming the fix, the reason in the report."""
    attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend="vcattn",
                           options=MCS_BLOCKS)
    layers = [tuple(t.bfloat16() for t in gaussian(B=1, S=256, seed=s)) for s in range(3)]
    with pytest.warns(RuntimeWarning, match="Fix: compile the block.*no block identity"), \
            torch.no_grad(), vc_compile.sampling(num_steps=6):
        for s in range(6):
            vc_compile.step(s)
            for i, (q, k, v) in enumerate(layers):
                if s >= 2 and i == 1:
                    continue
                assert torch.equal(attend(q, k, v), F.scaled_dot_product_attention(q, k, v))
    (rec,) = vc_compile.report().rewritten
    assert not rec.has_identity and rec.runtime_fallbacks["mcsparse: no block identity"] == 3 * 2 + 2 * 4
    assert not rec.phases and not metas_of(rec.site)


@pytest.mark.parametrize("how", ["copy", "new-parameter"])
def test_mcsparse_refuses_weights_in_alternating_staging_buffers(fresh_vcattn, how):
    """Regression: weights copied into two staging buffers that alternate between steps (an allocator reusing
    addresses under CPU offloading) made one block's address name the other block at the next step: rel. L2
    0.37 on every other step. A weight replaced or overwritten in place at an address seen before is now
    detected: the site refuses MC-Sparse (stock SDPA, warning, report reason) and every step is right."""
    m, x, ctx = tiny_blocks(layers=2)
    own = [b.q.weight.detach().clone() for b in m.blocks]
    bufs = [torch.nn.Parameter(torch.empty_like(own[0]), requires_grad=False) for _ in range(2)]

    def stage(s):
        for i, b in enumerate(m.blocks):
            buf = bufs[(i + s) % 2]
            with torch.no_grad():
                buf.copy_(own[i])
            b.q.weight = buf if how == "copy" else torch.nn.Parameter(buf.data, requires_grad=False)

    stage(0)
    for b in m.blocks:
        b.compile(backend="vcattn", options=MCS_BLOCKS)
    with pytest.warns(RuntimeWarning, match="block identity unstable|replaced or overwritten.*offloading"):
        errs = run_blocks(m, x, ctx, 6, before_step=stage)
    assert max(errs) <= 0.02, errs
    rw = [s for s in vc_compile.report().rewritten if "Sk" not in s.shape]
    assert sum(s.runtime_fallbacks["mcsparse: block identity unstable"] for s in rw) > 0


# ---- sharp attention: the 8-bit paths step aside where their error would be high ------------------------
def sharp(std, S=256, D=64, seed=0):
    """Random q, k, v whose logits have std ``std`` (q scaled), bf16."""
    q, k, v = gaussian(B=1, S=S, D=D, seed=seed)
    return tuple(t.bfloat16() for t in (q * std, k, v))


@pytest.mark.parametrize("name", ["vsmooth", "expcast"])
def test_sharp_logits_stay_stock_with_a_reason(name, monkeypatch):
    """Regression: at logit std 50 the 8-bit path's error is 0.08 rel. L2 (0.04 at unit logits) and nothing said
    so. Now a site whose sampled logits have a std above ``max_logit_std`` (32) runs stock SDPA, bit for bit,
    with one warning and the reason in the report; the reading is taken once per site and shape."""
    from vc_compile import ops

    calls = []
    real = ops.logit_std
    monkeypatch.setattr(ops, "logit_std", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = sharp(50)
    site = new_site(name)
    with pytest.warns(RuntimeWarning, match=r"logits have std 5\d\.\d > max_logit_std=32.*max_logit_std': 0"):
        outs = run_op(q, k, v, name, steps=3, site=site)
    stock = F.scaled_dot_product_attention(q, k, v)
    assert all(torch.equal(o, stock) for o in outs)
    rec = _report.site(site)
    assert rec.runtime_fallbacks[ops.SHARP] == 3 and not rec.phases and len(calls) == 1
    # unit-variance logits: the 8-bit path, no warning
    q1, k1, v1 = sharp(1)
    site1 = new_site(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_op(q1, k1, v1, name, site=site1)
    assert not _report.site(site1).runtime_fallbacks and sum(_report.site(site1).phases.values()) == 2


def test_sharp_logits_check_can_be_forced_off():
    q, k, v = sharp(50)
    site = new_site("vsmooth")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = run_op(q, k, v, "vsmooth", site=site, max_logit_std=0)
    assert not _report.site(site).runtime_fallbacks and _report.site(site).phases["group"] >= 1
    assert not torch.equal(outs[0], F.scaled_dot_product_attention(q, k, v))


def test_sharp_logits_mcsparse_warmup_runs_stock():
    """MC-Sparse's V-Smooth warm-up steps become stock SDPA on a sharp site; its sparse steps (16-bit) stay."""
    q, k, v = sharp(50)
    site = new_site("mcsparse")
    with pytest.warns(RuntimeWarning, match="max_logit_std"):
        run_op(q, k, v, "mcsparse", steps=4, site=site, warmup_steps=2, anchor_steps=(2,))
    rec = _report.site(site)
    assert rec.phases == {"dense": 2, "anchor": 1, "reuse": 1}, rec.phases


def test_logit_std_estimate_and_predicted_error():
    from vc_compile import ops

    for std in (1, 10, 50):
        q, k, _ = sharp(std, S=512)
        assert abs(ops.logit_std(q, k, 64 ** -0.5) / std - 1) < 0.15
    assert ops.predicted_error(1) == 0.037 and ops.predicted_error(1000) == 0.108
    assert 0.057 < ops.predicted_error(30) < 0.071
    bad = sharp(1)[0].clone()
    bad[0, 0, 0, 0] = float("inf")
    assert ops.logit_std(bad, sharp(1)[1], 0.125) < 2  # non-finite rows do not count


# ---- the non-finite contract, stated and counted ---------------------------------------------------------
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_nonfinite_key_contract_reference(name, bad):
    """The documented contract (docs/usage.md, 'Non-finite inputs'; ``ops.NONFINITE_CONTRACT``): one NaN/+-Inf in a
    key makes its whole (batch, head) NaN on the 8-bit paths -- a superset of SDPA's non-finite outputs (the
    rows whose logit with that key is +Inf or NaN: about half the rows here) -- and nothing else. Before: the
    same outputs, but nothing said so; now the site counts ``nonfinite_calls`` and warns once, stating it."""
    (q, k, v), clean = poisoned("k", BADS[bad])
    site = new_site(name)
    with pytest.warns(RuntimeWarning, match="non-finite outputs: wherever stock SDPA's output is non-finite"):
        outs = run_op(*clean, name, steps=3, inputs=[(q, k, v), clean, clean], site=site, group_fraction=0.5)
    o, stock = outs[0], F.scaled_dot_product_attention(q, k, v)
    bad_o, bad_s = ~torch.isfinite(o), ~torch.isfinite(stock)
    assert bad_o[1, 0].all() and not bad_o[0].any() and not bad_o[1, 1].any()
    assert (bad_o | ~bad_s).all()  # every non-finite SDPA output is non-finite here too
    assert all(torch.isfinite(x).all() for x in outs[1:])
    assert _report.site(site).nonfinite_calls == 1


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("propagate", [False, True])
def test_mcsparse_reuse_contract_for_a_bad_key_no_group_selected(which, propagate):
    """The contract as stated (docs/usage.md, 'Non-finite inputs'): an MC-Sparse reuse step reads only the keys its query
    groups selected at the anchor, so by default a NaN in a key / value no group selected does not reach the
    output (finite where SDPA's is NaN: the real contract, said where the promise is made); with
    ``propagate_nonfinite=True`` SDPA's non-finite outputs are non-finite here too. Other heads stay clean."""
    g = torch.Generator().manual_seed(0)
    S, D = 160, 64
    u = torch.randn(D, generator=g)
    q, k, v = (torch.randn(2, 2, S, D, generator=g) for _ in range(3))
    q, k = q + u, k + u
    k[:, :, 7] = 0.0  # its logit (0) far below the others (~|u|^2 / 8): no group selects key 7
    clean = [t.to(torch.bfloat16) for t in (q, k, v)]
    bad = list(clean)
    i = "qkv".index(which)
    bad[i] = bad[i].clone()
    bad[i][1, 0, 7, 3] = float("nan")
    site = new_site("mcsparse")
    cj = VCConfig.from_options({"method": "mcsparse", "warmup_steps": 1, "anchor_steps": (1,), "density": 0.3,
                                "min_seq_len": 1, "propagate_nonfinite": propagate, "warmup_attention": "sdpa",
                                "experimental": {"kernels": "reference"}}).to_json()
    with vc_compile.sampling(num_steps=3):
        outs = []
        for step, x in enumerate([clean, clean, bad]):
            vc_compile.step(step)
            outs.append(torch.ops.vcattn.attention(*x, None, site, cj, None))
    assert dict(_report.site(site).phases) == {"dense": 1, "anchor": 1, "reuse": 1}
    reuse, stock = outs[2], F.scaled_dot_product_attention(*bad)
    assert (~torch.isfinite(stock))[1, 0].any()
    assert torch.isfinite(reuse[0]).all() and torch.isfinite(reuse[1, 1]).all()  # other heads clean
    if propagate:
        assert (~torch.isfinite(reuse) | torch.isfinite(stock)).all()
    else:
        assert torch.isfinite(reuse).all()


@pytest.mark.parametrize("scale", [1e3, 1e4])
def test_mcsparse_anchor_is_dense_at_extreme_scales(scale):
    """MC-Sparse's anchor step returns the dense output. At sm_scale 1e3 / 1e4 it was 5.8e-3 / 8.1e-2 off (bf16
    SDPA ~1e-4): the reference normalised its probabilities through the fp32 base-2 LSE, which at logits ~1e5 is
    one ulp (~0.5%) off. Normalised by the row sum (as the GPU's cuDNN / flash kernels do), it is SDPA's error."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    cj = VCConfig.from_options({"method": "mcsparse", "min_seq_len": 1, "warmup_steps": 0, "anchor_steps": (0,),
                                "density": 0.3, "experimental": {"kernels": "reference"}}).to_json()
    site = new_site("mcsparse")
    with vc_compile.sampling(num_steps=2):
        vc_compile.step(0)
        out = torch.ops.vcattn.attention(q, k, v, None, site, cj, scale)
    assert dict(_report.site(site).phases) == {"anchor": 1}
    truth = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    stock = F.scaled_dot_product_attention(q, k, v, scale=scale)
    rel = lambda a: float((a.double() - truth).norm() / truth.norm())  # noqa: E731
    assert rel(out) <= 2 * rel(stock) + 1e-5, (rel(out), rel(stock))


def test_sharp_logits_readings_are_bounded_per_site(monkeypatch):
    """Weights at ever new addresses (offloading) would make every call a new (site, block) key: after
    ``_SHARP_READINGS`` readings a site reuses its worst one instead of reading (and syncing) again."""
    from vc_compile import ops

    calls = []
    real = ops.logit_std
    monkeypatch.setattr(ops, "logit_std", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(ops, "_SHARP_READINGS", 3)
    q, k, v = sharp(50)
    cj, site = cfg_json("vsmooth"), new_site("vsmooth")
    idents = [torch.randn(4, 4) for _ in range(6)]  # kept alive: six addresses, six "blocks"
    with pytest.warns(RuntimeWarning, match="max_logit_std"), vc_compile.sampling(num_steps=2):
        vc_compile.step(0)
        for ident in idents:
            torch.ops.vcattn.attention(q, k, v, ident, site, cj, None)
    assert len(calls) == 3 and _report.site(site).runtime_fallbacks[ops.SHARP] == 6
