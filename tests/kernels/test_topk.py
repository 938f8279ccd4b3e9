"""Radix top-K (kernels/topk.py) against reference/topk.py: exact equality, ties lowest index first."""
import pytest
import torch

from conftest import KERNEL_DEVICE, requires_cuda
from vc_compile.reference.topk import select_topk as ref_topk
from vc_compile.kernels.configs import TopKConfig
from vc_compile.kernels.topk import select_topk

DEV = KERNEL_DEVICE
CONFIGS = [TopKConfig(block=256, digit=4), TopKConfig(block=1024, digit=8, num_warps=4)]


def masses(shape, dtype, seed=0):
    """Group-mass-like rows: a heavy tail over decades, many exact ties (repeated values, exact zeros)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.exp2(-20 * torch.rand(*shape, generator=g))
    m[..., ::7] = 0.5           # a tie block across the threshold region
    m[..., 3::11] = 0.0         # exact zeros
    m[..., 5::13] = -0.0        # negative zero counts as zero
    return m.to(dtype).to(DEV)


@pytest.mark.parametrize("N,keep,dtype,cfg", [
    (777, 1, torch.float32, CONFIGS[0]), (777, 777, torch.bfloat16, CONFIGS[1]),
    (1000, 143, torch.bfloat16, CONFIGS[0]), (1000, 143, torch.float32, CONFIGS[1]),
    (2049, 640, torch.float16, CONFIGS[0]), (333, 64, torch.bfloat16, CONFIGS[1])])
def test_equals_reference(N, keep, dtype, cfg):
    m = masses((2, 3, N), dtype)
    got = select_topk(m, keep, launch=cfg)
    want = ref_topk(m.cpu(), keep)
    assert got.dtype == torch.int32 and got.shape == (2, 3, keep)
    assert torch.equal(got.cpu(), want)
    assert (got[..., 1:] > got[..., :-1]).all()  # ascending, distinct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_take_lowest_indices(dtype):
    """All-equal rows and a row whose K-th value is shared by many keys: the lowest indices win."""
    N, keep = 600, 100
    m = torch.full((3, N), 0.25, dtype=dtype)
    m[1, 500:] = 1.0                     # 100 large at the end: exactly those
    m[2, 550:] = 1.0                     # 50 large, then 50 of the 0.25 ties, lowest first
    got = select_topk(m.to(DEV), keep, launch=CONFIGS[0]).cpu()
    assert torch.equal(got[0], torch.arange(100, dtype=torch.int32))
    assert torch.equal(got[1], torch.arange(500, 600, dtype=torch.int32))
    assert torch.equal(got[2], torch.cat([torch.arange(50), torch.arange(550, 600)]).to(torch.int32))


def test_padded_row_views():
    """A [..., :N] view of rows padded to a multiple of 64 (how the mass kernel writes them) reads whole padded
    rows; the padding (garbage here: large values) is never counted."""
    buf = torch.full((2, 5, 192), 7.0).bfloat16()
    buf[..., :150] = masses((2, 5, 150), torch.bfloat16).cpu()
    m = buf.to(DEV)[..., :150]
    assert torch.equal(select_topk(m, 40, launch=CONFIGS[0]).cpu(), ref_topk(m.cpu(), 40))


def test_is_the_k_largest():
    """Against torch.topk on distinct values (no ties): the same sets."""
    m = torch.randperm(5000).float().view(2, 2500).to(DEV) / 5000
    got = select_topk(m, 300, launch=CONFIGS[1]).cpu()
    want = torch.topk(m.cpu(), 300, dim=-1).indices.sort(-1).values.int()
    assert torch.equal(got, want)


def test_bad_arguments():
    m = torch.rand(2, 100)
    with pytest.raises(ValueError, match="keep must be in"):
        select_topk(m, 0)
    with pytest.raises(ValueError, match="keep must be in"):
        select_topk(m, 101)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        select_topk(m.double(), 5)
    with pytest.raises(ValueError, match="power of two"):
        TopKConfig(block=1000)
    with pytest.raises(ValueError, match="digit"):
        TopKConfig(digit=5)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("digit", [4, 8])
def test_gpu_large_rows(dtype, digit):
    """Anchor-step shapes: S = 32760 keys per row, K = 4928 (s = 0.15)."""
    m = masses((1, 2, 64, 32760), dtype)
    got = select_topk(m, 4928, launch=TopKConfig(digit=digit))
    assert torch.equal(got.cpu(), ref_topk(m.cpu(), 4928))
