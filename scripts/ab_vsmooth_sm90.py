"""H200 A/B of the Gluon sm_90 V-Smooth kernel (templates/vsmooth_attn_sm90.py) against the Triton one
(templates/vsmooth_attn.py) on the benchmark's structured inputs: agreement, fidelity vs fp32, time.

    python3 scripts/ab_vsmooth_sm90.py [--shapes 4173x128,32760x128] [--configs 64/4/2,64/4/3] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from benchmarks.bench_vsmooth_attn import make_inputs, truth_rows  # noqa: E402
from benchmarks.common import bench_ms, metrics, sdpa_backend  # noqa: E402
from vc_compile.templates import kmeans as tkm  # noqa: E402
from vc_compile.templates import preprocess as tpre  # noqa: E402
from vc_compile.templates import vsmooth_attn as tattn  # noqa: E402
from vc_compile.templates import vsmooth_attn_sm90 as g  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4173x128,32760x128,75600x128,32760x64,8190x128")
    p.add_argument("--configs", default="64/4/2,64/4/3,128/8/2")
    p.add_argument("--H", type=int, default=40)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cfgs = [tuple(int(x) for x in c.split("/")) for c in a.configs.split(",")]
    res = []
    for shp in a.shapes.split(","):
        S, D = (int(x) for x in shp.split("x"))
        H = a.H
        q, k, v = make_inputs(1, H, S, D)
        rows = torch.randperm(S, device="cuda")[:256].sort().values
        truth = truth_rows(q, k, v, rows)
        wu, rep = (25, 100) if S <= 10000 else ((25, 200) if S <= 40000 else (50, 600))
        with sdpa_backend("cudnn"):
            cud = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), wu, rep)
        print(f"\n=== S={S} D={D} H={H}: cudnn {cud:.3f} ms", flush=True)
        res.append(dict(S=S, D=D, variant="sdpa_cudnn", ms=cud))
        perm = tkm.kmeans_perm(v, min(256, S), 3).perm
        for name, pm, smooth, ec in (("naive8", None, False, False), ("vsmooth", perm, True, False),
                                     ("vsmooth_expcast", perm, True, True)):
            qk = tpre.preprocess_qk(q, k, pm, sm_scale=D ** -0.5)
            vq = tpre.preprocess_v(v, pm, smooth=smooth)
            ot, lt = tattn.vsmooth_attention(qk, vq, expcast=ec, return_lse=True)
            tms = bench_ms(lambda: tattn.vsmooth_attention(qk, vq, expcast=ec), wu, rep)
            mt = metrics(ot[:, :, rows].float(), truth)
            print(f"  {name:16s} triton        {tms:8.3f} ms x{cud / tms:.3f}  rel_l2 {mt['rel_l2']:.3e}", flush=True)
            res.append(dict(S=S, D=D, variant=name + "_triton", ms=tms, speedup=cud / tms, rel_l2=mt["rel_l2"]))
            for cfg in cfgs:
                try:
                    t0 = time.time()
                    og, lg = g.vsmooth_attention_sm90(qk, vq, expcast=ec, return_lse=True, config=cfg)
                    torch.cuda.synchronize()
                    first = time.time() - t0
                    gms = bench_ms(lambda: g.vsmooth_attention_sm90(qk, vq, expcast=ec, config=cfg), wu, rep)
                    mg = metrics(og[:, :, rows].float(), truth)
                    d = (og.float() - ot.float()).abs()
                    nan = int(torch.isnan(og).any(-1).sum())
                    dl = (lg - lt).abs().max().item()
                    print(f"  {name:16s} gluon {cfg}  {gms:8.3f} ms x{cud / gms:.3f}  rel_l2 {mg['rel_l2']:.3e} "
                          f"| vs triton max {d.max().item():.3e} mean {d.mean().item():.3e} lse {dl:.2e} "
                          f"nan rows {nan} | first {first:.1f}s", flush=True)
                    res.append(dict(S=S, D=D, variant=name + "_gluon", cfg=list(cfg), ms=gms, speedup=cud / gms,
                                    rel_l2=mg["rel_l2"], max_diff=d.max().item(), nan_rows=nan, lse_diff=dl))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} gluon {cfg} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    traceback.print_exc(limit=2)
            del qk, vq, ot
        del q, k, v
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
