"""Software roundings for the Triton interpreter (``TRITON_INTERPRET=1``): its fp32 -> e4m3 and fp32 -> bf16
casts round wrong (e4m3: -1.9547 -> -1.0 instead of -2.0 where rounding carries into the exponent;
tests/kernels/test_sparse_attn.py), so under the interpreter the kernels round in fp32 / int32 arithmetic first and the
cast then only sees exact values. Only called under an ``INTERPRET``-style constexpr: no GPU compile runs them.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_e4m3(x):
    """fp32 -> nearest E4M3 value (ties to even, saturating at +-448, sign kept), in fp32/int32 arithmetic.
    Interpreter only: its fp32 -> e4m3 cast mis-rounds ties, carries into the exponent and subnormals,
    so values are rounded to the E4M3 grid first and the cast then only sees exact values. Normal range: round
    the fp32 mantissa to 3 bits on the bit pattern (carries into the exponent are then right); below 2^-6 the
    grid step is 2^-9."""
    ax = tl.minimum(tl.abs(x), 448.0)
    bits = ax.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    nrm = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    sub = ((ax * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    r = tl.where(ax < 0.015625, sub, nrm)
    return tl.where(x < 0, -r, r)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32, in int32 arithmetic. Interpreter only: NOTE
    its fp32 -> bf16 cast truncates instead of rounding to nearest even, which shows as extra error against the
    references."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)
