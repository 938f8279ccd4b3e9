"""The cheap anchor step (methods/anchor.py): Triton pipeline against the reference pipeline, and the
reference pipeline's contract (what R and the returned output are)."""
import pytest
import torch

from conftest import INTERPRET, KERNEL_DEVICE
from vc_compile import torch_ops
from vc_compile.formats import n_keep
from vc_compile.methods.anchor import AnchorConfig, anchor_step
from vc_compile.reference import kmeans as RK
from vc_compile.reference.dense import dense_attention_lse
from vc_compile.kernels.dispatch import Impl

DEV = KERNEL_DEVICE


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(S, D, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(1, H, S, D, generator=g)
    k = torch.randn(1, H, S, D, generator=g) + 2.0 * torch.randn(1, H, 1, D, generator=g)
    v = torch.randn(1, H, S, D, generator=g)
    v[..., ::23, :] *= 8.0
    q, k, v = (t.bfloat16() for t in (q, k, v))
    pi = RK.kmeans_perm(v.float(), torch_ops.default_clusters(S), 2).perm
    sigma = torch.stack([torch.randperm(S, generator=g) for _ in range(H)]).view(1, H, S)
    return q, k, v, pi, sigma


@pytest.mark.parametrize("S,D,C,dense_out", [(200, 64, 64, "q8"), (257, 128, 128, "bf16")])
def test_triton_pipeline_matches_reference(S, D, C, dense_out):
    q, k, v, pi, sigma = inputs(S, D)
    keep = n_keep(S, 0.25)
    cfg = AnchorConfig(dense_out=dense_out)
    ref = anchor_step(Impl.REFERENCE, q, k, v, sm_scale=D ** -0.5, group_size=C, keep=keep, key_perm=pi,
                      cfg=cfg, sigma=sigma, out_dtype=torch.float32)
    to = lambda t: t.to(DEV)  # noqa: E731
    got = anchor_step(Impl.TRITON, to(q), to(k), to(v), sm_scale=D ** -0.5, group_size=C, keep=keep,
                      key_perm=to(pi), cfg=cfg, sigma=to(sigma), out_dtype=torch.float32)
    assert got.idx.shape == ref.idx.shape == (1, 2, -(-S // C), keep) and got.idx.dtype == torch.int32
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in
               zip(got.idx.cpu().view(-1, keep), ref.idx.view(-1, keep))) / ref.idx.numel()
    assert same >= 0.98  # rounding-level differences of the masses swap near-ties only
    assert rel(got.out.cpu(), ref.out) < 2e-2  # the 8-bit kernel vs its reference (test_vsmooth_attn: 2e-2)
    assert rel(got.residual.cpu(), ref.residual) < 0.1  # R is small; both terms' kernel errors land in it


@pytest.mark.parametrize("impl", [Impl.REFERENCE, Impl.TRITON])
@pytest.mark.parametrize("dense_out", ["bf16", "q8"])
def test_bf16_residual_from_the_epilogue(impl, dense_out):
    """R in bf16 formed by the gather kernel's epilogue (O_sparse + (-O_dense), one rounding, negated) has the bits
    of R formed in fp32 and rounded to bf16, which is what MC-Sparse cached before; an odd length, D = 64."""
    S, D, C = 203, 64, 64
    q, k, v, pi, sigma = inputs(S, D)
    to = (lambda t: t.to(DEV)) if impl == Impl.TRITON else (lambda t: t)  # noqa: E731
    kw = dict(sm_scale=D ** -0.5, group_size=C, keep=n_keep(S, 0.25), key_perm=to(pi),
              cfg=AnchorConfig(dense_out=dense_out), sigma=to(sigma))
    a = anchor_step(impl, to(q), to(k), to(v), residual_dtype=torch.float32, **kw)
    b = anchor_step(impl, to(q), to(k), to(v), residual_dtype=torch.bfloat16, **kw)
    assert torch.equal(a.idx, b.idx) and torch.equal(a.out, b.out)
    assert a.residual.dtype == torch.float32 and b.residual.dtype == torch.bfloat16
    r32 = a.residual.cpu()
    if impl == Impl.TRITON and INTERPRET:  # the interpreter's fp32 -> bf16 cast truncates (the GPU's rounds to
        r32 = (r32.view(torch.int32) & -65536).view(torch.float32)  # nearest even): the same cast, truncated
    assert torch.equal(b.residual.cpu(), r32.to(torch.bfloat16))
    assert a.residual.abs().max() > 0  # a real residual (density 0.25), not a vacuous equality
    with pytest.raises(ValueError, match="residual_dtype must be"):
        anchor_step(impl, to(q), to(k), to(v), residual_dtype=torch.float16, **kw)


def test_reference_contract():
    """dense_out='bf16': O_dense is dense attention in q's dtype (bf16, as cuDNN returns it); at density 1 the
    sparse output (fp32) is dense attention too, so R is O_dense's bf16 rounding only; with dense_out='q8', R at
    density 1 is the 8-bit pass's own error O8 - O."""
    S, D, C = 256, 64, 64
    q, k, v, pi, sigma = inputs(S, D)
    o, _ = dense_attention_lse(q, k, v, sm_scale=D ** -0.5)
    a = anchor_step(Impl.REFERENCE, q, k, v, sm_scale=D ** -0.5, group_size=C, keep=S, key_perm=pi,
                    cfg=AnchorConfig(dense_out="bf16"), sigma=sigma, out_dtype=torch.float32)
    assert torch.allclose(a.out, o, rtol=2 ** -8, atol=1e-6)
    assert torch.allclose(a.residual, a.out - o, atol=1e-5)
    assert rel(a.out, o) < 3e-3
    assert torch.equal(a.idx, torch.arange(S, dtype=torch.int32).expand(1, 2, S // C, S))
    b = anchor_step(Impl.REFERENCE, q, k, v, sm_scale=D ** -0.5, group_size=C, keep=S, key_perm=pi,
                    cfg=AnchorConfig(dense_out="q8"), sigma=sigma, out_dtype=torch.float32)
    assert torch.allclose(b.residual, b.out - o, atol=1e-4)
    assert 1e-3 < rel(b.out, o) < 5e-2  # the 8-bit pass error on these outlier-heavy V rows (3.2%)


def test_bad_inputs():
    q, k, v, pi, sigma = inputs(128, 64)
    with pytest.raises(ValueError, match="self-attention"):
        anchor_step(Impl.REFERENCE, q, k[:, :, :100], v[:, :, :100], sm_scale=0.125, group_size=64, keep=64)
    with pytest.raises(ValueError, match="exp"):
        AnchorConfig(exp="fast")
    with pytest.raises(ValueError):
        AnchorConfig(dense_out="fp8")


def test_mcsparse_cheap_anchor_argument():
    """``mcsparse.run(..., cheap_anchor=...)``: None (default) runs anchor_step, False the original passes (the
    benchmark's old path), True refuses shapes anchor_step cannot take. Same O_dense (both bf16 dense), the same
    sigma, selections (8-key runs, the default) that differ only by near-tie swaps (INT8 pass 2 vs exact fp32
    masses), each path's residual kept as int8 codes with per-token scales."""
    from vc_compile.torch_ops import residual_values
    from vc_compile.config import VCConfig
    from vc_compile.methods import mcsparse as M
    from vc_compile.methods.phase import Phase
    from vc_compile.kernels import dispatch

    S, D = 304, 64  # a whole number of 8-key runs (a partial last query group)
    q, k, v, _, _ = inputs(S, D)
    cfg = VCConfig.from_options({"method": "mcsparse", "density": 0.25, "group_size": 64, "key_run": 8})
    impl = Impl.REFERENCE
    run = lambda **kw: M.run(q, k, v, phase=Phase.ANCHOR, meta=None, cfg=cfg, sm_scale=D ** -0.5,  # noqa: E731
                             impl=impl, **kw)
    new_out, new = run()
    old_out, old = run(cheap_anchor=False)
    forced_out, forced = run(cheap_anchor=True)
    assert torch.equal(new_out, forced_out) and torch.equal(new.idx, forced.idx)
    assert torch.equal(new.sigma, old.sigma) and new.run == old.run == 8 and new.idx.dtype == torch.int16
    assert rel(new_out, old_out) < 1e-6
    keep = new.idx.shape[-1]
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in
               zip(new.idx.view(-1, keep), old.idx.view(-1, keep))) / old.idx.numel()
    assert 0.95 <= same
    for out, meta in ((new_out, new), (old_out, old)):  # R = O_dense - O_sparse of each path's own selection
        o_sparse = dispatch.sparse_attention(impl, q, k, v, meta.sigma, meta.idx, sm_scale=D ** -0.5,
                                             group_size=64, out_dtype=torch.float32, run=meta.run)
        # int8 storage of R: half a step of amax / 127 per element, ~0.7% of the rows' norm for Gaussian-like rows
        assert meta.residual.dtype == torch.int8
        assert rel(residual_values(meta.residual, meta.res_scale), out.float() - o_sparse) < 1.2e-2
    with pytest.raises(ValueError, match="cheap_anchor=True cannot run this anchor: q, k, v of different"):
        M.run(q, k[:, :, :200], v[:, :, :200], phase=Phase.ANCHOR, meta=None, cfg=cfg, sm_scale=D ** -0.5,
              impl=impl, cheap_anchor=True)


def test_dispatch_launch_rules():
    """The anchor kernels' launch configs (kernels/configs.py): validated, JSON round trip, the default per group
    size; dispatch refuses a launch config for the reference and a launch whose exp contradicts the call's."""
    from vc_compile.kernels import configs as KC
    from vc_compile.kernels import dispatch

    assert KC.anchor_mass_default(64).groups_per_program == 4 and KC.anchor_mass_default(128).groups_per_program == 1
    for c in (KC.AnchorMassConfig(groups_per_program=1, exp="exact"), KC.TopKConfig(block=256, digit=4)):
        assert type(c).from_json(c.to_json()) == c
    assert KC.AnchorMassConfig(exp="exact").exp is KC.ExpMode.EXACT
    with pytest.raises(ValueError, match="num_warps"):
        KC.AnchorMassConfig(num_warps=8)
    with pytest.raises(ValueError, match="launch.exp='exact' but exp='shift'"):
        dispatch.anchor_mass_launch(128, "shift", KC.AnchorMassConfig(exp="exact"))
    mass = torch.rand(1, 1, 2, 300)
    with pytest.raises(ValueError, match="reference has none"):
        dispatch.topk(Impl.REFERENCE, mass, 10, launch=KC.TOPK_DEFAULT)
    idx = dispatch.topk(Impl.REFERENCE, mass, 10)
    assert idx.dtype == torch.int32 and torch.equal(idx.sort(-1).values, idx)
    assert torch.equal(idx.long().sort(-1).values, mass.topk(10, dim=-1).indices.sort(-1).values)
