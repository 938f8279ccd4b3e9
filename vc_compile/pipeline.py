"""``vc_compile.enable(pipe)`` / ``vc_compile.disable(pipe)``: the backend on a whole diffusers pipeline.

    import vc_compile
    pipe = vc_compile.enable(pipe)                                   # V-Smooth on every transformer
    pipe = vc_compile.enable(pipe, method="mcsparse", density=0.15)  # any option of the options table
    vc_compile.disable(pipe)                                         # back to the pipeline as it was

``enable`` compiles every transformer of the pipeline (``transformer``, and ``transformer_2`` for Wan 2.2's
two experts: every diffusers ``ModelMixin`` component whose attribute or class name says transformer) with
``backend="vcattn"``, in place (``module.compile``: ``pipe.transformer`` stays the same object):

* regional by default: each repeated block class listed in the model's ``_repeated_blocks`` (what diffusers'
  ``compile_repeated_blocks`` compiles) is compiled once and shared by all blocks -- seconds instead of
  minutes of compile, the same kernels; ``regional=False``, or a model without ``_repeated_blocks``,
  compiles the whole model;
* the attention backend: diffusers' dispatcher only reaches ``scaled_dot_product_attention`` (what the
  backend rewrites) through its ``"native"`` backend; any other (``set_attention_backend("flash")``,
  ``DIFFUSERS_ATTN_BACKEND=sage``, ...) hides attention from us. ``enable`` sets the model's processors to
  ``"native"`` and warns, naming the backend it replaced (``disable`` restores it);
  ``reset_attention_backend=False`` only warns. Processors set up for context parallelism keep their
  backend when ``"native"`` cannot run it (a warning says so);
* the steps: the pipeline's calls are followed through its ``callback_on_step_end`` (chained after the
  user's own callback; ``runtime/pipeline_calls.py``), not through diffusers' loop variables.

The switch ``VCATTN_METHOD`` (environment), read by every ``enable`` call and every compile of
``backend="vcattn"``, changes the method without a code change (A/B in production):

    VCATTN_METHOD=off        enable() leaves the pipeline untouched; backend="vcattn" compiles with Inductor
                             and no attention rewrite (stock torch.compile)
    VCATTN_METHOD=dense|vsmooth|mcsparse|auto   this method, whatever the code or options say

(unset or empty: the code's choice; any other value is an error naming the accepted ones).
"""
from __future__ import annotations

import dataclasses
import json
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .log import get_logger

log = get_logger(__name__)

# the switch and options_dict live with the options (config.py); the backend reads them there, not here
from .config import ENV_METHOD, apply_env, method_from_env, options_dict  # noqa: E402,F401
from .runtime.runtime import current  # noqa: E402


# ---- enable / disable ---------------------------------------------------------------------------------
def _nothing():
    return None


@dataclasses.dataclass
class _Enabled:
    """What ``enable`` changed on a pipeline, for ``disable``. A copy of the pipeline (pickle, ``copy.deepcopy``)
    gets None in its place: torch drops a module's compiled call when it is copied, so the copy is not enabled
    (and says so: ``enabled_options`` is None); ``enable`` the copy to compile it."""

    options: Dict[str, Any]
    compiled: List[Any]  # modules whose _compiled_call_impl we set
    backends: List[Tuple[Any, Any]]  # (processor, its previous _attention_backend)
    tracked: bool
    components: List[str]
    first_site: int = 0  # the report's next site id when enable ran: the sites of this compile are from it on

    def __reduce__(self):
        return (_nothing, ())

    def __deepcopy__(self, memo):
        return None


_STATE_ATTR = "_vc_compile_enabled"
# module -> the pipelines (or bare modules) enabled with it: two pipelines sharing a transformer keep it compiled
# until the last of them is disabled
_OWNERS: "weakref.WeakKeyDictionary" = current().owners  # (the Runtime's, bound here)


def _is_module(x) -> bool:
    import torch

    return isinstance(x, torch.nn.Module)


def transformers_of(pipe) -> Dict[str, Any]:
    """The pipeline's transformer components by attribute name (a bare ``nn.Module``: ``{"model": it}``)."""
    if _is_module(pipe):
        return {"model": pipe}
    comps = getattr(pipe, "components", None)
    if not isinstance(comps, Mapping):
        raise TypeError(f"vc_compile.enable expects a diffusers pipeline or a torch.nn.Module, got "
                        f"{type(pipe).__name__}")
    try:
        from diffusers import ModelMixin
    except ImportError:  # pragma: no cover - a pipeline object implies diffusers
        ModelMixin = ()
    found = {}
    for name, comp in comps.items():
        if comp is not None and hasattr(comp, "_orig_mod") and _is_module(getattr(comp, "_orig_mod", None)):
            raise ValueError(f"vc_compile.enable: pipe.{name} is already torch.compile'd; give enable() the "
                             f"pipeline with its eager module (pipe.{name} = pipe.{name}._orig_mod)")
        if comp is None or not _is_module(comp) or (ModelMixin and not isinstance(comp, ModelMixin)):
            continue
        if "transformer" in name.lower() or "transformer" in type(comp).__name__.lower():
            found[name] = comp
    return found


_ATTENTION_WORDS = ("attention", "attn", "sdpa")


def _looks_like_attention(model) -> bool:
    """Whether ``model`` has a submodule named like attention or code that calls attention (a class's ``forward``
    source mentioning it): a cheap check that enable() is pointed at something vcattn can rewrite."""
    import inspect

    seen = set()
    for m in model.modules():
        cls = type(m)
        if cls in seen:
            continue
        seen.add(cls)
        if any(w in cls.__name__.lower() for w in _ATTENTION_WORDS):
            return True
        if cls.__module__.startswith("torch.nn.modules"):
            continue  # torch's own layers (Linear, LayerNorm, ...), except nn.MultiheadAttention named above
        try:
            src = inspect.getsource(cls.forward).lower()
        except (OSError, TypeError):
            return True  # unreadable: assume it may
        if any(w in src for w in _ATTENTION_WORDS):
            return True
    return False


def _blocks(model) -> List[Any]:
    """The modules regional compile compiles: instances of the classes named in ``_repeated_blocks``."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names] if names else []


def _fix_attention_backends(model, name: str, reset: bool) -> List[Tuple[Any, Any]]:
    """Processors whose diffusers attention backend is not ``"native"``: set to native (``reset``) and
    warned about. Returns (processor, previous value) for ``disable``."""
    procs = [m.processor for m in model.modules()
             if hasattr(getattr(m, "processor", None), "_attention_backend")]
    if not procs:
        return []  # diffusers < 0.35 processors call scaled_dot_product_attention directly
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
        active = getattr(_AttentionBackendRegistry, "_active_backend", "native")
        cp_ok = "native" in getattr(_AttentionBackendRegistry, "_supports_context_parallel", {"native"})
    except ImportError:  # pragma: no cover
        return []
    native = AttentionBackendName("native")
    changed, kept, seen = [], set(), set()
    for p in procs:
        eff = getattr(p._attention_backend or active, "value", p._attention_backend or active)
        if eff == "native":
            continue
        seen.add(str(eff))
        if not reset or (getattr(p, "_parallel_config", None) is not None and not cp_ok):
            kept.add(str(eff))
            continue
        changed.append((p, p._attention_backend))
        p._attention_backend = native
    if changed:
        warnings.warn(f"vc_compile.enable: {name} used the diffusers attention backend(s) "
                      f"{sorted(seen - kept)}, which hide scaled_dot_product_attention from backend='vcattn'; "
                      "set to 'native' (vc_compile.disable restores them; reset_attention_backend=False keeps "
                      "them).", UserWarning, stacklevel=3)
    if kept:
        warnings.warn(f"vc_compile.enable: {name} keeps the diffusers attention backend(s) {sorted(kept)}: "
                      "its attention is not rewritten (no call site will show in vc_compile.report()). "
                      "Call set_attention_backend('native') to let vcattn run it.", UserWarning, stacklevel=3)
    return changed


def enable(pipe, method: Optional[str] = None, *, options: Any = None, regional: bool = True,
           components: Optional[Sequence[str]] = None, reset_attention_backend: bool = True,
           compile_kwargs: Optional[Mapping[str, Any]] = None, **option_kwargs):
    """Compile every transformer of ``pipe`` with ``backend="vcattn"`` and return ``pipe``.

    ``method`` and ``option_kwargs`` are the backend's options (the table in docs/usage.md), on top of
    ``options`` (a dict or a ``VCConfig``); they are validated here, before anything changes.
    ``regional``: compile the repeated blocks (default) or the whole model. ``components``: attribute names
    to compile instead of every transformer. ``compile_kwargs``: more ``torch.compile`` arguments
    (``fullgraph``, ``dynamic``). ``$VCATTN_METHOD`` overrides the method or (``off``) disables all of this.
    A second ``enable`` first undoes the first; ``report()`` then lists the new compile's sites in place of
    the first's (with the same options: the same sites, counted on). ``pipe`` may also be a single ``nn.Module``."""
    from .config import VCConfig, merge_options

    opts = options_dict(options)
    if method is not None:
        opts["method"] = method
    opts = merge_options(opts, option_kwargs)  # an experimental={...} kwarg merges into options' own
    opts, off = apply_env(opts, "vc_compile.enable")
    cfg = VCConfig.from_options(opts)  # fail before changing anything
    sites = current().sites  # the report's site registry
    earlier = getattr(pipe, _STATE_ATTR, None)
    if earlier is not None:
        disable(pipe)
    if off:
        log.warning("vc_compile.enable: %s=off: %s left unchanged", ENV_METHOD, type(pipe).__name__)
        return pipe
    found = transformers_of(pipe)
    if components is not None:
        missing = [c for c in components if c not in found and getattr(pipe, c, None) is None]
        if missing:
            raise ValueError(f"vc_compile.enable: {type(pipe).__name__} has no component(s) {missing}; "
                             f"its transformers: {sorted(found)}")
        found = {c: found.get(c, getattr(pipe, c, None)) for c in components}
        not_modules = [c for c, m in found.items() if not _is_module(m)]
        if not_modules:  # checked before anything is compiled: a failed enable leaves the pipeline as it was
            raise ValueError(f"vc_compile.enable: component(s) {not_modules} of {type(pipe).__name__} are not "
                             f"torch.nn.Modules ({', '.join(type(found[c]).__name__ for c in not_modules)}); "
                             f"pass transformer components only, e.g. components={sorted(transformers_of(pipe))}")
    if not found:
        raise ValueError(f"vc_compile.enable: no transformer found in {type(pipe).__name__} (components: "
                         f"{sorted(getattr(pipe, 'components', {}) or {})}); pass components=[...]")
    quiet = [n for n, m in found.items() if not _looks_like_attention(m)]
    if quiet:  # e.g. enable(nn.Linear(...)): compiled as asked, but nothing there for the backend to rewrite
        warnings.warn(f"vc_compile.enable: {', '.join(f'{n} ({type(found[n]).__name__})' for n in quiet)} has no "
                      "attention module and no scaled_dot_product_attention in its code, so vcattn will likely "
                      "rewrite nothing there; give enable() the model (or pipeline) whose attention should run "
                      "on vcattn.", UserWarning, stacklevel=2)
    plain = json.loads(cfg.to_json())  # what the backend receives: plain JSON values
    kw = dict(compile_kwargs or {})
    compiled, backends, what = [], [], []
    for name, model in found.items():
        backends += _fix_attention_backends(model, name, reset_attention_backend)
        blocks = _blocks(model) if regional else []
        for m in blocks or [model]:
            others = [o for o in _OWNERS.get(m, ()) if o is not pipe]
            if others and any(enabled_options(o) != plain for o in others):
                warnings.warn(f"vc_compile.enable: {name} is shared with another enabled pipeline "
                              f"({type(others[0]).__name__}) that chose other options; both now run these.",
                              UserWarning, stacklevel=2)
            m.compile(backend="vcattn", options=plain, **kw)
            _OWNERS.setdefault(m, weakref.WeakSet()).add(pipe)
            compiled.append(m)
        what.append(f"{name} ({len(blocks)} blocks)" if blocks else f"{name} (whole model)")
    tracked = False
    if not _is_module(pipe):
        from .runtime import pipeline_calls

        tracked = pipeline_calls.track(pipe)
    first = sites.watermark()
    if earlier is not None:
        if earlier.options == plain and earlier.compiled == compiled:
            first = earlier.first_site  # the same compile again: Dynamo reuses its graphs, and their sites
        elif not _any_enabled():
            # NOTE another compile: its sites replace the undone one's in report(), which would list each site
            # once per compile; only where no other pipeline is enabled (a site record does not say whose it is)
            sites.retire_from(earlier.first_site)
    object.__setattr__(pipe, _STATE_ATTR, _Enabled(plain, compiled, backends, tracked, list(found), first))
    from .backend import warm_prebuild

    warm_prebuild(cfg)  # prebuild on: its helpers import while the first call traces and compiles
    log.info("vc_compile.enable: method=%s on %s; steps from %s", cfg.resolved_method.value, ", ".join(what),
             "callback_on_step_end" if tracked else "the frame probe / timestep")
    return pipe


def _any_enabled() -> bool:
    """Whether any pipeline (or bare module) is enabled now."""
    return any(getattr(o, _STATE_ATTR, None) is not None for owners in list(_OWNERS.values()) for o in owners)


def disable(pipe):
    """Undo ``enable``: the modules run eagerly again (their compiled code is dropped), attention backends
    and the pipeline's class are restored, cached metadata is dropped. Returns ``pipe``."""
    st = getattr(pipe, _STATE_ATTR, None)
    if st is None:
        return pipe
    kept = 0
    for m in st.compiled:
        owners = _OWNERS.get(m)
        if owners is not None:
            owners.discard(pipe)
        if owners and any(getattr(o, _STATE_ATTR, None) is not None for o in owners):
            kept += 1  # still enabled through another pipeline sharing the module
            continue
        m._compiled_call_impl = None  # what nn.Module.compile set
    for proc, prev in st.backends:
        proc._attention_backend = prev
    if st.tracked:
        from .runtime import pipeline_calls

        pipeline_calls.untrack(pipe)
    object.__delattr__(pipe, _STATE_ATTR)
    from .runtime.steps import TRACKER

    TRACKER.new_generation()  # drops the metadata of the sites these modules fed
    log.info("vc_compile.disable: %s restored%s", ", ".join(st.components),
             f" ({kept} module(s) kept compiled: still enabled through another pipeline)" if kept else "")
    return pipe


def enabled_options(pipe) -> Optional[Dict[str, Any]]:
    """The options ``enable`` compiled ``pipe`` with, or None."""
    st = getattr(pipe, _STATE_ATTR, None)
    return dict(st.options) if st is not None else None
