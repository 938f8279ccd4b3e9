"""``method="mcsparse"``: token-sparse attention with metadata cached at anchor steps (docs/methods.md, MC-Sparse).

ANCHOR: Fast PDDP query groups (sigma), pass 1 dense attention with its LSE, pass 2 exact group masses,
top-K keys per group, the sparse output with that selection and the residual ``R = O_dense - O_sparse``;
returns ``O_dense``. For self-attention with head dim 64/128 and the default exact token selection the anchor
runs ``methods/anchor.anchor_step`` ("cheap anchors": pass 2 on INT8 codes, radix top-K; option
``anchor_dense``); cross-attention, other head dims and the ablation variants run the original passes
(``run(..., cheap_anchor=False)`` forces them, for benchmarks). REUSE: the sparse kernel with the cached
sigma/selection on the current q, k, v, plus R. WARMUP (20% of the steps by default): the 8-bit V-Smooth path (ExpCast's softmax: ``warmup_attention``)
(``methods/vsmooth.py``: V re-grouped on V-Smooth's schedule, ``group_interval`` / ``group_fraction``, and
the grouping reused between, as ``method="vsmooth"`` does on the same steps), on its own metadata slot; with ``warmup_attention="sdpa"`` the warm-up is DENSE instead (stock SDPA, run by the op, the paper's).
Schedule (``phase_for``): WARMUP (or DENSE) warm-up, ANCHOR at ``anchor_steps`` (default: the paper's 20% and 52% of the
steps) and whenever no metadata is cached, REUSE otherwise; a block whose selection is older than the latest anchor
step (its call there was skipped, e.g. by a step or block cache: ``anchor_epoch``) selects at its next call.

Metadata ``SparseMeta`` (the token-sparse analogue of FlexAttention's BlockMask):
  sigma     [B, H, S] int32     query order; group g = sigma[g*C:(g+1)*C] (last group may be partial)
  idx       [B, H, G, n_keep / run]  the selection per group, ascending: key ids (``run = 1``) or run numbers r of
                                aligned runs of ``run`` keys (keys r*run .. r*run + run - 1), int16 where every
                                number fits (Sk / run < 2^15), else int32
  run       int                 keys a run: option ``key_run``, by default (None) the memory plan's: 1 where every
                                block's metadata fits, else the shortest of 2, 4, 8 that fits all (``memory_plan``);
                                64 for the ``selection_unit="block"`` ablation; 1 where Sk or n_keep is not a whole
                                number of runs
  residual  [B, H, S, Dv]       int8 codes (``residual="int8"``, the default), FP8 E4M3 codes (``"fp8"``) or bf16
                                (``"bf16"``), or None
  res_scale [B, H, S] fp32      per-token scale of the 8-bit codes (None otherwise): R = codes x scale, formed
                                in the gather kernel's epilogue
  density   float               realised density: n_keep / Sk (after rounding to the KV tile)
  epoch     int                 the anchor step (index in the schedule) that made it
Memory: the residual is the size of the attention output per site, block and CFG branch. Before storing
it the method checks the ``residual_budget_gb`` option (``inf`` = no limit) and the free GPU memory, and
raises a clear error naming the fixes instead of an OOM inside a kernel.

Hostile inputs (tests/test_hostile.py):
* A NaN/Inf in q, k or v at an anchor step gives a non-finite O_dense in its (b, h) -- returned like SDPA
  would -- but its selection and residual are not cached: a NaN residual would otherwise be added to
  every reuse step until the next anchor, long after the input is clean again. The previous metadata
  (if any) stays, else the next step anchors again. This costs one device->host sync per anchor step
  (a few per generation), none on reuse steps.
* A NaN/Inf in q propagates on every phase (row i, from the kernel itself). In keys or values no query group
  selected, a reuse step propagates it only with ``propagate_nonfinite=True`` (or the guard on): the gather
  kernel reads only the selected keys, so ``finite_flags`` (one pass over K and V) flags the heads with a
  non-finite key and the value columns with a non-finite element, and the kernel's epilogue writes NaN there
  (a NaN in K: the whole head, as SDPA; a +-Inf in K: the whole head, where fp32 SDPA has NaN on the rows
  whose logit is +Inf; V element (j, d): column d). Off by default: the flags pass costs far more of a reuse step
  than its target (docs/design/finite-flags.md). Anchor and warm-up steps
  return dense outputs: they propagate as is.
* fp16 outputs saturate at +-65504 instead of rounding up to inf (``methods.finish_output``).
* ``sparse_qk="fp8"`` on the reference path runs ``reference/sparse_attn_q8.py``.

Quality guard (``guard_threshold`` > 0, ``mcsparse_guard.py``): every reuse step also measures its own
relative error on R sampled query rows per head (exact rows from the finite-flags pass); ``ops`` asks
``mcsparse_guard.guard_check`` at the next call and runs it as an anchor when the reading exceeds the
threshold (``report()``: ``guard_anchors``).

Ablation switches (``experimental={...}``; the ladder of the paper's Table 5, docs/methods.md; defaults =
the full method):
* ``query_grouping="none"``: sigma = arange(S) (contiguous query tiles of C), no PDDP.
* ``selection="mean_pool"``: scores of each group's mean query against the keys (or key-block means),
  no pass 2 (the anchor still runs pass 1, so it returns the same O_dense as every other variant).
* ``selection_unit="block"``: the top 64-key blocks (exact: group masses summed per block), expanded to
  token indices (``torch_ops.expand_blocks``), so the same gather kernel runs every variant.
* ``selection_refresh="every_step"`` (mean_pool, no residual): the scores are recomputed from the current
  q, k at every sparse step (vanilla block-sparse attention); the grouping stays the anchor's.
The variants' scoring, block sums and block expansion are plain torch on every device (cheap next to the
attention); ``report()`` names them in the kernel path (``path_label``).
"""
from __future__ import annotations

import bisect
import math
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import torch_ops
from ..config import (Method, QueryGrouping, Residual, Selection, SelectionRefresh, SelectionUnit, SparseQK,
                      VCConfig, WarmupAttention)
from ..formats import FP8_DTYPE, KV_TILE, n_keep
from ..runtime import report as _report
from ..runtime import state
from ..kernels import configs as C
from ..kernels import dispatch
from . import mcsparse_guard
from .mcsparse_guard import GuardState, ReuseCheck
from .output import finish_output, kernel_out_dtype
from . import vsmooth
from .phase import Phase, warmup_steps
from .protocol import MethodSpec, Plan

# NOTE the paper's schedule: 10 dense warm-up steps of 50 (20%), anchors at steps 10 and 26 (20%, 52%). The
# warm-up is kept at 20% by fidelity: a shorter one saves a little attention and costs several dB on the demo clip.
# NOTE anchors at 20% / 52% (the paper's) kept: more anchors buy fidelity at a cost the user can choose
# (``anchor_steps`` / ``anchor_interval``); the default keeps the paper's speed. Both: docs/design/mcsparse-schedule.md
WARMUP_FRACTION = 0.2
ANCHOR_FRACTION = 0.52

_MASS_BYTES = 1 << 30  # pass-2 group masses are computed for as many heads as fit in 1 GiB at once


@dataclass
class SparseMeta:
    sigma: Optional[torch.Tensor]
    idx: Optional[torch.Tensor]
    residual: Optional[torch.Tensor]
    res_scale: Optional[torch.Tensor]
    density: float
    guard: Optional[GuardState] = None  # the quality guard's rows and readings (guard_threshold > 0)
    check: Optional[ReuseCheck] = None  # the reuse check of this anchor (option reuse_check)
    epoch: int = 0  # which anchor step of the schedule made it (``anchor_epoch``)
    # the anchor could not keep its metadata (the residual budget, the GPU's free memory, or it ran out): why. Nothing
    # is held; until the next anchor the reuse steps run stock SDPA (``plan``), never an exception mid-generation
    refused: Optional[str] = None
    # refused for the GPU's free memory (``_no_gpu_room``): the warm-up's dense 8-bit path runs instead of stock SDPA
    no_room: bool = False
    run: int = 1  # keys a run of ``idx`` (module docstring)


# ---- the schedule -----------------------------------------------------------------------------------------
def anchor_steps(cfg, n: int) -> Tuple[int, ...]:
    """The steps that re-select, ascending: the ``anchor_steps`` option, else every ``anchor_interval`` steps after
    the warm-up, else the first step after the warm-up and step 52% of n."""
    if cfg.anchor_steps is not None:
        return tuple(sorted(cfg.anchor_steps))
    w = warmup_steps(cfg, n, WARMUP_FRACTION)
    if cfg.anchor_interval is not None:
        return tuple(range(w, max(n, w + 1), cfg.anchor_interval))
    return tuple(sorted({w, max(w, int(round(ANCHOR_FRACTION * n)))}))


def _kept(meta: Optional["SparseMeta"], epoch: int) -> Optional["SparseMeta"]:
    """The previous selection, kept by an anchor step that could not make a finite one, as this epoch's: the
    block reuses it until the next anchor step rather than retrying the anchor at every call."""
    return None if meta is None else dataclasses.replace(meta, epoch=epoch)


def phase_for(cfg, step: int, n: int, has_meta: bool) -> Phase:
    if step < warmup_steps(cfg, n, WARMUP_FRACTION):
        return Phase.DENSE if cfg.warmup_attention == WarmupAttention.SDPA else Phase.WARMUP
    if step in anchor_steps(cfg, n) or not has_meta:
        return Phase.ANCHOR
    return Phase.REUSE


def anchor_epoch(cfg, step: int, n: int) -> int:
    """Which of the schedule's anchor steps ``step`` follows: 0 from the first anchor step on, 1 from the second,
    ...; -1 before the first."""
    return bisect.bisect_right(anchor_steps(cfg, n), step) - 1


@dataclass
class WarmupAt:
    """A warm-up step's plan metadata: whether it re-groups V (V-Smooth's own schedule, ``group_interval`` /
    ``group_fraction``: ``vsmooth.group_phase``) and the warm-up's grouping so far (None before the first)."""
    regroup: bool
    meta: Optional[vsmooth.VSmoothMeta]


@dataclass
class AnchorAt:
    """An anchor step's plan metadata: the epoch its selection starts (``SparseMeta.epoch``), the metadata it
    replaces (kept if the anchor cannot make a finite one) and the keys a run of its selection (``run_for``)."""
    epoch: int
    meta: Optional["SparseMeta"]
    run: Optional[int] = None


USES_KERNELS = True
FUSES_ROPE = False
NEEDS_IDENTITY = True  # a selection and residual cached for one block must never be applied to another
WARMUP_SLOT = ("warmup",)  # the V-Smooth warm-up's grouping: a slot of its own beside the selection's


def plan(cfg, step: int, n: int, slot, q, k, v, impl) -> Plan:
    """The schedule's phase with MC-Sparse's slots and guard: warm-up steps on the V-Smooth path use a grouping
    slot of their own (stock SDPA where the 8-bit kernels cannot take them; too sharp: stock SDPA too), the
    first anchor frees it, and a reuse step whose measured error passed ``guard_threshold`` re-anchors."""
    meta = slot(())
    phase = phase_for(cfg, step, n, meta is not None)
    epoch = anchor_epoch(cfg, step, n)
    if phase == Phase.REUSE and meta.epoch < epoch:
        # the block missed its anchor step (a step or block cache skipped its call there): select now, at its
        # first call after it, rather than reuse the previous epoch's selection to the end
        phase = Phase.ANCHOR
    if phase == Phase.WARMUP:
        if warmup_ineligible(q, k, v, impl) is None:
            return _eight_bit(cfg, step, n, slot)
        return Plan(Phase.DENSE, meta)
    run, note = _planned_run(cfg), None
    if phase == Phase.ANCHOR:
        key = getattr(slot, "key", None)  # the op's slots know their state key
        mp = memory_plan(cfg, key, q.device)
        if mp is not None and key is not None and mp.planned_out(key):  # no room: the warm-up's 8-bit path
            if warmup_ineligible(q, k, v, impl) is None:
                return _eight_bit(cfg, step, n, slot, note=(NO_PLAN_ROOM, mp.message()))
            return Plan(Phase.DENSE, meta, fallback=(NO_ROOM, mp.message()))
        if mp is not None and cfg.key_run is None:
            run = mp.run
            note = (KEY_RUNS, mp.runs_message()) if run > 1 and mp.keep == mp.planned else None
    oom = state.memo().get(OUT_OF_MEMORY)
    if phase == Phase.ANCHOR and (meta is None or meta.refused is not None) and oom and oom[0] == max(epoch, 0):
        # an anchor of this anchor step ran out of GPU memory: the blocks holding nothing wait for the next one
        return Plan(Phase.DENSE, meta, fallback=(NO_ROOM, oom[1]))
    if phase == Phase.ANCHOR and slot(WARMUP_SLOT) is not None:  # the warm-up is over: its grouping is not needed
        return Plan(phase, AnchorAt(max(epoch, 0), meta, run), drop=(WARMUP_SLOT,), note=note)
    if phase == Phase.REUSE and meta.refused is not None:
        # NOTE no room at the anchor: 8-bit attention like a block the plan left out, not stock SDPA (at 14B the
        # plan's estimate missed by 3 of 23 blocks: design/mcsparse-memory-plan.md)
        if meta.no_room and warmup_ineligible(q, k, v, impl) is None:
            return _eight_bit(cfg, step, n, slot, note=(NO_ANCHOR_ROOM, meta.refused))
        return Plan(Phase.DENSE, meta, fallback=(NO_ROOM, meta.refused))
    if phase == Phase.REUSE:
        err, reanchor = mcsparse_guard.guard_check(meta, cfg)
        if reanchor:
            return Plan(Phase.ANCHOR, AnchorAt(max(epoch, 0), meta, run), guard=(err, reanchor))
        check = meta.check
        if check is not None and check.poll():
            return Plan(Phase.DENSE, meta, fallback=(REUSE_WORSE, _check_message(check)))
        return Plan(phase, meta, guard=(err, reanchor), replay=check is None or not check.pending)
    if phase == Phase.ANCHOR:
        return Plan(phase, AnchorAt(max(epoch, 0), meta, run), note=note)
    return Plan(phase, meta)


def _planned_run(cfg) -> Optional[int]:
    """Keys a run of an anchor's selection: ``key_run``, else the generation's memory plan's (None before it)."""
    if cfg.key_run is not None:
        return cfg.key_run
    mp = state.memo().get("mcsparse_plan")
    return None if mp is None else mp.run


def _eight_bit(cfg, step: int, n: int, slot, note=None) -> Plan:
    """The warm-up's dense 8-bit path (V-Smooth, its grouping in a slot of its own, re-grouped on its schedule)."""
    wmeta = slot(WARMUP_SLOT)
    regroup = vsmooth.group_phase(cfg, step, n, wmeta is not None) == Phase.GROUP
    return Plan(Phase.WARMUP, WarmupAt(regroup, wmeta), WARMUP_SLOT, eight_bit=True, sharp_phase=Phase.DENSE,
                note=note)


def schedule(cfg, n: int):
    """Each step's phase in an n-step generation where every anchor keeps its metadata (the warm-up's: WARMUP,
    or DENSE with ``warmup_attention="sdpa"``)."""
    first = min(anchor_steps(cfg, n), default=n)
    return tuple(phase_for(cfg, i, n, has_meta=i > first) for i in range(n))


REUSE_WORSE = "mcsparse: reuse step worse than the previous output"
NO_ROOM = "mcsparse: no room to keep the anchor's metadata"
NO_PLAN_ROOM = "mcsparse: memory plan: dense 8-bit path, no room for the metadata"
NO_ANCHOR_ROOM = "mcsparse: dense 8-bit path to the next anchor, no room for the anchor's metadata"
KEY_RUNS = "mcsparse: memory plan: keys selected in runs, for every block's metadata to fit"
# NOTE the runs the plan tries, shortest first: each halves the selection's bytes and coarsens it
# (design/mcsparse-metadata-format.md)
PLAN_RUNS = (1, 2, 4, 8)
# NOTE 5% of the GPU stays out of the plan: activations can grow after it (design/mcsparse-memory-plan.md)
PLAN_MARGIN = 0.05
OUT_OF_MEMORY = "mcsparse_out_of_memory"  # the memo entry (epoch, why): an anchor of that epoch ran out of memory


@dataclass(frozen=True)
class MemoryPlan:
    """Which blocks of a generation keep an anchor's metadata (query order, selection, residual): made once, at the
    generation's first anchor step, from the blocks its warm-up ran (their state keys: site, block, branch,
    shapes), what each needs, the ``residual_budget_gb`` and the GPU's free memory. With ``key_run`` None the
    selection is key by key where every block fits, else in the shortest run of ``PLAN_RUNS`` with which all do
    (runs of 8 where none does): ``run``. The first blocks in call order that fit keep it; the others run the
    warm-up's dense 8-bit path (V-Smooth) for the whole generation, so the generation never runs out of memory at a
    later block's anchor. A block the warm-up did not run is not planned (its anchor checks its own metadata,
    ``_over_budget`` and ``_no_gpu_room``)."""
    planned: frozenset
    keep: frozenset
    need: int
    budget: float
    run: int = 1

    def planned_out(self, key) -> bool:
        return key in self.planned and key not in self.keep

    def _available(self) -> str:
        return _report.fmt_bytes(int(min(max(self.budget, 0), 2**62)))  # the budget is a float: inf, or below 0

    def message(self) -> str:
        return (f"MC-Sparse's metadata for all {len(self.planned)} blocks (every site and CFG branch) needs "
                f"{_report.fmt_bytes(self.need)}, {self._available()} is available (residual_budget_gb and the GPU's "
                f"free memory): {len(self.keep)} keep it and run sparse, {len(self.planned) - len(self.keep)} run "
                "the dense 8-bit path (V-Smooth) this generation, its selection "
                + (f"in runs of {self.run} keys" if self.run > 1 else "key by key")
                + ". options={'residual': 'none'} drops the residual, key_run=8 keeps an eighth of the selection")

    def runs_message(self) -> str:
        return (f"MC-Sparse's metadata for all {len(self.planned)} blocks fits the GPU only with the keys selected in "
                f"runs of {self.run} ({_report.fmt_bytes(self.need)} against {self._available()} available): every "
                "block runs sparse, "
                "at a coarser selection than key by key (docs/design/mcsparse-metadata-format.md). key_run=1 keeps "
                "key by key and runs the blocks without room on the dense 8-bit path")


def metadata_bytes(key: tuple, cfg, run: Optional[int] = None) -> int:
    """Bytes an anchor keeps for a state key's shapes: the selection ``idx`` [B, H, G, n_keep / run] (int16 or int32),
    the query order int32 [B, H, Sq], the residual [B, H, Sq, D] as cached; ``run``: keys a run asked for
    (``run_for``)."""
    (B, H, Sq, D), Sk = key[3], key[4][2]
    groups = -(-Sq // cfg.group_size)
    keep = n_keep(Sk, cfg.density)
    run = run_for(cfg, Sk, keep, run)
    entry = torch_ops.run_id_dtype(Sk, run).itemsize
    per_query = {Residual.BF16: 2 * D, Residual.INT8: D + 4, Residual.FP8: D + 4, Residual.NONE: 0}[cfg.residual] + 4
    return B * H * (groups * (keep // run) * entry + Sq * per_query)


def run_for(cfg, Sk: int, keep: int, run: Optional[int] = None) -> int:
    """Keys a run of the selection: the 64-key blocks of the ``selection_unit="block"`` ablation, else ``run`` (the
    memory plan's), else ``key_run``, else 1; 1 where Sk or ``keep`` is not a whole number of runs (the ablation
    then expands its blocks to key ids, a partial last block included)."""
    if cfg.experimental.selection_unit == SelectionUnit.BLOCK:
        run = KV_TILE
    run = run or cfg.key_run or 1
    if Sk % run or keep % run:
        return 1
    return run


_POOLS: dict = {}  # device index -> the MemPool the kept metadata lives in


def _metadata_pool(device):
    """The CUDA memory pool an anchor's kept metadata is allocated from, apart from the model's activations; None
    where there is none (not CUDA, a torch without ``MemPool``, or inside a CUDA graph capture)."""
    if getattr(device, "type", None) != "cuda" or not hasattr(torch.cuda, "use_mem_pool"):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        try:  # the model may borrow the pool's cached blocks when it runs out of memory itself
            _POOLS[index] = torch.cuda.MemPool(use_on_oom=True)
        except TypeError:  # an older signature
            _POOLS[index] = torch.cuda.MemPool()
    return _POOLS[index]


def _keep_apart(tensors: tuple, device) -> tuple:
    """Copies of the tensors an anchor keeps, allocated from the metadata pool (the originals are freed with the
    anchor's temporaries)."""
    # NOTE kept metadata must not split the segments of the model's activations: at 14B it left 9 GiB of the
    # allocator's cache unusable for a 2 GiB activation (design/mcsparse-memory-plan.md)
    pool = _metadata_pool(device)
    if pool is None:
        return tensors
    with torch.cuda.use_mem_pool(pool, device):
        return tuple(None if t is None else t.clone() for t in tensors)


def release_pools() -> None:
    """Forget the metadata pools: their cached blocks go back to the driver at the next ``empty_cache`` once the
    tensors in them are freed."""
    _POOLS.clear()


def _pool_free(device) -> int:
    """Bytes the metadata pool holds cached and unused (metadata of a generation that ended, or of an anchor's
    previous selection)."""
    pool = _POOLS.get(device.index if device.index is not None else torch.cuda.current_device())
    if pool is None:
        return 0
    try:
        snap = pool.snapshot()
    except Exception:  # noqa: BLE001 - a torch whose pool has no snapshot: count nothing (the safe side)
        return 0
    segments = snap.get("segments", []) if isinstance(snap, dict) else snap
    return sum(int(s.get("total_size", 0)) - int(s.get("allocated_size", 0)) for s in segments)


def _free_bytes(device) -> Tuple[int, int]:
    """(bytes metadata can take, total) on a CUDA device: the driver's free memory plus the metadata pool's unused
    blocks. What torch's allocator holds unused for the model is not counted: its activations come back every
    step (the FFN's buffers, an anchor's temporaries)."""
    free, total = torch.cuda.mem_get_info(device)
    return free + _pool_free(device), total


def _plan_free_bytes(device) -> Tuple[int, int]:
    """``_free_bytes`` once torch's unused cache went back to the driver: the plan's view, once a generation."""
    # NOTE the model's own cache held 30+ GB unused after a 14B generation's first anchors, out of the plan's
    # reach; its activations come back from the driver at their next step (design/mcsparse-memory-plan.md)
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.empty_cache()
    return _free_bytes(device)


def memory_plan(cfg, key: Optional[tuple], device) -> Optional[MemoryPlan]:
    """The generation's :class:`MemoryPlan` (made at its first call here), or None where there is nothing to
    plan: no key, or no block ran the warm-up."""
    memo = state.memo()
    if "mcsparse_plan" in memo or key is None:
        return memo.get("mcsparse_plan")
    planned = [k[:-len(WARMUP_SLOT)] for k in state.keys() if k[-len(WARMUP_SLOT):] == WARMUP_SLOT]
    if not planned:
        return None
    if key not in planned:
        planned.append(key)
    held = cfg.residual_budget_gb * 2**30 - state.bytes_held()
    free, total = _plan_free_bytes(device) if device.type == "cuda" else (None, None)

    def fit(run):
        sizes = [metadata_bytes(k, cfg, run) for k in planned]
        budget = held if free is None else min(held, free - max(sizes) - PLAN_MARGIN * total)  # new beside old
        keep, used = [], 0
        for k, n in zip(planned, sizes):  # a kept block drops its warm-up grouping, held in bytes_held above
            n -= state.nbytes(state.get(k + WARMUP_SLOT))
            if used + n > budget:
                break
            keep.append(k)
            used += n
        return sizes, budget, keep
    for run in (cfg.key_run,) if cfg.key_run is not None else PLAN_RUNS:
        sizes, budget, keep = fit(run)
        if len(keep) == len(planned):
            break
    memo["mcsparse_plan"] = plan = MemoryPlan(frozenset(planned), frozenset(keep), sum(sizes), budget, run)
    return plan


def _check_message(check: ReuseCheck) -> str:
    e_reuse, e_prev = check.errors
    return (f"its first reuse step after the anchor is further from exact attention (rel. L2 {e_reuse:.3f} on "
            f"sampled rows) than the anchor's own output would be ({e_prev:.3f}): its inputs move too much, or are "
            "too diffuse and noisy, for a reused selection and residual at this density. It runs stock SDPA until "
            "its next anchor step, where the check runs again. Raise 'density', anchor more often "
            "('anchor_interval'), or use method='vsmooth'; options={'reuse_check': False} keeps the sparse steps")


def replayable(phase: Phase, cfg) -> bool:
    """A reuse step whose launches depend only on q, k, v and the cached selection: not with the quality guard
    (host read-backs) or the non-finite flags pass, nor with a selection made again every step."""
    return (phase == Phase.REUSE and cfg.guard_threshold == 0 and not cfg.propagate_nonfinite
            and cfg.experimental.selection_refresh == SelectionRefresh.ANCHOR)


def needs_fp8(cfg) -> bool:
    """FP8 MMAs only with ``sparse_qk="fp8"``: the bf16 gather kernel, PDDP and selection run on any GPU Triton
    supports (8-bit residuals are plain torch casts). The V-Smooth warm-up's FP8 is checked per call
    (``warmup_ineligible``): without it the warm-up runs stock SDPA, not the whole method the reference."""
    return cfg.sparse_qk == SparseQK.FP8


def ineligible(q, k, v) -> Optional[str]:
    return dispatch.sparse_ineligible(q, k, v)


def warmup_ineligible(q, k, v, impl) -> Optional[str]:
    """Why a warm-up step cannot take the V-Smooth path with ``impl`` (the op then runs stock SDPA on it, the
    paper's warm-up), or None: the 8-bit kernels' limits, and FP8 tensor cores for its PV."""
    if impl != dispatch.Impl.TRITON:
        return None  # the reference runs any shape
    if not dispatch.fp8_capable(q.device):
        return "no FP8 tensor cores for the V-Smooth warm-up"
    return vsmooth.ineligible(q, k, v)


def warmup_run(q, k, v, *, meta, cfg, sm_scale, impl, regroup: bool = True):
    """One warm-up step on the V-Smooth path: what ``method="vsmooth"`` does on the same step. ``regroup``
    (the plan's ``WarmupAt``: V-Smooth's schedule, by default step 0 of a warm-up of 10): k-means of V
    warm-started from the previous grouping's centroids in ``meta`` (a ``VSmoothMeta``); otherwise that
    grouping is reused (``bench_vsmooth_schedule``, docs/img/vsmooth_schedule.png: over the first 10 steps of 50
    the grouping of step 0 gives the attention error of a fresh grouping at every step within ~2%)."""
    phase = Phase.GROUP if regroup else Phase.REUSE
    expcast = cfg.expcast or cfg.warmup_attention == WarmupAttention.EXPCAST
    return vsmooth.run(q, k, v, phase=phase, meta=meta, cfg=cfg, sm_scale=sm_scale, impl=impl, expcast=expcast)


def select(impl, q, k, sigma, lse2, *, sm_scale, group_size, keep, selection=Selection.EXACT,
           unit=SelectionUnit.TOKEN, max_mass_bytes: int = _MASS_BYTES, run: int = 1):
    """Scores + top-K (tokens; ``run`` > 1: the top runs of ``run`` keys by summed score, as run numbers) or top
    blocks (as runs of KV_TILE keys, ``run_for``; expanded to key ids where they are not whole runs), a chunk of
    heads at a time so the (S/C) x Sk scores stay within
    ``max_mass_bytes``. ``selection="exact"``: pass 2 (exact group masses, needs lse2); ``"mean_pool"``: mean
    query of each group against the keys / key-block means (lse2 unused)."""
    B, H, S, _ = q.shape
    Sk = k.shape[2]
    G = -(-S // group_size)
    block = unit == SelectionUnit.BLOCK
    hc = max(1, min(H, max_mass_bytes // max(1, B * G * Sk * 4)))
    parts = []
    for h0 in range(0, H, hc):
        sl = slice(h0, h0 + hc)
        if selection == Selection.EXACT:
            scores = dispatch.group_key_mass(impl, q[:, sl], k[:, sl], sigma[:, sl], lse2[:, sl],
                                             sm_scale=sm_scale, group_size=group_size)
            if block:
                scores = torch_ops.block_mass(scores, KV_TILE)
        else:
            scores = torch_ops.mean_pool_scores(q[:, sl], k[:, sl], sigma[:, sl], sm_scale=sm_scale,
                                                group_size=group_size, block=KV_TILE if block else 1)
        if block and run == 1:  # blocks that are not whole runs: as key ids
            parts.append(torch_ops.expand_blocks(scores, keep, Sk, KV_TILE))
        else:  # block scores are already per run of KV_TILE keys
            parts.append(dispatch.select_topk(scores if block else torch_ops.run_mass(scores, run), keep // run))
        del scores
    return torch.cat(parts, dim=1)


def query_order(impl, q, cfg) -> torch.Tensor:
    """sigma [B, H, S]: Fast PDDP groups, or the identity (contiguous tiles) for ``query_grouping="none"``."""
    if cfg.experimental.query_grouping == QueryGrouping.NONE:
        B, H, S, _ = q.shape
        return torch_ops.identity_perm(B, H, S, q.device)
    return dispatch.pddp_perm(impl, q, cfg.group_size)


def path_label(path: str, phase, cfg, q=None, v=None) -> str:
    """The kernel path recorded in ``report()`` for this call: ``path`` ("triton", "reference", ...), the
    gather kernel's label where the call runs the Gluon sm_90 one (``dispatch.sparse_kernel``, the same decision
    the call makes; q and v given), plus the parts of the ablation variants that run as plain torch on the
    Triton path."""
    ex = cfg.experimental
    if phase == Phase.WARMUP:
        return vsmooth.path_label(path, phase, cfg, q, v)
    if path != "triton" or phase not in (Phase.ANCHOR, Phase.REUSE):
        return path
    if q is not None and v is not None:
        path = dispatch.sparse_label(q, v, cfg.sparse_qk.value, cfg.group_size)
    selects = phase == Phase.ANCHOR or ex.selection_refresh == SelectionRefresh.EVERY_STEP
    if not selects:
        return path
    if ex.selection == Selection.MEAN_POOL:
        return path + "+torch:mean_pool_select"
    if ex.selection_unit == SelectionUnit.BLOCK:
        return path + "+torch:block_select"
    return path


def _compact(resid: torch.Tensor, mode: str):
    """The residual as kept: bf16, 8-bit codes with one scale a token (``torch_ops.row_codes``), or nothing."""
    if mode == "none":
        return None, None
    if mode == "bf16":
        return resid.to(torch.bfloat16), None
    return torch_ops.row_codes(resid, torch.int8 if mode == "int8" else FP8_DTYPE)


MEMORY_HINT = ("use options={'residual': 'int8'} (the default: half a bf16 residual's memory) or 'none' (no "
               "residual), key_run=8 (an eighth of a key-by-key selection), raise 'residual_budget_gb', or fewer "
               "sparse layers/branches")


def _over_budget(need: int, cfg, replaced: int = 0) -> Optional[str]:
    """Why the anchor cannot keep ``need`` bytes of metadata under ``residual_budget_gb``, with the fixes; None when
    it can. ``replaced``: bytes of the block's previous metadata, which the new replaces (freed once it is kept)."""
    held = state.bytes_held() - replaced
    budget = cfg.residual_budget_gb * 2**30  # a float: inf (no limit) must not go through int()
    if held + need > budget:
        return (f"keeping this anchor's metadata ({_report.fmt_bytes(need)}) would bring the metadata held to "
                f"{_report.fmt_bytes(held + need)}, over residual_budget_gb={cfg.residual_budget_gb}; the anchor's "
                f"output is exact, and its block runs stock SDPA until its next anchor step, which tries again: "
                f"{MEMORY_HINT}")
    return None


def _no_gpu_room(need: int, device) -> Optional[str]:
    """Why the GPU has no room for ``need`` bytes of metadata beside the plan's margin, with the fixes; None where it
    has (or ``device`` is not a GPU)."""
    if getattr(device, "type", None) != "cuda":
        return None
    free, total = _free_bytes(device)
    room = need + int(PLAN_MARGIN * total)  # kept beside the old, with the plan's margin
    if room <= free:
        return None
    return (f"the anchor's metadata needs {_report.fmt_bytes(need)} and the margin {_report.fmt_bytes(room - need)}, "
            f"but the GPU has {_report.fmt_bytes(free)} free for it; the anchor's output is exact, and until its "
            "next anchor step, which tries again, its block runs the dense 8-bit path (V-Smooth), or stock SDPA "
            f"where that path cannot take its inputs: {MEMORY_HINT}")


# ---- the cheap anchor step (methods/anchor.py) ---------------------------------------------------
def cheap_anchor_applies(q, k, v, cfg) -> Optional[str]:
    """None when the anchor can run ``methods/anchor.anchor_step`` (INT8 pass 2: self-attention, D in {64, 128},
    the exact token selection), else why not."""
    ex = cfg.experimental
    if ex.selection != Selection.EXACT or ex.selection_unit != SelectionUnit.TOKEN:
        return (f"experimental selection={ex.selection.value!r}, selection_unit={ex.selection_unit.value!r} "
                "(needs 'exact' / 'token')")
    if not q.shape == k.shape == v.shape:
        return f"q, k, v of different shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (cross-attention)"
    if q.shape[-1] not in (64, 128):
        return f"head dim {q.shape[-1]} (needs 64 or 128)"
    return None


def _cheap_anchor(impl, q, k, v, sigma, cfg, sm_scale, keep, run):
    """(out, O_dense, idx, R or None) by ``methods/anchor.anchor_step`` over ``impl``'s kernels; R in bf16, formed in
    the gather kernel's epilogue (8-bit residuals are quantised from it, ``_compact``)."""
    from . import anchor as A

    res = A.anchor_step(impl, q, k, v, sm_scale=sm_scale, group_size=cfg.group_size, keep=keep,
                        cfg=A.AnchorConfig(dense_out=cfg.anchor_dense), sigma=sigma,
                        residual=cfg.residual != Residual.NONE, out_dtype=kernel_out_dtype(q.dtype),
                        sparse_qk=cfg.sparse_qk.value,
                        residual_dtype=torch.bfloat16, run=run)
    out = finish_output(res.out, q.dtype).contiguous()  # SDPA's layout, as the original passes
    return out, res.out, res.idx, res.residual
# ----------


def run(q, k, v, *, phase, meta: Optional[SparseMeta], cfg, sm_scale, impl, cheap_anchor: Optional[bool] = None):
    """``cheap_anchor`` (anchor steps): None = ``methods/anchor.anchor_step`` where it applies (the
    default), False = the original passes (cuDNN + LSE, bf16 pass 2, torch top-K; docs/design/anchor-selection.md
    times both), True = anchor_step or a ValueError saying why it does not apply. WARMUP: ``meta`` is a ``WarmupAt``
    holding the warm-up's own ``VSmoothMeta`` slot (the op keeps it apart from the sparse metadata, so a warm-up
    never looks like a cached selection; a bare ``VSmoothMeta`` or None re-groups)."""
    if phase == Phase.WARMUP:
        regroup, wmeta = (meta.regroup, meta.meta) if isinstance(meta, WarmupAt) else (True, meta)
        return warmup_run(q, k, v, meta=wmeta, cfg=cfg, sm_scale=sm_scale, impl=impl, regroup=regroup)
    epoch, run = 0, None
    if isinstance(meta, AnchorAt):  # an anchor step as ``plan`` gives it
        epoch, run, meta = meta.epoch, meta.run, meta.meta
    C = cfg.group_size
    ex = cfg.experimental
    Sk = k.shape[2]
    keep = n_keep(Sk, cfg.density)

    def sparse(sigma, idx, **kw):
        return dispatch.sparse_attention(impl, q, k, v, sigma, idx, sm_scale=sm_scale, group_size=C,
                                         qk_format=cfg.sparse_qk.value, **kw)
    if phase == Phase.REUSE and meta is not None:
        idx = meta.idx
        if ex.selection_refresh == SelectionRefresh.EVERY_STEP:  # vanilla block-sparse: select again
            idx = select(impl, q, k, meta.sigma, None, sm_scale=sm_scale, group_size=C, keep=keep,
                         selection=ex.selection, unit=ex.selection_unit, run=meta.run)
        return _reuse(impl, q, k, v, meta, idx, cfg, sm_scale, sparse), meta
    try:
        return _anchor(q, k, v, meta, epoch, cfg, sm_scale, impl, keep, sparse, cheap_anchor, run)
    except torch.OutOfMemoryError as e:  # never an exception mid-generation for lack of memory
        msg = str(e).splitlines()[0][:120]
    # NOTE outside the handler: its traceback holds the failed anchor's temporaries until the block ends
    return _stock_after_oom(q, k, v, sm_scale, keep / Sk, epoch, msg)


def _stock_after_oom(q, k, v, sm_scale, density, epoch, msg):
    """An anchor out of GPU memory: stock SDPA's output and nothing kept. Where stock SDPA itself finds no room,
    every block's kept metadata is released first (they run stock SDPA until their next anchor): what is left is
    stock's own footprint. The blocks holding nothing skip this anchor step (``plan``) and try at the next."""
    why = (f"the anchor step ran out of GPU memory ({msg}); the anchor's output is stock SDPA, and its block runs "
           f"stock SDPA until its next anchor step, which tries again: {MEMORY_HINT}")
    state.memo()[OUT_OF_MEMORY] = (epoch, why)
    try:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=sm_scale).contiguous()
    except torch.OutOfMemoryError:
        out = None
    if out is None:
        freed = _shed_metadata(why)
        if q.is_cuda:
            release_pools()  # the metadata pool's blocks can then go back to the driver
            torch.cuda.empty_cache()  # the released blocks back to the driver, unfragmented
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=sm_scale).contiguous()
        why += f"; stock SDPA found room only after every block's metadata ({_report.fmt_bytes(freed)}) was released"
        state.memo()[OUT_OF_MEMORY] = (epoch, why)
    return out, SparseMeta(sigma=None, idx=None, residual=None, res_scale=None, density=density, epoch=epoch,
                           refused=why)


def _shed_metadata(why: str) -> int:
    """Release the anchor metadata every block of the active loop keeps (each runs stock SDPA until its next
    anchor, ``refused``); the bytes released."""
    freed = 0
    for key, meta in state.items():
        if isinstance(meta, SparseMeta) and meta.refused is None:
            freed += state.nbytes(meta)
            state.put(key, SparseMeta(sigma=None, idx=None, residual=None, res_scale=None, density=meta.density,
                                      epoch=meta.epoch, refused=why))
    return freed


def _anchor(q, k, v, meta, epoch, cfg, sm_scale, impl, keep, sparse, cheap_anchor, run=None):
    """An anchor step: (the exact output, the new metadata) (module docstring)."""
    C, ex, Sk = cfg.group_size, cfg.experimental, k.shape[2]
    # ---- cheap anchor where it applies, else (and with cheap_anchor=False) the original passes ----
    why_not = cheap_anchor_applies(q, k, v, cfg)
    if cheap_anchor and why_not:
        raise ValueError(f"mcsparse: cheap_anchor=True cannot run this anchor: {why_not}. Pass cheap_anchor=None "
                         "to fall back to the original passes.")
    sigma = query_order(impl, q, cfg)
    run = run_for(cfg, Sk, keep, run)
    resid = None
    if why_not is None and cheap_anchor is not False:
        out, o_dense, idx, resid = _cheap_anchor(impl, q, k, v, sigma, cfg, sm_scale, keep, run)
    else:
        # pass 1 for every variant (mean-pooled scores do not need the LSE): the anchor step returns the same
        # O_dense whatever the ablation switches, so the ladder's rungs differ only in what they switch
        o_dense, lse2 = dispatch.dense_with_lse(impl, q, k, v, sm_scale)
        out = o_dense.to(q.dtype).contiguous()
        idx = select(impl, q, k, sigma, lse2, sm_scale=sm_scale, group_size=C, keep=keep,
                     selection=ex.selection, unit=ex.selection_unit, run=run)
    # ----------
    residual = res_scale = None
    if cfg.residual != Residual.NONE:
        if resid is None:  # the original passes (anchor_step forms R itself)
            o_sparse = sparse(sigma, idx, out_dtype=torch.float32, run=run)
            resid = o_dense.float() - o_sparse.float()
            del o_sparse
        # One sync per anchor step (see the module docstring). The residual, not O_dense alone: a dense
        # kernel may return a finite row for an Inf query where the sparse one does not.
        if not bool(torch.isfinite(resid).all()):
            return out, _kept(meta, epoch)
        residual, res_scale = _compact(resid, cfg.residual.value)
    elif not bool(torch.isfinite(o_dense).all()):
        return out, _kept(meta, epoch)
    del resid, o_dense
    # NOTE kept narrow: int32 query order, 16-bit run numbers where they fit (design/mcsparse-metadata-format.md)
    kept = (sigma.to(torch.int32) if sigma.shape[2] < 2**31 else sigma,
            idx.to(torch_ops.run_id_dtype(Sk, run)), residual, res_scale)
    need = state.nbytes(kept)
    over = _over_budget(need, cfg, state.nbytes(meta))
    short = None if over else _no_gpu_room(need, q.device)
    if over or short:  # nothing kept: stock SDPA (over budget) or the dense 8-bit path (no room) to the next anchor
        return out, SparseMeta(sigma=None, idx=None, residual=None, res_scale=None, density=keep / Sk,
                               epoch=epoch, refused=over or short, no_room=short is not None)
    sigma, idx, residual, res_scale = _keep_apart(kept, q.device)
    del kept
    meta = SparseMeta(sigma=sigma, idx=idx, residual=residual, res_scale=res_scale, density=keep / Sk, epoch=epoch,
                      run=run)
    if cfg.reuse_check and cfg.guard_threshold == 0:  # with the guard on, the guard measures every reuse step
        meta.check = ReuseCheck.new(q, out)
    return out, meta


# ---- the reuse step's NaN/Inf flags and quality guard (the anchor path above is untouched) -------
def _reuse(impl, q, k, v, meta: SparseMeta, idx, cfg, sm_scale, sparse):
    """The reuse step's output in q.dtype. NaN/Inf in keys or values no group selected would vanish in the
    gather: one pass over K and V flags them and the kernel writes NaN where SDPA's output is non-finite (module
    docstring). With the guard on, the same pass computes the sampled rows exactly and the step records its
    error (read back at a later call: ``mcsparse_guard.guard_check``)."""
    guard = None
    if cfg.guard_threshold > 0:
        if meta.guard is None:  # the first reuse step since the anchor that made ``meta``
            meta.guard = GuardState.new(q)
        guard = meta.guard
    check = meta.check if meta.check is not None and meta.check.pending else None  # (None with the guard on)
    rows = guard.rows if guard is not None else check.rows if check is not None else None
    flag = part = None
    if rows is not None or cfg.propagate_nonfinite:  # off by default: +19% of a reuse step (config NOTE)
        probe = (q, rows, sm_scale) if rows is not None else None
        flag, part = dispatch.finite_flags(impl, k, v, probe=probe)
    if guard is None and not cfg.propagate_nonfinite:
        flag = None  # the check's pass: its flags are not applied (one contract on every reuse step)
    out = sparse(meta.sigma, idx, residual=meta.residual, res_scale=meta.res_scale, run=meta.run,
                 out_dtype=kernel_out_dtype(q.dtype), flag=flag)
    if guard is not None:
        guard.record(dispatch.probe_error(impl, out, guard.rows, part))
    if check is not None:  # once per anchor: this step against the anchor's output, on the same sampled rows
        B, H, R = check.rows.shape
        own = torch.arange(R, device=q.device, dtype=torch.int32).expand(B, H, R)
        check.reading = mcsparse_guard.Readback(torch.cat([dispatch.probe_error(impl, out, check.rows, part),
                                                           dispatch.probe_error(impl, check.anchor_rows, own, part)]))
    return finish_output(out, q.dtype)


def main_kernel(q, v, cfg) -> Optional[str]:
    return dispatch.sparse_kernel(q, v, cfg.sparse_qk.value, cfg.group_size)


_FIXED = ("on this GPU MC-Sparse's reuse step runs the sm_90 gather kernel ({kernel}), whose launch is fixed per group "
          "size (kernels/configs.py, sparse_sm90_default): there is nothing to tune; its kernels build at the first "
          "call, or ahead with 'python -m vc_compile warmup'.")


def _tune(a):
    """``vc_compile tune --method mcsparse``: the gather kernel of a reuse step at ``--density``, on random inputs
    with one selected key per stride; a str where its launch is fixed (nothing to tune)."""
    if a.sparse_qk == SparseQK.INT8.value:
        return ("sparse_qk='int8' runs the sm_90 gather kernel, whose launch is fixed per group size "
                "(kernels/configs.py, sparse_sm90_default): there is nothing to tune; its kernels build at the first "
                "call, or ahead with 'python -m vc_compile warmup'.")

    def build(q, k, v):
        B, H, S, D = q.shape
        Cg, dev = a.group_size, q.device
        kernel = dispatch.sparse_kernel(q, v, a.sparse_qk, Cg)
        if kernel != "sparse_attn":
            return _FIXED.format(kernel=kernel)
        cands = dispatch.sparse_candidates(a.sparse_qk, D, Cg)
        keep, G = n_keep(S, a.density), -(-S // Cg)
        g = torch.Generator(device=dev).manual_seed(1)
        sigma = torch.arange(S, device=dev).expand(B, H, S)
        j = torch.arange(keep, device=dev)
        lo, hi = (j * S) // keep, ((j + 1) * S) // keep  # one key per stride, at a random place in it
        idx = (lo + (torch.rand(B, H, G, keep, device=dev, generator=g) * (hi - lo)).long()).to(torch.int32)
        res = torch.randn(B, H, S, D, device=dev, dtype=q.dtype, generator=g) * 0.01
        out_dtype, sm = kernel_out_dtype(q.dtype), D ** -0.5

        def call(config=None):
            return dispatch.sparse_attention(dispatch.Impl.TRITON, q, k, v, sigma, idx, sm_scale=sm, group_size=Cg,
                                             residual=res, out_dtype=out_dtype, qk_format=a.sparse_qk, launch=config)
        return kernel, cands, call
    return build


# The ablation ladder of the MC-Sparse paper's Table 5 (demo ``--ladder``): each rung adds one component to the
# previous one; L5 is the full method (the default options). L1b is not in the paper: mean-pooled blocks selected
# at the anchors and reused, so L1 -> L1b isolates reuse and L1b -> L2 the selection rule alone. Every rung has the
# same schedule (dense warm-up, dense anchor steps).
_BSA = {"selection_unit": "block", "query_grouping": "none"}  # the ablation knobs are experimental options
_LADDER = (
    ("L1:bsa-meanpool", {"residual": "none",
                         "experimental": {**_BSA, "selection": "mean_pool", "selection_refresh": "every_step"}}),
    ("L1b:bsa-meanpool-reused", {"residual": "none", "experimental": {**_BSA, "selection": "mean_pool"}}),
    ("L2:bsa-exact-reused", {"residual": "none", "experimental": dict(_BSA)}),
    ("L3:token", {"residual": "none", "experimental": {"query_grouping": "none"}}),
    ("L4:+pddp", {"residual": "none"}),
    ("L5:+residual", {}),
)

# ---- the stateless op (a kernel call with given metadata, no cache; registered on import) ----
_DEFAULTS = VCConfig()  # the op schema's defaults: the runtime's


@torch.library.custom_op("vcattn::sparse_attention", mutates_args=())
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor,
                     idx: torch.Tensor, residual: Optional[torch.Tensor], group_size: int = _DEFAULTS.group_size,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Stateless token-gather sparse attention with given query groups and key selection (16-bit QK)."""
    cfg = VCConfig(method=Method.MCSPARSE, group_size=group_size)
    impl, _ = dispatch.choose("mcsparse", cfg.experimental.kernels, needs_fp8(cfg), q.device)
    sm = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = dispatch.sparse_attention(impl, q, k, v, sigma, idx, sm_scale=sm, group_size=group_size,
                                    residual=residual, out_dtype=kernel_out_dtype(q.dtype))
    return finish_output(out, q.dtype)  # fp16: saturate instead of rounding up to inf


@sparse_attention.register_fake
def _(q, k, v, sigma, idx, residual, group_size=_DEFAULTS.group_size, scale=None):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


# what the consumers outside the op read (methods/protocol.py); the densities of the demo's and benchmarks' rows
SPEC = MethodSpec(
    label=lambda cfg: f"mcsparse@{cfg.density:g}",
    variants=(("mcsparse@0.15", {"method": "mcsparse", "density": 0.15}),
              ("mcsparse@0.25", {"method": "mcsparse", "density": 0.25})),
    warmup=("mcsparse@0.15",),  # the density changes no kernel
    ladder=tuple((name, {"method": "mcsparse", **opts}) for name, opts in _LADDER),
    helpers=2,  # its warm-up, anchor and reuse kernels build in two chains
    tune=_tune,
    head_dim_error=C.pow2_head_dim_error,
)
