"""H200 A/B of the Gluon sm_90 gather kernel (templates/sparse_attn_sm90.py) against the Triton gather kernel
(templates/sparse_attn.py, its shipped launch config) on the benchmark's shapes: kernel time (median), the
efficiency eta = (t_dense / t) x s against a dense bf16 kernel of the same run (FlashAttention-3 bf16 where
``fa3_fwd_interface`` imports, else SDPA cuDNN), and agreement (rel. L2 of the Gluon output against the Triton
kernel's on every head and against the fp32 reference on heads 0-1).

    python3 -m scripts.ab_sparse_sm90 [--sizes 32760,75600] [--densities 0.15,0.25] [--C 128,64]
        [--configs 128/2,128/2p,128/3,64/3,64/4] [--residual] [--out F.json]
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats python3 -m scripts.ab_sparse_sm90 --ncu --C 128 --densities 0.15 \
        --configs 128/2

B = 1, H = 40, D = 128, bf16, random sigma and a random sorted selection per group (as bench_sparse_attn). A
``--configs`` entry is BN/stages of ``configs.SparseAttnSm90Config``, with a trailing ``p`` for the persistent grid;
one that does not fit the shared memory at a C is reported and skipped. Every row is printed as it is measured.
``--ncu``: no timing; the Triton kernel and each config once, warmed up, between ``torch.cuda.profiler.start()`` /
``stop()`` (the first size, C and density).
"""
from __future__ import annotations

import argparse
import json
import traceback

import torch

from benchmarks.common import attn_flops, bench_ms, metrics, sdpa_fn
from vc_compile.formats import n_keep
from vc_compile.reference.sparse_attn import sparse_attention as ref_sparse
from vc_compile.templates import configs as CF
from vc_compile.templates import sparse_attn as tsa
from vc_compile.templates import sparse_attn_sm90 as g

B, H, D = 1, 40, 128


def dense_fn(q, k, v):
    """(name, callable) of the dense bf16 yardstick: FA3 bf16 if it imports, else SDPA cuDNN."""
    try:
        from fa3_fwd_interface import flash_attn_func
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def fa3():
            out = flash_attn_func(qt, kt, vt, causal=False)
            return out[0] if isinstance(out, (tuple, list)) else out
        fa3()
        return "fa3-bf16", fa3
    except Exception as e:  # noqa: BLE001 - FA3 not installed / not loadable here
        print(f"fa3-bf16 unavailable ({type(e).__name__}: {str(e)[:100]}); SDPA cuDNN is the yardstick")
        return "sdpa-cudnn", sdpa_fn(q, k, v, "cudnn")


def inputs(S, C, density, dev="cuda"):
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    G, keep = -(-S // C), n_keep(S, density)
    sigma = torch.stack([torch.randperm(S, device=dev) for _ in range(B * H)]).view(B, H, S)
    idx = torch.empty(B, H, G, keep, device=dev, dtype=torch.int32)
    for h in range(H):
        idx[:, h] = torch.rand(B, G, S, device=dev).topk(keep, -1, sorted=False).indices.sort(-1).values.int()
    return q, k, v, sigma, idx, 0.1 * torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="32760")
    p.add_argument("--densities", default="0.15,0.25")
    p.add_argument("--C", default="128,64")
    p.add_argument("--configs", default="128/2,128/2p,128/3,64/2,64/2p,64/3,64/4")
    p.add_argument("--residual", action="store_true", help="time with the residual epilogue (a reuse step)")
    p.add_argument("--out", default=None)
    p.add_argument("--ncu", action="store_true", help="one profiled launch per kernel (for Nsight Compute)")
    a = p.parse_args(argv)
    rows = []
    if a.ncu:
        S, C, dens = int(a.sizes.split(",")[0]), int(a.C.split(",")[0]), float(a.densities.split(",")[0])
        q, k, v, sigma, idx, res = inputs(S, C, dens)
        kw = dict(sm_scale=D ** -0.5, group_size=C, residual=res if a.residual else None)
        calls = [lambda: tsa.sparse_attention(q, k, v, sigma, idx, launch=CF.sparse_default("bf16", D, C), **kw)]
        for spec in a.configs.split(","):
            bn, st = spec.rstrip("p").split("/")
            cfg = CF.SparseAttnSm90Config(block_n=int(bn), stages=int(st), persistent=spec.endswith("p"))
            calls.append(lambda cfg=cfg: g.sparse_attention_sm90(q, k, v, sigma, idx, launch=cfg, **kw))
        for f in calls:
            f()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for f in calls:
            f()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return rows

    def emit(r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    for S in map(int, a.sizes.split(",")):
        q, k, v, *_ = inputs(S, 128, 0.01)
        name, fn = dense_fn(q, k, v)
        t_dense = bench_ms(fn)
        emit({"variant": name, "S": S, "ms": t_dense, "tflops": attn_flops(B, H, S, S, D) / t_dense / 1e9})
        for C in map(int, a.C.split(",")):
            for dens in map(float, a.densities.split(",")):
                q, k, v, sigma, idx, res = inputs(S, C, dens)
                s = idx.shape[-1] / S
                kw = dict(sm_scale=D ** -0.5, group_size=C, residual=res if a.residual else None)
                tcfg = CF.sparse_default("bf16", D, C)
                tri = tsa.sparse_attention(q, k, v, sigma, idx, launch=tcfg, **kw)
                ref = ref_sparse(q[:, :2], k[:, :2], v[:, :2], sigma[:, :2], idx[:, :2], out_dtype=torch.float32, **{
                    **kw, "residual": res[:, :2] if a.residual else None})
                t = bench_ms(lambda: tsa.sparse_attention(q, k, v, sigma, idx, launch=tcfg, **kw))
                base = {"S": S, "C": C, "density": s, "residual": a.residual}
                emit({**base, "variant": "triton", "config": str(tcfg), "ms": t, "eta": t_dense / t * s,
                      "rel_l2_ref": metrics(tri[:, :2].float(), ref)["rel_l2"]})
                for spec in a.configs.split(","):
                    bn, st = spec.rstrip("p").split("/")
                    cfg = CF.SparseAttnSm90Config(block_n=int(bn), stages=int(st), persistent=spec.endswith("p"))
                    row = {**base, "variant": "gluon_sm90", "config": spec}
                    if cfg.smem_bytes(C, D, D) > CF.SM90_SMEM_BYTES:
                        emit({**row, "note": "does not fit the shared memory at this C"})
                        continue
                    try:
                        out = g.sparse_attention_sm90(q, k, v, sigma, idx, launch=cfg, **kw)
                        torch.cuda.synchronize()
                        t = bench_ms(lambda: g.sparse_attention_sm90(q, k, v, sigma, idx, launch=cfg, **kw))
                        emit({**row, "ms": t, "eta": t_dense / t * s, "nan": int(torch.isnan(out).sum()),
                              "rel_l2_triton": metrics(out.float(), tri.float())["rel_l2"],
                              "rel_l2_ref": metrics(out[:, :2].float(), ref)["rel_l2"]})
                    except Exception as e:  # noqa: BLE001 - report the config and go on
                        traceback.print_exc()
                        emit({**row, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
