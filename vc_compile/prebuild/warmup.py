"""``python -m vc_compile warmup``: build the kernels of the usual call layouts into Triton's on-disk cache ahead
of the first generation.

A process builds each kernel of its methods' phases before it can launch it; Triton keeps what it built on disk
(``TRITON_CACHE_DIR``, by default ``~/.triton/cache``), keyed by the kernel's source, its specialisation and the
toolchain, so only the first process on a machine (or after an upgrade of torch, Triton or this package) pays
for the builds. Inside a first process the backend's helpers build them in parallel while Inductor compiles
(``prebuild/helpers.py``, option ``prebuild='auto'``). This command pays that once ahead, on the GPU, for the
layouts of the supported pipelines at their usual sizes: each (method, layout) request runs its phases' chains as
a helper does (``prebuild.run_job``: every kernel found, built in parallel, then the steps run on random inputs),
and leaves the helpers' marker, so that a pipeline's first compile of a call of the same layout and kernel
options starts no helper and waits for none.

Nothing here depends on Triton's internals beyond what the helpers use; the binaries are Triton's own cache
entries, never files of this package.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional, Tuple

from .. import methods as _methods

# the supported pipelines' self-attention, B = 1, q / k / v as the [B, S, H, D] projections viewed as
# [B, H, S, D]: Wan 2.1 1.3B 480p x 81 frames (12 heads x 32760 tokens), Wan 2.1 14B 720p and 480p (40 x 75600,
# 40 x 32760); "wide" adds CogVideoX-5B 720 x 480 x 49 frames (48 heads of 64 over 17776 tokens)
PLANS: Dict[str, List[Tuple[int, int, int, int]]] = {
    "default": [(1, 12, 32760, 128), (1, 40, 75600, 128), (1, 40, 32760, 128)],
    "small": [(1, 12, 32760, 128)],
    "wide": [(1, 12, 32760, 128), (1, 40, 75600, 128), (1, 40, 32760, 128), (1, 48, 17776, 64)],
}



def request(opts: dict, B: int, H: int, S: int, D: int, dtype: str = "bfloat16", device: str = "cuda:0") -> dict:
    """A prebuild request (``prebuild.requests_for_graph``'s form) of one call layout and options."""
    from ..config import VCConfig

    spec = {"shape": [B, H, S, D], "stride": [S * H * D, D, H * D, 1], "dtype": dtype, "device": device,
            "offset": 0}
    return {"config": VCConfig.from_options(dict(opts)).to_json(), "site": 1, "scale": None, "rope": "",
            "q": spec, "k": spec, "v": spec, "ident": None, "cos": None, "sin": None}


def warmup(plan: str = "default", methods: Optional[List[str]] = None,
           progress: Optional[Callable[[str], None]] = None) -> dict:
    """Build (method x layout of ``plan``) into Triton's cache; returns counts and seconds. ``progress`` gets a
    line per job (default: the vc_compile logger)."""
    import torch

    from ..runtime.runtime import current

    from ..log import get_logger
    from . import helpers as prebuild

    progress = progress or get_logger().info
    if not torch.cuda.is_available():
        raise RuntimeError("vc_compile warmup builds and runs the kernels on the GPU: run it on a CUDA machine "
                           "(the CPU path has no kernels to build)")
    dev = f"cuda:{torch.cuda.current_device()}"
    METHODS = _methods.warmup_variants()  # {label: options}: each method's variants that build distinct kernels
    # a method's name stands for its spec's warm-up variants ("mcsparse": "mcsparse@0.15")
    by_name = {m.value: mod.SPEC.warmup for m, mod in _methods.METHODS.items()}
    methods = [lab for m in (methods or METHODS) for lab in ([m] if m in METHODS else by_name.get(m) or [m])]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or plan not in PLANS:
        raise ValueError(f"vc_compile warmup: unknown method(s) {unknown} or plan {plan!r}; methods: "
                         f"{sorted(METHODS)}, plans: {sorted(PLANS)}")
    t_all = time.time()
    out = {"built": 0, "found": 0, "cached": 0, "jobs": 0}
    todo = [(m, shape) for m in methods for shape in PLANS[plan]]
    for n, (label, (B, H, S, D)) in enumerate(todo, 1):
        req = request(METHODS[label], B, H, S, D, device=dev)
        sched = prebuild._schedule(req)
        for chain in prebuild.plan_chains(req):
            job = dict(req, steps=chain, phases=sorted({sched[i].value for i in chain}))
            marker = prebuild._marker_path(job)
            what = f"[{n}/{len(todo)}] {label} {H}x{S}x{D} phases {','.join(job['phases'])}"
            if marker and os.path.exists(marker):
                out["cached"] += 1
                progress(f"{what}: built before (Triton's cache)")
                continue
            t0 = time.time()
            said = prebuild.run_job(job)
            current().reset(report=True)
            if marker:
                prebuild.write_marker(marker, said)
            out["jobs"] += 1
            out["built"] += said.get("built", 0)
            out["found"] += said.get("found", 0)
            progress(f"{what}: {said.get('built', 0)} kernels built in {time.time() - t0:.1f} s")
    out["s"] = round(time.time() - t_all, 1)
    out["cache"] = prebuild._triton_cache_dir()
    return out
