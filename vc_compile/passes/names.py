"""Readable names for call sites: module paths such as ``blocks.0.attn1`` instead of Dynamo's sources.

Dynamo records, per graph node, the stack of modules it was called from (``nn_module_stack``) as *source*
strings relative to the compiled frame: ``L['self'].__dict__['_modules']['blocks'].0.attn1`` (torch
2.11+ with inlined modules), ``L['self']._modules['blocks']._modules['3'].attn``, ``L['self'].blocks[2]``,
or ``G['pipe'].transformer...`` for a global. :func:`source_to_path` turns each into a dotted path
(``blocks.0.attn1``; a root other than ``self`` keeps its name: ``model.blocks.0``).

What the path is relative to, :func:`site_label` says:

* whole-model compile: the model, so the path names the block (``blocks.0.attn1``);
* regional compile (``compile_repeated_blocks``: one graph serves every block of a class): the block,
  so the path alone (``attn1``) would not say which class; it is qualified by the compiled module's
  class (``WanTransformerBlock.attn1``; ``Block`` when the attention is the block's own);
* a compiled function of q, k, v: its name, ``f()``.

Rule: a path that holds a list index (``blocks.0...``) already names its block and is shown as is;
otherwise it is qualified by the compiled module's class. The compiled frame (its ``self`` and code
name) is read from Dynamo's instruction translator while the backend runs; where that is unavailable
the path alone is shown.
"""
from __future__ import annotations

import itertools
import re
import weakref
from typing import Dict, Optional, Tuple

import torch.fx as fx

# one step of a Dynamo source: .__dict__['_modules']['x'] | ._modules['x'] | ['x'] | [3] | .x | .0
_STEP = re.compile(r"\.__dict__\['_modules'\]\['([^']+)'\]|\._modules\['([^']+)'\]|\['([^']+)'\]|\[(\d+)\]"
                   r"|\.([A-Za-z_]\w*|\d+)")
_ROOT = re.compile(r"^(?:L|G)\['([^']+)'\]")
_RESUME = re.compile(r"^torch_dynamo_resume_in_(\w+?)_at_\d+$")


def source_to_path(src: str) -> str:
    """``L['self'].__dict__['_modules']['blocks'].0.attn1`` -> ``blocks.0.attn1`` (see module doc).
    A string that is not a Dynamo source (already a path) comes back unchanged."""
    m = _ROOT.match(src)
    if m is None:
        return src
    parts = [] if m.group(1) == "self" else [m.group(1)]
    pos = m.end()
    while pos < len(src):
        step = _STEP.match(src, pos)
        if step is None:  # an unknown form (getattr(...), a call): keep the rest verbatim
            parts.append(src[pos:].lstrip("."))
            break
        parts.append(next(g for g in step.groups() if g is not None))
        pos = step.end()
    return ".".join(parts)


def node_path(node: fx.Node) -> str:
    """The dotted path of the innermost module ``node`` was called from, relative to the compiled frame
    ("" when it runs in the compiled frame itself)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    return source_to_path(path[0] if isinstance(path, tuple) else str(path))


def compiled_root() -> Tuple[Optional[str], Optional[str]]:
    """``("module", class name)`` or ``("function", name)`` of the frame Dynamo is compiling now, or
    ``(None, None)`` outside a Dynamo compile (a graph handed to the backend by hand)."""
    try:
        import torch.nn as nn
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        owner = tx.f_locals.get("self")
        if isinstance(owner, nn.Module):
            return "module", type(owner).__name__
        name = tx.f_code.co_name
        m = _RESUME.match(name)  # the frame after a graph break
        return "function", m.group(1) if m else name
    except Exception:  # internal API: never let a label break a compile
        return None, None


_ROOTS: Dict[int, Tuple[weakref.ref, int]] = {}
_SERIAL = itertools.count(1)


def _identity(obj) -> int:
    """A number for ``obj`` that stays the same while it lives and is never given to another object
    (``id()`` alone is reused after an object dies)."""
    ent = _ROOTS.get(id(obj))
    if ent is not None and ent[0]() is obj:
        return ent[1]
    serial = next(_SERIAL)
    try:
        _ROOTS[id(obj)] = (weakref.ref(obj), serial)
    except TypeError:  # no weak references: a fresh number every time (never shared)
        pass
    return serial


def compiled_root_id() -> Optional[int]:
    """An identity of the callable Dynamo is compiling now: its module instance (``self``) or its code
    object; None outside a Dynamo compile. The same model recompiled (another grad mode, shape, guard
    failure) gives the same value; another instance of the model does not."""
    try:
        import torch.nn as nn
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        owner = tx.f_locals.get("self")
        return _identity(owner if isinstance(owner, nn.Module) else tx.f_code)
    except Exception:
        return None


def site_label(node: fx.Node, root: Tuple[Optional[str], Optional[str]]) -> str:
    """What ``report()``'s module column shows for ``node`` (see module doc)."""
    path = node_path(node)
    kind, name = root
    if kind == "module":
        if any(p.isdigit() for p in path.split(".")):
            return path
        return f"{name}.{path}" if path else name
    if kind == "function" and not path:
        return f"{name}()"
    return path
