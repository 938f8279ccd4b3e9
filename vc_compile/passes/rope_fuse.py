"""Prologue fusion: fold the RoPE (and the permute) of q and k into ``vcattn::attention``.

Runs on the Dynamo FX graph right after :func:`~vc_compile.passes.rope_detect.detect_rope` (backend.py)
and uses its findings. For a rewritten call site whose RoPE was recognised, the op's q and k arguments
become the *un-rotated* tensors in the model's own layout (the projection/normalisation output, e.g.
[B, S, H, D] before the permute, or [B, S, C] before the head split), and the op gets the model's
``cos``/``sin`` nodes plus a spec ``rope`` (JSON: pair convention ``interleaved`` / ``rotate-half``,
layout ``BSHD`` / ``BHSD`` / ``BSC``, heads, rotated token range; see formats.py). V-Smooth's
preprocessing kernel then applies the RoPE while it loads q and k (kernels/preprocess.py), so q and k
are read once from the projection output and the rotated copies are never written.

Fused forms (docs/methods.md, "RoPE forms"): ``interleaved-setitem`` (Wan, SkyReels), ``interleaved-stack`` on the whole
token axis (LTX [B, S, C]; tests/tiny_dit.py's pair-stack form), ``rotate-half`` (Cosmos), and
``slice-write`` (CogVideoX: the in-place rotation ``q[:, :, txt:] = rope(q[:, :, txt:])`` is removed and
the op rotates tokens ``txt:`` itself). Not fused, each with a counted reason:

* a rotated token slice joined to an unrotated part by ``cat`` (HunyuanVideo, Mochi): ``token slice
  joined by cat`` (the op could take it: fusing needs the cat's parts proven to be slices of one tensor;
  HunyuanVideo's attention is masked, so stock SDPA, anyway);
* a site whose method is not V-Smooth (the other kernels have no RoPE prologue): ``method <m>``;
* the option ``rope_fusion=False``: ``disabled``; an unrecognised producer: ``unrecognised form``;
* and whatever a check below refuses.

Checks before a site is fused (else the graph stays as it was, and ``rope_unfused:<reason>`` counts):
the form and layout are known; q and k rotate with the same tables (the same nodes, or the same
computation on the same inputs: Wan slices ``freqs_cos[..., 0::2]`` once per call) and token range;
the un-rotated inputs have q/k's dtype (bf16/fp16) and, viewed as [B, H, S, D], exactly q/k's shape;
cos/sin are floating tensors that broadcast the way the kernel reads them (the op's own normalisation,
``formats.rope_args``, is run on the fake values); every node of the RoPE subgraph (from q/k back
to the un-rotated input and the tables, plus the ``setitem`` writes into it) is used only inside that
subgraph or by this attention (or only for its dtype, ``y.type_as(q)``: Wan and Cosmos cast the attention
output that way; such a use is pointed at the un-rotated q, which has the same dtype), has no side effect
other than those writes, and is not a graph input.
For ``slice-write``, the written tensor must be q/k itself (not a view of something else) and nothing
else may read it after the write.

Rewrite: the op node keeps its name and ``meta`` (stack trace, module stack); its ``example_value``/``val``
is recomputed by the fake impl on the new inputs (same shape/dtype as before). The RoPE subgraph is
erased (its ``setitem`` writes too, which plain DCE would keep), then what that erasure orphaned
(e.g. k's copy of the table slice) if it is side-effect free; nothing else is touched, so a graph with
nothing to fuse comes out identical.

Counters: ``rope_fused``, ``rope_fused:<form>`` (form as detected), ``rope_unfused:<reason>``; the site's
report record gets ``SiteRecord.rope_fusion`` = ``"fused"`` / ``"unfused: <reason>"``.

Cache keys: the pass runs before Inductor, whose FX graph / AOTAutograd caches hash the graph it produces,
including the op's ``rope`` spec and config JSON (which holds ``rope_fusion``). :func:`uuid` hashes this
file, rope_detect.py, fx_nodes.py and formats.py (the RoPE conventions) plus the options that steer the decision, and is written into
every fused op's spec (``"pass"``), so a change of the pass's sources also changes the cached graphs' keys.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import operator
from typing import Dict, List, Optional, Set

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from .. import formats, methods
from ..config import VCConfig
from ..runtime import report as _report
from . import fx_nodes as _fx
from . import rope_detect as _det
from .fx_nodes import LAYOUT_OPS, is_op, val
from .rope_detect import RopeFinding, RopeMatch

_PAIRING = {"interleaved-setitem": "interleaved", "interleaved-stack": "interleaved", "rotate-half": "rotate-half"}
_MAX_REGION = 96
_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _sources_hash() -> str:
    h = hashlib.sha256()
    for mod in (_det, _fx, formats):
        h.update(inspect.getsource(mod).encode())
    h.update(open(__file__, "rb").read())
    return h.hexdigest()


def uuid(cfg: VCConfig) -> str:
    """Hash of this pass's sources and of the options that decide what it does."""
    opts = f"rope_fusion={cfg.rope_fusion};method={cfg.resolved_method.value}"
    return hashlib.sha256((_sources_hash() + opts).encode()).hexdigest()[:16]


class _NoFuse(Exception):
    """``key``: the counted reason (stable, no node names); ``detail``: what the report record adds."""

    def __init__(self, key: str, detail: str = ""):
        super().__init__(key)
        self.key, self.detail = key, detail


def _val(n):
    return val(n)


def _same_table(a, b, depth: int = 0) -> bool:
    """The same table node, or the same side-effect-free computation on the same inputs."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or depth > 4:
        return False
    if a.op != b.op or a.target != b.target or a.op not in ("call_function", "call_method"):
        return False
    if len(a.args) != len(b.args) or a.kwargs != b.kwargs or a.is_impure():
        return False
    for x, y in zip(a.args, b.args):
        if isinstance(x, fx.Node) or isinstance(y, fx.Node):
            if not _same_table(x, y, depth + 1):
                return False
        elif x != y:
            return False
    return True


def _writes_into(n: fx.Node) -> List[fx.Node]:
    return [u for u in n.users if u.op == "call_function" and u.target is operator.setitem and u.args[0] is n]


def _region(seeds: List[fx.Node], boundary: Set[fx.Node]) -> Set[fx.Node]:
    """The RoPE subgraph: seeds and everything they are computed from, down to ``boundary``, plus the
    ``setitem`` writes into any of its nodes."""
    region: Set[fx.Node] = set()
    stack = list(seeds)
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in region or n in boundary:
            continue
        if n.op not in ("call_function", "call_method"):
            raise _NoFuse("the RoPE subgraph reaches a graph input", f"{n.op} {n.name}")
        if n.is_impure() and n.target is not operator.setitem:
            raise _NoFuse("the RoPE subgraph holds a side effect", n.name)
        region.add(n)
        if len(region) > _MAX_REGION:
            raise _NoFuse("the RoPE subgraph is too large")
        stack.extend(n.all_input_nodes)
        stack.extend(_writes_into(n))
    return region


def _spec(m: RopeMatch, heads: int) -> formats.RopeSpec:
    form = m.form
    if form == "slice-write":
        form = m.q.inner
    pairing = _PAIRING.get(form)
    if pairing is None:
        raise _NoFuse("form has no kernel prologue", f"{m.form} {m.q.inner or ''}".strip())
    if m.layout not in formats.ROPE_LAYOUTS:
        raise _NoFuse("layout unsupported", str(m.layout))
    start = stop = None
    if m.q.token_slice != m.k.token_slice:
        raise _NoFuse("q and k rotate different token ranges")
    if m.q.token_slice is not None:
        if m.form != "slice-write":
            raise _NoFuse("token slice joined by cat")
        start, stop = m.q.token_slice
        if not all(x is None or type(x) is int for x in (start, stop)):
            raise _NoFuse("symbolic token slice bounds")
    return formats.RopeSpec(pairing, m.layout, heads, start, stop)


def _check_inputs(att: fx.Node, m: RopeMatch, spec: formats.RopeSpec):
    qa, ka = _val(att.args[0]), _val(att.args[1])
    if not (isinstance(qa, torch.Tensor) and isinstance(ka, torch.Tensor)):
        raise _NoFuse("no fake values for q/k")
    for name, op, ref in (("q", m.q, qa), ("k", m.k, ka)):
        x = _val(op.input)
        if not isinstance(x, torch.Tensor) or x.dtype != ref.dtype or x.dtype not in _DTYPES:
            raise _NoFuse("the un-rotated q/k dtype differs or is not bf16/fp16", name)
        try:
            xb = formats.to_bhsd(x, spec)
            ok = tuple(xb.shape) == tuple(ref.shape)
            if ok:
                formats.rope_args(_val(op.cos), _val(op.sin), spec, tuple(xb.shape))
        except Exception as e:  # noqa: BLE001 - any failure means: do not fuse
            raise _NoFuse("cos/sin do not broadcast as the kernel reads them", str(e)[:120]) from None
        if not ok:
            raise _NoFuse("the un-rotated q/k does not view as the attention input", f"{name} {tuple(ref.shape)}")
    if qa.shape != ka.shape:
        raise _NoFuse("q and k differ in shape")


def _fake(att: fx.Node):
    args = [_val(a) if isinstance(a, fx.Node) else a for a in att.args]
    kwargs = {k: _val(a) if isinstance(a, fx.Node) else a for k, a in att.kwargs.items()}
    fake = next((x for x in args if isinstance(x, torch.Tensor)), None)
    mode = getattr(fake, "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return att.target(*args, **kwargs)


def _fuse_site(graph: fx.Graph, att: fx.Node, m: RopeMatch, cfg: VCConfig) -> None:
    if att.kwargs.get("key_mask") is not None:
        raise _NoFuse("key-padding mask (the op slices q and k: RoPE applied before it)")
    if len(att.args) != 7 or att.kwargs:
        raise _NoFuse("the op call is not the rewrite's")
    qa = _val(att.args[0])
    spec = _spec(m, qa.shape[1] if isinstance(qa, torch.Tensor) else 0)
    if not (_same_table(m.q.cos, m.k.cos) and _same_table(m.q.sin, m.k.sin)):
        raise _NoFuse("q and k rotate with different tables")
    _check_inputs(att, m, spec)
    order = {n: i for i, n in enumerate(graph.nodes)}
    regions: Set[fx.Node] = set()
    for arg, op in ((att.args[0], m.q), (att.args[1], m.k)):
        boundary = {op.input, op.cos, op.sin}
        if m.form == "slice-write":
            if arg is not op.input:
                raise _NoFuse("slice-write behind layout ops")
            if is_op(op.input, *LAYOUT_OPS) or op.input.op == "placeholder":
                raise _NoFuse("slice-write into a view or a graph input")
            writes = _writes_into(op.input)
            if len(writes) != 1 or order[writes[0]] > order[att]:
                raise _NoFuse("slice-write: not exactly one write before the attention")
            reg = _region(writes, boundary)
            after = [u for u in op.input.users if u not in reg and u is not att and order[u] > order[writes[0]]]
            if after:
                raise _NoFuse("slice-write: q/k is read after the in-place rotation", after[0].name)
        else:
            reg = _region([arg], boundary)
        regions |= reg
    dtype_uses = []  # ``y.type_as(q_rotated)`` (Wan, Cosmos: the output cast to q's dtype): dtype only
    qdt = _val(m.q.input).dtype
    for n in regions:
        for u in n.users:
            if u in regions or u is att:
                continue
            nv = _val(n)
            if (is_op(u, "type_as") and len(u.args) == 2 and u.args[1] is n and u.args[0] is not n
                    and not u.kwargs and isinstance(nv, torch.Tensor) and nv.dtype == qdt):
                dtype_uses.append(u)
                continue
            raise _NoFuse("a RoPE intermediate has other users", f"{n.name} used by {u.name}")
    if any(x in regions for x in (m.q.input, m.k.input, m.q.cos, m.q.sin)):
        raise _NoFuse("the un-rotated input is part of the other operand's RoPE")
    # ---- rewrite (nothing above changed the graph)
    old_args, old_kwargs = att.args, att.kwargs
    att.args = (m.q.input, m.k.input, *att.args[2:])
    att.kwargs = {"cos": m.q.cos, "sin": m.q.sin, "rope": spec.to_json(uuid(cfg))}
    try:
        fake = _fake(att)
    except Exception as e:  # noqa: BLE001
        fake, err = None, e
    else:
        err = None
    old = att.meta.get("example_value", att.meta.get("val"))
    if fake is None or (isinstance(old, torch.Tensor) and (fake.shape != old.shape or fake.dtype != old.dtype)):
        att.args, att.kwargs = old_args, old_kwargs
        raise _NoFuse("the fused op's fake value does not match", type(err).__name__ if err else "shape")
    for key in ("example_value", "val"):
        if key in att.meta:
            att.meta[key] = fake
    for u in dtype_uses:  # same dtype, defined before every RoPE node, so before u
        u.args = (u.args[0], m.q.input)
    orphans: Set[fx.Node] = set()
    for n in sorted(regions, key=order.__getitem__, reverse=True):
        orphans.update(a for a in n.all_input_nodes if a not in regions)
        graph.erase_node(n)
    # what the erasure orphaned (k's copy of the table slice, ...): side-effect-free nodes only
    work = list(orphans)
    while work:
        n = work.pop()
        if n.graph is not graph or n.users or n.op not in ("call_function", "call_method") or n.is_impure():
            continue
        ins = n.all_input_nodes
        graph.erase_node(n)
        work.extend(ins)


def _set(site: Optional[int], value: str) -> None:
    if site is None:
        return
    rec = _report.site(site)
    if rec is not None:
        rec.rope_fusion = value


def fuse_rope(gm: fx.GraphModule, findings: List[RopeFinding], cfg: VCConfig, graph_name: str = "graph") -> dict:
    """Fuse the RoPE of every recognised, rewritten site of ``gm`` (and its nested graphs) into its op.
    Returns {'fused': n, 'unfused': m}."""
    stats = {"fused": 0, "unfused": 0}
    mods: Dict[str, fx.GraphModule] = {}
    for mod_name, mod in gm.named_modules():
        if isinstance(mod, fx.GraphModule):
            mods[f"{graph_name}{'.' + mod_name if mod_name else ''}"] = mod
    vc_target = torch.ops.vcattn.attention.default
    changed = set()
    for f in findings:
        if f.form == "none":
            continue
        mod = mods.get(f.graph)
        node = next((n for n in mod.graph.nodes if n.name == f.node), None) if mod is not None else None
        detail = ""
        if node is None or node.target is not vc_target:
            reason = "stock sdpa"  # not rewritten (masked, ...): nothing to fuse into
        elif not isinstance(f.result, RopeMatch):
            reason = "unrecognised form"
        elif not cfg.rope_fusion:
            reason = "disabled"
        elif not methods.get(cfg.resolved_method).FUSES_ROPE:
            reason = f"method {cfg.resolved_method.value}"
        else:
            try:
                _fuse_site(mod.graph, node, f.result, cfg)
                reason = None
            except _NoFuse as e:
                reason, detail = e.key, e.detail
            except Exception as e:  # noqa: BLE001 - a fusion must never break compilation
                reason = f"fusion failed: {type(e).__name__}"
        if reason is None:
            counters["vcattn"]["rope_fused"] += 1
            counters["vcattn"][f"rope_fused:{f.form}"] += 1
            _set(f.site, "fused")
            stats["fused"] += 1
            changed.add(mod)
        else:
            counters["vcattn"][f"rope_unfused:{reason}"] += 1
            _set(f.site, f"unfused: {reason}" + (f" ({detail})" if detail else ""))
            stats["unfused"] += 1
    for mod in changed:
        mod.graph.lint()
        mod.recompile()
    return stats
