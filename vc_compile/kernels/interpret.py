"""What the kernels do differently under the Triton interpreter (``TRITON_INTERPRET=1``: CPU tests), in one
place: whether it is on (the one check of the variable), the loop bounds it can iterate and when its dot needs
fp32 operands. The roundings its casts get wrong are ``soft_round.py`` (jit helpers). NOTE the workarounds are
for the interpreters of Triton 3.6-3.9 (3.8+ raise on an all-NaN argmin, 3.9 refuses a block mask and-ed with a
scalar one: the kernels' ``INTERPRET`` branches); none of it changes a GPU compile. This module does not import triton (the
dispatch asks ``interpreting()`` on installs without it).
"""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """The one ``TRITON_INTERPRET`` check: Triton kernels run on the CPU interpreter (read per call: the tests
    set the variable before triton is imported, never after)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def loop_bound(n: int) -> int:
    """Constexpr copy of a runtime loop bound: ``n`` under the interpreter, else -1 (= use the runtime value,
    one compile for all lengths); kernels write ``range(0, N_C if N_C >= 0 else n)`` inline. NOTE the
    interpreter iterates ``range`` over a runtime scalar via ``int(np.array([n]))``, which numpy >= 2.4
    refuses, and it rewrites every assignment ``x = v`` into ``x = to_tensor(v)``, so the bound must not pass
    through a variable."""
    return int(n) if interpreting() else -1


def dot_upcast(*dtypes) -> bool:
    """NOTE the interpreter's ``tl.dot`` multiplies bf16 operands as their uint16 bit patterns (it stores bf16
    as uint16 and calls np.matmul), so under the interpreter bf16 operands are cast to fp32 first (after the
    same bf16 rounding the GPU path does)."""
    return interpreting() and torch.bfloat16 in dtypes
