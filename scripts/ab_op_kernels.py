"""Where a V-Smooth reuse step's GPU time goes, kernel by kernel, at the checked-out commit: the op as the runtime
runs it (preprocessing of Q, K, V with the cached key order, then the attention kernel), timed by the profiler
over repeated calls (median per kernel), plus the whole op by CUDA events. Works on trees before and after the
two-launch preprocessing (it adapts to either API), so two checkouts can be compared in one run:

    python3 -m scripts.ab_op_kernels --out /tmp/new.json                  # this checkout
    (cd /tmp/old && python3 -m scripts.ab_op_kernels --out /tmp/old.json) # another commit
    python3 -m scripts.ab_op_kernels --compare /tmp/old.json /tmp/new.json

Inputs: benchmarks' structured [B, S, H, D] tensors viewed as [B, H, S, D] (B = 1, D = 128), a fixed random key
order (a k-means order costs the same to gather).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def _op(q, k, v, perm, expcast, pre_launch=None):
    from vc_compile.kernels import dispatch
    T = dispatch.Impl.TRITON
    sm = q.shape[-1] ** -0.5
    if hasattr(dispatch, "preprocess"):
        launch = None
        if pre_launch:
            from vc_compile.kernels.configs import PreprocessConfig
            launch = PreprocessConfig.from_json(json.loads(pre_launch))

        def run():
            qk, vq = dispatch.preprocess(T, q, k, v, perm, sm_scale=sm, expcast=expcast, launch=launch)
            return dispatch.vsmooth_attention(T, qk, vq, expcast=expcast)
    else:
        def run():
            qk = dispatch.preprocess_qk(T, q, k, perm, sm_scale=sm)
            vq = dispatch.preprocess_v(T, v, perm)
            return dispatch.vsmooth_attention(T, qk, vq, expcast=expcast)
    return run


def measure(H, S, expcast, reps=20, pre_launch=None):
    from benchmarks.bench_vsmooth_attn import make_inputs
    q, k, v = make_inputs(1, H, S, 128)
    g = torch.Generator(device="cuda").manual_seed(3)
    perm = torch.stack([torch.randperm(S, device="cuda", generator=g) for _ in range(H)]).view(1, H, S)
    run = _op(q, k, v, perm, expcast, pre_launch)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    per = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    kern = {n: statistics.median(t) for n, t in per.items()}
    counts = {n: len(t) / reps for n, t in per.items()}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        run()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    attn = {n: t for n, t in kern.items() if "vsmooth_attn" in n}
    pre = {n: t * counts[n] for n, t in kern.items() if n not in attn}
    return {"op_ms": statistics.median(times), "attn_ms": sum(attn.values()), "pre_ms": sum(pre.values()),
            "launches": sum(counts.values()), "kernels": {n: [round(kern[n], 4), counts[n]] for n in kern}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs="+")
    ap.add_argument("--shapes", default="40x32760,40x75600,12x32760")
    ap.add_argument("--modes", default="exp2,expcast", help="exp2 and / or expcast")
    ap.add_argument("--pre-launch", default=None, help="a PreprocessConfig as JSON (trees that have it)")
    a = ap.parse_args(argv)
    if a.compare:
        runs = [json.load(open(p)) for p in a.compare]
        for key in runs[0]:
            vals = [r.get(key, {}) for r in runs]
            print(key, " | ".join(f"op {v.get('op_ms', float('nan')):.3f} attn {v.get('attn_ms', float('nan')):.3f} "
                                  f"pre {v.get('pre_ms', float('nan')):.3f} ms, {v.get('launches', 0):.0f} launches"
                                  for v in vals))
        return 0
    out = {}
    for sh in a.shapes.split(","):
        H, S = (int(x) for x in sh.split("x"))
        for ec in [m == "expcast" for m in a.modes.split(",")]:
            key = f"H{H}_S{S}_{'expcast' if ec else 'exp2'}"
            out[key] = measure(H, S, ec, pre_launch=a.pre_launch)
            r = out[key]
            print(f"{key}: op {r['op_ms']:.3f} ms, attention {r['attn_ms']:.3f}, preprocessing {r['pre_ms']:.3f} "
                  f"in {r['launches'] - 1:.0f} launches", flush=True)
            for n, (t, c) in sorted(r["kernels"].items(), key=lambda x: -x[1][0]):
                print(f"    {t:8.4f} ms x {c:.0f}  {n[:90]}")
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
