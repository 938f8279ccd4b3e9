"""Non-finite flags of K and V, and the MC-Sparse guard's probe rows: one streaming pass over K and V on
each reuse step (docs/methods.md, MC-Sparse step 4; contract: ``vc_compile/reference/finite_flags.py``).

Notation
--------
k, v        [B, H, Sk, D], [B, H, Sk, Dv]; bf16, fp16 or fp32, last dim contiguous (other strides free).
flag        [B, H, Dv] int32: 1 where output column d of head (b, h) must be non-finite (any NaN/Inf in
            K of the head, or in column d of V), else 0. The gather kernel (``kernels/sparse_attn.py``,
            argument ``flag``) writes NaN there. Detected from the bits (exponent all ones), not with
            float arithmetic: ``x * 0`` or ``x != x`` tests can be folded away under fast-math flags,
            integer masks cannot.
strip       the keys one program scans: ``STRIP`` consecutive keys, in chunks of BLOCK_N rows.
R, rows     the guard's probe (``methods/mcsparse_guard.py``): R sampled query rows per head ([B, H, R]
            query indices). Each program also runs exact attention of those rows over its strip (online
            softmax, base 2) and writes the partial (max m, sum l, acc) -- flash-decoding's split-K.
            ``probe_error`` combines the strips and compares with the reuse step's output rows.

Grid and cost
-------------
Flags (+ probe): ``(n_strips, B*H)``, strips of one head side by side. Bytes: K and V read once
(2 x 335 MB at B = 1, H = 40, Sk = 32760, D = 128: at HBM3e bandwidth ~2% of a reuse step at that shape,
the pass's target; docs/design/finite-flags.md); the flag buffer is written by masked atomics only where a flag is set (never on clean
inputs). Probe: 4 R Sk D FLOPs per head (R = 16: 10.7 GFLOP at that shape, under the memory time) and
R (Dv + 2) fp32 partials per program. ``probe_error``: grid ``(B*H,)``, one program per head loops over
the strips' partials (R x Dv fp32 each) and the R output rows.

Launch configuration: a ``configs.FiniteFlagsConfig`` (BLOCK_N, warps, strip sizing; ``launch=``); the runtime
runs ``configs.FINITE_FLAGS_DEFAULT`` (``dispatch.finite_flags``; not tuned, not yet measured on a GPU).
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
import triton
import triton.language as tl

from vc_compile.formats import LOG2E
from vc_compile.kernels.compat import assembled
from vc_compile.kernels.configs import FiniteFlagsConfig
from vc_compile.kernels.interpret import dot_upcast, loop_bound

# exponent masks by element size: a float is NaN/Inf iff its exponent bits are all ones
_EXP = {torch.bfloat16: (16, 0x7F80), torch.float16: (16, 0x7C00), torch.float32: (32, 0x7F800000)}


@triton.jit
def _bad_bits(x, BITS: tl.constexpr, EXP: tl.constexpr):
    """int32 1 where the float x is NaN or +-Inf (exponent all ones), else 0."""
    if BITS == 16:
        xi = x.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        xi = x.to(tl.int32, bitcast=True)
    return ((xi & EXP) == EXP).to(tl.int32)


@triton.jit
def _flags_kernel(K, V, FLAG, Q, ROWS, PM, PL, PACC,
                  skb, skh, sks, svb, svh, svs, sqb, sqh, sqs,
                  H, Sk, n_strips, sm_scale_log2,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, STRIP: tl.constexpr,
                  R: tl.constexpr, BITS_K: tl.constexpr, EXP_K: tl.constexpr, BITS_V: tl.constexpr,
                  EXP_V: tl.constexpr, UPCAST: tl.constexpr):
    st = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    kacc = tl.zeros([BLOCK_N, D], dtype=tl.int32)
    vacc = tl.zeros([BLOCK_N, DV], dtype=tl.int32)
    if R > 0:
        r = tl.arange(0, R)
        rows = tl.load(ROWS + bh.to(tl.int64) * R + r).to(tl.int64)
        qs = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + d[None, :])
        m_i = tl.full([R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([R], dtype=tl.float32)
        acc = tl.zeros([R, DV], dtype=tl.float32)
    for n0 in range(0, STRIP, BLOCK_N):
        offs = st * STRIP + n0 + tl.arange(0, BLOCK_N)
        nmask = offs < Sk
        offs64 = offs.to(tl.int64)
        kt = tl.load(k_base + offs64[:, None] * sks + d[None, :], mask=nmask[:, None], other=0.0)
        vt = tl.load(v_base + offs64[:, None] * svs + dv[None, :], mask=nmask[:, None], other=0.0)
        kacc = kacc | _bad_bits(kt, BITS_K, EXP_K)
        vacc = vacc | _bad_bits(vt, BITS_V, EXP_V)
        if R > 0:
            if UPCAST:  # the interpreter's tl.dot mis-multiplies bf16 (interpret.dot_upcast)
                s = tl.dot(qs.to(tl.float32), tl.trans(kt.to(tl.float32)))
            else:
                s = tl.dot(qs, tl.trans(kt))
            s = tl.where(nmask[None, :], s * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if UPCAST:
                acc = tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), acc * alpha[:, None])
            else:
                acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
            m_i = m_new
    kbad = tl.max(tl.max(kacc, 1), 0)
    bad = tl.maximum(tl.max(vacc, 0), kbad)  # [DV]
    # masked: no atomic at all on clean inputs (the buffer starts at 0)
    tl.atomic_max(FLAG + bh.to(tl.int64) * DV + dv, bad, mask=bad > 0)
    if R > 0:
        part = bh.to(tl.int64) * n_strips + st
        tl.store(PM + part * R + r, m_i)
        tl.store(PL + part * R + r, l_i)
        tl.store(PACC + (part * R + r[:, None]) * DV + dv[None, :], acc)


@triton.jit
def _probe_error_kernel(PM, PL, PACC, OUT, ROWS, ERR, H, n_strips, sob, soh, sos,
                        DV: tl.constexpr, R: tl.constexpr, NS_I: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    r = tl.arange(0, R)
    dv = tl.arange(0, DV)
    m = tl.full([R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, DV], dtype=tl.float32)
    base = bh.to(tl.int64) * n_strips
    for s in range(0, NS_I if NS_I >= 0 else n_strips):  # NS_I: interpret.loop_bound
        pm = tl.load(PM + (base + s) * R + r)
        pl = tl.load(PL + (base + s) * R + r)
        pa = tl.load(PACC + ((base + s) * R + r[:, None]) * DV + dv[None, :])
        m_new = tl.maximum(m, pm)
        a_old = tl.exp2(m - m_new)
        a_new = tl.exp2(pm - m_new)
        l = l * a_old + pl * a_new
        acc = acc * a_old[:, None] + pa * a_new[:, None]
        m = m_new
    exact = acc / l[:, None]
    rows = tl.load(ROWS + bh.to(tl.int64) * R + r).to(tl.int64)
    got = tl.load(OUT + b * sob + h * soh + rows[:, None] * sos + dv[None, :]).to(tl.float32)
    diff = got - exact
    tl.store(ERR + bh.to(tl.int64) * 2, tl.sum(tl.sum(diff * diff, 1), 0))
    tl.store(ERR + bh.to(tl.int64) * 2 + 1, tl.sum(tl.sum(exact * exact, 1), 0))


class Partials(NamedTuple):
    """The probe's per-strip partials: m, l [B*H, n_strips, R], acc [B*H, n_strips, R, Dv] (fp32)."""
    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    shape: Tuple[int, int, int, int]  # (B, H, R, Dv)


def finite_flags(k: torch.Tensor, v: torch.Tensor, probe=None, *, launch: FiniteFlagsConfig):
    """(flag [B, H, Dv] int32, Partials or None); ``probe = (q, rows [B, H, R], sm_scale)``, R a power
    of two >= 16 (the probe's tl.dot tile)."""
    if not isinstance(launch, FiniteFlagsConfig):
        raise TypeError(f"launch must be a FiniteFlagsConfig, got {type(launch).__name__}")
    B, H, Sk, D = k.shape
    DV = v.shape[-1]
    if tuple(v.shape[:3]) != (B, H, Sk):
        raise ValueError(f"finite_flags: k {tuple(k.shape)} and v {tuple(v.shape)} do not match")
    for t in (k, v):
        if t.dtype not in _EXP:
            raise ValueError(f"finite_flags: dtype {t.dtype} unsupported (bf16, fp16, fp32)")
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    flag = torch.zeros(B, H, DV, device=k.device, dtype=torch.int32)
    STRIP = launch.strip_len(Sk, B * H)
    ns = triton.cdiv(Sk, STRIP)
    R = 0
    q = rows = pm = pl = pacc = k  # placeholders (unused when R == 0)
    sm_log2 = 0.0
    if probe is not None:
        q, rows, sm_scale = probe
        R = rows.shape[-1]
        if R < 16 or R & (R - 1) or tuple(rows.shape) != (B, H, R) or q.shape[:2] != (B, H) or q.shape[3] != D:
            raise ValueError(f"finite_flags: probe rows must be [B, H, R] with R a power of two >= 16 and q "
                             f"[B, H, S, D]; got rows {tuple(rows.shape)}, q {tuple(q.shape)}")
        if q.stride(-1) != 1:
            q = q.contiguous()
        rows = rows.to(torch.int32).contiguous()
        pm = torch.empty(B * H, ns, R, device=k.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        pacc = torch.empty(B * H, ns, R, DV, device=k.device, dtype=torch.float32)
        sm_log2 = float(sm_scale) * LOG2E
    bk, ek = _EXP[k.dtype]
    bv, ev = _EXP[v.dtype]
    _flags_kernel[(ns, B * H)](
        k, v, flag, q, rows, pm, pl, pacc,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        q.stride(0), q.stride(1), q.stride(2), H, Sk, ns, sm_log2,
        D=D, DV=DV, BLOCK_N=launch.block_n, STRIP=STRIP, R=R, BITS_K=bk, EXP_K=ek, BITS_V=bv, EXP_V=ev,
        UPCAST=R > 0 and dot_upcast(q.dtype, v.dtype), num_warps=launch.num_warps)
    return flag, (Partials(pm, pl, pacc, (B, H, R, DV)) if R > 0 else None)


def probe_rows(partials: Partials) -> torch.Tensor:
    """The exact rows [B, H, R, Dv] fp32 from the strips' partials (torch; tests and diagnostics)."""
    B, H, R, DV = partials.shape
    m = partials.m.amax(1, keepdim=True)
    w = torch.exp2(partials.m - m)
    out = (partials.acc * w[..., None]).sum(1) / (partials.l * w).sum(1)[..., None]
    return out.view(B, H, R, DV)


def probe_error(out: torch.Tensor, rows: torch.Tensor, partials: Partials) -> torch.Tensor:
    """[2] fp32: (sum ||out[row] - exact[row]||^2, sum ||exact[row]||^2) over the sampled rows."""
    B, H, R, DV = partials.shape
    if out.stride(-1) != 1:
        out = out.contiguous()
    rows = rows.to(torch.int32).contiguous()
    ns = partials.m.shape[1]
    err = torch.empty(B * H, 2, device=out.device, dtype=torch.float32)
    _probe_error_kernel[(B * H,)](partials.m, partials.l, partials.acc, out, rows, err, H, ns,
                                  out.stride(0), out.stride(1), out.stride(2),
                                  DV=DV, R=R, NS_I=loop_bound(ns), num_warps=4)
    return err.sum(0)


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
