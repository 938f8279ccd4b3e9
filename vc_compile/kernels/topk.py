"""Top-K keys per row of the group masses by a radix threshold select (MC-Sparse anchor step).

Contract: ``vc_compile/reference/topk.py`` (key order, tie rule: lowest index first, exactly K per row,
output sorted ascending). Replaces ``torch.topk`` + ``torch.sort``, which took several times the kernel's time
(docs/design/anchor-mass-config.md).

Notation
--------
x           one row of ``mass [..., N]`` (fp32 or bf16/fp16), N keys.
key         order key of a value: its bits as an integer, negative patterns -> 0 (reference ``order_key``);
            KB = 31 (fp32) or 15 (16-bit) significant bits.
digit       DIGIT bits of the key (the last one may be narrower); pass p looks at bits
            [KB - DIGIT (p + 1), KB - DIGIT p) of the keys whose higher bits equal the prefix found so far.
T           the key of the K-th largest element (found digit by digit: a histogram of the digit over the
            still-matching keys, the largest bin b with count(digit >= b) >= need, need -= count(digit > b)).
need        after the last pass: how many keys EQUAL to T are kept (the first ones by index).
compaction  one more pass in index order: keep key > T, or key == T among the first ``need`` of those; the
            output slot of a kept index is (#gt before) + min(#eq before, need), from one exclusive scan of
            ``gt + (eq << 16)`` per chunk (both counts < 2^16 per chunk) plus running totals.

Parallelisation: one program per row (grid = rows), looping over the row in chunks of BLOCK elements
ceil(KB / DIGIT) + 1 times (the row, 64-150 KB in bf16 at S = 32760-75600, stays in L1/L2 after the first
pass). Cost per row: (ceil(KB / DIGIT) + 1) N loads, ceil(KB / DIGIT) ``tl.histogram`` of N digits, one
N-element scan; no sort, no atomics in global memory, deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vc_compile.kernels.compat import assembled
from vc_compile.kernels.configs import TOPK_DEFAULT, TopKConfig
from vc_compile.kernels.interpret import loop_bound


@triton.jit
def _keys(X, row_ptr, offs, n, n_load, IS16: tl.constexpr):
    """Order keys (int32) of the row elements ``offs`` and their validity (offs < n). Loads run to
    ``n_load`` >= n (the padded row where the storage has it): a mask that is constant over 8 elements lets
    them vectorise (NOTE sm_90 SASS: 16 LDG.E.U16 per 16 elements with the mask offs < n, n = 32760)."""
    m = offs < n
    if IS16:
        b = tl.load(X.to(tl.pointer_type(tl.int16)) + row_ptr + offs, mask=offs < n_load, other=0).to(tl.int32)
    else:
        b = tl.load(X.to(tl.pointer_type(tl.int32)) + row_ptr + offs, mask=offs < n_load, other=0)
    return tl.where(m & (b > 0), b, 0), m


@triton.jit
def _radix_pass(X, row_ptr, n, n_load, n_chunks, NCH_C: tl.constexpr, prefix, pmask, need, IS16: tl.constexpr,
                SHIFT: tl.constexpr, WIDTH: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr):
    """One digit: the histogram of bits [SHIFT, SHIFT + WIDTH) over the keys matching ``prefix`` on ``pmask``,
    the digit b of the K-th largest, and the updated (prefix, pmask, need)."""
    hist = tl.zeros([NB], dtype=tl.int32)
    for c in range(0, NCH_C if NCH_C > 0 else n_chunks):  # NCH_C: see interpret.loop_bound
        offs = c * BLOCK + tl.arange(0, BLOCK)
        key, m = _keys(X, row_ptr, offs, n, n_load, IS16)
        match = m & ((key & pmask) == prefix)
        hist += tl.histogram((key >> SHIFT) & ((1 << WIDTH) - 1), NB, mask=match)
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matching keys with digit >= b (non-increasing)
    b = tl.sum((ge >= need).to(tl.int32), 0) - 1
    need = need - tl.sum(tl.where(tl.arange(0, NB) > b, hist, 0), 0)
    return prefix | (b << SHIFT), pmask | (((1 << WIDTH) - 1) << SHIFT), need


@triton.jit
def _topk_kernel(X, OUT, n, n_load, row_stride, keep, n_chunks, NCH_C: tl.constexpr, IS16: tl.constexpr,
                 KB: tl.constexpr, DIGIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row * row_stride  # NOTE a row stride divisible by 16 (padded rows) lets the loads vectorise
    NB: tl.constexpr = 1 << DIGIT
    NPASS: tl.constexpr = (KB + DIGIT - 1) // DIGIT
    prefix = tl.zeros([], dtype=tl.int32)
    pmask = tl.zeros([], dtype=tl.int32)
    need = keep + tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(NPASS - 1):  # full digits, from the top
        prefix, pmask, need = _radix_pass(X, row_ptr, n, n_load, n_chunks, NCH_C, prefix, pmask, need, IS16,
                                          KB - DIGIT * (p + 1), DIGIT, NB, BLOCK)
    prefix, pmask, need = _radix_pass(X, row_ptr, n, n_load, n_chunks, NCH_C, prefix, pmask, need, IS16,
                                      0, KB - DIGIT * (NPASS - 1), NB, BLOCK)  # the last (narrower) digit
    # compaction in index order: every key > T, and the first `need` keys == T
    out_row = OUT + row * keep
    run_gt = 0
    run_eq = 0
    for c in range(0, NCH_C if NCH_C > 0 else n_chunks):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        key, m = _keys(X, row_ptr, offs, n, n_load, IS16)
        gt = (m & (key > prefix)).to(tl.int32)
        eq = (m & (key == prefix)).to(tl.int32)
        packed = gt + (eq << 16)
        ex = tl.cumsum(packed, 0) - packed  # exclusive: (#gt, #eq) before this element in the chunk
        eq_before = run_eq + (ex >> 16)
        sel = (gt != 0) | ((eq != 0) & (eq_before < need))
        pos = run_gt + (ex & 65535) + tl.minimum(eq_before, need)
        tl.store(out_row + pos, offs, mask=sel)
        tot = tl.sum(packed, 0)
        run_gt += tot & 65535
        run_eq += tot >> 16


def select_topk(mass: torch.Tensor, keep: int, *, launch: TopKConfig = TOPK_DEFAULT) -> torch.Tensor:
    """idx [..., keep] int32: the ``keep`` largest masses per row (ties: lowest index first), ascending."""
    if mass.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"select_topk: masses must be fp32, bf16 or fp16, got {mass.dtype}")
    N = mass.shape[-1]
    keep = int(keep)
    if not 1 <= keep <= N:
        raise ValueError(f"select_topk: keep must be in [1, {N}] (the row length), got {keep}")
    if N >= 2**31 // 2:
        raise ValueError(f"select_topk: rows of {N} elements are too long (int32 offsets)")
    x = mass if _uniform_rows(mass) else mass.contiguous()
    rows = x.numel() // N
    out = torch.empty(*mass.shape[:-1], keep, device=mass.device, dtype=torch.int32)
    if rows == 0:
        return out
    block = max(128, min(launch.block, triton.next_power_of_2(N)))
    n_chunks = triton.cdiv(N, block)
    is16 = x.element_size() == 2
    row_stride = x.stride(-2) if x.dim() > 1 else N
    # read whole padded rows when the storage holds them (the last row's padding included)
    end = (x.storage_offset() + (rows - 1) * row_stride + row_stride) * x.element_size()
    n_load = row_stride if row_stride % 8 == 0 and end <= x.untyped_storage().nbytes() else N
    _topk_kernel[(rows,)](x, out, N, n_load, row_stride, keep, n_chunks, loop_bound(n_chunks), IS16=is16,
                          KB=15 if is16 else 31, DIGIT=launch.digit, BLOCK=block, num_warps=launch.num_warps)
    return out


def _uniform_rows(x: torch.Tensor) -> bool:
    """Rows of the last dim at a constant stride (e.g. a [..., :N] view of padded rows), unit element stride."""
    if x.stride(-1) != 1 or x.dim() == 1:
        return x.stride(-1) == 1
    rs = x.stride(-2)
    if rs < x.shape[-1]:
        return False
    expect = rs
    for i in range(x.dim() - 2, -1, -1):
        if x.shape[i] > 1 and x.stride(i) != expect:
            return False
        expect *= x.shape[i]
    return True


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
