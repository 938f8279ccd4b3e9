"""H200 A/B of launch configurations of the Gluon sm_90 V-Smooth kernel (kernels/vsmooth_attn_sm90.py) on the
benchmark's structured inputs: NaN rows, agreement with the shipped configuration and the reference, fidelity
vs fp32, time (median, with SDPA cuDNN of the same run).

    python3 -m scripts.ab_vsmooth_sm90 [--check-shapes 300x128,4173x128] [--shapes 32760x128]
        [--variants "vsmooth:smem,expcast:ms_ws,expcast:reg_ws/stages=3,..."] [--triton] [--out F.json]

A variant is METHOD:STRUCTURE[/FIELD=VALUE...] with METHOD in naive8 / vsmooth / expcast, STRUCTURE one of
``STRUCTURES`` (shared-memory P~, register P~, + warp specialisation, + row sums and mean term by MMA) and
optional fields of ``configs.VSmoothSm90Config`` (block_m, num_warps, stages); a launch config the dataclass
refuses is reported and skipped.
--check-shapes run first, on H = 4 (correctness only: NaN rows, rel. L2 vs the shipped config and vs the
reference); --shapes are timed on H = 40 (and checked against the fp32 truth on 256 sampled rows).
--triton adds the Triton kernel's row per method.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from benchmarks.bench_vsmooth_attn import make_inputs, truth_rows
from benchmarks.common import bench_ms, metrics, sdpa_backend
from vc_compile.reference import vsmooth_attn as ref
from vc_compile.kernels import configs as C
from vc_compile.kernels import kmeans as tkm
from vc_compile.kernels import preprocess as tpre
from vc_compile.kernels import vsmooth_attn as tattn
from vc_compile.kernels import vsmooth_attn_sm90 as g

_REG = dict(p_operand="registers")
_MS = dict(rowsum="mma", mean="tf32_window")
STRUCTURES = {"smem": {}, "reg": dict(_REG), "reg_ws": dict(_REG, warp_specialize=True), "ms": dict(_REG, **_MS),
              "ms_ws": dict(_REG, warp_specialize=True, **_MS)}
AB_VARIANTS = ("naive8:smem,vsmooth:smem,expcast:smem,naive8:ms_ws,vsmooth:reg,vsmooth:reg_ws,vsmooth:ms,"
               "vsmooth:ms_ws,expcast:reg,expcast:reg_ws,expcast:reg_ws/stages=3,expcast:ms,expcast:ms_ws")
METHODS = {"naive8": (False, False), "vsmooth": (True, False), "expcast": (True, True)}  # (smooth, expcast)
BASE = C.VSmoothSm90Config()  # shared-memory P~: the yardstick of the --check-shapes comparison


def parse(spec):
    """[(item, method, VSmoothSm90Config or the error that refused it)]."""
    out = []
    for item in spec.split(","):
        method, cfg = item.split(":")
        name, *fields = cfg.split("/")
        kw = dict(STRUCTURES[name])
        for f in fields:
            key, val = f.split("=")
            kw[key] = {"true": True, "false": False}.get(val, int(val) if val.isdigit() else val)
        try:
            launch = C.VSmoothSm90Config(**kw)
        except (TypeError, ValueError) as e:
            launch = e
        out.append((item, method, launch))
    return out


def inputs(S, D, H, perm_k):
    q, k, v = make_inputs(1, H, S, D)
    perm = tkm.kmeans_perm(v, min(perm_k, S), 3).perm
    quant = {}
    for method, (smooth, _) in METHODS.items():
        pm = perm if smooth else None
        quant[method] = (tpre.preprocess_qk(q, k, pm, sm_scale=D ** -0.5), tpre.preprocess_v(v, pm, smooth=smooth))
    return q, k, v, quant


def run(qk, vq, method, cfg, lse=False):
    return g.vsmooth_attention_sm90(qk, vq, expcast=METHODS[method][1], return_lse=lse, launch=cfg)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(shape, variants, res):
    S, D = shape
    q, k, v, quant = inputs(S, D, 4, 64)
    print(f"\n=== check S={S} D={D} H=4", flush=True)
    for item, method, cfg in variants:
        qk, vq = quant[method]
        try:
            if isinstance(cfg, Exception):
                raise cfg
            o, lse = run(qk, vq, method, cfg, lse=True)
            base, blse = run(qk, vq, method, BASE, lse=True)
            ro = ref.vsmooth_attention(qk, vq, expcast=METHODS[method][1])
            nan = int((~torch.isfinite(o)).any(-1).sum()) + int((~torch.isfinite(lse)).sum())
            d = dict(kind="check", S=S, D=D, variant=item, nan=nan, vs_base=rel(o, base), vs_ref=rel(o, ro),
                     lse_diff=(lse - blse).abs().max().item())
            print(f"  {item:28s} nan {nan:5d}  vs shared-memory-P~ kernel {d['vs_base']:.2e}  vs reference "
                  f"{d['vs_ref']:.2e}  lse {d['lse_diff']:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            d = dict(kind="check", S=S, D=D, variant=item, error=f"{type(e).__name__}: {str(e)[:200]}")
            print(f"  {item:28s} FAILED {d['error']}", flush=True)
        res.append(d)


def timing(shape, variants, res, triton):
    S, D = shape
    H = 40
    q, k, v, quant = inputs(S, D, H, 256)
    rows = torch.randperm(S, device="cuda")[:256].sort().values
    truth = truth_rows(q, k, v, rows)
    wu, rep = (25, 100) if S <= 10000 else ((25, 200) if S <= 40000 else (10, 30))
    with sdpa_backend("cudnn"):
        cud = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), wu, rep)
    flops = 4 * H * S * S * D
    print(f"\n=== time S={S} D={D} H={H}: cudnn {cud:.3f} ms ({flops / cud / 1e9:.0f} TFLOP/s)", flush=True)
    res.append(dict(kind="time", S=S, D=D, variant="sdpa_cudnn", ms=cud))
    if triton:
        for method, (_, ec) in METHODS.items():
            qk, vq = quant[method]
            tms = bench_ms(lambda: tattn.vsmooth_attention(qk, vq, expcast=ec,
                                                          launch=C.VSMOOTH_TRITON_DEFAULT[(D, ec)]), wu, rep)
            print(f"  {method + ' triton':28s} {tms:8.3f} ms x{cud / tms:.3f}", flush=True)
            res.append(dict(kind="time", S=S, D=D, variant=method + "_triton", ms=tms, speedup=cud / tms))
    for item, method, cfg in variants:
        qk, vq = quant[method]
        try:
            if isinstance(cfg, Exception):
                raise cfg
            t0 = time.time()
            o = run(qk, vq, method, cfg)
            torch.cuda.synchronize()
            first = time.time() - t0
            ms = bench_ms(lambda: run(qk, vq, method, cfg), wu, rep)
            m = metrics(o[:, :, rows].float(), truth)
            nan = int((~torch.isfinite(o)).any(-1).sum())
            d = dict(kind="time", S=S, D=D, variant=item, ms=ms, speedup=cud / ms, tflops=flops / ms / 1e9,
                     rel_l2=m["rel_l2"], nan=nan)
            print(f"  {item:28s} {ms:8.3f} ms x{cud / ms:.3f} {d['tflops']:5.0f} TFLOP/s rel_l2 {m['rel_l2']:.3e}"
                  f" nan rows {nan} | first call {first:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            d = dict(kind="time", S=S, D=D, variant=item, error=f"{type(e).__name__}: {str(e)[:200]}")
            print(f"  {item:28s} FAILED {d['error']}", flush=True)
            traceback.print_exc(limit=2)
        res.append(d)
    del q, k, v, quant
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check-shapes", default="300x128,4173x128")
    p.add_argument("--shapes", default="32760x128")
    p.add_argument("--variants", default=AB_VARIANTS)
    p.add_argument("--triton", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    variants = parse(a.variants)
    res = []
    shp = lambda s: [tuple(int(x) for x in t.split("x")) for t in s.split(",") if t]  # noqa: E731
    for s in shp(a.check_shapes):
        check(s, variants, res)
    for s in shp(a.shapes):
        timing(s, variants, res, a.triton)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
