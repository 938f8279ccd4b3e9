"""MC-Sparse anchor step on the 8-bit pass ("cheap anchors"; docs/methods.md, MC-Sparse steps 1-3).

    sigma = PDDP(q)                                                    (Fast PDDP query groups)
    qk, vq = preprocess(q, k, v; pi)                                   (INT8 Q/K, FP8 V; pi = V-Smooth key order)
    O8, lse_s = vsmooth_attention(qk, vq, return_lse=True)             (pass 1: the 8-bit dense pass)
    idx = top-K(pass-2 masses from qk, lse_s, sigma; pi)               (kernels/anchor_mass.py + topk.py)
    O_sparse = sparse_attention(q, k, v, sigma, idx)                   (the reuse steps' gather kernel, fp32 out)
    R = O_dense - O_sparse ;  returns O_dense                           (O_dense = O8, or a bf16 dense pass)

``AnchorConfig.dense_out`` picks O_dense. "bf16" (default): SDPA (cuDNN) gives O_dense and its LSE, and pass 2
reads the INT8 codes of Q/K quantised for it (lse_s = lse - (q . k_mean) * sm_scale * log2 e, the K-smoothing
shift; keys in token order, no V pass). "q8": the 8-bit V-Smooth pass gives O8 and lse_s, and O8 is both the
returned output and the residual's dense term -- one cheaper dense pass, but R then carries the 8-bit pass's error into every reuse step. NOTE measured on CPU with the
references (docs/design/anchor-selection.md, docs/design/anchor-mass-config.md): pass 2 on the INT8 codes
leaves the reuse-step error unchanged (within 0.2%) everywhere; O_dense = O8 raises it by +0.1%, +1.4%, +9% on the
demo model's layers 4, 0, 2 and by +31% on the drifting structured input, against the issue's "within 10% of today's".
Hence "bf16" by default, "q8" an explicit speed option.

Entry point ``anchor_step(impl, q, k, v, ...)``: every kernel through ``kernels/dispatch.py`` (``impl``: the
Triton/Gluon kernels, or the plain-PyTorch references: the CPU path and the oracle of the tests); launch configs
of pass 2 and the top-K are ``kernels/configs.py``'s ``AnchorMassConfig`` / ``TopKConfig``. MC-Sparse runs it
at its anchor steps where it applies (``methods/mcsparse.py``, ``cheap_anchor``).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import AnchorDense
from ..kernels import configs as KC
from ..kernels import dispatch
from ..torch_ops import lse_correction


DenseOut = AnchorDense  # the option's Enum (config.AnchorDense: "bf16" | "q8")


@dataclass(frozen=True)
class AnchorConfig:
    """Options of the anchor step. ``dense_out``: see the module doc. ``exp``: pass 2's exponential ("exact" |
    "shift", ``kernels.anchor_mass.ExpMode``; the reference emulates both). ``mass_dtype``: "bf16" | "fp32"
    storage of the masses between pass 2 and the top-K. ``mass`` / ``topk``: launch configs (None = the
    defaults for the group size, with ``exp``); ``max_mass_bytes``: masses held at once (heads are processed in
    chunks)."""
    dense_out: DenseOut = DenseOut.BF16
    exp: KC.ExpMode = KC.ExpMode.SHIFT
    mass_dtype: str = "bf16"
    mass: Optional[KC.AnchorMassConfig] = None
    topk: Optional[KC.TopKConfig] = None
    max_mass_bytes: int = 1 << 30

    def __post_init__(self):
        for name, cls in (("dense_out", DenseOut), ("exp", KC.ExpMode)):
            val = getattr(self, name)
            try:
                object.__setattr__(self, name, cls(val.value if isinstance(val, enum.Enum) else val))
            except ValueError:
                raise ValueError(f"AnchorConfig.{name} must be one of {[m.value for m in cls]}, got {val!r}") from None
        if self.mass is not None and not isinstance(self.mass, KC.AnchorMassConfig):
            raise ValueError(f"AnchorConfig.mass must be a configs.AnchorMassConfig or None, got {self.mass!r}")
        if self.topk is not None and not isinstance(self.topk, KC.TopKConfig):
            raise ValueError(f"AnchorConfig.topk must be a configs.TopKConfig or None, got {self.topk!r}")
        if self.mass_dtype not in ("bf16", "fp32"):
            raise ValueError(f"AnchorConfig.mass_dtype must be 'bf16' or 'fp32', got {self.mass_dtype!r}")
        if not self.max_mass_bytes > 0:
            raise ValueError(f"AnchorConfig.max_mass_bytes must be positive, got {self.max_mass_bytes}")


@dataclass
class AnchorResult:
    out: torch.Tensor                 # O_dense [B, H, S, Dv] (kernel output dtype)
    sigma: torch.Tensor               # [B, H, S] int64
    idx: torch.Tensor                 # [B, H, G, keep / run] int32 ascending (key ids, or runs of ``run`` keys)
    residual: Optional[torch.Tensor]  # R = O_dense - O_sparse, fp32 or bf16 (None when not asked for)


def _select(impl, qk, lse_s, sigma, *, group_size, keep, key_perm, cfg: AnchorConfig, run: int = 1):
    mass_dtype = torch.bfloat16 if cfg.mass_dtype == "bf16" else torch.float32
    launch = topk_launch = None
    if impl == dispatch.Impl.TRITON:
        launch = cfg.mass
        if launch is not None and launch.exp != cfg.exp:  # the option's exp wins over a given launch's
            launch = dataclasses.replace(launch, exp=cfg.exp)
        topk_launch = cfg.topk
    return dispatch.anchor_select_q8(impl, qk, lse_s, sigma, group_size=group_size, keep=keep, key_perm=key_perm,
                                     exp=cfg.exp, mass_dtype=mass_dtype, max_mass_bytes=cfg.max_mass_bytes,
                                     launch=launch, topk_launch=topk_launch, run=run)


def anchor_step(impl, q, k, v, *, sm_scale: float, group_size: int, keep: int,
                key_perm: Optional[torch.Tensor] = None, cfg: AnchorConfig = AnchorConfig(),
                sigma: Optional[torch.Tensor] = None, residual: bool = True, out_dtype=None,
                sparse_qk: str = "bf16", residual_dtype: torch.dtype = torch.float32, run: int = 1) -> AnchorResult:
    """One anchor step over ``impl``'s kernels (``dispatch.Impl``). q, k, v [B, H, S, D] (self-attention,
    D = Dv in {64, 128}); ``key_perm`` [B, H, S]: the V-Smooth key order pi for pass 1 (None: keys in token
    order, V means over consecutive 128-token blocks); ``sigma``: a query order to use instead of running PDDP
    (MC-Sparse's own, ablations, tests). ``out_dtype``: of O_dense (default q.dtype). ``sparse_qk``: the QK
    format of the gather kernel forming O_sparse (MC-Sparse passes its reuse steps', e.g. "fp8", so R matches
    what the reuse steps add it to). ``residual_dtype``: R's dtype, fp32 (O_sparse in fp32, R formed in place) or
    bf16: the gather kernel's epilogue forms it, O_sparse + (-O_dense) rounded once to bf16 and negated, the same
    bits as R formed in fp32 and rounded to bf16 (a - b = -(b + (-a)) exactly), without the S x Dv fp32 buffers.
    NOTE bf16 R from the epilogue is faster than fp32 R and writes half the bytes; docs/design/
    anchor-residual-bf16.md. ``run``: keys selected in aligned runs of ``run`` (the top runs by summed mass; idx then
    holds run numbers, as the gather kernel takes them)."""
    B, H, S, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"anchor_step: the 8-bit pass needs self-attention with q, k, v of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    out_dtype = out_dtype or q.dtype
    C = int(group_size)
    if cfg.dense_out == DenseOut.BF16:
        key_perm = None  # no V pass: keys stay in token order (pass 2 then stores its masses contiguously)
    if sigma is None:
        sigma = dispatch.pddp_perm(impl, q, C)
    if cfg.dense_out == DenseOut.Q8:
        qk, vq = dispatch.preprocess(impl, q, k, v, key_perm, sm_scale=sm_scale, smooth=True)
        o_dense, lse_s = dispatch.vsmooth_attention(impl, qk, vq, out_dtype=out_dtype, return_lse=True)
        del vq
    else:
        qk = dispatch.preprocess_qk(impl, q, k, key_perm, sm_scale=sm_scale)
        # cuDNN on the Triton path; the fp32 reference rounded to q's dtype, as the kernel path returns it
        o_dense, lse = dispatch.dense_with_lse(impl, q, k, v, sm_scale)
        o_dense = o_dense.to(q.dtype).to(out_dtype)
        lse_s = lse - lse_correction(q, qk.k_mean, sm_scale)
    idx = _select(impl, qk, lse_s, sigma, group_size=C, keep=keep, key_perm=key_perm, cfg=cfg, run=run)
    del qk
    res = None
    if residual and residual_dtype == torch.bfloat16:
        res = dispatch.sparse_attention(impl, q, k, v, sigma, idx, sm_scale=sm_scale, group_size=C,
                                        residual=o_dense.neg(), out_dtype=torch.bfloat16, qk_format=sparse_qk,
                                        run=run)
        res.neg_()
    elif residual:
        if residual_dtype != torch.float32:
            raise ValueError(f"anchor_step: residual_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{residual_dtype}")
        o_sparse = dispatch.sparse_attention(impl, q, k, v, sigma, idx, sm_scale=sm_scale, group_size=C,
                                             out_dtype=torch.float32, qk_format=sparse_qk, run=run)
        res = o_sparse.neg_().add_(o_dense)  # fp32, in place: no second S x Dv fp32 buffer
    return AnchorResult(o_dense, sigma, idx, res)
