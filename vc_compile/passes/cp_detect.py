"""Context-parallel detection on the Dynamo graph: which attention calls run under Ulysses, all-gather or
ring-style context parallelism, and which of them vcattn must leave to stock attention (and why).

What each pattern means for vcattn (docs/context_parallel.md has the user-facing version):

* **Ulysses** (q/k/v reach SDPA through an all-to-all): the local attention is ordinary full-sequence
  attention over H/N heads. Rewritten like any other call; metadata is per process, i.e. per rank.
* **All-gather KV** (k/v reach SDPA through an all-gather, q stays local): attention of the local queries
  against the whole sequence; exact, rewritten as usual.
* **Ring** (KV chunks, partial outputs merged by their log-sum-exp): needs an attention that returns its
  LSE. ``vcattn::attention`` returns none, and a correct one is not cheap to give: V-Smooth subtracts the
  key mean, so ``lse_true = lse_smoothed + q . kbar * sm`` per chunk, and an MC-Sparse reuse step
  (sparse output + a residual cached at the anchor) has no LSE at all. Ring code therefore never reaches
  F.scaled_dot_product_attention (which cannot return the LSE): diffusers' ring calls
  ``aten._scaled_dot_product_{cudnn,flash}_attention`` (its ``native`` backend refuses ``return_lse``),
  flash-attn or sage kernels. vcattn already leaves those alone; this pass records each such call as a
  not-rewritten site in ``vc_compile.report()`` with the reason :data:`RING_REASON` and bumps
  ``counters["vcattn"]["fallback:ring context parallel"]``, instead of the generic "no SDPA captured"
  warning (whose advice, set_attention_backend('native'), would be wrong: native cannot do ring).
* **DTensor** (torch's ``context_parallel``: SDPA on DTensors sharded along the sequence, dispatched to
  a ring implementation at the aten level): the SDPA node *is* in the graph, and rewriting it would
  bypass the ring and attend to the local KV chunk only, or fail (no sharding rule for the custom op).
  :func:`dtensor_reason` is the check ``sdpa_rewrite.ineligible`` calls to keep it stock.

Entry points:
``detect_context_parallel(gm, cfg, graph_name)`` runs once per graph (idempotent: marks ``gm.meta``),
records findings (``findings()``) and ring sites, returns a :class:`CPDetection`.
``dtensor_reason(q, k, v)`` -> the fallback reason for SDPA inputs that are DTensors, or None.

Like every pass (passes/README.md): nothing in the graph changes; only the report and counters.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ..runtime import report as _report
from ..runtime.runtime import current

# short: they are report() reasons and counter keys (docs/context_parallel.md has the long story)
RING_REASON = "ring context parallel: LSE-merged KV chunks, vcattn::attention returns no LSE"
RING_COUNTER = "fallback:ring context parallel"
DTENSOR_REASON = "context parallel: DTensor inputs (torch context_parallel ring)"
META_KEY = "vcattn_cp_detect"

# attention kernels that return the log-sum-exp (the building block of ring attention)
_LSE_ATTENTION = (
    "_scaled_dot_product_flash_attention",  # also ..._for_cpu
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "flash_attn",  # flash-attn / hub kernels (_flash_attn_forward, flash_attn_func, ...)
    "sageattn",
)
_SDPA_NAMES = ("scaled_dot_product_attention",)
_A2A = ("all_to_all",)
_GATHER = ("all_gather",)
_P2P = ("permute_tensor", "batch_isend_irecv", "isend", "irecv", ".send", ".recv")
_COLLECTIVE = _A2A + _GATHER + _P2P + ("reduce_scatter", "all_reduce", "broadcast", "_c10d_functional")

_LOCK = threading.Lock()
_FINDINGS: List["Finding"] = current().cp_findings  # (the Runtime's, bound here)


@dataclass
class Finding:
    graph: str
    node: str
    kind: str  # "ulysses" | "allgather" | "ring" | "lse-attention" | "dtensor"
    target: str
    module: str = ""
    rewritable: bool = True
    reason: Optional[str] = None


@dataclass
class CPDetection:
    graph: str
    collectives: int = 0
    findings: List[Finding] = field(default_factory=list)

    @property
    def has_ring(self) -> bool:
        return any(f.kind == "ring" for f in self.findings)

    @property
    def kinds(self) -> List[str]:
        return sorted({f.kind for f in self.findings})


def target_name(target) -> str:
    """A stable lower-case name for an FX call target (aten/custom ops, Python functions, methods)."""
    if isinstance(target, str):
        return target.lower()
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target).lower()
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{mod}.{name}".lower()


def _has(name: str, keys) -> bool:
    return any(k in name for k in keys)


def is_collective(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and _has(target_name(node.target), _COLLECTIVE)


def is_lse_attention(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = target_name(node.target)
    return _has(name, _LSE_ATTENTION) and not name.endswith("backward") and "backward." not in name


def _val(x):
    if isinstance(x, fx.Node):
        return x.meta.get("example_value", x.meta.get("val"))
    return x


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def dtensor_reason(q, k, v) -> Optional[str]:
    """Fallback reason when any SDPA input (a tensor, or an FX node with an example value) is a DTensor."""
    return DTENSOR_REASON if any(_is_dtensor(_val(t)) for t in (q, k, v)) else None


def upstream_collective(x, max_depth: int = 24) -> Optional[str]:
    """The collective ('all_to_all' | 'all_gather' | 'p2p') that the tensor ``x`` was reshaped out of,
    following the first tensor input of each producer (views, permutes, casts, waits), or None."""
    n = x
    for _ in range(max_depth):
        if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
            return None
        name = target_name(n.target)
        if _has(name, _A2A):
            return "all_to_all"
        if _has(name, _GATHER):
            return "all_gather"
        if _has(name, _P2P):
            return "p2p"
        nxt = None
        for arg in n.args:
            if isinstance(arg, fx.Node):
                nxt = arg
                break
            if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], fx.Node):
                nxt = arg[0]
                break
        if nxt is None:
            for arg in n.kwargs.values():
                if isinstance(arg, fx.Node):
                    nxt = arg
                    break
        n = nxt
    return None


def _sdpa_qkv(node: fx.Node):
    names = ("query", "key", "value")
    vals = list(node.args[:3])
    for i in range(len(vals), 3):
        vals.append(node.kwargs.get(names[i]))
    return vals


def module_path(node: fx.Node) -> str:
    """The report's module label of ``node`` (``blocks.0.attn1``; see passes/names.py)."""
    from .names import compiled_root, site_label

    return site_label(node, compiled_root())


def _shape(node: fx.Node) -> str:
    q = _val(node.args[0]) if node.args else None
    return "x".join(str(s) for s in q.shape) if isinstance(q, torch.Tensor) else "?"


def _dtype(node: fx.Node) -> str:
    q = _val(node.args[0]) if node.args else None
    return str(q.dtype).replace("torch.", "") if isinstance(q, torch.Tensor) else "?"


def detect_context_parallel(gm: fx.GraphModule, cfg=None, graph_name: str = "graph") -> CPDetection:
    """Classify the attention calls of ``gm`` (and its nested GraphModules) by context-parallel pattern.

    Records every finding (``findings()``), registers ring-style attention calls as not-rewritten sites
    with :data:`RING_REASON` in ``vc_compile.report()`` and bumps ``counters["vcattn"]``:
    ``cp:<kind>`` per finding and ``fallback:ring context parallel`` per ring site. Runs once per graph:
    a second call returns the first result (so a caller and the backend may both call it).
    """
    done = getattr(gm, "meta", {}).get(META_KEY)
    if isinstance(done, CPDetection):
        return done
    det = CPDetection(graph=graph_name)
    method = cfg.resolved_method.value if cfg is not None else "?"
    graphs = [(f"{graph_name}{'.' + n if n else ''}", m) for n, m in gm.named_modules()
              if isinstance(m, fx.GraphModule)]
    det.collectives = sum(1 for _, m in graphs for n in m.graph.nodes if is_collective(n))
    ring_nodes = []
    for gname, mod in graphs:
        for node in mod.graph.nodes:
            if node.op != "call_function":
                continue
            name = target_name(node.target)
            if is_lse_attention(node):
                ring = det.collectives > 0
                f = Finding(gname, node.name, "ring" if ring else "lse-attention", name, module_path(node),
                            rewritable=False,
                            reason=RING_REASON if ring else "attention kernel called directly (not SDPA)")
                det.findings.append(f)
                if ring:
                    ring_nodes.append((f, node))
            elif _has(name, _SDPA_NAMES):
                q, k, v = _sdpa_qkv(node)
                reason = dtensor_reason(q, k, v)
                if reason is not None:
                    det.findings.append(Finding(gname, node.name, "dtensor", name, module_path(node),
                                                rewritable=False, reason=reason))
                    continue
                up_q, up_k = upstream_collective(q), upstream_collective(k)
                kind = ("ulysses" if "all_to_all" in (up_q, up_k) else
                        "allgather" if up_k == "all_gather" else
                        "kv-chunk" if up_k == "p2p" else None)
                if kind is not None:
                    det.findings.append(Finding(gname, node.name, kind, name, module_path(node)))
    for f in det.findings:
        counters["vcattn"][f"cp:{f.kind}"] += 1
    for f, node in ring_nodes:
        counters["vcattn"][RING_COUNTER] += 1
        _report.register_site(rewritten=False, reason=RING_REASON, graph=f.graph, node=f.node,
                              module=f.module, shape=_shape(node), dtype=_dtype(node), method=method)
    if ring_nodes:
        warnings.warn(f"vcattn: compiled graph '{graph_name}' runs ring-style context-parallel attention "
                      f"({len(ring_nodes)} LSE-merged attention calls); they stay stock (see "
                      f"vc_compile.report()). Use Ulysses (ulysses_degree) with the 'native' attention "
                      f"backend for vcattn under context parallelism.", UserWarning, stacklevel=2)
    with _LOCK:
        _FINDINGS.extend(det.findings)
    if hasattr(gm, "meta"):
        gm.meta[META_KEY] = det
    return det


def findings() -> List[Finding]:
    """Every finding recorded in this process (in compile order)."""
    with _LOCK:
        return list(_FINDINGS)


def clear() -> None:
    with _LOCK:
        _FINDINGS.clear()
