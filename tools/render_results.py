"""Docs tables and plots from the benchmark CSVs (the latest row of every variant).

    python -m tools.render_results                     # markdown tables to stdout, plots to docs/img/
    python -m tools.render_results --write             # also rewrite the marked blocks of README.md and docs/
    python -m tools.render_results --no-plots          # tables only
    python -m tools.render_results --results-dir DIR --img-dir DIR

``--write`` replaces the text between ``<!-- results:NAME:begin -->`` and ``<!-- results:NAME:end -->`` in
README.md and docs/performance.md (``--docs FILE ...`` to choose) with block NAME (``blocks()``):
``pipeline``, ``generation``, ``kernels``, ``kernels-summary``, ``kernels-sm90``, ``sparse-sm90``,
``schedule``, ``vsmooth-schedule``, ``op-overhead``, ``cold-start``, ``key-padding``, ``e2e``, ``toolchain``
(the other blocks show the reference Triton release's rows only, ``REFERENCE_TRITON``). A block whose CSV has no rows says
"no rows yet" (it never keeps or invents numbers); a broken marker is an error naming the file and block.

Tables (markdown, printed):
* the README's headline table, from ``benchmarks/results/bench_pipeline.csv``: per model / size / compile
  mode / step count, every method's generation time, speed-up vs stock Inductor + cuDNN (measured in the
  same process), first generation and its difference to stock's, attention time by phase, rel. L2 of the
  final latents vs stock;
* whole-generation bare attention, from ``bench_generation.csv``: per shape, total attention time over the
  generation, x cuDNN, x FA4, time by phase, first generation, rel. L2 vs fp32; and the reuse-step
  breakdown (share of the step outside the attention kernels).
* the kernel benchmarks, from ``bench_vsmooth_attn.csv`` and ``bench_sparse_attn.csv``: the latest row of
  each headline variant at B=1 H=40 D=128, S = 32760 / 75600, with x cuDNN (the row's own run) and x FA4
  (the ``fa4-bf16`` row of the same run, where one exists);
* the demo model end to end, from ``bench_e2e.csv`` (bench ``e2e``): the latest row of each variant per size.
Plots (matplotlib, the ``bench`` extra; skipped with a message when it is missing):
``docs/img/bench_pipeline_speedup.png`` (speed-up per method, the targets marked),
``docs/img/bench_generation_phases.png`` (attention time by phase per method and shape) and
``docs/img/bench_generation_steps.png`` (per-step attention time over one generation).
"Latest" = the last row (file order = time order) of each variant within its group, on one GPU: the blocks
render each GPU's rows apart, the H200's (the figures of record) first and any other GPU's under its name.
"""
from __future__ import annotations

import argparse
import glob
import csv
import math
import os
import re
import statistics
import sys
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("dense", "warmup", "group", "anchor", "reuse")  # warmup: MC-Sparse's V-Smooth warm-up
NAMES = {"stock": "stock (Inductor + cuDNN)", "dense": "dense (SDPA through vcattn)", "vsmooth": "V-Smooth",
         "vsmooth+expcast": "V-Smooth + ExpCast", "mcsparse@0.15": "MC-Sparse s = 0.15",
         "mcsparse@0.25": "MC-Sparse s = 0.25", "mcsparse+int8@0.15": "MC-Sparse s = 0.15, 8-bit QK",
         "sdpa_cudnn": "cuDNN (bf16)", "fa4-bf16": "FA4 (bf16)",
         "torchao-fp8": "torchao FP8 attention (FA3 FP8)", "sage": "SageAttention (diffusers backend)",
         "fa4": "FA4 (torch flash SDPA)"}
ORDER = ["stock", "sdpa_cudnn", "fa4-bf16", "fa4", "torchao-fp8", "sage", "dense", "vsmooth", "vsmooth+expcast",
         "mcsparse@0.15", "mcsparse+int8@0.15", "mcsparse@0.25"]
# the targets: end to end (1.3B, 32760 tokens) and bare attention over a generation (x cuDNN)
TARGET_E2E = {  # per model: the pipeline benchmark's targets (1.3B: 50 steps; 14B at 720p: 10 steps)
    "wan2.1-t2v-1.3b": {"vsmooth": 1.30, "vsmooth+expcast": 1.40, "mcsparse@0.15": 2.0,
                        "vsmooth+expcast+f8lin": 1.5, "mcsparse@0.15+f8lin": 2.2},
    "wan2.1-t2v-14b": {"vsmooth+expcast": 1.40, "mcsparse@0.15": 2.1}}
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


F8, DBC = "+f8lin", "+dbcache"  # bench_pipeline: torchao float8 linears in the blocks; cache-dit's DBCache
STACK_NAMES = {F8: "float8 linears", DBC: "cache-dit DBCache"}


def _split(v: str):
    """(base variant, stack suffixes in order): ``"mcsparse@0.15+f8lin+dbcache"`` -> (``"mcsparse@0.15"``,
    [``"+f8lin"``, ``"+dbcache"``])."""
    found = []
    for suffix in (DBC, F8):
        if v.endswith(suffix):
            found.insert(0, suffix)
            v = v[:-len(suffix)]
    return v, found


def name(v: str) -> str:
    """A variant's display name; ``<v>+f8lin`` = ``<v>``'s + float8 linears (``stock+f8lin``: those alone), the
    same for ``+dbcache``."""
    b, found = _split(v)
    if not found:
        return NAMES.get(v, v)
    if b == "stock":
        return " + ".join({F8: "float8 linears (torchao)", DBC: "cache-dit DBCache"}[x] for x in found) + \
            ", attention stock"
    return f"{NAMES.get(b, b)} + " + " + ".join(STACK_NAMES[x] for x in found)


def _pipe_order(variants):
    """stock, the peers, the methods, then the stacks (float8 linears, the cache, both) in the same order."""
    def key(v):
        b, found = _split(v)
        return len(found), tuple((F8, DBC).index(x) for x in found), ORDER.index(b) if b in ORDER else len(ORDER), v
    return sorted(variants, key=key)


def _runs(rows) -> str:
    """The runs a table's rows come from: ``date commit (variants)``, earliest first."""
    runs: Dict[str, list] = {}
    for v, r in rows.items():
        run = runs.setdefault(r.get("commit") or "?", [r.get("date") or "?", []])
        run[0], _ = min(run[0], r.get("date") or "?"), run[1].append(v)
    return "; ".join(f"{d} commit {c} ({', '.join(name(v) for v in _pipe_order(vs))})"
                     for c, (d, vs) in sorted(runs.items(), key=lambda kv: kv[1][0]))


def pipeline_tables(rows) -> List[str]:
    """The README's headline: per model / size / step count / compile mode, the latest row of every variant, speed
    and attention error side by side (x torchao's error where a torchao row has one). A table whose rows come from
    several runs names them; each speed-up is against the stock variant of the row's own run."""
    out = []
    # a run of the first N steps of a longer schedule (--schedule) belongs with that schedule's rows; an A/B
    # variant ("<method>:<change>") belongs to the design record that names it
    rows = [{**r, "steps_run": r.get("steps"), "steps": r.get("schedule") or r.get("steps")} for r in rows
            if ":" not in r["variant"]]
    for key, by_var in latest(rows, PIPE_GROUP).items():
        model, S, layers, steps, guidance, mode = key
        any_row = by_var.get("stock") or next(iter(by_var.values()))
        ao = num((by_var.get("torchao-fp8") or {}).get("attn_rel_l2"))
        mem = any(num(r.get("peak_mem_gb")) is not None for r in by_var.values())  # runs that measured memory
        body = []
        for v in _pipe_order(by_var):
            r = by_var[v]
            phases = " / ".join(sec(r.get(f"attn_{p}_ms")) for p in PHASES)
            extra = num(r.get("first_generation_extra_s"))
            first = f(r.get("first_generation_s"), "{:.1f}") + (f" ({extra:+.1f})" if extra is not None
                                                                and v != "stock" else "")
            err = f(r.get("attn_rel_l2"), "{:.2e}")
            e = num(r.get("attn_rel_l2"))
            if ao and e is not None and v != "torchao-fp8" and v != "stock":
                err += f" ({e / ao:.2f}x torchao)"
            bound = " (at the warm-up's rate)" if "priced at the warm-up's median" in (r.get("note") or "") else ""
            body.append([name(v), sec(r.get("ms")) + bound, f(r.get("speedup_vs_stock"), "{:.2f}x"), first,
                         sec(r.get("attn_ms")), phases, f(r.get("rel_l2"), "{:.2e}"), err]
                        + ([f(r.get("peak_mem_gb"), "{:.1f}") + " / " + f(r.get("metadata_gb"), "{:.1f}")]
                           if mem else []))
        cut = next((m.group(0) for m in (re.search(r"cut to \d+ of \d+ layers", r.get("note") or "")
                                         for r in by_var.values()) if m), None)
        title = (f"**{model}, {S} tokens, {layers} layers{' (' + cut + ')' if cut else ''}, {steps} steps, CFG "
                 f"{guidance}, {mode} compile** ({any_row.get('gpu')}, torch {any_row.get('torch')}; random weights: "
                 f"speed only, not quality). Runs: {_runs(by_var)}")
        if len({r.get("commit") for r in by_var.values()}) > 1:
            title += "; each speed-up against the stock generation of its own run"
        title += "."
        part = {v: r["steps_run"] for v, r in by_var.items() if str(r.get("steps_run")) != str(steps)}
        if part:
            title += (" Extrapolated: " + ", ".join(f"{name(v)} ran the first {r} steps" for v, r in part.items())
                      + f" of the {steps}-step schedule; s / generation = each phase's median step time over the "
                        "schedule's phases.")
        fs, caches = num(any_row.get("first_steps")), any_row.get("caches") or ""
        per_run = {}  # first-generation steps -> the commits whose runs used that many
        for r in by_var.values():
            per_run.setdefault(num(r.get("first_steps")) or num(steps), set()).add(r.get("commit") or "?")
        if len(per_run) > 1:  # runs timed different first generations: say which, each against its own stock
            title += (" First generation = torch.compile + kernel builds + the first steps: "
                      + "; ".join(f"{n:.0f} in {', '.join(sorted(c))}" for n, c in sorted(per_run.items()))
                      + " (each difference against the stock variant of the same run).")
        elif (fs is not None and fs < num(steps)) or caches == "shared":
            title += (f" First generation = torch.compile + kernel builds + {fs or steps:.0f} steps"
                      + (", Inductor/Triton caches shared between the variants (a later variant reuses "
                         "kernels an earlier one built)" if caches == "shared" else
                         ", Inductor/Triton caches fresh per variant, the process warm after the first variant (a cold "
                         "start per process: `benchmarks/bench_cold_start.py`)") + ".")
        notes = []
        if any(not _is_method(v) and num(r.get("attn_ms")) is not None for v, r in by_var.items()):
            notes.append("Attention s of stock and the peers: their attention kernels in one profiled step x the "
                         "steps (torchao's: the FA3 kernel, not its quantisation kernels); of the methods: the op, "
                         "preprocessing included, over a profiled generation by phase.")
        if any(DBC in _split(v)[1] for v in by_var):
            notes.append("cache-dit DBCache: `enable_cache` with a static step mask (the rows' notes say how many "
                         "steps it computed); a cached step runs the first blocks only.")
        if any(F8 in _split(v)[1] for v in by_var):
            notes.append("float8 linears: torchao `quantize_` with `Float8DynamicActivationFloat8WeightConfig` "
                         "(per-row) on the blocks' linear layers, in the same compile as the attention.")
        out.append(title + "\n\n" + md_table(
            ["method", "s / generation", "speed-up vs stock", "first generation s (vs stock)", "attention s",
             "attention s: " + " / ".join(PHASES), "final latents rel. L2 vs stock",
             "attention rel. L2 vs fp32 (captured inputs)"]
            + (["GB peak allocated / metadata held (first timed generation)"] if mem else []), body)
            + ("\n\n" + " ".join(notes) if notes else ""))
    return out


def _is_method(v: str) -> bool:
    b = _split(v)[0]
    return b.startswith(("vsmooth", "mcsparse", "dense"))


GEN_GROUP = ("S", "H", "D", "steps")


def generation_tables(rows) -> List[str]:
    out = []
    for key, by_var in latest(rows, GEN_GROUP).items():
        S, H, D, steps = key
        main = {v: r for v, r in by_var.items() if ":" not in v}  # an A/B label ("<method>:<change>"): its record
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
        several = len({r.get("commit") for r in main.values()}) > 1
        txt = (f"**Bare attention over a {steps}-step generation, B=1 H={H} S={S} D={D} bf16** "
               f"({any_row.get('gpu')}; runs: {_runs(main)})"
               + (": each x cuDNN against the cuDNN row of its own run" if several else "") + "\n\n")
        txt += md_table(["method", "attention ms (sum)", "x cuDNN", "x FA4",
                         "ms (steps): " + " / ".join(PHASES), "first generation s", "rel. L2 vs fp32"], body)
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
        methods = _pipe_order({v for g in groups.values() for v in g if v != "stock"})
        fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(methods)), 4.2))
        w = 0.8 / len(groups)
        first_target = True
        for gi, (key, by_var) in enumerate(groups.items()):
            xs = [i + gi * w for i, m in enumerate(methods) if num(by_var.get(m, {}).get("speedup_vs_stock"))]
            ys = [num(by_var[m]["speedup_vs_stock"]) for m in methods if num(by_var.get(m, {}).get("speedup_vs_stock"))]
            layers = f", {key[2]} layers" if key[0] == "wan2.1-t2v-14b" else ""
            bars = ax.bar(xs, ys, w, label=f"{key[0]} {key[1]} tok{layers}, {key[5]}, {key[3]} steps")
            ax.bar_label(bars, fmt="%.2fx", fontsize=7)
            for m, t in TARGET_E2E.get(key[0], {}).items():
                if m in methods:
                    x = methods.index(m) + gi * w
                    ax.plot([x - w / 2, x + w / 2], [t, t], "k--", lw=1, label="target" if first_target else None)
                    first_target = False
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(methods))],
                      [name(m).replace(" + float8", "\n+ float8").replace(" + cache-dit", "\n+ cache-dit").replace(", attention", "\nattention")
                       for m in methods], fontsize=7)
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
        colors = {"dense": "#999999", "warmup": "#cc79a7", "group": "#e69f00", "anchor": "#d55e00", "reuse": "#0072b2", "total": "#555555"}
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
    return written


KERNEL_S = ("32760", "75600")
# (variant, density rounded to 2 places or None, what it is[, the config column it must have]): the headline
# rows of each kernel benchmark
KERNEL_ROWS = {
    "bench_vsmooth_attn": [
        ("sdpa_cudnn", None, "SDPA cuDNN (bf16)"), ("fa4-bf16", None, "FlashAttention-4 (bf16)"),
        ("fa3-fp8", None, "FlashAttention-3 FP8 kernel (inputs quantised per head, outside the timing)"),
        ("torchao-fp8", None, "torchao 0.18 FP8 attention op (its quantisation + the FA3 FP8 kernel)"),
        ("sageattn_1.0.6", None, "SageAttention 1.0.6"), ("naive8_kernel", None, "naive 8-bit kernel"),
        ("vsmooth_kernel", None, "V-Smooth kernel"), ("vsmooth_op", None, "V-Smooth op (+ preprocessing)"),
        ("vsmooth_group_step", None, "V-Smooth grouping step (+ k-means)"),
        ("vsmooth_expcast_kernel", None, "V-Smooth + ExpCast kernel"),
        ("vsmooth_expcast_op", None, "V-Smooth + ExpCast op"),
        ("vsmooth_expcast_group_step", None, "V-Smooth + ExpCast grouping step"),
        ("preprocess", None, "preprocessing of Q, K, V (reuse step)")],
    "bench_sparse_attn": [
        ("sdpa_cudnn", None, "SDPA cuDNN (bf16)"), ("fa4-bf16", None, "FlashAttention-4 (bf16)"),
        ("sparse_bf16_c128", 0.10, "gather kernel, C = 128"), ("sparse_bf16_c128", 0.15, "gather kernel, C = 128"),
        ("sparse_bf16_c128", 0.25, "gather kernel, C = 128"),
        ("reuse_bf16_c128", 0.15, "reuse step (gather + residual), C = 128"),
        ("ab_kvoff_reuse_c128", 0.15, "reuse step, C = 128, kv_off, BN 64 (the shipped config; A/B rows)",
         "BN64_w4_s3"),
        ("reuse_bf16", 0.15, "reuse step (gather + residual), C = 64"),
        ("anchor_total", 0.15, "anchor step (two passes, PDDP, residual)"), ("pddp", None, "Fast PDDP grouping")],
}


def _dens(r) -> Optional[float]:
    d = num(r.get("density"))
    return None if d is None or d >= 1.0 else round(d, 2)


def _kernel_latest(rows, wanted):
    """({(S, variant, density): latest row}, {(date, commit, S): {variant: row}}) of the headline rows."""
    need = {w[0]: w[3] for w in wanted if len(w) > 3}
    last: Dict[tuple, Dict[str, str]] = {}
    runs: Dict[tuple, Dict[str, Dict[str, str]]] = {}
    for r in rows:
        if r["variant"] in need and r.get("config") != need[r["variant"]]:
            continue
        last[(r["S"], r["variant"], _dens(r))] = r
        runs.setdefault((r.get("date"), r.get("commit"), r["S"]), {})[r["variant"]] = r
    return last, runs


def _kernel_rows(by_bench, bench):
    return [r for r in by_bench.get(bench, []) if r.get("S") in KERNEL_S and r.get("D") == "128"
            and r.get("H") == "40" and r.get("B") == "1"]


def _x(r, same_run, base) -> Optional[float]:
    """Speed-up of row r over the ``base`` variant of the same run (the row's own column for cuDNN)."""
    if base == "sdpa_cudnn" and num(r.get("speedup_vs_cudnn")) is not None:
        return num(r.get("speedup_vs_cudnn"))
    b = same_run.get(base)
    return num(b.get("ms")) / num(r.get("ms")) if b is not None and num(b.get("ms")) and num(r.get("ms")) else None


def kernel_tables(by_bench: Dict[str, List[Dict[str, str]]]) -> List[str]:
    """Latest headline rows of the kernel benchmarks at B=1 H=40 D=128, S in KERNEL_S; x FA4 from the fa4-bf16
    row of the same run (date, commit, S), "-" where that run had none."""
    out = []
    for bench, wanted in KERNEL_ROWS.items():
        rows = _kernel_rows(by_bench, bench)
        if not rows:
            out.append(f"**{bench}**: no rows yet at S = {' / '.join(KERNEL_S)}, D = 128.")
            continue
        last, runs = _kernel_latest(rows, wanted)
        body = []
        for S in KERNEL_S:
            for variant, dens, what, *_ in wanted:
                r = last.get((S, variant, dens))
                if r is None:
                    continue
                same_run = runs[(r.get("date"), r.get("commit"), S)]
                body.append([S, what, f"{dens:.2f}" if dens is not None else "-", f(r.get("ms"), "{:.2f}"),
                             f(_x(r, same_run, "sdpa_cudnn"), "{:.2f}x"), f(_x(r, same_run, "fa4-bf16"), "{:.2f}x"),
                             f(_x(r, same_run, "torchao-fp8"), "{:.2f}x"),
                             "-" if variant.startswith("ab_") else f(r.get("rel_l2"), "{:.2e}"),  # A/B: vs default
                             f"{r.get('date', '')[:10]} {r.get('commit', '')}"])
        gpus = sorted({r.get("gpu", "") for r in rows})
        out.append(f"**{bench}** (B = 1, H = 40, D = 128, bf16 inputs; {', '.join(gpus)}; latest row of each "
                   f"variant, x cuDNN / x FA4 against the baseline of the same run)\n\n" + md_table(
                       ["S", "variant", "density", "ms", "x cuDNN", "x FA4", "x torchao FP8", "rel. L2 vs fp32",
                        "run"], body))
    return out


# the README's short kernel table: (bench, variant, density, column title)
KERNEL_SUMMARY = [("bench_vsmooth_attn", "vsmooth_op", None, "V-Smooth op"),
                  ("bench_vsmooth_attn", "vsmooth_expcast_op", None, "V-Smooth + ExpCast op"),
                  ("bench_sparse_attn", "ab_kvoff_reuse_c128", 0.15, "MC-Sparse reuse step, s = 0.15")]


def kernel_summary(by_bench: Dict[str, List[Dict[str, str]]]) -> str:
    """One row per S: x cuDNN (x FA4 where measured) of the whole op per method, from the latest rows."""
    latest_of = {b: _kernel_latest(_kernel_rows(by_bench, b), w) for b, w in KERNEL_ROWS.items()}
    body, runs_seen = [], set()
    for S in KERNEL_S:
        cells = []
        for bench, variant, dens, _ in KERNEL_SUMMARY:
            last, runs = latest_of[bench]
            r = last.get((S, variant, dens))
            if r is None:
                cells.append("-")
                continue
            same_run = runs[(r.get("date"), r.get("commit"), S)]
            x4, xt = _x(r, same_run, "fa4-bf16"), _x(r, same_run, "torchao-fp8")
            extra = ", ".join(t for t in ((f"{x4:.2f}x FA4" if x4 else ""), (f"{xt:.2f}x torchao FP8" if xt else ""))
                              if t)
            cells.append(f(_x(r, same_run, "sdpa_cudnn"), "{:.2f}x") + (f" ({extra})" if extra else ""))
            runs_seen.add(f"{r.get('date', '')[:10]} {r.get('commit', '')}")
        body.append([S] + cells)
    if all(c == "-" for row in body for c in row[1:]):
        return _none_yet("bench_vsmooth_attn.csv / bench_sparse_attn.csv", "the kernel benchmarks")
    return (md_table(["S (B = 1, H = 40, D = 128)"] + [t for *_, t in KERNEL_SUMMARY], body) +
            f"\n\nx SDPA cuDNN of the same run (x FA4, x torchao's FP8 attention where that run measured them); runs "
            f"{', '.join(sorted(runs_seen))}; "
            "all kernel rows: docs/performance.md.")


E2E_ORDER = ["dense", "vsmooth", "vsmooth+expcast", "mcsparse@0.15", "mcsparse@0.25", "mcsparse-c128@0.15",
             "mcsparse-c128@0.25", "torchao-fp8", "floor:bf16-vs-fp32", "floor:seed-to-seed"]


def e2e_tables(rows) -> List[str]:
    """Per model and size, each variant's latest clip row (``weights`` names the model: the demo model's rows
    predate the column's model names and say "trained")."""
    out = []
    for (w, H, S), by_var in latest([r for r in rows if r.get("bench") == "e2e"], ("weights", "H", "S")).items():
        body = []
        for v in sorted(by_var, key=lambda v: E2E_ORDER.index(v) if v in E2E_ORDER else len(E2E_ORDER)):
            r, floor = by_var[v], v.startswith("floor:")
            body.append([v, "-" if floor else f(r.get("ms"), "{:.0f}"),
                         "-" if floor else f(r.get("speedup_vs_cudnn"), "{:.2f}x"), f(r.get("psnr"), "{:.2f}"),
                         f(r.get("ssim"), "{:.4f}"), f"{r.get('date', '')[:10]} {r.get('commit', '')}"])
        r = next(iter(by_var.values()))
        model = "Fidelity model" if "fidelity" in w else "Demo model"
        out.append(f"**{model} (trained, H = {H}, D = {r.get('D')}), {S} tokens, {r.get('steps')} steps, CFG "
                   f"{r.get('guidance')}** ({r.get('gpu')}; latest row of each variant; speed-up vs dense of the same "
                   "run; PSNR / SSIM of the final clip vs the dense bf16 clip)\n\n"
                   + md_table(["variant", "ms / generation", "speed-up", "PSNR dB", "SSIM", "run"], body))
    return out


def fidelity_attention_tables(rows) -> List[str]:
    """``bench_e2e_attention.csv``: attention error by phase, the latest row of each (variant, phase) with its run;
    top-15% key mass per head and step of the latest run that read it."""
    if not rows:
        return [_none_yet("bench_e2e_attention.csv", "`python -m benchmarks.bench_e2e --attention` on a GPU")]
    last = {(r["variant"], r["phase"]): r for r in rows if r["variant"].startswith("attn:")}  # rows in run order
    err = [[r["variant"][5:], r["phase"], r["n"], f(num(r["rel_l2"]), "{:.2e}"), f(num(r["rel_l2_max"]), "{:.2e}"),
            f"{r['date'][:10]} {r['commit']}"] for r in last.values()]
    run = max((r["date"], r["commit"]) for r in rows if r["variant"] == "mass")
    rows = [r for r in rows if (r["date"], r["commit"]) == run]
    cells: Dict[tuple, Dict[str, float]] = {}
    for r in (r for r in rows if r["variant"] == "mass"):
        cells.setdefault((r["layer"], r["head"]), {})[r["step"]] = float(r["top15_mass"])
    steps = list(next(iter(cells.values()), {}))
    mass = [[f"layer {k[0]}, head {k[1]}", *(f(v.get(s), "{:.3f}") for s in steps)] for k, v in cells.items()]
    mass.append(["median over heads", *(f(statistics.median(v[s] for v in cells.values()), "{:.3f}") for s in steps)])
    return [f"Attention rel. L2 vs fp32 by phase ({rows[0]['gpu']}, {rows[0]['S']} tokens; one layer's inputs at every "
            f"step of the dense run):\n\n" + md_table(["variant", "phase", "steps", "median", "max", "run"], err),
            f"Top-15% key mass per layer and head along the dense run ({run[0][:10]}, commit {run[1]}; columns: "
            "denoising step):\n\n"
            + md_table(["head", *steps], mass)]


def _none_yet(csv_name: str, how: str) -> str:
    return f"_No rows yet: `benchmarks/results/{csv_name}` has none ({how} writes them)._"


def sm90_ab_tables(rows) -> List[str]:
    """``bench_vsmooth_attn_sm90.csv``: for each (H, S, D, inputs), the rows of its latest run (one date and
    commit): the Gluon kernel's launch variants beside cuDNN, FA3's FP8 kernel and torchao's op of that run."""
    if not rows:
        return [_none_yet("bench_vsmooth_attn_sm90.csv", "`python -m benchmarks.bench_vsmooth_attn_sm90` on a GPU")]
    groups: Dict[tuple, List[Dict[str, str]]] = {}
    for r in rows:
        groups.setdefault((int(r["H"]), int(r["S"]), int(r.get("D") or 128), r.get("inputs", "")), []).append(r)
    body = []
    for (H, S, D, inputs), rs in sorted(groups.items()):
        run = max((r.get("date", ""), r.get("commit", "")) for r in rs)
        for r in rs:
            if (r.get("date", ""), r.get("commit", "")) != run:
                continue
            body.append([str(H), str(S), str(D), inputs, r["variant"], f(r.get("ms"), "{:.2f}"),
                         f(num(r.get("speedup_vs_cudnn")), "{:.2f}x"), f(num(r.get("speedup_vs_fa3")), "{:.2f}x"),
                         f(num(r.get("speedup_vs_torchao")), "{:.2f}x"), f(r.get("rel_l2"), "{:.2e}"),
                         "" if r["variant"] in ("sdpa_cudnn", "fa3-fp8", "torchao-fp8") else r.get("note", "") or "",
                         f"{run[0][:10]} {run[1]}"])
    gpus = sorted({r.get("gpu", "") for r in rows})
    return [f"**bench_vsmooth_attn_sm90** (the Gluon kernel alone, its launch variants; B = 1; "
            f"{', '.join(gpus)}; the latest run of each shape and input, every row of that run)\n\n" + md_table(
                ["H", "S", "D", "inputs", "variant", "ms", "x cuDNN", "x FA3 FP8", "x torchao FP8", "rel. L2 vs fp32",
                 "note", "run"], body)]


def sparse_sm90_tables(rows) -> List[str]:
    """``bench_sparse_attn_sm90.csv``: for each (H, S, D), the rows of its latest run (one date and commit): the
    gather kernels (Triton, the Gluon sm_90 kernel's configs) per group size and density, beside cuDNN and FA3
    bf16 of that run, with eta = (t_FA3 / t) x s."""
    if not rows:
        return [_none_yet("bench_sparse_attn_sm90.csv", "`python -m benchmarks.bench_sparse_attn_sm90` on a GPU")]
    groups: Dict[tuple, List[Dict[str, str]]] = {}
    for r in rows:
        groups.setdefault((int(r["H"]), int(r["S"]), int(r.get("D") or 128)), []).append(r)
    body = []
    for (H, S, D), rs in sorted(groups.items()):
        run = max((r.get("date", ""), r.get("commit", "")) for r in rs)
        for r in rs:
            if (r.get("date", ""), r.get("commit", "")) != run:
                continue
            cfg = r.get("config", "") or ""
            cfg = "default" if cfg.startswith("default") else cfg
            cfg = "shipped" if cfg.startswith("SparseAttnConfig") else cfg
            body.append([str(H), str(S), str(D), r["variant"], cfg, r.get("C", "") or "",
                         f(num(r.get("density")), "{:.2f}"), f(r.get("ms"), "{:.2f}"), f(num(r.get("speedup_vs_cudnn")), "{:.2f}x"),
                         f(num(r.get("eta")), "{:.2f}"), f(r.get("rel_l2"), "{:.2e}"), f"{run[0][:10]} {run[1]}"])
    gpus = sorted({r.get("gpu", "") for r in rows})
    return [f"**bench_sparse_attn_sm90** (the gather kernels alone, reuse step with its residual epilogue; B = 1; "
            f"{', '.join(gpus)}; the latest run of each shape, every row of that run; eta against FA3 bf16)\n\n"
            + md_table(["H", "S", "D", "variant", "config", "C", "s", "ms", "x cuDNN", "eta", "rel. L2 vs fp32",
                        "run"], body)]


def schedule_tables(rows) -> List[str]:
    """``bench_mcsparse_schedule.csv``: MC-Sparse's schedule by fidelity on the demo model, the latest row of each
    (variant, density, steps, warm-up, anchors, seed), each against the dense clip of its own run (same seed),
    with the modelled attention cost of the generation in reuse-step units."""
    if not rows:
        return [_none_yet("bench_mcsparse_schedule.csv", "the benchmark that docs/design/mcsparse-schedule.md names")]
    latest_of: Dict[tuple, Dict[str, str]] = {}
    open_loop = [r for r in rows if r.get("variant", "").endswith("+open-loop")]
    for r in rows:
        if r.get("variant") == "dense" or r in open_loop:
            continue
        latest_of[(r["variant"], r.get("density", ""), r.get("steps", ""), r.get("warmup_steps", ""),
                   r.get("anchors", ""), r.get("seed") or "0")] = r  # rows before the seed column: the default 0
    body = []
    for (v, dens, steps, w, anchors, seed), r in sorted(
            latest_of.items(),
            key=lambda kv: (kv[0][0], kv[0][1], num(kv[0][3]) or -1, len(kv[0][4]), kv[0][4], kv[0][5])):
        body.append([name(v.split("@")[0]) if "@" not in v else v, f(num(dens), "{:.2f}"), steps, w or "-",
                     anchors or "-", seed, f(num(r.get("psnr_db")), "{:.2f}"), f(num(r.get("ssim")), "{:.3f}"),
                     f(num(r.get("attn_cost")), "{:.0f}"), r.get("device", ""),
                     f"{r.get('date', '')[:10]} {r.get('commit', '')}"])
    out = ["**bench_mcsparse_schedule** (the trained demo model, 4096 tokens, CFG 3; PSNR / SSIM of the clip against "
           "the dense clip of the same run; attention cost: the generation's attention in reuse-step units from "
           "the 1.3B pipeline's per-call costs)\n\n" + md_table(
               ["variant", "s", "steps", "warm-up", "anchors", "seed", "PSNR dB", "SSIM", "attention cost", "device",
                "run"],
               body)]
    if open_loop:
        last: Dict[tuple, Dict[str, str]] = {}
        for r in open_loop:
            last[(r["variant"], r.get("steps", ""), r.get("warmup_steps", ""), r.get("anchors", ""),
                  r.get("seed") or "0")] = r
        ol = [[v.replace("+open-loop", ""), st, w, an or "-", sd, f(num(r.get("rel_l2")), "{:.3e}"),
               f(num(r.get("rel_l2_late")), "{:.3e}"), f(num(r.get("rel_l2_max")), "{:.3e}"),
               f(num(r.get("attn_cost")), "{:.0f}"), r.get("device", ""), f"{r.get('date', '')[:10]} {r.get('commit', '')}"]
              for (v, st, w, an, sd), r in sorted(last.items(), key=lambda kv: (kv[0][0], num(kv[0][2]) or -1,
                                                                                 kv[0][3]))]
        out.append("**bench_mcsparse_schedule --open-loop** (the same model; every self-attention call of the dense "
                   "trajectory through the op once per schedule, rel. L2 against fp64: the schedule's own error, "
                   "without the sampler compounding it; second half = steps n/2 ..)\n\n" + md_table(
                       ["variant", "steps", "warm-up", "anchors", "seed", "rel. L2", "second half", "worst call",
                        "attention cost", "device", "run"], ol))
    return out


def sm90_kernel_line(rows) -> str:
    """One table from ``bench_vsmooth_attn_sm90.csv`` for the README: the default launches of the Gluon kernel
    alone (ExpCast, V-Smooth) at H = 40, D = 128 on the structured inputs, per S from its latest run with FA3's FP8
    kernel beside it (else its latest run), against FA3's FP8 kernel, torchao's op and cuDNN of that run, with both kernels' error ("" when no such run)."""
    groups: Dict[int, List[Dict[str, str]]] = {}
    for r in rows:
        if (r.get("H"), r.get("D") or "128", r.get("inputs", "")) == ("40", "128", "structured"):
            groups.setdefault(int(r["S"]), []).append(r)
    body, runs = [], set()
    for S, rs in sorted(groups.items()):
        # the latest run with the FA3 FP8 peer beside ours, else the latest run
        with_peer = [r for r in rs if r.get("variant") == "fa3-fp8"]
        run = max((r.get("date", ""), r.get("commit", "")) for r in (with_peer or rs))
        by = {r["variant"]: r for r in rs if (r.get("date", ""), r.get("commit", "")) == run}
        fa3 = by.get("fa3-fp8")
        cells = []
        for v in ("expcast_kernel", "exp2_kernel"):
            r = by.get(v)
            cells.append("-" if r is None else
                         f"{f(r.get('ms'), '{:.2f}')} ms, {f(num(r.get('speedup_vs_fa3')), '{:.2f}x')} FA3 FP8, "
                         f"{f(num(r.get('speedup_vs_torchao')), '{:.2f}x')} torchao, "
                         f"{f(num(r.get('speedup_vs_cudnn')), '{:.2f}x')} cuDNN; rel. L2 {f(r.get('rel_l2'), '{:.1e}')}")
        if all(c == "-" for c in cells):
            continue
        body.append([str(S)] + cells + ["-" if fa3 is None else f"{f(fa3.get('ms'), '{:.2f}')} ms; rel. L2 "
                                        f"{f(fa3.get('rel_l2'), '{:.1e}')}"])
        runs.add(f"{run[0][:10]} {run[1]}")
    if not body:
        return ""
    return ("The 8-bit kernel alone (no preprocessing), default launches, from `bench_vsmooth_attn_sm90.csv`:\n\n" +
            md_table(["S (B = 1, H = 40, D = 128)", "V-Smooth + ExpCast kernel", "V-Smooth kernel", "FA3 FP8 kernel"],
                     body) + f"\n\nRuns {', '.join(sorted(runs))}; rel. L2 against fp32 on the structured inputs.")


def overhead_tables(rows) -> List[str]:
    """``bench_op_overhead.csv``: per (H, S), the rows of its latest run per variant: host time and GPU time per
    reuse call (back to back), launches, x cuDNN of the same run."""
    if not rows:
        return [_none_yet("bench_op_overhead.csv", "`python -m benchmarks.bench_op_overhead` on a GPU")]
    last: Dict[tuple, Dict[str, str]] = {}
    for r in rows:
        last[(int(r["H"]), int(r["S"]), r["variant"])] = r
    body = []
    for (H, S, variant), r in sorted(last.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                 kv[0][2] != "sdpa_cudnn", kv[0][2])):
        body.append([str(H), str(S), variant, f(r.get("host_ms"), "{:.3f}"), f(r.get("ms"), "{:.3f}"),
                     r.get("launches", "") or "-", f(num(r.get("speedup_vs_cudnn")), "{:.2f}x"),
                     r.get("kernel_path", "") or "", f"{r.get('date', '')[:10]} {r.get('commit', '')}"])
    gpus = sorted({r.get("gpu", "") for r in rows})
    return [f"**bench_op_overhead** (one reuse call, B = 1, D = 128, bf16, calls back to back; {', '.join(gpus)}; "
            "the latest row of each shape and variant; host = CPU time per call, GPU = CUDA events per call)\n\n"
            + md_table(["H", "S", "variant", "host ms", "GPU ms", "launches", "x cuDNN", "kernel path", "run"], body)]


def cold_start_tables(rows, runs: int = 2) -> List[str]:
    """``bench_cold_start.csv``: the latest ``runs`` runs' rows (first generation per variant in a fresh process and
    in a second one on its caches, against stock's in the same mode), newest first. A row whose kernel-build
    helpers ran (CSV column ``prebuild``) says so in its variant."""
    if not rows:
        return [_none_yet("bench_cold_start.csv", "`python -m benchmarks.bench_cold_start` on a GPU")]
    keys = []
    for r in rows:
        k = (r.get("date", "")[:13], r.get("commit", ""))
        if k not in keys:
            keys.append(k)
    out = []
    for run in reversed(keys[-runs:]):
        latest = [r for r in rows if (r.get("date", "")[:13], r.get("commit", "")) == run]
        said = lambda r: r.get("prebuild") or ""  # noqa: E731
        body = [[r["variant"] + (" (shipped)" if "shipped sm_90 kernel(s) loaded" in said(r) else "")
                 + (" (helpers)" if "kernels built ahead" in said(r) else ""),
                 r.get("mode", "") + (f" ({num(r.get('warmup_s')):.0f} s)" if num(r.get("warmup_s")) else ""),
                 f(num(r.get("first_call_s")), "{:.1f}"),
                 f(num(r.get("extra_s")), "{:+.1f}"), f(num(r.get("steady_s")), "{:.1f}"),
                 f(num(r.get("startup_s")), "{:.1f}"), f(num(r.get("startup_extra_s")), "{:+.1f}"),
                 f(num(r.get("prebuild_wait_s")), "{:.1f}") if r.get("variant") != "stock" else "-"]
                for r in latest]
        r0 = latest[0]
        out.append(f"**bench_cold_start** ({r0.get('model', '')}, {r0.get('S', '')} tokens, regional compile, "
                   f"{r0.get('steps', '')}-step first generation, CFG 5; {r0.get('gpu', '')}, "
                   f"{r0.get('date', '')[:10]}, commit {r0.get('commit', '')}; random weights). fresh = empty "
                   "Inductor / Triton caches; second = a second process on them; warmup = empty caches after "
                   "`python -m vc_compile warmup` (its own time in brackets, not in the figures); extra = against "
                   "stock in the same mode (warmup: against stock fresh); start-up = first generation minus a "
                   "steady one in the same process; (helpers) = kernel-build helpers ran, waited = what the first "
                   "calls waited for them; (shipped) = binaries the package shipped until 2026-12-06 were loaded.\n\n"
                   + md_table(["variant", "process", "first generation s", "extra s", "steady s", "start-up s",
                               "start-up extra s", "waited s"], body))
    return out


def key_padding_tables(rows) -> List[str]:
    """``bench_key_padding.csv``: per (H, S, kept text tokens), the rows of its latest run: HunyuanVideo's key-padded
    joint attention through each method against stock SDPA with the mask and cuDNN on the kept keys."""
    if not rows:
        return [_none_yet("bench_key_padding.csv", "`python -m benchmarks.bench_key_padding` on a GPU")]
    runs: Dict[tuple, tuple] = {}
    for r in rows:
        runs[(r.get("H"), r.get("S"), r.get("kept"))] = (r.get("date", ""), r.get("commit", ""))
    body, seen = [], set()
    for (H, S, kept), run in runs.items():
        for r in rows:
            if (r.get("H"), r.get("S"), r.get("kept"), r.get("date", ""), r.get("commit", "")) == (H, S, kept, *run):
                body.append([H, S, f"{kept} of {r.get('text', '')}", r["variant"], f(r.get("ms"), "{:.2f}"),
                             f(r.get("host_ms"), "{:.3f}"), f(num(r.get("speedup_vs_masked")), "{:.2f}x"),
                             f(num(r.get("speedup_vs_kept")), "{:.2f}x"), f(r.get("rel_l2"), "{:.2e}")])
                seen.add(f"{run[0][:10]} {run[1]}")
    gpus = sorted({r.get("gpu", "") for r in rows})
    return [f"**bench_key_padding** (HunyuanVideo's joint attention: B = 1, D = 128, bf16, video + 256 text tokens, the "
            f"padding dropped by a boolean [B, 1, 1, S] mask; {', '.join(gpus)}; runs {', '.join(sorted(seen))}; x "
            "masked = stock SDPA with the mask over the row, x kept = cuDNN on the kept keys over the row; rel. L2 "
            "against fp32 on the kept keys)\n\n"
            + md_table(["H", "S", "text kept", "variant", "ms", "host ms", "x masked", "x kept", "rel. L2"], body)]


def vsmooth_schedule_tables(rows) -> List[str]:
    """``bench_vsmooth_schedule.csv``: V-Smooth's grouping schedules by attention error on the demo model's dense
    trajectory, the latest row of each (variant, steps, seed): mean / second-half / worst rel. L2 against fp64,
    against re-grouping every step, and the group steps each schedule costs."""
    if not rows:
        return [_none_yet("bench_vsmooth_schedule.csv", "the benchmark that docs/design/vsmooth-grouping-schedule.md names")]
    latest_of: Dict[tuple, Dict[str, str]] = {}
    for r in rows:
        latest_of[(r["variant"], r.get("steps", ""), r.get("seed") or "0")] = r
    body = []
    for (v, steps, seed), r in sorted(latest_of.items(), key=lambda kv: (kv[0][0].startswith("vsmooth+expcast"),
                                                                         -(num(kv[1].get("group_steps")) or 0))):
        body.append([v.replace("vsmooth+", "").replace("expcast+", "ExpCast, ").replace(",group_interval=",
                                                                                          ", group_interval="),
                     r.get("group_steps", ""), steps, seed, f(num(r.get("rel_l2")), "{:.3e}"),
                     f(num(r.get("rel_l2_late")), "{:.3e}"), f(num(r.get("rel_l2_max")), "{:.3e}"),
                     f(num(r.get("vs_every_step")), "{:.3f}x"), f(num(r.get("late_vs_every_step")), "{:.3f}x"),
                     r.get("device", ""), f"{r.get('date', '')[:10]} {r.get('commit', '')}"])
    return ["**bench_vsmooth_schedule** (the trained demo model, 4096 tokens, 6 layers x 2 CFG branches per step; "
            "each call's attention on the dense trajectory's own q, k, v, rel. L2 against fp64; second half = "
            "steps n/2 ..; x every step = against re-grouping at every step)\n\n" + md_table(
                ["schedule", "group steps", "steps", "seed", "rel. L2", "second half", "worst call", "x every step",
                 "second half x every step", "device", "run"], body)]


# the GPU whose rows are the figures of record: its tables come first and carry no heading of their own
REFERENCE_GPU = "NVIDIA H200"


def gpus_of(rows: List[Dict[str, str]]) -> List[str]:
    """The GPUs (the ``gpu`` column; "cpu" for CPU rows) that ``rows`` ran on: the reference GPU first, the rest in
    the order they first appear."""
    seen: List[str] = []
    for r in rows:
        g = r.get("gpu", "")
        if g not in seen:
            seen.append(g)
    return sorted(seen, key=lambda g: g != REFERENCE_GPU)


def per_gpu(render, rows, *, joiner: str = "\n\n") -> str:
    """``render(rows)`` for the rows of each GPU apart (``rows``: a list of rows, or {bench: rows}): "latest row"
    means latest on that GPU, so another GPU's rows (an H100's, say) never replace the reference GPU's figures.
    Where there is more than one GPU, each one after the first is headed by its name. ``render`` returns markdown
    or a list of markdown parts."""
    def of(g):
        if isinstance(rows, dict):
            return {b: [r for r in rs if r.get("gpu", "") == g] for b, rs in rows.items()}
        return [r for r in rows if r.get("gpu", "") == g]

    def text(part) -> str:
        return joiner.join(t for t in part if t) if isinstance(part, list) else part

    gpus = gpus_of([r for rs in rows.values() for r in rs] if isinstance(rows, dict) else rows)
    if len(gpus) <= 1:
        return text(render(rows))
    parts = []
    for i, g in enumerate(gpus):
        body = text(render(of(g)))
        if body:
            parts.append(body if i == 0 else f"On the {g or 'GPU not recorded'}:\n\n{body}")
    return "\n\n".join(parts)


# The Triton release the published figures are measured on (rows without a triton column predate the column);
# rows of other releases appear in the ``toolchain`` block only, side by side with this one's
REFERENCE_TRITON = "3.6."


def reference_rows(rows):
    return [r for r in rows if not r.get("triton") or r["triton"].startswith(REFERENCE_TRITON)]


def toolchain_tables(sm90, overhead) -> List[str]:
    """The same GPU on each Triton release: the Gluon V-Smooth kernel rows (``bench_vsmooth_attn_sm90.csv``) and
    the op's host time per reuse call (``bench_op_overhead.csv``), the latest run of each release on the day the
    newest release was measured, against the reference release's."""
    out = []
    for name, rows, cols, val in (
            ("bench_vsmooth_attn_sm90", sm90, ("H", "S", "variant"), lambda r: f(num(r.get("ms")), "{:.2f}")),
            ("bench_op_overhead", overhead, ("H", "S", "variant"),
             lambda r: f"{f(num(r.get('host_ms')), '{:.3f}')} host / {f(num(r.get('ms')), '{:.2f}')} GPU")):
        rows = [r for r in rows if r.get("triton") and r.get("variant") and "[" not in r["variant"]
                and "{" not in r["variant"]]
        others = [r for r in rows if not r["triton"].startswith(REFERENCE_TRITON)]
        if not others:
            continue
        day, gpu = others[-1]["date"][:10], others[-1].get("gpu", "")
        rows = [r for r in rows if r["date"][:10] == day and r.get("gpu", "") == gpu]
        versions = sorted({r["triton"] for r in rows}, key=lambda v: [int(x) for x in v.split(".")[:2]])
        latest: Dict[tuple, Dict[str, str]] = {}
        for r in rows:
            latest[tuple(r.get(c, "") for c in cols) + (r["triton"],)] = r
        keys = [k for k in dict.fromkeys(tuple(r.get(c, "") for c in cols) for r in rows)
                if all(k + (v,) in latest for v in versions)]  # measured on every release
        body = []
        for k in keys:
            cells = [latest.get(k + (v,)) for v in versions]
            ref = cells[0]
            line = list(k)
            for c in cells:
                txt = val(c) if c is not None else "-"
                if c is not None and ref is not None and c is not ref and num(c.get("ms")) and num(ref.get("ms")):
                    txt += f" ({num(c['ms']) / num(ref['ms']) - 1:+.1%})"
                line.append(txt)
            body.append(line)
        head = list(cols) + [f"Triton {v} ms" for v in versions]
        out.append(f"**{name}** ({gpu}, {day}, torch {rows[-1].get('torch', '')}; each release's latest run that "
                   f"day; in brackets the GPU time against Triton {versions[0]}'s)\n\n" + md_table(head, body))
    return out or [_none_yet("bench_vsmooth_attn_sm90.csv / bench_op_overhead.csv", "a run on a second Triton")]


def triton_versions_table(rows) -> str:
    """``triton_versions.csv`` (``tools/triton_versions.py``): per release, the latest run's offline sm_90 build
    of every kernel against the baseline release."""
    if not rows:
        return _none_yet("triton_versions.csv", "`python -m tools.triton_versions PYTHON ...`")
    latest = {}
    for r in rows:
        latest[r["triton"]] = r
    body = [[v, f"{r['built']} of {r['kernels']}", r["spill_more"], r.get("spill_guarded") or "0",
             f"{r['spill_bytes']} ({r['baseline_spill_bytes']})",
             r["loops_moved"], f"{r['wgmma_serialized']} ({r['baseline_wgmma_serialized']})",
             r["serialized_kernels"] or "-"]
            for v, r in sorted(latest.items(), key=lambda kv: [int(x) for x in kv[0].split(".")[:2]])]
    r0 = list(latest.values())[-1]
    return (f"Offline sm_90 builds ({r0['date'][:10]}, commit {r0['commit']}; against Triton {r0['baseline']}; loops "
            f"moved: by more than {float(r0['tolerance']):.0%})\n\n"
            + md_table(["Triton", "built", "spill more", "spill more, replaced at run time (byte-mask guard)",
                        "spill bytes, all kernels (baseline)", "loops moved",
                        "wgmma serialised (baseline)", "serialised here, not in the baseline"], body))


def quant_check_table(rows) -> str:
    """``bench_quant_check.csv``: the latest run (its commit), per input kind and head dim, what the quantisation
    check chose per outlier case and V-Smooth's error without and with it, as multiples of the clean case's."""
    if not rows:
        return _none_yet("bench_quant_check.csv", "the benchmark that docs/design/quant-check.md names")
    last = rows[-1]["commit"]
    run = [r for r in rows if r["commit"] == last and r["date"][:10] == rows[-1]["date"][:10]]
    cases = list(dict.fromkeys(r["variant"] for r in run))
    groups = list(dict.fromkeys((r["inputs"], r["D"]) for r in run))
    head = ["case"] + [f"{k} D={d}: action, error x clean unchecked -> checked" for k, d in groups]
    body = []
    for c in cases:
        line = [c]
        for k, d in groups:
            r = next((x for x in run if x["variant"] == c and (x["inputs"], x["D"]) == (k, d)), None)
            line.append("-" if r is None else f"{r['action']}, {float(r['x_clean_unchecked']):.1f}x -> "
                                             f"{float(r['x_clean']):.1f}x")
        body.append(line)
    return (f"`bench_quant_check` ({run[-1]['date'][:10]}, commit {last}; CPU reference path, S = {run[-1]['S']}, "
            "H = 2, bf16; rel. L2 against fp64 SDPA as a multiple of the clean case's):\n\n" + md_table(head, body))


def kmeans_table(rows) -> str:
    """``bench_kmeans.csv``: the latest run, what a V-Smooth grouping step's k-means costs, whole and by kernel,
    beside the reuse call it precedes, and the alternatives' time and agreement with the kernel's grouping."""
    if not rows:
        return _none_yet("bench_kmeans.csv", "the benchmark that docs/design/kmeans-kernel.md names")
    last = rows[-1]["commit"]
    run = [r for r in rows if r["commit"] == last]
    shapes = list(dict.fromkeys((r["H"], r["S"]) for r in run))
    head = ["variant"] + [f"H = {h}, S = {s}: ms (x reuse call)" for h, s in shapes] + ["labels equal (last shape)"]
    body = []
    for v in dict.fromkeys(r["variant"] for r in run):
        line, same = [v], "-"
        for shape in shapes:
            r = next((x for x in run if x["variant"] == v and (x["H"], x["S"]) == shape), None)
            line.append("-" if r is None else f"{float(r['ms']):.3f} ({float(r['x_reuse_call']):.3f}x)")
            same = f"{float(r['labels_equal']):.4f}" if r is not None and r.get("labels_equal") else same
        body.append(line + [same])
    return (f"`bench_kmeans`, {run[-1]['gpu']} ({run[-1]['date'][:10]}, commit {last}; B = 1, D = 128, bf16, "
            f"K = {run[-1]['K']}, {run[-1]['iters']} warm-started iterations):\n\n" + md_table(head, body))


def reuse_check_table(rows) -> str:
    """``bench_reuse_check.csv``: the latest run, per trajectory and density, the first reuse step's error beside the
    previous output's, what the check did, and the mean error over the steps after the anchor without and with it."""
    if not rows:
        return _none_yet("bench_reuse_check.csv", "the benchmark that docs/design/reuse-check.md names")
    last = rows[-1]["commit"]
    run = [r for r in rows if r["commit"] == last and r["date"][:10] == rows[-1]["date"][:10]]
    f3 = lambda x: f"{float(x):.3f}"  # noqa: E731
    body = [[r["variant"], r["density"], f3(r["first_reuse"]), f3(r["first_prev"]), r["action"],
             f3(r["rel_l2_unchecked"]), f3(r["rel_l2"]), f3(r["rel_l2_prev"])] for r in run]
    r0 = run[-1]
    return (f"`bench_reuse_check` ({r0['date'][:10]}, commit {last}; CPU reference path, S = {r0['S']}, H = 2, "
            f"D = {r0['D']}, bf16, {r0['steps']} steps, one anchor at step 0; rel. L2 against fp64 SDPA):\n\n"
            + md_table(["trajectory", "density", "first reuse step", "previous output", "the check",
                        "mean error, unchecked", "mean error, checked", "naive cache (previous output)"], body))


DEFAULT_CANDIDATES = ("stock", "torchao-fp8", "vsmooth", "vsmooth+expcast")


def _latest_run(rows, need, key=lambda r: (r["commit"], r.get("model", ""))):
    """The rows of the latest run (same ``key``: commit and model) holding every variant of ``need``."""
    runs: Dict[tuple, List[Dict[str, str]]] = {}
    for r in rows:
        runs.setdefault(key(r), []).append(r)
    ok = [rs for rs in runs.values() if set(need) <= {r["variant"] for r in rs}]
    return max(ok, key=lambda rs: max(r["date"] for r in rs)) if ok else []


def default_method_tables(pipe, gen) -> List[str]:
    """The default method's race: per GPU, the latest ``bench_pipeline`` run of the 1.3B model with stock, torchao's
    FP8 attention and the dense 8-bit candidates (speed and attention error on inputs captured from the run), and the
    latest ``bench_generation`` run with torchao (the error on drifting structured inputs)."""
    out = []
    one = [r for r in pipe if r.get("model") == "wan2.1-t2v-1.3b" and r["variant"] in DEFAULT_CANDIDATES]
    run = _latest_run(one, ("stock", "torchao-fp8", "vsmooth+expcast"),
                      key=lambda r: (r["commit"], r.get("model", ""), r.get("first_steps", "")))  # one invocation
    if run:
        by = {r["variant"]: r for r in run}
        ao = by["torchao-fp8"]
        body = []
        for v in DEFAULT_CANDIDATES:
            r = by.get(v)
            if r is None:
                continue
            sp, spa = num(r["speedup_vs_stock"]), num(ao["speedup_vs_stock"])
            e, ea = num(r.get("attn_rel_l2")), num(ao.get("attn_rel_l2"))
            body.append([v, f(num(r["ms"]) / 1000, "{:.1f}"), f(sp, "{:.3f}x"),
                         f(sp / spa if sp and spa else None, "{:.3f}x"), f(e, "{:.2e}"),
                         f(e / ea if e is not None and ea else None, "{:.3f}x"), f(num(r.get("rel_l2")), "{:.2e}")])
        r0 = run[0]
        out.append(f"`bench_pipeline`, {r0['gpu']} ({r0['date'][:10]}, commit {r0['commit']}, torch {r0['torch']}, "
                   f"Triton {r0['triton']}; Wan 2.1 1.3B, 480p x 81 ({r0['S']} tokens), {r0['steps']} steps, CFG "
                   f"{r0['guidance']}, {r0['compile']} compile, random weights, one process):\n\n"
                   + md_table(["variant", "s / generation", "vs stock", "vs torchao", "attention error, captured "
                               "inputs", "x torchao's", "clip rel. L2 vs stock"], body))
    for S in sorted({int(r["S"]) for r in gen}):
        g = [r for r in gen if int(r["S"]) == S and r["variant"] in ("torchao-fp8", "vsmooth", "vsmooth+expcast")]
        run = _latest_run(g, ("torchao-fp8", "vsmooth", "vsmooth+expcast"), key=lambda r: r["commit"])
        if not run:
            continue
        by = {r["variant"]: r for r in run}
        ea = num(by["torchao-fp8"]["rel_l2"])
        body = [[v, f(num(by[v]["rel_l2"]), "{:.2e}"), f(num(by[v]["rel_l2"]) / ea if ea else None, "{:.2f}x")]
                for v in ("torchao-fp8", "vsmooth", "vsmooth+expcast") if v in by]
        r0 = run[0]
        out.append(f"`bench_generation`, {r0['gpu']} ({r0['date'][:10]}, commit {r0['commit']}; H = {r0['H']}, "
                   f"S = {S}, drifting structured inputs, the last step's output against fp32):\n\n"
                   + md_table(["variant", "rel. L2", "x torchao's"], body))
    return out or [_none_yet("bench_pipeline.csv", "`python -m benchmarks.bench_pipeline` on a GPU")]


def blocks(results_dir: str) -> Dict[str, str]:
    """{marker name: markdown} for every block ``--write`` fills; each GPU's rows apart (``per_gpu``); the
    reference Triton release's rows only, but in ``toolchain``."""
    raw = lambda name: read(os.path.join(results_dir, name))  # noqa: E731
    rd = lambda name: reference_rows(raw(name))  # noqa: E731
    pipe, gen = rd("bench_pipeline.csv"), rd("bench_generation.csv")
    ker = {b: rd(f"{b}.csv") for b in KERNEL_ROWS}
    e2e = rd("bench_e2e.csv")
    sm90 = rd("bench_vsmooth_attn_sm90.csv")
    return {
        "pipeline": per_gpu(pipeline_tables, pipe) if pipe else
        _none_yet("bench_pipeline.csv", "`python -m benchmarks.bench_pipeline` on a GPU"),
        "generation": per_gpu(generation_tables, gen) if gen else
        _none_yet("bench_generation.csv", "`python -m benchmarks.bench_generation` on a GPU"),
        "kernels": per_gpu(kernel_tables, ker) if any(ker.values()) else
        _none_yet("bench_vsmooth_attn.csv / bench_sparse_attn.csv", "the kernel benchmarks"),
        "kernels-summary": "\n\n".join(t for t in (per_gpu(kernel_summary, ker),
                                                      per_gpu(sm90_kernel_line, sm90)) if t),
        "kernels-sm90": per_gpu(sm90_ab_tables, sm90),
        "sparse-sm90": per_gpu(sparse_sm90_tables, rd("bench_sparse_attn_sm90.csv")),
        "schedule": per_gpu(schedule_tables, rd("bench_mcsparse_schedule.csv")),
        "vsmooth-schedule": per_gpu(vsmooth_schedule_tables, rd("bench_vsmooth_schedule.csv")),
        "op-overhead": per_gpu(overhead_tables, rd("bench_op_overhead.csv")),
        "cold-start": per_gpu(cold_start_tables, rd("bench_cold_start.csv")),
        "toolchain": "\n\n".join(toolchain_tables(raw("bench_vsmooth_attn_sm90.csv"), raw("bench_op_overhead.csv"))),
        "triton-versions": triton_versions_table(raw("triton_versions.csv")),
        "quant-check": quant_check_table(raw("bench_quant_check.csv")),
        "reuse-check": reuse_check_table(raw("bench_reuse_check.csv")),
        "kmeans": kmeans_table(raw("bench_kmeans.csv")),
        "default-method": per_gpu(lambda d: default_method_tables(d["pipe"], d["gen"]), {"pipe": pipe, "gen": gen}),
        "key-padding": per_gpu(key_padding_tables, rd("bench_key_padding.csv")),
        "e2e": per_gpu(e2e_tables, e2e) if any(r.get("bench") == "e2e" for r in e2e) else
        _none_yet("bench_e2e.csv", "`python -m benchmarks.bench_e2e` on a GPU"),
        "fidelity-attention": "\n\n".join(fidelity_attention_tables(raw("bench_e2e_attention.csv"))),
    }


def write_blocks(path: str, texts: Dict[str, str]) -> List[str]:
    """Replace the text between ``<!-- results:NAME:begin -->`` and ``<!-- results:NAME:end -->`` in ``path``
    by ``texts[NAME]`` for every pair in the file; returns the names replaced. An unpaired, repeated,
    nested or unknown marker raises ValueError naming the file (nothing is written then)."""
    src = open(path).read()
    begins = re.findall(r"<!-- results:([\w-]+):begin -->", src)
    ends = re.findall(r"<!-- results:([\w-]+):end -->", src)
    if sorted(begins) != sorted(ends) or len(set(begins)) != len(begins):
        raise ValueError(f"{path}: results markers unpaired or repeated (begin: {begins}, end: {ends})")
    new = src
    for name in begins:
        if name not in texts:
            raise ValueError(f"{path}: unknown results block {name!r} (known: {', '.join(sorted(texts))})")
        b, e = f"<!-- results:{name}:begin -->", f"<!-- results:{name}:end -->"
        i, j = new.index(b) + len(b), new.index(e)
        if j < i or "<!-- results:" in new[i:j]:
            raise ValueError(f"{path}: block {name!r} ends before it begins or holds another block")
        new = new[:i] + "\n" + texts[name].strip() + "\n" + new[j:]
    if new != src:
        with open(path, "w") as fh:
            fh.write(new)
    return begins


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--img-dir", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--write", action="store_true", help="rewrite the <!-- results:NAME --> blocks of --docs")
    ap.add_argument("--docs", nargs="+", default=[os.path.join(ROOT, "README.md"),
                                                   os.path.join(ROOT, "docs", "performance.md"),
                                                   *sorted(glob.glob(os.path.join(ROOT, "docs", "design", "*.md")))])
    a = ap.parse_args(argv)
    if a.write:
        texts = blocks(a.results_dir)
        for path in a.docs:
            names = write_blocks(path, texts)
            print(f"{os.path.relpath(path)}: {', '.join(names) or 'no results blocks'}", file=sys.stderr)
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
