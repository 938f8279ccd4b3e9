"""The Gluon sm_90 gather kernel (kernels/sparse_attn_sm90.py) against the Triton gather kernel
(kernels/sparse_attn.py, its shipped launch config) and the dense bf16 kernels of the same run (FlashAttention-3
bf16 where ``fa3_fwd_interface`` imports, SDPA cuDNN): kernel time (median), the efficiency
eta = (t_FA3 / t) x s (the MC-Sparse paper's measure; SDPA cuDNN stands in where FA3 is missing), and agreement
(rel. L2 against the fp32 reference on heads 0-1, and of the Gluon output against the Triton kernel's).

    python3 -m benchmarks.bench_sparse_attn_sm90 [--sizes 32760,75600] [--densities 0.15,0.25] [--C 128,64]
        [--configs default,128/2,128/2fo,...] [--qk8] [--compact] [--no-residual] [--no-csv]
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        python3 -m benchmarks.bench_sparse_attn_sm90 --ncu --C 128 --densities 0.15 --configs 128/2,128/2fo

B = 1, H = 40, D = 128, bf16, random sigma and a random sorted selection per group (as bench_sparse_attn), the
reuse step's residual epilogue on (``--no-residual``: off). A ``--configs`` entry is ``default`` (the kernel's
default at that C) or ``BN/stages`` of ``configs.SparseAttnSm90Config`` with letters for its switches
(``from_spec``: f producer-side proxy fence, o FlashAttention-3's overlap order); one that does not fit the
shared memory at a C is reported and skipped. Every row is printed as it is measured, then the table; rows are appended to ``benchmarks/results/bench_sparse_attn_sm90.csv``.
``--compact``: also each config on MC-Sparse's default metadata (``gluon_sm90_gather_runs8``: a random selection of
aligned 8-key runs as int16 run numbers, the residual as int8 codes with per-token scales).
``--ncu``: no timing; the Triton kernel and each config once, warmed up, between ``torch.cuda.profiler.start()``
/ ``stop()`` (the first size, C and density).
"""
from __future__ import annotations

import argparse
import json
import traceback

import torch

from benchmarks.common import append_rows, attn_flops, bench_ms, metrics, print_table, sdpa_fn
from vc_compile.formats import n_keep
from vc_compile.reference.sparse_attn import sparse_attention as ref_sparse
from vc_compile.kernels import configs as CF
from vc_compile.kernels import sparse_attn as tsa
from vc_compile.kernels import sparse_attn_sm90 as g

BENCH = "bench_sparse_attn_sm90"
B, H, D = 1, 40, 128
EXTRAS = ["C", "config", "residual", "eta", "rel_l2_triton", "k_quant_ms"]


def fa3_fn(q, k, v):
    """FA3 bf16 on these inputs, or None where ``fa3_fwd_interface`` does not import or run."""
    try:
        from fa3_fwd_interface import flash_attn_func
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def fa3():
            out = flash_attn_func(qt, kt, vt, causal=False)
            return out[0] if isinstance(out, (tuple, list)) else out
        fa3()
        return fa3
    except Exception as e:  # noqa: BLE001 - FA3 not installed / not loadable here
        print(f"fa3-bf16 unavailable ({type(e).__name__}: {str(e)[:100]}); eta against SDPA cuDNN")
        return None


def inputs(S, C, density, dev="cuda"):
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    G, keep = -(-S // C), n_keep(S, density)
    sigma = torch.stack([torch.randperm(S, device=dev) for _ in range(B * H)]).view(B, H, S)
    idx = torch.empty(B, H, G, keep, device=dev, dtype=torch.int32)
    for h in range(H):
        idx[:, h] = torch.rand(B, G, S, device=dev).topk(keep, -1, sorted=False).indices.sort(-1).values.int()
    return q, k, v, sigma, idx, 0.1 * torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)


def compact_row(q, k, v, sigma, res, keep, C, cfg, name, base, t_dense, t_cudnn, flops):
    """The Gluon kernel on MC-Sparse's default metadata: a random selection of aligned 8-key runs (int16 run
    numbers, ``keep`` keys a group), the residual as int8 codes with one scale a token; its time, eta and rel. L2
    against the reference on heads 0-1."""
    from vc_compile.torch_ops import row_codes
    S, run = q.shape[2], 8
    G = -(-S // C)
    runs = torch.empty(B, H, G, keep // run, device=q.device, dtype=torch.int16)
    for h in range(H):
        runs[:, h] = torch.rand(B, G, S // run, device=q.device).topk(keep // run, -1, sorted=False).indices.sort(
            -1).values.to(torch.int16)
    kw = dict(sm_scale=D ** -0.5, group_size=C, run=run)
    if res is not None:
        codes, scale = row_codes(res, torch.int8)
        kw.update(residual=codes, res_scale=scale)
    out = g.sparse_attention_sm90(q, k, v, sigma, runs, launch=cfg, **kw)
    t = bench_ms(lambda: g.sparse_attention_sm90(q, k, v, sigma, runs, launch=cfg, **kw))
    two = {n: (x[:, :2] if x is not None else None) for n, x in (("residual", kw.get("residual")),
                                                               ("res_scale", kw.get("res_scale")))}
    ref = ref_sparse(q[:, :2], k[:, :2], v[:, :2], sigma[:, :2], runs[:, :2], out_dtype=torch.float32,
                     **{**kw, **two})
    m = metrics(out[:, :2].float(), ref)
    s = keep / S
    return {**base, "variant": "gluon_sm90_gather_runs8", "config": name, "ms": t, "tflops": s * flops / t / 1e9,
            "speedup_vs_cudnn": t_cudnn / t, "eta": t_dense / t * s, "rel_l2": m["rel_l2"], "cos_sim": m["cos_sim"]}


def config_of(spec: str, C: int) -> CF.SparseAttnSm90Config:
    return CF.sparse_sm90_default(C) if spec == "default" else CF.SparseAttnSm90Config.from_spec(spec)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="32760,75600")
    p.add_argument("--densities", default="0.15,0.25")
    p.add_argument("--C", default="128")
    p.add_argument("--configs", default="default")
    p.add_argument("--no-residual", dest="residual", action="store_false",
                   help="time without the residual epilogue (a reuse step has it)")
    p.add_argument("--qk8", action="store_true",
                   help="also each config with 8-bit QK (int8 K codes, one scale a head; Q quantised in the kernel)")
    p.add_argument("--compact", action="store_true",
                   help="also each config on runs of 8 keys (int16 run numbers) and an int8 residual")
    p.add_argument("--no-csv", action="store_true")
    p.add_argument("--ncu", action="store_true", help="one profiled launch per kernel (for Nsight Compute)")
    a = p.parse_args(argv)
    rows = []
    if a.ncu:
        S, C, dens = int(a.sizes.split(",")[0]), int(a.C.split(",")[0]), float(a.densities.split(",")[0])
        q, k, v, sigma, idx, res = inputs(S, C, dens)
        kw = dict(sm_scale=D ** -0.5, group_size=C, residual=res if a.residual else None)
        calls = [lambda: tsa.sparse_attention(q, k, v, sigma, idx, launch=CF.sparse_default("bf16", D, C), **kw)]
        k8, ks = tsa.quantize_k_int8_head(k) if a.qk8 else (None, None)
        for spec in a.configs.split(","):
            cfg = config_of(spec, C)
            calls.append(lambda cfg=cfg: g.sparse_attention_sm90(q, k, v, sigma, idx, launch=cfg, **kw))
            if a.qk8:
                calls.append(lambda cfg=cfg: g.sparse_attention_sm90(q, k8, v, sigma, idx, launch=cfg, k_scale=ks, **kw))
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
        flops = attn_flops(B, H, S, S, D)
        t_cudnn = bench_ms(sdpa_fn(q, k, v, "cudnn"))
        shape = {"B": B, "H": H, "S": S, "D": D}
        emit({**shape, "variant": "sdpa_cudnn", "density": 1.0, "ms": t_cudnn, "tflops": flops / t_cudnn / 1e9})
        fa3 = fa3_fn(q, k, v)
        t_dense = t_cudnn
        if fa3 is not None:
            t_dense = bench_ms(fa3)
            emit({**shape, "variant": "fa3-bf16", "density": 1.0, "ms": t_dense, "tflops": flops / t_dense / 1e9})
        del q, k, v
        for C in map(int, a.C.split(",")):
            for dens in map(float, a.densities.split(",")):
                q, k, v, sigma, idx, res = inputs(S, C, dens)
                s = idx.shape[-1] / S
                kw = dict(sm_scale=D ** -0.5, group_size=C, residual=res if a.residual else None)
                ref = ref_sparse(q[:, :2], k[:, :2], v[:, :2], sigma[:, :2], idx[:, :2], out_dtype=torch.float32,
                                 **{**kw, "residual": res[:, :2] if a.residual else None})
                base = {**shape, "C": C, "density": s, "residual": a.residual}

                def timed(variant, config, fn, out):
                    t = bench_ms(fn)
                    m = metrics(out[:, :2].float(), ref)
                    return {**base, "variant": variant, "config": config, "ms": t, "tflops": s * flops / t / 1e9,
                            "speedup_vs_cudnn": t_cudnn / t, "eta": t_dense / t * s, "rel_l2": m["rel_l2"],
                            "cos_sim": m["cos_sim"]}
                tcfg = CF.sparse_default("bf16", D, C)
                tri = tsa.sparse_attention(q, k, v, sigma, idx, launch=tcfg, **kw)
                emit(timed("triton_gather", str(tcfg),
                           lambda: tsa.sparse_attention(q, k, v, sigma, idx, launch=tcfg, **kw), tri))
                for spec in a.configs.split(","):
                    cfg = config_of(spec, C)
                    name = spec if spec != "default" else f"default ({cfg})"
                    row = {**base, "variant": "gluon_sm90_gather", "config": name}
                    if cfg.smem_bytes(C, D, D) > CF.SM90_SMEM_BYTES:
                        print(json.dumps({**row, "note": "does not fit the shared memory at this C"}))
                        continue
                    try:
                        out = g.sparse_attention_sm90(q, k, v, sigma, idx, launch=cfg, **kw)
                        torch.cuda.synchronize()
                        r = timed("gluon_sm90_gather", name,
                                  lambda: g.sparse_attention_sm90(q, k, v, sigma, idx, launch=cfg, **kw), out)
                        r["rel_l2_triton"] = metrics(out.float(), tri.float())["rel_l2"]
                        if torch.isnan(out).any():
                            r["note"] = f"{int(torch.isnan(out).sum())} NaN"
                        emit(r)
                        if a.qk8:
                            k8, ks = tsa.quantize_k_int8_head(k)
                            out8 = g.sparse_attention_sm90(q, k8, v, sigma, idx, launch=cfg, k_scale=ks, **kw)
                            torch.cuda.synchronize()
                            r8 = timed("gluon_sm90_gather_qk8", name, lambda: g.sparse_attention_sm90(
                                q, k8, v, sigma, idx, launch=cfg, k_scale=ks, **kw), out8)
                            r8["rel_l2_triton"] = metrics(out8.float(), tri.float())["rel_l2"]
                            r8["k_quant_ms"] = bench_ms(lambda: tsa.quantize_k_int8_head(k))
                            emit(r8)
                            del k8, ks, out8
                        if a.compact:
                            emit(compact_row(q, k, v, sigma, res if a.residual else None, idx.shape[-1], C, cfg,
                                             name, base, t_dense, t_cudnn, flops))
                    except Exception as e:  # noqa: BLE001 - report the config and go on
                        traceback.print_exc()
                        print(json.dumps({**row, "error": f"{type(e).__name__}: {str(e)[:200]}"}))
                del q, k, v, sigma, idx, res, tri
    print_table(rows, ["variant", "config", "S", "C", "density", "ms", "tflops", "speedup_vs_cudnn", "eta",
                       "rel_l2", "rel_l2_triton"])
    if not a.no_csv and rows:
        print("rows appended to " + append_rows(BENCH, rows, extras=EXTRAS))
    return rows


if __name__ == "__main__":
    main()
