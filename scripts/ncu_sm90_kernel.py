"""One launch of the sm_90 Gluon attention kernel (or of FA3's FP8 kernel on the same inputs) between
``torch.cuda.profiler.start()/stop()``, for Nsight Compute's per-instruction stall sampling:

    ncu --profile-from-start off --clock-control none --section WarpStateStats --section SourceCounters \\
        --page source --print-source sass --csv python3 -m scripts.ncu_sm90_kernel [--which ours|fa3]
        [--mode expcast|exp2] [--H 8] [--S 32760] [--launch '{"pv_group": 4}']

Warmed up first (compiles and autotuning outside the profiled range). The kernel benchmark's structured inputs.
"""
import argparse
import dataclasses
import json

import torch

from benchmarks.bench_vsmooth_attn import make_inputs, runtime_pre


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--which", default="ours", choices=("ours", "fa3"))
    ap.add_argument("--mode", default="expcast", choices=("expcast", "exp2"))
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--S", type=int, default=32760)
    ap.add_argument("--launch", default="{}")
    a = ap.parse_args()
    D = 128
    q, k, v = make_inputs(1, a.H, a.S, D)
    if a.which == "fa3":
        from benchmarks.common import fa3_fp8_fn
        fn = fa3_fp8_fn(q, k, v)
        if fn is None:
            raise SystemExit("fa3-fwd is not installed")
    else:
        from vc_compile.kernels.configs import vsmooth_sm90_default
        from vc_compile.kernels.vsmooth_attn_sm90 import vsmooth_attention_sm90
        ec = a.mode == "expcast"
        g = torch.Generator(device="cuda").manual_seed(3)
        perm = torch.stack([torch.randperm(a.S, device="cuda", generator=g) for _ in range(a.H)]).view(1, a.H, a.S)
        qk, vq = runtime_pre(q, k, v, perm, D ** -0.5, True, ec)
        cfg = dataclasses.replace(vsmooth_sm90_default(D, ec, a.S), **json.loads(a.launch))
        fn = lambda: vsmooth_attention_sm90(qk, vq, expcast=ec, launch=cfg)  # noqa: E731
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
