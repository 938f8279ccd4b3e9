"""ExpCast's accuracy (docs/methods.md): why its error grew with S, and the fix.

The cause, measured on the emulated kernel (vc_compile/reference/vsmooth_attn_sm90.py): a key far below the row
max gets ExpCast code 0 (u < -14.9 at the shipped offset 119.65) or a subnormal code 1-7 decoded linearly,
where exp2 + cast still keeps subnormals down to u = -18. Attention whose far field grows with S (video
latents: the local peak stays, the number of far tokens grows) loses a growing share of its mass there.
The fix: every 128-key block is quantised against its OWN maximum (floored at L = 32 below the running max),
not the running max; the accumulator recurrence takes alpha = 2^(r_{j-1} - r_j), which may exceed 1. No
instruction per score changes (per row and block: one FADD, one FMNMX).

Tolerances: ratios between variants on the same rows (the measurement noise of a ratio over 96-128 rows is
~3%); thresholds sit between the measured values quoted in each test.
"""
import functools
import math

import torch

from vc_compile import torch_ops
from vc_compile.formats import LOG2E
from vc_compile.reference import kmeans, preprocess
from vc_compile.reference import vsmooth_attn as ref_attn
from vc_compile.reference import vsmooth_attn_sm90 as emu

import fidelity_inputs as FI

L = 32.0  # the block reference floor below the running max


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def truth_rows(q, k, v, rows):
    s = (q[:, :, rows].double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, -1) @ v.double()


def prepared(q, k, v, n_rows=128, seed=0):
    S = q.shape[2]
    rows = torch.randperm(S, generator=torch.Generator().manual_seed(seed))[:n_rows].sort().values
    perm = kmeans.kmeans_perm(v, torch_ops.default_clusters(S), 3).perm
    qk = preprocess.preprocess_qk(q, k, perm, sm_scale=q.shape[-1] ** -0.5)
    vq = preprocess.preprocess_v(v, perm)
    return qk, vq, rows, truth_rows(q, k, v, rows)


def err(qk, vq, rows, truth, **kw):
    return rel(emu.attention(qk, vq, rows=rows, out_dtype=torch.float32, **kw), truth)


# ---- the cause and the fix --------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def far_case(S):
    """A few keys per query 16 octaves above all the others (tests/fidelity_inputs.py ``far_field``, groups of
    4): the far field's mass grows with S, as in video attention (docs/methods.md)."""
    q, k, v = FI.far_field(S, 128, 1, 0, group=4, gap=16.0)
    return prepared(q, k, v, n_rows=96)


def errors(S):
    qk, vq, rows, truth = far_case(S)
    return {name: err(qk, vq, rows, truth, **kw) for name, kw in (
        ("vs", dict(p_mode="exp2")), ("ec", dict(p_mode="expcast")),
        ("vs_b", dict(p_mode="exp2", block_ref=L)), ("ec_b", dict(p_mode="expcast", block_ref=L)))}


def test_expcast_error_grows_with_s_and_the_block_reference_removes_it():
    """Measured (96 rows): ExpCast / exp2 + cast 1.15 at S = 4096, 1.53 at 8192 (the issue's growth);
    with the block reference 1.005 and 1.004. exp2 + cast gains a little from it too (0.997 at both)."""
    e4, e8 = errors(4096), errors(8192)
    assert e8["ec"] / e8["vs"] > 1.3 and e8["ec"] / e8["vs"] > e4["ec"] / e4["vs"] + 0.2, (e4, e8)
    for e in (e4, e8):
        assert e["ec_b"] / e["vs_b"] < 1.05, e  # the target is 1.26, flat in S
        assert e["vs_b"] <= 1.01 * e["vs"], e
    assert e8["ec_b"] < 0.75 * e8["ec"]


def test_expcast_excess_is_the_tail_below_e4m3s_range():
    """Giving the keys whose code would be < 8 (u < -14) exp2 + cast's value instead removes most of ExpCast's
    excess (measured: 1% of it is left); the rest of ExpCast (mode 3 codes, the mantissa's linear decode, MS row
    sums) is a small part here."""
    qk, vq, rows, truth = far_case(8192)

    def tail_as_exp2(u, full):
        x = 8.0 * u + 119.65
        c = torch.floor(x + 0.5).clamp(min=0)
        return torch.where(x < 7.5, emu._e4m3(torch.exp2(u.double() + 8.0)), emu.decode_codes(c))

    e = errors(8192)
    e_mix = err(qk, vq, rows, truth, code_fn=tail_as_exp2)
    assert (e_mix - e["vs"]) < 0.2 * (e["ec"] - e["vs"]), (e, e_mix)


# ---- the recurrence behind the fix ------------------------------------------------------------------
def test_block_reference_recurrence_is_exact_without_rounding():
    """With unrounded P (2^u exactly) the block reference is only a change of units: same output to fp32."""
    q, k, v = FI.video(2000, 64, 1, 3, peak=14.0)
    qk = preprocess.preprocess_qk(q, k, None, sm_scale=0.125)
    vq = preprocess.preprocess_v(v, None)
    rows = torch.arange(0, 2000, 37)
    exact = lambda u, full: torch.exp2(u.double() + 8.0)  # noqa: E731
    a = emu.attention(qk, vq, rows=rows, code_fn=exact, acc_bits=23, rowsum="exact", out_dtype=torch.float32)
    b = emu.attention(qk, vq, rows=rows, code_fn=exact, acc_bits=23, rowsum="exact", out_dtype=torch.float32,
                      block_ref=L)
    assert rel(a, b) < 1e-6


def test_kernel_recurrence_with_alpha_above_one_stays_finite_and_exact():
    """The kernel folds acc = acc * alpha + PV_j, l = l * alpha + r_j in fp32 with alpha = 2^(r_{j-1} - r_j) <= 2^L.
    A row whose blocks sit 0, 40, 200 and 10 octaves under its max: the sequential fp32 recurrence equals the
    combined sum, the floor L keeps every alpha <= 2^32 and the accumulator far from fp32's range."""
    torch.manual_seed(0)
    nb, n = 4, 128
    block_max = torch.tensor([0.0, -40.0, -200.0, -10.0])
    s = block_max.repeat_interleave(n) - 6.0 * torch.rand(nb * n)  # base-2 logits, max 0 in block 0
    s[0] = 0.0
    v = torch.randn(nb * n, 8)
    m_run = torch.cummax(block_max, 0).values
    ref = torch.maximum(block_max, m_run - L)
    acc, l, r_prev = torch.zeros(8), torch.zeros(()), torch.tensor(float("-inf"))
    alphas = []
    for j in range(nb):
        sj = s[j * n:(j + 1) * n]
        p = torch.exp2(sj - ref[j] + 8.0).to(torch.float8_e4m3fn).float()  # P~ of block j, max ~256
        alpha = torch.exp2(r_prev - ref[j])
        alphas.append(alpha.item())
        acc = acc * alpha + p @ v[j * n:(j + 1) * n]
        l = l * alpha + p.sum()
        r_prev = ref[j]
    assert max(alphas) <= 2.0 ** L and torch.isfinite(acc).all() and acc.abs().max() < 1e30
    o = acc / l
    truth = torch.softmax(s.double() * math.log(2.0), 0) @ v.double()
    assert rel(o, truth) < 5e-2  # one row, FP8 P~ over 6 octaves: measured 2.4e-2 (block 2 is 2^-200: nothing)
    combined = sum(torch.exp2((ref[j] - ref[-1]).double()) * (torch.exp2(
        s[j * n:(j + 1) * n] - ref[j] + 8.0).to(torch.float8_e4m3fn).double() @ v[j * n:(j + 1) * n].double())
        for j in range(nb)) / sum(torch.exp2((ref[j] - ref[-1]).double()) * torch.exp2(
            s[j * n:(j + 1) * n] - ref[j] + 8.0).to(torch.float8_e4m3fn).double().sum() for j in range(nb))
    assert rel(o, combined) < 1e-6


def test_contract_reference_and_kernel_emulation_agree_with_the_block_reference():
    """reference/vsmooth_attn.py (final row max, the contract's oracle) and the emulated kernel (running max,
    mode 3 codes, MS row sums) quantise the same P~ under the block reference: they agree to 2e-4 (exp2) /
    5.5e-4 (ExpCast), against 7.4e-3 / 7.6e-3 from the fp32 truth."""
    q, k, v = FI.video(1500, 64, 2, 5, peak=16.0)
    qk = preprocess.preprocess_qk(q, k, None, sm_scale=0.125)
    vq = preprocess.preprocess_v(v, None)
    rows = torch.arange(0, 1500, 11)
    truth = truth_rows(q, k, v, rows)
    for expcast in (False, True):
        r = ref_attn.vsmooth_attention(qk, vq, expcast=expcast, out_dtype=torch.float32, block_ref=L)[:, :, rows]
        e = emu.attention(qk, vq, rows=rows, p_mode="expcast" if expcast else "exp2", block_ref=L,
                          out_dtype=torch.float32)
        assert rel(e, r) < 0.15 * rel(r, truth), (expcast, rel(e, r), rel(r, truth))


def test_reference_defaults_are_the_shipped_numerics():
    """Until the kernels change (docs/methods.md, kernel spec), the reference's defaults stay theirs."""
    s = torch.randn(2, 3, 300) * 6.0
    for expcast in (False, True):
        p0, _ = ref_attn.quantized_probs(s, expcast)
        p1, _ = ref_attn.quantized_probs(s, expcast, block_ref=None)
        assert torch.equal(p0, p1)
    u = -torch.rand(1000) * 20
    c = (8.0 * u + 119.65 + 0.5).floor().clamp(0, 120)
    from vc_compile.reference.quant import expcast_codes
    assert torch.equal(expcast_codes(u).float(), c)
    assert LOG2E > 1.44
