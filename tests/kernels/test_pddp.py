"""Fast PDDP grouping (kernels/pddp.py) against reference/pddp.py."""
import pytest
import torch

from conftest import KERNEL_DEVICE, requires_cuda
from vc_compile.reference.pddp import pddp_perm as ref_pddp
from vc_compile.kernels.pddp import pddp_perm

DEV = KERNEL_DEVICE


def groups(sig, C):
    return [frozenset(sig[g:g + C].tolist()) for g in range(0, sig.numel(), C)]


def assert_valid(sigma, B, H, S):
    assert sigma.shape == (B, H, S) and sigma.dtype == torch.int64
    ar = torch.arange(S, device=sigma.device)
    assert torch.equal(sigma.sort(dim=-1).values, ar.expand(B, H, S))


def clustered(B, H, n_clusters, C, D, spread=0.05, extra=0):
    """n_clusters clusters of exactly C points each (+ `extra` points of one more cluster), far apart."""
    out = []
    for _ in range(B * H):
        centres = torch.randn(n_clusters + 1, D) * 10.0
        sizes = [C] * n_clusters + [extra]
        pts = torch.cat([c + spread * torch.randn(n, D) for c, n in zip(centres, sizes)])
        lab = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
        perm = torch.randperm(pts.shape[0])
        out.append((pts[perm], lab[perm]))
    x = torch.stack([p for p, _ in out]).view(B, H, -1, D)
    lab = torch.stack([lab for _, lab in out]).view(B, H, -1)
    return x, lab


@pytest.mark.parametrize("S,D,C", [(200, 64, 64), (1000, 64, 64), (333, 128, 32), (64, 64, 64), (50, 64, 64)])
def test_valid_permutation_and_matches_reference(S, D, C):
    q = torch.randn(1, 2, S, D).bfloat16().to(DEV)
    sigma = pddp_perm(q, C)
    assert_valid(sigma, 1, 2, S)
    ref = ref_pddp(q.cpu(), C)
    # same split rule and iterations: the groups agree (exact order may differ only by float rounding)
    for h in range(2):
        got, want = groups(sigma[0, h].cpu(), C), groups(ref[0, h], C)
        assert sum(a == b for a, b in zip(got, want)) >= 0.75 * len(want)


def test_multi_chunk_segments_d64():
    """S = 2100 at D = 64: the top segment spans two work items (atomics path)."""
    q = torch.randn(1, 1, 2100, 64).to(DEV)
    sigma = pddp_perm(q, 64)
    assert_valid(sigma, 1, 1, 2100)
    ref = ref_pddp(q.cpu(), 64)
    got, want = groups(sigma[0, 0].cpu(), 64), groups(ref[0, 0], 64)
    assert sum(a == b for a, b in zip(got, want)) >= 0.75 * len(want)


@pytest.mark.parametrize("D", [64, 128])
def test_separated_clusters_are_the_groups(D):
    C, n = 64, 7
    x, lab = clustered(1, 2, n, C, D, spread=0.01)
    sigma = pddp_perm(x.bfloat16().to(DEV), C)
    assert_valid(sigma, 1, 2, n * C)
    ref = ref_pddp(x.bfloat16(), C)
    for h in range(2):
        got = groups(sigma[0, h].cpu(), C)
        assert got == groups(ref[0, h], C)
        for g in got:  # each group is one cluster
            assert len(set(lab[0, h, list(g)].tolist())) == 1


def test_separated_clusters_partial_group_match_reference():
    """With a partial cluster the median splits need not respect clusters, but the split rule is the
    reference's: same groups."""
    x, _ = clustered(1, 2, 5, 64, 64, spread=0.01, extra=20)
    sigma = pddp_perm(x.to(DEV), 64)
    assert_valid(sigma, 1, 2, 5 * 64 + 20)
    ref = ref_pddp(x, 64)
    for h in range(2):
        assert groups(sigma[0, h].cpu(), 64) == groups(ref[0, h], 64)


def test_duplicate_queries_no_nan():
    q = torch.zeros(1, 2, 300, 64)
    q[0, 1] = torch.randn(64)  # head 1: one query repeated
    q[0, 0, 150:] = torch.randn(64)  # head 0: two distinct queries, 150 copies each
    sigma = pddp_perm(q.to(DEV), 64)
    assert_valid(sigma, 1, 2, 300)
    assert torch.equal(sigma[0, 1].cpu(), torch.arange(300))  # constant projection: order kept


def test_partial_group_sizes():
    S, C = 333, 64
    sigma = pddp_perm(torch.randn(2, 1, S, 64).to(DEV), C)
    assert_valid(sigma, 2, 1, S)
    G = (S + C - 1) // C
    assert [len(g) for g in groups(sigma[1, 0].cpu(), C)] == [C] * (G - 1) + [S - C * (G - 1)]


@requires_cuda
def test_cuda_large_clusters():
    # fp32 queries: in bf16 the rounding of the centres (ulp 0.06 at |x| ~ 10) is comparable to the gaps
    # between 64 clusters' projections, and the median splits can then cut through a cluster
    C, n, D = 64, 32, 128
    x, lab = clustered(1, 4, n, C, D, spread=0.001)
    sigma = pddp_perm(x.cuda(), C)
    S = x.shape[2]
    assert_valid(sigma, 1, 4, S)
    for h in range(4):
        purity = sum(len(set(lab[0, h, list(g)].tolist())) == 1 for g in groups(sigma[0, h].cpu(), C)) / n
        assert purity == 1.0


@requires_cuda
def test_cuda_random_vs_reference():
    q = torch.randn(1, 4, 8190, 128, device="cuda", dtype=torch.bfloat16)
    sigma = pddp_perm(q, 64)
    assert_valid(sigma, 1, 4, 8190)
    ref = ref_pddp(q, 64)
    agree = sum(a == b for h in range(4) for a, b in zip(groups(sigma[0, h], 64), groups(ref[0, h], 64)))
    print(f"PDDP kernel vs reference, random bf16 queries: {agree} / {4 * 128} groups identical")
    # covariance form + tf32x3 vs the reference's fp32 X-form: a row at a median that swaps sides changes
    # that whole subtree, so random data agrees only partly (the first H200 run, with tf32: 128 / 512)
    assert agree >= 0.25 * 4 * 128
