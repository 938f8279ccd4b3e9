"""Launch configurations of the tuned kernels: frozen dataclasses with named fields, the kernel modes as
``str`` Enums, and the measured default tables (with the NOTEs that justify them).

A kernel is a pure function of its inputs and one of these configs (``launch=``); ``dispatch.py`` picks the
config (the tuning cache, ``vc_compile/tune``, holding them as JSON: ``to_json`` / ``from_json``), and
``tools/gen_shipped_table.py`` writes the shipped sm_90 table from the tables here. Nothing in this module
imports a kernel or the tuner.

Kernel modes (one name per meaning; the two V-Smooth kernels use different subsets):

============  ===============================================  ==================================================
mode          Triton kernel (``vsmooth_attn.py``)               Gluon sm_90 kernel (``vsmooth_attn_sm90.py``)
============  ===============================================  ==================================================
RowSum.FP32   decode P~ to fp32, sum in fp32                    --
RowSum.MMA    P~ @ ones[BN, 16] per block, row max of the 16    P~ @ ones[BN, 8] issued beside PV_j: exact fp32
              columns                                           sums, l_i a [BM, 8] tile
RowSum.FP16   decode to fp16, sum in fp16 (2^-11)               the same, on the ALUs
MeanTerm.FFMA acc += r_ij mu'_j per block                       the same (mu' staged by TMA with V)
MeanTerm.     [r_hi r_hi r_lo] x [mu_hi; mu_lo; mu_hi], a bf16  --
 BF16_MMA     MMA into the block's fresh accumulator
MeanTerm.     --                                                R_w mu'_w every 8 key blocks by three tf32 MMAs
 TF32_WINDOW                                                    (hi / lo split; needs RowSum.MMA)
ExpCast       one rounding mode: the reference's (s, then the   full blocks: the code formed and rounded by ONE
              code)                                             FFMA; the key-tail block as the Triton kernel
============  ===============================================  ==================================================

The integer names these modes had in earlier notes and benchmark rows (ROWSUM, MEAN, MS, EXPCAST):
docs/design/vsmooth-triton-config.md.

A V-Smooth input without block means (``VQuant.zero_mean``: ``smooth_v=False``, "naive 8-bit") runs either
kernel without a mean term, whatever ``mean`` says.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from vc_compile.formats import BLOCK_V  # keys per V-Smooth key block (one V mean per block)

# What the kernels support (one check per family; dispatch's eligibility, the launchers' errors and the tune
# CLI all ask these): the 8-bit kernels tile D as one TMA box and BN = 128 keys; the others (gather attention,
# pass 2, PDDP, k-means) need a power-of-two head dim for tl.arange, within the registers of one tile.
VSMOOTH_HEAD_DIMS = (64, 128)


def vsmooth_head_dim_error(D: int) -> Optional[str]:
    """None, or why the 8-bit kernels (preprocessing and attention) cannot take head dim D."""
    return None if D in VSMOOTH_HEAD_DIMS else f"head dim {D} is not supported (64 or 128)"


def pow2_head_dim_error(D: int, name: str = "head dim") -> Optional[str]:
    """None, or why the kernels with a power-of-two head dim (gather attention, pass 2, PDDP, k-means) cannot take
    head dim D."""
    ok = 16 <= D <= 256 and D & (D - 1) == 0
    return None if ok else f"{name} must be a power of two in [16, 256], got {D}"


class RowSum(str, enum.Enum):
    """How the row sum r_ij of the decoded P~ over a key block is formed (see the module table)."""
    FP32 = "fp32"
    MMA = "mma"
    FP16 = "fp16"

    @property
    def code(self) -> int:
        """The Triton kernel's ROWSUM constexpr."""
        return {RowSum.FP32: 0, RowSum.MMA: 1, RowSum.FP16: 2}[self]


class MeanTerm(str, enum.Enum):
    """How V-Smooth's mean term r_ij mu'_j enters the accumulator (see the module table)."""
    FFMA = "ffma"
    BF16_MMA = "bf16_mma"
    TF32_WINDOW = "tf32_window"

    @property
    def code(self) -> int:
        """The Triton kernel's MEAN constexpr (0 = no mean term is chosen by the input, not the config)."""
        return {MeanTerm.FFMA: 1, MeanTerm.BF16_MMA: 2}[self]


class POperand(str, enum.Enum):
    """Where the Gluon kernel's PV MMA reads P~ from."""
    SHARED = "shared"  # stored to a shared-memory double buffer, PV_{j-1} overlapped with softmax(S_j)
    REGISTERS = "registers"  # the softmax's registers are the MMA's A operand (keys relabelled, V^T reordered)


def _coerce_enum(obj, name: str, cls) -> None:
    val = getattr(obj, name)
    try:
        object.__setattr__(obj, name, cls(val.value if isinstance(val, enum.Enum) else val))
    except ValueError:
        raise ValueError(f"{type(obj).__name__}.{name}={val!r}; accepted: {[m.value for m in cls]}") from None


def _check_ints(obj, **allowed) -> None:
    for name, ok in allowed.items():
        val = getattr(obj, name)
        if isinstance(val, bool) or not isinstance(val, int) or val not in ok:
            raise ValueError(f"{type(obj).__name__}.{name}={val!r}; accepted: {sorted(ok)}")


class _Json:
    """to_json / from_json: the tuning cache's form (enum values as strings)."""

    def to_json(self) -> Dict[str, object]:
        return {f.name: (v.value if isinstance(v, enum.Enum) else v)
                for f in dataclasses.fields(self) for v in (getattr(self, f.name),)}

    @classmethod
    def from_json(cls, d: Dict[str, object]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; accepted: {sorted(names)}")
        return cls(**d)


# ---- the Triton V-Smooth kernel (kernels/vsmooth_attn.py) ---------------------------------------------
@dataclass(frozen=True)
class VSmoothTritonConfig(_Json):
    """(BM, BN, warps, stages) of ``_vsmooth_attn_kernel`` and how it forms the row sums and the mean term."""
    block_m: int = 64
    block_n: int = BLOCK_V
    num_warps: int = 4
    num_stages: int = 3
    rowsum: RowSum = RowSum.MMA
    mean: MeanTerm = MeanTerm.FFMA

    def __post_init__(self):
        _coerce_enum(self, "rowsum", RowSum)
        _coerce_enum(self, "mean", MeanTerm)
        _check_ints(self, block_m={16, 32, 64, 128}, block_n={BLOCK_V}, num_warps={4, 8}, num_stages=set(range(1, 6)))
        if self.mean == MeanTerm.TF32_WINDOW:
            raise ValueError("VSmoothTritonConfig.mean: tf32_window is the Gluon kernel's; accepted: ffma, bf16_mma")


# Per (head dim, ExpCast). NOTE: the fastest variants of an A/B that pass the accuracy / NaN check; exp2 with the
# FFMA mean term is NaN-prone in some specialisations (a code-generation problem not pinned down), so
# test_gpu_no_nan_any_specialisation checks every specialisation of these defaults.
# docs/design/vsmooth-triton-config.md
_T64 = dict(block_m=64, block_n=128, num_warps=4, num_stages=3)
_T128 = dict(block_m=128, block_n=128, num_warps=4, num_stages=3)
VSMOOTH_TRITON_DEFAULT: Dict[Tuple[int, bool], VSmoothTritonConfig] = {
    (128, False): VSmoothTritonConfig(**_T64, rowsum=RowSum.MMA, mean=MeanTerm.FFMA),
    (128, True): VSmoothTritonConfig(**_T64, rowsum=RowSum.FP16, mean=MeanTerm.FFMA),
    (64, False): VSmoothTritonConfig(**_T128, rowsum=RowSum.FP16, mean=MeanTerm.BF16_MMA),
    (64, True): VSmoothTritonConfig(**_T128, rowsum=RowSum.FP16, mean=MeanTerm.BF16_MMA),
}
# What the autotuner may pick per (head dim, ExpCast), FIRST = the measured default above (what runs when
# nothing is tuned). Only variants compiled in the A/B and marked correct there
# (docs/design/vsmooth-triton-config.md); exp2 + FFMA mean is the default only: the other exp2 + FFMA compiles are the
# NaN-prone family, so no tuner may pick one.
VSMOOTH_TRITON_CANDIDATES: Dict[Tuple[int, bool], Tuple[VSmoothTritonConfig, ...]] = {
    (128, False): (VSMOOTH_TRITON_DEFAULT[(128, False)],
                   VSmoothTritonConfig(**_T64, rowsum=RowSum.FP16, mean=MeanTerm.BF16_MMA)),
    (128, True): (VSMOOTH_TRITON_DEFAULT[(128, True)],
                  VSmoothTritonConfig(**_T64, rowsum=RowSum.FP32, mean=MeanTerm.FFMA),
                  VSmoothTritonConfig(**_T64, rowsum=RowSum.FP16, mean=MeanTerm.BF16_MMA)),
    (64, False): (VSMOOTH_TRITON_DEFAULT[(64, False)],
                  VSmoothTritonConfig(**_T64, rowsum=RowSum.FP16, mean=MeanTerm.BF16_MMA)),
    (64, True): (VSMOOTH_TRITON_DEFAULT[(64, True)],
                 VSmoothTritonConfig(**_T128, rowsum=RowSum.FP32, mean=MeanTerm.FFMA),
                 VSmoothTritonConfig(**_T64, rowsum=RowSum.FP16, mean=MeanTerm.BF16_MMA),
                 VSmoothTritonConfig(**_T64, rowsum=RowSum.FP32, mean=MeanTerm.FFMA)),
}


def vsmooth_triton_variant(expcast: bool, qk_fp8: bool) -> str:
    """The variant field of the Triton V-Smooth kernel's tuning key."""
    return f"{'expcast' if expcast else 'exp2'}-{'fp8' if qk_fp8 else 'int8'}"


# ---- the Gluon sm_90 V-Smooth kernel (kernels/vsmooth_attn_sm90.py) -----------------------------------
@dataclass(frozen=True)
class VSmoothSm90Config(_Json):
    """The Gluon kernel's launch: BM query rows per program (per consumer warp group when warp-specialised),
    warps, K / V ring depth, where PV reads P~, warp specialisation (two consumer warp groups + a producer
    warp, one CTA per SM), and the row-sum / mean-term modes (``RowSum.MMA`` + ``MeanTerm.TF32_WINDOW``: both
    on the tensor cores, "MS" in docs/design/sm90-vsmooth-structure.md). ``byte_mask``: register-P~ ExpCast
    clamps its codes at 0 in the byte packing (``softmax.codes_masked``) instead of by an FMNMX per score, in
    every program whose scales allow it (``bytemask_ok``; the others run the FMNMX loop); the output is the
    same bits either way."""
    block_m: int = 64
    num_warps: int = 4
    stages: int = 2
    p_operand: POperand = POperand.SHARED
    warp_specialize: bool = False
    rowsum: RowSum = RowSum.FP16
    mean: MeanTerm = MeanTerm.FFMA
    # NOTE on: the clamp in the byte packing takes instructions off the key loop, the softmax's critical path, and
    # gives the same bits as an FMNMX per score; docs/design/expcast-byte-mask.md
    byte_mask: bool = True
    # key blocks whose PV the FP8 MMA accumulates in its own accumulator before one fp32 fold (1: a fresh
    # accumulator per block, the two-level accumulation; ``steps.window_step``). NOTE 8 for ExpCast at D = 128: the
    # fold of every block is its cost, and on smoothed V a window of 8 keeps the two-level accumulation's error;
    # exp2 and D = 64 were slower at every G. Only on smoothed V: without the block means the kernel runs G = 1
    # (vsmooth_attn_sm90.py). docs/design/pv-window.md
    pv_window: int = 1

    def __post_init__(self):
        _coerce_enum(self, "p_operand", POperand)
        _coerce_enum(self, "rowsum", RowSum)
        _coerce_enum(self, "mean", MeanTerm)
        _check_ints(self, block_m={64, 128}, num_warps={4, 8}, stages=set(range(1, 5)), pv_window={1, 2, 4, 8})
        for flag in ("warp_specialize", "byte_mask"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"VSmoothSm90Config.{flag}={getattr(self, flag)!r}; accepted: True, False")
        regs = self.p_operand == POperand.REGISTERS
        if self.warp_specialize and (not regs or self.num_warps != 4 or self.block_m != 64):
            raise ValueError(f"{self}: warp specialisation needs p_operand='registers', 4 warps and block_m = 64 "
                             "per consumer warp group")
        if self.rowsum not in (RowSum.FP16, RowSum.MMA):
            raise ValueError(f"{self}: rowsum is 'fp16' (the ALUs) or 'mma' (the tensor cores)")
        if (self.rowsum == RowSum.MMA) != (self.mean == MeanTerm.TF32_WINDOW) or self.mean == MeanTerm.BF16_MMA:
            raise ValueError(f"{self}: rowsum='mma' goes with mean='tf32_window' (both on the tensor cores), "
                             "rowsum='fp16' with mean='ffma'")
        if self.rowsum == RowSum.MMA and not regs:
            raise ValueError(f"{self}: rowsum='mma' takes P~ from registers: needs p_operand='registers'")
        if self.pv_window > 1 and not (self.warp_specialize and self.rowsum == RowSum.MMA):
            raise ValueError(f"{self}: pv_window > 1 is built on the warp-specialised structure with MMA row sums "
                             "(warp_specialize=True, rowsum='mma', mean='tf32_window')")

    @property
    def mma_sums(self) -> bool:
        """Row sums and the mean term on the tensor cores (the kernel's MS constexpr)."""
        return self.rowsum == RowSum.MMA


_SHARED_P = VSmoothSm90Config()
_REG_P = VSmoothSm90Config(p_operand=POperand.REGISTERS)
_MS_WS = VSmoothSm90Config(p_operand=POperand.REGISTERS, warp_specialize=True, rowsum=RowSum.MMA,
                           mean=MeanTerm.TF32_WINDOW)
_MS_WS_W8 = dataclasses.replace(_MS_WS, pv_window=8)  # ExpCast, D = 128: see the NOTE on ``pv_window``
# NOTE (BM, warps, stages) = (64, 4, 2) for every structure: two CTAs (8 warps) per SM; a third stage or BM = 128
# leaves one CTA per SM. Register P~ and warp specialisation feed the PV MMA from the softmax's registers and
# overlap the producer's loads with the consumers' math, which pays only when a head has enough key blocks to fill
# the pipeline: hence the short / long split below, with the threshold where the measured curves cross. "MS" (row
# sums and the mean term on the tensor cores) takes ~20% of the instructions out of the key loop.
# docs/design/sm90-vsmooth-structure.md
# Per (head dim, ExpCast): the configuration below LONG's threshold ...
VSMOOTH_SM90_SHORT: Dict[Tuple[int, bool], VSmoothSm90Config] = {
    (128, False): _SHARED_P, (128, True): _SHARED_P, (64, False): _REG_P, (64, True): _REG_P}
# ... and (from this many query rows, the configuration from there on)
VSMOOTH_SM90_LONG: Dict[Tuple[int, bool], Tuple[int, VSmoothSm90Config]] = {
    (128, False): (6144, _MS_WS), (128, True): (4096, _MS_WS_W8), (64, False): (6144, _MS_WS),
    (64, True): (6144, _MS_WS)}
# What the autotuner may pick on an sm_90 GPU outside the shipped table (every structure the kernel has, at the
# measured (BM, warps, stages) = (64, 4, 2)); the regime's default first.
_SM90_STRUCTURES = (_SHARED_P, _REG_P, VSmoothSm90Config(p_operand=POperand.REGISTERS, warp_specialize=True),
                    VSmoothSm90Config(p_operand=POperand.REGISTERS, rowsum=RowSum.MMA, mean=MeanTerm.TF32_WINDOW),
                    _MS_WS, _MS_WS_W8)


def sm90_regime(D: int, expcast: bool, S: int) -> str:
    """``"long"`` from VSMOOTH_SM90_LONG's threshold on, else ``"short"``. Part of the tuning key: the measured
    default changes at a row count that is not a boundary of the key's power-of-two sequence buckets."""
    return "long" if S >= VSMOOTH_SM90_LONG[(D, bool(expcast))][0] else "short"


def vsmooth_sm90_default(D: int, expcast: bool, S: int) -> VSmoothSm90Config:
    key = (D, bool(expcast))
    return VSMOOTH_SM90_LONG[key][1] if sm90_regime(D, expcast, S) == "long" else VSMOOTH_SM90_SHORT[key]


def vsmooth_sm90_candidates(D: int, expcast: bool, S: int) -> Tuple[VSmoothSm90Config, ...]:
    first = vsmooth_sm90_default(D, expcast, S)
    return (first,) + tuple(c for c in _SM90_STRUCTURES if c != first)


def vsmooth_sm90_variant(expcast: bool, regime: str) -> str:
    """The variant field of the Gluon kernel's tuning key (INT8 Q/K only)."""
    return f"{'expcast' if expcast else 'exp2'}-int8-{regime}"


# ---- the MC-Sparse gather kernel (kernels/sparse_attn.py) ---------------------------------------------
@dataclass(frozen=True)
class SparseAttnConfig(_Json):
    """(BLOCK_N keys per inner step, warps, stages) of ``_sparse_attn_kernel``; ``kv_off``: the V gather
    reuses the K gather's offsets (applies only when K and V have the same row stride, D == Dv and 16-bit QK;
    None = the measured rule: on for query groups C >= 128)."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    kv_off: Optional[bool] = None

    def __post_init__(self):
        _check_ints(self, block_n={16, 32, 64, 128, 256}, num_warps={1, 2, 4, 8, 16}, num_stages=set(range(1, 6)))
        if self.kv_off is not None and not isinstance(self.kv_off, bool):
            raise ValueError(f"SparseAttnConfig.kv_off={self.kv_off!r}; accepted: None, True, False")


# NOTE configs (BLOCK_N, num_warps, num_stages) per (qk_format, D, C): the fastest of the sweeps at each C; 8 warps
# lost everywhere. kv_off (K/V row offsets once per key chunk) removes most of the key loop's register spills at
# C = 128 and costs a little at C = 64, so it is on for C >= 128 (kv_off=None). docs/design/sparse-launch-config.md
SPARSE_DEFAULT: Dict[Tuple[str, int, int], SparseAttnConfig] = {
    ("bf16", 64, 64): SparseAttnConfig(128, 4, 3),
    ("bf16", 128, 64): SparseAttnConfig(64, 4, 4),
    ("fp8", 64, 64): SparseAttnConfig(128, 4, 3),
    ("fp8", 128, 64): SparseAttnConfig(64, 4, 3),
    ("bf16", 128, 128): SparseAttnConfig(64, 4, 3),
    ("fp8", 128, 128): SparseAttnConfig(128, 4, 3),
}
# shapes outside the sweeps: (64, 4, 3), measured only at D = 128, C = 64
SPARSE_FALLBACK = SparseAttnConfig(64, 4, 3)
# The autotuner's candidates: the configs both sweeps compiled and timed (C = 64 first run, C = 128
# benchmarks/bench_sparse_attn.py SWEEP_C128); the default is put first, so an untuned run launches exactly
# what the table says.
SPARSE_SWEPT = tuple(SparseAttnConfig(*c) for c in ((64, 4, 3), (64, 4, 4), (64, 4, 2), (32, 4, 4), (128, 4, 3),
                                                     (64, 8, 3), (64, 8, 4), (128, 8, 3)))


# ---- the Gluon sm_90 gather kernel (kernels/sparse_attn_sm90.py; dispatch.sparse_kernel says where it runs) --
SM90_SMEM_BYTES = 227 * 1024  # the most dynamic shared memory one sm_90 CTA may use
SM90_REGS_PER_THREAD_SLOT = 504  # 65536 registers over 128 threads, in setmaxnreg's steps of 8 (3 x 168)


@dataclass(frozen=True)
class SparseAttnSm90Config(_Json):
    """The warp-specialised Gluon gather kernel's launch: ``block_n`` keys per ring stage, ``stages`` K / V
    stages per ring (one ring per CTA at C = 128, one per query group at C = 64), the registers per thread
    that ``setmaxnreg`` gives the two consumer warp groups and the 4-warp producer (two consumers and the
    producer share the 504-register thread slot of a 12-warp CTA), and where the synchronisation sits
    (``producer_fence``, ``overlap``). Measurements: docs/design/sparse-launch-config.md."""
    block_n: int = 128
    stages: int = 2
    # NOTE 232 / 40: the producer needs 40 registers for its 64-bit row addresses (at 24 its loop spills), and the
    # consumers' loop is the same at 232 as at 240; docs/design/sparse-launch-config.md
    consumer_regs: int = 232
    producer_regs: int = 40
    # where the proxy fence between the cp.async rows (generic proxy) and the wgmma reads (async proxy) sits:
    # False: in the consumers, after each ready wait (two per block on their critical path); True: in the
    # producer, after its own copies completed (cp.async.wait_group), before one release arrival per stage
    producer_fence: bool = False
    # FlashAttention-3's order inside a consumer: S_j and PV_{j-1} issued together, the softmax of S_j while
    # PV_{j-1} runs (False: softmax(S_j), then PV_j and S_{j+1} together, both waited for)
    overlap: bool = False

    def __post_init__(self):
        _check_ints(self, block_n={64, 128}, stages={2, 3, 4}, consumer_regs=set(range(128, 257, 8)),
                    producer_regs=set(range(24, 129, 8)))
        for name in ("producer_fence", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SparseAttnSm90Config.{name}={getattr(self, name)!r}; accepted: True, False")
        if 2 * self.consumer_regs + self.producer_regs > SM90_REGS_PER_THREAD_SLOT:
            raise ValueError(f"{self}: 2 x consumer_regs + producer_regs = "
                             f"{2 * self.consumer_regs + self.producer_regs} > {SM90_REGS_PER_THREAD_SLOT}")

    # the letters after "BN/stages" in ``from_spec`` (scripts' --configs)
    SPEC_FLAGS = {"f": "producer_fence", "o": "overlap"}

    @classmethod
    def from_spec(cls, spec: str) -> "SparseAttnSm90Config":
        """``"BN/stages"`` plus any of the letters f (producer_fence), o (overlap), e.g. ``"128/2fo"``."""
        head = spec.rstrip("".join(cls.SPEC_FLAGS))
        flags = spec[len(head):]
        try:
            bn, st = head.split("/")
            return cls(block_n=int(bn), stages=int(st), **{cls.SPEC_FLAGS[f]: True for f in flags})
        except (ValueError, KeyError) as e:
            raise ValueError(f"sparse sm_90 launch spec {spec!r}: expected BN/stages plus any of "
                             f"{''.join(cls.SPEC_FLAGS)} ({e})") from None

    def smem_bytes(self, C: int, D: int, DV: int, elem: int = 2) -> int:
        """Shared memory of one CTA: the K / V rings (two at C = 64: each consumer its own group), both consumers'
        Q tiles, the mbarriers (4 per stage and ring), and 512 bytes for what the compiler adds (alignment: the
        offline compiles measured 296-320 bytes more than the buffers)."""
        rings = 2 if C == 64 else 1
        return ((rings * self.stages * self.block_n * (D + DV) + 2 * 64 * D) * elem + 4 * 8 * rings * self.stages
                + 512)

    def check_fits(self, C: int, D: int, DV: int, elem: int = 2) -> None:
        need = self.smem_bytes(C, D, DV, elem)
        if need > SM90_SMEM_BYTES:
            raise ValueError(f"{self}: {need} bytes of shared memory at C = {C}, D = {D}, Dv = {DV} "
                             f"(> {SM90_SMEM_BYTES}); use fewer stages or block_n = 64")


# Per group size C. C = 128: one ring of 128-key stages (S 64 + O 64 + P 32 registers of a consumer's 232), 2 stages
# = 128 KB + Q 32 KB, the proxy fence in the producer and FlashAttention-3's order in the consumers.
# NOTE the fence and the overlap pay together (without the fence on the consumers' path, the overlap's second MMA
# has something to hide); each alone, or a third stage, measured slower.
# C = 64: two rings (the two consumers' groups select different keys), so 64-key stages: 2 x 2 x 32 KB + 32 KB.
# docs/design/sparse-launch-config.md
SPARSE_SM90_DEFAULT: Dict[int, SparseAttnSm90Config] = {
    128: SparseAttnSm90Config(block_n=128, stages=2, producer_fence=True, overlap=True),
    64: SparseAttnSm90Config(block_n=64, stages=2),
}


def sparse_sm90_default(C: int) -> SparseAttnSm90Config:
    return SPARSE_SM90_DEFAULT[C]


def sparse_default(qk_format: str, D: int, C: int) -> SparseAttnConfig:
    return SPARSE_DEFAULT.get((qk_format, D, C), SPARSE_FALLBACK)


def sparse_candidates(qk_format: str, D: int, C: int) -> Tuple[SparseAttnConfig, ...]:
    first = sparse_default(qk_format, D, C)
    return (first,) + tuple(c for c in SPARSE_SWEPT if c != first)


def sparse_variant(qk_format: str, C: int, n_keep: int, Sk: int) -> str:
    """The variant field of the gather kernel's tuning key: QK format, group size, density to 0.05."""
    return f"{qk_format}-c{C}-p{int(round(20 * n_keep / Sk)) * 5}"


# ---- the V-Smooth preprocessing (kernels/preprocess.py) -----------------------------------------------
@dataclass(frozen=True)
class PreprocessConfig(_Json):
    """Launch of the two preprocessing passes (kernels/preprocess.py). ``stats_per_sm``: pass 1's programs per SM
    when it reads V (splits per head = that x 132 / heads; pass 2 reduces that many partials per head),
    ``stats_warps`` its warps per program (with V, D = 128), ``stats_regs`` its register cap there (0: the
    compiler's choice). ``quant_warps``: pass 2's warps per program at D = 128 (half at D = 64), ``quant_regs`` its
    register cap per thread (0: the compiler's choice), which sets how many of its programs share an SM (applied at
    D = 128 without Hadamard or RoPE, where it was measured). How the Q/K quantisation applies a fused RoPE prologue
    (no effect without RoPE): ``rope_packed``: interleaved pairs of 16-bit q/k read as 32-bit words and the codes
    stored as int16 pairs (applies when the inputs allow it and the codes are INT8; else the pairs are split in
    registers). ``rope_head_fast``: grid (B*H, token blocks), the heads of one token block back to back (the table
    rows come from L2)."""
    rope_packed: bool = True
    rope_head_fast: bool = True
    stats_per_sm: int = 8
    stats_warps: int = 4
    quant_warps: int = 8
    quant_regs: int = 80
    # pass 1's register cap a thread (0: the compiler's choice), applied with V at D = 128. NOTE 128: uncapped, pass 1
    # holds so many registers with the index prefetch that only 2 programs share an SM; 128 gives 4 for a small
    # spill and was the fastest cap measured. docs/design/preprocess-launch.md
    stats_regs: int = 128

    def __post_init__(self):
        for name in ("rope_packed", "rope_head_fast"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PreprocessConfig.{name}={getattr(self, name)!r}; accepted: True, False")
        if isinstance(self.stats_per_sm, bool) or not isinstance(self.stats_per_sm, int) \
                or not 1 <= self.stats_per_sm <= 64:
            raise ValueError(f"PreprocessConfig.stats_per_sm={self.stats_per_sm!r}; accepted: an int in [1, 64]")
        if self.stats_warps not in (2, 4, 8):
            raise ValueError(f"PreprocessConfig.stats_warps={self.stats_warps!r}; accepted: 2, 4, 8")
        if self.quant_warps not in (4, 8, 16):
            raise ValueError(f"PreprocessConfig.quant_warps={self.quant_warps!r}; accepted: 4, 8, 16")
        if self.stats_regs not in (0, 96, 128, 168) or isinstance(self.stats_regs, bool):
            raise ValueError(f"PreprocessConfig.stats_regs={self.stats_regs!r}; accepted: 0 (the compiler's choice), "
                             "96, 128, 168")
        if self.quant_regs not in (0, 64, 80, 96, 128):
            raise ValueError(f"PreprocessConfig.quant_regs={self.quant_regs!r}; accepted: 0 (the compiler's choice), "
                             "64, 80, 96, 128")


# NOTE the measurements behind both RoPE switches: docs/design/rope-fusion.md. Pass 1 with V runs 4 warps, 8 programs
# per SM, the fastest of the sweep; pass 2 is capped at 80 registers (3 programs per SM instead of 2, a small spill
# outside the tile work), faster than uncapped or 16 warps at 64. The cap applies where it was measured (D = 128, no
# Hadamard, no RoPE): the Hadamard rotation's wgmma needs >= 90 registers (ptxas C7602 at 80). docs/design/preprocess-launch.md
PREPROCESS_DEFAULT = PreprocessConfig()


# ---- MC-Sparse cheap anchor: pass 2 on INT8 codes and the radix top-K (kernels/anchor_mass.py, topk.py) ----
class ExpMode(str, enum.Enum):
    """Pass 2's exponential (reference/anchor_mass.py): EXACT = exp2 (MUFU.EX2); SHIFT = Schraudolph's
    exponent-field construction on the FMA/INT pipes, centred by BETA (|rel err| <= 4%, unbiased in sums)."""
    EXACT = "exact"
    SHIFT = "shift"


@dataclass(frozen=True)
class AnchorMassConfig(_Json):
    """Launch of the pass-2 mass kernel. ``groups_per_program`` (NG): query groups held per program; NG x C = 256
    queries halves the K8 tiles streamed from L2 against NG x C = 128 (0.54 vs 1.07 GB per head at S = 32760).
    ``exp``: ``ExpMode``. ``num_stages``: depth of the K8 TMA pipeline. 4 warps = one warpgroup: the [64, C]
    tile's rows stay in one warpgroup, so the group sums need no shared-memory reduction."""
    groups_per_program: int = 2
    exp: ExpMode = ExpMode.SHIFT
    num_stages: int = 3
    num_warps: int = 4

    def __post_init__(self):
        _coerce_enum(self, "exp", ExpMode)
        _check_ints(self, groups_per_program={1, 2, 4}, num_stages=set(range(1, 7)), num_warps={4})


def anchor_mass_default(group_size: int, exp: ExpMode = ExpMode.SHIFT) -> AnchorMassConfig:
    """C = 128: one group per program (NG = 1); C = 64: NG = 4 (256 queries, not timed against the others).
    NOTE NG = 1 at C = 128: NG = 2 streams half the K8 tiles from L2 but holds so many registers that only two
    CTAs share an SM, and NG = 1 (three) measured faster, with the same masses; docs/design/anchor-mass-config.md."""
    if int(group_size) not in (64, 128):
        raise ValueError(f"anchor mass: group_size must be 64 or 128 (the sparse kernel's query tile), "
                         f"got {group_size}")
    return AnchorMassConfig(groups_per_program=1 if int(group_size) == 128 else 4, exp=exp)


@dataclass(frozen=True)
class TopKConfig(_Json):
    """Launch of the radix top-K. ``block``: elements per chunk (power of two, <= 32768 so the packed scan's
    counts fit 16 bits); ``digit``: bits per radix pass (4: 16-bin histograms, 4 passes for bf16; 8: 256 bins,
    2 passes); ``num_warps``.
    NOTE digit 8: a 256-bin histogram pass costs about as many instructions per element over its 2 passes as
    16-bin passes over 4, and reads the row fewer times; block 2048 with 4 warps was the fastest of the sweep.
    docs/design/anchor-mass-config.md"""
    block: int = 2048
    digit: int = 8
    num_warps: int = 4

    def __post_init__(self):
        b = self.block
        if isinstance(b, bool) or not isinstance(b, int) or not 128 <= b <= 32768 or b & (b - 1):
            raise ValueError(f"TopKConfig.block={b!r}; accepted: a power of two in [128, 32768]")
        _check_ints(self, digit={4, 8}, num_warps={1, 2, 4, 8, 16})


TOPK_DEFAULT = TopKConfig()
# ---- the MC-Sparse reuse step's non-finite flags + guard probe (kernels/finite_flags.py) --------------
@dataclass(frozen=True)
class FiniteFlagsConfig(_Json):
    """``_flags_kernel``: ``block_n`` keys per inner step, ``num_warps``; each program scans a strip of
    ``strip_len`` keys, a power of two in [block_n, ``max_strip``] giving about ``target_programs`` programs."""
    block_n: int = 64
    num_warps: int = 4
    target_programs: int = 1024
    max_strip: int = 4096

    def __post_init__(self):
        _check_ints(self, block_n={16, 32, 64, 128}, num_warps={1, 2, 4, 8})
        for name in ("target_programs", "max_strip"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1 or val & (val - 1):
                raise ValueError(f"FiniteFlagsConfig.{name}={val!r}; accepted: a power of two >= 1")
        if self.max_strip < self.block_n:
            raise ValueError(f"FiniteFlagsConfig.max_strip={self.max_strip} < block_n={self.block_n}")

    def strip_len(self, Sk: int, BH: int) -> int:
        """Keys per program for Sk keys and B*H heads."""
        want = max(1, -(-Sk * BH // self.target_programs))
        p2 = 1 << (want - 1).bit_length()
        return int(min(self.max_strip, max(self.block_n, p2)))


# NOTE BLOCK_N 64, 4 warps, strips for ~1024 programs (at most 4096 keys): enough programs to fill a GPU with a
# streaming read; chosen, not yet measured (bench_finite_flags, removed since, timed the pass against one read of K
# and V). Not tuned: one config. docs/design/finite-flags.md
FINITE_FLAGS_DEFAULT = FiniteFlagsConfig()
