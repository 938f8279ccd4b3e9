"""RoPE of the prologue fusion: the op-side conventions and the fp32 reference.

When ``passes/rope_fuse.py`` folds a model's RoPE into ``vcattn::attention``, the op receives q and k
*before* the rotation, in the model's own layout, plus the model's cos/sin tables and a spec (JSON):

    {"form": "interleaved" | "rotate-half", "layout": "BSHD" | "BHSD" | "BSC", "heads": H,
     "start": int | null, "stop": int | null, "pass": <rope_fuse.uuid()>}

* ``interleaved``: pairs (2i, 2i+1), ``out = x*cos + rot(x)*sin`` with ``rot(x)[2i] = -x[2i+1]``,
  ``rot(x)[2i+1] = x[2i]``. ``rotate-half``: pairs (i, i + D/2), ``rot(x) = cat([-x2, x1])``.
* tables: cos/sin broadcast (from the right, like the model's own ``x * cos``) against the rotated
  region in the source layout; their last dim is D ("full" table, one value per channel: HunyuanVideo,
  LTX, CogVideoX, Cosmos) or D/2 for ``interleaved`` ("pair" table, one value per pair: Wan, SkyReels,
  tests/tiny_dit.py). For ``BSC`` the channel dim C = H * D is split into heads like the model's
  ``unflatten(2, (H, -1))`` that follows the rotation.
* ``start``/``stop``: the rotated tokens (a Python slice along S, negative values from the end, None =
  open); the other tokens pass through unrotated (CogVideoX's text head).

Precision: the rotation runs in fp32 and rounds once to the input dtype, as Wan (bf16 x times fp32 tables),
HunyuanVideo, LTX and CogVideoX (``x.float() * cos + ...``, ``.to(x.dtype)``) do; the products are summed
in the models' order (``x*cos`` first), so this reference is bit-identical to those models' RoPE on CPU.
A model that rotates in bf16 (tests/tiny_dit.py casts its tables to bf16) differs by bf16 roundings.
"""
from __future__ import annotations

import functools
import json
from typing import NamedTuple, Optional

import torch

FORMS = ("interleaved", "rotate-half")
LAYOUTS = ("BSHD", "BHSD", "BSC")


class RopeSpec(NamedTuple):
    form: str
    layout: str
    heads: int
    start: Optional[int]
    stop: Optional[int]

    def to_json(self, pass_uuid: str = "") -> str:
        return json.dumps({"form": self.form, "layout": self.layout, "heads": self.heads, "start": self.start,
                           "stop": self.stop, "pass": pass_uuid}, sort_keys=True)


@functools.lru_cache(maxsize=256)
def parse_spec(s: str) -> RopeSpec:
    d = json.loads(s)
    spec = RopeSpec(d["form"], d["layout"], int(d["heads"]), d.get("start"), d.get("stop"))
    if spec.form not in FORMS or spec.layout not in LAYOUTS:
        raise ValueError(f"vcattn: bad RoPE spec {s!r} (form in {FORMS}, layout in {LAYOUTS})")
    return spec


class RopeArgs(NamedTuple):
    """What the kernels need: tables as [B, H, S_rot, Dc] views (stride 0 where broadcast), the form and
    the rotated token range [lo, hi) along S."""
    cos: torch.Tensor
    sin: torch.Tensor
    form: str
    lo: int
    hi: int

    def pair_table(self, D: int) -> bool:
        """One table value per pair (2i, 2i+1) (last dim D/2), else one per channel."""
        return self.cos.shape[-1] * 2 == D


def to_bhsd(x: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """The model's q/k in its layout -> the [B, H, S, D] view SDPA saw (no copy)."""
    if spec.layout == "BSHD":
        return x.permute(0, 2, 1, 3)
    if spec.layout == "BHSD":
        return x
    return x.unflatten(-1, (spec.heads, -1)).permute(0, 2, 1, 3)


def _table(t: torch.Tensor, spec: RopeSpec, B: int, H: int, S_rot: int, D: int) -> torch.Tensor:
    Dc = t.shape[-1]
    if spec.layout == "BSHD":
        return t.expand(B, S_rot, H, Dc).permute(0, 2, 1, 3)
    if spec.layout == "BHSD":
        return t.expand(B, H, S_rot, Dc)
    return t.expand(B, S_rot, Dc).unflatten(-1, (H, Dc // H)).permute(0, 2, 1, 3)


def rope_args(cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, shape) -> RopeArgs:
    """Normalise the model's tables for a [B, H, S, D] ``shape``; raises ValueError for tables that do not
    broadcast the way the kernels read them (the pass runs this on fake values before it fuses)."""
    B, H, S, D = shape
    lo, hi, step = slice(spec.start, spec.stop).indices(S)
    if step != 1 or hi <= lo:
        raise ValueError(f"empty or strided rotated token range {spec.start}:{spec.stop} of {S}")
    tabs = []
    for t in (cos, sin):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 1:
            raise ValueError("cos/sin are not floating-point tensors")
        Dc = t.shape[-1] if spec.layout != "BSC" else t.shape[-1] // H
        if spec.layout == "BSC" and t.shape[-1] % H:
            raise ValueError("a [B, S, C] table whose C is not split evenly into heads")
        if not (Dc == D or (Dc * 2 == D and spec.form == "interleaved")):
            raise ValueError(f"table last dim {t.shape[-1]} is neither D={D} nor (interleaved) D/2")
        try:
            tabs.append(_table(t, spec, B, H, hi - lo, D))
        except RuntimeError as e:
            raise ValueError(f"table of shape {tuple(t.shape)} does not broadcast: {e}") from None
    if tabs[0].shape != tabs[1].shape:
        raise ValueError("cos and sin tables differ in shape")
    return RopeArgs(tabs[0], tabs[1], spec.form, lo, hi)


def rotate(x: torch.Tensor, form: str) -> torch.Tensor:
    """rot(x) of ``x*cos + rot(x)*sin`` along the last dim."""
    if form == "interleaved":
        return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, rope: RopeArgs) -> torch.Tensor:
    """x [B, H, S, D] (any strides) -> rotated copy (contiguous, x's dtype): fp32 math, one rounding."""
    D = x.shape[-1]
    xs = x[:, :, rope.lo:rope.hi].float()
    c, s = rope.cos.float(), rope.sin.float()
    if c.shape[-1] * 2 == D:  # pair table: one value per pair (2i, 2i+1)
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
    y = (xs * c + rotate(xs, rope.form) * s).to(x.dtype)
    out = x.contiguous().clone() if (rope.lo, rope.hi) != (0, x.shape[2]) else None
    if out is None:
        return y.contiguous()
    out[:, :, rope.lo:rope.hi] = y
    return out
