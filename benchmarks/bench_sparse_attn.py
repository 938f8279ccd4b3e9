"""MC-Sparse kernels on the H200: token-gather sparse attention, reuse and anchor steps, Fast PDDP.

    python -m benchmarks.bench_sparse_attn            # S in {32760, 75600}, H = 40, D = 128, B = 1
    python -m benchmarks.bench_sparse_attn --quick    # S = 32760 only
    python -m benchmarks.bench_sparse_attn --csv $OUT/bench_sparse_attn.csv   # also copy rows there
    python -m benchmarks.bench_sparse_attn --ab [--sizes 32760,75600] [--budget 200]   # switch A/B

Rows (``variant``), all with B = 1, H = 40, D = 128, C = 64, bf16 inputs:
* ``sdpa_cudnn`` / ``sdpa_flash``: dense baselines measured in the same process; where they import (sm_90 for
  the FP8 ones), ``fa4-bf16`` (FlashAttention-4), ``fa3-fp8`` (FlashAttention-3's FP8 kernel alone, inputs
  quantised once per (batch, head)) and ``torchao-fp8`` (torchao's FP8 attention op from bf16, its
  quantisation included; ``speedup_vs_torchao``), else a logged note. The FP8 rows carry rel_l2 / cos_sim.
* ``sparse_{bf16,fp8}`` at s in {0.10, 0.15, 0.25}: the gather kernel with a random sorted top-K per
  group (PDDP groups of these queries). ``density`` = realised n_keep / S; ``tflops`` = effective
  (dense FLOPs 4 B H S^2 D over the time). fp8 rows include the per-token K quantisation pass (K changes
  every step). ``efficiency`` = (t_dense_ours / t_sparse) * density, where "our dense kernel of the same
  precision" is the same gather kernel at density 1.0 (idx = arange(S), broadcast), row ``dense_ours_*``.
* ``reuse_{bf16,fp8}`` at s = 0.15: gather kernel + residual epilogue (bf16 R) = a whole reuse step.
* ``anchor_*`` at s = 0.15 (bf16): pddp (grouping), pass1 (``dense_with_lse``: cuDNN + LSE), pass2+top-K
  (``methods/mcsparse.select``, heads chunked as the runtime does; ``anchor_pass2_mass`` times the mass kernel
  alone), sparse + residual subtraction, ``anchor_total``; ``speedup_vs_cudnn`` < 1 there is the cost
  relative to a dense cuDNN step.
* ``pddp`` and ``flash_kmeans_it{3,10}`` (flash-kmeans 0.3.1, K = S / C clusters, fp16, if importable).
* ``*_c128``: the same with C = 128 query groups (SPEC 3.4 allows C = 64 or 128): twice the MMA work
  per gathered K/V byte.
* ``sweep_*_c128``: launch configs (BLOCK_N, warps, stages) at S = 32760, s = 0.15; the fastest is used
  (C = 64 configs were swept on the first run, see configs.SPARSE_DEFAULT).
* the log also prints per-level PDDP stage times (``pddp_perm(marks=...)``).
* ``--ab``: the gather kernel's shared K/V offsets (``SparseAttnConfig.kv_off``) x launch configs
  (``ab_candidates``) at s = 0.15, C in {64, 128}: ``ab_<name>_c<C>`` = kernel alone,
  ``ab_<name>_reuse_c<C>`` = with the residual epilogue (a reuse step); rel_l2 there is against the
  first candidate (kv_off off, shipped config) on the same inputs, and a candidate above AB_TOL is
  flagged WRONG. Candidates run in order until --budget seconds are spent; the rest are listed as skipped.
Every kernel call passes its launch config explicitly (``launch=``).
rel_l2 / cos_sim: against the fp32 reference on heads 0-1 (reference/sparse_attn{,_q8}.py, dense.py).
"""
from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:  # CPU dry run of this script (Triton interpreter, tiny shapes)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.common import (add_speedup, append_rows, attn_flops, bench_ms, fa4_fn, fa4_status,  # noqa: E402
                               metrics, print_table, run_fp8_baselines, sdpa_fn)
from vc_compile.formats import n_keep  # noqa: E402
from vc_compile.methods import mcsparse as M  # noqa: E402
from vc_compile.reference.dense import dense_attention_lse  # noqa: E402
from vc_compile.reference.sparse_attn import sparse_attention as ref_sparse  # noqa: E402
from vc_compile.reference.sparse_attn_q8 import sparse_attention_q8  # noqa: E402
from vc_compile.kernels import configs as CF  # noqa: E402
from vc_compile.kernels import dispatch  # noqa: E402
from vc_compile.kernels import pddp as tpddp  # noqa: E402
from vc_compile.kernels import select as tsel  # noqa: E402
from vc_compile.kernels import sparse_attn as tsa  # noqa: E402
from vc_compile.kernels.configs import SparseAttnConfig  # noqa: E402

B, H, D, C = 1, 40, 128, 64
DENSITIES = (0.10, 0.15, 0.25)
# C = 64 was swept on the first H200 run (configs.SPARSE_DEFAULT); C = 128 is swept here
SWEEP_C128 = [SparseAttnConfig(*c) for c in ((64, 4, 3), (64, 4, 4), (64, 8, 3), (64, 8, 4), (128, 8, 3),
                                             (128, 4, 3))]
EXTRAS = ["efficiency", "config", "group_size", "speedup_vs_fa4", "note", "speedup_vs_torchao"]


def random_idx(S, keep, G, device, heads_per_chunk=4):
    """A random sorted top-``keep`` subset of the S keys for every group (chunked: rand is G x S)."""
    out = torch.empty(B, H, G, keep, device=device, dtype=torch.int32)
    for h0 in range(0, H, heads_per_chunk):
        r = torch.rand(B, min(heads_per_chunk, H - h0), G, S, device=device)
        out[:, h0:h0 + heads_per_chunk] = r.topk(keep, dim=-1, sorted=False).indices.sort(-1).values.int()
    return out


def row(variant, S, density, ms, t_cudnn, **kw):
    fl = attn_flops(B, H, S, S, D)
    r = {"variant": variant, "B": B, "H": H, "S": S, "D": D, "density": density, "ms": ms,
         "tflops": fl / (ms * 1e-3) / 1e12, "speedup_vs_cudnn": t_cudnn / ms}
    r.update(kw)
    return r


def head_metrics(out, ref_fn):
    ref = ref_fn()
    m = metrics(out[:, :2].float(), ref.float())
    return {"rel_l2": m["rel_l2"], "cos_sim": m["cos_sim"]}


def cfg_name(cfg):
    return f"BN{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}" + ("" if cfg.kv_off is None else
                                                                       f"_kvoff{int(cfg.kv_off)}")


def sweep(q, k, v, sigma, idx, sm, t_cudnn, S, dens, Cg, configs, log):
    rows, best = [], {}
    kf8 = tsa.quantize_k_fp8(k)
    for fmt in ("bf16", "fp8"):
        times = {}
        for cfg in configs:
            try:
                fn = lambda: tsa.sparse_attention(q, k, v, sigma, idx, sm_scale=sm, group_size=Cg,  # noqa
                                                  qk_format=fmt, launch=cfg, k_fp8=kf8)
                times[cfg] = bench_ms(fn, warmup=10, rep=40)
            except Exception as e:  # a config that does not compile (registers / shared memory)
                log(f"sweep C={Cg} {fmt} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append(row(f"sweep_{fmt}_c{Cg}", S, dens, times[cfg], t_cudnn, config=cfg_name(cfg),
                            group_size=Cg, note="kernel only (K pre-quantised)"))
        best[fmt] = min(times, key=times.get)
        log(f"sweep C={Cg} {fmt}: " + ", ".join(f"{c}: {t:.2f} ms" for c, t in sorted(times.items(), key=lambda x: x[1])))
    return rows, best


# --ab candidates per C, in the order they are timed (the most informative first; see
# docs/design/sparse-launch-config.md): (name, launch config). s3 and s4 compile to the same two-buffer loop
# (tests/codegen_sparse.py), so only the shipped one of the two is timed. "base" = kv_off off (the kernel
# before the A/B); the shipped default is kv_off for C >= 128. (The lazy-rescale variant, rescale_tau, is
# gone: docs/design/sparse-launch-config.md.)
AB_KV_OFF = [("base", False), ("kvoff", True)]
AB_EXTRA_CONFIGS = {64: [SparseAttnConfig(32, 4, 4)], 128: [SparseAttnConfig(32, 4, 3)]}
AB_TOL = 1e-2  # bf16 P in PV: the kernel's own error vs fp32 is ~2e-3 (rel_l2 column of sparse_* rows)


def ab_candidates(Cg):
    import dataclasses

    cfgs = [CF.sparse_default("bf16", D, Cg)] + AB_EXTRA_CONFIGS[Cg]
    return [(name, dataclasses.replace(cfg, kv_off=kv)) for cfg in cfgs for name, kv in AB_KV_OFF]


def bench_ab(S, log, budget_s, dev="cuda", dense_backend="cudnn", group_sizes=(64, 128), t_cudnn=None, only=()):
    """``--ab``: every switch set x config candidate, kernel alone and as a reuse step (+ residual)."""
    import time
    t_start = time.monotonic()
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    sm = D ** -0.5
    wu, rp = (10, 40) if S > 40000 else (25, 100)
    rows, skipped = [], []
    if t_cudnn is None:
        t_cudnn = bench_ms(sdpa_fn(q, k, v, dense_backend), warmup=wu, rep=rp)
        rows.append(row("sdpa_cudnn", S, 1.0, t_cudnn, t_cudnn, note="ab"))
    log(f"S={S}: cudnn {t_cudnn:.2f} ms")
    res = (0.01 * torch.randn(B, H, S, D, device=dev)).bfloat16()
    keep = n_keep(S, 0.15)
    dens = keep / S
    for Cg in group_sizes:
        G = (S + Cg - 1) // Cg
        sigma = tpddp.pddp_perm(q, Cg)
        idx = random_idx(S, keep, G, dev)
        base = {}
        for name, cfg in ab_candidates(Cg):
            if only and name not in only:
                continue
            for residual, kind in ((None, ""), (res, "_reuse")):
                variant = f"ab_{name}{kind}_c{Cg}"
                spent = time.monotonic() - t_start
                if spent > budget_s:
                    skipped.append(f"{variant} {cfg_name(cfg)}")
                    continue

                def run():
                    return tsa.sparse_attention(q, k, v, sigma, idx, sm_scale=sm, group_size=Cg,
                                                residual=residual, launch=cfg)
                try:
                    o = run()
                    t = bench_ms(run, warmup=wu, rep=rp)
                except Exception as e:  # a candidate that does not compile (registers / shared memory)
                    log(f"{variant} {cfg_name(cfg)}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                if kind not in base:  # the first candidate is the default kernel: the yardstick
                    base[kind] = (o.float(), t)
                err = metrics(o.float(), base[kind][0])["rel_l2"]
                flag = " WRONG" if not err < AB_TOL else ""
                rows.append(row(variant, S, dens, t, t_cudnn, rel_l2=err, config=cfg_name(cfg), group_size=Cg,
                                note=("reuse step: gather + bf16 residual" if kind else "kernel only")
                                + f"; rel_l2 vs default kernel; {t / base[kind][1]:.3f}x its time" + flag))
                log(f"{variant} {cfg_name(cfg)}: {t:.3f} ms = x{t_cudnn / t:.2f} vs cudnn, "
                    f"{t / base[kind][1]:.3f}x default, rel_l2 {err:.1e}{flag}")
        del idx
    if skipped:
        log(f"S={S}: budget {budget_s:.0f} s spent, skipped {len(skipped)}: " + ", ".join(skipped))
    return rows


def pddp_profile(q, Cg, log):
    ev = []
    tpddp.pddp_perm(q, Cg, marks=ev)
    torch.cuda.synchronize()
    parts = [f"{name} {ev[i - 1][1].elapsed_time(e):.3f}" for i, (name, e) in enumerate(ev) if i]
    log(f"pddp C={Cg} stages (ms): " + "; ".join(parts))


def bench_size(S, do_sweep, log, dev="cuda", dense_backend="cudnn", group_sizes=(64, 128)):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    sm = D ** -0.5
    rows = []
    big = S > 40000
    wu, rp = (10, 40) if big else (25, 100)

    t_cudnn = bench_ms(sdpa_fn(q, k, v, dense_backend), warmup=wu, rep=rp)
    rows.append(row("sdpa_cudnn", S, 1.0, t_cudnn, t_cudnn))
    t_flash = bench_ms(sdpa_fn(q, k, v, "flash" if dev == "cuda" else "math"), warmup=wu, rep=rp)
    rows.append(row("sdpa_flash", S, 1.0, t_flash, t_cudnn))
    log(f"S={S}: cudnn {t_cudnn:.2f} ms, flash {t_flash:.2f} ms")
    fa4 = fa4_fn(q, k, v) if dev == "cuda" else None  # FlashAttention-4 bf16: the headline baseline
    if fa4 is not None:
        t_fa4 = bench_ms(fa4, warmup=wu, rep=rp)
        rows.append(row("fa4-bf16", S, 1.0, t_fa4, t_cudnn))
        log(f"S={S}: fa4-bf16 {t_fa4:.2f} ms")
    elif dev == "cuda":
        log(f"S={S}: {fa4_status()[1]}")
    del fa4
    def fp8_row(name, fn, note):
        t_fp8 = bench_ms(fn, warmup=wu, rep=rp)
        mt = head_metrics(fn(), lambda: dense_attention_lse(q[:, :2], k[:, :2], v[:, :2], sm_scale=sm)[0])
        rows.append(row(name, S, 1.0, t_fp8, t_cudnn, note=note, **mt))
        log(f"S={S}: {name} {t_fp8:.2f} ms")
    run_fp8_baselines(q, k, v, fp8_row, log, prefix=f"S={S}: ")

    # grouping: Fast PDDP vs flash-kmeans on the same queries
    sigmas, t_pddp = {}, {}
    for Cg in group_sizes:
        G = (S + Cg - 1) // Cg
        t_pddp[Cg] = bench_ms(lambda: tpddp.pddp_perm(q, Cg), warmup=wu, rep=rp)
        rows.append(row("pddp", S, 1.0, t_pddp[Cg], t_cudnn, group_size=Cg, note=f"G={G} groups of {Cg}"))
        sigmas[Cg] = tpddp.pddp_perm(q, Cg)
        if dev == "cuda":
            pddp_profile(q, Cg, log)
        try:
            from flash_kmeans import batch_kmeans_Euclid
            x16 = q.view(B * H, S, D).half()
            for it in (3, 10):
                t_km = bench_ms(lambda: batch_kmeans_Euclid(x16, G, max_iters=it, tol=0.0), warmup=wu, rep=rp)
                rows.append(row(f"flash_kmeans_it{it}", S, 1.0, t_km, t_cudnn, group_size=Cg,
                                note=f"K={G}, {it} Lloyd iterations; pddp/kmeans time = {t_pddp[Cg] / t_km:.2f}"))
                log(f"flash-kmeans K={G} it={it}: {t_km:.2f} ms vs pddp {t_pddp[Cg]:.2f} ms")
        except Exception as e:  # not installed, or no GPU
            log(f"flash_kmeans unavailable: {type(e).__name__}: {e}")

    res = (0.01 * torch.randn(B, H, S, D, device=dev)).bfloat16()
    for Cg in group_sizes:
        G = (S + Cg - 1) // Cg
        sigma = sigmas[Cg]
        sfx = "" if Cg == 64 else f"_c{Cg}"
        best = {"bf16": CF.sparse_default("bf16", D, Cg), "fp8": CF.sparse_default("fp8", D, Cg)}
        if do_sweep and Cg == 128:
            idx15 = random_idx(S, n_keep(S, 0.15), G, dev)
            srows, best = sweep(q, k, v, sigma, idx15, sm, t_cudnn, S, n_keep(S, 0.15) / S, Cg,
                                SWEEP_C128, log)
            rows += srows
            del idx15
        dense_idx = torch.arange(S, device=dev, dtype=torch.int32).expand(B, H, G, S)
        for fmt in ("bf16", "fp8"):
            cfg = best[fmt]
            ref_fn16 = ref_sparse if fmt == "bf16" else sparse_attention_q8
            kq = " incl. K quant" if fmt == "fp8" else ""

            def run(idx, residual=None):
                return tsa.sparse_attention(q, k, v, sigma, idx, sm_scale=sm, group_size=Cg,
                                            qk_format=fmt, launch=cfg, residual=residual)
            t_dense = bench_ms(lambda: run(dense_idx), warmup=wu, rep=rp)
            o = run(dense_idx)
            mt = head_metrics(o, lambda: dense_attention_lse(q[:, :2], k[:, :2], v[:, :2], sm_scale=sm)[0])
            rows.append(row(f"dense_ours_{fmt}{sfx}", S, 1.0, t_dense, t_cudnn, efficiency=1.0,
                            config=cfg_name(cfg), group_size=Cg, note="gather kernel at density 1.0" + kq, **mt))
            log(f"C={Cg} {fmt} dense-ours {t_dense:.2f} ms")
            for s in DENSITIES:
                keep = n_keep(S, s)
                idx = random_idx(S, keep, G, dev)
                t = bench_ms(lambda: run(idx), warmup=wu, rep=rp)
                o = run(idx)
                mt = head_metrics(o, lambda: ref_fn16(q[:, :2], k[:, :2], v[:, :2], sigma[:, :2], idx[:, :2],
                                                       sm_scale=sm, group_size=Cg, out_dtype=torch.float32))
                dens = keep / S
                eff = t_dense / t * dens
                rows.append(row(f"sparse_{fmt}{sfx}", S, dens, t, t_cudnn, efficiency=eff, config=cfg_name(cfg),
                                group_size=Cg, note=kq.strip(), **mt))
                log(f"C={Cg} {fmt} s={dens:.4f}: {t:.2f} ms, eff {eff:.3f}, x{t_cudnn / t:.2f} vs cudnn")
                if s == 0.15:
                    t_r = bench_ms(lambda: run(idx, res), warmup=wu, rep=rp)
                    rows.append(row(f"reuse_{fmt}{sfx}", S, dens, t_r, t_cudnn, config=cfg_name(cfg), group_size=Cg,
                                    note="gather + bf16 residual epilogue" + kq))
                    log(f"C={Cg} reuse {fmt}: {t_r:.2f} ms = x{t_cudnn / t_r:.2f} vs cudnn")
                del idx

    # anchor step at s = 0.15 (bf16, C = 64)
    Cg = group_sizes[0]
    sigma = sigmas[Cg]
    G = (S + Cg - 1) // Cg
    keep = n_keep(S, 0.15)
    dens = keep / S
    t_p1 = bench_ms(lambda: tsel.dense_with_lse(q, k, v, sm), warmup=wu, rep=rp)
    o_dense, lse2 = tsel.dense_with_lse(q, k, v, sm)
    hc = max(1, min(H, (4 << 30) // (G * S * 4)))
    t_mass = bench_ms(lambda: tsel.group_key_mass(q[:, :hc], k[:, :hc], sigma[:, :hc], lse2[:, :hc],
                                                  sm_scale=sm, group_size=Cg), warmup=wu, rep=rp) * H / hc
    T = dispatch.Impl.TRITON
    t_sel = bench_ms(lambda: M.select(T, q, k, sigma, lse2, sm_scale=sm, group_size=Cg, keep=keep),
                     warmup=2, rep=10)
    idx = M.select(T, q, k, sigma, lse2, sm_scale=sm, group_size=Cg, keep=keep)

    def sparse_res():
        return o_dense - tsa.sparse_attention(q, k, v, sigma, idx, sm_scale=sm, group_size=Cg,
                                              launch=CF.sparse_default("bf16", D, Cg))
    t_sr = bench_ms(sparse_res, warmup=wu, rep=rp)
    total = t_pddp[Cg] + t_p1 + t_sel + t_sr
    for name, t, note in [("anchor_pddp", t_pddp[Cg], "grouping"), ("anchor_pass1", t_p1, "cuDNN + LSE"),
                          ("anchor_pass2_mass", t_mass, f"mass kernel only, {hc} heads per chunk"),
                          ("anchor_pass2_topk", t_sel, "mass + torch.topk + sort (mcsparse.select)"),
                          ("anchor_sparse_residual", t_sr, "sparse + R = O_dense - O_sparse"),
                          ("anchor_total", total, "pddp + pass1 + pass2/topk + sparse/residual")]:
        rows.append(row(name, S, dens, t, t_cudnn, group_size=Cg, note=note))
    log(f"anchor: pddp {t_pddp[Cg]:.2f} pass1 {t_p1:.2f} mass {t_mass:.2f} select {t_sel:.2f} sparse+R {t_sr:.2f}"
        f" total {total:.2f} ms = {total / t_cudnn:.2f}x a dense cuDNN step")
    return rows


def bench_focus(S, log, first, dev="cuda", dense_backend="cudnn"):
    """``--focus``: only PDDP and the bf16 gather kernel (C = 64 and 128): what changed after the second
    H200 run (bf16 hi/lo PDDP moments, FMA-folded softmax scale), within a one-minute device budget."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    sm = D ** -0.5
    wu, rp = (10, 40) if S > 40000 else (25, 100)
    rows = []
    t_cudnn = bench_ms(sdpa_fn(q, k, v, dense_backend), warmup=wu, rep=rp)
    rows.append(row("sdpa_cudnn", S, 1.0, t_cudnn, t_cudnn))
    log(f"S={S}: cudnn {t_cudnn:.2f} ms")
    res = (0.01 * torch.randn(B, H, S, D, device=dev)).bfloat16()
    for Cg in (64, 128):
        G = (S + Cg - 1) // Cg
        sigma = tpddp.pddp_perm(q, Cg)
        ok = torch.equal(sigma.sort(-1).values, torch.arange(S, device=dev).expand(B, H, S))
        t_p = bench_ms(lambda: tpddp.pddp_perm(q, Cg), warmup=wu, rep=rp)
        rows.append(row("pddp", S, 1.0, t_p, t_cudnn, group_size=Cg,
                        note=f"G={G} groups of {Cg}; bf16 hi/lo moments; valid permutation: {ok}"))
        log(f"pddp C={Cg}: {t_p:.2f} ms, valid {ok}")
        if dev == "cuda":
            pddp_profile(q, Cg, log)
        sfx = "" if Cg == 64 else f"_c{Cg}"
        cfg = CF.sparse_default("bf16", D, Cg)

        def run(idx, residual=None):
            return tsa.sparse_attention(q, k, v, sigma, idx, sm_scale=sm, group_size=Cg, launch=cfg,
                                        residual=residual)
        dense_idx = torch.arange(S, device=dev, dtype=torch.int32).expand(B, H, G, S)
        t_dense = bench_ms(lambda: run(dense_idx), warmup=wu, rep=rp)
        rows.append(row(f"dense_ours_bf16{sfx}", S, 1.0, t_dense, t_cudnn, efficiency=1.0, config=cfg_name(cfg),
                        group_size=Cg, note="gather kernel at density 1.0; FMA-folded scale"))
        log(f"C={Cg} bf16 dense-ours {t_dense:.2f} ms")
        for s in DENSITIES:
            keep = n_keep(S, s)
            idx = random_idx(S, keep, G, dev)
            t = bench_ms(lambda: run(idx), warmup=wu, rep=rp)
            mt = {}
            if first and s == 0.15:
                mt = head_metrics(run(idx), lambda: ref_sparse(q[:, :2], k[:, :2], v[:, :2], sigma[:, :2], idx[:, :2],
                                                                sm_scale=sm, group_size=Cg, out_dtype=torch.float32))
            dens = keep / S
            rows.append(row(f"sparse_bf16{sfx}", S, dens, t, t_cudnn, efficiency=t_dense / t * dens,
                            config=cfg_name(cfg), group_size=Cg, note="FMA-folded scale", **mt))
            log(f"C={Cg} bf16 s={dens:.4f}: {t:.2f} ms, eff {t_dense / t * dens:.3f}, x{t_cudnn / t:.2f} vs cudnn")
            if s == 0.15:
                t_r = bench_ms(lambda: run(idx, res), warmup=wu, rep=rp)
                rows.append(row(f"reuse_bf16{sfx}", S, dens, t_r, t_cudnn, config=cfg_name(cfg), group_size=Cg,
                                note="gather + bf16 residual epilogue; FMA-folded scale"))
                log(f"C={Cg} reuse bf16: {t_r:.2f} ms = x{t_cudnn / t_r:.2f} vs cudnn")
            del idx
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="S = 32760 only")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    ap.add_argument("--sizes", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: S = 200, H = 2, nothing saved")
    ap.add_argument("--focus", action="store_true", help="only PDDP and the bf16 gather kernel")
    ap.add_argument("--ab", action="store_true", help="A/B of the gather kernel's kv_off x configs")
    ap.add_argument("--budget", type=float, default=200.0, help="--ab: seconds for all sizes together")
    ap.add_argument("--group-sizes", default="64,128", help="--ab: comma-separated C values")
    ap.add_argument("--ab-switches", default="", help="--ab: only these candidates (base, kvoff)")
    args = ap.parse_args()
    log = lambda m: print(m, flush=True)  # noqa: E731
    if args.smoke:
        global H
        H = 2
        if args.ab:
            rows = bench_ab(200, log, args.budget, dev="cpu", dense_backend="math",
                            group_sizes=tuple(int(c) for c in args.group_sizes.split(",")),
                            only=tuple(n for n in args.ab_switches.split(",") if n))
            print_table(rows, ["variant", "S", "density", "ms", "rel_l2", "config", "note"])
            return
        if args.focus:
            rows = bench_focus(200, log, True, dev="cpu", dense_backend="math")
        else:
            rows = bench_size(200, do_sweep=True, log=log, dev="cpu", dense_backend="math", group_sizes=(64, 128))
        print_table(rows, ["variant", "S", "density", "ms", "efficiency", "rel_l2", "cos_sim", "config", "note"])
        return
    if not torch.cuda.is_available():
        sys.exit("bench_sparse_attn: needs a CUDA GPU (H200)")
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else ([32760] if args.quick or args.ab
                                                                           else [32760, 75600])
    rows = []
    import time
    t0 = time.monotonic()
    for i, S in enumerate(sizes):
        if args.ab:  # the budget left is shared by the sizes in order
            new = bench_ab(S, log, max(0.0, args.budget - (time.monotonic() - t0)),
                           group_sizes=tuple(int(c) for c in args.group_sizes.split(",")),
                           only=tuple(n for n in args.ab_switches.split(",") if n))
        elif args.focus:
            new = bench_focus(S, log, first=(i == 0))
        else:
            new = bench_size(S, do_sweep=(i == 0 and not args.no_sweep), log=log)
        add_speedup(new, "fa4-bf16", "speedup_vs_fa4")
        add_speedup(new, "torchao-fp8", "speedup_vs_torchao")
        for r in new:
            for c in EXTRAS:
                r.setdefault(c, "")
        path = append_rows("bench_sparse_attn", new, extras=EXTRAS)  # per size: a timeout later keeps these rows
        if args.csv:
            with open(path) as f_in, open(args.csv, "w", newline="") as f_out:
                f_out.write(f_in.read())
        rows += new
        torch.cuda.empty_cache()
    print_table(rows, ["variant", "S", "density", "ms", "tflops", "speedup_vs_cudnn", "speedup_vs_fa4",
                       "speedup_vs_torchao", "efficiency", "rel_l2", "cos_sim", "config", "group_size"])
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
