"""MC-Sparse anchor step, old vs new, per kernel (issue 20 "cheap anchors"), side by side with cuDNN dense.

    python3 benchmarks/bench_anchor_mass.py                    # S = 32760 and 75600, H = 40, D = 128, C = 128
    python3 benchmarks/bench_anchor_mass.py --sizes 32760      # one size
    python3 benchmarks/bench_anchor_mass.py --csv $OUT/bench_anchor_mass.csv
    python3 benchmarks/bench_anchor_mass.py --smoke            # CPU dry run (interpreter), S = 300, H = 2

Rows (``variant``; B = 1, H = 40, D = 128, C = 128, s = 0.15, bf16 inputs with a channel bias on K and V
outlier tokens; ``speedup_vs_cudnn`` < 1 = the part's cost relative to one dense cuDNN step):
* ``sdpa_cudnn``: the dense baseline, same process.
* ``old_*``: today's anchor (methods/mcsparse.py): ``old_pddp``, ``old_pass1`` (cuDNN + LSE), ``old_pass2_mass``
  (templates/select.group_key_mass, bf16 MMA, fp32 masses), ``old_topk`` (torch.topk + sort), ``old_sparse_res``
  (gather kernel fp32 + R), ``old_total``.
* ``new_*``: the cheap anchor (methods/anchor.py; default dense_out='bf16'): ``new_preprocess`` (INT8 Q/K +
  FP8 V-Smooth V, key order pi),
  ``new_pass1_q8`` (the 8-bit V-Smooth kernel with RETURN_LSE), ``new_prep_q`` (Q8 / coefficients gathered
  through sigma), ``new_mass_<exp>_ng<NG>`` (pass 2 on the INT8 codes, bf16 masses), ``new_topk_d<digit>``
  (radix select), ``new_sparse_res``, ``new_total_q8`` (= pddp + preprocess + pass1 + prep + mass + top-K +
  sparse/R, dense_out='q8') and ``new_total_bf16`` (dense_out='bf16', the default: cuDNN pass 1 instead of the
  8-bit one, + Q/K preprocessing); ``new_anchor_step_{q8,bf16}``: the whole ``anchor_step`` call (sigma given).
* ``check_*`` (heads 0-1, exact fp32 truth on the GPU): ``overlap`` = |selected ∩ exact| / K for the new
  default selection (rel_l2 column: 1 - captured exact mass ratio), the top-K kernel against the reference
  top-K on the same masses (must be identical: rel_l2 = number of differing rows), and ``residual`` = rel. L2
  of R = O_dense - O_sparse against the exact R (fp32 dense, exact selection), for dense_out q8 and bf16.
Timing: ``triton.testing.do_bench`` medians (fewer repetitions for the slow old parts at 75600).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import append_rows, bench_ms, print_table, sdpa_fn  # noqa: E402
from vc_compile.methods.anchor import AnchorConfig, anchor_step, modules  # noqa: E402
from vc_compile.reference import kmeans as RK  # noqa: E402
from vc_compile.reference import select as RS  # noqa: E402
from vc_compile.reference.dense import dense_attention_lse  # noqa: E402
from vc_compile.reference.topk import select_topk as ref_topk  # noqa: E402
from vc_compile.templates import anchor_mass as TA  # noqa: E402
from vc_compile.templates import pddp as tpddp  # noqa: E402
from vc_compile.templates import preprocess as tpre  # noqa: E402
from vc_compile.templates import select as tsel  # noqa: E402
from vc_compile.templates import sparse_attn as tsa  # noqa: E402
from vc_compile.templates import topk as TK  # noqa: E402
from vc_compile.templates import vsmooth_attn as tvs  # noqa: E402

B, H, D, C, DENSITY = 1, 40, 128, 128, 0.15
EXTRAS = ["part", "group_size", "note"]


def row(variant, S, ms, t_cudnn, density=DENSITY, **kw):
    r = {"variant": variant, "B": B, "H": H, "S": S, "D": D, "density": density, "ms": ms,
         "speedup_vs_cudnn": t_cudnn / ms if ms else "", "group_size": C}
    r.update(kw)
    return r


def inputs(S, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, S, D, device=dev, generator=g)
    k = torch.randn(B, H, S, D, device=dev, generator=g) + 2.0 * torch.randn(1, H, 1, D, device=dev, generator=g)
    v = torch.randn(B, H, S, D, device=dev, generator=g)
    v[:, :, ::97] *= 10.0  # outlier tokens
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def bench_size(S, log, dev="cuda", smoke=False):
    torch.manual_seed(0)
    q, k, v = inputs(S, dev)
    sm = D ** -0.5
    G = -(-S // C)
    keep = tsel.n_keep(S, DENSITY)
    dens = keep / S
    big = S > 40000
    wu, rp = (5, 25) if big else (25, 100)
    slow = dict(warmup=1, rep=3) if big else dict(warmup=3, rep=15)
    rows = []
    t_cudnn = bench_ms(sdpa_fn(q, k, v, "cudnn" if dev == "cuda" else "math"), warmup=wu, rep=rp)
    rows.append(row("sdpa_cudnn", S, t_cudnn, t_cudnn, density=1.0))
    log(f"S={S}: cuDNN {t_cudnn:.2f} ms")

    # ---------------- old anchor (today's methods/mcsparse.py path) ----------------
    t_pddp = bench_ms(lambda: tpddp.pddp_perm(q, C), warmup=wu, rep=rp)
    sigma = tpddp.pddp_perm(q, C)
    t_p1 = bench_ms(lambda: tsel.dense_with_lse(q, k, v, sm), warmup=wu, rep=rp)
    o_dense, lse2 = tsel.dense_with_lse(q, k, v, sm)
    hc = max(1, min(H, (4 << 30) // (G * S * 4)))

    def old_mass():
        for h0 in range(0, H, hc):
            m = tsel.group_key_mass(q[:, h0:h0 + hc], k[:, h0:h0 + hc], sigma[:, h0:h0 + hc], lse2[:, h0:h0 + hc],
                                    sm_scale=sm, group_size=C)
            del m
    t_mass_old = bench_ms(old_mass, **slow)
    t_sel_old = bench_ms(lambda: tsel.anchor_select(q, k, sigma, lse2, sm_scale=sm, group_size=C, keep=keep), **slow)
    idx_old = tsel.anchor_select(q, k, sigma, lse2, sm_scale=sm, group_size=C, keep=keep)
    t_sr_old = bench_ms(lambda: o_dense.float() - tsa.sparse_attention(q, k, v, sigma, idx_old, sm_scale=sm,
                                                                       group_size=C, out_dtype=torch.float32),
                        warmup=wu, rep=rp)
    old_total = t_pddp + t_p1 + t_sel_old + t_sr_old
    for name, t, note in [("old_pddp", t_pddp, "templates/pddp.py (shared by old and new)"),
                          ("old_pass1", t_p1, "cuDNN + LSE"),
                          ("old_pass2_mass", t_mass_old,
                           f"select.group_key_mass, bf16 MMA, fp32 masses, {hc} heads/chunk"),
                          ("old_topk", t_sel_old - t_mass_old, "torch.topk + sort (anchor_select - mass)"),
                          ("old_sparse_res", t_sr_old, "gather kernel fp32 + R"),
                          ("old_total", old_total, "pddp + pass1 + mass/top-K + sparse/R")]:
        rows.append(row(name, S, t, t_cudnn, density=dens, part="old", note=note))
    log(f"old: pddp {t_pddp:.2f} pass1 {t_p1:.2f} mass {t_mass_old:.2f} topk {t_sel_old - t_mass_old:.2f} "
        f"sparse+R {t_sr_old:.2f} total {old_total:.2f} ms = {old_total / t_cudnn:.2f}x cuDNN")
    del idx_old

    # ---------------- new anchor ----------------
    pi = RK.kmeans_perm(v[:, :, ::1].float(), RK.default_clusters(S), 2).perm if smoke else \
        torch.argsort(v.float().sum(-1), dim=-1, stable=True)  # a V-Smooth-like key order (its cost is not anchor's)
    t_pre = bench_ms(lambda: (tpre.preprocess_qk(q, k, pi, sm_scale=sm), tpre.preprocess_v(v, pi)), warmup=wu, rep=rp)
    qk = tpre.preprocess_qk(q, k, pi, sm_scale=sm)
    vq = tpre.preprocess_v(v, pi)
    t_p1q = bench_ms(lambda: tvs.vsmooth_attention(qk, vq, return_lse=True), warmup=wu, rep=rp)
    o8, lse_s = tvs.vsmooth_attention(qk, vq, return_lse=True)
    del vq
    mass_rows, t_mass, masses = [], {}, {}
    variants = [("shift", 2), ("exact", 2), ("shift", 1)] if not big else [("shift", 2), ("exact", 2)]
    for exp, ng in variants:
        cfg = TA.AnchorMassConfig(groups_per_program=ng, exp=exp)
        prep = TA.prepare_queries(qk, lse_s, sigma, group_size=C, config=cfg)
        hcn = max(1, min(H, (1 << 30) // (G * (-(-S // 64) * 64) * 2)))

        def new_mass():
            for h0 in range(0, H, hcn):
                m = TA.mass_heads(prep, qk, h0, min(H, h0 + hcn), key_perm=pi, config=cfg, mass_dtype=torch.bfloat16)
                del m
        t = bench_ms(new_mass, warmup=wu, rep=rp)
        t_mass[(exp, ng)] = t
        rows.append(row(f"new_mass_{exp}_ng{ng}", S, t, t_cudnn, density=dens, part="new",
                        note=f"pass 2 on INT8 codes, bf16 masses, {hcn} heads/chunk, NG={ng}"))
        log(f"new mass {exp} NG={ng}: {t:.2f} ms")
    dflt = TA.default_config(C)
    t_prep = bench_ms(lambda: TA.prepare_queries(qk, lse_s, sigma, group_size=C, config=dflt), warmup=wu, rep=rp)
    prep = TA.prepare_queries(qk, lse_s, sigma, group_size=C, config=dflt)
    m16 = TA.mass_heads(prep, qk, 0, min(H, 8), key_perm=pi, config=dflt, mass_dtype=torch.bfloat16)
    t_topk = {}
    for digit in (8, 4):
        t_topk[digit] = bench_ms(lambda: TK.select_topk(m16, keep, config=TK.TopKConfig(digit=digit)),
                                 warmup=wu, rep=rp) * H / m16.shape[0]
        rows.append(row(f"new_topk_d{digit}", S, t_topk[digit], t_cudnn, density=dens, part="new",
                        note=f"radix select, bf16 masses, digit {digit} (timed on {m16.shape[0]} heads, x H)"))
    m32 = m16.float()
    t32 = bench_ms(lambda: TK.select_topk(m32, keep), warmup=wu, rep=rp) * H / m16.shape[0]
    rows.append(row("new_topk_fp32_masses", S, t32, t_cudnn, density=dens, part="new", note="fp32 masses, digit 8"))
    ok_rows = int((TK.select_topk(m16[:2], keep) != ref_topk(m16[:2], keep)).any(-1).sum())
    log(f"top-K: d8 {t_topk[8]:.2f} d4 {t_topk[4]:.2f} fp32 {t32:.2f} ms; "
        f"kernel vs reference rows differing: {ok_rows}")
    del m16, m32
    idx = TA.anchor_select_q8(qk, lse_s, sigma, group_size=C, keep=keep, key_perm=pi)
    t_sr = bench_ms(lambda: tsa.sparse_attention(q, k, v, sigma, idx, sm_scale=sm, group_size=C,
                                                 out_dtype=torch.float32).neg_().add_(o8), warmup=wu, rep=rp)
    t_preqk = bench_ms(lambda: tpre.preprocess_qk(q, k, None, sm_scale=sm), warmup=wu, rep=rp)
    sel = t_prep + t_mass[("shift", 2)] + t_topk[8]
    new_q8 = t_pddp + t_pre + t_p1q + sel + t_sr
    new_bf16 = t_pddp + t_preqk + t_p1 + sel + t_sr
    t_e2e = {m: bench_ms(lambda: anchor_step(q, k, v, sm_scale=sm, group_size=C, keep=keep, mods=modules("templates"),
                                             key_perm=pi, sigma=sigma, cfg=AnchorConfig(dense_out=m)), **slow)
             for m in ("q8", "bf16")}
    for name, t, note in [("new_preprocess", t_pre, "INT8 Q/K + FP8 V (V-Smooth), key order pi"),
                          ("new_pass1_q8", t_p1q, "8-bit V-Smooth attention + LSE"),
                          ("new_prep_q", t_prep, "Q8, a, b gathered through sigma"),
                          ("new_sparse_res", t_sr, "gather kernel fp32 + R (in place)"),
                          ("new_total_q8", new_q8, "pddp + preprocess + pass1 q8 + prep + mass + top-K + sparse/R"),
                          ("new_total_bf16", new_bf16,
                           "pddp + Q/K preprocess + cuDNN pass1 + prep + mass + top-K + sparse/R"),
                          ("new_anchor_step_q8", t_e2e["q8"], "anchor_step(dense_out='q8'), sigma given (no pddp)"),
                          ("new_anchor_step_bf16", t_e2e["bf16"], "anchor_step(dense_out='bf16', the default), "
                                                                   "sigma given (no pddp)")]:
        rows.append(row(name, S, t, t_cudnn, density=dens, part="new", note=note))
    log(f"new: pddp {t_pddp:.2f} preprocess {t_pre:.2f} pass1 {t_p1q:.2f} prep {t_prep:.2f} "
        f"mass {t_mass[('shift', 2)]:.2f} topk {t_topk[8]:.2f} sparse+R {t_sr:.2f} total q8 {new_q8:.2f} ms "
        f"= {new_q8 / t_cudnn:.2f}x cuDNN (bf16 pass 1: {new_bf16:.2f} = {new_bf16 / t_cudnn:.2f}x); "
        f"anchor_step() without pddp: q8 {t_e2e['q8']:.2f}, bf16 {t_e2e['bf16']:.2f}")

    # ---------------- correctness on heads 0-1 ----------------
    hs = slice(0, 2)
    o_ref, lse_ref = dense_attention_lse(q[:, hs], k[:, hs], v[:, hs], sm_scale=sm)
    mass_ref = RS.group_key_mass(q[:, hs], k[:, hs], sigma[:, hs], lse_ref, sm_scale=sm, group_size=C)
    idx_ref = ref_topk(mass_ref, keep)
    got = idx[:, hs]
    inter = (torch.zeros_like(mass_ref).scatter_(3, got.long(), 1.0)
             * torch.zeros_like(mass_ref).scatter_(3, idx_ref.long(), 1.0)).sum().item() / idx_ref.numel()
    cap = (torch.gather(mass_ref, -1, got.long()).sum() / torch.gather(mass_ref, -1, idx_ref.long()).sum()).item()
    rows.append(row("check_overlap", S, 0.0, t_cudnn, density=dens, part="check", rel_l2=1 - cap,
                    note=f"selection overlap {inter:.5f} with exact fp32 selection; captured mass ratio {cap:.6f}"))
    rows.append(row("check_topk_exact", S, 0.0, t_cudnn, density=dens, part="check", rel_l2=ok_rows,
                    note="rows where the top-K kernel differs from reference top-K (must be 0)"))
    def sparse32(ix):
        return tsa.sparse_attention(q[:, hs], k[:, hs], v[:, hs], sigma[:, hs], ix, sm_scale=sm, group_size=C,
                                    out_dtype=torch.float32)
    sp_new = sparse32(got)
    r_exact = o_ref - sp_new  # the exact residual of the new selection (fp32 dense)
    e_sel = ((r_exact - (o_ref - sparse32(idx_ref))).norm() / (o_ref - sparse32(idx_ref)).norm()).item()
    rows.append(row("check_residual_selection", S, 0.0, t_cudnn, density=dens, part="check", rel_l2=e_sel,
                    note="exact R of the new selection vs exact R of the exact selection (near-tie swaps)"))
    for mode, od in (("q8", o8[:, hs]), ("bf16", o_dense[:, hs])):
        r = od.float() - sp_new
        e = ((r - r_exact).norm() / r_exact.norm()).item()
        eo = ((od.float() - o_ref).norm() / o_ref.norm()).item()
        rows.append(row(f"check_residual_{mode}", S, 0.0, t_cudnn, density=dens, part="check", rel_l2=e,
                        note=f"R (O_dense {mode}) vs exact R, same selection; O_dense rel L2 {eo:.2e}"))
        log(f"check dense_out={mode}: residual rel L2 {e:.4f} (O_dense {eo:.2e}); selection effect on R {e_sel:.4f}")
    log(f"check: overlap {inter:.5f}, captured mass ratio {cap:.6f}, top-K rows differing {ok_rows}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="32760,75600")
    ap.add_argument("--csv", default=None, help="also copy the results file here")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: interpreter, S = 300, H = 2, nothing saved")
    a = ap.parse_args()
    log = lambda m: print(m, flush=True)  # noqa: E731
    cols = ["variant", "S", "ms", "speedup_vs_cudnn", "rel_l2", "note"]
    if a.smoke:
        global H
        H = 2
        rows = bench_size(300, log, dev="cpu", smoke=True)
        print_table(rows, cols)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_anchor_mass: needs a CUDA GPU (H200)")
    t0 = time.monotonic()
    rows, path = [], None
    for S in (int(s) for s in a.sizes.split(",")):
        new = bench_size(S, log)
        for r in new:
            for c in EXTRAS:
                r.setdefault(c, "")
        path = append_rows("bench_anchor_mass", new)  # per size: a time-out later keeps these rows
        if a.csv:
            with open(path) as f_in, open(a.csv, "w", newline="") as f_out:
                f_out.write(f_in.read())
        rows += new
        torch.cuda.empty_cache()
        log(f"[{time.monotonic() - t0:.0f} s]")
    print_table(rows, cols)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
