"""The ``vcattn::`` custom ops: the only door from compiled graphs to our kernels.

``vcattn::attention(q, k, v, ident, site, config, scale) -> out``
    What the rewrite pass puts in place of an eligible ``scaled_dot_product_attention``. Opaque to
    Dynamo/Inductor (an op defined through ``torch.library.Library``, with a fake impl), so all step/phase
    logic runs here at run time and never recompiles. q, k, v are [B, H, S, D] (any strides; usually a permuted view of
    the projection output); ``ident`` is the block-identity tensor (the weight that feeds the q
    projection) or None; ``site`` the call-site id; ``config`` the VCConfig as JSON; ``scale`` SDPA's
    ``scale`` argument. Returns a contiguous [B, H, S, Dv] tensor in q's dtype.

    Prologue fusion (``passes/rope_fuse.py``): with ``rope`` (a JSON spec, formats.py)
    q and k arrive *un-rotated in the model's layout* (e.g. [B, S, H, D] before the permute, or [B, S, C]
    before the head split) with the model's ``cos``/``sin`` tables; the op views them as [B, H, S, D] and
    V-Smooth's preprocessing kernel applies the RoPE as it loads them. Every other path (stock SDPA
    fallbacks, other methods) first rotates them with the fp32 reference, so results never depend on
    whether the pass fused.

    Padding masks: with ``key_mask`` (a boolean mask SDPA would broadcast as [B, 1, 1, Sk] or [B, 1, Sq, Sk]:
    HunyuanVideo's joint attention over video + padded text tokens, HunyuanVideo 1.5's ``valid_i & valid_j``; the
    rewrite pass passes it on) the op reads the mask (``key_prefix``: two small device-to-host copies a call):
    where every batch row keeps exactly the first L keys, for every query or for the first L queries, the method
    runs on the first L keys (with q, k, v of one length, on the first L queries too; the other query rows go
    through stock SDPA, on the kept keys or with their own mask rows: rows are independent); a mask that keeps the
    same L keys for every query but not as a prefix (QwenImage: the prompt's padding before the image tokens) runs
    the method on those keys gathered in order (attention does not see the keys' order); any other mask runs stock
    SDPA with it, the reason counted (``key_padded``) and warned once per reason.

    Tagged ``cudagraph_unsafe``: under ``mode="reduce-overhead"``/``"max-autotune"`` Inductor partitions
    the CUDA graph around it, so its Python runs on every call and phases never freeze.

``vcattn::vsmooth_attention(q, k, v, perm, expcast, hadamard, qk_format, smooth_v, scale)`` and
``vcattn::sparse_attention(q, k, v, sigma, idx, residual, group_size, scale)``: stateless ops exposing
the kernels themselves (benchmarks, users who manage metadata); their defaults are ``VCConfig``'s.

The data path: op -> ``methods.get(method)`` (the method's schedule and its ``run``) -> ``kernels/dispatch.py``
(reference / Triton / Gluon, launch configs) -> the kernel.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import weakref
from typing import Dict, Optional, Set, Tuple

import torch
import torch.nn.functional as F

from . import formats, methods, toolchain, torch_ops
from .config import SpeedGate, VCConfig
from .methods import Phase
from .kernels import graphs as _graphs  # noqa: F401  (provides the runtime's graphs part)
from .kernels import programs as _programs
from .runtime import report as _report
from .runtime import runtime as _runtime
from .runtime import state
from .runtime.steps import TRACKER
from .kernels import dispatch
from .tune import gate as _gate
from .tune import lookup as _tune

_TAGS = (torch._C.Tag.cudagraph_unsafe,) if hasattr(torch._C.Tag, "cudagraph_unsafe") else ()
# what the methods take; the rewrite pass (passes/sdpa_rewrite.py) checks the same tuple at compile time
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
_DEFAULTS = VCConfig()  # the stateless ops' defaults (one source of truth: VCConfig)


@functools.lru_cache(maxsize=256)
def _config(config: str) -> VCConfig:
    return VCConfig.from_json(config)


@functools.lru_cache(maxsize=16)
def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def gate_reason(cfg: VCConfig, device: torch.device, q_shape, keys: int) -> Optional[str]:
    """The speed gate's reason to leave a call of q's [B, H, S, D] shape and ``keys`` keys on ``device`` (CUDA) to
    stock SDPA, or None (``speed_gate='off'``, no measurements for this GPU, or ours is faster there)."""
    if cfg.speed_gate != SpeedGate.AUTO:
        return None
    B, H, S, D = q_shape
    return _gate.slower_than_stock(_gpu_name(device), methods.get(cfg.resolved_method).SPEC.label(cfg),
                                   float(B * H * S * keys * D))


def ungated_gpu(cfg: VCConfig, device: torch.device) -> str:
    """The name of ``device``'s GPU when the speed gate is on (``speed_gate='auto'``) but its table has no
    measurements for that GPU, so nothing is gated there (report() says so per site); "" otherwise."""
    if cfg.speed_gate != SpeedGate.AUTO:
        return ""
    gpu = _gpu_name(device)
    return "" if _gate.measured(gpu) else gpu


def runtime_ineligible(q, k, v, cfg: VCConfig) -> Optional[str]:
    """Reasons only knowable at run time (symbolic shapes in the graph, devices), plus the rewrite's own
    checks again for callers that reach the op directly: whatever the methods cannot run goes to stock
    SDPA (which then returns its result, or raises its own error for inputs SDPA refuses too)."""
    return _shape_ineligible(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, cfg.min_seq_len, cfg.head_dims)


# NOTE memoised: the checks are a function of shapes, dtypes and two options, and they ran on every call;
# docs/design/host-overhead.md
@functools.lru_cache(maxsize=4096)
def _shape_ineligible(qs, ks, vs, qd, kd, vd, min_seq_len: int, head_dims) -> Optional[str]:
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return "not 4-D [B, H, S, D]"
    if 0 in qs or 0 in ks or 0 in vs:
        return "empty input"
    if qs[:2] != ks[:2] or ks[:3] != vs[:3]:
        return "gqa or shape mismatch"
    if qd not in SUPPORTED_DTYPES or kd != qd or vd != qd:
        return "dtype unsupported"
    if qs[2] < min_seq_len:
        return "sequence too short"
    if ks[2] < min_seq_len:
        return "cross-attention too short"
    if qs[-1] not in head_dims or ks[-1] != qs[-1] or vs[-1] != qs[-1]:
        return "head_dim unsupported"
    return None


# Metadata of a block whose weight is freed (the model was deleted) is dropped right away instead of at
# the next generation: a deleted pipeline's MC-Sparse residuals can be GBs, and the next model is
# usually loaded before anything starts a new generation. The finalizer only queues the block (it can
# run inside a garbage collection triggered while this thread holds the state lock); the queue is
# drained at once when the lock is free, else at the next op call.
# What the op remembers per site lives in the process's Runtime (runtime/runtime.py: Checks); bound here once.
_RUNTIME = _runtime.current()
_CHECKS = _RUNTIME.checks
GRAPHS = _runtime.current().graphs  # the reuse steps replayed as CUDA graphs (kernels/graphs.py)
PROGRAMS = _runtime.current().programs  # the reuse steps replayed as recorded launches (kernels/programs.py)
_WATCHED: Dict[Tuple[int, int], "_Watch"] = _CHECKS.watched  # (site, ident_ptr) -> the weight, metadata keys written
_FREED: collections.deque = _CHECKS.freed


class _Watch:
    """One watched block: the weight it was registered for (weakly) and the metadata keys written for it.
    A finalizer names the entry it belongs to, so a late one (queued while the state lock was held) can
    never drop the entry of a newer weight that took the same address and site."""

    __slots__ = ("ref", "keys", "__weakref__")

    def __init__(self, ref):
        self.ref, self.keys = ref, set()


def _ident_freed(block: Tuple[int, int], entry: "_Watch") -> None:
    _FREED.append((block, entry))
    if not state.busy() and not _report.busy():  # (state.put may take the report's)
        _drain_freed()


def _drain_freed() -> None:
    while _FREED:
        try:
            block, entry = _FREED.popleft()
        except IndexError:
            return
        if _WATCHED.get(block) is not entry:
            continue  # the address was watched again for a newer weight: that entry is not this one's
        del _WATCHED[block]
        _drop_keys(entry.keys)


def _watch(ident: Optional[torch.Tensor], key: tuple) -> None:
    if not isinstance(ident, torch.nn.Parameter):
        return  # only module weights are stable objects; a per-call alias would drop metadata every call
    block = key[:2]
    entry = _WATCHED.get(block)
    if entry is None or entry.ref() is not ident:
        # new, or an entry whose weight died unseen (its finalizer still queued) or is another object at
        # the same address: this weight gets its own finalizer, else deleting it would not free its metadata
        try:
            ref = weakref.ref(ident)
        except TypeError:  # a tensor subclass without weakref support: dropped at the next generation
            return
        if entry is not None:
            _WATCHED.pop(block)
            _drop_keys(entry.keys - {key})  # (``key`` was just written for this weight)
        entry = _WATCHED[block] = _Watch(ref)
        weakref.finalize(ident, _ident_freed, block, entry).atexit = False
    entry.keys.add(key)


def _drop_keys(keys) -> None:
    for key in keys:
        if state.get(key) is not None:
            state.put(key, None)


def _forget_watched(_gen: int) -> None:  # a new generation cleared the store: the key sets start over
    for entry in _WATCHED.values():
        entry.keys.clear()


# Block identity checks (MC-Sparse): a selection and residual cached at an anchor step are reused at later
# steps of the block they were computed for, found again by the identity weight's address. Two things break
# that, and both make the site refuse MC-Sparse (stock SDPA, a warning naming the fix, a report reason) rather
# than apply one block's selection to another:
# * no identity: the rewrite found no q-projection weight (``has_identity=False``) while one graph may serve
#   several blocks (regional compile, a shared attention function, two experts): call order alone is not an
#   identity once a block is skipped at some steps (block caching, skip-layer guidance).
# * an unstable identity: the weight at an address seen before in this generation is another tensor object
#   or was overwritten in place since (``_version``), e.g. offloading that copies block weights into reused
#   staging buffers; its address then names another block at another step.
# A call the op is handed directly with ``ident=None`` on a site it registered itself (benchmarks, tests,
# users managing one block per site) keeps the old contract: the caller guarantees one block per site.
NO_IDENTITY = "mcsparse: no block identity"
UNSTABLE_IDENTITY = "mcsparse: block identity unstable"
_IDENTS: Dict[Tuple[int, int], tuple] = _CHECKS.idents  # (site, ident ptr) -> (version, weakref or storage id)
_UNSTABLE: Dict[int, str] = _CHECKS.unstable  # site -> what was seen (refused until vc_compile.reset())
_IDENT_WARNED: Set[Tuple[int, str]] = _CHECKS.ident_warned

_FIXES = {
    NO_IDENTITY: "its graph may serve several blocks (regional compile, an attention function shared by "
                 "layers) and no per-block identity reached it (q is not produced by a linear of a module "
                 "weight inside the compiled code), so a cached selection could be applied to another block. "
                 "Fix: compile the block or the whole transformer so that q's projection (nn.Linear, or "
                 "F.linear of a weight parameter, dequantised or not) is inside the compiled code, or use "
                 "method='vsmooth' (no cached selection)",
    UNSTABLE_IDENTITY: "the q-projection weight identifying its block was replaced or overwritten in place "
                       "between calls of one generation (CPU offloading that copies weights into reused "
                       "buffers?), so its address may name another block at another step. Fix: keep the "
                       "transformer's weights resident during sampling (diffusers' "
                       "enable_model_cpu_offload moves whole models between calls, which is fine; sequential "
                       "or group offloading is not), or use method='vsmooth'",
}


def _ident_token(ident: torch.Tensor):
    if isinstance(ident, torch.nn.Parameter):
        try:
            return weakref.ref(ident)
        except TypeError:
            pass
    try:
        return ("storage", ident.untyped_storage()._cdata)
    except Exception:  # a tensor subclass without one storage
        return None


def _same(token, ident) -> bool:
    if isinstance(token, weakref.ref):
        return token() is ident
    return token is None or token == _ident_token(ident)


def identity_problem(rec, site: int, ident: Optional[torch.Tensor]) -> Optional[str]:
    """None when MC-Sparse may cache and reuse metadata at this call, else the reason (the first time per
    site and reason: a warning, and the site's metadata dropped)."""
    problem = _UNSTABLE.get(site)
    if problem is None:
        if ident is None:
            if rec.has_identity:
                return None
            problem = NO_IDENTITY
        else:
            key = (site, ident.data_ptr())
            seen = _IDENTS.get(key)
            version = ident._version
            if seen is None:
                _IDENTS[key] = (version, _ident_token(ident))
                return None
            if seen[0] == version and _same(seen[1], ident):
                return None
            problem = _UNSTABLE[site] = UNSTABLE_IDENTITY
    if (site, problem) not in _IDENT_WARNED:
        _IDENT_WARNED.add((site, problem))
        state.drop_sites([site])
        import warnings

        warnings.warn(f"vcattn: call site {rec.module or site} ({rec.shape}) runs stock SDPA instead of MC-Sparse: "
                      f"{_FIXES[problem]}. vc_compile.report() lists it as '{problem}'.", RuntimeWarning,
                      stacklevel=3)
    return problem


def forget_identities(_gen: Optional[int] = None) -> None:
    """A new generation: addresses seen so far name nothing any more (``_UNSTABLE`` stays until reset())."""
    _IDENTS.clear()


# Sharp attention (option ``max_logit_std``): the 8-bit paths' error grows with the spread of the logits (INT8
# QK moves each logit by a fraction of its block's range, and a sharp softmax turns that into weight moved
# between keys). Measured on the CPU reference, random q, k, v, S = 1024, D = 64/128, bf16, rel. L2 against fp64
# SDPA (docs/design/sharpness-check.md; config.py NOTE): (logit std, V-Smooth error). Checked once per (site, block,
# shape) on sampled rows: one small matmul and one host read the first time, nothing on later calls.
SHARP = "logits too sharp for 8-bit"
SHARP_ERR = ((1.0, 0.037), (10.0, 0.045), (20.0, 0.057), (35.0, 0.071), (50.0, 0.080), (100.0, 0.108))
_SHARP: Dict[tuple, float] = _CHECKS.sharp  # (site, ident ptr, q shape, k shape, device) -> sampled logit std
_SHARP_WORST: Dict[int, Tuple[int, float]] = _CHECKS.sharp_worst  # site -> (readings taken, the largest)
_SHARP_READINGS = 256  # per site (blocks x shapes); beyond (weights at ever new addresses) its worst reading stands
_SHARP_WARNED: Set[int] = _CHECKS.sharp_warned


def predicted_error(std: float) -> float:
    """V-Smooth's rel. L2 at this logit std, interpolated in the measured table (log std; clamped)."""
    pts = SHARP_ERR
    if std <= pts[0][0]:
        return pts[0][1]
    for (s0, e0), (s1, e1) in zip(pts, pts[1:]):
        if std <= s1:
            w = (math.log(std) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return e0 + w * (e1 - e0)
    return pts[-1][1]


def logit_std(q: torch.Tensor, k: torch.Tensor, sm_scale: float, rows: int = 64, keys: int = 256) -> float:
    """The largest, over (batch, head), mean over sampled query rows of the std of their logits over sampled
    keys (evenly spaced rows; fp32). Non-finite inputs count as 0 (their contract is SDPA's NaN, not this)."""
    S, Sk = q.shape[2], k.shape[2]
    qi = torch.linspace(0, S - 1, min(S, rows), device=q.device).round().long()
    ki = torch.linspace(0, Sk - 1, min(Sk, keys), device=k.device).round().long()
    s = (q.index_select(2, qi).float() @ k.index_select(2, ki).float().transpose(-1, -2)) * sm_scale
    per_head = s.std(dim=-1, correction=0).mean(dim=-1)
    return float(torch.nan_to_num(per_head, nan=0.0, posinf=0.0, neginf=0.0).amax())


def too_sharp(rec, key: tuple, q, k, sm_scale: float, cfg: VCConfig) -> bool:
    """Whether this (site, block, shape) stays stock SDPA for its logit spread (warning once per site)."""
    std = _SHARP.get(key)
    if std is None:
        n, worst = _SHARP_WORST.get(key[0], (0, 0.0))
        if n >= _SHARP_READINGS:
            std = worst  # no sync per call where addresses never repeat (offloading)
        else:
            std = _SHARP[key] = logit_std(q, k, sm_scale)
            _SHARP_WORST[key[0]] = (n + 1, max(worst, std))
    if std <= cfg.max_logit_std:
        return False
    rec.runtime_fallbacks[SHARP] += 1
    if key[0] not in _SHARP_WARNED:
        _SHARP_WARNED.add(key[0])
        import warnings

        warnings.warn(
            f"vcattn: call site {rec.module or key[0]} ({rec.shape}): its sampled attention logits have std "
            f"{std:.1f} > max_logit_std={cfg.max_logit_std:g}, where the 8-bit path's error is about "
            f"{predicted_error(std):.2f} rel. L2 (0.04 at unit logits; docs/design/sharpness-check.md); "
            f"it runs stock SDPA there instead (report: '{SHARP}'). "
            f"options={{'max_logit_std': 0}} forces the 8-bit path.",
            RuntimeWarning, stacklevel=3)
    return True


# Outliers the 8-bit codes cannot hold (option ``quant_check``, reference/quant_check.py): read once per (site,
# block, shape) on a sample before its first 8-bit call; the action is remembered, so later calls pay a dict lookup.
OUTLIER_KEYS = "outlier keys or values for 8-bit"
ROTATED = "outlier K channel: Hadamard rotation on"
_QUANT: Dict[tuple, str] = _CHECKS.quant  # (site, ident ptr, q shape, k shape, device) -> "8bit" | "hadamard" | "sdpa"
_QUANT_WARNED: Set[Tuple[int, str]] = _CHECKS.quant_warned
_ROTATED_CFG: Dict[int, Tuple[VCConfig, VCConfig]] = {}  # id(cfg) -> (cfg, the same with hadamard=True)


def quant_action(rec, key: tuple, q, k, v, cfg: VCConfig, rope_args=None) -> str:
    """What this (site, block, shape) runs: "8bit", "hadamard" or "sdpa" (reported, warned once per site and kind)."""
    act = _QUANT.get(key)
    if act is None:
        if rope_args is not None:  # fused RoPE: the codes are of the rotated q, k
            q, k = torch_ops.apply_rope(q, rope_args), torch_ops.apply_rope(k, rope_args)
        reading = dispatch.quant_reading(q, k, v, cfg.qk_format.value, cfg.hadamard)
        act = reading.action(cfg.qk_format.value, cfg.hadamard)
        if act == "hadamard" and _rotated(cfg) is None:
            act = "sdpa"
        _QUANT[key] = act
        rec.quant_reading = (reading, act)
    if act == "8bit":
        return act
    rec.runtime_fallbacks[OUTLIER_KEYS if act == "sdpa" else ROTATED] += 1
    if (key[0], act) not in _QUANT_WARNED:
        _QUANT_WARNED.add((key[0], act))
        import warnings

        r = rec.quant_reading[0]
        what = f"logit error {r.r_qk:.3f}, value error {r.r_v:.3f} of their spread"
        if act == "hadamard":
            msg = (f"an outlier K channel ({what}; clean INT8 ~0.012): this site runs with the Hadamard rotation, "
                   f"which brings the logit error back to {r.r_qk_hadamard:.3f}")
        else:
            msg = (f"outlier keys or values the 8-bit codes cannot hold ({what}; clean ~0.012 / ~0.025): "
                   "it runs stock SDPA there instead")
        warnings.warn(f"vcattn: call site {rec.module or key[0]} ({rec.shape}): {msg} (report: '"
                      f"{OUTLIER_KEYS if act == 'sdpa' else ROTATED}'). options={{'quant_check': False}} turns the "
                      "check off.", RuntimeWarning, stacklevel=3)
    return act


KNOWN_FAILURE = "a kernel failure known on this Triton"
_KNOWN_WARNED: Set[int] = _CHECKS.known_warned


def _known_failure(rec, site: int, kernel: str, expcast: bool, head_dim: int) -> Optional[str]:
    """``KNOWN_FAILURE`` where toolchain.KNOWN_FAILURES lists the attention kernel this call would run on the
    installed Triton (stock SDPA runs; one warning per site with what failed and the fix), else None."""
    why = toolchain.known_failure(kernel, expcast, head_dim)
    if why is None:
        return None
    if site not in _KNOWN_WARNED:
        _KNOWN_WARNED.add(site)
        import warnings

        warnings.warn(f"vcattn: call site {rec.module or site} ({rec.shape}) runs stock SDPA: {why}. Triton 3.6 (torch 2.11), "
                      "where that test passes, or options={'expcast': True} run our kernels there.", RuntimeWarning,
                      stacklevel=4)
    return KNOWN_FAILURE


def _rotated(cfg: VCConfig) -> Optional[VCConfig]:
    """``cfg`` with ``hadamard=True``, made once per config object (a call pays a dict lookup); None where the
    config's head dims do not allow the rotation."""
    hit = _ROTATED_CFG.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        if len(_ROTATED_CFG) >= 256:
            _ROTATED_CFG.clear()
        try:
            rotated = dataclasses.replace(cfg, hadamard=True)
        except ValueError:  # a head dim the rotation does not take (config.py's rule): no rotated config
            rotated = None
        hit = _ROTATED_CFG[id(cfg)] = (cfg, rotated)
    return hit[1]


# The wiring of the run-time pieces, in one place: a new generation (steps.py) drops the metadata store and
# the watched blocks' key sets.
TRACKER.subscribe(state.clear)
TRACKER.subscribe(GRAPHS.clear)
TRACKER.subscribe(PROGRAMS.clear)
TRACKER.subscribe(_forget_watched)
TRACKER.subscribe(forget_identities)


def _rope_inputs(q, k, cos, sin, rope: str):
    """(q, k as [B, H, S, D] views, RopeArgs) of a fused call; (q, k, None) without ``rope``."""
    if not rope:
        return q, k, None
    spec = formats.parse_spec(rope)
    q, k = formats.to_bhsd(q, spec), formats.to_bhsd(k, spec)
    if cos is None or sin is None or k.shape != q.shape:
        raise ValueError("vcattn::attention: a RoPE spec needs cos, sin and q, k of one shape")
    return q, k, formats.rope_args(cos, sin, spec, tuple(q.shape))


# NOTE vcattn::attention is defined through torch.library.Library, not ``custom_op``: every call of a custom_op
# runs its Python autograd wrapper, a redispatch, Dynamo's ``disable`` wrapper and an aliasing check, several
# times the host time of a Library-registered Python kernel (docs/design/host-overhead.md; tests: opcheck in
# tests/test_ops.py). The op is inference-only (the rewrite refuses inputs that need grad), returns
# a fresh tensor (never an input or a view of one) and mutates nothing, as the schema says.
_LIB = torch.library.Library("vcattn", "FRAGMENT")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor? ident, int site, str config, float? scale=None, "
            "Tensor? cos=None, Tensor? sin=None, str rope=\"\", Tensor? key_mask=None) -> Tensor", tags=_TAGS)


class _Lane:
    """A call site's decisions that follow from its config and its inputs' layout alone (kernel path, eligibility,
    speed gate, softmax scale, report label), noted at a call whose reuse step replayed a recorded launch sequence
    (kernels/programs.py): a later call of the same (site, config, scale) with the same layout skips deciding them
    again, and where its reuse step has a program ready, replays it without the call's other scaffolding.
    NOTE those decisions and the scaffolding around a replay (timer, tuning-lookup recorder, graph check, report
    label) were a third of a small reuse call's host time; docs/design/host-overhead.md."""

    __slots__ = ("layout", "cfg", "M", "impl", "path", "sm", "label", "shapes")

    def __init__(self, layout, cfg, M, impl, path, sm, label, shapes):
        self.layout, self.cfg, self.M, self.impl, self.path, self.sm, self.label = layout, cfg, M, impl, path, sm, label
        self.shapes = shapes  # (q shape, k shape, device) as the state key spells them


_LANES: Dict[tuple, _Lane] = _CHECKS.lanes  # (site, config, scale) -> _Lane


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ident: Optional[torch.Tensor],
              site: int, config: str, scale: Optional[float] = None, cos: Optional[torch.Tensor] = None,
              sin: Optional[torch.Tensor] = None, rope: str = "",
              key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    if key_mask is not None:
        return _key_padded(q, k, v, ident, site, config, scale, cos, sin, rope, key_mask)
    if _FREED:
        _drain_freed()
    lane = _LANES.get((site, config, scale)) if not rope else None
    layout = None
    if lane is not None:
        layout = _programs.layout_key(q, k, v)
        if layout != lane.layout:
            lane = None
    if lane is not None:  # the decisions below, as this layout had them
        cfg, M, impl, path, sm, rope_args = lane.cfg, lane.M, lane.impl, lane.path, lane.sm, None
        rec = _report.site(site)
        rec.calls += 1
    else:
        q, k, rope_args = _rope_inputs(q, k, cos, sin, rope)
        cfg = _config(config)
        rec = _report.site(site)
        rec.calls += 1
        method = cfg.resolved_method
        M = methods.get(method)
        reason = runtime_ineligible(q, k, v, cfg)
        impl, path = None, "sdpa"
        if reason is None and M.USES_KERNELS:
            impl, path = dispatch.choose(method.value, cfg.experimental.kernels, M.needs_fp8(cfg), q.device)
            if impl == dispatch.Impl.TRITON:
                reason = dispatch.method_build_failure(method.value) or M.ineligible(q, k, v)
                if reason is None and q.is_cuda and toolchain.has_known_failures():
                    kernel = M.main_kernel(q, v, cfg)
                    reason = _known_failure(rec, site, kernel, cfg.expcast, q.shape[-1]) if kernel else None
                if reason is None and q.is_cuda:
                    reason = gate_reason(cfg, q.device, q.shape, k.shape[2])
                    if reason is None:
                        rec.ungated_gpu = ungated_gpu(cfg, q.device)
        if rope_args is not None and (reason is not None or not M.FUSES_ROPE):
            q, k, rope_args = torch_ops.apply_rope(q, rope_args), torch_ops.apply_rope(k, rope_args), None
        if reason is not None:
            rec.runtime_fallbacks[reason] += 1
            return F.scaled_dot_product_attention(q, k, v, scale=scale).contiguous()
        sm = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ident_ptr = ident.data_ptr() if ident is not None else 0
    shapes = lane.shapes if lane is not None else (tuple(q.shape), tuple(k.shape), str(q.device))
    info = TRACKER.current((site, ident_ptr), cfg.num_steps, shape=shapes[:2])
    if M.NEEDS_IDENTITY:
        problem = identity_problem(rec, site, ident)
        if problem is not None:  # never metadata of another block: stock SDPA, counted
            rec.runtime_fallbacks[problem] += 1
            return F.scaled_dot_product_attention(q, k, v, scale=scale).contiguous()
    key = (site, ident_ptr, info.branch) + shapes
    plan = M.plan(cfg, info.step, info.num_steps, _Slots(key), q, k, v, impl)
    for slot in plan.drop:
        state.put(key + slot, None)
    phase, meta = plan.phase, plan.meta
    if cfg.max_logit_std > 0 and plan.eight_bit and too_sharp(rec, (site, ident_ptr) + key[3:6], q, k, sm, cfg):
        if plan.sharp_phase is None:  # the whole call: stock SDPA
            if rope_args is not None:
                q, k = torch_ops.apply_rope(q, rope_args), torch_ops.apply_rope(k, rope_args)
            return F.scaled_dot_product_attention(q, k, v, scale=scale).contiguous()
        phase = plan.sharp_phase
    if cfg.quant_check and plan.eight_bit and phase == plan.phase:
        act = quant_action(rec, (site, ident_ptr) + key[3:6], q, k, v, cfg, rope_args)
        if act == "sdpa":
            if plan.sharp_phase is None:  # the whole call: stock SDPA
                if rope_args is not None:
                    q, k = torch_ops.apply_rope(q, rope_args), torch_ops.apply_rope(k, rope_args)
                return F.scaled_dot_product_attention(q, k, v, scale=scale).contiguous()
            phase = plan.sharp_phase
        elif act == "hadamard":
            cfg = _rotated(cfg)
    if plan.guard is not None:
        rec.note_guard(*plan.guard)
    if plan.fallback is not None:
        _method_fallback(rec, site, *plan.fallback)
    if plan.note is not None:
        _method_note(rec, site, *plan.note)
    key = key + plan.slot
    kw = {} if rope_args is None else {"rope": rope_args}
    prebuilds = _RUNTIME.part("prebuilds")  # None: no helper was ever started (prebuild/helpers.py)
    if prebuilds is not None and prebuilds.pending and phase != Phase.DENSE:  # helpers build this phase's kernels
        prebuilds.wait(phase.value)
    if (lane is not None and meta is not None and phase != Phase.DENSE and not cfg.profile
            and plan.replay and M.replayable(phase, cfg) and PROGRAMS.usable(q)):
        hit = PROGRAMS.replay(key, meta, q, k, v, layout)
        if hit is not None:  # the reuse step's recorded launches: the rest is the report's counts
            out, sources = hit
            if sources:
                counts = rec.config_sources
                for c, n in sources.items():
                    counts[c] += n
            rec.phases[phase.value] += 1
            rec.kernel_path[lane.label] += 1
            rec.step_sources[info.source] += 1
            return out
    programmed = False
    with _report.Timer(rec, cfg.profile, q.is_cuda), _tune.recording(cfg.tune_cache_dir) as sources:
        replayed = False
        if phase == Phase.DENSE:  # method="dense" and every method's warm-up steps: stock SDPA
            if rope_args is not None:
                q, k = torch_ops.apply_rope(q, rope_args), torch_ops.apply_rope(k, rope_args)
            out, new_meta = F.scaled_dot_product_attention(q, k, v, scale=sm).contiguous(), meta
        else:
            try:
                out, new_meta, replayed, programmed, layout = _kernels(M, phase, meta, cfg, sm, impl, rec, key,
                                                                       layout, q, k, v, sources, kw, plan.replay)
            except Exception as e:
                why = dispatch.method_failed(cfg.resolved_method.value, e) if impl == dispatch.Impl.TRITON else None
                if why is None:
                    raise
                # this toolchain cannot build the method's kernels: stock SDPA, now and for the process's later calls
                rec.runtime_fallbacks[why] += 1
                if rope_args is not None:
                    q, k = torch_ops.apply_rope(q, rope_args), torch_ops.apply_rope(k, rope_args)
                return F.scaled_dot_product_attention(q, k, v, scale=scale).contiguous()
    rec.config_sources.update(sources)
    if new_meta is not None and (new_meta is not meta or plan.borrowed):
        state.put(key, new_meta)
        _watch(ident, key)
    rec.phases[phase.value] += 1
    label = "sdpa" if phase == Phase.DENSE else M.path_label(path, phase, cfg, q, v)
    rec.kernel_path[label + "+cuda_graph" if phase != Phase.DENSE and replayed else label] += 1
    # a lane only where the option can never want a graph (the lane's replay skips the graph check)
    if programmed and lane is None and rope_args is None and not cfg.profile \
            and not GRAPHS.may_want(cfg.cuda_graphs.value, q, k):
        if len(_LANES) >= 4096:
            _LANES.clear()
        _LANES[(site, config, scale)] = _Lane(layout, cfg, M, impl, path, sm, label, shapes)
    rec.step_sources[info.source] += 1
    if phase != Phase.DENSE and impl == dispatch.Impl.REFERENCE and out.device.type == "cpu":
        _note_nonfinite(rec, out)
    return out


_METHOD_WARNED: Set[Tuple[int, str]] = _CHECKS.method_warned


class _Slots:
    """``slots(suffix)``: the metadata the call's state key plus ``suffix`` holds; ``slots.key``: that key."""

    __slots__ = ("key",)

    def __init__(self, key: tuple):
        self.key = key

    def __call__(self, suffix: tuple):
        return state.get(self.key + suffix)

    @property
    def branch(self) -> int:
        return self.key[2]

    def of_branch(self, branch: int, suffix: tuple = ()):
        """The metadata of the same site, block and shapes in another CFG branch."""
        return state.get(self.key[:2] + (branch,) + self.key[3:] + suffix)


def _method_note(rec, site: int, reason: str, message: str) -> None:
    """A call the method ran on another of its own paths: counted under ``reason``, warned once per reason until
    ``reset()`` (the plan behind it is one decision for every site, so no site id in the key)."""
    rec.method_notes[reason] += 1
    if (-1, reason) not in _METHOD_WARNED:
        _METHOD_WARNED.add((-1, reason))
        import warnings

        warnings.warn(f"vcattn: {message} (report: '{reason}').", RuntimeWarning, stacklevel=3)


def _method_fallback(rec, site: int, reason: str, message: str) -> None:
    """A call the method itself sent to stock SDPA for accuracy: counted under ``reason``, warned once per site."""
    rec.runtime_fallbacks[reason] += 1
    if (site, reason) not in _METHOD_WARNED:
        _METHOD_WARNED.add((site, reason))
        import warnings

        warnings.warn(f"vcattn: call site {rec.module or site} ({rec.shape}): {message} (report: '{reason}').",
                      RuntimeWarning, stacklevel=3)


def _kernels(M, phase, meta, cfg, sm, impl, rec, key, layout, q, k, v, sources, kw, replay=True):
    """A kernel phase of one call: (out, new metadata, replayed as a CUDA graph, replayed as a recorded program,
    the input layout where a program needed it).
    A replayable step with metadata runs as a CUDA graph where the option wants one, else as a recorded launch
    sequence (recorded at its second call), else through the method's ``run``."""
    out, new_meta, replayed, programmed = None, meta, False, False
    if (replay and kw.get("rope") is None and impl == dispatch.Impl.TRITON and meta is not None
            and M.replayable(phase, cfg)):
        fn = functools.partial(_replayed_run, M, phase, meta, cfg, sm, impl)
        if GRAPHS.wanted(cfg.cuda_graphs.value, q, k):
            out = GRAPHS.run(key, meta, fn, q, k, v, sources)
            replayed = out is not None
            if not replayed and rec.cuda_graph_failure is None:
                rec.cuda_graph_failure = GRAPHS.failures(meta).get(key)
        if out is None and PROGRAMS.usable(q):  # else a recorded launch sequence (recorded at its 2nd call)
            layout = layout if layout is not None else _programs.layout_key(q, k, v)
            n_replays = PROGRAMS.replays
            out = PROGRAMS.run(key, meta, fn, q, k, v, sources, layout=layout)
            programmed = PROGRAMS.replays != n_replays
            if out is None and rec.program_failure is None:
                rec.program_failure = PROGRAMS.failures(meta).get(key)
    if out is None:
        out, new_meta = M.run(q, k, v, phase=phase, meta=meta, cfg=cfg, sm_scale=sm, impl=impl, **kw)
    return out, new_meta, replayed, programmed, layout


def _replayed_run(M, phase, meta, cfg, sm, impl, q, k, v):
    """A replayable step's output (what ``kernels/graphs.py`` captures): the method must hand back the metadata
    it was given, or the capture is refused."""
    out, new_meta = M.run(q, k, v, phase=phase, meta=meta, cfg=cfg, sm_scale=sm, impl=impl)
    if new_meta is not meta:
        raise RuntimeError("the method replaced its metadata on a replayable step")
    return out


# Non-finite inputs (the contract, docs/usage.md "Non-finite inputs"): wherever stock SDPA's output is non-finite ours
# is too, in the same (batch, head), and nothing leaks into other heads, batch rows or later steps; the 8-bit
# paths widen it within the head: a NaN or +-Inf key makes the whole (batch, head) NaN (SDPA: the rows whose
# logit with that key is +Inf or NaN). Counted, with one warning per site, where the check costs no GPU sync:
# on the CPU reference path (its attention costs far more than one pass over the output).
NONFINITE_CONTRACT = ("wherever stock SDPA's output is non-finite this one is too (but on MC-Sparse reuse steps "
                      "without propagate_nonfinite, where a key or value no query group selected is ignored), and "
                      "other heads, batch rows and later steps stay clean; the 8-bit paths widen it within the "
                      "(batch, head): a NaN or +-Inf in a key makes that whole head NaN, where SDPA has NaN only in "
                      "the rows whose logit with that key is +Inf or NaN (docs/usage.md, 'Non-finite inputs')")
_NONFINITE_WARNED: Set[int] = _CHECKS.nonfinite_warned


def _note_nonfinite(rec, out: torch.Tensor) -> None:
    if bool(torch.isfinite(out).all()):
        return
    rec.nonfinite_calls += 1
    if rec.site not in _NONFINITE_WARNED:
        _NONFINITE_WARNED.add(rec.site)
        import warnings

        n = int((~torch.isfinite(out)).sum())
        warnings.warn(f"vcattn: call site {rec.module or rec.site} ({rec.shape}): non-finite values in q, k or v "
                      f"gave {n} non-finite outputs: {NONFINITE_CONTRACT}. report(): nonfinite_calls.",
                      RuntimeWarning, stacklevel=3)


def key_prefix(mask: torch.Tensor, B: int, Sq: int, Sk: int) -> Tuple[Optional[int], Optional[str]]:
    """(L, None) when the boolean ``mask``, as SDPA broadcasts it over [B, H, Sq, Sk], keeps exactly the first L keys
    in every batch row: for every query (a key-padding mask, [B, 1, 1, Sk]) or for the first L queries, whatever the
    rows past them keep (a per-query mask [B, 1, Sq, Sk] of padded tokens, ``valid_i & valid_j`` as HunyuanVideo
    1.5 builds it); (None, why) otherwise. Two device-to-host copies: the first query's count, then the check."""
    if mask.dtype != torch.bool:
        return None, "mask not boolean"
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    if mask.dim() > 4 or shape[1] != 1 or shape[2] not in (1, Sq) or shape[3] != Sk or shape[0] not in (1, B):
        return None, f"mask of shape {tuple(mask.shape)} is neither [B, 1, 1, Sk] nor [B, 1, Sq, Sk]"
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return None, "mask read under CUDA graph capture"
    m = mask.reshape(shape[0], shape[2], Sk)
    n = m[:, 0].sum(-1)  # keys the first query keeps, per batch row
    lo, hi = torch.stack([n.min(), n.max()]).tolist()
    if lo != hi:
        return None, "kept keys differ across the batch"
    if lo == 0:
        return None, "mask drops every key of the first query"
    L = int(lo)
    top = m[:, :min(L, shape[2])]  # every query row of a key-padding mask; the first L of a per-query one
    if not bool(top[..., :L].all() & ~top[..., L:].any()):
        return None, _NOT_A_PREFIX
    return L, None


_NOT_A_PREFIX = "mask keeps keys other than a prefix"


def _kept_keys(mask: torch.Tensor, B: int, Sk: int) -> Optional[torch.Tensor]:
    """[B or 1, L] indices of the keys a key-padding ``mask`` ([B, 1, 1, Sk] as SDPA broadcasts it, the same L kept
    keys in every batch row: ``key_prefix`` checked the counts) keeps, in order; None for a per-query mask. Attention
    over the kept keys gathered is the masked attention exactly (the softmax does not see the keys' order)."""
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    if shape[2] != 1:
        return None
    m = mask.reshape(shape[0], Sk)
    L = int(m[0].sum())
    return m.nonzero()[:, 1].reshape(shape[0], L)


_MASK_WARNED: Set[str] = _CHECKS.mask_warned  # reasons warned (every site of a model shares its mask)


def _warn_masked(rec, site: int, why: str) -> None:
    """A rewritten site whose attention mask sends its calls to stock SDPA says so once per reason, not only in
    ``report()``."""
    if why in _MASK_WARNED:
        return
    _MASK_WARNED.add(why)
    import warnings

    warnings.warn(f"vcattn: call site {rec.module or site} ({rec.shape}) was rewritten, but its attention mask "
                  f"sends its calls to stock SDPA: {why}; the methods take a mask that keeps a prefix of the keys "
                  "(e.g. padding at the end of the sequence). Every site with such a mask does the same (report(): "
                  "'key_padded: ...').", RuntimeWarning, stacklevel=3)


def _key_padded(q, k, v, ident, site, config, scale, cos, sin, rope, key_mask):
    """``attention`` of a call SDPA would mask with ``key_mask`` (see the module docstring)."""
    if rope:  # the mask splits q and k: rotate them first (the fp32 reference, as every unfused path)
        q, k, rope_args = _rope_inputs(q, k, cos, sin, rope)
        q, k = torch_ops.apply_rope(q, rope_args), torch_ops.apply_rope(k, rope_args)
    Sq, Sk = q.shape[2], k.shape[2]
    L, why = key_prefix(key_mask, q.shape[0], Sq, Sk)
    rec = _report.site(site)
    if why == _NOT_A_PREFIX:
        kept = _kept_keys(key_mask, q.shape[0], Sk)
        if kept is not None:  # a key-padding mask with its padding inside (QwenImage): the kept keys gathered
            idx = kept.view(kept.shape[0], 1, -1, 1)
            kk = torch.gather(k, 2, idx.expand(k.shape[0], k.shape[1], -1, k.shape[3]))
            vk = torch.gather(v, 2, idx.expand(v.shape[0], v.shape[1], -1, v.shape[3]))
            rec.key_padding = f"{kk.shape[2]} of {Sk} keys, gathered"
            return attention(q, kk, vk, ident, site, config, scale)
    if why is not None:
        rec.calls += 1
        rec.runtime_fallbacks[f"key_padded: {why}"] += 1
        _warn_masked(rec, site, why)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=scale).contiguous()
    per_query = key_mask.dim() >= 2 and key_mask.shape[-2] == Sq and Sq > 1
    # the rows through the method: with q, k, v of one length the first L (the kept prefix as self-attention), else
    # every row a key-padding mask covers, or the first L a per-query one does
    R = L if Sq == Sk else (min(L, Sq) if per_query else Sq)
    if per_query and 2 * R < Sq:
        # e.g. a block-causal mask (SkyReels-V2's diffusion forcing): the first block's rows keep a prefix, the
        # rest keep more; the method would serve the smaller part of the call and the mask's read cost the rest
        rec.calls += 1
        rec.runtime_fallbacks["key_padded: the kept prefix covers under half of the query rows"] += 1
        _warn_masked(rec, site, "the kept prefix covers under half of the query rows (e.g. a block-causal mask)")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=scale).contiguous()
    rec.key_padding = f"{L} of {Sk} keys"
    kept_k, kept_v = k[:, :, :L], v[:, :, :L]
    head = attention(q[:, :, :R], kept_k, kept_v, ident, site, config, scale)
    if R == Sq:
        return head
    # the other rows (padding tokens, which no row of the head reads): stock SDPA, on the kept keys for a key-padding
    # mask, with their own mask rows for a per-query one (rows that keep nothing come out as SDPA makes them)
    if per_query:
        tail = F.scaled_dot_product_attention(q[:, :, R:], k, v, attn_mask=key_mask[..., R:, :], scale=scale)
    else:
        tail = F.scaled_dot_product_attention(q[:, :, R:], kept_k, kept_v, scale=scale)
    return torch.cat([head, tail.to(head.dtype)], dim=2)


_LIB.impl("attention", attention, "CompositeExplicitAutograd")


@torch.library.register_fake("vcattn::attention")
def _(q, k, v, ident, site, config, scale=None, cos=None, sin=None, rope="", key_mask=None):
    if rope:
        q = formats.to_bhsd(q, formats.parse_spec(rope))
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
