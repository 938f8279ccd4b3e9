"""Reading FX graph nodes: which op a node runs, its example value, its arguments, and the casts to look
through. Shared by the graph passes (``rope_detect.py`` recognises RoPE with them, ``rope_fuse.py`` walks the
layout ops between a rotation and the attention)."""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

# repeat_interleave: the GQA head expansion (Cosmos; by 1 when H_q == H_kv)
LAYOUT_OPS = {"permute", "transpose", "unflatten", "view", "reshape", "type_as", "to", "float", "half",
              "bfloat16", "contiguous", "clone", "getitem", "unbind", "chunk", "split",
              "repeat_interleave", "unsqueeze", "squeeze", "expand"}
DTYPE_OPS = {"type_as", "to", "float", "half", "bfloat16", "contiguous", "clone"}
MAX_WALK = 40  # nodes a walk through casts follows at most
OP_NAMES = {operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.neg: "neg",
             operator.getitem: "getitem", operator.setitem: "setitem", operator.truediv: "div"}


def node_name(n) -> Optional[str]:
    """The op a node runs (``mul``, ``permute``, ``linear``, ...), or its kind (``placeholder``)."""
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        if n.target in OP_NAMES:
            return OP_NAMES[n.target]
        return getattr(n.target, "__name__", str(n.target)).split(".")[-1]
    return n.op


def is_op(n, *names) -> bool:
    """Whether ``n`` is a node running one of ``names``."""
    return node_name(n) in names


def val(n):
    """The example value (fake tensor) Dynamo recorded for a node, or None."""
    if isinstance(n, fx.Node):
        return n.meta.get("example_value", n.meta.get("val"))
    return None


def ndim(n) -> Optional[int]:
    v = val(n)
    return v.dim() if isinstance(v, torch.Tensor) else None


def arg(n: fx.Node, i: int, kw: str, default=None):
    """Argument ``i`` of a call, given positionally or as keyword ``kw``."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(kw, default)


def strip(n):
    """Follow dtype/device casts and copies (``float()``, ``to()``, ``type_as``, ``contiguous``)."""
    for _ in range(MAX_WALK):
        if isinstance(n, fx.Node) and is_op(n, *DTYPE_OPS) and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        else:
            return n
    return n
