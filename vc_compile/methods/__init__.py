"""One module per attention method (``METHODS``). Each owns its phase schedule and its metadata type and runs
its kernels through ``templates/dispatch.py`` (the reference or the kernels: the ``impl`` that dispatch chose
for the call), never a kernel module by name.

A method module provides
``phase_for(cfg, step, n, has_meta) -> Phase``   what step ``step`` of ``n`` does (``methods/phase.py``);
``needs_fp8(cfg) -> bool``                       whether its kernels use FP8 MMAs with these options;
``ineligible(q, k, v) -> reason or None``        the kernels' limits (dispatch's checks);
``path_label(path, phase, cfg, device) -> str``  the kernel path recorded in ``report()``;
``run(q, k, v, *, phase, meta, cfg, sm_scale, impl, rope=None) -> (out [B, H, S, Dv] in q.dtype, new meta)``
with q, k, v in [B, H, S, D] (any strides); ``Phase.DENSE`` never reaches ``run`` (the op runs stock SDPA).
"""
from __future__ import annotations

from ..config import Method
from . import dense, mcsparse, vsmooth
from .output import finish_output, kernel_out_dtype
from .phase import Phase

__all__ = ["METHODS", "Phase", "finish_output", "get", "kernel_out_dtype"]
METHODS = {Method.DENSE: dense, Method.VSMOOTH: vsmooth, Method.MCSPARSE: mcsparse}


def get(method: Method):
    """The module of a resolved method (``VCConfig.resolved_method``)."""
    return METHODS[method]
