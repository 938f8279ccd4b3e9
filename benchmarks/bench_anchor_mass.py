"""MC-Sparse anchor step, old vs new, per kernel (the cheap anchor), side by side with cuDNN dense.

    python -m benchmarks.bench_anchor_mass                   # S = 32760 and 75600, B1 H40 D128 bf16, C = 128
    python -m benchmarks.bench_anchor_mass --sizes 32760 --heads 12          # Wan 1.3B's head count
    python -m benchmarks.bench_anchor_mass --csv $OUT/bench_anchor_mass.csv  # also copy the results file
    python -m benchmarks.bench_anchor_mass --smoke           # CPU dry run (interpreter), S = 300, H = 2, no CSV
    python -m benchmarks.bench_anchor_mass --sizes 32760 --mass-configs 1/shift/3,1/exact/3,2/exact/3
                                                             # + pass 2's launch A/B (rows pass2_mass:...)
    python -m benchmarks.bench_anchor_mass --sizes 32760 --topk-configs 8192/8/8,4096/4/8
                                                             # + the top-K's launch A/B (rows topk:...)

Three anchor steps on the same inputs (bf16, a channel bias on K, outlier V tokens; density 0.15, C = 128):
* ``old``: ``methods/mcsparse.run(..., cheap_anchor=False)``: PDDP, cuDNN + LSE, bf16-MMA pass 2 (fp32 masses,
  kernels/select.py), torch.topk + sort, gather kernel + R, caching R (finiteness check, bf16).
* ``new_bf16``: the default (``cheap_anchor=None``, anchor_dense='bf16'): PDDP, INT8 Q/K codes, cuDNN + LSE
  (shifted by the K mean), pass 2 on the INT8 codes (kernels/anchor_mass.py, bf16 masses), radix top-K
  (kernels/topk.py), gather kernel forming the bf16 R in its epilogue, caching.
* ``new_q8``: option anchor_dense='q8': the 8-bit V-Smooth pass gives O_dense and the LSE instead of cuDNN.
Rows (``variant`` = ``<path>_<part>``; ``speedup_vs_cudnn`` = cuDNN ms / ms: 0.5 = twice a dense step, 4 = a
quarter of one): one per kernel part (timed alone, medians of
``triton.testing.do_bench``), ``<path>_sum_of_parts`` and ``<path>_step`` (the whole ``mcsparse.run`` anchor
call, which is what the issue's 1.3x target is about); ``sdpa_cudnn`` the dense baseline from the same run.
``check_*`` (heads 0-1 against an fp32 truth on the device): ``check_<path>_selection``: rel_l2 = 1 - the exact
masses captured by the path's selection / those of the exact top-K, note = overlap |sel ∩ exact| / K;
``check_<path>_residual``: rel. L2 of the path's R against the exact R of its own selection.
The profiler's per-kernel GPU times of one whole step of each path are printed too (not saved).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--smoke" in sys.argv:  # the CPU dry run runs the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.common import append_rows, bench_ms, print_table, sdpa_fn  # noqa: E402
from vc_compile import formats, torch_ops  # noqa: E402
from vc_compile.config import VCConfig  # noqa: E402
from vc_compile.methods import mcsparse as M  # noqa: E402
from vc_compile.methods.phase import Phase  # noqa: E402
from vc_compile.reference import select as RS  # noqa: E402
from vc_compile.reference.dense import dense_attention_lse  # noqa: E402
from vc_compile.kernels import anchor_mass as TA  # noqa: E402
from vc_compile.kernels import configs as KC  # noqa: E402
from vc_compile.kernels import dispatch  # noqa: E402
from vc_compile.torch_ops import lse_correction  # noqa: E402

B, D, C, DENSITY = 1, 128, 128, 0.15
PATHS = ("old", "new_bf16", "new_q8")
PARTS = ("pddp", "preprocess", "pass1", "lse_shift", "prep_q", "pass2_mass", "topk", "sparse_res", "cache")
EXTRAS = ["part", "group_size", "note"]


def inputs(H, S, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, S, D, device=dev, generator=g)
    k = torch.randn(B, H, S, D, device=dev, generator=g) + 2.0 * torch.randn(1, H, 1, D, device=dev, generator=g)
    v = torch.randn(B, H, S, D, device=dev, generator=g)
    v[:, :, ::97] *= 10.0  # outlier tokens
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def timed(fn, **kw):
    """Median ms on CUDA (``bench_ms``); on the CPU dry run one wall-clock call (the interpreter is slow)."""
    if torch.cuda.is_available():
        return bench_ms(fn, **kw)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def kernel_ms(fn):
    """GPU time (ms) by kernel name of one call of ``fn`` under torch.profiler (summed per kernel name)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    if not out:  # torch versions that attach the kernels to the CPU ops instead
        for e in prof.events():
            for kk in getattr(e, "kernels", None) or []:
                out[kk.name] = out.get(kk.name, 0.0) + kk.duration / 1e3
    return out


def _parse_specs(text: str, option: str, form: str, make):
    """Comma-separated ``a/b/c`` launch specs of ``option`` -> [make(a, b, c)]; a malformed or invalid spec
    stops the benchmark naming the option and the expected ``form``."""
    out = []
    for spec in (t for t in text.split(",") if t):
        try:
            out.append(make(*spec.split("/")))
        except (TypeError, ValueError) as e:
            raise SystemExit(f"{option} {spec!r}: expected {form} ({e})")
    return out


def parse_mass_configs(text: str):
    """``--mass-configs``: comma-separated ``NG/exp/stages`` (e.g. ``1/exact/3``) -> AnchorMassConfig list."""
    return _parse_specs(text, "--mass-configs", "NG/exp/stages, e.g. 1/exact/3", lambda ng, ex, st: KC.AnchorMassConfig(
        groups_per_program=int(ng), exp=ex, num_stages=int(st)))


def parse_topk_configs(text: str):
    """``--topk-configs``: comma-separated ``block/digit/warps`` (e.g. ``8192/8/8``) -> TopKConfig list."""
    return _parse_specs(text, "--topk-configs", "block/digit/warps, e.g. 8192/8/8", lambda blk, dg, nw: KC.TopKConfig(
        block=int(blk), digit=int(dg), num_warps=int(nw)))


def bench_size(S, H, log, dev="cuda", mass_configs=(), topk_configs=()):
    torch.manual_seed(0)
    q, k, v = inputs(H, S, dev)
    sm = D ** -0.5
    cuda = dev == "cuda"
    big = S > 40000
    fast = dict(warmup=5, rep=25) if big else dict(warmup=25, rep=100)  # do_bench: milliseconds
    slow = dict(warmup=1, rep=3) if big else dict(warmup=3, rep=15)
    opts = {"method": "mcsparse", "density": DENSITY, "group_size": C, "experimental": {"kernels": "triton"}}
    cfg = VCConfig.from_options(opts)
    cfg_q8 = VCConfig.from_options({**opts, "anchor_dense": "q8"})
    impl, path = dispatch.choose("mcsparse", cfg.experimental.kernels, M.needs_fp8(cfg), q.device)
    assert path == "triton", path
    keep = formats.n_keep(S, DENSITY)
    dens = keep / S
    t_cudnn = timed(sdpa_fn(q, k, v, "cudnn" if cuda else "math"), **fast)
    log(f"S={S} H={H}: cuDNN {t_cudnn:.2f} ms")
    T = {p: {} for p in PATHS}

    def put(paths, part, t):
        for p in paths:
            T[p][part] = t

    # ---- parts shared by several paths
    put(PATHS, "pddp", timed(lambda: dispatch.pddp_perm(impl, q, C), **fast))
    sigma = dispatch.pddp_perm(impl, q, C)
    put(("old", "new_bf16"), "pass1", timed(lambda: dispatch.dense_with_lse(impl, q, k, v, sm), **fast))
    o_dense, lse2 = dispatch.dense_with_lse(impl, q, k, v, sm)

    def sparse(q, k, v, sigma, idx, **kw):
        return dispatch.sparse_attention(impl, q, k, v, sigma, idx, qk_format=cfg.sparse_qk.value, **kw)

    # ---- old: bf16-MMA pass 2 + torch top-K (mcsparse.select), R out of place
    G = -(-S // C)
    hc = max(1, min(H, M._MASS_BYTES // max(1, B * G * S * 4)))

    def old_mass():
        for h0 in range(0, H, hc):
            m = dispatch.group_key_mass(impl, q[:, h0:h0 + hc], k[:, h0:h0 + hc], sigma[:, h0:h0 + hc],
                                        lse2[:, h0:h0 + hc], sm_scale=sm, group_size=C)
            del m
    T["old"]["pass2_mass"] = timed(old_mass, **slow)
    m32 = dispatch.group_key_mass(impl, q[:, :hc], k[:, :hc], sigma[:, :hc], lse2[:, :hc], sm_scale=sm,
                                  group_size=C)
    T["old"]["topk"] = timed(lambda: dispatch.select_topk(m32, keep), **slow) * H / m32.shape[1]
    del m32
    idx_old = M.select(impl, q, k, sigma, lse2, sm_scale=sm, group_size=C, keep=keep)
    T["old"]["sparse_res"] = timed(lambda: o_dense.float() - sparse(q, k, v, sigma, idx_old, sm_scale=sm,
                                                                       group_size=C, out_dtype=torch.float32), **fast)
    resid = o_dense.float() - sparse(q, k, v, sigma, idx_old, sm_scale=sm, group_size=C, out_dtype=torch.float32)

    def cache():  # what mcsparse.run does with R after forming it: finiteness check (a sync), memory check, bf16
        bool(torch.isfinite(resid).all())
        M._check_memory(resid, cfg)
        return M._compact(resid, cfg.residual.value)
    T["old"]["cache"] = timed(cache, **fast)
    del resid
    log("old parts: " + ", ".join(f"{p} {t:.2f}" for p, t in T["old"].items()))

    # ---- new (anchor_step): INT8 Q/K codes, pass 2 on them, radix top-K, bf16 R from the gather kernel
    T["new_bf16"]["preprocess"] = timed(lambda: dispatch.preprocess_qk(impl, q, k, None, sm_scale=sm), **fast)
    qk = dispatch.preprocess_qk(impl, q, k, None, sm_scale=sm)
    T["new_bf16"]["lse_shift"] = timed(lambda: lse2 - lse_correction(q, qk.k_mean, sm), **fast)
    lse_s = lse2 - lse_correction(q, qk.k_mean, sm)
    mcfg = KC.anchor_mass_default(C)
    put(("new_bf16", "new_q8"), "prep_q",
        timed(lambda: TA.prepare_queries(qk, lse_s, sigma, group_size=C, launch=mcfg), **fast))
    prep = TA.prepare_queries(qk, lse_s, sigma, group_size=C, launch=mcfg)
    hcn = max(1, min(H, (1 << 30) // (G * (-(-S // 64) * 64) * 2)))  # as anchor_select_q8: 1 GiB of bf16 masses

    def new_mass():
        for h0 in range(0, H, hcn):
            m = TA.mass_heads(prep, qk, h0, min(H, h0 + hcn), key_perm=None, launch=mcfg, mass_dtype=torch.bfloat16)
            del m
    put(("new_bf16", "new_q8"), "pass2_mass", timed(new_mass, **fast))
    m16 = TA.mass_heads(prep, qk, 0, hcn, key_perm=None, launch=mcfg, mass_dtype=torch.bfloat16)
    ab_rows = []
    for mc in mass_configs:  # pass 2's launch A/B: the same masses (exp mode aside), other program shapes
        pmc = TA.prepare_queries(qk, lse_s, sigma, group_size=C, launch=mc)

        def mass_mc(pmc=pmc, mc=mc):
            for h0 in range(0, H, hcn):
                m = TA.mass_heads(pmc, qk, h0, min(H, h0 + hcn), key_perm=None, launch=mc, mass_dtype=torch.bfloat16)
                del m
        t = timed(mass_mc, **fast)
        mm = TA.mass_heads(pmc, qk, 0, hcn, key_perm=None, launch=mc, mass_dtype=torch.bfloat16).float()
        err = ((mm - m16.float()).norm() / m16.float().norm()).item()
        name = f"pass2_mass:NG={mc.groups_per_program},exp={mc.exp.value},stages={mc.num_stages}"
        ab_rows.append(dict(variant=name, S=S, H=H, ms=t, density=dens, part="pass2_mass_ab", rel_l2=err,
                            note=f"masses vs the default launch's (heads 0-{hcn - 1}); default {T['new_bf16']['pass2_mass']:.3f} ms"))
        log(f"  {name}: {t:.3f} ms (default {T['new_bf16']['pass2_mass']:.3f}), masses vs default rel. L2 {err:.2e}")
        del pmc, mm
    put(("new_bf16", "new_q8"), "topk", timed(lambda: dispatch.topk(impl, m16, keep), **fast) * H / m16.shape[0])
    if topk_configs:
        idx16 = dispatch.topk(impl, m16, keep)
    for tc in topk_configs:  # the top-K's launch A/B: the same indices (an exact select), other launches
        t = timed(lambda tc=tc: dispatch.topk(impl, m16, keep, launch=tc), **fast) * H / m16.shape[0]
        same = bool(torch.equal(dispatch.topk(impl, m16, keep, launch=tc), idx16))
        name = f"topk:block={tc.block},digit={tc.digit},warps={tc.num_warps}"
        ab_rows.append(dict(variant=name, S=S, H=H, ms=t, density=dens, part="topk_ab",
                            note=f"indices equal to the default launch's: {same}; "
                                 f"default {T['new_bf16']['topk']:.3f} ms"))
        log(f"  {name}: {t:.3f} ms (default {T['new_bf16']['topk']:.3f}), same indices {same}")
    if topk_configs:
        del idx16
    del m16, prep
    idx_new = dispatch.anchor_select_q8(impl, qk, lse_s, sigma, group_size=C, keep=keep)
    # R as anchor_step forms the cached bf16 residual: the gather kernel's epilogue adds -O_dense, one rounding
    def sparse_res():
        return sparse(q, k, v, sigma, idx_new, sm_scale=sm, group_size=C, residual=o_dense.neg(),
                      out_dtype=torch.bfloat16).neg_()
    put(("new_bf16", "new_q8"), "sparse_res", timed(sparse_res, **fast))
    resid16 = sparse_res()

    def cache16():  # the bf16 R: finiteness check (a sync), memory check, no conversion left
        bool(torch.isfinite(resid16).all())
        M._check_memory(resid16, cfg)
        return M._compact(resid16, cfg.residual.value)
    put(("new_bf16", "new_q8"), "cache", timed(cache16, **fast))
    del resid16
    # q8: Q/K and V preprocessing + the 8-bit V-Smooth pass with its LSE instead of cuDNN
    T["new_q8"]["preprocess"] = timed(lambda: (dispatch.preprocess_qk(impl, q, k, None, sm_scale=sm),
                                               dispatch.preprocess_v(impl, v, None, smooth=True)), **fast)
    vq = dispatch.preprocess_v(impl, v, None, smooth=True)
    # the kernel dispatch picks for V-Smooth (Gluon on sm_90), with its LSE, as anchor_step runs it
    T["new_q8"]["pass1"] = timed(lambda: dispatch.vsmooth_attention(impl, qk, vq, out_dtype=q.dtype,
                                                                    return_lse=True), **fast)
    o8, lse_s8 = dispatch.vsmooth_attention(impl, qk, vq, out_dtype=q.dtype, return_lse=True)
    del vq
    idx_q8 = dispatch.anchor_select_q8(impl, qk, lse_s8, sigma, group_size=C, keep=keep)
    del qk

    # ---- whole anchor steps (what the 1.3x target is about)
    steps = {"old": lambda: M.run(q, k, v, phase=Phase.ANCHOR, meta=None, cfg=cfg, sm_scale=sm, impl=impl,
                                  cheap_anchor=False),
             "new_bf16": lambda: M.run(q, k, v, phase=Phase.ANCHOR, meta=None, cfg=cfg, sm_scale=sm, impl=impl),
             "new_q8": lambda: M.run(q, k, v, phase=Phase.ANCHOR, meta=None, cfg=cfg_q8, sm_scale=sm, impl=impl)}
    t_step = {p: timed(f, **slow) for p, f in steps.items()}
    log("steps: " + ", ".join(f"{p} {t:.2f} ms ({t / t_cudnn:.2f}x)" for p, t in t_step.items()))
    if cuda:
        for p, f in steps.items():
            km = sorted(kernel_ms(f).items(), key=lambda kv: -kv[1])
            tot = sum(t for _, t in km)
            log(f"  profiler, {p} step: {tot:.2f} ms of kernels; " + "; ".join(
                f"{n[:48]} {t:.2f}" for n, t in km[:8]))

    rows = [dict(variant="sdpa_cudnn", S=S, H=H, ms=t_cudnn, speedup_vs_cudnn=1.0, density=1.0, part="dense")]
    for r in ab_rows:
        r["speedup_vs_cudnn"] = t_cudnn / r["ms"]
    rows += ab_rows
    for p in PATHS:
        for part in PARTS:
            if part in T[p]:
                rows.append(dict(variant=f"{p}_{part}", S=S, H=H, ms=T[p][part], density=dens, part=part,
                                 speedup_vs_cudnn=t_cudnn / T[p][part] if T[p][part] > 0 else ""))
        tot = sum(T[p].values())
        rows.append(dict(variant=f"{p}_sum_of_parts", S=S, H=H, ms=tot, density=dens, part="sum",
                         speedup_vs_cudnn=t_cudnn / tot, note=f"{tot / t_cudnn:.3f}x a cuDNN step"))
        rows.append(dict(variant=f"{p}_step", S=S, H=H, ms=t_step[p], density=dens, part="step",
                         speedup_vs_cudnn=t_cudnn / t_step[p],
                         note=f"mcsparse.run anchor step = {t_step[p] / t_cudnn:.3f}x a cuDNN step"))
    # side-by-side table of this size
    w = 12
    print(f"\nS = {S}, H = {H}: ms per part (cuDNN dense step {t_cudnn:.2f} ms)")
    print("part".ljust(w) + "".join(p.rjust(w) for p in PATHS))
    for part in PARTS:
        print(part.ljust(w) + "".join((f"{T[p][part]:.2f}" if part in T[p] else "-").rjust(w) for p in PATHS))
    print("sum".ljust(w) + "".join(f"{sum(T[p].values()):.2f}".rjust(w) for p in PATHS))
    print("step".ljust(w) + "".join(f"{t_step[p]:.2f}".rjust(w) for p in PATHS))
    print("step/cuDNN".ljust(w) + "".join(f"{t_step[p] / t_cudnn:.3f}x".rjust(w) for p in PATHS))

    # ---- accuracy on heads 0-1 against an fp32 truth
    hs = slice(0, 2)
    o_ref, lse_ref = dense_attention_lse(q[:, hs], k[:, hs], v[:, hs], sm_scale=sm)
    mass_ref = RS.group_key_mass(q[:, hs], k[:, hs], sigma[:, hs], lse_ref, sm_scale=sm, group_size=C)
    idx_ref = torch_ops.select_topk(mass_ref, keep)
    best = torch.gather(mass_ref, -1, idx_ref.long()).sum().item()
    for p, ix, od in (("old", idx_old, o_dense), ("new_bf16", idx_new, o_dense), ("new_q8", idx_q8, o8)):
        got = ix[:, hs].long()
        inter = (torch.zeros_like(mass_ref).scatter_(3, got, 1.0)
                 * torch.zeros_like(mass_ref).scatter_(3, idx_ref.long(), 1.0)).sum().item() / idx_ref.numel()
        cap = torch.gather(mass_ref, -1, got).sum().item() / best
        o_sp = sparse(q[:, hs], k[:, hs], v[:, hs], sigma[:, hs], ix[:, hs], sm_scale=sm, group_size=C,
                      out_dtype=torch.float32)
        r_exact = o_ref - o_sp
        e = ((od[:, hs].float() - o_sp - r_exact).norm() / r_exact.norm()).item()
        rows.append(dict(variant=f"check_{p}_selection", S=S, H=H, ms="", density=dens, part="check",
                         rel_l2=1 - cap, note=f"overlap with the exact selection {inter:.5f}; mass captured {cap:.6f}"))
        rows.append(dict(variant=f"check_{p}_residual", S=S, H=H, ms="", density=dens, part="check", rel_l2=e,
                         note="R vs the exact R of the same selection (O_dense's error)"))
        log(f"check {p}: overlap {inter:.5f}, exact mass captured {cap:.6f}, residual rel L2 {e:.2e}")
    for r in rows:
        r.update(B=B, D=D, group_size=C)
        for c in EXTRAS + ["rel_l2"]:
            r.setdefault(c, "")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="32760,75600")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--csv", default=None, help="also copy the results file here")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: interpreter, S = 300, H = 2, nothing saved")
    ap.add_argument("--mass-configs", default="",
                    help="pass 2's launches to time beside the default, NG/exp/stages comma-separated "
                         "(e.g. 1/shift/3,1/exact/3,2/exact/3); rows pass2_mass:...")
    ap.add_argument("--topk-configs", default="",
                    help="the top-K's launches to time beside the default, block/digit/warps comma-separated "
                         "(e.g. 8192/8/8,4096/4/8); rows topk:...")
    a = ap.parse_args()
    mass_configs = parse_mass_configs(a.mass_configs)
    topk_configs = parse_topk_configs(a.topk_configs)
    log = lambda m: print(m, flush=True)  # noqa: E731
    cols = ["variant", "S", "ms", "speedup_vs_cudnn", "rel_l2", "note"]
    if a.smoke:
        print_table(bench_size(300, 2, log, dev="cpu", mass_configs=mass_configs, topk_configs=topk_configs), cols)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_anchor_mass: needs a CUDA GPU (H200); --smoke runs on the CPU")
    t0 = time.monotonic()
    rows, path = [], None
    for S in (int(s) for s in a.sizes.split(",")):
        new = bench_size(S, a.heads, log, mass_configs=mass_configs, topk_configs=topk_configs)
        path = append_rows("bench_anchor_mass", new, extras=EXTRAS)  # per size: a time-out later keeps these rows
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
