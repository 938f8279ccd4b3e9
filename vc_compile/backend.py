"""``backend="vcattn"``: validate options, rewrite SDPA on the Dynamo graph, hand the graph to Inductor.

Registered only through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="vcattn")`` works in a fresh interpreter that never imported
``vc_compile``. This module must not call ``register_backend`` itself: torch would then raise
"duplicate name: vcattn" on the lazy entry-point path.
"""
from __future__ import annotations

import collections
import functools
import itertools
import sys
import warnings
import weakref
from typing import Optional

import torch

from . import ops  # noqa: F401  (registers torch.ops.vcattn.*: also for graphs loaded from Inductor's cache)
from . import methods, toolchain
from .config import Compiler, Kernels, Prebuild, VCConfig, VCConfigError, apply_env, options_dict
from .log import get_logger
from .passes.cp_detect import detect_context_parallel
from .passes.rope_detect import detect_rope
from .passes.rope_fuse import fuse_rope
from .passes.sdpa_rewrite import rewrite_sdpa
from .runtime import runtime as _runtime

log = get_logger(__name__)

_GRAPH_IDS = itertools.count(1)


_LIVE: collections.Counter = _runtime.current().live_graphs  # site id -> live compiled graphs that call it



def _fast_path_off():
    """Why the remembered kernel launches (and the recorded reuse steps built on them) cannot run on the installed
    Triton, or None: its JIT launches in a way they do not replay (``kernels/launch.py``)."""
    if toolchain.triton_version() is None:
        return None
    try:
        from .kernels import launch
    except Exception as e:  # noqa: BLE001 - the kernels do not import: dispatch says so at the first call
        return f"{type(e).__name__}: {e}"
    return launch._CONVENTION_ERROR


def _graph_freed(sites) -> None:
    from .runtime import state

    dead = []
    for site in sites:
        _LIVE[site] -= 1
        if _LIVE[site] <= 0:
            del _LIVE[site]
            dead.append(site)
    if dead:
        state.drop_sites(dead)


def cudagraph_partition_supported() -> bool:
    """Can Inductor cut a CUDA graph around ``vcattn::attention``? Needs the ``cudagraph_unsafe`` op tag
    and the ``graph_partition`` option (both present in torch 2.11 and 2.13)."""
    from torch._inductor import config as inductor_config

    return hasattr(torch._C.Tag, "cudagraph_unsafe") and hasattr(inductor_config, "graph_partition")


def inductor_patches(cfg: VCConfig) -> dict:
    """Inductor settings for ``mode``, scoped to this compile through ``config_patches`` (never global).

    CUDA-graph modes (``"reduce-overhead"``, ``"max-autotune"``): an opaque op inside a CUDA graph runs
    its Python only while the graph is recorded, so the step tracking and the metadata of
    ``vcattn::attention`` would freeze at their first values. The op is tagged ``cudagraph_unsafe`` and
    ``graph_partition=True`` is forced for this compile: Inductor records CUDA graphs of the pieces
    between attention calls and runs the op itself eagerly on every call, so phases keep advancing (the
    GPU test ``tests/runtime/test_steps.py::test_reduce_overhead_phases_advance_gpu`` checks it). Where
    partitioning is unavailable the mode is refused up front rather than silently frozen.
    """
    if not cfg.mode or cfg.mode == "default":
        return {}
    patches = dict(torch._inductor.list_mode_options(cfg.mode))
    if patches.get("triton.cudagraphs"):
        if not cudagraph_partition_supported():
            raise VCConfigError(
                f"vcattn: mode={cfg.mode!r} records CUDA graphs, and this torch ({torch.__version__}) cannot "
                "partition a graph around vcattn::attention (needs torch._C.Tag.cudagraph_unsafe and "
                "torch._inductor.config.graph_partition), so the attention phases would freeze at their "
                "first step. Use mode='max-autotune-no-cudagraphs' or the default mode, or torch >= 2.11.")
        patches["graph_partition"] = True
    return patches


def start_prebuild(gm: torch.fx.GraphModule, cfg: VCConfig) -> int:
    """Hand the graph's rewritten calls to kernel-build helpers (``prebuild/helpers.py``, option ``prebuild``);
    returns how many helpers started. Never fails the compile: a problem here only costs the first call's time."""
    if cfg.prebuild == Prebuild.OFF:
        return 0
    try:
        from .prebuild import helpers as prebuild

        reqs = prebuild.requests_for_graph(gm)
        # the calls that will run our Triton kernels on a CUDA device
        gpu = [r for r in reqs if _auto_builds(r["q"]["device"].startswith("cuda"), VCConfig.from_json(r["config"]))
               and not _gated(r)]
        todo = gpu if cfg.prebuild == Prebuild.AUTO else reqs  # 'on': the CPU reference path too
        return _runtime.current().prebuilds.start(todo) if todo else 0
    except Exception as e:  # noqa: BLE001 - an optimisation of the first call's time, never a compile error
        log.warning("vcattn: kernel builds ahead of the first call did not start (%s: %s); the kernels are "
                    "built at their first launch", type(e).__name__, e)
        return 0


def warm_prebuild(cfg: VCConfig) -> int:
    """Start the kernel-build helpers ahead of the first compile (``vc_compile.enable``), where option
    ``prebuild`` will use them: their imports then run while Dynamo traces. Returns how many started."""
    if cfg.prebuild == Prebuild.OFF:
        return 0
    if cfg.prebuild == Prebuild.AUTO and not _auto_builds(torch.cuda.is_available(), cfg):
        return 0
    helpers = methods.get(cfg.resolved_method).SPEC.helpers
    if helpers == 0:
        return 0
    try:
        from .prebuild import helpers as _helpers  # noqa: F401  (provides the runtime's prebuilds part)

        return _runtime.current().prebuilds.warm(helpers)
    except Exception as e:  # noqa: BLE001 - an optimisation of the first call's time, never an error of enable
        log.warning("vcattn: kernel-build helpers did not start (%s: %s)", type(e).__name__, e)
        return 0


def _auto_builds(cuda: bool, cfg: VCConfig) -> bool:
    """``prebuild='auto'``: helpers only where the calls run our Triton kernels on a CUDA device."""
    from .kernels.interpret import interpreting

    return cuda and not interpreting() and cfg.experimental.kernels != Kernels.REFERENCE


def _gated(req: dict) -> bool:
    """Whether the speed gate will send this call to stock SDPA at run time (``ops.gate_reason``, from the
    compile-time shapes): then none of our kernels runs there and nothing is worth building."""
    from . import formats

    if not torch.cuda.is_available():
        return False
    q = torch.empty(req["q"]["shape"], device="meta")
    k = torch.empty(req["k"]["shape"], device="meta")
    if req["rope"]:
        spec = formats.parse_spec(req["rope"])
        q, k = formats.to_bhsd(q, spec), formats.to_bhsd(k, spec)
    return ops.gate_reason(VCConfig.from_json(req["config"]), torch.device(req["q"]["device"]), q.shape,
                           k.shape[2]) is not None


def vcattn(gm: torch.fx.GraphModule, example_inputs, *, mode: Optional[str] = None, options=None, **_):
    # options: a dict or a VCConfig; $VCATTN_METHOD (vc_compile/pipeline.py) may switch the method or, with
    # "off", compile this graph with Inductor and no rewrite (stock torch.compile: the A/B baseline)
    try:
        opts, off = apply_env(options_dict(options), "backend='vcattn'")
        cfg = VCConfig.from_options(opts, mode)
    except VCConfigError as e:
        raise _usage_error(e) from None
    if off:
        log.info("backend='vcattn': VCATTN_METHOD=off: graph compiled without the attention rewrite")
        if cfg.experimental.compiler == Compiler.EAGER:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=inductor_patches(cfg))
    name = f"vcattn_graph_{next(_GRAPH_IDS)}"
    detect_context_parallel(gm, cfg, graph_name=name)  # report-only: ring / DTensor / Ulysses findings
    stats = rewrite_sdpa(gm, cfg, graph_name=name)
    findings = detect_rope(gm, graph_name=name)  # RoPE producer forms, graph unchanged
    fuse_rope(gm, findings, cfg, graph_name=name)  # RoPE + permute into the preprocessing kernel (step 2)
    if stats["rewritten"]:
        toolchain.check(_fast_path_off())  # an untested Triton: one warning per process, not only in report()
        start_prebuild(gm, cfg)  # our kernels build in helper processes while Inductor compiles the graph
    if stats["sites"]:
        # torch._dynamo.reset() or a deleted model frees the graph: its metadata goes with it, once no
        # other live graph has the site (a recompile for another grad mode keeps its site ids)
        sites = tuple(stats["sites"])
        _LIVE.update(sites)
        weakref.finalize(gm, _graph_freed, sites)
    if cfg.experimental.compiler == Compiler.EAGER:
        if cfg.mode not in (None, "default"):
            warnings.warn(f"vcattn: mode={cfg.mode!r} has no effect with compiler='eager' (Inductor is not "
                          "used); drop one of the two.", UserWarning, stacklevel=2)
        return _warn_later(gm.forward, stats.get("deferred_warning"))
    from torch._inductor.compile_fx import compile_fx

    return _warn_later(compile_fx(gm, example_inputs, config_patches=inductor_patches(cfg)),
                       stats.get("deferred_warning"))


def _usage_error(e: VCConfigError) -> VCConfigError:
    """A bad option reaches the user from inside Dynamo's compile, which would wrap it in
    ``BackendCompilerFailed`` and ask for a PyTorch bug report. Raised as a Dynamo ``ShortenTraceback`` (passed
    through unwrapped; where this torch has one) it stays a ``VCConfigError`` (a ``ValueError``) and says that it
    is a usage error of the ``torch.compile`` call."""
    msg = (f"{e} -- a usage error in the options of torch.compile(..., backend='vcattn'), not a PyTorch bug; "
           "VCConfig.from_options(options) checks them before any compile.")
    try:
        from torch._dynamo.exc import ShortenTraceback as base
    except ImportError:
        base = None
    if base is None:
        return VCConfigError(msg)
    try:
        return _shortened(base)(msg, sys._getframe(1))  # the traceback starts at the backend call
    except TypeError:  # another constructor on a future torch: the plain error still names the problem
        return VCConfigError(msg)


@functools.lru_cache(maxsize=None)
def _shortened(base: type) -> type:
    class VCOptionsError(VCConfigError, base):  # type: ignore[misc, valid-type]
        def __init__(self, msg: str, frame=None):
            base.__init__(self, msg, first_useful_frame=frame)

    VCOptionsError.__module__ = "vc_compile.config"
    VCOptionsError.__name__ = VCOptionsError.__qualname__ = "VCConfigError"
    return VCOptionsError


def _warn_later(fn, msg: Optional[str]):
    """``fn``, or where ``msg`` (a graph with no attention: passes/sdpa_rewrite._warn_no_sdpa) a wrapper that warns
    ``msg`` at the graph's second call if no rewritten attention ran since its first (a forward pass in between: the
    model's attention ran eagerly), and nothing if one did (this graph was a piece without attention)."""
    if msg is None:
        return fn
    from .runtime.report import op_calls
    seen = []  # the op's call count at this graph's first call

    def run(*args):
        if len(seen) < 2:
            seen.append(op_calls())
            if len(seen) == 2 and seen[1] == seen[0]:  # a whole forward pass ran no rewritten attention
                warnings.warn(msg, UserWarning, stacklevel=2)
        return fn(*args)
    if getattr(fn, "_boxed_call", False):  # Inductor's calling convention: one list argument, kept
        run._boxed_call = True
    return run
