"""The op's fixed cost per call: host time, launches and GPU time of a reuse step, beside stock SDPA.

    python -m benchmarks.bench_op_overhead                    # H200: the (H, S) sweep below, every method
    python -m benchmarks.bench_op_overhead --shapes 12x8192,2x32760 --options '{"cuda_graphs": "off"}'
    python -m benchmarks.bench_op_overhead --smoke            # CPU: tiny shapes, reference kernels, no rows

Per (H, S) (B = 1, D = 128, bf16, structured inputs drifting a little each step, as ``bench_generation``
makes them) and per method, the op ``torch.ops.vcattn.attention`` runs inside ``vc_compile.sampling`` with
``vc_compile.step(i)``; past its first three reuse steps (warm-up of the kernels, the CUDA graph capture where
``cuda_graphs`` allows it: ``first_host_ms``) and two more on the timed inputs (the steady state: a graph on q,
k, v in place captured), one steady-state call is profiled (``launches``), then ``--reuse`` reuse steps run back
to back, as a sampling loop runs them (one set of inputs, no synchronisation in between):

* ``host_ms``: their wall time per call: the CPU's cost (Python, metadata, launches). Where it exceeds the
  GPU's time the op is host-bound: the GPU idles between calls.
* ``ms``: CUDA events around them, per call: what a call costs the GPU, idle gaps included.
* ``launches``: GPU activities (kernels, memsets, copies) the profiler sees for one steady-state reuse call
  (their names in the log).
* ``replays``: how many of the timed calls replayed a CUDA graph, and how many of those replayed it on the
  caller's q, k, v in place (``direct``: nothing copied; kernels/graphs.py).
* ``kernel_path``: what ``report()`` recorded (``+cuda_graph``: replayed).

``sdpa_cudnn`` is stock SDPA (cuDNN) on the same inputs, timed the same way in the same run;
``speedup_vs_cudnn`` = its ms / ours. ``--options`` (JSON) is merged into every method's options and named in
the variant (e.g. the A/B of ``cuda_graphs``). ``--ab-launch`` runs each method a second time right after, with
every launch through Triton's binder and no recorded preprocessing (``kernels/launch.py`` off; variant
suffix `` [binder]``): the host-time A/B on one host, whose own speed moves between runs (stock's host time
per call: 0.035-0.111 ms in three runs of one day on the H200). docs/design/host-overhead.md splits the host time by layer.
Our path is measured with ``speed_gate="off"`` and ``group_interval=0`` (V-Smooth groups at step 0 only, so
every timed call is a reuse call; ``--options`` may set it): these rows are what the speed gate's table is generated from
(``python3 -m tools.gen_gate_table``; tune/gate.py). Rows are appended to
``benchmarks/results/bench_op_overhead.csv``.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import vc_compile
import vc_compile.ops  # noqa: F401 - registers torch.ops.vcattn.*
from benchmarks.bench_generation import Runner, _phase_counts, _step_phase
from benchmarks.common import Drift, append_rows, parse_methods, print_table, sdpa_backend
from vc_compile.ops import GRAPHS

BENCH = "bench_op_overhead"
METHODS = {
    "vsmooth": {"method": "vsmooth", "expcast": False},
    "vsmooth+expcast": {"method": "vsmooth", "expcast": True},
    "mcsparse@0.15": {"method": "mcsparse", "density": 0.15},
}
# the sweep of the fixed-cost target: 2-40 heads, 2K-75K tokens
SHAPES = ((12, 2048), (12, 4096), (12, 8192), (12, 16384), (12, 32760), (2, 32760), (40, 8192), (40, 32760),
          (40, 75600))
EXTRAS = ["host_ms", "host_ms_sdpa", "launches", "replays", "first_host_ms", "steps_run", "kernel_path", "note"]


def log(*a):
    print(*a, flush=True)


def gpu_activities(fn, cuda: bool) -> list:
    """The names of the GPU activities (kernels, memsets, copies) of one call, in order, from torch.profiler;
    None on a CPU."""
    if not cuda:
        fn()
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    return [e.name for e in evs]


def count_launches(fn, cuda: bool) -> int:
    """GPU activities (kernels, memsets, copies) of one call; -1 on a CPU."""
    names = gpu_activities(fn, cuda)
    return -1 if names is None else len(names)


def burst(fn, n: int, cuda: bool):
    """(host ms, GPU ms) per call of n calls back to back (no synchronisation between them)."""
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / n
    if not cuda:
        return host, host
    b.record()
    b.synchronize()
    return host, a.elapsed_time(b) / n


def timed_call(fn, cuda: bool):
    """(host ms, GPU ms) of one call: the host time without a closing synchronisation."""
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host = (time.perf_counter() - t0) * 1e3
        b.synchronize()
        return host, a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    return host, host


def run_method(runner: Runner, opts: dict, n_reuse: int):
    """Steps a sampling loop of 100 steps. Its first reuse step warms (kernels compiled, configs looked up), the
    second is the one a CUDA graph is captured on where ``cuda_graphs`` allows (``first_host_ms``); after two
    settling calls on the timed inputs one steady-state call counts launches (torch.profiler); then ``n_reuse``
    reuse steps run back to back on one set of inputs, without
    a synchronisation: ``host_ms`` = their wall time / n (the CPU's cost, what a host-bound pipeline waits for),
    ``ms`` = CUDA events around them / n (the GPU's time per call, launch gaps included)."""
    site, call = runner.op(opts)
    drift, launches, steps_run, seen, first_host = runner.drift(), -1, 0, 0, float("nan")
    activities = None
    # NOTE 100 steps, not 50: MC-Sparse's schedule (warm-up 20% of the steps, anchors at its end and at 52%) left
    # 15 reuse steps between its anchors at 50, fewer than the 16 this loop takes before its timed calls end, so
    # the second anchor fell among them (H200: "1 of the 10 timed steps were not reuse steps", 4.15 ms a call at
    # H12 S32760 against 1.81 for reuse steps alone); at 100 the timed calls end at step 37 of the 31 between 21
    # and 51
    n_steps = 100
    host = gpu = float("nan")
    note, replays = "", ""
    with vc_compile.sampling(num_steps=n_steps), sdpa_backend("cudnn" if runner.cuda else "math"):
        i = 0
        while i < n_steps and seen < 3:
            qkv = tuple(t.transpose(1, 2) for t in drift.step())
            vc_compile.step(i)
            before = _phase_counts(site)
            fn = lambda: call(*qkv)  # noqa: E731
            h, _ = timed_call(fn, runner.cuda)
            if seen == 1:
                first_host = h
            i += 1
            if _step_phase(before, _phase_counts(site)) == "reuse":
                seen += 1
        # NOTE two untimed calls on the timed inputs first: a graph on q, k, v in place is captured at the second
        # call that finds them where the first left them, and a sampling loop reaches that steady state after
        # one step; timing it instead put a capture (GPU idle, ~3 ms of host) into the timed calls (H200:
        # ExpCast H12 S8192 0.86-0.90 GPU ms per call against 0.67-0.68 with the staged graph captured earlier)
        settle = 2
        if seen < 3 or i + settle + 1 + n_reuse > n_steps:
            note = f"too few reuse steps ({seen} by step {i} of {n_steps})"
        else:
            for j in range(i, i + settle):
                vc_compile.step(j)
                call(*qkv)
            i += settle
            # NOTE the launches of a steady-state call (what the timed calls are): counted on an earlier reuse step
            # they included the three input copies of a graph replayed on staged inputs (H200, 6e5a57b: 7-8 GPU
            # activities per call at H12 S <= 8192, of which 3 input copies)
            vc_compile.step(i)
            activities = gpu_activities(lambda: call(*qkv), runner.cuda)
            launches = -1 if activities is None else len(activities)
            i += 1
            before = _phase_counts(site).get("reuse", 0)
            g0 = (GRAPHS.replays, GRAPHS.direct_replays)
            if runner.cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t0 = time.perf_counter()
            for j in range(i, i + n_reuse):
                vc_compile.step(j)
                call(*qkv)
            host = (time.perf_counter() - t0) * 1e3 / n_reuse
            if runner.cuda:
                b.record()
                b.synchronize()
                gpu = a.elapsed_time(b) / n_reuse
            else:
                gpu = host
            n_done = _phase_counts(site).get("reuse", 0) - before
            n_rep, n_dir = GRAPHS.replays - g0[0], GRAPHS.direct_replays - g0[1]
            replays = f"{n_rep} ({n_dir} direct)" if n_rep else "0"
            if n_done != n_reuse:
                note = f"{n_reuse - n_done} of the {n_reuse} timed steps were not reuse steps"
    rec = next((s for s in vc_compile.report().sites if s.site == site), None)
    paths = ",".join(sorted(rec.kernel_path)) if rec is not None else ""
    if rec is not None and rec.cuda_graph_failure:
        note = (note + "; " if note else "") + f"graph capture failed: {rec.cuda_graph_failure}"
    if activities:  # what the launch count is made of, in the log (kernel names abridged)
        log("    activities: " + "; ".join(n[:48] for n in activities))
    return dict(host_ms=host, ms=gpu, launches=launches, replays=replays, steps_run=steps_run + i,
                first_host_ms=first_host,
                kernel_path=paths, note=note)


def bench_shape(H, S, args, device):
    runner = Runner(S, H, 128, 50, args.seed, device, args.smoke)
    base = dict(B=1, H=H, S=S, D=128, density="")
    rows = []
    q, k, v = (t.transpose(1, 2) for t in Drift(1, H, S, 128, seed=args.seed, device=device).step())
    sd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    with sdpa_backend("cudnn" if runner.cuda else "math"):
        for _ in range(3):
            sd()
            sdpa_host, sdpa_ms = burst(sd, args.reuse, runner.cuda)
    rows.append(dict(base, variant="sdpa_cudnn", ms=sdpa_ms, host_ms=sdpa_host,
                     launches=count_launches(sd, runner.cuda), speedup_vs_cudnn=1.0))
    from vc_compile.kernels.launch import FAST_LAUNCH
    for label in args.methods:
        # our path, measured (the gate's source); V-Smooth groups at step 0 only (MC-Sparse's warm-up too): the timed
        # calls are reuse calls. NOTE with a periodic schedule (every 10th step) the 13 steps from the settling
        # calls to the last timed one always held a group step (H200, cf11bc3: V-Smooth / ExpCast H12 S32760 0.56 /
        # 0.58 ms host per call, "1 of the 10 timed steps were not reuse steps", a k-means and a new recording)
        opts = dict(METHODS[label], speed_gate="off", **{"group_interval": 0, **args.options})
        # --ab-launch: the same method with every launch through Triton's binder right after, on the same host
        for remembered in ((True, False) if args.ab_launch else (True,)):
            FAST_LAUNCH.enabled = remembered
            try:
                r = run_method(runner, opts, args.reuse)
            finally:
                FAST_LAUNCH.enabled = True
            name = label + (f" {json.dumps(args.options, sort_keys=True)}" if args.options else "") + \
                ("" if remembered else " [binder]")
            rows.append(dict(base, variant=name, host_ms_sdpa=sdpa_host,
                             speedup_vs_cudnn=sdpa_ms / r["ms"] if r["ms"] == r["ms"] else float("nan"), **r))
            log(f"  H{H} S{S} {name:16s} host {r['host_ms']:.3f} ms  gpu {r['ms']:.3f} ms  launches "
                f"{r['launches']}  x cuDNN {rows[-1]['speedup_vs_cudnn']:.2f}  {r['note']}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="HxS list, e.g. 12x8192,2x32760 (default: the sweep)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    ap.add_argument("--reuse", type=int, default=10, help="timed reuse steps per row (median)")
    ap.add_argument("--options", default="{}", help="JSON options merged into every method's, e.g. "
                    "'{\"cuda_graphs\": \"off\"}' (named in the variant)")
    ap.add_argument("--ab-launch", action="store_true",
                    help="each method also with every launch through Triton's binder (kernels/launch.py off; "
                    "variant suffix ' [binder]'), right after it on the same host")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, reference kernels, no rows")
    ap.add_argument("--csv", default=None, help="also append rows to this file")
    args = ap.parse_args(argv)
    args.methods = parse_methods(ap, args.methods, METHODS)
    args.options = json.loads(args.options)
    if args.smoke:
        shapes = [(2, 64)]
        args.reuse = min(args.reuse, 2)
    elif args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = SHAPES
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    all_rows = []
    for H, S in shapes:
        rows = bench_shape(H, S, args, device)
        all_rows += rows
        if not args.smoke:
            append_rows(BENCH, rows, args.csv, EXTRAS)
    print_table(all_rows, ["variant", "H", "S", "host_ms", "ms", "launches", "replays", "speedup_vs_cudnn",
                           "kernel_path",
                           "note"])
    return all_rows


if __name__ == "__main__":
    main()
