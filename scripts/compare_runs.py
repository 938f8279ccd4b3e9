"""Row-by-row speed of two benchmark runs (issue 22: "the same speeds, +-2%, before and after in one run").

    python -m scripts.compare_runs --a OLD.csv:COMMIT --b NEW.csv:COMMIT [--out FILE] [--tol 0.02]

Rows are matched on (bench, variant, B, H, S, D, density); for each variant measured in both runs the
ratio ``ms_b / ms_a`` is printed with a flag when it leaves 1 +- tol. Timing rows only (ms > 0).
If a commit is measured more than once in a file, its last row per key counts.
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys

KEY = ("bench", "variant", "B", "H", "S", "D", "density")


def load(spec: str) -> dict:
    path, _, commit = spec.rpartition(":")
    rows = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("commit") != commit:
                continue
            try:
                ms = float(r["ms"])
            except (KeyError, ValueError):
                continue
            if ms > 0 and math.isfinite(ms):
                rows[tuple(r.get(k, "") for k in KEY)] = ms
    return rows


def compare(a: dict, b: dict, tol: float):
    out = []
    for key in sorted(set(a) & set(b)):
        r = b[key] / a[key]
        out.append((key, a[key], b[key], r, abs(r - 1.0) > tol))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="OLD.csv:COMMIT")
    ap.add_argument("--b", required=True, help="NEW.csv:COMMIT")
    ap.add_argument("--tol", type=float, default=0.02)
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    a, b = load(args.a), load(args.b)
    res = compare(a, b, args.tol)
    lines = [f"{'variant':34s} {'S':>6s} {'D':>4s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s}"]
    for key, ma, mb, r, flag in res:
        lines.append(f"{key[1]:34s} {key[4]:>6s} {key[5]:>4s} {ma:9.3f} {mb:9.3f} {r:8.3f}"
                     + ("  <-- outside +-%.0f%%" % (100 * args.tol) if flag else ""))
    if res:
        ratios = [r for *_, r, _ in res]
        lines.append(f"{len(res)} rows: median new/old {statistics.median(ratios):.3f}, "
                     f"min {min(ratios):.3f}, max {max(ratios):.3f}; "
                     f"{sum(f for *_, f in res)} outside +-{100 * args.tol:.0f}%")
    else:
        lines.append(f"no common rows ({len(a)} old, {len(b)} new)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
