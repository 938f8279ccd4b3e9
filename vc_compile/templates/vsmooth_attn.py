"""8-bit attention with V-Smooth mean compensation and optional ExpCast-FP8 (SPEC 3.2 step 4, 3.3).

Contract: ``vc_compile/reference/vsmooth_attn.py`` (inputs from ``preprocess``'s QKQuant / VQuant).

Notation
--------
BM, BN      query rows per program, keys per inner step (BN = 128 = BLOCK_V: one V mean per step, two
            64-token K scales).
q8, k8      int8 (or E4M3) codes [B, H, S, D]; qs = [BM] q_scale of the program's query rows (one per
            token, ``sm_scale * log2 e`` folded in), ks = k_scale per key (one per 64 keys).
s~          = (q8 . k8) ks, the K-scaled scores of one [BM, BN] tile: ONE scale multiply per element (the
            scalar-per-column K scale, as before per-token Q scales). The base-2 logit is s = qs_i s~;
            qs_i is applied per ROW, never per element on its own: the row max is max_j s~ * qs_i
            (qs_i >= 0), and qs_i joins the FMA that already forms the exp2 argument / the ExpCast code
            (``fma(s~, qs_i, m_i - 8)`` instead of ``s - (m_i - 8)``; ``fma(s~, 8 qs_i, ...)`` instead of
            ``fma(s, 8, ...)``). Cost per score unchanged; the per-block ``ks * qs`` [BN] multiply is gone.
            Exception: the masked key-tail block (one per program) applies qs_i explicitly before the
            -inf mask (qs = 0, i.e. scale=0, would make 0 * -inf).
m_i         running row max of s (online softmax). P~ = fp8(256 * 2^(s - m_i)) (exp2 + cast), or the
            ExpCast E4M3 byte c = clamp(rne(8 (s - m_i) + 119.65), 0, 120): ``fma(s, 8, 119.65 - 8 m_i)``
            plus the 2^23 magic add rounds to the integer code (the fraction 0.65 must be added before the
            magic: a float cannot hold 2^23 + 119.65), one max clamps at 0, and the byte is the low byte
            of the fp32 bits, reinterpreted as float8e4nv (no cvt). EXPCAST == 1 saves the magic add: the
            row offset is rounded to an integer n_i = floor(119.65 - 8 m_i), so ``fma(s, 8, n_i + 2^23)``
            is the code in ONE instruction; that is ExpCast of u - delta_i, delta_i in [0, 1/8) (a per-row
            factor that cancels in the normalisation), but the row max is no longer exact (code 120):
            measured 5-7% larger error than the reference on peaked rows, so mode 2 is the default.
r_ij        row sum of the decoded P~ over key block j (what the PV MMA multiplied).
acc         the PV accumulator in units of v_scale: per block (two-level: a fresh MMA accumulator,
            then acc = acc * alpha + P~ R8_j + r_ij (mu_j / v_scale)); O = acc * v_scale / l.
lse         optional base-2 LSE of the *smoothed* logits: m'_i + log2 l_i - 8 (as the reference).
non-finite  (reference/preprocess.py) preprocessing marks a query row whose logits are undefined (a
            NaN/Inf in q row i, or any NaN/Inf in K of the head) with qs_i = NaN, a non-finite V channel
            with v_scale NaN. The epilogue sets l_i = NaN where qs_i is not finite (one select per row):
            the row is NaN whatever the inner loop did with it (ExpCast's max clamp and GPU fmax drop NaN);
            v_scale NaN makes column d NaN through the epilogue multiply (as SDPA: column d).

INT8 QK: the int32 scores (|qk| <= 127^2 * 128 < 2^22) are turned into floats without the
quarter-rate I2F: bits(qk + 0x4B400000) is the float 1.5 * 2^23 + qk, and s = fma(t, ks, -1.5 * 2^23 ks)
(error < 1 unit of qk * ks, far below the INT8 rounding of q and k).

Grid
----
``(ceil(S / BM), B * H)``: program_id(0) = query tile runs fastest, so the tiles of one head run
together and its K/V (2 * S * D bytes) stays in L2. Each program loads its Q tile once (TMA), loops over
the full key blocks (TMA loads of K [BN, D] and of V^T [D, BN], pipelined by ``num_stages``), then one
masked block for the key tail (padded keys get s = -inf, so P~ = 0). Q rows past S read the next head's
rows (finite) and are never stored.

Switches (constexpr; one kernel): QK_FP8 (E4M3 QK instead of INT8), EXPCAST (0 = exp2 + cast, 1/2 see
DEFAULT_EXPCAST_MODE), MEAN (0 for ``smooth=False`` V: no mean term, the "naive 8-bit" kernel; 1/2 see
DEFAULT_VARIANTS), ROWSUM (how r_ij is formed: decoding P~ on the ALUs, or ``P~ @ ones[BN, 16]`` on the
tensor cores; see DEFAULT_VARIANTS), RETURN_LSE, INTERPRET (fp32
-> e4m3 rounding done in software: the Triton 3.6 interpreter's cast mis-rounds).

Launch configuration ((BM, BN, warps, stages), ROWSUM, MEAN): one lookup in ``vc_compile/tune`` per
launch (shipped sm_90 table = DEFAULT_VARIANTS, else the local cache, else the fastest of CANDIDATES,
tuned on first use; the first candidate under the interpreter). docs/autotune.md.

Cost: 4 B H S Sk D FLOPs (half INT8, half FP8 MMA); bytes ~ B H (S D (1 + out bytes) + n_q_tiles Sk 2D)
with K/V re-read per query tile mostly from L2.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vc_compile.reference.preprocess import BLOCK_K, BLOCK_V, QKQuant, VQuant
from vc_compile.templates.preprocess import interpret, loop_bound, round_e4m3

# Per (head dim, expcast): ((BM, BN, num_warps, num_stages), ROWSUM, MEAN). NOTE: chosen on the H200,
# see docs/kernels_notes.md.
#   ROWSUM (row sum r_ij of P~ per block): 0 = decode to fp32 + sum, 1 = P~ @ ones[BN, 16] on the
#   tensor cores, 2 = decode to fp16 + fp16 sum (2^-11 relative), 3 = decode via fp16 to fp32 + sum,
#   4 = the fp32 p before the cast (NOT decoded: a cost measurement only, exp2 path).
#   MEAN (mean compensation): 1 = acc += r mu' per block (one FFMA per accumulator element), 2 = r mu'
#   as a bf16 hi/lo MMA [BM, 16] x [16, D] into the block's fresh accumulator (0 = no mean, set by a
#   smooth=False VQuant).
# NOTE (H200, S = 32760, H = 40, A/B of 22 variants, docs/kernels_notes.md v2): fastest variants that
# pass the accuracy/NaN check. D = 128: exp2 ROWSUM=1 589 TFLOP/s (ROWSUM=2 583, fp32 p 599), ExpCast
# ROWSUM=2 572; MEAN=2 costs 27% at D = 128 (427) but wins at D = 64 with BM = 128 (407-409 vs 353).
# NOTE exp2 + MEAN=1 gave NaN rows (~40%) with ROWSUM 0/3 at (64,128,4,3) and with ROWSUM=2 at
# (128,128,4,3) (a code-generation problem we did not pin down; ExpCast and MEAN=2 never did):
# test_gpu_no_nan_any_specialisation checks every specialisation of these defaults.
DEFAULT_VARIANTS: Dict[Tuple[int, bool], Tuple[Tuple[int, int, int, int], int, int]] = {
    (128, False): ((64, 128, 4, 3), 1, 1), (128, True): ((64, 128, 4, 3), 2, 1),
    (64, False): ((128, 128, 4, 3), 2, 2), (64, True): ((128, 128, 4, 3), 2, 2),
}
# Launch configurations the autotuner (vc_compile/tune) may pick per (head dim, expcast), FIRST = the
# measured default above (what runs when nothing is tuned). Only variants compiled on the H200 in the
# v2 A/B and marked correct there (docs/kernels_notes.md); exp2 + MEAN=1 is the default only: the
# other exp2 + MEAN=1 compiles are the NaN-prone family, so no tuner may pick one.
CANDIDATES: Dict[Tuple[int, bool], Tuple[Tuple[Tuple[int, int, int, int], int, int], ...]] = {
    (128, False): (((64, 128, 4, 3), 1, 1), ((64, 128, 4, 3), 2, 2)),
    (128, True): (((64, 128, 4, 3), 2, 1), ((64, 128, 4, 3), 0, 1), ((64, 128, 4, 3), 2, 2)),
    (64, False): (((128, 128, 4, 3), 2, 2), ((64, 128, 4, 3), 2, 2)),
    (64, True): (((128, 128, 4, 3), 2, 2), ((128, 128, 4, 3), 0, 1), ((64, 128, 4, 3), 2, 2),
                 ((64, 128, 4, 3), 0, 1)),
}
_FROZEN_DEFAULTS = dict(DEFAULT_VARIANTS)  # a benchmark that replaces an entry gets it as is (no lookup)
# ExpCast rounding: 1 = one FMA with an integer row offset (row reference m' in [m, m + 1/8)),
# 2 = the reference's rounding (fractional offset, + one FADD per element; the row max is exact).
DEFAULT_EXPCAST_MODE = 2
# Benchmarks and tests may set these; None = the defaults above.
EXPCAST_MODE_OVERRIDE: Optional[int] = None
MEAN_MODE_OVERRIDE: Optional[int] = None
CONFIG_OVERRIDE: Optional[Tuple[int, int, int, int]] = None
ROWSUM_OVERRIDE: Optional[int] = None
# Triton's automatic warp specialisation of the key loop (``tl.range(warp_specialize=True)``; on sm_90
# Triton 3.6 runs its Hopper producer/consumer pass: TMA loads in a producer warp group, MMAs + softmax in
# the consumers). Off by default until an H200 A/B shows it pays (``bench_vsmooth_attn.py --ab-plan ws``).
DEFAULT_WARP_SPEC = False
WARP_SPEC_OVERRIDE: Optional[bool] = None

# The Gluon kernel (vsmooth_attn_sm90.py: the MMAs overlapped with the softmax) runs instead of this one on
# sm_90 GPUs for INT8 Q/K when no launch configuration is given. None = that rule, False = never (the
# Triton kernel everywhere: benchmarks' side-by-side rows), True = also refuse to fall back silently.
# NOTE (H200, S = 32760, B = 1, H = 40, D = 128, same run): V-Smooth 34.49 vs 38.57 ms, + ExpCast 34.69
# vs 38.97, naive 8-bit 30.59 vs 34.85 (cuDNN 38.43); docs/kernels_notes.md "v3".
SM90_KERNEL: Optional[bool] = None

MAGIC_I2F = 0x4B400000  # bits of 1.5 * 2^23
MAGIC_F = 12582912.0  # 1.5 * 2^23


@triton.jit
def round_bf16(x):
    """fp32 -> nearest bf16 value (ties to even) in int32 arithmetic. Interpreter only: NOTE its fp32 ->
    bf16 cast truncates (measured: rel. L2 vs fp32 truth 3.8e-3 against torch's RNE 2.5e-3)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _attn_step(acc, l_i, m_i, q, qs, desc_k, desc_v, KS, VM, ivs, ones, kv_row, vt_row, start_n, Sk,
               BN: tl.constexpr, D: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
               MASK: tl.constexpr, QK_FP8: tl.constexpr, EXPCAST: tl.constexpr,
               MEAN: tl.constexpr, ROWSUM: tl.constexpr, INTERPRET: tl.constexpr):
    offs_n = start_n + tl.arange(0, BN)
    k = desc_k.load([kv_row + start_n, 0])
    if MASK:
        ks = tl.load(KS + offs_n // BKS, mask=offs_n < Sk, other=0.0)
    else:
        ks = tl.load(KS + offs_n // BKS)
    if QK_FP8:
        s = tl.dot(q, k.T) * ks[None, :]
    else:
        t = (tl.dot(q, k.T, out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)
        s = t * ks[None, :] + (ks * -12582912.0)[None, :]  # one FFMA (enable_fp_fusion)
    # s is s~ (K-scaled); qr [BM] is the row scale still to apply (qs, or 1 once applied)
    if MASK:  # key tail, one block per program: scale the rows before the -inf mask (0 * -inf = NaN)
        s = tl.where((offs_n < Sk)[None, :], s * qs[:, None], float("-inf"))
        qr = tl.full(qs.shape, 1.0, tl.float32)
    else:
        qr = qs
    rmax = tl.max(s, 1) * qr
    if EXPCAST == 1:
        # m_i holds n_i = floor(119.65 - 8 m): +inf before the first block, never increases.
        m_new = tl.minimum(m_i, tl.floor(119.65 - 8.0 * rmax))
        alpha = tl.math.exp2((m_new - m_i) * 0.125)
        x = tl.maximum(s * (8.0 * qr)[:, None] + (m_new + 8388608.0)[:, None], 8388608.0)
        p8 = x.to(tl.int32, bitcast=True).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    elif EXPCAST == 2:
        # the reference's rounding: c = rne(8 (s - m) + 119.65), the row max maps to code 120 exactly
        m_new = tl.maximum(m_i, rmax)
        alpha = tl.math.exp2(m_i - m_new)
        x = s * (8.0 * qr)[:, None] + (119.65 - 8.0 * m_new)[:, None]
        x = tl.maximum(x + 8388608.0, 8388608.0)
        p8 = x.to(tl.int32, bitcast=True).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        m_new = tl.maximum(m_i, rmax)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * qr[:, None] - (m_new - 8.0)[:, None])  # one FFMA, as s - m was one FADD
        if INTERPRET:
            p = round_e4m3(p)
        p8 = p.to(tl.float8e4nv)
    if ROWSUM == 1:  # on the tensor cores: P~ @ ones[BN, 16] (ones loaded once, before the loop)
        r = tl.max(tl.dot(p8, ones), 1)
    elif ROWSUM == 2:  # decoded to fp16 (exact), summed in fp16 (2^-11 relative), then fp32
        r = tl.sum(p8.to(tl.float16), 1).to(tl.float32)
    elif ROWSUM == 3:  # decoded to fp16 then fp32 (exact), summed in fp32
        r = tl.sum(p8.to(tl.float16).to(tl.float32), 1)
    elif ROWSUM == 4:  # NOT the contract: the fp32 p before the cast (exp2 only; a cost measurement)
        r = tl.sum(p, 1)
    else:  # decoded to fp32 (exact), summed in fp32
        r = tl.sum(p8.to(tl.float32), 1)
    l_i = l_i * alpha + r
    v = desc_v.load([vt_row, start_n])  # [D, BN] K-major
    pv = tl.dot(p8, v.T)  # fresh accumulator: the FP8 MMA's own accumulation stays within one block
    if MEAN == 2:
        # r_ij mu'_j on the tensor cores, in the same fresh accumulator: [r_hi r_hi r_lo 0..] (bf16,
        # [BM, 16]) @ [mu_hi; mu_lo; mu_hi; 0..] (bf16, [16, D]) = r mu' to ~2^-16 (fp32 accumulate)
        c16 = tl.arange(0, 16)
        r_hi = r.to(tl.bfloat16).to(tl.float32)
        a_mu = tl.where(c16[None, :] == 2, (r - r_hi)[:, None], tl.where(c16[None, :] < 2, r_hi[:, None],
                                                                         0.0))
        b_mu = tl.load(VM + ((start_n // BV) * 3 + c16[:, None]) * D + tl.arange(0, D)[None, :],
                       mask=c16[:, None] < 3, other=0.0)
        if INTERPRET:  # NOTE the 3.6 interpreter's tl.dot mis-multiplies bf16
            pv = tl.dot(a_mu.to(tl.bfloat16).to(tl.float32), b_mu.to(tl.float32), pv)
        else:
            pv = tl.dot(a_mu.to(tl.bfloat16), b_mu, pv)
    acc = acc * alpha[:, None] + pv
    if MEAN == 1:
        mu = tl.load(VM + (start_n // BV) * D + tl.arange(0, D)) * ivs
        acc += r[:, None] * mu[None, :]
    return acc, l_i, m_new


@triton.jit
def _vsmooth_attn_kernel(desc_q, desc_k, desc_v, QS, KS, VM, VS, ONES, OUT, LSE,
                         S, Sk, n_full, N_FULL_C: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                         BKS: tl.constexpr, BV: tl.constexpr, HAS_TAIL: tl.constexpr,
                         QK_FP8: tl.constexpr, EXPCAST: tl.constexpr, MEAN: tl.constexpr,
                         ROWSUM: tl.constexpr, RETURN_LSE: tl.constexpr,
                         INTERPRET: tl.constexpr, WS: tl.constexpr = False):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    start_m = pid_m * BM
    q = desc_q.load([bh * S + start_m, 0])
    rows = start_m + tl.arange(0, BM)
    rmask = rows < S
    qs = tl.load(QS + bh.to(tl.int64) * S + rows, mask=rmask, other=1.0)  # [BM] per-token Q scales
    d = tl.arange(0, D)
    vs = tl.load(VS + bh * D + d)
    ivs = 1.0 / vs
    KS_bh = KS + bh * tl.cdiv(Sk, BKS)
    VM_bh = VM + bh.to(tl.int64) * tl.cdiv(Sk, BV) * (3 if MEAN == 2 else 1) * D
    kv_row = bh * Sk
    vt_row = bh * D
    if EXPCAST == 1:
        m_i = tl.full([BM], float("inf"), tl.float32)
    else:
        m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if ROWSUM == 1:
        o16 = tl.arange(0, 16)
        ones = tl.load(ONES + tl.arange(0, BN)[:, None] * 16 + o16[None, :])  # [BN, 16] e4m3 ones
    else:
        ones = 0
    for j in tl.range(0, N_FULL_C if N_FULL_C >= 0 else n_full, warp_specialize=WS):
        acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, qs, desc_k, desc_v, KS_bh, VM_bh, ivs, ones,
                                   kv_row, vt_row, j * BN, Sk, BN, D, BKS, BV, False, QK_FP8, EXPCAST,
                                   MEAN, ROWSUM, INTERPRET)
    if HAS_TAIL:
        acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, qs, desc_k, desc_v, KS_bh, VM_bh, ivs, ones,
                                   kv_row, vt_row, n_full * BN, Sk, BN, D, BKS, BV, True, QK_FP8,
                                   EXPCAST, MEAN, ROWSUM, INTERPRET)
    l_i = tl.where(qs < float("inf"), l_i, float("nan"))  # undefined logits (NaN/Inf in q or K): NaN row
    o = acc * (vs[None, :] / l_i[:, None])
    if INTERPRET:
        if OUT.dtype.element_ty == tl.bfloat16:
            o = round_bf16(o)
    tl.store(OUT + (bh.to(tl.int64) * S + rows[:, None]) * D + d[None, :],
             o.to(OUT.dtype.element_ty), mask=rmask[:, None])
    if RETURN_LSE:
        if EXPCAST == 1:
            m_ref = (119.65 - m_i) * 0.125
        else:
            m_ref = m_i
        tl.store(LSE + bh.to(tl.int64) * S + rows, m_ref + tl.math.log2(l_i) - 8.0, mask=rmask)


_ONES: Dict[Tuple[int, str], torch.Tensor] = {}


def _ones(BN: int, device) -> torch.Tensor:
    key = (BN, str(device))
    if key not in _ONES:
        _ONES[key] = torch.ones(BN, 16, device=device).to(torch.float8_e4m3fn)
    return _ONES[key]


def as_config(variant) -> Dict[str, int]:
    """((BM, BN, warps, stages), ROWSUM, MEAN) -> the tuning cache's JSON form."""
    (bm, bn, nw, ns), rs, mean = variant
    return {"BM": bm, "BN": bn, "num_warps": nw, "num_stages": ns, "ROWSUM": rs, "MEAN": mean}


@functools.lru_cache(maxsize=None)
def candidates(D: int, expcast: bool):
    """The tuner's candidates for (D, expcast) in ``as_config`` form (first = the default)."""
    return [as_config(v) for v in CANDIDATES[(D, bool(expcast))]]


def tune_variant(expcast: bool, qk_fp8: bool) -> str:
    """The variant field of this kernel's tuning key."""
    return f"{'expcast' if expcast else 'exp2'}-{'fp8' if qk_fp8 else 'int8'}"


def _variant(D: int, expcast: bool, config: Optional[Dict[str, int]] = None):
    """((BM, BN, warps, stages), rowsum, mean, expcast mode) after the overrides."""
    c = config if config is not None else as_config(DEFAULT_VARIANTS[(D, bool(expcast))])
    cfg, rs, mean = (c["BM"], c["BN"], c["num_warps"], c["num_stages"]), c["ROWSUM"], c["MEAN"]
    cfg = CONFIG_OVERRIDE if CONFIG_OVERRIDE is not None else cfg
    rs = ROWSUM_OVERRIDE if ROWSUM_OVERRIDE is not None else rs
    mean = MEAN_MODE_OVERRIDE if MEAN_MODE_OVERRIDE is not None else mean
    mode = EXPCAST_MODE_OVERRIDE if EXPCAST_MODE_OVERRIDE is not None else DEFAULT_EXPCAST_MODE
    return cfg, rs, mean, mode


def _warp_spec() -> bool:
    return DEFAULT_WARP_SPEC if WARP_SPEC_OVERRIDE is None else bool(WARP_SPEC_OVERRIDE)


def _lookup(qk: QKQuant, vq: VQuant, expcast: bool, out_dtype, return_lse: bool):
    """The launch configuration from vc_compile/tune (shipped -> cache -> tuned on first use)."""
    from vc_compile.tune import lookup

    B, H, S, D = qk.q8.shape
    overridden = (CONFIG_OVERRIDE, ROWSUM_OVERRIDE, MEAN_MODE_OVERRIDE) != (None, None, None)
    if overridden or DEFAULT_VARIANTS[(D, bool(expcast))] != _FROZEN_DEFAULTS[(D, bool(expcast))]:
        return as_config(DEFAULT_VARIANTS[(D, bool(expcast))])  # a benchmark's or test's own choice
    qk_fp8 = qk.q8.dtype == torch.float8_e4m3fn

    def launch(c):
        return vsmooth_attention(qk, vq, expcast=expcast, out_dtype=out_dtype, return_lse=return_lse, config=c)
    return lookup.resolve("vsmooth_attn", __file__, candidates(D, expcast), dtype=out_dtype, head_dim=D,
                          seq_len=S, variant=tune_variant(expcast, qk_fp8), device=qk.q8.device,
                          bench=lookup.validated_bench(launch))[0]


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def use_sm90(device: torch.device, qk_fp8: bool, config: Optional[Dict[str, int]] = None) -> bool:
    """Whether ``vsmooth_attention`` runs the Gluon sm_90 kernel for these inputs (see SM90_KERNEL)."""
    if SM90_KERNEL is False:
        return False
    overridden = (config, CONFIG_OVERRIDE, ROWSUM_OVERRIDE, MEAN_MODE_OVERRIDE, EXPCAST_MODE_OVERRIDE) != (None,) * 5
    ok = (device.type == "cuda" and not interpret() and not qk_fp8 and not overridden
          and _is_sm90(device.index if device.index is not None else torch.cuda.current_device()))
    if SM90_KERNEL is True and not ok:
        raise RuntimeError("vsmooth_attn.SM90_KERNEL = True, but these inputs cannot use the sm_90 kernel "
                           "(needs an sm_90 GPU, INT8 Q/K, no Triton launch configuration/overrides)")
    return ok


def vsmooth_attention(qk: QKQuant, vq: VQuant, *, expcast: bool = False, out_dtype=torch.bfloat16,
                      return_lse: bool = False, config: Optional[Dict[str, int]] = None):
    """8-bit attention: O [B, H, S, D] in ``out_dtype`` (and the base-2 LSE of the smoothed logits,
    [B, H, S] fp32, when ``return_lse``). ``config`` (``as_config`` form) skips the tuning lookup."""
    q8, q_scale, k8, k_scale = qk.q8, qk.q_scale, qk.k8, qk.k_scale
    B, H, S, D = q8.shape
    Sk = k8.shape[2]
    if D not in (64, 128):
        raise ValueError(f"head dim {D} is not supported (64 or 128)")
    if vq.S != Sk or vq.v8t.shape[2] != D:
        raise ValueError("VQuant does not match the keys (S or head dim)")
    qk_fp8 = q8.dtype == torch.float8_e4m3fn
    if q8.dtype not in (torch.int8, torch.float8_e4m3fn) or k8.dtype != q8.dtype:
        raise ValueError(f"q8/k8 must both be int8 or float8_e4m3fn, got {q8.dtype}, {k8.dtype}")
    if q_scale.shape != (B, H, S):
        raise ValueError(f"q_scale must be per query token [B, H, S] = {[B, H, S]}, got "
                         f"{list(q_scale.shape)}")
    if use_sm90(q8.device, qk_fp8, config):
        from vc_compile.templates import vsmooth_attn_sm90

        return vsmooth_attn_sm90.vsmooth_attention_sm90(qk, vq, expcast=expcast, out_dtype=out_dtype,
                                                        return_lse=return_lse)
    if config is None:
        config = _lookup(qk, vq, expcast, out_dtype, return_lse)
    (BM, BN, nw, ns), rowsum, mean, mode = _variant(D, expcast, config)
    if rowsum == 4 and expcast:
        rowsum = 0
    q8 = q8.contiguous()
    k8 = k8.contiguous()
    v8t = vq.v8t.contiguous()
    S_pad = v8t.shape[-1]
    desc_q = TensorDescriptor.from_tensor(q8.view(B * H * S, D), [BM, D])
    desc_k = TensorDescriptor.from_tensor(k8.view(B * H * Sk, D), [BN, D])
    desc_v = TensorDescriptor.from_tensor(v8t.view(B * H * D, S_pad), [D, BN])
    out = torch.empty(B, H, S, D, device=q8.device, dtype=out_dtype)
    lse = torch.empty(B, H, S, device=q8.device, dtype=torch.float32) if return_lse else out
    mean = 0 if getattr(vq.v_mean, "_vc_zero_mean", False) else mean
    if mean == 2:  # [B, H, nb, 3, D] bf16: mu' = mu / v_scale split as (hi, lo, hi)
        mu = vq.v_mean / vq.v_scale.unsqueeze(2)
        hi = mu.to(torch.bfloat16)
        v_mean = torch.stack([hi, (mu - hi.float()).to(torch.bfloat16), hi], dim=3)
    else:
        v_mean = vq.v_mean.contiguous()
    n_full = Sk // BN
    _vsmooth_attn_kernel[(triton.cdiv(S, BM), B * H)](
        desc_q, desc_k, desc_v, q_scale.contiguous(), k_scale.contiguous(), v_mean,
        vq.v_scale.contiguous(), _ones(BN, q8.device) if rowsum == 1 else out, out, lse, S, Sk, n_full,
        loop_bound(n_full),
        BM=BM, BN=BN, D=D, BKS=BLOCK_K, BV=BLOCK_V, HAS_TAIL=Sk % BN != 0,
        QK_FP8=qk_fp8, EXPCAST=mode if expcast else 0, MEAN=mean, ROWSUM=rowsum,
        RETURN_LSE=bool(return_lse), INTERPRET=interpret(), WS=_warp_spec() and not interpret(),
        num_warps=nw, num_stages=ns)
    return (out, lse) if return_lse else out
