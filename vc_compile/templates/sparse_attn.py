"""Token-gather sparse attention: the MC-Sparse reuse-step kernel (SPEC 3.4 steps 3, 4, 6).

Contract: ``vc_compile/reference/sparse_attn.py`` (16-bit QK) and ``reference/sparse_attn_q8.py``
(``qk_format="fp8"``).

Notation
--------
q, k, v     [B, H, S, D], [B, H, Sk, D], [B, H, Sk, Dv]; bf16 or fp16, last dim contiguous.
C           group size = the kernel's query tile (BLOCK_M); G = ceil(S / C) groups, the last partial.
sigma       [B, H, S] int64 query order; group g = queries sigma[g*C : (g+1)*C].
idx         [B, H, G, n_keep] int32: keys kept by group g, sorted ascending (any strides: a broadcast
            ``arange(Sk).expand(...)`` is the dense case without materialising it).
s           base-2 logits ``(q . k) * sm_scale * log2(e)``; online softmax with exp2.
residual    [B, H, S, Dv] in the original query order (R = O_dense - O_sparse of the anchor step),
            added in the epilogue.
flag        optional [B, H, Dv] int32 from ``templates/finite_flags.py``: the epilogue writes NaN into the
            flagged columns (NaN/Inf in keys or values no group selected: SDPA's non-finite pattern).
qk_format   "bf16": QK in the inputs' 16-bit type. "fp8": Q and K in E4M3 -- Q with one scale per group
            tile (amax over its C x D values / 448, quantised inside the kernel), K with one scale per
            token (``quantize_k_fp8``, a separate pass, since K changes every step). PV stays 16-bit:
            gathered V rows arrive MN-major and FP8 wgmma wants K-major B (~250 TFLOP/s measured).

Grid
----
``(G, B*H)``; program_id(0) = group g runs fastest, so the groups of one head run together and that
head's K/V (2 * Sk * D * 2 bytes: 16.8 MB at Sk = 32760, D = 128) stays in L2 ("head-major"). Each
program gathers its C query rows through sigma, loops over its n_keep keys in BLOCK_N chunks
(pointer-gathered K and V rows: Hopper has no TMA gather; Triton pipelines the indirect loads),
and in the epilogue divides by the row sums, adds the residual and scatters row i to sigma[g*C + i].

Launch configuration (BLOCK_N, warps, stages): ``config=``, else one lookup in ``vc_compile/tune``
(shipped sm_90 table = ``_CONFIGS``, else the local cache, else the fastest of SWEPT, tuned on first
use; the first candidate under the interpreter). docs/autotune.md.

Cost per program: 4 * C * n_keep * D FLOPs; n_keep * (D + Dv) * 2 bytes gathered (mostly L2 hits),
i.e. C / 2 = 32 FLOP per gathered byte at C = 64 (128-row tiles would double it).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_MAX = 448.0


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_upcast(*dtypes) -> bool:
    """NOTE the Triton 3.6 interpreter's ``tl.dot`` multiplies bf16 operands as their uint16 bit
    patterns (it stores bf16 as uint16 and calls np.matmul), so under the interpreter bf16 operands are
    cast to fp32 first (after the same bf16 rounding the GPU path does)."""
    return _interpret() and torch.bfloat16 in dtypes


def interpret_bound(n: int) -> int:
    """A loop bound's constexpr copy: ``n`` under the interpreter, 0 (use the runtime value) on GPU.

    NOTE the Triton 3.6 interpreter runs ``range(0, n)`` on a runtime scalar through
    ``int(np.array([n]))``, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted").
    Kernels therefore take every loop bound twice: runtime (GPU: one compile for all lengths) and
    constexpr (interpreter only)."""
    return int(n) if _interpret() else 0


@triton.jit
def round_e4m3(x):
    """fp32 x (|x| <= 448) -> nearest E4M3 value (ties to even), in fp32 arithmetic.

    Only used under the interpreter: its fp32 -> e4m3 cast mis-rounds when rounding carries into the
    exponent (SPEC 6). Adding c = 1.5 * 2^(e+20) puts the fp32 ulp at 2^(e-3), the E4M3 ulp of
    binade e (e >= -6: subnormals share the 2^-9 step)."""
    ax = tl.abs(x)
    e = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    c = (((e + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (ax + c) - c
    return tl.where(x < 0, -r, r)


@triton.jit
def _quant_rows_fp8_kernel(X, XQ, XS, H, S, sxb, sxh, sxs,
                           D: tl.constexpr, BLOCK: tl.constexpr, SW_ROUND: tl.constexpr):
    """One scale per row (token): grid (cdiv(S, BLOCK), B*H). XQ [B*H, S, D] e4m3, XS [B*H, S] fp32."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < S
    d = tl.arange(0, D)
    base = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
    x = tl.load(base + rows[:, None].to(tl.int64) * sxs + d[None, :], mask=rmask[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    # NOTE IEEE divisions (div_rn): Triton's `/` is div.full.f32 (~2 ulp) on sm_90, which made scales
    # and codes differ from the reference (tests/test_sparse_attn.py, first H200 run)
    scale = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None] + tl.zeros_like(x)), -448.0), 448.0)
    if SW_ROUND:
        y = round_e4m3(y)
    out = bh.to(tl.int64) * S * D + rows[:, None].to(tl.int64) * D + d[None, :]
    tl.store(XQ + out, y.to(tl.float8e4nv), mask=rmask[:, None])
    tl.store(XS + bh.to(tl.int64) * S + rows, scale, mask=rmask)


def quantize_k_fp8(k: torch.Tensor):
    """K [B, H, Sk, D] -> (codes [B, H, Sk, D] float8_e4m3fn, scale [B, H, Sk] fp32): per-token scale
    amax/448 (1 for an all-zero row), codes = clamp(k / scale) rounded to nearest even."""
    B, H, S, D = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    kq = torch.empty(B, H, S, D, device=k.device, dtype=torch.float8_e4m3fn)
    ks = torch.empty(B, H, S, device=k.device, dtype=torch.float32)
    BLOCK = 64
    _quant_rows_fp8_kernel[(triton.cdiv(S, BLOCK), B * H)](
        k, kq, ks, H, S, k.stride(0), k.stride(1), k.stride(2),
        D=D, BLOCK=BLOCK, SW_ROUND=_interpret(), num_warps=4)
    return kq, ks


@triton.jit
def _sparse_attn_kernel(Q, K, V, KS, SIGMA, IDX, RES, OUT, FLAG,
                        sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                        sib, sih, sig, sin, srb, srh, srs, sob, soh, sos,
                        H, S, Sk, N_KEEP, sm_scale_log2,
                        C: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
                        EVEN_N: tl.constexpr, HAS_RES: tl.constexpr, QK_FP8: tl.constexpr,
                        SW_ROUND: tl.constexpr, N_KEEP_I: tl.constexpr,
                        UPCAST: tl.constexpr, OFF64: tl.constexpr, RESCALE_TAU: tl.constexpr,
                        KV_OFF: tl.constexpr, HAS_FLAG: tl.constexpr):
    g = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = g * C + tl.arange(0, C)
    mrow = offs_m < S
    rows = tl.load(SIGMA + bh.to(tl.int64) * S + offs_m, mask=mrow, other=0)
    # NOTE in-head offsets in int32 unless they could overflow (OFF64): 64-bit address math per gathered
    # element is extra integer work in the inner loop
    rows = rows.to(tl.int64) if OFF64 else rows.to(tl.int32)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + d[None, :], mask=mrow[:, None], other=0.0)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    i_base = IDX + b * sib + h * sih + g.to(tl.int64) * sig
    if QK_FP8:
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf))
        q_scale = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
        qf = tl.minimum(tl.maximum(tl.div_rn(qf, q_scale + tl.zeros_like(qf)), -448.0), 448.0)  # IEEE div
        if SW_ROUND:
            qf = round_e4m3(qf)
        q = qf.to(tl.float8e4nv)
        col_scale = q_scale * sm_scale_log2
        ks_base = KS + bh.to(tl.int64) * Sk
    m_i = tl.full([C], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([C], dtype=tl.float32)
    acc = tl.zeros([C, DV], dtype=tl.float32)
    # interpreter: N_KEEP_I (see interpret_bound); inline, since the interpreter turns every
    # assignment into a tensor
    for n0 in range(0, N_KEEP_I if N_KEEP_I > 0 else N_KEEP, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if EVEN_N:
            kid = tl.load(i_base + offs_n * sin)
        else:
            kid = tl.load(i_base + offs_n * sin, mask=offs_n < N_KEEP, other=0)
        kid = kid.to(tl.int64) if OFF64 else kid.to(tl.int32)
        if KV_OFF:  # one offset tensor for the K and the V gather (same row stride, D == DV)
            kv_off = kid[:, None] * sks + d[None, :]
            kt = tl.load(k_base + kv_off)
        else:
            kt = tl.load(k_base + kid[:, None] * sks + d[None, :])
        if UPCAST:  # interpreter: see dot_upcast()
            qk = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)))
        else:
            qk = tl.dot(q, tl.trans(kt))
        if QK_FP8:
            s = qk * (tl.load(ks_base + kid) * col_scale)[None, :]
        else:
            s = qk  # scaled inside the exp2 below (one FMA per element instead of FMUL + FADD)
        if not EVEN_N:
            s = tl.where((offs_n < N_KEEP)[None, :], s, float("-inf"))
        m_blk = tl.max(s, 1) if QK_FP8 else tl.max(s, 1) * sm_scale_log2
        if RESCALE_TAU > 0:  # lazy: keep a stale max while it is within 2^tau of the block's
            m_new = tl.where(m_blk > m_i + RESCALE_TAU, m_blk, m_i)
        else:
            m_new = tl.maximum(m_i, m_blk)
        if QK_FP8:
            p = tl.exp2(s - m_new[:, None])
        else:
            p = tl.exp2(s * sm_scale_log2 - m_new[:, None])
        if RESCALE_TAU > 0:
            # tile-uniform skip of the C x DV rescale (a cross-warp max per tile); p <= 2^tau, exact up
            # to rounding since acc and l_i share the same m
            if tl.max((m_new > m_i).to(tl.int32), 0) > 0:
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
            l_i = l_i + tl.sum(p, 1)
        else:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        if KV_OFF:
            vt = tl.load(v_base + kv_off)
        else:
            vt = tl.load(v_base + kid[:, None] * svs + dv[None, :])
        if UPCAST:
            acc = tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(vt.dtype), vt, acc)
        m_i = m_new
    o = acc / l_i[:, None]
    if HAS_RES:
        r = tl.load(RES + b * srb + h * srh + rows[:, None] * srs + dv[None, :], mask=mrow[:, None],
                    other=0.0)
        o = o + r.to(tl.float32)
    if HAS_FLAG:  # NaN/Inf in keys/values this group did not select (templates/finite_flags.py)
        bad = tl.load(FLAG + bh.to(tl.int64) * DV + dv)
        o = tl.where(bad[None, :] != 0, float("nan"), o)
    tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + dv[None, :], o.to(OUT.dtype.element_ty),
             mask=mrow[:, None])


# NOTE configs (BLOCK_N, num_warps, num_stages) per (qk_format, D, C). H200, S = 32760, s = 0.15, C = 64
# (first run, docs/sparse_notes.md): bf16 BN64/w4/s4 8.99 ms, s3 9.06, BN32/w4/s4 9.35, s2 11.5,
# BN128/w4 12.5, 8 warps 12.9-15.7; fp8 BN64/w4/s3 9.68, s4 9.79, BN128 10.2, 8 warps 17.7-20.0.
# C = 128 (second run): bf16 BN64/w4/s3 and s4 7.60 ms, BN128/w8 8.87, BN64/w8 9.16, BN128/w4 13.7;
# fp8 BN128/w4/s3 8.13, BN64/w4 8.65, 8 warps 9.9-10.1.
_CONFIGS = {
    ("bf16", 64, 64): (128, 4, 3),
    ("bf16", 128, 64): (64, 4, 4),
    ("fp8", 64, 64): (128, 4, 3),
    ("fp8", 128, 64): (64, 4, 3),
    ("bf16", 128, 128): (64, 4, 3),
    ("fp8", 128, 128): (128, 4, 3),
}


# The autotuner's candidates (vc_compile/tune): the configs both H200 sweeps compiled and timed
# (C = 64 first run, C = 128 benchmarks/bench_sparse_attn.py SWEEP_C128); default_config's answer is
# put first, so an untuned run launches exactly what it launched before the tuner existed.
SWEPT = ((64, 4, 3), (64, 4, 4), (64, 4, 2), (32, 4, 4), (128, 4, 3), (64, 8, 3), (64, 8, 4), (128, 8, 3))


# Code-generation switches of _sparse_attn_kernel (benchmarks/bench_sparse_attn.py --ab times them; the
# defaults are the measured kernel). rescale_tau: 0 = rescale acc and l by exp2(m_old - m_new) every tile;
# tau > 0 = FA4-style lazy rescaling: the running max moves only when a row's tile max exceeds it by more
# than tau (log2 units), and the C x DV acc rescale is skipped when no row of the tile moved.
# kv_off: the V gather reuses the K gather's offsets (applies only when K and V have the same row stride
# and D == DV; ignored otherwise).
# NOTE sm_90 codegen (scripts/codegen_sparse.py, S = 32760, bf16, residual on; docs/sparse_notes.md):
# C = 128 BN64/w4: 255 registers, 228 B spilled, 96 KB smem, 2 CTAs/SM; key loop 720 SASS instructions
# (41 of them spill loads/stores, 128 FMULs of the acc rescale, 68 MUFU); kv_off: 671, 13 spill
# instructions. rescale_tau > 0: ptxas C7515 "wgmma serialized" (warpgroup waits in the loop 3 -> 48),
# since the acc is defined inside an scf.if; expected slower, kept to measure what that costs.
# NOTE measured (H200, S = 32760, s = 0.15, bf16, 2026-11-29, bf83f15, `--ab`): kv_off at C = 128 (BN64/w4)
# 7.871 -> 7.482 ms kernel, 7.973 -> 7.585 ms reuse step (4.76x -> 5.00x cuDNN), identical output; at
# C = 64 (BN64/w4/s4) 8.854 -> 9.015 ms (+1.8%). rescale_tau = 8: +4.3% (C = 128), +11% (C = 64). So
# kv_off is on for C >= 128 (None = that rule), rescale_tau stays off.
SWITCHES = {"rescale_tau": 0.0, "kv_off": None}


def _switch_args(switches, same_kv_rows: bool, C: int) -> dict:
    sw = dict(SWITCHES)
    for key, val in (switches or {}).items():
        if key not in sw:
            raise ValueError(f"sparse_attention: unknown switch {key!r} (known: {sorted(sw)})")
        sw[key] = val
    kv_off = C >= 128 if sw["kv_off"] is None else bool(sw["kv_off"])
    return {"RESCALE_TAU": float(sw["rescale_tau"]), "KV_OFF": kv_off and same_kv_rows}


def default_config(qk_format: str, D: int, C: int):
    return _CONFIGS.get((qk_format, D, C), (64, 4, 3))


def as_config(cfg) -> dict:
    bn, nw, ns = cfg
    return {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}


@functools.lru_cache(maxsize=None)
def candidates(qk_format: str, D: int, C: int):
    """The tuner's candidates (``as_config`` form), the default first."""
    first = default_config(qk_format, D, C)
    return [as_config(c) for c in (first,) + tuple(c for c in SWEPT if c != first)]


def tune_variant(qk_format: str, C: int, n_keep: int, Sk: int) -> str:
    """The variant field of this kernel's tuning key: QK format, group size, density to 0.05."""
    return f"{qk_format}-c{C}-p{int(round(20 * n_keep / Sk)) * 5}"


def _lookup(q, k, v, sigma, idx, sm_scale, C, residual, out_dtype, fmt, k_fp8):
    from vc_compile.tune import lookup

    D, Sk, n_keep = q.shape[3], k.shape[2], idx.shape[3]

    def launch(c):
        return sparse_attention_launch(q, k, v, sigma, idx, sm_scale=sm_scale, group_size=C, residual=residual,
                                       out_dtype=out_dtype, qk_format=fmt, k_fp8=k_fp8,
                                       config=(c["BLOCK_N"], c["num_warps"], c["num_stages"]))
    c, _ = lookup.resolve("sparse_attn", __file__, candidates(fmt, D, C), dtype=q.dtype, head_dim=D,
                          seq_len=q.shape[2], variant=tune_variant(fmt, C, n_keep, Sk), device=q.device,
                          bench=lookup.validated_bench(launch))
    return c["BLOCK_N"], c["num_warps"], c["num_stages"]


def _check_dim(name, d):
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"sparse_attention: {name} must be a power of two in [16, 256], got {d}")


def sparse_attention_launch(q, k, v, sigma, idx, *, sm_scale, group_size, residual=None,
                            out_dtype=None, qk_format="bf16", config=None, k_fp8=None, switches=None,
                            flag=None):
    """``sparse_attention`` with an explicit ``config = (BLOCK_N, num_warps, num_stages)`` (None = the
    tuning lookup, vc_compile/tune), an optional pre-quantised ``k_fp8 = (codes, scale)`` (benchmarks
    sweep configs with it) and ``switches``: overrides of ``SWITCHES`` (the A/B candidates)."""
    B, H, S, D = q.shape
    Sk, DV = k.shape[2], v.shape[3]
    C = int(group_size)
    G = triton.cdiv(S, C)
    if qk_format not in ("bf16", "fp8"):
        raise ValueError(f"sparse_attention: qk_format must be 'bf16' or 'fp8', got {qk_format!r}")
    if C < 16 or C & (C - 1):
        raise ValueError(f"sparse_attention: group_size must be a power of two >= 16, got {C}")
    _check_dim("head dim", D)
    _check_dim("value head dim", DV)
    if k.shape[:2] != (B, H) or k.shape[3] != D or v.shape[:3] != (B, H, Sk):
        raise ValueError(f"sparse_attention: shapes q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"v {tuple(v.shape)} do not match")
    if tuple(sigma.shape) != (B, H, S):
        raise ValueError(f"sparse_attention: sigma must be [B, H, S] = {(B, H, S)}, got {tuple(sigma.shape)}")
    if idx.dim() != 4 or tuple(idx.shape[:3]) != (B, H, G) or idx.shape[3] < 1:
        raise ValueError(f"sparse_attention: idx must be [B, H, G={G}, n_keep>=1], got {tuple(idx.shape)}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    sigma = sigma.to(torch.int64).contiguous()
    if idx.dtype not in (torch.int32, torch.int64):
        idx = idx.to(torch.int32)
    n_keep = idx.shape[3]
    out = torch.empty(B, H, S, DV, device=q.device, dtype=out_dtype or q.dtype)
    fmt = "fp8" if qk_format == "fp8" else "bf16"
    if fmt == "fp8":
        kq, ks = k_fp8 if k_fp8 is not None else quantize_k_fp8(k)
    else:
        kq, ks = k, k  # KS unused
    BLOCK_N, warps, stages = config or _lookup(q, k, v, sigma, idx, sm_scale, C, residual, out_dtype, fmt,
                                               (kq, ks) if fmt == "fp8" else None)
    has_res = residual is not None
    if has_res:
        if tuple(residual.shape) != (B, H, S, DV):
            raise ValueError(f"sparse_attention: residual must be {(B, H, S, DV)}, got {tuple(residual.shape)}")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    res = residual if has_res else out
    if flag is not None and (tuple(flag.shape) != (B, H, DV) or flag.dtype != torch.int32):
        raise ValueError(f"sparse_attention: flag must be int32 {(B, H, DV)}, got {flag.dtype} {tuple(flag.shape)}")
    _sparse_attn_kernel[(G, B * H)](
        q, kq, v, ks, sigma, idx, res, out, flag.contiguous() if flag is not None else out,
        q.stride(0), q.stride(1), q.stride(2), kq.stride(0), kq.stride(1), kq.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2), idx.stride(3),
        res.stride(0), res.stride(1), res.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, S, Sk, n_keep, float(sm_scale) * LOG2E,
        C=C, D=D, DV=DV, BLOCK_N=BLOCK_N, EVEN_N=(n_keep % BLOCK_N == 0), HAS_RES=has_res,
        QK_FP8=(fmt == "fp8"), SW_ROUND=_interpret(), N_KEEP_I=interpret_bound(n_keep),
        UPCAST=dot_upcast(q.dtype, v.dtype),
        OFF64=max(S * max(q.stride(2), out.stride(2), res.stride(2)), Sk * max(kq.stride(2), v.stride(2))) >= 2**31,
        **_switch_args(switches, same_kv_rows=(kq.stride(2) == v.stride(2) and D == DV and fmt == "bf16"), C=C),
        HAS_FLAG=flag is not None, num_warps=warps, num_stages=stages)
    return out


def sparse_attention(q, k, v, sigma, idx, *, sm_scale: float, group_size: int,
                     residual: Optional[torch.Tensor] = None, out_dtype=None, qk_format: str = "bf16",
                     flag: Optional[torch.Tensor] = None):
    """O[sigma[g*C+i]] = softmax over the keys idx[g] of group g (renormalised) @ V, + residual.

    ``flag`` [B, H, Dv] int32 (``finite_flags``): NaN in the flagged output columns of each head.
    Returns [B, H, S, Dv] in ``out_dtype`` (default q.dtype), in the original query order."""
    return sparse_attention_launch(q, k, v, sigma, idx, sm_scale=sm_scale, group_size=group_size,
                                   residual=residual, out_dtype=out_dtype, qk_format=qk_format, flag=flag)
