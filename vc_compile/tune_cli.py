"""``python -m vc_compile tune``: pre-tune the attention kernel of one method for one shape.

    python -m vc_compile tune --heads 40 --head-dim 128 --seq 75600 --method vsmooth
    python -m vc_compile tune --heads 40 --head-dim 128 --seq 32760 --method mcsparse --density 0.15

Runs the kernel the runtime runs for that shape and the runtime's options (``VCConfig``'s defaults unless
given: group size, density, QK formats; on an sm_90 GPU with INT8 Q/K that is the Gluon kernel) once on random
inputs, through ``kernels/dispatch.py``, i.e. the same lookup as a real run (shipped -> cache -> tune): a
shipped or cached shape is not re-tuned unless ``--force``.
While tuning, a progress bar per kernel; then a table of the chosen configuration, where it came from,
its time and the default configuration's time (both ``triton.testing.do_bench`` medians). The other
kernels of the methods (preprocessing, k-means, PDDP, selection) have one launch configuration each
and are not tuned.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from vc_compile import methods
from vc_compile.config import GROUP_SIZES, VCConfig

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_DEFAULTS = VCConfig()  # the runtime's defaults: the CLI tunes what a default run looks up


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vc_compile tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", required=True, choices=tuple(methods.tunable()))
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--expcast", action=argparse.BooleanOptionalAction, default=_DEFAULTS.expcast,
                    help="vsmooth: the ExpCast-FP8 kernel (the default; --no-expcast: exp2 and a cast)")
    ap.add_argument("--qk-format", choices=("int8", "fp8"), default=_DEFAULTS.qk_format.value,
                    help="vsmooth: Q/K format")
    ap.add_argument("--density", type=float, default=_DEFAULTS.density, help="mcsparse: fraction of keys kept")
    ap.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=_DEFAULTS.group_size,
                    help="mcsparse: queries per group (default: the runtime's)")
    ap.add_argument("--sparse-qk", choices=tuple(m.value for m in type(_DEFAULTS.sparse_qk)),
                    default=_DEFAULTS.sparse_qk.value,
                    help="mcsparse: QK precision ('int8': the sm_90 gather kernel, whose launch is fixed per group "
                         "size: nothing to tune)")
    ap.add_argument("--force", action="store_true", help="re-tune even when shipped or cached")
    ap.add_argument("--cache-dir", default=None, help="default: $VCATTN_CACHE_DIR, else ~/.cache/vc_compile/tune")
    return ap


def check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if min(a.heads, a.seq, a.batch) < 1:
        ap.error("--heads, --seq and --batch must be >= 1")
    err = methods.tunable()[a.method].SPEC.head_dim_error(a.head_dim)
    if err:
        ap.error(f"--head-dim {a.head_dim}: {err}")
    if not 0.0 < a.density <= 1.0:
        ap.error(f"--density {a.density}: must be in (0, 1]")


def no_gpu_reason() -> Optional[str]:
    import torch

    from vc_compile.kernels.interpret import interpreting

    if interpreting():
        return "TRITON_INTERPRET=1 is set: kernels run on the CPU interpreter and are never tuned"
    if not torch.cuda.is_available():
        return "no CUDA GPU found: configurations are tuned by timing the kernels on the GPU they will run on"
    return None


class Bar:
    """A one-line progress bar per tuned kernel (redrawn with \\r on a terminal, one line per step else)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.times = total, label, []

    def __call__(self, i: int, cfg, ms) -> None:
        self.times.append((cfg, ms))
        done = i + 1
        bar = "#" * (20 * done // self.total) + "." * (20 - 20 * done // self.total)
        last = f"{ms:.3f} ms" if ms is not None else "failed"
        end = "\n" if done == self.total or not sys.stderr.isatty() else ""
        print(f"\r{self.label} [{bar}] {done}/{self.total}  {fmt_cfg(cfg)}: {last}   ", end=end,
              file=sys.stderr, flush=True)


def fmt_cfg(cfg) -> str:
    items = cfg.items() if isinstance(cfg, dict) else cfg.to_json().items()
    return " ".join(f"{k}={v}" for k, v in items)


def run(a: argparse.Namespace) -> List[dict]:
    import torch
    import triton.testing

    from vc_compile.kernels import dispatch
    from vc_compile.tune import lookup

    build = methods.tunable()[a.method].SPEC.tune(a)
    if isinstance(build, str):
        print(f"vc_compile tune: {build}")
        return []
    dev = torch.device("cuda")
    dtype = getattr(torch, DTYPES[a.dtype])
    B, H, S, D = a.batch, a.heads, a.seq, a.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dtype, generator=g) for _ in range(3))
    built = build(q, k, v)
    if isinstance(built, str):  # what this GPU runs has a fixed launch
        print(f"vc_compile tune: {built}")
        return []
    kernel, cands, call = built
    cls = dispatch.KERNELS[kernel].config
    bar = Bar(len(cands), f"tuning {kernel}")
    lookup.configure(cache_dir=a.cache_dir or "", force=a.force, progress=bar)
    try:
        with lookup.recording() as sources:
            call()
            torch.cuda.synchronize()
    finally:
        lookup.configure(force=False, progress=False)
    source = next(iter(sources)).split(":")[1] if sources else "?"
    chosen = cls.from_json(lookup.last_config(kernel))
    rows = []
    for name, cfg in (("chosen", chosen), ("default", cands[0])):
        ms = triton.testing.do_bench(lambda: call(cfg), return_mode="median")
        rows.append({"kernel": kernel, "which": name, "source": source if name == "chosen" else "-",
                     "config": fmt_cfg(cfg), "ms": ms})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    check_args(ap, a)
    said = methods.tunable()[a.method].SPEC.tune(a)
    if isinstance(said, str):  # nothing to tune with these options, on any GPU
        print(f"vc_compile tune: {said}")
        return 0
    why = no_gpu_reason()
    if why:
        print(f"vc_compile tune: cannot tune here: {why}.", file=sys.stderr)
        return 1
    rows = run(a)
    if not rows:
        return 0
    from vc_compile.table import format_table
    from vc_compile.tune.cache import cache_dir

    print(format_table([{**r, "ms": f"{r['ms']:.3f}"} for r in rows], ["kernel", "which", "source", "config", "ms"]))

    print(f"cache: {cache_dir(a.cache_dir)}")
    return 0
