"""H200 check behind ``VSmoothSm90Config.pv_window``: the Gluon ExpCast kernel's error against fp64 for PV
windows of 1 / 2 / 4 / 8 key blocks, on V with its block means removed (V-Smooth) and without (naive 8-bit),
beside the shared-memory-P~ kernel (docs/kernels_notes.md, "PV summed by the FP8 MMA over a window").

    python3 -m scripts.pv_window_accuracy [--S 2048,4173,20000] [--H 3]

Inputs: the GPU tests' (``benchmarks.common.run_clustered_inputs``: peaked attention, channel-biased K, V clustered
in token runs with token outliers), quantised as the tests do (``preprocess``, identity order). Without block means the kernel itself runs window 1 whatever the launch says, so this script forces
the window on unsmoothed V by marking it as carrying (all-zero) means: what the kernel would do without that rule.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from vc_compile.kernels import vsmooth_attn_sm90 as g
from vc_compile.kernels.configs import VSmoothSm90Config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", default="2048,4173,20000")
    ap.add_argument("--H", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs an sm_90 GPU")
    from benchmarks.common import metrics, run_clustered_inputs
    from vc_compile.reference import preprocess as ref_pre

    def rel(a, b):
        return metrics(a, b)["rel_l2"]

    ms_ws = VSmoothSm90Config(p_operand="registers", warp_specialize=True, rowsum="mma", mean="tf32_window")
    cfgs = [("smem", VSmoothSm90Config())] + [(f"w{w}", dataclasses.replace(ms_ws, pv_window=w)) for w in (1, 2, 4, 8)]
    for S in (int(x) for x in a.S.split(",")):
        q, k, v = run_clustered_inputs(1, a.H, S, 128, torch.bfloat16, device="cuda")
        truth = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()
        for smooth in (True, False):
            qk = ref_pre.preprocess_qk(q, k, None, sm_scale=128 ** -0.5, qk_format="int8")
            vq = ref_pre.preprocess_v(v, None, smooth=smooth)
            vq = vq if smooth else vq._replace(zero_mean=False)  # the window on unsmoothed V (module doc)
            outs = {n: g.vsmooth_attention_sm90(qk, vq, expcast=True, launch=c) for n, c in cfgs}
            cells = " | ".join(f"{n} {rel(o, truth):.3e} ({rel(o, outs['smem']):.1e} vs smem)" for n, o in outs.items())
            print(f"S={S} {'smoothed' if smooth else 'unsmoothed'}: rel. L2 vs fp64: {cells}", flush=True)


if __name__ == "__main__":
    main()
