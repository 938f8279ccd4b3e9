"""Autotuning cache on the H200: start-up cost of a first (tuning) run vs a second (cache-hit) run vs the
shipped table, and the tuned vs the shipped-default kernel time.

    python -m benchmarks.bench_tune                           # S = 32760, H = 40, D = 128, bf16, B = 1
    python -m benchmarks.bench_tune --csv $OUT/bench_tune.csv # also copy the rows there
    python -m benchmarks.bench_tune --smoke                   # CPU dry run (interpreter, tiny, nothing saved)

(a) Start-up: each row is a fresh subprocess, timed from its spawn to the end of its first finished
vcattn op call (``vcattn::vsmooth_attention`` / ``vcattn::sparse_attention`` at density 0.15, synchronised),
with its own ``VCATTN_CACHE_DIR``, ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR``:
* ``startup_<m>_first``: all three empty and the shipped table ignored (``vc_compile.tune.configure(
  shipped=False)``, as on a GPU we ship nothing for): compiles and tunes every candidate;
* ``startup_<m>_second``: the same directories again, shipped still ignored: a cache hit (no tuning;
  Triton's cache is warm too, as on any second run);
* ``startup_<m>_shipped``: fresh empty directories, shipped table used (an H100/H200 out of the box:
  one compile per kernel, no tuning); ``startup_<m>_shipped_warm``: the same directories again.
``note`` splits the time: import (torch + vc_compile), inputs, first op call; ``config`` is where each
kernel's config came from.
(b) ``kernel_<m>_tuned`` / ``kernel_<m>_default``: inside the first-run process, after its start-up
measurement, the tuned and the shipped default configuration timed with do_bench (``python -m vc_compile
tune``'s table); ``speedup_vs_cudnn`` is unused (empty).

A time guard (``--budget``, default 380 s) skips what would not finish and says so in the log.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.time()  # the child's own start (the parent measures from spawn)
ROOT = Path(__file__).resolve().parents[1]

B, H, S, D, DENSITY = 1, 40, 32760, 128, 0.15
SMOKE_SHAPE = (1, 1, 256, 64)
EXTRAS = ["config", "note"]
MODES = ("first", "second", "shipped", "shipped_warm")


def child(method: str, mode: str, smoke: bool) -> None:
    """One start-up measurement (run in a fresh process); prints one JSON line."""
    import torch

    import vc_compile  # noqa: F401  (registers torch.ops.vcattn.*)
    from vc_compile.tune import lookup

    t_import = time.time()
    if mode in ("first", "second"):
        lookup.configure(shipped=False)
    b, h, s, d = SMOKE_SHAPE if smoke else (B, H, S, D)
    dev = "cpu" if smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    if method == "mcsparse":
        from vc_compile.config import VCConfig
        from vc_compile.formats import n_keep

        C = VCConfig().group_size  # the runtime's query groups (what the shipped table and the CLI tune)
        keep, G = n_keep(s, DENSITY), -(-s // C)
        j = torch.arange(keep, device=dev)
        lo, hi = (j * s) // keep, ((j + 1) * s) // keep
        idx = (lo + (torch.rand(b, h, G, keep, device=dev, generator=g) * (hi - lo)).long()).to(torch.int32)
        sigma = torch.arange(s, device=dev).expand(b, h, s).contiguous()
        res = 0.01 * torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=g)
    if dev == "cuda":
        torch.cuda.synchronize()
    t_inputs = time.time()
    with lookup.recording() as sources:
        if method == "vsmooth":
            torch.ops.vcattn.vsmooth_attention(q, k, v, None)
        else:
            torch.ops.vcattn.sparse_attention(q, k, v, sigma, idx, res, C)
        if dev == "cuda":
            torch.cuda.synchronize()
    t_done = time.time()
    out = {"t_done": t_done, "import_s": t_import - T_START, "inputs_s": t_inputs - t_import,
           "call_s": t_done - t_inputs, "sources": dict(sources)}
    if mode == "first" and not smoke:  # (b): tuned vs shipped default, same process, cache now holds it
        from vc_compile import tune_cli as cli

        del q, k, v
        args = cli.parser().parse_args(["--method", method, "--heads", str(H), "--head-dim", str(D),
                                        "--seq", str(S), "--density", str(DENSITY)])
        out["kernel"] = cli.run(args)
    print("BENCH_TUNE " + json.dumps(out), flush=True)


def spawn(method: str, mode: str, dirs: dict, smoke: bool, timeout: float):
    env = {**os.environ, "VCATTN_CACHE_DIR": dirs["vcattn"], "TRITON_CACHE_DIR": dirs["triton"],
           "TORCHINDUCTOR_CACHE_DIR": dirs["inductor"], "PYTHONPATH": str(ROOT)}
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "benchmarks.bench_tune", "--child", method, mode] + (["--smoke"] if smoke else [])
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("BENCH_TUNE ")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"{method}/{mode} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    res = json.loads(line[-1][len("BENCH_TUNE "):])
    res["startup_s"] = res["t_done"] - t0
    res["stderr_tail"] = [ln for ln in r.stderr.splitlines() if "tuning" in ln][-4:]
    return res


def fresh_dirs(root: str, name: str) -> dict:
    return {k: tempfile.mkdtemp(prefix=f"{name}-{k}-", dir=root) for k in ("vcattn", "triton", "inductor")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=None, help="also copy the results CSV here")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: interpreter, tiny shapes, nothing saved")
    ap.add_argument("--budget", type=float, default=380.0, help="stop starting new runs after this (s)")
    ap.add_argument("--methods", default="vsmooth,mcsparse")
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args.smoke)
    import torch

    from benchmarks.common import print_table

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_tune: needs a CUDA GPU (H200); --smoke for a CPU dry run")
    t_begin = time.time()
    log = lambda m: print(f"[{time.time() - t_begin:6.1f} s] {m}", flush=True)  # noqa: E731
    rows, shape = [], SMOKE_SHAPE if args.smoke else (B, H, S, D)
    with tempfile.TemporaryDirectory(prefix="bench_tune-") as root:
        for method in args.methods.split(","):
            dirs = {"first": fresh_dirs(root, method + "-tune"), "shipped": fresh_dirs(root, method + "-ship")}
            dirs["second"], dirs["shipped_warm"] = dirs["first"], dirs["shipped"]
            for mode in MODES:
                left = args.budget - (time.time() - t_begin)
                if left < 20:
                    log(f"time guard: skipping {method}/{mode} ({left:.0f} s left of --budget {args.budget:.0f})")
                    continue
                log(f"{method}/{mode}: spawning a fresh process ...")
                try:
                    r = spawn(method, mode, dirs[mode], args.smoke, timeout=left)
                except subprocess.TimeoutExpired:
                    log(f"{method}/{mode}: hit the time guard, killed")
                    continue
                for ln in r["stderr_tail"]:
                    log("  " + ln.strip()[:160])
                src = " ".join(f"{k}x{v}" for k, v in sorted(r["sources"].items())) or "-"
                log(f"{method}/{mode}: {r['startup_s']:.1f} s to the first finished op ({src})")
                rows.append({"variant": f"startup_{method}_{mode}", "B": shape[0], "H": shape[1], "S": shape[2],
                             "D": shape[3], "density": DENSITY if method == "mcsparse" else "",
                             "ms": 1e3 * r["startup_s"], "config": src,
                             "note": f"import {r['import_s']:.1f} s, inputs {r['inputs_s']:.1f} s, "
                                     f"first call {r['call_s']:.1f} s"})
                for k in r.get("kernel", []):
                    rows.append({"variant": f"kernel_{method}_{'tuned' if k['which'] == 'chosen' else 'default'}",
                                 "B": B, "H": H, "S": S, "D": D, "density": DENSITY if method == "mcsparse" else "",
                                 "ms": k["ms"], "config": k["config"], "note": f"source {k['source']}"})
                    log(f"  {rows[-1]['variant']}: {k['ms']:.3f} ms ({k['config']})")
            if not args.smoke:  # per method: a later time-out keeps these rows
                save([r for r in rows if f"_{method}_" in r["variant"]], args.csv)
    for r in rows:
        for c in EXTRAS:
            r.setdefault(c, "")
    if rows:
        print_table(rows, ["variant", "S", "density", "ms", "config", "note"])
    print("smoke run: nothing saved" if args.smoke else f"rows appended to {save.path}")


def save(rows, csv_copy) -> None:
    from benchmarks.common import append_rows

    if not rows:
        return
    for r in rows:
        for c in EXTRAS:
            r.setdefault(c, "")
    save.path = append_rows("bench_tune", rows)
    if csv_copy:
        with open(save.path) as f_in, open(csv_copy, "w", newline="") as f_out:
            f_out.write(f_in.read())


save.path = "(nothing measured)"


if __name__ == "__main__":
    main()
