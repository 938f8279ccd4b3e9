"""The speed gate: a call our kernels run slower than stock SDPA on this GPU stays stock, by measurement.

``shipped_gate.json`` (written by ``python3 -m tools.gen_gate_table`` from ``benchmarks/results/
bench_op_overhead.csv``) holds, per GPU name and method, the measured speed-up over SDPA cuDNN of a reuse call
at several call sizes (work = B H S Sk D), each measured on the path the default takes (no CUDA graph: the
recorded launch sequence, kernels/programs.py), back to back, as a sampling loop runs them. For a call of another size the speed-up is
interpolated linearly in (log work, log speed-up) between the two nearest measured sizes, and held at the end
points beyond them. Below 1.0 the op runs stock SDPA and ``report()`` says why (``stock is faster at this
shape``); ``speed_gate="off"`` forces our path.

Where the table has no rows for the GPU (anything but the GPUs benchmarked), nothing is gated: the op cannot
know, and ``report()`` names that GPU with the sites that ran on it (``measured``; ``ops.ungated_gpu``). MC-Sparse is gated by its reuse step's speed-up at the measured
density nearest to the call's (its anchor and warm-up steps are not measured here).
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import Dict, List, Optional, Tuple

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped_gate.json")


@functools.lru_cache(maxsize=None)
def table(path: str = PATH) -> Dict[str, Dict[str, List[Tuple[float, float]]]]:
    """{gpu name: {method label: [(work, speed-up), ...] sorted by work}} ({} when the file is missing)."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return {gpu: {m: sorted((float(w), float(x)) for w, x in pts) for m, pts in ms.items()}
            for gpu, ms in raw.get("gpus", {}).items()}


def table_label(label: str, labels) -> Optional[str]:
    """The table's label for a call of variant ``label`` (``methods.MethodSpec.label``): itself where measured,
    else the measured label of the same name (before ``@``) whose number after ``@`` is nearest; None."""
    if label in labels:
        return label
    name, at, num = label.partition("@")
    if not at:
        return None
    near = [(abs(float(lab.partition("@")[2]) - float(num)), lab) for lab in labels if lab.startswith(name + "@")]
    return min(near)[1] if near else None


def estimate(points: List[Tuple[float, float]], work: float) -> float:
    """Speed-up at ``work``: log-log interpolation between the measured points, held beyond them."""
    if work <= points[0][0]:
        return points[0][1]
    if work >= points[-1][0]:
        return points[-1][1]
    for (w0, x0), (w1, x1) in zip(points, points[1:]):
        if w0 <= work <= w1:
            if w1 == w0:
                return min(x0, x1)
            t = (math.log(work) - math.log(w0)) / (math.log(w1) - math.log(w0))
            return math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))
    return points[-1][1]


def measured(gpu: str) -> bool:
    """Whether the table has measurements for the GPU named ``gpu`` (elsewhere nothing is gated, and report() says
    so per site)."""
    return bool(table().get(gpu))


@functools.lru_cache(maxsize=4096)
def slower_than_stock(gpu: str, label: str, work: float) -> Optional[str]:
    """The report's reason when the measured table says stock SDPA is faster for this call, else None."""
    per_gpu = table().get(gpu)
    if not per_gpu:
        return None
    lab = table_label(label, per_gpu)
    if lab is None:
        return None
    x = estimate(per_gpu[lab], work)
    if x >= 1.0:
        return None
    return f"stock is faster at this shape ({lab} x{x:.2f} cuDNN measured on {gpu})"
