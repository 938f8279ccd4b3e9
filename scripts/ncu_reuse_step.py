"""One V-Smooth reuse step (preprocessing + attention, by default ExpCast at S = 32760, H = 40, D = 128) between
``torch.cuda.profiler.start()/stop()``, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats python3 -m scripts.ncu_reuse_step [--H 12 --S 8192]

Warmed up first, so only the profiled call's kernels are captured (2 preprocessing launches + the attention;
``--pre-only``: the two preprocessing launches alone, e.g. with ncu's ``--section MemoryWorkloadAnalysis``).
"""
import argparse

import torch

from benchmarks.bench_vsmooth_attn import make_inputs
from vc_compile.kernels import dispatch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--H", type=int, default=40)
    ap.add_argument("--S", type=int, default=32760)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--exp2", action="store_true", help="V-Smooth's exp2 softmax instead of ExpCast")
    ap.add_argument("--pre-only", action="store_true", help="profile the preprocessing launches alone")
    args = ap.parse_args(argv)
    T = dispatch.Impl.TRITON
    H, S, D, expcast = args.H, args.S, args.D, not args.exp2
    q, k, v = make_inputs(1, H, S, D)
    g = torch.Generator(device="cuda").manual_seed(3)
    perm = torch.stack([torch.randperm(S, device="cuda", generator=g) for _ in range(H)]).view(1, H, S)

    def step(pre_only=False):
        qk, vq = dispatch.preprocess(T, q, k, v, perm, sm_scale=D ** -0.5, expcast=expcast)
        return None if pre_only else dispatch.vsmooth_attention(T, qk, vq, expcast=expcast)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step(args.pre_only)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
