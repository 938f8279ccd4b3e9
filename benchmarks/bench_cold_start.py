"""Cold start: what a user waits for the first time, each variant in a process of its own.

    python -m benchmarks.bench_cold_start [--methods vsmooth+expcast,mcsparse@0.15] [--steps 10]
    python -m benchmarks.bench_cold_start --smoke          # CPU: tiny model, eager compiler, nothing appended
    python -m benchmarks.bench_cold_start --methods mcsparse@0.15,mcsparse@0.15/prebuild   # helpers off / on

Per variant (``stock`` first: ``torch.compile`` with Inductor and SDPA on cuDNN; then each method through
``backend="vcattn"``), two processes in turn, each building the diffusers ``WanPipeline`` of
``bench_pipeline`` (Wan 2.1 1.3B configuration, random seeded weights: speed only), compiling it regionally
(``compile_repeated_blocks``) and running one ``--steps``-step generation (CFG 5):
* ``fresh``: empty Inductor and Triton cache directories (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``
  pointed at a new temporary directory): every graph compiled and every kernel built;
* ``second``: a second process on the caches the first one left, what a user's next run sees;
* ``warmup``: empty caches, then ``python -m vc_compile warmup --plan small`` for the method (its own time:
  ``warmup_s``, outside ``first_call_s``), then the process: what a machine's first run sees after the warm-up
  command (stock has no warm-up: its ``fresh`` row is the reference).
``first_call_s`` is the wall time of the first generation (torch.compile is lazy: Dynamo, Inductor, our pass,
the kernel builds and the steps all happen in it); ``extra_s`` its difference to stock's in the same mode;
``steady_s`` a second generation in the same process (the steps alone), so ``first_call_s - steady_s`` is the
start-up cost. Model construction and imports are outside every figure. A label ending in ``/noprebuild`` runs
the method with option ``prebuild='off'`` (every kernel built at its launch; fresh only: a second process is
unaffected), a plain label with the default ('auto': kernel-build helpers while Inductor compiles,
prebuild/helpers.py) (column ``prebuild``: what ``report()`` said of the helpers, ``prebuild_wait_s``: what the
first calls waited for them).
Rows:
``benchmarks/results/bench_cold_start.csv``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import append_rows, prefer_cudnn, print_table

BENCH = "bench_cold_start"
DEFAULT_METHODS = "vsmooth,vsmooth+expcast,mcsparse@0.15"


def log(*a):
    print(*a, flush=True)


def child(a) -> dict:
    """One process: build, compile, first generation, second generation; a JSON line on stdout."""
    import torch

    import vc_compile
    from benchmarks import bench_pipeline as bp

    smoke = a.smoke
    device = "cpu" if smoke else "cuda"
    spec = bp.SIZES["smoke" if smoke else "1.3b-480p"]
    t0 = time.perf_counter()
    pipe, base, call = bp.build_pipeline(spec, spec["cfg"]["num_layers"], device, seed=0)
    build_s = time.perf_counter() - t0
    label, pb_opt = _split(a.child)
    opts = None
    if label != "stock":
        opts = dict(bp.METHODS[label])
        if smoke:
            opts.update(bp.SMOKE_OPTS)
        if pb_opt is not None:
            opts["prebuild"] = pb_opt
    bp.compile_variant(pipe, base, label, opts, "regional", smoke)
    if opts is not None:  # what vc_compile.enable does after compiling: kernel-build helpers start (prebuild on)
        from vc_compile.backend import warm_prebuild
        from vc_compile.config import VCConfig

        warm_prebuild(VCConfig.from_options(opts))
    rec = bp.StepRecorder(device == "cuda", a.steps, f"{label} first")
    ctx = prefer_cudnn() if device == "cuda" else contextlib.nullcontext()
    with ctx:
        _, first_s = bp.generate(pipe, call, a.steps, 5.0, rec)
        rec2 = bp.StepRecorder(device == "cuda", a.steps, f"{label} steady")
        _, steady_s = bp.generate(pipe, call, a.steps, 5.0, rec2)
    rep = vc_compile.report() if label != "stock" else None
    sites = len(rep.sites) if rep is not None else 0
    from vc_compile.runtime.runtime import current

    pb = current().prebuilds
    return {"first_call_s": first_s, "steady_s": steady_s, "build_s": build_s, "sites": sites,
            "prebuild": (rep.prebuild or "none") if rep is not None else "",
            "prebuild_wait_s": round(pb.waited_s, 2),
            "tokens": bp.tokens(spec), "layers": spec["cfg"]["num_layers"], "model": spec["model"],
            "torch_threads": torch.get_num_threads()}


# label suffixes: the method with option prebuild='off' (each kernel built at its first launch); plain labels run
# the default ('auto': helpers while Inductor compiles)
PREBUILD_SUFFIX = {"/noprebuild": "off"}
# bench_pipeline's method labels -> the warm-up command's (the same options)
WARMUP_METHODS = {"vsmooth": "vsmooth", "vsmooth+expcast": "vsmooth+expcast", "mcsparse@0.15": "mcsparse"}


def _split(label: str):
    """(method label, the prebuild option its suffix asks for or None)."""
    for suf, val in PREBUILD_SUFFIX.items():
        if label.endswith(suf):
            return label[:-len(suf)], val
    return label, None


def _env(cache_dir) -> dict:
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
                TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))


def run_warmup(label, cache_dir, a) -> float:
    """``python -m vc_compile warmup`` for the method of ``label`` into these caches: its wall time."""
    method = WARMUP_METHODS.get(_split(label)[0])
    if method is None:
        raise RuntimeError(f"no warm-up for {label!r} (the warm-up command builds {sorted(WARMUP_METHODS)})")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "vc_compile", "warmup", "--plan", "small", "--methods", method],
                       env=_env(cache_dir), capture_output=True, text=True, timeout=a.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"warm-up for {label} failed: {(p.stderr or p.stdout)[-500:]}")
    log("   " + p.stdout.strip().splitlines()[-1])
    return time.perf_counter() - t0


def run_child(label, mode, cache_dir, a) -> dict:
    env = _env(cache_dir)
    cmd = [sys.executable, "-m", "benchmarks.bench_cold_start", "--child", label, "--steps", str(a.steps)]
    if a.smoke:
        cmd.append("--smoke")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{label} ({mode}) failed, rc={p.returncode}: " + " | ".join(tail))
    out = json.loads(lines[-1])
    out["process_s"] = wall
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds per process")
    ap.add_argument("--modes", default="fresh,second",
                    help="which processes per variant, comma-separated: fresh, second (after fresh), warmup")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, eager compiler; nothing appended")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    modes = [m for m in a.modes.split(",") if m]
    if not set(modes) <= {"fresh", "second", "warmup"} or ("second" in modes and "fresh" not in modes):
        ap.error("--modes: of fresh, second, warmup (a second process runs on the caches a fresh one left)")
    labels = ["stock"] + [m for m in a.methods.split(",") if m]
    res, rows = {}, []
    for label in labels:
        with tempfile.TemporaryDirectory(prefix="vc_cold_") as d:
            # without helpers a second process is what it always was (the caches are warm): fresh only
            runs = [m for m in modes if m != "warmup"] or (["fresh"] if label == "stock" else [])  # stock: reference
            for mode in (("fresh",) if _split(label)[1] == "off" else runs):
                r = run_child(label, mode, d, a)
                res[(label, mode)] = r
                log(f"  {label:18s} {mode:6s}: first call {r['first_call_s']:6.1f} s, steady {r['steady_s']:5.1f} s, "
                    f"process {r['process_s']:5.1f} s")
        if "warmup" in modes and label != "stock" and _split(label)[1] is None:
            with tempfile.TemporaryDirectory(prefix="vc_cold_") as d:
                w = run_warmup(label, d, a)
                r = dict(run_child(label, "warmup", d, a), warmup_s=round(w, 1))
                res[(label, "warmup")] = r
                log(f"  {label:18s} warmup: first call {r['first_call_s']:6.1f} s after a {w:.1f} s warm-up")
    for (label, mode), r in res.items():
        stock = res[("stock", "fresh" if mode == "warmup" else mode)]
        rows.append({"variant": label, "B": 1, "H": 12, "S": r["tokens"], "D": 128, "ms": round(1e3 * r["first_call_s"], 1),
                     "mode": mode, "steps": a.steps, "first_call_s": round(r["first_call_s"], 2),
                     "extra_s": round(r["first_call_s"] - stock["first_call_s"], 2),
                     "steady_s": round(r["steady_s"], 2),
                     "startup_s": round(r["first_call_s"] - r["steady_s"], 2),
                     "startup_extra_s": round((r["first_call_s"] - r["steady_s"])
                                              - (stock["first_call_s"] - stock["steady_s"]), 2),
                     "process_s": round(r["process_s"], 1), "model": r["model"], "layers": r["layers"],
                     "sites": r["sites"], "prebuild": r.get("prebuild", ""),
                     "prebuild_wait_s": r.get("prebuild_wait_s", ""), "warmup_s": r.get("warmup_s", ""),
                     "note": "regional compile; random weights; fresh = empty Inductor/Triton caches, second = "
                             "a second process on them, warmup = empty caches after `python -m vc_compile warmup`"})
    cols = ["variant", "mode", "first_call_s", "extra_s", "steady_s", "startup_s", "startup_extra_s", "process_s"]
    print_table(rows, cols)
    if not a.smoke:
        path = append_rows(BENCH, rows, extras=["mode", "steps", "first_call_s", "extra_s", "steady_s", "startup_s",
                                                "startup_extra_s", "process_s", "model", "layers", "sites", "note",
                                                "prebuild", "prebuild_wait_s", "warmup_s"])
        log(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
