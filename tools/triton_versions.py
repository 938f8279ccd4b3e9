"""Every kernel built offline for sm_90 on several Triton releases, compared with the first (the baseline).

    python3 -m tools.triton_versions PYTHON [PYTHON ...] [--out DIR] [--only gluon,sm90_sparse,...]

Each PYTHON is an interpreter whose environment holds one Triton release (a venv with
``--system-site-packages`` over this checkout's environment and ``pip install triton==X``). Per interpreter,
``tests/codegen_fingerprint.py`` compiles every kernel configuration a default or a tuner candidate launches
(the fake-driver warm-up compile, no GPU) and records per kernel: its SASS length, its key loops' lengths
(the longest backward branch; the Gluon kernels' register-P~ loop and MMA window, the gather kernel's
consumer and producer loops), registers and spill bytes. The table lists, per release against the baseline,
the kernels that did not build, those that spill more (apart: the ExpCast builds whose spill the byte-mask guard
replaces at run time by their FMNMX build, where that build spills no more than the baseline), and those whose key
loop moved by more than ``--tolerance`` (default 2%). Exit status 1 where a kernel did not build on some release.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

S_MAIN = 32760  # the sequence length the kernels are built for (tests/codegen_fingerprint.S_MAIN)
LOOPS = ("loop", "preg_loop", "smem_window", "consumer_loop", "producer_loop")


def fingerprints(python: str, out: str, only: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests")])  # the offline sm_90 build lives there
    r = subprocess.run([python, "-m", "codegen_fingerprint", "--out", out, "--only", only], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{python}: codegen_fingerprint failed:\n{r.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def version(python: str) -> str:
    r = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 else "?"


# a build of the ExpCast kernel's byte-mask clamp that spills more than this is replaced at run time by its FMNMX
# build (vc_compile/kernels/vsmooth_attn_sm90.py, BytemaskGuard's default limit); its case is the kernel's name
# with codegen_fingerprint.FMNMX before the '#'
GUARD_LIMIT = 64
FMNMX = "_fmnmx"


def compare(base: dict, other: dict, tol: float) -> dict:
    missing = sorted(k for k in base if k not in other)
    spills, moved, guarded = [], [], []
    for k, x in sorted(base.items()):
        y = other.get(k)
        if y is None:
            continue
        if y["spill_bytes"] > max(x["spill_bytes"], 0):
            alt = other.get(k.replace("#", FMNMX + "#", 1))
            if alt is not None and y["spill_bytes"] > GUARD_LIMIT and alt["spill_bytes"] <= max(x["spill_bytes"], 0):
                guarded.append((k, x["kernel"], x["spill_bytes"], y["spill_bytes"], alt["spill_bytes"]))
            else:
                spills.append((k, x["kernel"], x["spill_bytes"], y["spill_bytes"]))
        for name in LOOPS:
            if x.get(name) and y.get(name) is not None and abs(y[name] / x[name] - 1) > tol:
                moved.append((k, x["kernel"], name, x[name], y[name]))
    return {"missing": missing, "spills": spills, "moved": moved, "guarded": guarded, "built": len(other),
            "of": len(base)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pythons", nargs="+")
    ap.add_argument("--out", default="/tmp/triton_versions")
    ap.add_argument("--only", default="gluon,sm90_sparse,anchor,triton,sparse,pre,aux")
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--csv", default=None, help="append one row per release (against the baseline) to this CSV "
                                                "(benchmarks/results/triton_versions.csv)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    runs = []
    for py in a.pythons:
        v = version(py)
        print(f"triton {v} ({py}): compiling ...", flush=True)
        runs.append((v, fingerprints(py, os.path.join(a.out, f"fingerprint_{v}.json"), a.only)))
    (bv, base), bad = runs[0], 0
    for v, fp in runs[1:]:
        c = compare(base, fp, a.tolerance)
        bad += bool(c["missing"])
        print(f"\n## Triton {v} against {bv}: {c['built']} of {c['of']} kernels built, {len(c['spills'])} spill "
              f"more, {len(c['moved'])} key loops moved by more than {a.tolerance:.0%}")
        for k in c["missing"]:
            print(f"  not built: {k}")
        for k, kern, b0, b1 in c["spills"]:
            print(f"  spills:    {k} ({kern}) {b0} -> {b1} bytes")
        for k, kern, b0, b1, b2 in c["guarded"]:
            print(f"  guarded:   {k} ({kern}) {b0} -> {b1} bytes; runs its FMNMX build ({b2} bytes) instead")
        for k, kern, name, n0, n1 in c["moved"]:
            print(f"  loop:      {k} ({kern}) {name} {n0} -> {n1} ({n1 / n0 - 1:+.1%})")
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({v: compare(base, fp, a.tolerance) for v, fp in runs[1:]}, f, indent=1)
    if a.csv:
        write_rows(a.csv, runs, a.tolerance)
    return 1 if bad else 0


# the columns after the agreed ones (benchmarks/common.COLUMNS): one row per release, ``triton`` the release built
EXTRAS = ["baseline", "kernels", "built", "spill_more", "spill_guarded", "spill_more_kernels", "spill_bytes",
          "baseline_spill_bytes", "loops_moved", "tolerance", "wgmma_serialized", "baseline_wgmma_serialized",
          "serialized_kernels"]


def rows(runs, tol: float, env: dict) -> list:
    """One row per release: what built, spilled more, moved its key loop, had its wgmmas serialised by ptxas.
    ``env``: the agreed columns' run facts (``benchmarks.common.env_info``); ``gpu`` names the offline target."""
    (bv, base) = runs[0]
    ser = lambda fp: sorted(k.split("#")[0] for k, x in fp.items() if x.get("serialized"))  # noqa: E731
    out = []
    for v, fp in runs:
        c = compare(base, fp, tol)
        out.append({**env, "gpu": "none (offline sm_90 build)", "triton": v, "bench": "triton_versions",
                    "variant": f"Triton {v} against {bv}", "S": S_MAIN, "baseline": bv, "kernels": c["of"],
                    "built": c["built"], "spill_more": len(c["spills"]), "spill_guarded": len(c["guarded"]),
                    "spill_more_kernels": " ".join(sorted(k.split("#")[0] for k, *_ in c["spills"])),
                    "spill_bytes": sum(max(0, x["spill_bytes"]) for x in fp.values()),
                    "baseline_spill_bytes": sum(max(0, x["spill_bytes"]) for x in base.values()),
                    "loops_moved": len(c["moved"]), "tolerance": tol, "wgmma_serialized": len(ser(fp)),
                    "baseline_wgmma_serialized": len(ser(base)),
                    "serialized_kernels": " ".join(sorted(set(ser(fp)) - set(ser(base))))})
    return out


def write_rows(path: str, runs, tol: float) -> None:
    """Append ``rows`` to ``path`` with the agreed leading columns (``benchmarks.common.append_csv``)."""
    from benchmarks.common import COLUMNS, append_csv, env_info
    env = {k: v for k, v in env_info().items() if k in COLUMNS}
    append_csv(path, rows(runs, tol, env), columns=COLUMNS + EXTRAS)


if __name__ == "__main__":
    sys.exit(main())
