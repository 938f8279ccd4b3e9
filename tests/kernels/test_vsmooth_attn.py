"""Triton 8-bit attention (``kernels/vsmooth_attn.py``) against the reference and an fp32 truth.

The kernel is fed the *reference's* QKQuant / VQuant, so only the attention arithmetic is compared.

Why not code for code: the kernel rounds P~ = fp8(256 * 2^(s - m)) against the running row max of its
online softmax, the reference against the final max; the INT8 logits are converted with the 2^23 magic
(error < one unit of q8.k8 * scale). All are valid roundings of the same numbers: single P~ elements may
differ by one E4M3 step (<= 12.5%), which moves rows dominated by one key by up to ~1e-2. Tolerances:
* kernel vs reference: relative L2 <= 2e-2 (exp2 and ExpCast); measured <= 1.3e-2 on peaked inputs.
* kernel vs fp32 truth <= 1.25 x reference vs truth + 1e-3 (the "no worse than the reference" test).
* where the arithmetic is the same (one key block: online max = final max, fp32 output), >= 80% of the
  rows agree to 1e-5 (measured 90%; the rest have a logit within ~1e-4 -- the magic-number conversion's
  error, or the interpreter's unfused FMA -- of an E4M3 rounding boundary).
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import KERNEL_DEVICE, requires_cuda
from vc_compile.reference import kmeans as ref_km
from vc_compile.reference import preprocess as ref_pre
from vc_compile.reference import vsmooth_attn as ref
from vc_compile.kernels import configs as C
from vc_compile.kernels import dispatch
from vc_compile.kernels import vsmooth_attn as tpl
from vc_compile.kernels.configs import MeanTerm, RowSum


def launch(D, expcast, **over):
    """The Triton kernel's measured default for (D, expcast), with ``over`` fields replaced."""
    return dataclasses.replace(C.VSMOOTH_TRITON_DEFAULT[(D, bool(expcast))], **over)


def attn(qk, vq, expcast=False, **kw):
    """The Triton kernel (kernels/vsmooth_attn.py) at its measured default configuration."""
    return tpl.vsmooth_attention(qk, vq, expcast=expcast, launch=launch(qk.q8.shape[-1], expcast), **kw)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_qkv(B, H, S, D, dtype, device=KERNEL_DEVICE, seed=0):
    """Peaked attention, channel-biased K, clustered V (clusters in token runs) with token outliers
    (``benchmarks.common.run_clustered_inputs``, which scripts share)."""
    from benchmarks.common import run_clustered_inputs
    return run_clustered_inputs(B, H, S, D, dtype, device=device, seed=seed)


def truth_of(q, k, v):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()


def quantise(q, k, v, fmt="int8", smooth=True, perm=None):
    D = q.shape[-1]
    return (ref_pre.preprocess_qk(q, k, perm, sm_scale=D ** -0.5, qk_format=fmt),
            ref_pre.preprocess_v(v, perm, smooth=smooth))


CASES = [  # (S, D, fmt, smooth, expcast, out_dtype)
    (200, 64, "int8", True, False, torch.bfloat16),
    (200, 64, "int8", True, True, torch.float16),
    (300, 64, "int8", False, False, torch.float16),
    (300, 64, "fp8", True, True, torch.bfloat16),
    (300, 128, "int8", True, True, torch.bfloat16),
    (200, 128, "fp8", True, False, torch.bfloat16),
]


REF_TOL = 2e-2  # kernel vs reference, relative L2 (module doc)


@pytest.mark.parametrize("S,D,fmt,smooth,expcast,out_dtype", CASES)
@pytest.mark.parametrize("rowsum", [RowSum.FP32, RowSum.MMA, RowSum.FP16])
def test_matches_reference_and_truth(S, D, fmt, smooth, expcast, out_dtype, rowsum):
    B, H = 1, 2
    q, k, v = make_qkv(B, H, S, D, torch.bfloat16)
    qk, vq = quantise(q, k, v, fmt, smooth)
    o, lse = tpl.vsmooth_attention(qk, vq, expcast=expcast, out_dtype=out_dtype, return_lse=True,
                                   launch=launch(D, expcast, rowsum=rowsum))
    ro, rlse = ref.vsmooth_attention(qk, vq, expcast=expcast, out_dtype=out_dtype, return_lse=True)
    assert o.shape == ro.shape and o.dtype == out_dtype and lse.shape == rlse.shape
    assert torch.isfinite(o).all()
    assert rel(o, ro) <= REF_TOL
    truth = truth_of(q, k, v)
    assert rel(o, truth) <= 1.25 * rel(ro, truth) + 1e-3
    dl = (lse - rlse).abs()
    assert dl.max().item() <= 0.1 and dl.mean().item() <= 1e-2


@pytest.mark.skipif(KERNEL_DEVICE == "cuda", reason="arithmetic equivalence is an interpreter check")
@pytest.mark.parametrize("D", [64, 128])
def test_same_arithmetic_single_block(D):
    """S = 100 < BN: one (masked) key block, so the online max is the final max and the kernel's P~ is
    the reference's except at rounding boundaries. Exact row sums and mean term (fp32 row sums, FFMA mean):
    the defaults may use fp16 row sums / bf16 hi-lo means (2^-11 / 2^-16 relative) for speed."""
    q, k, v = make_qkv(1, 2, 100, D, torch.bfloat16)
    qk, vq = quantise(q, k, v)
    o = tpl.vsmooth_attention(qk, vq, out_dtype=torch.float32,
                              launch=launch(D, False, rowsum=RowSum.FP32, mean=MeanTerm.FFMA))
    ro = ref.vsmooth_attention(qk, vq, out_dtype=torch.float32)
    row = (o - ro).norm(dim=-1) / ro.norm(dim=-1)
    assert (row <= 1e-5).float().mean().item() >= 0.8
    assert row.max().item() <= 5e-2


@pytest.mark.parametrize("D,S,fmt,expcast,out_dtype", [
    (64, 200, "int8", False, torch.bfloat16), (64, 300, "int8", True, torch.float16),
    (128, 200, "fp8", False, torch.float16), (128, 300, "int8", True, torch.bfloat16)])
def test_per_token_q_scales_rows(D, S, fmt, expcast, out_dtype):
    """Per-token Q scales: the kernel applies each row's scale (folded into the exp2 / ExpCast FMA, or
    explicitly in the masked key tail) to its own row. Row norms spread over 10^[-1.5, 1.5] (scales
    differ ~1000x inside one BM tile; a row-for-row mix-up would cost O(1)); same tolerances as
    test_matches_reference_and_truth."""
    g = torch.Generator().manual_seed(4)
    q, k, v = make_qkv(1, 2, S, D, torch.bfloat16)
    q = (q.float().cpu() * 10.0 ** (3 * torch.rand(1, 2, S, 1, generator=g) - 1.5)).bfloat16().to(q.device)
    qk, vq = quantise(q, k, v, fmt)
    assert qk.q_scale.shape == (1, 2, S)
    o = attn(qk, vq, expcast=expcast, out_dtype=out_dtype)
    ro = ref.vsmooth_attention(qk, vq, expcast=expcast, out_dtype=out_dtype)
    assert torch.isfinite(o).all()
    assert rel(o, ro) <= REF_TOL
    truth = truth_of(q, k, v)
    assert rel(o, truth) <= 1.25 * rel(ro, truth) + 1e-3


@pytest.mark.parametrize("expcast", [False, True])
def test_zero_sm_scale_uniform_rows(expcast):
    """sm_scale = 0 (SDPA's scale=0.0): every q_scale is 0, softmax uniform. Regression guard for the
    per-row scale: applied after the -inf mask of the key tail it would give 0 * -inf = NaN."""
    S, D = 200, 64
    q, k, v = make_qkv(1, 2, S, D, torch.bfloat16)
    qk = ref_pre.preprocess_qk(q, k, sm_scale=0.0)
    vq = ref_pre.preprocess_v(v)
    o = attn(qk, vq, expcast=expcast, out_dtype=torch.float32)
    ro = ref.vsmooth_attention(qk, vq, expcast=expcast, out_dtype=torch.float32)
    assert torch.isfinite(o).all()
    assert rel(o, ro) <= 2e-2
    assert rel(o, v.float().mean(dim=2, keepdim=True).expand_as(o)) <= 2e-2


@pytest.mark.parametrize("expcast", [False, True])
def test_rejects_per_block_q_scale(expcast):
    """QKQuant built for the old per-128-token Q scales must be refused, not misread."""
    q, k, v = make_qkv(1, 1, 300, 64, torch.bfloat16)
    qk, vq = quantise(q, k, v)
    with pytest.raises(ValueError, match="per query token"):
        attn(qk._replace(q_scale=qk.q_scale[..., ::128].contiguous()), vq, expcast=expcast)


def test_padded_keys_get_zero_probability():
    """Key tails read the next head's rows (one flat TMA descriptor): make them win every softmax if
    they were not masked."""
    S, D = 200, 64
    q, k, v = make_qkv(1, 2, S, D, torch.bfloat16)
    k[:, 1] = 8.0 * q[:, 0, :1].expand(-1, S, -1)  # head 1's keys align with head 0's queries
    v[:, 1] = 100.0
    qk, vq = quantise(q, k, v)
    o = attn(qk, vq, out_dtype=torch.float32)
    ro = ref.vsmooth_attention(qk, vq, out_dtype=torch.float32)
    assert rel(o[:, 0], ro[:, 0]) <= 1.5e-2
    assert o[:, 0].abs().max().item() < 50.0


def test_vsmooth_beats_naive_on_outliers():
    """The point of V-Smooth: with k-means order and block means the P_q (V - V_q) term shrinks."""
    S, D = 384, 64
    g = torch.Generator().manual_seed(3)
    q, k, _ = make_qkv(1, 2, S, D, torch.bfloat16, seed=3)
    q = q / 3  # flatter attention: the V term dominates the error
    centers = 4.0 * torch.randn(1, 2, 3, D, generator=g)
    lab = torch.randint(0, 3, (1, 2, S, 1), generator=g).expand(1, 2, S, D)  # clusters scattered
    v = (torch.gather(centers, 2, lab) + 0.2 * torch.randn(1, 2, S, D, generator=g)).bfloat16()
    v = v.to(KERNEL_DEVICE)
    truth = truth_of(q, k, v)
    qk0, vq0 = quantise(q, k, v, smooth=False)
    naive = attn(qk0, vq0, out_dtype=torch.float32)
    perm = ref_km.kmeans_perm(v, 3, 5).perm
    qk1, vq1 = quantise(q, k, v, smooth=True, perm=perm)
    smooth = attn(qk1, vq1, out_dtype=torch.float32)
    assert rel(smooth, truth) < 0.7 * rel(naive, truth)  # measured 0.58


def test_bad_inputs():
    q, k, v = make_qkv(1, 1, 64, 64, torch.bfloat16)
    qk, vq = quantise(q, k, v)
    with pytest.raises(ValueError):
        attn(qk, vq._replace(S=63))
    with pytest.raises(TypeError, match="VSmoothTritonConfig"):
        tpl.vsmooth_attention(qk, vq, launch=(64, 128, 4, 3))


def test_launch_config_validation():
    """Named fields, str enums, refused combinations name the field and what is accepted."""
    cfg = C.VSmoothTritonConfig(rowsum="fp16", mean="bf16_mma")
    assert cfg.rowsum is RowSum.FP16 and cfg.mean is MeanTerm.BF16_MMA
    assert C.VSmoothTritonConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="rowsum.*accepted"):
        C.VSmoothTritonConfig(rowsum="fp32_p")  # the undecoded-p row sum (old ROWSUM 4) is gone
    with pytest.raises(ValueError, match="tf32_window is the Gluon kernel's"):
        C.VSmoothTritonConfig(mean="tf32_window")
    with pytest.raises(ValueError, match="num_warps"):
        C.VSmoothTritonConfig(num_warps=3)
    with pytest.raises(ValueError, match="block_n"):
        C.VSmoothTritonConfig(block_n=64)  # one V mean per key block: BN = BLOCK_V


@requires_cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("fmt,expcast", [("int8", False), ("int8", True), ("fp8", False)])
@pytest.mark.parametrize("kernel", ["runtime", "triton"])
def test_gpu_large(D, fmt, expcast, kernel):
    """What the runtime runs (dispatch: the Gluon kernel on sm_90 for INT8) and the Triton kernel itself."""
    B, H, S = 1, 4, 4173
    q, k, v = make_qkv(B, H, S, D, torch.bfloat16, device="cuda")
    truth = truth_of(q, k, v)
    for smooth in (True, False):
        qk, vq = quantise(q, k, v, fmt, smooth)
        if kernel == "runtime":
            o, lse = dispatch.vsmooth_attention(dispatch.Impl.TRITON, qk, vq, expcast=expcast, return_lse=True)
        else:
            o, lse = attn(qk, vq, expcast=expcast, return_lse=True)
        ro, rlse = ref.vsmooth_attention(qk, vq, expcast=expcast, return_lse=True)
        assert rel(o, ro) <= REF_TOL
        assert rel(o, truth) <= 1.25 * rel(ro, truth) + 1e-3
        assert (lse - rlse).abs().mean().item() <= 1e-2


@requires_cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("expcast", [False, True])
@pytest.mark.parametrize("S", [4096, 4173])
@pytest.mark.parametrize("mean", [None, MeanTerm.BF16_MMA])
def test_gpu_no_nan_any_specialisation(D, expcast, S, mean):
    """NOTE on the H200 (triton 3.6) some exp2 + FFMA-mean variants gave NaN in ~40% of the rows
    (code generation, not understood; see configs.VSMOOTH_TRITON_DEFAULT): every specialisation of the
    defaults (key tail or not, LSE or not) must be finite and match the reference; the bf16 MMA mean is the
    fallback."""
    if mean is not None and (expcast or D == 64):
        pytest.skip("fallback only matters for the D=128 exp2 default")
    cfg = launch(D, expcast) if mean is None else launch(D, expcast, mean=mean)
    q, k, v = make_qkv(1, 4, S, D, torch.bfloat16, device="cuda")
    qk, vq = quantise(q, k, v)
    ro = ref.vsmooth_attention(qk, vq, expcast=expcast)
    for return_lse in (False, True):
        o = tpl.vsmooth_attention(qk, vq, expcast=expcast, return_lse=return_lse, launch=cfg)
        o = o[0] if return_lse else o
        bad = int((~torch.isfinite(o)).any(-1).sum())
        assert bad == 0, f"{bad} rows not finite (return_lse={return_lse})"
        assert rel(o, ro) <= REF_TOL


@requires_cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("expcast", [False, True])
@pytest.mark.parametrize("S", [4096, 4173])
def test_gpu_every_tuning_candidate(D, expcast, S):
    """Every config the autotuner may pick (configs.VSMOOTH_TRITON_CANDIDATES), in every specialisation (key
    tail or not, LSE or not): finite rows and the reference's tolerance, as the defaults above. (The
    tuner also rejects a candidate whose output is not finite or > 2e-2 from the default's.)"""
    q, k, v = make_qkv(1, 4, S, D, torch.bfloat16, device="cuda")
    qk, vq = quantise(q, k, v)
    ro = ref.vsmooth_attention(qk, vq, expcast=expcast)
    for cfg in C.VSMOOTH_TRITON_CANDIDATES[(D, expcast)]:
        for return_lse in (False, True):
            o = tpl.vsmooth_attention(qk, vq, expcast=expcast, return_lse=return_lse, launch=cfg)
            o = o[0] if return_lse else o
            bad = int((~torch.isfinite(o)).any(-1).sum())
            assert bad == 0, f"{bad} rows not finite ({cfg}, return_lse={return_lse})"
            assert rel(o, ro) <= REF_TOL, cfg
