"""Token-gather sparse attention: the MC-Sparse reuse-step kernel (docs/methods.md, MC-Sparse steps 3, 4, 6).

Contract: ``vc_compile/reference/sparse_attn.py`` (16-bit QK) and ``reference/sparse_attn_q8.py``
(``qk_format="fp8"``).

Notation
--------
q, k, v     [B, H, S, D], [B, H, Sk, D], [B, H, Sk, Dv]; bf16 or fp16, last dim contiguous.
C           group size = the kernel's query tile (BLOCK_M); G = ceil(S / C) groups, the last partial.
sigma       [B, H, S] int64 or int32 query order; group g = queries sigma[g*C : (g+1)*C].
idx         [B, H, G, n] int16 / int32 / int64, sorted ascending (any strides: a broadcast
            ``arange(Sk).expand(...)`` is the dense case without materialising it): the keys kept by group g
            (``run = 1``), or run numbers r of aligned runs of RUN keys (keys r*RUN .. r*RUN + RUN - 1); n_keep =
            n * RUN keys. Key j of the group's list is idx[j // RUN] * RUN + j % RUN (RUN a power of two: a shift).
s           base-2 logits ``(q . k) * sm_scale * log2(e)``; online softmax with exp2.
residual    [B, H, S, Dv] in the original query order (R = O_dense - O_sparse of the anchor step),
            added in the epilogue; 8-bit codes (int8 or FP8 E4M3) with ``res_scale`` [B, H, S] fp32 (one scale a
            token: R = codes x scale in fp32, half the bytes of a bf16 R read per step).
flag        optional [B, H, Dv] int32 from ``kernels/finite_flags.py``: the epilogue writes NaN into the
            flagged columns (NaN/Inf in keys or values no group selected: SDPA's non-finite pattern).
qk_format   "bf16": QK in the inputs' 16-bit type. "fp8": Q and K in E4M3 -- Q with one scale per group
            tile (amax over its C x D values / 448, quantised inside the kernel), K with one scale per
            token (``quantize_k_fp8``, a separate pass, since K changes every step). PV stays 16-bit:
            gathered V rows arrive MN-major and FP8 wgmma wants K-major B (an FP8 PV
            gather measured far slower; docs/design/sparse-qk8-scale.md).

Grid
----
``(G, B*H)``; program_id(0) = group g runs fastest, so the groups of one head run together and that
head's K/V (2 * Sk * D * 2 bytes: 16.8 MB at Sk = 32760, D = 128) stays in L2 ("head-major"). Each
program gathers its C query rows through sigma, loops over its n_keep keys in BLOCK_N chunks
(pointer-gathered K and V rows: Hopper has no TMA gather; Triton pipelines the indirect loads),
and in the epilogue divides by the row sums, adds the residual and scatters row i to sigma[g*C + i].

Launch configuration: a ``configs.SparseAttnConfig`` (BLOCK_N, warps, stages, kv_off; ``launch=``; the
measured defaults and the tuner's candidates are in ``configs.py``, the choice per launch in
``dispatch.py``). docs/autotune.md.

Cost per program: 4 * C * n_keep * D FLOPs; n_keep * (D + Dv) * 2 bytes gathered (mostly L2 hits),
i.e. C = 64 FLOP per gathered byte at C = 64 (128-row tiles would double it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vc_compile.formats import LOG2E
from vc_compile.kernels.compat import assembled
from vc_compile.kernels.configs import SparseAttnConfig, pow2_head_dim_error
from vc_compile.kernels.interpret import dot_upcast, interpreting, loop_bound
from vc_compile.kernels.soft_round import round_e4m3


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
    # and codes differ from the reference (tests/kernels/test_sparse_attn.py)
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
        D=D, BLOCK=BLOCK, SW_ROUND=interpreting(), num_warps=4)
    return kq, ks


@triton.jit
def _k_stats_kernel(K, PART, S, H, skb, skh, sks, rows_per, D: tl.constexpr, BLOCK: tl.constexpr,
                    ROWS_C: tl.constexpr):
    """Per (split, b*h): the channel sums, maxima and minima of rows [split * rows_per, ...) of K ->
    PART [B*H, n_split, 3, D] fp32."""
    sp = tl.program_id(0)
    bh = tl.program_id(1)
    base = K + (bh // H).to(tl.int64) * skb + (bh % H).to(tl.int64) * skh
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    hi = tl.full([D], float("-inf"), tl.float32)
    lo = tl.full([D], float("inf"), tl.float32)
    r0 = sp * rows_per
    for r in range(0, ROWS_C if ROWS_C >= 0 else rows_per, BLOCK):  # rows_per: a multiple of BLOCK
        rows = r0 + r + tl.arange(0, BLOCK)
        m = rows < S
        x = tl.load(base + rows[:, None].to(tl.int64) * sks + d[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(x, 0)
        hi = tl.maximum(hi, tl.max(tl.where(m[:, None], x, float("-inf")), 0))
        lo = tl.minimum(lo, tl.min(tl.where(m[:, None], x, float("inf")), 0))
    out = PART + (bh * tl.num_programs(0) + sp).to(tl.int64) * 3 * D
    tl.store(out + d, acc)
    tl.store(out + D + d, hi)
    tl.store(out + 2 * D + d, lo)


@triton.jit
def _k_codes_kernel(K, MEAN, INV, K8, S, H, skb, skh, sks, D: tl.constexpr, BLOCK: tl.constexpr):
    """codes = round-to-nearest-even((k - mean) x inv) as int8 (|.| <= 127 by construction of inv)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    base = K + (bh // H).to(tl.int64) * skb + (bh % H).to(tl.int64) * skh
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    m = rows < S
    x = tl.load(base + rows[:, None].to(tl.int64) * sks + d[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    y = (x - tl.load(MEAN + bh * D + d)[None, :]) * tl.load(INV + bh)
    y = tl.minimum(tl.maximum((y + 12582912.0) - 12582912.0, -127.0), 127.0)  # the magic add: nearest even
    tl.store(K8 + bh.to(tl.int64) * S * D + rows[:, None].to(tl.int64) * D + d[None, :], y.to(tl.int8),
             mask=m[:, None])


def quantize_k_int8_head(k: torch.Tensor):
    """K [B, H, Sk, D] -> (codes [B, H, Sk, D] int8, scale [B, H] fp32) for the sm_90 gather kernel's 8-bit QK:
    K smoothed (its token mean per head and channel subtracted: softmax is invariant to it, as in the 8-bit
    dense path), then ONE scale per head, amax / 127 with amax = max over channels of max(hi - mean, mean - lo)
    (1 for a constant head), codes = round-to-nearest-even((k - mean) x 127 / amax). One scale per head, not
    per token: the gathered keys' scores then need no per-column factor in the kernel (the scale folds into the
    row's exponent factor). Two passes over K (channel sums / extremes per split, then the codes) and a few
    [B, H, D] torch ops between them. Reference: ``reference/sparse_attn_q8.quantize_k_int8_head``."""
    B, H, S, D = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    # NOTE this pass costs most of what the 8-bit gather kernel saves at 32K tokens and s = 0.15, which is why
    # sparse_qk='int8' is opt-in; docs/design/sparse-qk8-scale.md
    BLOCK = 64
    n_split = max(1, min(triton.cdiv(S, BLOCK), 8192 // max(1, B * H)))
    rows_per = triton.cdiv(triton.cdiv(S, n_split), BLOCK) * BLOCK
    n_split = triton.cdiv(S, rows_per)
    part = torch.empty(B * H, n_split, 3, D, device=k.device, dtype=torch.float32)
    _k_stats_kernel[(n_split, B * H)](k, part, S, H, k.stride(0), k.stride(1), k.stride(2), rows_per, D=D,
                                      BLOCK=BLOCK, ROWS_C=loop_bound(rows_per), num_warps=4)
    mean = part[:, :, 0].sum(1) / S
    amax = torch.maximum(part[:, :, 1].amax(1) - mean, mean - part[:, :, 2].amin(1)).amax(1)
    ok = amax > 0
    scale = torch.where(ok, amax / 127.0, torch.ones_like(amax))
    inv = torch.where(ok, 127.0 / torch.where(ok, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    codes = torch.empty(B, H, S, D, device=k.device, dtype=torch.int8)
    _k_codes_kernel[(triton.cdiv(S, BLOCK), B * H)](k, mean.contiguous(), inv.contiguous(), codes, S, H,
                                                     k.stride(0), k.stride(1), k.stride(2), D=D, BLOCK=BLOCK,
                                                     num_warps=4)
    return codes, scale.view(B, H)


@triton.jit
def _sparse_attn_kernel(Q, K, V, KS, SIGMA, IDX, RES, RSCALE, OUT, FLAG,
                        sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                        sib, sih, sig, sin, srb, srh, srs, sob, soh, sos,
                        H, S, Sk, N_KEEP, sm_scale_log2,
                        C: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
                        EVEN_N: tl.constexpr, HAS_RES: tl.constexpr, QK_FP8: tl.constexpr,
                        SW_ROUND: tl.constexpr, N_KEEP_I: tl.constexpr,
                        UPCAST: tl.constexpr, OFF64: tl.constexpr, KV_OFF: tl.constexpr,
                        HAS_FLAG: tl.constexpr, RUN: tl.constexpr, HAS_RSCALE: tl.constexpr):
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
    # interpreter: N_KEEP_I (interpret.loop_bound); inline, since the interpreter turns every
    # assignment into a tensor
    for n0 in range(0, N_KEEP_I if N_KEEP_I >= 0 else N_KEEP, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if EVEN_N:
            kid = tl.load(i_base + (offs_n // RUN) * sin)
        else:
            kid = tl.load(i_base + (offs_n // RUN) * sin, mask=offs_n < N_KEEP, other=0)
        kid = kid.to(tl.int64) if OFF64 else kid.to(tl.int32)
        if RUN > 1:  # run numbers: key = run * RUN + position in the run
            kid = kid * RUN + offs_n % RUN
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
        m_new = tl.maximum(m_i, m_blk)
        if QK_FP8:
            p = tl.exp2(s - m_new[:, None])
        else:
            p = tl.exp2(s * sm_scale_log2 - m_new[:, None])
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
                    other=0.0).to(tl.float32)
        if HAS_RSCALE:  # 8-bit codes, one scale a token
            r = r * tl.load(RSCALE + bh.to(tl.int64) * S + rows, mask=mrow, other=0.0)[:, None]
        o = o + r
    if HAS_FLAG:  # NaN/Inf in keys/values this group did not select (kernels/finite_flags.py)
        bad = tl.load(FLAG + bh.to(tl.int64) * DV + dv)
        o = tl.where(bad[None, :] != 0, float("nan"), o)
    tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + dv[None, :], o.to(OUT.dtype.element_ty),
             mask=mrow[:, None])


def gather_operands(who: str, q, k, v, sigma, idx, G: int, run: int = 1):
    """(q, k, v, sigma, idx) checked against each other (``G`` query groups, runs of ``run`` keys) and in the form
    the gather kernels read: channel-contiguous q / k / v, contiguous int32 / int64 sigma, int16 / int32 / int64 ids
    (any strides). Shared by the gather kernels (this one and ``sparse_attn_sm90``)."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    if k.shape[:2] != (B, H) or k.shape[3] != D or v.shape[:3] != (B, H, Sk):
        raise ValueError(f"{who}: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} do not match")
    if tuple(sigma.shape) != (B, H, S):
        raise ValueError(f"{who}: sigma must be [B, H, S] = {(B, H, S)}, got {tuple(sigma.shape)}")
    if idx.dim() != 4 or tuple(idx.shape[:3]) != (B, H, G) or idx.shape[3] < 1:
        raise ValueError(f"{who}: idx must be [B, H, G={G}, n_keep>=1], got {tuple(idx.shape)}")
    if not (isinstance(run, int) and 1 <= run <= 128 and run & (run - 1) == 0):
        raise ValueError(f"{who}: run must be a power of two in [1, 128], got {run!r}")
    if Sk % run:
        raise ValueError(f"{who}: runs of {run} keys need a whole number of runs, got Sk = {Sk}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if sigma.dtype not in (torch.int32, torch.int64):
        sigma = sigma.to(torch.int64)
    sigma = sigma.contiguous()
    if idx.dtype not in (torch.int16, torch.int32, torch.int64):
        idx = idx.to(torch.int32)
    return q, k, v, sigma, idx


def epilogue_operands(who: str, residual, flag, out, shape, res_scale=None):
    """(the epilogue's residual tensor, its per-token scale): ``out`` as a placeholder for what is not given, the
    residual checked against the output shape ``(B, H, S, Dv)`` and made channel-contiguous, ``res_scale`` (FP8
    codes only) fp32 ``(B, H, S)``; ``flag`` checked as int32 ``(B, H, Dv)``. Shared by the gather kernels (this
    one and ``sparse_attn_sm90``)."""
    B, H, S, DV = shape
    codes = residual is not None and residual.dtype in (torch.float8_e4m3fn, torch.int8)
    if codes != (res_scale is not None):
        raise ValueError(f"{who}: res_scale goes with a residual of 8-bit codes (int8 or float8_e4m3fn) and only "
                         f"with it; got "
                         f"residual {None if residual is None else residual.dtype}, res_scale "
                         f"{'None' if res_scale is None else 'given'}")
    if res_scale is not None:
        if tuple(res_scale.shape) != (B, H, S) or res_scale.dtype != torch.float32:
            raise ValueError(f"{who}: res_scale must be fp32 {(B, H, S)}, got {res_scale.dtype} "
                             f"{tuple(res_scale.shape)}")
        res_scale = res_scale.contiguous()
    if residual is not None:
        if tuple(residual.shape) != (B, H, S, DV):
            raise ValueError(f"{who}: residual must be {(B, H, S, DV)}, got {tuple(residual.shape)}")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    if flag is not None and (tuple(flag.shape) != (B, H, DV) or flag.dtype != torch.int32):
        raise ValueError(f"{who}: flag must be int32 {(B, H, DV)}, got {flag.dtype} {tuple(flag.shape)}")
    return (residual if residual is not None else out), (res_scale if res_scale is not None else out)


def sparse_attention(q, k, v, sigma, idx, *, sm_scale, group_size, residual=None, out_dtype=None,
                     qk_format="bf16", launch: SparseAttnConfig, k_fp8=None, flag=None, run: int = 1,
                     res_scale=None):
    """O[sigma[g*C+i]] = softmax over the keys idx[g] of group g (renormalised) @ V, + residual, with the launch
    configuration ``launch``; ``k_fp8 = (codes, scale)``: K already quantised (``quantize_k_fp8``; benchmarks
    sweep configs with it); ``flag`` [B, H, Dv] int32 (``finite_flags``): NaN in the flagged output columns of
    each head; ``run``: idx holds run numbers of aligned runs of ``run`` keys; ``res_scale``: the per-token scale
    of a residual of 8-bit codes (int8 or FP8). Returns [B, H, S, Dv] in ``out_dtype`` (default q.dtype), in the original query order."""
    if not isinstance(launch, SparseAttnConfig):
        raise TypeError(f"launch must be a SparseAttnConfig, got {type(launch).__name__}")
    B, H, S, D = q.shape
    Sk, DV = k.shape[2], v.shape[3]
    C = int(group_size)
    G = triton.cdiv(S, C)
    if qk_format not in ("bf16", "fp8"):
        raise ValueError(f"sparse_attention: qk_format must be 'bf16' or 'fp8', got {qk_format!r}")
    if C < 16 or C & (C - 1):
        raise ValueError(f"sparse_attention: group_size must be a power of two >= 16, got {C}")
    for name, d in (("head dim", D), ("value head dim", DV)):
        err = pow2_head_dim_error(d, name)
        if err:
            raise ValueError(f"sparse_attention: {err}")
    q, k, v, sigma, idx = gather_operands("sparse_attention", q, k, v, sigma, idx, G, run)
    n_keep = idx.shape[3] * run
    out = torch.empty(B, H, S, DV, device=q.device, dtype=out_dtype or q.dtype)
    fmt = "fp8" if qk_format == "fp8" else "bf16"
    if fmt == "fp8":
        kq, ks = k_fp8 if k_fp8 is not None else quantize_k_fp8(k)
    else:
        kq, ks = k, k  # KS unused
    BLOCK_N, warps, stages = launch.block_n, launch.num_warps, launch.num_stages
    kv_off = C >= 128 if launch.kv_off is None else launch.kv_off
    same_kv_rows = kq.stride(2) == v.stride(2) and D == DV and fmt == "bf16"
    has_res = residual is not None
    res, rscale = epilogue_operands("sparse_attention", residual, flag, out, (B, H, S, DV), res_scale)
    _sparse_attn_kernel[(G, B * H)](
        q, kq, v, ks, sigma, idx, res, rscale, out, flag.contiguous() if flag is not None else out,
        q.stride(0), q.stride(1), q.stride(2), kq.stride(0), kq.stride(1), kq.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2), idx.stride(3),
        res.stride(0), res.stride(1), res.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, S, Sk, n_keep, float(sm_scale) * LOG2E,
        C=C, D=D, DV=DV, BLOCK_N=BLOCK_N, EVEN_N=(n_keep % BLOCK_N == 0), HAS_RES=has_res,
        QK_FP8=(fmt == "fp8"), SW_ROUND=interpreting(), N_KEEP_I=loop_bound(n_keep),
        UPCAST=dot_upcast(q.dtype, v.dtype),
        OFF64=max(S * max(q.stride(2), out.stride(2), res.stride(2)), Sk * max(kq.stride(2), v.stride(2))) >= 2**31,
        KV_OFF=kv_off and same_kv_rows, HAS_FLAG=flag is not None, RUN=run, HAS_RSCALE=res_scale is not None,
        num_warps=warps, num_stages=stages)
    return out


assembled(globals())  # built with the sm_90 assembler of compat.py (a CUDA 12 ptxas where Triton picks 13+)
