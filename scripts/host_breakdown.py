"""Where the op's host time goes on a reuse step: inclusive wall time per call of each layer, and every
device->host synchronisation the call makes.

    python3 -m scripts.host_breakdown [--method vsmooth|vsmooth+expcast|mcsparse@0.15] [--shape 12x8192]
        [--steps 10] [--cprofile N] [--out F.json]

The op runs as ``benchmarks/bench_op_overhead`` runs it (a sampling loop, one call per step). On the reuse
steps after the first two, each function in ``LAYERS`` is wrapped by a timer (perf_counter, inclusive of what
it calls), and the mean per reuse call is printed, outermost first. Then one more reuse step runs under
``torch.cuda.set_sync_debug_mode("warn")``: every operation that waits for the GPU is printed with its stack.
cProfile cannot do this job: the custom op's dispatch through Dynamo's ``disable`` wrapper hides its
callees' time from it.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import importlib
import json
import pstats
import time
import traceback
import warnings

import torch

import vc_compile
import vc_compile.ops  # noqa: F401
from benchmarks.bench_generation import Runner, _phase_counts, _step_phase
from benchmarks.bench_op_overhead import METHODS
from benchmarks.common import sdpa_backend

LAYERS = [
    "torch._ops:OpOverloadPacket.__call__",
    "vc_compile.ops:attention",
    "vc_compile.ops:_rope_inputs",
    "vc_compile.kernels.dispatch:choose",
    "vc_compile.tune.gate:slower_than_stock",
    "vc_compile.kernels.graphs:LaunchGraphs.wanted",
    "vc_compile.kernels.graphs:LaunchGraphs.run",
    "vc_compile.kernels.graphs:PerMeta.of",
    "vc_compile.kernels.graphs:_where",
    "torch.cuda.graphs:CUDAGraph.replay",
    "vc_compile.kernels.programs:LaunchPrograms.run",
    "vc_compile.kernels.programs:layout_key",
    "vc_compile.kernels.programs:Program.run",
    "torch._tensor:Tensor.clone",
    "vc_compile.runtime.report:Timer.__enter__",
    "vc_compile.runtime.report:Timer.__exit__",
    "vc_compile.runtime.tracker:Tracker.current",
    "vc_compile.ops:runtime_ineligible",
    "vc_compile.ops:too_sharp",
    "vc_compile.ops:identity_problem",
    "vc_compile.runtime.report:site",
    "vc_compile.runtime.state:get",
    "vc_compile.runtime.state:put",
    "vc_compile.methods.vsmooth:plan",
    "vc_compile.methods.vsmooth:run",
    "vc_compile.methods.mcsparse:plan",
    "vc_compile.methods.mcsparse:run",
    "vc_compile.methods.mcsparse:_reuse",
    "vc_compile.kernels.dispatch:preprocess",
    "vc_compile.kernels.dispatch:vsmooth_attention",
    "vc_compile.kernels.dispatch:sparse_attention",
    "vc_compile.kernels.dispatch:_resolve",
    "vc_compile.kernels.preprocess:preprocess",
    "vc_compile.kernels.vsmooth_attn_sm90:vsmooth_attention_sm90",
    "vc_compile.kernels.vsmooth_attn:vsmooth_attention",
    "vc_compile.kernels.sparse_attn:sparse_attention",
    "vc_compile.kernels.sparse_attn_sm90:sparse_attention_sm90",
    "vc_compile.kernels.vsmooth_attn:check_inputs",
    "vc_compile.formats:to_sm90_layout",
    "vc_compile.formats:natural_layout",
    "triton.experimental.gluon.nvidia.hopper:TensorDescriptor.from_tensor",
    "triton.experimental.gluon.language._layouts:NVMMASharedLayout.get_default_for",
    "vc_compile.tune.lookup:recording",
    "vc_compile.tune.lookup:resolve",
    "triton.runtime.jit:JITFunction.run",
    "triton.backends.nvidia.driver:CudaLauncher.__call__",
]


def _wrap_all(acc):
    undo = []
    for spec in LAYERS:
        mod_name, attr = spec.split(":")
        try:
            obj = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001
            continue
        owner, name = obj, attr
        if "." in attr:
            cls, name = attr.split(".")
            owner = getattr(obj, cls, None)
            if owner is None:
                continue
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        kind = type(fn) if isinstance(fn, (staticmethod, classmethod)) else None
        raw = fn.__func__ if kind is not None else fn
        if raw is None or not callable(raw):
            continue

        def make(fn, spec):
            @functools.wraps(fn)
            def timed(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    if acc["on"]:
                        acc["t"][spec] += time.perf_counter() - t0
                        acc["n"][spec] += 1
            return timed

        wrapped = make(raw, spec)
        setattr(owner, name, kind(wrapped) if kind is not None else wrapped)
        undo.append((owner, name, fn))
    return undo


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="vsmooth+expcast", choices=list(METHODS))
    ap.add_argument("--shape", default="12x8192")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--same-buffers", action="store_true",
                    help="each step's q, k, v written into the same buffers (as a compiled model's are)")
    ap.add_argument("--options", default="{}", help="JSON options merged into the method's, e.g. "
                    "'{\"cuda_graphs\": \"on\"}'")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="instead of the timers: cProfile over the timed calls, the N functions of most own time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    H, S = (int(x) for x in args.shape.split("x"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runner = Runner(S, H, 128, 50, 0, device, device.type == "cpu")
    # groups at step 0 only (as bench_op_overhead): every timed call is a reuse call
    site, call = runner.op(dict(METHODS[args.method], speed_gate="off", **{"group_interval": 0, **json.loads(args.options)}))
    acc = {"on": False, "t": collections.Counter(), "n": collections.Counter()}
    undo = [] if args.cprofile else _wrap_all(acc)
    prof = cProfile.Profile() if args.cprofile else None
    drift, n_reuse, totals, syncs = runner.drift(), 0, [], []
    try:
        with vc_compile.sampling(num_steps=50), sdpa_backend("cudnn" if runner.cuda else "math"):
            for i in range(50):
                qkv = tuple(t.transpose(1, 2) for t in drift.step())
                if args.same_buffers:
                    bufs = bufs if i else tuple(torch.empty_like(t) for t in qkv)
                    qkv = tuple(b.copy_(t) for b, t in zip(bufs, qkv))
                vc_compile.step(i)
                before = _phase_counts(site)
                if runner.cuda:
                    torch.cuda.synchronize()
                timing = 2 <= n_reuse < 2 + args.steps
                sync_probe = n_reuse == 2 + args.steps
                acc["on"] = timing
                if sync_probe and runner.cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if prof is not None and timing:
                        prof.enable()
                    t0 = time.perf_counter()
                    call(*qkv)
                    dt = time.perf_counter() - t0
                    if prof is not None and timing:
                        prof.disable()
                if sync_probe and runner.cuda:
                    torch.cuda.set_sync_debug_mode(0)
                    syncs = [str(w.message)[:300] for w in caught if "synchroniz" in str(w.message).lower()]
                acc["on"] = False
                if _step_phase(before, _phase_counts(site)) != "reuse":
                    if timing:  # not a reuse step after all: drop what it added
                        pass
                    continue
                if timing:
                    totals.append(dt)
                n_reuse += 1
                if sync_probe:
                    break
    finally:
        for owner, name, fn in undo:
            setattr(owner, name, fn)
    n = max(len(totals), 1)
    rows = [{"layer": "whole call (perf_counter)", "ms_per_call": 1e3 * sum(totals) / n, "calls_per_call": 1.0}]
    for spec in LAYERS:
        if acc["n"][spec]:
            rows.append({"layer": spec, "ms_per_call": 1e3 * acc["t"][spec] / n,
                         "calls_per_call": acc["n"][spec] / n})
    print(f"{args.method} H{H} S{S}{' same buffers' if args.same_buffers else ''}: {len(totals)} reuse calls")
    for r in rows:
        print(f"  {r['ms_per_call']:8.3f} ms  x{r['calls_per_call']:5.2f}  {r['layer']}")
    print(f"synchronisations in one reuse call: {len(syncs)}")
    if prof is not None:  # microseconds per op call (the profiler's own cost included: read them as shares)
        st = pstats.Stats(prof).stats
        n_calls = max(len(totals), 1)
        for title, col in (("own time", 2), ("inclusive time", 3)):
            print(f"cProfile, {title}, us per op call (calls per op call):")
            for fn, v in sorted(st.items(), key=lambda kv: -kv[1][col])[:args.cprofile]:
                where = f"{fn[0].split('/site-packages/')[-1].split('/work/main/')[-1]}:{fn[1]}({fn[2]})"
                print(f"  {1e6 * v[col] / n_calls:8.1f}  x{v[1] / n_calls:5.1f}  {where}")
    for s in syncs:
        print("  " + s.replace("\n", " | "))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"method": args.method, "H": H, "S": S, "same_buffers": args.same_buffers, "rows": rows, "syncs": syncs}, f, indent=1)


if __name__ == "__main__":
    main()
