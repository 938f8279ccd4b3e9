"""Test speed-up for the Triton interpreter (TRITON_INTERPRET=1, CPU): ``tl.reduce`` with a user combine
function, vectorised.

The interpreter runs ``tl.max`` / ``tl.sum`` through numpy, but a reduction with its own combine function
(``kernels/preprocess.py``'s NaN-propagating ``tl.reduce(x, axis, _nanmax)``: ``tl.max`` drops NaN)
falls back to ``ReduceOps.generic_reduce``, which calls the combine function once per ELEMENT, on scalar
tensors. That loop was most of the CPU suite's time: one ``preprocess_qk`` of a [1, 2, 130, 64] input took
~90 s (cProfile: 40 reductions, 176 s of 225 s in one tests/test_hostile.py kernel case).

``generic_reduce`` below performs the same left fold in the same order -- ``acc = x[0]; acc = f(acc, x[i])``
for i = 1 .. n-1 -- but calls the combine function once per step of the reduced axis on whole slices
(numpy arrays of the other axes). Elementwise combine functions (all Triton allows) therefore give the
same bits as the stock loop, the accumulator is cast back to the input's dtype after each step as there,
and the kernels under test are unchanged. tests/test_triton_interp.py checks bit equality against the
stock loop on NaN-bearing data and through ``preprocess_qk``. Anything this code does not handle (a
combine function that does not broadcast) falls back to the stock loop.
"""
import numpy as np


def install():
    """Replace ``ReduceOps.generic_reduce`` (kept as ``ReduceOps.stock_generic_reduce``). Idempotent."""
    from triton.runtime import interpreter as interp

    ops = interp.ReduceOps
    if getattr(ops, "stock_generic_reduce", None) is None:
        ops.stock_generic_reduce = ops.generic_reduce
        ops.generic_reduce = _generic_reduce


def _generic_reduce(self, input):
    try:
        return _vectorised_reduce(self, input)
    except Exception:  # noqa: BLE001  (a combine function that does not broadcast: the stock loop)
        return self.stock_generic_reduce(input)


def _vectorised_reduce(self, input):
    import triton.language as tl

    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    datas = [arg.handle.data for arg in input]
    dtypes = [arg.dtype for arg in input]
    in_shape = datas[0].shape
    out_shape = in_shape[:axis] + in_shape[axis + 1:]

    def tensor(x, dtype):  # a block tensor of the other axes' shape, or a scalar tensor when there are none
        return self.to_tensor(x if out_shape else x.reshape(()).item(), dtype)

    def values(ret, j):
        x = ret.handle.data if isinstance(ret, tl.core.tensor) else ret
        x = np.asarray(x)
        if x.size == 1 and not out_shape:
            x = x.reshape(())
        return np.broadcast_to(x, out_shape).astype(datas[j].dtype, copy=True)

    acc = [np.take(d, 0, axis=axis).astype(d.dtype, copy=True) for d in datas]
    for i in range(1, in_shape[axis]):
        a = tuple(tensor(x, dt) for x, dt in zip(acc, dtypes))
        b = tuple(tensor(np.take(d, i, axis=axis), dt) for d, dt in zip(datas, dtypes))
        ret = self.combine_fn.fn(*a, *b)
        ret = ret if isinstance(ret, tuple) else (ret, )
        if len(ret) != len(acc):
            raise ValueError("combine function returned the wrong number of values")
        acc = [values(r, j) for j, r in enumerate(ret)]
    out = []
    for data, dt in zip(acc, dtypes):
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(len(in_shape)):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        out.append(self.to_tensor(data, dt))
    return out
