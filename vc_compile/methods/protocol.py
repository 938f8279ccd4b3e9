"""What every attention method module provides (``METHODS`` in ``methods/__init__.py``), and the plan of one
call. The op (``ops.attention``) parses the call, checks eligibility, finds the step, asks the method for a
``Plan`` of that step, runs it and records the report; it knows no method by name.

A method module is an ``AttentionMethod``:

``USES_KERNELS``     whether it runs kernels at all (``dense``: stock SDPA only, no kernel choice);
``FUSES_ROPE``       whether its ``run`` takes un-rotated q, k with the model's RoPE (``rope=``); the op
                     rotates them itself for the other methods;
``NEEDS_IDENTITY``   whether it caches metadata that a later step of the same block reuses (the op then refuses
                     the call where the block identity is missing or unstable: stock SDPA, reported);
``needs_fp8(cfg)``   whether its kernels use FP8 MMAs with these options;
``ineligible(q, k, v)``  the kernels' limits (dispatch's checks): a reason, or None;
``plan(cfg, step, n, slot, q, k, v, impl) -> Plan``  what step ``step`` of ``n`` does: its phase, which
                     metadata slot it reads and writes (``slot(suffix)`` returns the cached metadata of the
                     site's key + suffix, or None; ``slot.branch`` is the call's CFG branch and
                     ``slot.of_branch(b)`` another branch's main slot), whether it runs the 8-bit attention
                     (the sharpness check), what runs when the site is too sharp, and a guard reading to record;
``run(q, k, v, *, phase, meta, cfg, sm_scale, impl, **kw) -> (out, new meta)``  ``Phase.DENSE`` never reaches
                     it (the op runs stock SDPA);
``path_label(path, phase, cfg, q, v) -> str``  the kernel path ``report()`` records for a call on these inputs
                     (the dispatch decisions depend on their device, head dims and dtype);
``replayable(phase, cfg) -> bool``  whether ``run`` of this phase launches the same kernels on the same buffers
                     whatever q, k, v hold, reads nothing back to the host and returns the metadata it was given:
                     the op may then replay it as a CUDA graph (``cuda_graphs``, kernels/graphs.py).
``main_kernel(q, v, cfg) -> str | None``  the kernel-table row (``kernels/dispatch.py``) its reuse steps run for
                     these inputs on their device (the toolchain's known failures are keyed by it), None: no kernel;
``SPEC``             its ``MethodSpec``: what every consumer outside the op reads (the demo, the warm-up, the
                     kernel-build helpers, the speed gate, the tuning CLI, the RoPE fusion).

Adding a method is three files: its module (this protocol and ``SPEC``), its row in ``methods.METHODS`` and its
``config.Method`` value (with its options in ``config.py``); no consumer names a method.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Tuple, runtime_checkable

from .phase import Phase

Slot = Tuple[str, ...]


@dataclass
class Plan:
    """One call's step, as its method plans it."""
    phase: Phase
    meta: object = None  # the cached metadata the step starts from (of ``slot``)
    slot: Slot = ()  # the metadata slot: a suffix of the site's state key (() = the method's main slot)
    drop: Tuple[Slot, ...] = ()  # slots the method no longer needs (freed before the step runs)
    eight_bit: bool = False  # the step runs the 8-bit V-Smooth attention: ``max_logit_std`` applies
    sharp_phase: Optional[Phase] = None  # too sharp: this phase instead (None: the whole call runs stock SDPA)
    guard: Optional[Tuple[Optional[float], bool]] = None  # a quality-guard reading (error, re-anchored) to record
    replay: bool = True  # False: this call measures something (no recorded launches or CUDA graph replays it)
    fallback: Optional[Tuple[str, str]] = None  # a DENSE phase the method chose for accuracy: (reason, warning)
    note: Optional[Tuple[str, str]] = None  # another of the method's paths, and why: (reason, warning once)
    borrowed: bool = False  # ``meta`` is another branch's: the op stores it in this call's slot too


@dataclass(frozen=True)
class MethodSpec:
    """A method's row for the consumers outside the op.

    ``label(cfg)``: the variant a config runs, as every table names it (``report()``, the speed gate's
    measurements, the benchmarks' rows): the method's name, ``+`` a switch, ``@`` a number (the speed gate takes
    the nearest number of the same name where the exact label was not measured).
    ``variants``: (label, options) the demo and the benchmarks run, in order; ``warmup``: the labels among them
    whose kernels ``python -m vc_compile warmup`` builds by default (variants that launch the same kernels need
    one); ``ladder``: (label, options) of the method's ablation ladder (demo ``--ladder``), if any.
    ``helpers``: kernel-build helper processes ``enable()`` starts ahead (0: the method builds no kernels).
    ``tune``: ``vc_compile tune --method <name>``: ``tune(args, q, k, v) -> (kernel, candidates, call)`` or a
    str saying why there is nothing to tune; None: the method has no tunable kernel (the CLI does not offer it).
    ``head_dim_error(D)``: why its kernels cannot take head dim D, or None.
    """
    label: Callable[[Any], str]
    variants: Tuple[Tuple[str, Mapping[str, Any]], ...] = ()
    warmup: Tuple[str, ...] = ()
    ladder: Tuple[Tuple[str, Mapping[str, Any]], ...] = ()
    helpers: int = 0
    tune: Optional[Callable[..., Any]] = None
    head_dim_error: Callable[[int], Optional[str]] = lambda D: None

    def __post_init__(self):
        labels = [lab for lab, _ in self.variants]
        if len(set(labels)) != len(labels):
            raise ValueError(f"MethodSpec: duplicate variant labels {labels}")
        missing = [lab for lab in self.warmup if lab not in labels]
        if missing:
            raise ValueError(f"MethodSpec: warm-up labels {missing} are not variants ({labels})")
        if self.helpers < 0:
            raise ValueError(f"MethodSpec: helpers={self.helpers} must be >= 0")


@runtime_checkable
class AttentionMethod(Protocol):
    SPEC: MethodSpec
    USES_KERNELS: bool
    FUSES_ROPE: bool
    NEEDS_IDENTITY: bool

    def needs_fp8(self, cfg) -> bool: ...

    def ineligible(self, q, k, v) -> Optional[str]: ...

    def plan(self, cfg, step: int, n: int, slot: Callable[[Slot], object], q, k, v, impl) -> Plan: ...

    def schedule(self, cfg, n: int) -> Tuple[Phase, ...]: ...  # each step's phase, every block's metadata kept

    def run(self, q, k, v, *, phase, meta, cfg, sm_scale, impl, **kw): ...

    def path_label(self, path: str, phase: Phase, cfg, q, v) -> str: ...

    def replayable(self, phase: Phase, cfg) -> bool: ...

    def main_kernel(self, q, v, cfg) -> Optional[str]: ...
