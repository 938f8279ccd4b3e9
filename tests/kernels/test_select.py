"""Anchor-step selection (kernels/select.py) against reference/select.py and brute force."""
import pytest
import torch

from conftest import KERNEL_DEVICE, requires_cuda
from vc_compile import torch_ops
from vc_compile.formats import LOG2E, n_keep
from vc_compile.methods import mcsparse as M
from vc_compile.reference import select as R
from vc_compile.reference.dense import dense_attention_lse
from vc_compile.kernels import dispatch
from vc_compile.kernels.select import dense_with_lse, group_key_mass
from vc_compile.torch_ops import select_topk

DEV = KERNEL_DEVICE


def inputs(B, H, S, Sk, D, dtype, C=64, device=DEV):
    q = torch.randn(B, H, S, D) * 1.5
    k = torch.randn(B, H, Sk, D) + 2.0 * torch.randn(1, 1, 1, D)
    v = torch.randn(B, H, Sk, D)
    sigma = torch.stack([torch.randperm(S) for _ in range(B * H)]).view(B, H, S)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    _, lse2 = dense_attention_lse(q, k, v, sm_scale=D ** -0.5)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k), to(v), to(sigma), to(lse2)


@pytest.mark.parametrize("S,Sk,D,dtype", [(200, 200, 64, torch.bfloat16), (333, 333, 128, torch.float16),
                                          (130, 70, 64, torch.float32)])
def test_mass_matches_reference(S, Sk, D, dtype):
    q, k, _, sigma, lse2 = inputs(1, 2, S, Sk, D, dtype)
    mass = group_key_mass(q, k, sigma, lse2, sm_scale=D ** -0.5, group_size=64)
    ref = R.group_key_mass(q.cpu(), k.cpu(), sigma.cpu(), lse2.cpu(), sm_scale=D ** -0.5, group_size=64)
    G = (S + 63) // 64
    assert mass.shape == (1, 2, G, Sk) and mass.dtype == torch.float32
    assert torch.allclose(mass.cpu(), ref, rtol=1e-4, atol=1e-6)
    # rows of probabilities sum to 1: a group's masses sum to its number of rows
    sizes = torch.tensor([64] * (G - 1) + [S - 64 * (G - 1)], dtype=torch.float32)
    assert torch.allclose(mass.sum(-1).cpu(), sizes.expand(1, 2, G), rtol=1e-4)


def test_selection_is_bruteforce_topk():
    S, D, C = 333, 64, 64
    q, k, v, sigma, lse2 = inputs(1, 2, S, S, D, torch.bfloat16)
    keep = n_keep(S, 0.25)
    assert keep == 128
    idx = select_topk(group_key_mass(q, k, sigma, lse2, sm_scale=D ** -0.5, group_size=C), keep)
    assert idx.dtype == torch.int32 and idx.shape == (1, 2, 6, keep)
    assert (idx[..., 1:] > idx[..., :-1]).all()  # sorted ascending, distinct
    # brute force: the full S x S probability matrix in fp64, summed over each group's rows
    s = (q.double() @ k.double().transpose(-1, -2)) * (D ** -0.5)
    p = torch.softmax(s, dim=-1).cpu()
    for h in range(2):
        for g in range(6):
            rows = sigma[0, h, g * C:(g + 1) * C].cpu()
            m = p[0, h, rows].sum(0)
            want = set(torch.topk(m, keep).indices.tolist())
            got = set(idx[0, h, g].cpu().tolist())
            if got != want:  # only exact near-ties may swap
                thr = torch.topk(m, keep).values[-1]
                for j in got ^ want:
                    assert abs(m[j] - thr) <= 1e-5 * thr


def test_anchor_selection_chunks_heads():
    """The anchor step's selection (methods/mcsparse.select) passes heads in chunks under a byte budget for the
    masses: chunked and whole give the same keys."""
    S, D = 200, 64
    q, k, _, sigma, lse2 = inputs(1, 3, S, S, D, torch.bfloat16)
    full = select_topk(group_key_mass(q, k, sigma, lse2, sm_scale=0.125, group_size=64), 64)
    one_head = 4 * 200 * 4  # bytes of one head's mass: forces 1 head per chunk
    chunked = M.select(dispatch.Impl.TRITON, q, k, sigma, lse2, sm_scale=0.125, group_size=64, keep=64,
                       max_mass_bytes=one_head)
    assert torch.equal(full, chunked)


def test_dense_with_lse_cpu_convention():
    q, k, v = (torch.randn(1, 2, 150, 64) for _ in range(3))
    out, lse2 = dense_with_lse(q, k, v, 0.125)
    ro, rl = dense_attention_lse(q, k, v, sm_scale=0.125)
    assert torch.allclose(lse2, rl, atol=1e-4)
    assert torch.allclose(out, ro, atol=1e-4)


@requires_cuda
def test_dense_with_lse_cuda():
    """cuDNN / flash return the natural-log LSE; dense_with_lse converts to base 2 (reference/dense.py)."""
    S, D = 1000, 128
    q, k, v = (torch.randn(1, 4, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse2 = dense_with_lse(q, k, v, D ** -0.5)
    ro, rl = dense_attention_lse(q, k, v, sm_scale=D ** -0.5)
    assert lse2.shape == (1, 4, S) and lse2.dtype == torch.float32
    assert (lse2 - rl).abs().max().item() < 2e-2
    assert ((out.float() - ro).norm() / ro.norm()).item() < 1e-2
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=D ** -0.5)
    assert (r[1].float() * LOG2E - rl).abs().max().item() < 2e-2


@requires_cuda
def test_cuda_mass_and_selection_large():
    S, D = 4000, 128
    q, k, _, sigma, lse2 = inputs(1, 2, S, S, D, torch.bfloat16, device="cuda")
    mass = group_key_mass(q, k, sigma, lse2, sm_scale=D ** -0.5, group_size=64)
    ref = R.group_key_mass(q, k, sigma, lse2, sm_scale=D ** -0.5, group_size=64)
    assert torch.allclose(mass, ref, rtol=1e-3, atol=1e-6)
    keep = n_keep(S, 0.1)
    a, b = select_topk(mass, keep), torch_ops.select_topk(ref, keep)
    agree = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean().item()
    assert agree > 0.999
