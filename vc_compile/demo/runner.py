"""One generation of the demo model under one vcattn configuration, timed: shared by the demo
(:func:`run_pipeline`) and ``benchmarks/bench_e2e.py`` (:func:`run_config`).

Per configuration: ``torch._dynamo.reset()`` and ``vc_compile.reset(report=True)`` (a fresh compile and
fresh call-site records), the backend put on the transformer with ``backend="vcattn", options=...``, an
untimed warm-up generation of ``warmup`` steps (compilation and Triton JIT stay out of the timing; 6 steps
already pass through every phase of every method's default schedule: dense warm-up, V-Smooth grouping
and reuse, MC-Sparse anchors and reuse; 1 step is enough where nothing is JIT-compiled, e.g. the CPU
reference paths), ``vc_compile.reset()`` (drops metadata and counts, keeps the compiled graph), then the
timed generation.

* :func:`run_pipeline` (the demo): the generation is ``pipe(...)`` of a diffusers ``WanPipeline``
  (``demo/pipe.py``); nothing tells vc_compile the step: the op reads it from the pipeline's loop.
* :func:`run_config` (the benchmark): the demo's own Euler/CFG loop (``sampler.sample``) with the
  explicit step API::

      with vc_compile.sampling(num_steps=n):
          for i in range(n): vc_compile.step(i); model(...)

End-to-end time is the wall clock of the timed generation (CUDA synchronised); attention time is
``vc_compile.report().total_time_ms`` when the ``profile`` option is on (CUDA events around every
rewritten attention call; cross-attention to the few text tokens stays stock SDPA and is not counted).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .. import methods as _methods
from .sampler import sample

LADDER = tuple(_methods.ladder())  # the methods' ablation ladders (MC-Sparse's: the paper's Table 5)


def known_methods():
    """(label, options) the demo runs: the baseline first, then every method's variants (their specs)."""
    return tuple(_methods.variants())


def ladder_methods(densities=(0.15, 0.25)):
    """[(label, options)] for every rung at every density, density-major: ``L3:token@0.15``."""
    return [(f"{name}@{d:g}", {**opts, "density": float(d)}) for d in densities for name, opts in LADDER]


@dataclasses.dataclass
class RunResult:
    label: str
    options: dict
    clip: torch.Tensor            # [B, 3, F, H, W] float32 on CPU
    e2e_ms: float
    attn_ms: float | None          # None: profiling unavailable
    report: object | None          # vc_compile.Report of the timed run
    summary: str = ""
    warmup_s: float = 0.0          # compile + warm-up generation, seconds


def vc_api():
    """The vc_compile module and a backend usable by torch.compile, or raise with a clear message."""
    try:
        import vc_compile
        from vc_compile.backend import vcattn
    except Exception as e:  # noqa: BLE001 - say exactly what is missing
        raise SystemExit(f"[vc_demo] the vcattn backend is not importable ({type(e).__name__}: {e}); "
                         "the demo needs vc_compile.backend") from e
    for name in ("sampling", "step", "reset", "report"):
        if not hasattr(vc_compile, name):
            raise SystemExit(f"[vc_demo] vc_compile.{name} is missing: the demo needs the step/report API")
    try:
        from torch._dynamo.backends.registry import lookup_backend

        lookup_backend("vcattn")
        backend = "vcattn"
    except Exception:  # not pip-installed (no entry point): hand torch the callable itself
        backend = vcattn
    return vc_compile, backend


def compile_full(transformer, backend, options):
    """``torch.compile(transformer, backend="vcattn", options=...)``: the user-facing form."""
    return torch.compile(transformer, backend=backend, options=options)


def compile_regional(transformer, backend, options):
    """diffusers' regional compile: one graph for all Wan blocks (compiles ~6x faster here; the backend
    keys its per-layer state by the block's weights, not by the graph). Compiles the blocks in place;
    :func:`uncompile` undoes it."""
    uncompile(transformer)
    transformer.compile_repeated_blocks(backend=backend, options=options)
    return transformer


def uncompile(module):
    """Drop ``nn.Module.compile`` wrappers (set in place by regional compile) from every submodule."""
    for m in module.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None


def summarize(rep) -> str:
    """One line: rewritten sites, phase counts, kernel paths, fallback reasons."""
    if rep is None:
        return ""
    phases, paths, reasons = {}, {}, {}
    for s in rep.sites:
        for k, v in s.phases.items():
            phases[k] = phases.get(k, 0) + v
        for k, v in s.kernel_path.items():
            paths[k] = paths.get(k, 0) + v
        r = s.reason or ", ".join(s.runtime_fallbacks)
        if r:
            reasons[r] = reasons.get(r, 0) + 1
    fmt = lambda d: " ".join(f"{k}:{v}" for k, v in sorted(d.items())) or "-"  # noqa: E731
    return (f"{len(rep.rewritten)}/{len(rep.sites)} sites rewritten; phases {fmt(phases)}; "
            f"kernels {fmt(paths)}; stock SDPA: {fmt(reasons)}")


def run_config(transformer, cond, uncond, label: str, options: dict, *, frames: int, height: int, width: int,
               steps: int, seed: int, guidance: float, shift: float, dtype=torch.bfloat16,
               warmup: int = 6, profile: bool = True, progress=None, compile_fn=None) -> RunResult:
    vc, backend = vc_api()
    opts = dict(options)
    # the clip measures each method's fidelity: its kernels run whatever the speed gate would say of these small
    # shapes on this GPU (the real-size timing, demo/speed.py, keeps the gate)
    opts.setdefault("speed_gate", "off")
    if profile:
        opts["profile"] = True
    torch._dynamo.reset()
    vc.reset(report=True)
    model = (compile_fn or compile_full)(transformer, backend, opts)
    kw = dict(frames=frames, height=height, width=width, seed=seed, uncond=uncond, guidance=guidance,
              shift=shift, dtype=dtype)
    cuda = cond.device.type == "cuda"

    t0 = time.perf_counter()
    if warmup > 0:
        with vc.sampling(num_steps=warmup):  # compile (+ JIT), not timed
            sample(model, cond, steps=warmup, step_fn=vc.step, **kw)
    warm_s = time.perf_counter() - t0
    vc.reset()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with vc.sampling(num_steps=steps):
        clip = sample(model, cond, steps=steps, step_fn=vc.step, progress=progress, **kw)
    if cuda:
        torch.cuda.synchronize()
    e2e = (time.perf_counter() - t0) * 1e3
    rep = vc.report()
    attn = rep.total_time_ms if (profile and hasattr(rep, "total_time_ms")) else None
    uncompile(transformer)
    return RunResult(label, options, clip.cpu(), e2e, attn, rep, summarize(rep), warm_s)


def run_pipeline(pipe, cond, uncond, label: str, options: dict, *, frames: int, height: int, width: int,
                 steps: int, seed: int, guidance: float, shift: float = 1.0, warmup: int = 6,
                 regional: bool = False, profile: bool = True, progress: bool = True) -> RunResult:
    """Compile ``pipe.transformer`` with ``options``, warm up, then time one ``pipe(...)`` generation."""
    from .pipe import compile_pipe, generate, uncompile_pipe

    vc, _ = vc_api()
    opts = dict(options)
    # as run_config: the clip measures each method's fidelity, so its kernels run past the speed gate (on an H200
    # the gate keeps the 4096-token, 2-head clip on stock SDPA: every clip would be the dense one)
    opts.setdefault("speed_gate", "off")
    if profile:
        opts["profile"] = True
    torch._dynamo.reset()
    vc.reset(report=True)
    compile_pipe(pipe, opts, regional=regional)
    kw = dict(frames=frames, height=height, width=width, seed=seed, guidance=guidance, shift=shift)
    cuda = cond.device.type == "cuda"
    try:
        t0 = time.perf_counter()
        if warmup > 0:  # compile (+ JIT), not timed
            generate(pipe, cond, uncond, steps=warmup, progress=False, **kw)
        warm_s = time.perf_counter() - t0
        vc.reset()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        clip = generate(pipe, cond, uncond, steps=steps, progress=progress, desc=f"{label:<16}", **kw)
        if cuda:
            torch.cuda.synchronize()
        e2e = (time.perf_counter() - t0) * 1e3
    finally:
        uncompile_pipe(pipe)
    rep = vc.report()
    attn = rep.total_time_ms if (profile and hasattr(rep, "total_time_ms")) else None
    return RunResult(label, options, clip.cpu(), e2e, attn, rep, summarize(rep), warm_s)
