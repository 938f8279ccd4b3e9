"""Recognise the RoPE producer of q and k at every attention call site (step 1: analysis only).

It runs right after :func:`~vc_compile.passes.sdpa_rewrite.rewrite_sdpa` (backend.py), on each
``vcattn::attention`` node and on each stock ``scaled_dot_product_attention`` node the rewrite left:
after, because the op carries its site id (``args[4]``), so a finding lands on exactly that site's report
record, and because step 2 will transform the rewritten op's inputs; on stock SDPA too, because masked
calls (all of HunyuanVideo's, LTX's cross-attention) stay stock today, and their RoPE form is what a
masked method would need to know. Their records are found by (graph, node name). The pass walks back
from q and from k through layout nodes (``permute``, ``transpose``, ``unflatten``, ``view``, ``reshape``, ``type_as``,
``to``, ``float``, ``contiguous``, ``getitem``) and matches the producer against the forms of docs/methods.md, "RoPE forms":

* ``interleaved-setitem`` (Wan, SkyReels): ``x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)``;
  ``out = empty_like(x)``; ``out[..., 0::2] = x1*cos - x2*sin``; ``out[..., 1::2] = x1*sin + x2*cos``
  (``operator.setitem`` in the Dynamo graph), ``out.type_as(x)``.
* ``interleaved-stack`` (HunyuanVideo, LTX, the rotation inside CogVideoX's slice write):
  ``x*cos + stack([-x_imag, x_real], -1).flatten(...)*sin`` with ``x_real, x_imag`` the unbound pairs of
  ``x``; also the variant ``stack([x1*c - x2*s, x1*s + x2*c], -1).flatten(-2)`` (tests/tiny_dit.py).
* ``slice-write`` (CogVideoX): ``q[:, :, txt:] = rope(q[:, :, txt:])`` in place on [B, H, S, D], after
  the transpose; the written value must itself be one of the rotations above.
* ``rotate-half`` (Cosmos): ``x*cos + cat([-x2, x1], -1)*sin`` with ``x1, x2`` the two halves of ``x``
  (``getitem`` slices, ``chunk(2, -1)`` or ``reshape(..., 2, -1).unbind(-2)``).

and where it sits: ``layout`` is ``"BSC"`` (applied on [B, S, C] before the head split: LTX),
``"BSHD"`` (on [B, S, H, D] before the permute: Wan, HunyuanVideo, tiny_dit) or ``"BHSD"`` (after the
permute: CogVideoX, Cosmos). A rotated token slice followed by a ``cat`` with an unrotated part
(HunyuanVideo: video tokens rotated, text tail not; Mochi: per-sample cat after the transpose) gives
``token_slice = (start, stop)`` of the rotated tokens along the attention's token axis S; the CogVideoX
slice write gives the written slice. A cat or in-place write along another axis is not accepted.

q and k without any rotation (cross-attention, HunyuanVideo's token refiner) give ``form == "none"``:
their producer is a projection or a normalisation. Anything else is *unrecognised*, with a reason.

Per call site one counter is bumped: ``counters["vcattn"]["rope:<form>"]`` (``rope:none`` included)
or ``counters["vcattn"]["rope:unrecognised"]``, and the call site's report record gets
``SiteRecord.rope`` (e.g. ``"interleaved-setitem BSHD"``, ``"none"``, ``"unrecognised: <reason>"``).

Invariants (passes/README.md): this pass changes no graph at all (tests compare the code before and
after), so it needs no ``uuid()`` source hash and adds nothing to any cache key: the graph that Inductor
and its caches see is exactly the one :func:`rewrite_sdpa` produced. Its only side effects are the
diagnostics (counters, report records).

Step 2 (folding RoPE + permute into the preprocessing kernel) would need, from each ``RopeMatch``:
* the un-rotated ``input`` node of q and k (the projection output, [B, S, C] or [B, S, H, D]) to become
  the op's q/k arguments instead of the permuted, rotated tensors, so the kernel reads q/k once from the
  projection output and applies the permute by strides;
* ``cos``/``sin`` as extra op inputs (their producers are the model's frequency tables; broadcasting
  shapes differ: Wan [1, S, 1, D/2] even/odd-sliced, HunyuanVideo/LTX [S, D] / [B, S, C] repeat-interleaved,
  CogVideoX [S_video, D]), with the pairing convention (``interleaved`` pairs (2i, 2i+1) vs
  ``rotate-half`` pairs (i, i + D/2)) as a static kernel parameter;
* ``token_slice`` bounds as inputs (rotate only [start, stop) of the token axis; the text tail passes
  through), and for LTX the head split (rotation over C, not D);
* the fp32 compute of the models (HunyuanVideo/LTX/CogVideoX rotate in fp32 and round once to bf16; Wan
  rounds each half separately) reproduced exactly, or the change accepted and measured;
* erasing the matched RoPE subgraph only when nothing else uses its nodes (the k rotation of a
  shared-KV graph, the in-place CogVideoX write whose target is also read elsewhere), a fake impl for
  the new op signature, and then a ``uuid()``/cache-key story since the pass would transform the graph.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ..runtime import report as _report
from .fx_nodes import DTYPE_OPS, LAYOUT_OPS, MAX_WALK, arg, is_op, ndim, node_name, strip, val  # noqa: F401
from .sdpa_rewrite import SDPA_TARGETS

ATTENTION_TARGETS = set(SDPA_TARGETS)
try:
    ATTENTION_TARGETS.add(torch.ops.vcattn.attention.default)
except (AttributeError, RuntimeError):  # pragma: no cover - ops registers it on import of sdpa_rewrite
    pass

FORMS = ("interleaved-setitem", "interleaved-stack", "slice-write", "rotate-half")
_PROJ_OPS = {"linear", "layer_norm", "rms_norm", "group_norm", "addmm", "matmul", "bmm", "conv2d"}
_NORM_WALK = {"mul", "to", "float", "type_as", "add", "rsqrt", "pow", "mean"}

Slice = Tuple[Optional[int], Optional[int]]


@dataclass
class RopeOperand:
    """What rotates one of q / k."""
    input: fx.Node                      # the un-rotated tensor (what step 2 would read)
    cos: fx.Node
    sin: fx.Node
    token_slice: Optional[Slice] = None  # (start, stop) of the rotated tokens along S, None = all
    inner: Optional[str] = None          # slice-write: the rotation inside the write


@dataclass
class RopeMatch:
    """The RoPE found at one call site; ``form == "none"`` means q and k are not rotated."""
    form: str
    layout: Optional[str] = None        # "BSC" before the head split, "BSHD" before the permute, "BHSD" after
    q: Optional[RopeOperand] = None
    k: Optional[RopeOperand] = None

    def describe(self) -> str:
        if self.form == "none":
            return "none"
        s = f"{self.form} {self.layout}"
        if self.q is not None and self.q.inner:
            s += f" ({self.q.inner})"
        if self.q is not None and self.q.token_slice is not None:
            a, b = self.q.token_slice
            s += f" tokens {'' if a is None else a}:{'' if b is None else b}"
        return s


@dataclass
class RopeFinding:
    graph: str
    node: str
    site: Optional[int]
    result: Union[RopeMatch, str]       # a RopeMatch, or the reason the producer is not recognised

    @property
    def form(self) -> str:
        return self.result.form if isinstance(self.result, RopeMatch) else "unrecognised"


class _NoMatch(Exception):
    pass


def _dim_is_last(n: fx.Node, d) -> bool:
    nd = ndim(n)
    return d == -1 or (nd is not None and d == nd - 1)


def _unbound(n) -> Optional[Tuple[fx.Node, int]]:
    """``n = unbind(u, dim)[i]`` (or ``chunk``): returns (u's source x, i) for the pairs split."""
    n = strip(n)
    if not (is_op(n, "getitem") and isinstance(n.args[1], int)):
        return None
    src = n.args[0]
    if not is_op(src, "unbind"):
        return None
    return src, n.args[1]


def _pairs_of(n) -> Optional[Tuple[fx.Node, int]]:
    """``n = x.unflatten(-1, (-1, 2)).unbind(-1)[i]`` / ``x.reshape(..., -1, 2).unbind(-1)[i]`` /
    ``x[..., i::2]`` (Mochi): returns (x, i)."""
    s = strip(n)
    if is_op(s, "getitem") and isinstance(s.args[1], tuple) and len(s.args[1]) == 2 and s.args[1][0] is Ellipsis:
        sl = s.args[1][1]
        if isinstance(sl, slice) and sl.step == 2 and (sl.start or 0) in (0, 1) and sl.stop is None:
            return s.args[0], sl.start or 0
    ub = _unbound(n)
    if ub is None:
        return None
    unb, i = ub
    d = arg(unb, 1, "dim", 0)
    u = unb.args[0]
    if not (is_op(u, "unflatten", "reshape", "view") and _dim_is_last(u, d)):
        return None
    v = val(u)
    if not isinstance(v, torch.Tensor) or v.shape[-1] != 2:
        return None
    return u.args[0], i


def _mul_terms(n) -> Optional[Tuple[object, object]]:
    n = strip(n)
    if is_op(n, "mul") and len(n.args) == 2:
        return n.args[0], n.args[1]
    return None


def _same(a, b) -> bool:
    return strip(a) is strip(b)


# ---- rotation matchers -----------------------------------------------------------------------------------
def _pair_rotation(e0, e1) -> Tuple[fx.Node, fx.Node, fx.Node]:
    """``e0 = x1*cos - x2*sin``, ``e1 = x1*sin + x2*cos`` with (x1, x2) the interleaved pairs of x."""
    e0, e1 = strip(e0), strip(e1)
    if not (is_op(e0, "sub") and is_op(e1, "add")):
        raise _NoMatch("the two halves are not (x1*cos - x2*sin, x1*sin + x2*cos)")

    def split(term):  # x1*c -> candidates (pair index, x, c); a strided cos table can look like a pair too
        t = _mul_terms(term)
        if t is None:
            raise _NoMatch("a rotation term is not a product")
        out = [(p[1], p[0], b) for a, b in (t, t[::-1]) for p in [_pairs_of(a)] if p is not None]
        if not out:
            raise _NoMatch("a rotation term does not multiply an interleaved pair of x")
        return out

    cands = [split(e0.args[0]), split(e0.args[1]), split(e1.args[0]), split(e1.args[1])]
    reason = "the pairs are not combined as a rotation"
    for (i0, x0, c), (i1, x1, s), (j0, y0, s2), (j1, y1, c2) in itertools.product(*cands):
        if not (i0 == 0 and i1 == 1 and j0 == 0 and j1 == 1):
            continue
        if not (x0 is x1 is y0 is y1):
            reason = "the pairs come from different tensors"
            continue
        if not (_same(c, c2) and _same(s, s2)) or _same(c, s):
            reason = "cos/sin factors are not consistent"
            continue
        return x0, c, s
    raise _NoMatch(reason)


def _rotated_term(r, x_expected=None) -> Tuple[str, fx.Node]:
    """The rotated copy of x in ``x*cos + rot(x)*sin``: returns (form, x)."""
    r = strip(r)
    if is_op(r, "flatten") and is_op(r.args[0], "stack"):
        st = r.args[0]
        parts, d = arg(st, 0, "tensors"), arg(st, 1, "dim", 0)
        if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and _dim_is_last(st, d)):
            raise _NoMatch("stack is not of two tensors on the last dim")
        neg, real = strip(parts[0]), parts[1]
        if not is_op(neg, "neg"):
            raise _NoMatch("stack is not [-x_imag, x_real]")
        pi, pr = _pairs_of(neg.args[0]), _pairs_of(real)
        if pi is None or pr is None or pi[1] != 1 or pr[1] != 0 or pi[0] is not pr[0]:
            raise _NoMatch("stack is not [-x_imag, x_real] of the interleaved pairs of one tensor")
        return "interleaved-stack", pi[0]
    if is_op(r, "cat"):
        parts, d = arg(r, 0, "tensors"), arg(r, 1, "dim", 0)
        if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and _dim_is_last(r, d)):
            raise _NoMatch("cat is not of two halves on the last dim")
        neg, first = strip(parts[0]), parts[1]
        if not is_op(neg, "neg"):
            raise _NoMatch("cat is not rotate-half [-x2, x1]")
        h2, h1 = _half_of(neg.args[0]), _half_of(first)
        if h1 is None or h2 is None or h1[1] != 0 or h2[1] != 1 or h1[0] is not h2[0]:
            raise _NoMatch("cat is not rotate-half [-x2, x1] of the two halves of one tensor")
        return "rotate-half", h1[0]
    raise _NoMatch(f"{node_name(r)} is not a rotated copy of x")


def _half_of(n) -> Optional[Tuple[fx.Node, int]]:
    """n = x[..., :D/2] / x[..., D/2:] / x.chunk(2, -1)[i] / x.reshape(..., 2, -1).unbind(-2)[i]."""
    n = strip(n)
    if not is_op(n, "getitem"):
        return None
    src, idx = n.args[0], n.args[1]
    if isinstance(idx, int):
        if is_op(src, "chunk") and arg(src, 1, "chunks") == 2 and _dim_is_last(src.args[0], arg(src, 2, "dim", 0)):
            return src.args[0], idx
        if is_op(src, "unbind"):
            u = src.args[0]
            v = val(u)
            d = arg(src, 1, "dim", 0)
            if (is_op(u, "reshape", "view", "unflatten") and isinstance(v, torch.Tensor) and v.dim() >= 2
                    and v.shape[-2] == 2 and d in (-2, v.dim() - 2)):
                return u.args[0], idx
        return None
    if isinstance(idx, tuple) and idx and isinstance(idx[-1], slice) and isinstance(src, fx.Node):
        if not all(i is Ellipsis or i == slice(None) for i in idx[:-1]):
            return None
        v = val(src)
        if not isinstance(v, torch.Tensor) or (idx[0] is not Ellipsis and len(idx) != v.dim()):
            return None
        D, sl = v.shape[-1], idx[-1]
        if sl.step not in (None, 1) or not isinstance(D, int):
            return None
        if sl.start in (None, 0) and sl.stop == D // 2:
            return src, 0
        if sl.start in (D // 2, -(D // 2)) and sl.stop is None:
            return src, 1
    return None


def _add_rotation(n) -> Tuple[str, fx.Node, fx.Node, fx.Node]:
    """``x*cos + rot(x)*sin``: returns (form, x, cos, sin)."""
    n = strip(n)
    if not (is_op(n, "add") and len(n.args) == 2):
        raise _NoMatch(f"{node_name(n)} is not x*cos + rot(x)*sin")
    ta, tb = _mul_terms(n.args[0]), _mul_terms(n.args[1])
    if ta is None or tb is None:
        raise _NoMatch("add of terms that are not products (not x*cos + rot(x)*sin)")
    errors = []
    for plain, rot in ((ta, tb), (tb, ta)):
        for r, sin in (rot, rot[::-1]):
            try:
                form, x = _rotated_term(r)
            except _NoMatch as e:
                # a cat/stack that is almost a rotation says more than "a cos table is not a rotation"
                errors.append((is_op(strip(r), "cat", "flatten"), str(e)))
                continue
            for xx, cos in (plain, plain[::-1]):
                if _same(xx, x):
                    return form, strip(x), cos, sin
            errors.append((True, "the unrotated term is not the same tensor as the rotated one"))
    errors.sort(key=lambda e: not e[0])
    raise _NoMatch(errors[0][1] if errors else "not x*cos + rot(x)*sin")


# ---- one operand (q or k) --------------------------------------------------------------------------------
@dataclass
class _Op:
    form: str                            # a FORM or "none"
    layout: Optional[str] = None
    operand: Optional[RopeOperand] = None


def _is_norm(n) -> bool:
    """A projection/normalisation output: linear, layer_norm, rms_norm, or a hand-written RMSNorm
    (``x * rsqrt(mean(x^2) + eps)``, times a weight)."""
    if is_op(n, *_PROJ_OPS):
        return True
    if not is_op(n, "mul"):
        return False
    seen, frontier = set(), [n]
    for _ in range(6):
        nxt = []
        for m in frontier:
            if not isinstance(m, fx.Node) or m in seen:
                continue
            seen.add(m)
            if is_op(m, "rsqrt", "rms_norm", "layer_norm"):
                return True
            if is_op(m, *_NORM_WALK):
                nxt.extend(a for a in m.args if isinstance(a, fx.Node))
        frontier = nxt
    return False


def _layout(x: fx.Node, perm: Optional[List[int]]) -> str:
    """``perm[i]``: the dim of x that holds dim i of the [B, H, S, D] attention input."""
    if ndim(x) == 3:
        return "BSC"
    if perm == [0, 1, 2, 3]:
        return "BHSD"
    if perm == [0, 2, 1, 3]:
        return "BSHD"
    return "other"


def _track(n: fx.Node, perm: Optional[List[int]]) -> Optional[List[int]]:
    """Carry the attention-dim mapping back through one layout node (None once a reshape loses it)."""
    if perm is None:
        return None
    nd = ndim(n.args[0])
    if is_op(n, "permute"):
        p = list(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else list(n.args[1:])
        p = p or list(n.kwargs.get("dims", ()))
        if nd is None or not all(isinstance(d, int) for d in p) or len(p) != nd:
            return None
        p = [d % nd for d in p]
        return [p[c] for c in perm]
    if is_op(n, "transpose"):
        a, b = n.args[1], n.args[2]
        if nd is None or not isinstance(a, int) or not isinstance(b, int):
            return None
        a, b = a % nd, b % nd
        return [b if c == a else a if c == b else c for c in perm]
    if is_op(n, *DTYPE_OPS, "repeat_interleave"):
        return perm
    if is_op(n, "getitem") and ndim(n) == nd:
        return perm
    return None


def _slice_of(idx) -> Optional[Tuple[int, Optional[int], Optional[int]]]:
    """(dim, start, stop) of the one non-trivial slice in a getitem/setitem index."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    found = None
    for d, i in enumerate(idx):
        if i is Ellipsis:
            return found
        if isinstance(i, slice) and i != slice(None):
            if found is not None or i.step not in (None, 1):
                return None
            found = (d, i.start, i.stop)
        elif not isinstance(i, slice):
            return None
    return found


def _analyse(x, order: Dict[fx.Node, int], limit: int, depth: int = 0,
             perm: Optional[List[int]] = None) -> _Op:
    """Walk back from an attention input ``x`` to its producer and match it (``perm``: see :func:`_layout`;
    None at the attention input itself)."""
    if perm is None and depth == 0:
        perm = [0, 1, 2, 3]
    n = x
    for _ in range(MAX_WALK):
        if not isinstance(n, fx.Node):
            raise _NoMatch("q/k is not a graph value")
        writes = [u for u in n.users if is_op(u, "setitem") and u.args[0] is n and order.get(u, limit) < limit]
        if writes:
            return _in_place(n, writes, perm)
        if is_op(n, *LAYOUT_OPS) and n.args and isinstance(n.args[0], fx.Node):
            if is_op(n, "getitem") and is_op(n.args[0], "unbind", "chunk", "split") and _pairs_or_half(n):
                break  # a rotation's own pair/half split is not a layout step
            perm = _track(n, perm)
            n = n.args[0]
            continue
        break
    if n.op == "placeholder":
        raise _NoMatch("q/k is a graph input (a RoPE, if any, ran outside the compiled graph)")
    if _is_norm(n):
        return _Op("none")
    if is_op(n, "cat"):
        return _token_cat(n, order, limit, perm, depth)
    if is_op(n, "add"):
        form, src, cos, sin = _add_rotation(n)
        return _Op(form, _layout(src, perm), RopeOperand(src, cos, sin))
    if is_op(n, "flatten") and is_op(n.args[0], "stack"):
        st = n.args[0]
        parts = arg(st, 0, "tensors")
        if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and _dim_is_last(st, arg(st, 1, "dim", 0))):
            raise _NoMatch("stack/flatten of other than two tensors on the last dim")
        try:
            src, cos, sin = _pair_rotation(parts[0], parts[1])
        except _NoMatch as e:
            raise _NoMatch(f"stack/flatten: {e}") from None
        return _Op("interleaved-stack", _layout(src, perm), RopeOperand(src, cos, sin))
    if is_op(n, "mul"):
        raise _NoMatch("an elementwise multiply that is neither a normalisation nor x*cos + rot(x)*sin")
    raise _NoMatch(f"producer {node_name(n)!r} is not a RoPE form")


def _pairs_or_half(n) -> bool:
    return _pairs_of(n) is not None or _half_of(n) is not None


def _in_place(n: fx.Node, writes: List[fx.Node], perm: Optional[List[int]]) -> _Op:
    if is_op(n, "empty_like"):  # Wan: out = empty_like(x); out[..., 0::2] = ...; out[..., 1::2] = ...
        by_idx = {}
        for w in writes:
            idx = w.args[1]
            idx = idx if isinstance(idx, tuple) else (idx,)
            if not (len(idx) == 2 and idx[0] is Ellipsis and isinstance(idx[1], slice) and idx[1].step == 2):
                raise _NoMatch("writes into empty_like are not the even/odd interleaved halves")
            by_idx[idx[1].start or 0] = w.args[2]
        if set(by_idx) != {0, 1} or len(writes) != 2:
            raise _NoMatch("writes into empty_like are not exactly out[..., 0::2] and out[..., 1::2]")
        src, cos, sin = _pair_rotation(by_idx[0], by_idx[1])
        if not _same(src, n.args[0]):
            raise _NoMatch("the rotated pairs are not of the tensor empty_like copies")
        return _Op("interleaved-setitem", _layout(src, perm), RopeOperand(strip(src), cos, sin))
    if len(writes) != 1:
        raise _NoMatch(f"{len(writes)} in-place writes into q/k")
    (w,) = writes
    idx, value = w.args[1], w.args[2]
    inner, src, cos, sin = _add_rotation(value)
    src = strip(src)
    if not (is_op(src, "getitem") and src.args[0] is n and src.args[1] == idx):
        raise _NoMatch("an in-place write into q/k that is not the rotation of the slice it overwrites")
    sl = _slice_of(idx)
    if sl is None or (perm is not None and sl[0] != perm[2]):
        raise _NoMatch(f"an in-place rotation of {idx!r}, which is not a token slice")
    return _Op("slice-write", _layout(n, perm), RopeOperand(n, cos, sin, sl[1:], inner=inner))


def _token_cat(n: fx.Node, order, limit, perm: Optional[List[int]], depth: int) -> _Op:
    parts, d = arg(n, 0, "tensors"), arg(n, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or depth > 2:
        raise _NoMatch("cat of unknown parts")
    if _dim_is_last(n, d):
        raise _NoMatch("cat along the channel dim that is not rotate-half")
    nd = ndim(n)
    d = d % nd if nd else d
    if perm is not None and d != perm[2]:
        raise _NoMatch(f"cat along dim {d}, which is not the token axis")
    found, start = [], 0
    for p in parts:
        op = _analyse(p, order, limit, depth + 1, perm)
        v = val(p)
        size = v.shape[d] if isinstance(v, torch.Tensor) else None
        stop = start + size if isinstance(size, int) and isinstance(start, int) else None
        if op.form != "none":
            found.append((op, (start, stop)))
        start = stop
    if not found:
        return _Op("none")
    if len(found) > 1:
        raise _NoMatch("cat of more than one rotated part")
    op, sl = found[0]
    if op.operand.token_slice is None:
        op.operand.token_slice = sl
    return op


# ---- call sites ------------------------------------------------------------------------------------------
def _site_result(q, k, order, limit) -> Union[RopeMatch, str]:
    ops = []
    for name, x in (("q", q), ("k", k)):
        try:
            ops.append(_analyse(x, order, limit))
        except _NoMatch as e:
            return f"{name}: {e}"
    oq, ok = ops
    if oq.form != ok.form or oq.layout != ok.layout:
        fmt = lambda o: o.form + (f" {o.layout}" if o.layout else "")  # noqa: E731
        return f"q and k differ (q: {fmt(oq)}, k: {fmt(ok)})"
    if oq.form == "none":
        return RopeMatch("none")
    return RopeMatch(oq.form, oq.layout, oq.operand, ok.operand)


def _record(graph: str, node: fx.Node, site: Optional[int]):
    if site is not None:
        return _report.site(site)
    return _report.find_site(graph, node.name)


def detect_rope(gm: fx.GraphModule, graph_name: str = "graph") -> List[RopeFinding]:
    """Find the RoPE producer of q and k at every attention node of ``gm`` (and its nested graphs).

    Changes no graph. Bumps ``counters["vcattn"]["rope:<form>"]`` / ``["rope:unrecognised"]`` once per
    call site and sets ``SiteRecord.rope`` on the site's report record when it has one.
    """
    findings = []
    vc_op = getattr(getattr(torch.ops, "vcattn", None), "attention", None)
    vc_target = getattr(vc_op, "default", None)
    for mod_name, mod in gm.named_modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        gname = f"{graph_name}{'.' + mod_name if mod_name else ''}"
        order = {n: i for i, n in enumerate(mod.graph.nodes)}
        for node in mod.graph.nodes:
            if node.op != "call_function" or node.target not in ATTENTION_TARGETS:
                continue
            if node.target is vc_target:
                q, k, site = node.args[0], node.args[1], node.args[4]
            else:
                q = arg(node, 0, "query")
                k = arg(node, 1, "key")
                site = None
            try:
                result = _site_result(q, k, order, order[node])
            except Exception as e:  # a diagnostic must never break compilation
                result = f"analysis failed: {type(e).__name__}: {e}"
            f = RopeFinding(gname, node.name, site, result)
            findings.append(f)
            counters["vcattn"][f"rope:{f.form}"] += 1
            rec = _record(gname, node, site)
            if rec is not None:
                rec.rope = result.describe() if isinstance(result, RopeMatch) else f"unrecognised: {result}"
    return findings
