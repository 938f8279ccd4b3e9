"""Dynamo-level rewrite: every eligible ``scaled_dot_product_attention`` -> ``vcattn::attention``.

Why here (docs/methods.md, "Where the rewrite happens"): in the Dynamo graph SDPA is one target; after AOTAutograd it is already a
device-specific kernel (cuDNN / flash / efficient / CPU flash / math). Nested GraphModules
(``invoke_subgraph``, ``nested_compile_region``) are rewritten too.

Eligible: no mask, not causal, no dropout, no GQA, q/k/v need no grad, dtype bf16/fp16, head dim in
``head_dims`` (q, k and v alike), query and key lengths >= ``min_seq_len`` (checked again at run time
when the graph has symbolic lengths). Anything else stays stock SDPA, with the reason recorded in
``vc_compile.report()`` and a counter ``counters["vcattn"]["fallback:<reason>"]``; every rewrite bumps
``counters["vcattn"]["rewrite"]`` and ``counters["vcattn"]["rewrite:<method>"]``.

Block identity: the op gets the weight that feeds q's projection (found by walking q's producers back to
a ``linear`` or ``matmul``; a weight dequantised inside ``forward``, as diffusers' GGUF linears do, is
followed back to the stored parameter), so graphs shared by many blocks (regional compile, Wan 2.2's
experts) key their metadata per block at run time. A site where none is found is recorded with
``has_identity=False``; MC-Sparse refuses such a site at run time (``ops.py``: its cached selections
could reach another block).

Dynamic shapes (``dynamic=True``, ``mark_dynamic``): the head dim is compared symbolically, which
guards on it (specialises it: one graph per head dim) while the sequence length stays symbolic.

Site identity: the same call site in a recompiled graph of the same model (another grad mode, a guard
failure) gets the same site id, so its metadata carries over (``_site_keys``). The report's module
column is a module path (``passes/names.py``); a graph whose sites stay (partly) stock gets one warning
naming the most common reason and its fix (``passes/fallback_notes.py``).
"""
from __future__ import annotations

import operator
import warnings
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters

from .. import ops  # (registers torch.ops.vcattn.*)
from ..config import VCConfig
from ..runtime import report as _report
from . import fallback_notes as _notes
from .fallback_notes import HEAD_DIM_DYNAMIC
from . import names as _names
from .cp_detect import META_KEY as _CP_META_KEY
from .cp_detect import dtensor_reason

# (a model calling the aten op itself puts its overload packet in the graph, not ``.default``)
SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
                torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.scaled_dot_product_attention}
LINEAR_TARGETS = {F.linear, torch._C._nn.linear, torch.ops.aten.linear.default}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_args(node: fx.Node) -> dict:
    a = dict(_DEFAULTS)
    for name, val in zip(_SDPA_ARGS, node.args):
        a[name] = val
    a.update(node.kwargs)
    for short, long in (("q", "query"), ("k", "key"), ("v", "value")):
        a[short] = a.pop(long)
    return a


def _val(x):
    if isinstance(x, fx.Node):
        return x.meta.get("example_value", x.meta.get("val"))
    return x


def _static(n) -> Optional[int]:
    return n if isinstance(n, int) else None




def _marked_dynamic(dims, gm: Optional[fx.GraphModule]) -> bool:
    """Does a symbolic head dim come from an input dim the user marked dynamic
    (``torch._dynamo.mark_dynamic``)? Specialising it would then fail the compile
    (ConstraintViolationError) instead of recompiling."""
    if gm is None:
        return False
    syms = set()
    env = None
    for d in dims:
        if isinstance(d, torch.SymInt):
            syms |= d.node.expr.free_symbols
            env = d.node.shape_env
    if env is None:
        return False
    args = [n.meta["grapharg"] for n in gm.graph.nodes if n.op == "placeholder" and "grapharg" in n.meta]
    for sym in syms:
        for src in env.var_to_sources.get(sym, ()):
            base, idx = getattr(src, "base", None), getattr(src, "idx", None)
            for ga in args:
                if ga.source == base:
                    try:
                        example = ga.example
                    except Exception:
                        continue
                    if idx in getattr(example, "_dynamo_dynamic_indices", ()):
                        return True
    return False


def _head_dim_reason(q, k, v, cfg: VCConfig, gm: Optional[fx.GraphModule]) -> Optional[str]:
    """None when q, k, v share a head dim in ``cfg.head_dims``.

    Under ``dynamic=True`` every dim is symbolic, the head dim too. Every DiT has one fixed head dim, so
    the comparison below is allowed to guard on it: Dynamo specialises the head dim (a new one
    recompiles, at most once per head dim) while the sequence length stays symbolic (checked against
    ``min_seq_len`` at run time). Not when the user marked the head dim dynamic: specialising it
    would fail the compile, so it stays stock (the fallback warning names the fix)."""
    dims = [t.shape[-1] for t in (q, k, v)]
    if not all(isinstance(d, int) for d in dims):
        try:
            if _marked_dynamic(dims, gm):
                return HEAD_DIM_DYNAMIC
        except Exception:  # internal structures: never let the check break a compile
            pass
    try:
        ok = any(dims[0] == d for d in cfg.head_dims) and dims[1] == dims[0] and dims[2] == dims[0]
    except Exception:  # a data-dependent (unbacked) head dim: no guard possible
        return "head_dim unsupported"
    return None if ok else "head_dim unsupported"


def key_padding_mask(a: dict) -> bool:
    """Whether the call's ``attn_mask`` is a boolean mask of a padding form, [B or 1, 1, 1 or Sq, Sk] as SDPA
    broadcasts it (HunyuanVideo's joint attention over video + padded text tokens: [B, 1, 1, S]; HunyuanVideo 1.5's:
    [B, 1, S, S]): the op runs such a call on the keys it keeps when, at run time, every batch row keeps the same
    first L keys for every query or for the first L queries (ops.key_prefix), and stock SDPA with the mask
    otherwise. Any other mask (additive, per head) stays stock at compile time."""
    m, q, k = (_val(a[x]) for x in ("attn_mask", "q", "k"))
    if not all(isinstance(t, torch.Tensor) for t in (m, q, k)) or m.dtype != torch.bool or not 1 <= m.dim() <= 4:
        return False
    shape = (1,) * (4 - m.dim()) + tuple(m.shape)
    dims = [_static(x) for x in (*shape, q.shape[0], k.shape[2])]
    if any(d is None for d in dims):  # symbolic sizes: no guard taken on them here
        return False
    b, h, sq, sk, B, Sk = dims
    Sq = _static(q.shape[2])
    return h == 1 and sq in (1, Sq) and sk == Sk and b in (1, B)


def ineligible(a: dict, cfg: VCConfig, gm: Optional[fx.GraphModule] = None) -> Optional[str]:
    """The reason this SDPA call must stay stock, or None. ``gm``: the graph being compiled (lets a
    symbolic head dim be told apart from one the user marked dynamic)."""
    if a["attn_mask"] is not None and not (isinstance(a["attn_mask"], fx.Node) and key_padding_mask(a)):
        return "masked"
    if a["is_causal"] is True or isinstance(a["is_causal"], fx.Node):
        return "causal"
    dp = a["dropout_p"]
    if isinstance(dp, fx.Node) or dp != 0.0:
        return "dropout"
    if a["enable_gqa"] not in (False, None):
        return "gqa"
    if isinstance(a["scale"], fx.Node):
        return "scale is a tensor"
    q, k, v = (_val(a[x]) for x in "qkv")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "no example value"
    cp_reason = dtensor_reason(q, k, v)  # torch context_parallel: the ring is behind the DTensor dispatch
    if cp_reason is not None:
        return cp_reason
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "not 4-D [B, H, S, D]"
    if any(t.requires_grad for t in (q, k, v)):
        return "requires grad"
    if any(t.dtype not in ops.SUPPORTED_DTYPES for t in (q, k, v)) or len({q.dtype, k.dtype, v.dtype}) > 1:
        return "dtype unsupported"
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1]:
        return "gqa"
    hd = _head_dim_reason(q, k, v, cfg, gm)
    if hd is not None:
        return hd
    Sq, Sk = _static(q.shape[2]), _static(k.shape[2])
    # a short call with a mask stays "masked", as before key-padding masks were rewritten: stock for two reasons,
    # it is never the small test model that the length warning is for (Mochi's masked 1-query caption pooling)
    if Sq is not None and Sq < cfg.min_seq_len:
        return "masked" if a["attn_mask"] is not None else "sequence too short"
    if Sk is not None and Sk < cfg.min_seq_len:
        return "masked" if a["attn_mask"] is not None else "cross-attention too short"
    return None


MATMUL_TARGETS = {torch.matmul, operator.matmul, torch.ops.aten.matmul.default, torch.ops.aten.mm.default}


def _is_leaf(n) -> bool:
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")


def _numel(n: fx.Node) -> int:
    v = _val(n)
    try:
        return int(v.numel()) if isinstance(v, torch.Tensor) else 0
    except Exception:  # a symbolic size
        return 0


def weight_source(w: fx.Node, max_nodes: int = 64) -> Optional[fx.Node]:
    """The stored tensor a computed weight comes from: a weight dequantised inside ``forward`` (diffusers'
    GGUF linears, bitsandbytes-style int8 + scale) is a chain of ops on a module parameter. Of the
    placeholders / attributes the weight's producers read (at most ``max_nodes`` nodes back), the largest:
    the quantised data, not its scales or a shared lookup table."""
    if _is_leaf(w):
        return w
    seen, stack, leaves = set(), [w], []
    while stack and len(seen) < max_nodes:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if _is_leaf(n):
            leaves.append(n)
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        for arg in list(n.args) + list(n.kwargs.values()):
            if isinstance(arg, fx.Node):
                stack.append(arg)
            elif isinstance(arg, (list, tuple)):
                stack.extend(a for a in arg if isinstance(a, fx.Node))
    leaves = [n for n in leaves if _numel(n) > 0]
    return max(leaves, key=_numel) if leaves else None


def find_block_identity(q: fx.Node, max_depth: int = 40) -> Optional[fx.Node]:
    """The weight (placeholder / get_attr) feeding the linear (or matmul) that produced q, if any; a weight
    computed in the graph (dequantised inside ``forward``) is followed back to the parameter it is computed
    from (``weight_source``)."""
    seen, frontier = set(), [q]
    for _ in range(max_depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if n.op == "call_function" and n.target in LINEAR_TARGETS | MATMUL_TARGETS:
                w = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight", n.kwargs.get("other"))
                if isinstance(w, fx.Node):
                    src = weight_source(w)
                    if src is not None:
                        return src
            if n.op in ("call_function", "call_method"):
                # follow the data input only (first tensor argument), not cos/sin tables
                for arg in n.args:
                    if isinstance(arg, fx.Node):
                        nxt.append(arg)
                        break
                    if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], fx.Node):
                        nxt.append(arg[0])
                        break
        if not nxt:
            return None
        frontier = nxt
    return None


def plain_identity(graph: fx.Graph, ident: Optional[fx.Node]) -> Optional[fx.Node]:
    """The block identity as a plain tensor. A weight held as a tensor subclass (torchao's ``Float8Tensor`` of
    ``quantize_(model, Float8DynamicActivationFloat8WeightConfig())``, other wrapper subclasses) cannot be an
    argument of the op (the subclass has no rule for ``vcattn::attention``: the call would raise at run time);
    its largest inner tensor (the quantised data, stored as long as the weight is) identifies the block as well.
    Inserts that ``getattr`` at the graph's insertion point."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    val = _val(ident)
    if ident is None or not is_traceable_wrapper_subclass(val):
        return ident
    names, _ = val.__tensor_flatten__()
    inner = max(names, key=lambda n: getattr(val, n).numel())
    node = graph.call_function(getattr, (ident, inner))
    node.meta["example_value"] = getattr(val, inner)
    return node


def _shape_str(a) -> str:
    q, k = _val(a["q"]), _val(a["k"])
    if not isinstance(q, torch.Tensor):
        return "?"
    s = "x".join(str(x) for x in q.shape)
    if isinstance(k, torch.Tensor) and k.shape[2] != q.shape[2]:
        s += f" (Sk={k.shape[2]})"
    return s


def _fake_value(node: fx.Node):
    """Recompute meta['example_value'] of the new node from its inputs' fake values."""
    try:
        args = [_val(a) if isinstance(a, fx.Node) else a for a in node.args]
        fake = next((x for x in args if isinstance(x, torch.Tensor)), None)
        mode = getattr(fake, "fake_mode", None)
        if mode is None:
            return None
        with mode:
            return node.target(*args)
    except Exception:
        return None


def _short(a: dict, cfg: VCConfig) -> bool:
    """Is this call's query or key length known at compile time and below ``min_seq_len``? (Such a
    site would stay stock whatever else it is: e.g. Mochi's masked 1-query caption pooling.)"""
    lens = [getattr(_val(a[x]), "shape", (None,) * 4) for x in "qk"]
    return any(len(s) == 4 and _static(s[2]) is not None and s[2] < cfg.min_seq_len for s in lens)


def _site_keys(nodes, labels, root_id, cfg_json: str, mod_name: str) -> dict:
    """A key per SDPA node that is the same for the same call site in a recompiled graph.

    Dynamo recompiles the same model for another grad mode (``no_grad`` <-> ``inference_mode``), a
    new static shape, or after a guard failure; each recompile used to get fresh site ids, so the
    site's metadata started over (an extra MC-Sparse anchor, a V-Smooth re-grouping). The key holds
    what names the call site: the compiled callable (``root_id``: its module instance or code object),
    the nested graph, the module path, the user-code stack of the call and its occurrence among equal
    ones; and what must not be shared: the options (another method's metadata), q's dtype and shape
    string, and the outcome. A recompile for another model instance gets keys of its own (``root_id``);
    a graph Dynamo does not recompile but reuses for another instance (the identical blocks of a regional
    compile, or of two models of one class) keeps its site ids, so those calls share a site in
    ``report()``, and the block identity keeps their metadata apart at run time."""
    keys, seen = {}, {}
    if root_id is None:  # not inside a Dynamo compile (a graph handed over by hand): no sharing
        return dict.fromkeys(nodes)
    for node in nodes:
        where = (labels[node], node.meta.get("stack_trace") or node.name)
        n = seen[where] = seen.get(where, -1) + 1
        keys[node] = (root_id, mod_name, *where, n, cfg_json)
    return keys


def rewrite_sdpa(gm: fx.GraphModule, cfg: VCConfig, graph_name: str = "graph") -> dict:
    """Rewrite ``gm`` in place (and its nested GraphModules). Returns {'rewritten': n, 'fallback': m}."""
    stats = {"rewritten": 0, "fallback": 0, "sdpa": 0, "sites": [], "records": [], "short": set()}
    cfg_json = cfg.to_json()
    method = cfg.resolved_method.value
    root = _names.compiled_root()
    root_id = _names.compiled_root_id()
    for mod_name, mod in gm.named_modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        changed = False
        nodes = [n for n in mod.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
        labels = {n: _names.site_label(n, root) for n in nodes}
        site_keys = _site_keys(nodes, labels, root_id, cfg_json, mod_name)
        for node in nodes:
            stats["sdpa"] += 1
            a = sdpa_args(node)
            reason = ineligible(a, cfg, gm)
            q = _val(a["q"])
            rec_kw = dict(graph=f"{graph_name}{'.' + mod_name if mod_name else ''}", node=node.name,
                          module=labels[node], shape=_shape_str(a),
                          dtype=str(q.dtype).replace("torch.", "") if isinstance(q, torch.Tensor) else "?",
                          method=method)
            key = site_keys[node] and site_keys[node] + (rec_kw["dtype"], rec_kw["shape"], reason)
            if reason is not None:
                rec = _report.register_site(rewritten=False, reason=reason, key=key, **rec_kw)
                stats["records"].append(rec)
                if _short(a, cfg):
                    stats["short"].add(rec.site)
                counters["vcattn"][f"fallback:{reason}"] += 1
                stats["fallback"] += 1
                continue
            ident = find_block_identity(a["q"])
            with mod.graph.inserting_before(node):
                ident = plain_identity(mod.graph, ident)
            rec = _report.register_site(rewritten=True, has_identity=ident is not None, key=key, **rec_kw)
            stats["records"].append(rec)
            _notes.note_reference_path(cfg, q)
            with mod.graph.inserting_before(node):
                new = mod.graph.call_function(
                    torch.ops.vcattn.attention.default,
                    (a["q"], a["k"], a["v"], ident, rec.site, cfg_json, a["scale"]),
                    {"key_mask": a["attn_mask"]} if a["attn_mask"] is not None else {})
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
            fake = _fake_value(new)
            if fake is not None:
                new.meta["example_value"] = fake
            node.replace_all_uses_with(new)
            mod.graph.erase_node(node)
            counters["vcattn"]["rewrite"] += 1
            counters["vcattn"][f"rewrite:{method}"] += 1
            stats["rewritten"] += 1
            stats["sites"].append(rec.site)
            changed = True
        if changed:
            mod.graph.lint()
            mod.recompile()
    cp = getattr(gm, "meta", {}).get(_CP_META_KEY)
    if stats["sdpa"] == 0 and not getattr(cp, "has_ring", False):  # ring calls got their own warning
        stats["deferred_warning"] = _warn_no_sdpa(gm, graph_name)
    elif stats["fallback"] and cfg.warn_fallbacks:
        _notes.warn_fallbacks(stats["records"], stats["short"], cfg, graph_name, root_id)
    return stats


_ATTN_WORDS = ("attn", "attention", "sage", "flash", "xformers")


def _target_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    name = getattr(t, "__name__", None) or str(t)
    ns = getattr(t, "namespace", None) or getattr(getattr(t, "_schema", None), "name", "").split("::")[0]
    return f"{ns}.{name}" if ns and ns not in ("aten", "prim") else name


def _warn_no_sdpa(gm: fx.GraphModule, graph_name: str) -> Optional[str]:
    """Warn when a compiled graph has no SDPA to rewrite although it should have had attention.

    Small graph pieces without any attention-like op stay quiet (graph breaks cut models into pieces,
    most of which hold no attention). The cause is classified into a counter
    ``counters["vcattn"]["no_sdpa:<cause>"]`` (``third-party``, ``hand-written``, ``graph-break``) and
    the warning text names what to do; the text carries no graph name, so Python's warning filter
    shows each cause once instead of once per graph piece (a model with graph breaks compiles into
    many). Every graph is listed in ``vc_compile.report().graphs_without_sdpa``.

    The ``graph-break`` cause is not warned here but returned: a graph with no attention at all is usually one
    piece of a model whose attention sits in another compiled graph (Lumina2's and HunyuanVideo 1.5's embedders,
    split off by a graph break), which the compile of this piece cannot know yet. The backend warns at the
    graph's second call, only if no rewritten attention ran since its first (Mochi: its joint attention runs
    eagerly, only a masked cross-attention reaches a graph).
    """
    nodes = [n for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
             if n.op in ("call_function", "call_method", "call_module")]
    names = [_target_name(n) for n in nodes]
    lowered = [x.lower() for x in names]
    attn_like = [x for x, lo in zip(names, lowered) if any(w in lo for w in _ATTN_WORDS)]
    has_softmax = any("softmax" in lo for lo in lowered)
    if len(nodes) < 8 and not attn_like and not has_softmax:
        return  # a small graph piece (e.g. between graph breaks) with no attention in it: stay quiet
    counters["vcattn"]["graphs_without_sdpa"] += 1
    _report.note_empty_graph(graph_name)
    if attn_like:
        kind = "third-party"
        cause = (f"attention runs through another kernel ({attn_like[0]!r}; e.g. diffusers "
                 "set_attention_backend('sage'/'flash'/'flex'/'xformers')); call "
                 "set_attention_backend('native') (the default) so that scaled_dot_product_attention is "
                 "visible to vcattn")
    elif has_softmax:
        kind = "hand-written"
        cause = ("attention is written by hand (matmul + softmax); vcattn rewrites only "
                 "F.scaled_dot_product_attention")
    else:
        kind = "graph-break"
        cause = ("no attention reached the compiled graphs: graph breaks can leave it running eagerly "
                 "(check torch._dynamo.explain(model)(...)); e.g. Mochi's per-sample nonzero() needs "
                 "torch._dynamo.config.capture_dynamic_output_shape_ops = True")
    counters["vcattn"][f"no_sdpa:{kind}"] += 1
    msg = (f"vcattn: a compiled graph contains no scaled_dot_product_attention, so nothing in it "
           f"was rewritten: {cause}. Graphs concerned: vc_compile.report().graphs_without_sdpa.")
    if kind == "graph-break":
        return msg
    warnings.warn(msg, UserWarning, stacklevel=3)
    return None
