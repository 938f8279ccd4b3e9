"""H200 check behind ``VSmoothSm90Config.pv_window``: the Gluon ExpCast kernel's error against fp64 for PV
windows of 1 / 2 / 4 / 8 key blocks, on V with its block means removed (V-Smooth) and without (naive 8-bit),
beside the shared-memory-P~ kernel (docs/kernels_notes.md, "PV summed by the FP8 MMA over a window").

    python3 -m scripts.pv_window_accuracy [--S 2048,4173,20000] [--H 3]

Inputs: the GPU tests' ``make_qkv`` (peaked attention, channel-biased K, V clustered in token runs with token
outliers). Without block means the kernel itself runs window 1 whatever the launch says, so this script forces
the window on unsmoothed V by marking it as carrying (all-zero) means: what the kernel would do without that rule.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
from test_vsmooth_attn import make_qkv, quantise, rel, truth_of  # noqa: E402

from vc_compile.templates import vsmooth_attn_sm90 as g  # noqa: E402
from vc_compile.templates.configs import VSmoothSm90Config  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", default="2048,4173,20000")
    ap.add_argument("--H", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs an sm_90 GPU")
    ms_ws = VSmoothSm90Config(p_operand="registers", warp_specialize=True, rowsum="mma", mean="tf32_window")
    cfgs = [("smem", VSmoothSm90Config())] + [(f"w{w}", dataclasses.replace(ms_ws, pv_window=w)) for w in (1, 2, 4, 8)]
    for S in (int(x) for x in a.S.split(",")):
        q, k, v = make_qkv(1, a.H, S, 128, torch.bfloat16, device="cuda")
        truth = truth_of(q, k, v)
        for smooth in (True, False):
            qk, vq = quantise(q, k, v, "int8", smooth)
            vq = vq if smooth else vq._replace(zero_mean=False)  # the window on unsmoothed V (module doc)
            outs = {n: g.vsmooth_attention_sm90(qk, vq, expcast=True, launch=c) for n, c in cfgs}
            cells = " | ".join(f"{n} {rel(o, truth):.3e} ({rel(o, outs['smem']):.1e} vs smem)" for n, o in outs.items())
            print(f"S={S} {'smoothed' if smooth else 'unsmoothed'}: rel. L2 vs fp64: {cells}", flush=True)


if __name__ == "__main__":
    main()
