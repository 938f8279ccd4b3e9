"""tests/triton_interp.py (the interpreter's vectorised ``tl.reduce``) gives the stock interpreter's bits.

A small kernel reduces a block with the kernels' own NaN-propagating max (kernels/preprocess.py
``_nanmax``) and with an order-sensitive fp32 sum (a left fold in another order would change low bits),
over each axis and over all of it, once through the vectorised reduce and once through the stock
per-element loop. tests/kernels/test_preprocess.py checks the kernels' codes exactly against the reference on CPU
with the vectorised reduce in place, NaN/Inf inputs included.
"""
import contextlib

import numpy as np
import pytest
import torch

from conftest import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="checks the Triton interpreter (TRITON_INTERPRET=1)")

if INTERPRET:
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as interp

    from vc_compile.kernels.preprocess import _nanmax

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _reduce_all(x, f: tl.constexpr, o_ptr, M: tl.constexpr, N: tl.constexpr):
        """[rows (axis 1) | cols (axis 0) | rows with keep_dims | a 1-D fold to a scalar | axis=None]"""
        tl.store(o_ptr + tl.arange(0, M), tl.reduce(x, 1, f))
        tl.store(o_ptr + M + tl.arange(0, N), tl.reduce(x, 0, f))
        tl.store(o_ptr + M + N + tl.arange(0, M)[:, None], tl.reduce(x, 1, f, keep_dims=True))
        tl.store(o_ptr + 2 * M + N, tl.reduce(tl.reduce(x, 1, f), 0, f))
        tl.store(o_ptr + 2 * M + N + 1, tl.reduce(x, None, f))

    @triton.jit
    def _reduce_kernel(x_ptr, o_ptr, M: tl.constexpr, N: tl.constexpr, SUM: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :])
        if SUM:
            _reduce_all(x, _add, o_ptr, M, N)
        else:
            _reduce_all(x, _nanmax, o_ptr, M, N)


@contextlib.contextmanager
def stock_reduce():
    fast = interp.ReduceOps.generic_reduce
    interp.ReduceOps.generic_reduce = interp.ReduceOps.stock_generic_reduce
    try:
        yield
    finally:
        interp.ReduceOps.generic_reduce = fast


def run(x, use_sum):
    M, N = x.shape
    out = torch.full((2 * M + N + 2,), 7.0)
    _reduce_kernel[(1,)](x, out, M, N, use_sum)
    return out


def same_bits(a, b):
    return np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))


def test_vectorised_reduce_is_installed():
    assert interp.ReduceOps.generic_reduce is not interp.ReduceOps.stock_generic_reduce


@pytest.mark.parametrize("use_sum", [False, True], ids=["nanmax", "sum"])
def test_vectorised_reduce_gives_the_stock_bits(use_sum, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=g) * torch.logspace(-20, 20, 32)  # wide range: order-sensitive sums
    if not use_sum:
        x[3, 5], x[7, 0], x[0, 31], x[9, 9] = float("nan"), float("inf"), float("-inf"), float("nan")
    with monkeypatch.context() as m:  # the vectorised path itself, not its fallback to the stock loop
        m.setattr(interp.ReduceOps, "stock_generic_reduce", lambda self, input: pytest.fail("fell back"))
        fast = run(x, use_sum)
    with stock_reduce():
        stock = run(x, use_sum)
    assert same_bits(fast, stock), (fast, stock)
    assert not (fast == 7.0).any()  # every output written
    if not use_sum:  # and the NaNs propagated (the reason the kernels do not use tl.max)
        M, N = x.shape
        rows, cols, keep, scalars = fast[:M], fast[M:M + N], fast[M + N:2 * M + N], fast[2 * M + N:]
        assert torch.isnan(rows[3]) and torch.isnan(cols[5]) and torch.isnan(scalars).all()
        assert torch.equal(rows.nan_to_num(), keep.nan_to_num()) and rows[7] == float("inf")
