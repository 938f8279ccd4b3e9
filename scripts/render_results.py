"""Docs tables and plots from the benchmark CSVs (the latest row of every variant).

    python scripts/render_results.py                     # markdown tables to stdout, plots to docs/img/
    python scripts/render_results.py --no-plots          # tables only
    python scripts/render_results.py --results-dir DIR --img-dir DIR

Tables (markdown, printed):
* the README's headline table, from ``benchmarks/results/bench_pipeline.csv``: per model / size / compile
  mode / step count, every method's generation time, speed-up vs stock Inductor + cuDNN (measured in the
  same process), first generation and its difference to stock's, attention time by phase, rel. L2 of the
  final latents vs stock;
* whole-generation bare attention, from ``bench_generation.csv``: per shape, total attention time over the
  generation, x cuDNN, x FA4, time by phase, first generation, rel. L2 vs fp32; and the reuse-step
  breakdown (share of the step outside the attention kernels).
Plots (matplotlib, the ``bench`` extra; skipped with a message when it is missing):
``docs/img/bench_pipeline_speedup.png`` (speed-up per method, issue 20's targets marked),
``docs/img/bench_generation_phases.png`` (attention time by phase per method and shape) and
``docs/img/bench_generation_steps.png`` (per-step attention time over one generation).
"Latest" = the last row (file order = time order) of each variant within its group.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("dense", "group", "anchor", "reuse")
NAMES = {"stock": "stock (Inductor + cuDNN)", "dense": "dense (SDPA through vcattn)", "vsmooth": "V-Smooth",
         "vsmooth+expcast": "V-Smooth + ExpCast", "mcsparse@0.15": "MC-Sparse s = 0.15",
         "mcsparse@0.25": "MC-Sparse s = 0.25", "sdpa_cudnn": "cuDNN (bf16)", "fa4-bf16": "FA4 (bf16)"}
ORDER = ["stock", "sdpa_cudnn", "fa4-bf16", "dense", "vsmooth", "vsmooth+expcast", "mcsparse@0.15", "mcsparse@0.25"]
# issue 20's targets: end to end (1.3B, 32760 tokens) and bare attention over a generation (x cuDNN)
TARGET_E2E = {"vsmooth": 1.30, "vsmooth+expcast": 1.35, "mcsparse@0.15": 2.0, "mcsparse@0.25": 1.8}
TARGET_GEN = {"vsmooth": 1.35, "vsmooth+expcast": 1.45, "mcsparse@0.15": 3.0}


def read(path: str) -> List[Dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(x) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def latest(rows: List[Dict[str, str]], group: Sequence[str]) -> Dict[tuple, Dict[str, Dict[str, str]]]:
    """{group key: {variant: its last row}} (file order), groups and variants in order of appearance."""
    out: Dict[tuple, Dict[str, Dict[str, str]]] = {}
    for r in rows:
        out.setdefault(tuple(r.get(c, "") for c in group), {})[r["variant"]] = r
    return out


def _order(variants):
    return sorted(variants, key=lambda v: (ORDER.index(v) if v in ORDER else len(ORDER), v))


def f(x, fmt="{:.2f}", none="-") -> str:
    v = num(x)
    return fmt.format(v) if v is not None else none


def sec(ms) -> str:
    """milliseconds -> seconds with one decimal, "-" when missing."""
    v = num(ms)
    return f"{v / 1e3:.1f}" if v is not None else "-"


def md_table(head: List[str], body: List[List[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


PIPE_GROUP = ("model", "S", "layers", "steps", "guidance", "compile")


def pipeline_tables(rows) -> List[str]:
    out = []
    for key, by_var in latest(rows, PIPE_GROUP).items():
        model, S, layers, steps, guidance, mode = key
        any_row = next(iter(by_var.values()))
        body = []
        for v in _order(by_var):
            r = by_var[v]
            phases = " / ".join(sec(r.get(f"attn_{p}_ms")) for p in PHASES)
            extra = num(r.get("first_generation_extra_s"))
            first = f(r.get("first_generation_s"), "{:.1f}") + (f" ({extra:+.1f})" if extra is not None
                                                                and v != "stock" else "")
            body.append([NAMES.get(v, v), sec(r.get("ms")), f(r.get("speedup_vs_stock"), "{:.2f}x"), first,
                         sec(r.get("attn_ms")), phases, f(r.get("rel_l2"), "{:.2e}")])
        title = (f"**{model}, {S} tokens, {layers} layers, {steps} steps, CFG {guidance}, {mode} compile** "
                 f"({any_row.get('gpu')}, torch {any_row.get('torch')}, {any_row.get('date')}, commit "
                 f"{any_row.get('commit')}; random weights: speed only, not quality)")
        out.append(title + "\n\n" + md_table(
            ["method", "s / generation", "speed-up vs stock", "first generation s (vs stock)", "attention s",
             "attention s: dense / group / anchor / reuse", "rel. L2 vs stock"], body))
    return out


GEN_GROUP = ("S", "H", "D", "steps")


def generation_tables(rows) -> List[str]:
    out = []
    for key, by_var in latest(rows, GEN_GROUP).items():
        S, H, D, steps = key
        main = {v: r for v, r in by_var.items() if not v.endswith(":reuse_breakdown")}
        brk = {v.split(":")[0]: r for v, r in by_var.items() if v.endswith(":reuse_breakdown")}
        any_row = next(iter(by_var.values()))
        body = []
        for v in _order(main):
            r = main[v]
            ph = " / ".join(f"{f(r.get(f'ms_{p}'), '{:.0f}')} ({r.get(f'n_{p}') or 0})" for p in PHASES) \
                if num(r.get("n_reuse")) is not None else "-"
            body.append([NAMES.get(v, v), f(r.get("ms"), "{:.0f}"), f(r.get("speedup_vs_cudnn"), "{:.2f}x"),
                         f(r.get("speedup_vs_fa4"), "{:.2f}x"), ph, f(r.get("first_generation_s"), "{:.1f}"),
                         f(r.get("rel_l2"), "{:.2e}")])
        txt = (f"**Bare attention over a {steps}-step generation, B=1 H={H} S={S} D={D} bf16** "
               f"({any_row.get('gpu')}, {any_row.get('date')}, commit {any_row.get('commit')})\n\n")
        txt += md_table(["method", "attention ms (sum)", "x cuDNN", "x FA4",
                         "ms (steps): dense / group / anchor / reuse", "first generation s", "rel. L2 vs fp32"], body)
        if brk:
            rows_b = [[NAMES.get(v, v), f(r.get("ms"), "{:.2f}"), f(r.get("attn_kernel_ms"), "{:.2f}"),
                       f(r.get("other_kernels_ms"), "{:.2f}"), f(r.get("gap_ms"), "{:.2f}"),
                       f(r.get("host_ms"), "{:.2f}"),
                       f(num(r.get("outside_share")) * 100 if num(r.get("outside_share")) is not None else None,
                         "{:.1f}%")] for v, r in ((v, brk[v]) for v in _order(brk))]
            txt += "\n\nReuse step: time outside the attention kernels (target <= 5%)\n\n" + md_table(
                ["method", "step ms", "attention kernels ms", "other kernels ms", "gaps ms", "op host ms",
                 "outside share"], rows_b)
        out.append(txt)
    return out


def plots(pipe_rows, gen_rows, img_dir) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        print("matplotlib not installed: plots skipped (pip install matplotlib: the 'bench' extra)", file=sys.stderr)
        return []
    os.makedirs(img_dir, exist_ok=True)
    written = []
    groups = latest(pipe_rows, PIPE_GROUP)
    if groups:
        methods = _order({v for g in groups.values() for v in g if v != "stock"})
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(methods)), 4))
        w = 0.8 / len(groups)
        for gi, (key, by_var) in enumerate(groups.items()):
            ys = [num(by_var.get(m, {}).get("speedup_vs_stock")) or 0 for m in methods]
            xs = [i + gi * w for i in range(len(methods))]
            bars = ax.bar(xs, ys, w, label=f"{key[0]} {key[1]} tok, {key[5]}, {key[3]} steps")
            ax.bar_label(bars, fmt="%.2fx", fontsize=7)
        for i, m in enumerate([m for m in methods if m in TARGET_E2E]):
            j = methods.index(m)
            ax.plot([j - w / 2, j + 0.8 - w / 2], [TARGET_E2E[m]] * 2, "k--", lw=1,
                    label="issue 20 target (1.3B, 32760 tokens)" if i == 0 else None)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(methods))], [NAMES.get(m, m) for m in methods], fontsize=8)
        ax.set_ylabel("end-to-end speed-up vs stock Inductor + cuDNN")
        ax.set_title("WanPipeline, random weights (speed only, not quality)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(os.path.join(img_dir, "bench_pipeline_speedup.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    ggroups = latest(gen_rows, GEN_GROUP)
    if ggroups:
        fig, axes = plt.subplots(1, len(ggroups), figsize=(4.5 * len(ggroups), 3.8), squeeze=False)
        colors = {"dense": "#999999", "group": "#e69f00", "anchor": "#d55e00", "reuse": "#0072b2", "total": "#555555"}
        for ax, (key, by_var) in zip(axes[0], ggroups.items()):
            vs = [v for v in _order(by_var) if not v.endswith(":reuse_breakdown")]
            for i, v in enumerate(vs):
                r, left = by_var[v], 0.0
                if num(r.get("n_reuse")) is None:  # a baseline: one bar
                    ax.barh(i, num(r.get("ms")) or 0, color=colors["total"])
                    continue
                for p in PHASES:
                    t = num(r.get(f"ms_{p}")) or 0.0
                    ax.barh(i, t, left=left, color=colors[p], label=p if i == len(vs) - 1 else None)
                    left += t
            ax.set_yticks(range(len(vs)), [NAMES.get(v, v) for v in vs], fontsize=7)
            ax.set_title(f"S={key[0]} H={key[1]}: attention ms over {key[3]} steps", fontsize=8)
            ax.legend(fontsize=6)
        fig.tight_layout()
        written.append(os.path.join(img_dir, "bench_generation_phases.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
        key, by_var = next(iter(ggroups.items()))
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for v in _order(by_var):
            ts = [num(x) for x in (by_var[v].get("step_ms") or "").split()]
            if ts and all(t is not None for t in ts):
                ax.plot(range(len(ts)), ts, label=NAMES.get(v, v), lw=1.2)
        ax.set_xlabel("denoising step")
        ax.set_ylabel("attention ms")
        ax.set_title(f"per-step attention time, S={key[0]} H={key[1]} D={key[2]}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(os.path.join(img_dir, "bench_generation_steps.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--img-dir", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    pipe = read(os.path.join(a.results_dir, "bench_pipeline.csv"))
    gen = read(os.path.join(a.results_dir, "bench_generation.csv"))
    parts = []
    if pipe:
        parts += ["## End to end: WanPipeline (bench_pipeline.csv)", *pipeline_tables(pipe)]
    if gen:
        parts += ["## Bare attention over a whole generation (bench_generation.csv)", *generation_tables(gen)]
    if not parts:
        parts = [f"no bench_pipeline.csv / bench_generation.csv rows under {a.results_dir}"]
    text = "\n\n".join(parts)
    print(text)
    if not a.no_plots:
        for p in plots(pipe, gen, a.img_dir):
            print(f"wrote {os.path.relpath(p)}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
