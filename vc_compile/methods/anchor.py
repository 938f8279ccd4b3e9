"""MC-Sparse anchor step on the 8-bit pass (issue 20, "cheap anchors"; SPEC 3.4 steps 1-3).

    sigma = PDDP(q)                                                    (Fast PDDP query groups)
    qk, vq = preprocess(q, k, v; pi)                                   (INT8 Q/K, FP8 V; pi = V-Smooth key order)
    O8, lse_s = vsmooth_attention(qk, vq, return_lse=True)             (pass 1: the 8-bit dense pass)
    idx = top-K(pass-2 masses from qk, lse_s, sigma; pi)               (templates/anchor_mass.py + topk.py)
    O_sparse = sparse_attention(q, k, v, sigma, idx)                   (the reuse steps' gather kernel, fp32 out)
    R = O_dense - O_sparse ;  returns O_dense                           (O_dense = O8, or a bf16 dense pass)

``AnchorConfig.dense_out`` picks O_dense. "bf16" (default): SDPA (cuDNN) gives O_dense and its LSE, and pass 2
reads the INT8 codes of Q/K quantised for it (lse_s = lse - (q . k_mean) * sm_scale * log2 e, the K-smoothing
shift; keys in token order, no V pass). "q8": the 8-bit V-Smooth pass gives O8 and lse_s, and O8 is both the
returned output and the residual's dense term -- one cheaper dense pass (27 vs 38.5 ms at S = 32760 on the
H200), but R then carries the 8-bit pass's error into every reuse step. NOTE measured on CPU with the
references (scripts/anchor_accuracy.py, docs/anchor_notes.md): pass 2 on the INT8 codes leaves the reuse-step
error unchanged (within 0.2%) everywhere; O_dense = O8 raises it by +0.1%, +1.4%, +9% on the demo model's
layers 4, 0, 2 and by +31% on the drifting structured input, against the issue's "within 10% of today's".
Hence "bf16" by default, "q8" an explicit speed option.

Entry point ``anchor_step(q, k, v, ...)``; ``modules("templates" | "reference")`` names the kernels it runs
(Triton on CUDA / the interpreter, or the plain-PyTorch references: the CPU path and the oracle of the tests).
Wiring into ``methods/mcsparse.py``: a separate commit (the kernel-layer refactor moves launch configs to
``templates/configs.py``; ``AnchorConfig`` and the configs it holds are frozen dataclasses ready to move).
"""
from __future__ import annotations

import enum
import functools
import importlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch


class DenseOut(str, enum.Enum):
    Q8 = "q8"
    BF16 = "bf16"


@dataclass(frozen=True)
class AnchorConfig:
    """Options of the anchor step. ``dense_out``: see the module doc. ``exp``: pass 2's exponential ("exact" |
    "shift", ``templates.anchor_mass.ExpMode``; the reference emulates both). ``mass_dtype``: "bf16" | "fp32"
    storage of the masses between pass 2 and the top-K. ``mass`` / ``topk``: launch configs (None = the
    defaults for the group size); ``max_mass_bytes``: masses held at once (heads are processed in chunks)."""
    dense_out: DenseOut = DenseOut.BF16
    exp: str = "shift"
    mass_dtype: str = "bf16"
    mass: Optional[object] = None
    topk: Optional[object] = None
    max_mass_bytes: int = 1 << 30

    def __post_init__(self):
        object.__setattr__(self, "dense_out", DenseOut(self.dense_out))
        if self.exp not in ("exact", "shift"):
            raise ValueError(f"AnchorConfig.exp must be 'exact' or 'shift', got {self.exp!r}")
        if self.mass_dtype not in ("bf16", "fp32"):
            raise ValueError(f"AnchorConfig.mass_dtype must be 'bf16' or 'fp32', got {self.mass_dtype!r}")
        if not self.max_mass_bytes > 0:
            raise ValueError(f"AnchorConfig.max_mass_bytes must be positive, got {self.max_mass_bytes}")


@dataclass
class AnchorResult:
    out: torch.Tensor                 # O_dense [B, H, S, Dv] (kernel output dtype)
    sigma: torch.Tensor               # [B, H, S] int64
    idx: torch.Tensor                 # [B, H, G, keep] int32 ascending
    residual: Optional[torch.Tensor]  # R = O_dense - O_sparse, fp32 (None when not asked for)


_MODULES = {"pddp": "pddp", "preprocess": "preprocess", "vsmooth_attn": "vsmooth_attn",
            "anchor_mass": "anchor_mass", "sparse_attn": "sparse_attn"}


@functools.lru_cache(maxsize=None)
def modules(kind: str) -> SimpleNamespace:
    """The kernels of the anchor step: ``kind`` = "templates" (Triton) or "reference" (plain PyTorch)."""
    if kind not in ("templates", "reference"):
        raise ValueError(f"anchor modules: kind must be 'templates' or 'reference', got {kind!r}")
    ns = {k: importlib.import_module(f"vc_compile.{kind}.{m}") for k, m in _MODULES.items()}
    return SimpleNamespace(kind=kind, **ns)


def _dense_with_lse(mods, q, k, v, sm_scale):
    """(O bf16-class dense output, base-2 LSE of the true logits): cuDNN on the Triton path, fp32 reference."""
    if mods.kind == "templates":
        from vc_compile.templates.select import dense_with_lse

        return dense_with_lse(q, k, v, sm_scale)
    from vc_compile.reference.dense import dense_attention_lse

    o, lse = dense_attention_lse(q, k, v, sm_scale=sm_scale)
    return o.to(q.dtype), lse


def _select(mods, qk, lse_s, sigma, *, group_size, keep, key_perm, cfg: AnchorConfig):
    mass_dtype = torch.bfloat16 if cfg.mass_dtype == "bf16" else torch.float32
    am = mods.anchor_mass
    if mods.kind == "reference":
        return am.anchor_select_q8(qk, lse_s, sigma, group_size=group_size, keep=keep, key_perm=key_perm,
                                   exp=cfg.exp, mass_dtype=mass_dtype, max_mass_bytes=cfg.max_mass_bytes)
    mcfg = cfg.mass or am.default_config(group_size)
    if mcfg.exp.value != cfg.exp:
        mcfg = am.AnchorMassConfig(groups_per_program=mcfg.groups_per_program, exp=cfg.exp,
                                   num_stages=mcfg.num_stages, num_warps=mcfg.num_warps)
    return am.anchor_select_q8(qk, lse_s, sigma, group_size=group_size, keep=keep, key_perm=key_perm,
                               config=mcfg, topk_config=cfg.topk, mass_dtype=mass_dtype,
                               max_mass_bytes=cfg.max_mass_bytes)


def anchor_step(q, k, v, *, sm_scale: float, group_size: int, keep: int, mods: SimpleNamespace,
                key_perm: Optional[torch.Tensor] = None, cfg: AnchorConfig = AnchorConfig(),
                sigma: Optional[torch.Tensor] = None, residual: bool = True, out_dtype=None,
                sparse_fn=None) -> AnchorResult:
    """One anchor step. q, k, v [B, H, S, D] (self-attention, D = Dv in {64, 128}); ``key_perm`` [B, H, S]: the
    V-Smooth key order pi for pass 1 (None: keys in token order, V means over consecutive 128-token blocks);
    ``sigma``: a query order to use instead of running PDDP (ablations, tests). ``out_dtype``: of O_dense
    (default q.dtype). ``sparse_fn``: the gather kernel for O_sparse (default ``mods.sparse_attn.sparse_attention``;
    MC-Sparse passes its reuse steps' kernel, e.g. the FP8-QK one, so R matches what the reuse steps add it to)."""
    B, H, S, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"anchor_step: the 8-bit pass needs self-attention with q, k, v of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    out_dtype = out_dtype or q.dtype
    C = int(group_size)
    if cfg.dense_out == DenseOut.BF16:
        key_perm = None  # no V pass: keys stay in token order (pass 2 then stores its masses contiguously)
    if sigma is None:
        sigma = mods.pddp.pddp_perm(q, C)
    qk = mods.preprocess.preprocess_qk(q, k, key_perm, sm_scale=sm_scale)
    if cfg.dense_out == DenseOut.Q8:
        vq = mods.preprocess.preprocess_v(v, key_perm, smooth=True)
        o_dense, lse_s = mods.vsmooth_attn.vsmooth_attention(qk, vq, out_dtype=out_dtype, return_lse=True)
        del vq
    else:
        o_dense, lse = _dense_with_lse(mods, q, k, v, sm_scale)
        o_dense = o_dense.to(out_dtype)
        from vc_compile.reference.vsmooth_attn import lse_correction

        lse_s = lse - lse_correction(q, qk.k_mean, sm_scale)
    idx = _select(mods, qk, lse_s, sigma, group_size=C, keep=keep, key_perm=key_perm, cfg=cfg)
    del qk
    res = None
    if residual:
        sparse_fn = sparse_fn or mods.sparse_attn.sparse_attention
        o_sparse = sparse_fn(q, k, v, sigma, idx, sm_scale=sm_scale, group_size=C, out_dtype=torch.float32)
        res = o_sparse.neg_().add_(o_dense)  # fp32, in place: no second S x Dv fp32 buffer
    return AnchorResult(o_dense, sigma, idx, res)
