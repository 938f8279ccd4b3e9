"""Prologue fusion on the H200: the Q/K preprocessing chain with and without the model's RoPE
folded into our kernel, against a device-to-device copy of the same bytes.

    python3 -m benchmarks.bench_preprocess [--csv PATH] [--smoke] [--no-results] [--shapes S,S] [--no-op] [--no-ab]

Per S in {32760, 75600}, B = 1, H = 40, D = 128, bf16; q and k are the projection outputs [B, S, H, D]
(not rotated), cos/sin Wan's pair tables [1, S, 1, D/2] fp32 (``freqs[..., 0::2]``, interleaved form):
* ``rope_inductor``   Wan's RoPE (setitem form) + permute of q and k, compiled by Inductor (alone);
* ``pre_qk``          our Q/K preprocessing on already rotated q, k (alone);
* ``unfused``         the two above in sequence: what a compiled model runs without the fusion;
* ``fused``           our preprocessing with the RoPE prologue, on the un-rotated q, k;
* ``fused_unpacked``  A/B (``--no-ab`` skips): the same with ``ROPE_PACKED = False`` (pairs split in registers
                      from an [R, D] tile: all loads vectorised, but layout conversions on sm_90);
* ``fused_rowmajor``  A/B: packed, with ``ROPE_HEAD_FAST = False`` (the no-RoPE grid: a head's token blocks
                      back to back, table rows re-read from L2 across heads at a distance);
* ``fused_perm``      A/B: the default with a random key permutation (V-Smooth's cluster order: K' rows, and
                      so their table rows, gathered per head); same byte count;
* ``copy``            ``dst.copy_(src)`` of a buffer sized so that read + write = the fused chain's bytes.
Bytes (``gb`` column, read + written by our kernels, as they run): unfused = RoPE (read q, k; write q, k)
+ preprocessing (read q once, k once plus the token sample of K's mean -- a separate pass over every
st-th 64-token block, reference.preprocess.k_mean_mask: 14% of K at S = 32760, 5.5% at 75600 -- write the
int8 codes); fused = read q once, k once plus its sample, the tables once (every head re-reads them: the kernel runs the heads of a
token block back to back so those are L2 hits), write the codes and the per-token Q scales (fp32);
K scales (one per 64 tokens) are left out.
``gbs`` = gb / time; ``pct_copy`` = gbs / copy's GB/s (target: fused >= 80%).
* ``op_unfused`` / ``op_fused`` at S = 75600 (``--shapes`` picks): the whole V-Smooth op on a non-grouping
  (reuse) step -- cached k-means order, preprocessing of Q, K, V, 8-bit attention -- with the Inductor
  RoPE in front vs the RoPE in the prologue (target: fused >= 5% faster). ``speedup`` = unfused / fused.
  Expectation, stated before measuring: the RoPE pass the fusion removes moves 4 x S*H*D*2 bytes
  (3.1 GB at S = 75600, ~0.8 ms at ~4 TB/s) while the 8-bit attention is O(S^2) (~120 ms at ~800
  TFLOP/s), so the whole-op gain should be ~1%, not 5%; the row says what it is.
Correctness in the same run: ``mismatch`` = share of Q/K codes that differ between fused and unfused
(the RoPE rounds once to bf16 in both; FMA contraction may move a code by one step), ``rel_l2`` of the op
outputs fused vs unfused.

Robust by construction (it runs once on the GPU): every measurement is guarded; a failure becomes a row
with ``error`` set and the script goes on; rows are written to ``--csv`` (fresh file) after every shape
and appended to benchmarks/results/bench_preprocess.csv at the end (unless ``--no-results``). A time
budget (``--budget``, default 130 s) skips what would not fit, saying so in a row.
``--smoke``: tiny shapes on any device (CPU: TRITON_INTERPRET=1), to exercise the script itself.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

if __name__ == "__main__" and "--smoke" in sys.argv and not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.common import COLUMNS, _fmt, append_rows, bench_ms, env_info, print_table  # noqa: E402

BENCH = "bench_preprocess"
EXTRA = ["gb", "gbs", "pct_copy", "speedup", "mismatch", "error"]
SHOW = ["variant", "S", "ms", "gb", "gbs", "pct_copy", "speedup", "mismatch", "rel_l2", "error"]


def log(*a):
    print(*a, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", default=None, help="also write this run's rows to this CSV file (fresh)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: under TRITON_INTERPRET=1)")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/results/")
    p.add_argument("--shapes", default=None, help="comma-separated S values (default 32760,75600)")
    p.add_argument("--op-shapes", default=None, help="S values for the whole-op rows (default 75600)")
    p.add_argument("--no-op", action="store_true", help="skip the whole-op rows")
    p.add_argument("--no-ab", action="store_true", help="skip the fused_unpacked / fused_rowmajor A/B rows")
    p.add_argument("--budget", type=float, default=130.0, help="seconds; later measurements are skipped")
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    if a.smoke:
        a.H, a.D = 2, 64
        a.shapes = ints(a.shapes or "200,300")
        a.op_shapes = ints(a.op_shapes or "300")
    else:
        a.H, a.D = 40, 128
        a.shapes = ints(a.shapes or "32760,75600")
        a.op_shapes = ints(a.op_shapes or "75600")
    if a.no_op:
        a.op_shapes = []
    return a


def timer(smoke: bool):
    """(fn, rep) -> median ms: ``common.bench_ms`` (CUDA: triton do_bench, L2 flushed between reps;
    CPU: median of 3 wall-clock runs)."""
    return lambda fn, rep=300: bench_ms(fn, warmup=25, rep=rep)


def wan_rope(x, cos, sin):
    """diffusers 0.42 transformer_wan.apply_rotary_emb with the pair tables already sliced."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def rope_permute(q, k, cos, sin):
    return wan_rope(q, cos, sin).permute(0, 2, 1, 3), wan_rope(k, cos, sin).permute(0, 2, 1, 3)


def make_inputs(S, H, D, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    q = (1.5 * r(1, S, H, D)).bfloat16()
    k = (r(1, S, H, D) + 3.0 * r(1, 1, H, D)).bfloat16()
    centers = 2.0 * r(H, 64, D)
    lab = torch.randint(0, 64, (1, S, H), device=dev, generator=g)
    v = (centers[torch.arange(H, device=dev).view(1, 1, H), lab] + 0.4 * r(1, S, H, D)).bfloat16()
    # Wan's 3-axis tables, one angle per pair: positions times inverse frequencies
    pos = torch.arange(S, device=dev, dtype=torch.float64)[:, None]
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float64) / D))
    ang = (pos * inv[None]).float()
    cos, sin = ang.cos().view(1, S, 1, D // 2), ang.sin().view(1, S, 1, D // 2)
    return q, k, v, cos, sin


class Run:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.t0 = time.time()
        self.time = timer(args.smoke)

    def left(self) -> float:
        return self.args.budget - (time.time() - self.t0)

    def add(self, **r):
        row = {"B": 1, "H": self.args.H, "D": self.args.D, **r}
        self.rows.append(row)
        log("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in r.items()))
        return row

    def guarded(self, variant, S, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one failure must not lose the other rows
            self.add(variant=variant, S=S, error=f"{type(e).__name__}: {str(e)[:160]}")
            return None

    def write(self):
        if self.args.csv:
            d = os.path.dirname(os.path.abspath(self.args.csv))
            os.makedirs(d, exist_ok=True)
            info = env_info()
            with open(self.args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=COLUMNS + EXTRA, extrasaction="ignore")
                w.writeheader()
                for r in self.rows:
                    full = {**info, "bench": BENCH, **r}
                    w.writerow({c: _fmt(full.get(c, "")) for c in COLUMNS + EXTRA})


def chain_inputs(S: int, H: int, D: int):
    """Model-layout q, k, v, Wan's RoPE tables, their [B, H, S, D] views, the fused path's RopeArgs, the
    Inductor-compiled RoPE + permute of the unfused path, and the softmax scale."""
    from vc_compile import formats

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, cos, sin = make_inputs(S, H, D, dev)
    spec = formats.RopeSpec("interleaved", "BSHD", H, None, None)
    qb, kb = formats.to_bhsd(q, spec), formats.to_bhsd(k, spec)
    ra = formats.rope_args(cos, sin, spec, tuple(qb.shape))
    return dev, q, k, v, cos, sin, qb, kb, ra, torch.compile(rope_permute, dynamic=False), D ** -0.5


def bench_chain(run: Run, S: int):
    from vc_compile.reference.preprocess import k_mean_mask
    from vc_compile.kernels import preprocess as tpre
    from vc_compile.kernels.configs import PREPROCESS_DEFAULT, PreprocessConfig

    a, H, D = run.args, run.args.H, run.args.D
    dev, q, k, v, cos, sin, qb, kb, ra, rope_c, sm = chain_inputs(S, H, D)
    del v

    def unfused():
        qr, kr = rope_c(q, k, cos, sin)
        return tpre.preprocess_qk(qr, kr, None, sm_scale=sm)

    def fused(launch=PREPROCESS_DEFAULT):
        return tpre.preprocess_qk(qb, kb, None, sm_scale=sm, rope=ra, launch=launch)

    qr, kr = rope_c(q, k, cos, sin)  # compile (and warm) outside the timings
    n = q.numel()
    tab = 2 * cos.numel() * 4  # both tables, fp32
    gb_rope = (2 * n * 2 + 2 * n * 2) / 1e9                     # read q, k; write q, k (bf16)
    frac = float(k_mean_mask(S).float().mean())                 # K rows read by the mean pass
    gb_pre = (n * 2 + (1 + frac) * n * 2 + 2 * n + n // D * 4) / 1e9  # read q, k (+ sample); write codes, q scales
    gb_fused = gb_pre + tab / 1e9                               # + the tables once (re-reads: L2 hits)
    res = {}

    def t(name, fn, gb):
        ms = run.time(fn)
        res[name] = ms
        return run.add(variant=name, S=S, ms=ms, gb=gb, gbs=gb / (ms / 1e3))

    run.guarded("rope_inductor", S, lambda: t("rope_inductor", lambda: rope_c(q, k, cos, sin), gb_rope))
    run.guarded("pre_qk", S, lambda: t("pre_qk", lambda: tpre.preprocess_qk(qr, kr, None, sm_scale=sm), gb_pre))
    ru = run.guarded("unfused", S, lambda: t("unfused", unfused, gb_rope + gb_pre))
    rf = run.guarded("fused", S, lambda: t("fused", fused, gb_fused))
    ab = []
    if not a.no_ab:  # design A/B in the same run (launch configs of kernels/preprocess.py)
        for name, cfg in (("fused_unpacked", PreprocessConfig(rope_packed=False)),
                          ("fused_rowmajor", PreprocessConfig(rope_head_fast=False))):
            def one(name=name, cfg=cfg):
                fused(cfg)  # compile outside the timing
                row = t(name, lambda: fused(cfg), gb_fused)
                a_, b_ = unfused(), fused(cfg)
                row["mismatch"] = ((a_.q8 != b_.q8).float().mean().item()
                                   + (a_.k8 != b_.k8).float().mean().item()) / 2
                return row
            ab.append(run.guarded(name, S, one))
    if not a.no_ab:  # V-Smooth's case: K' rows gathered through a key permutation (their table rows too)
        perm = torch.stack([torch.randperm(S, device=dev) for _ in range(H)]).view(1, H, S)
        ab.append(run.guarded("fused_perm", S, lambda: (tpre.preprocess_qk(qb, kb, perm, sm_scale=sm, rope=ra),
                                                        t("fused_perm", lambda: tpre.preprocess_qk(
                                                            qb, kb, perm, sm_scale=sm, rope=ra), gb_fused))[1]))
    # copy of the fused chain's bytes: read N + write N = gb_fused
    nbytes = int(gb_fused * 1e9 / 2)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    rc = run.guarded("copy", S, lambda: t("copy", lambda: dst.copy_(src), gb_fused))
    del src, dst
    if rc is not None:
        for r in (ru, rf, *ab):
            if r is not None:
                r["pct_copy"] = 100.0 * r["gbs"] / rc["gbs"]
    for r in (rf, *ab):
        if ru is not None and r is not None:
            r["speedup"] = ru["ms"] / r["ms"]

    def check():
        a_, b_ = unfused(), fused()
        mis = ((a_.q8 != b_.q8).float().mean().item() + (a_.k8 != b_.k8).float().mean().item()) / 2
        if rf is not None:
            rf["mismatch"] = mis
        log(f"  codes differing fused vs unfused: {mis:.2e}")
    run.guarded("check", S, check)


def bench_op(run: Run, S: int):
    """The whole V-Smooth op on a reuse step (cached k-means order), RoPE via Inductor vs prologue."""
    from vc_compile.config import VCConfig
    from vc_compile.methods import Phase
    from vc_compile.methods import vsmooth as mv
    from vc_compile.kernels import dispatch
    from vc_compile.kernels import kmeans as tkm

    H, D = run.args.H, run.args.D
    dev, q, k, v, cos, sin, qb, kb, ra, rope_c, sm = chain_inputs(S, H, D)
    vb = v.permute(0, 2, 1, 3)
    impl = dispatch.Impl.TRITON
    cfg = VCConfig.from_options({"method": "vsmooth"})
    km = tkm.kmeans_perm(vb, min(256, max(1, S // 128)), 3)
    meta = mv.VSmoothMeta(perm=km.perm, centroids=km.centroids)

    def unfused():
        qr, kr = rope_c(q, k, cos, sin)
        return mv.run(qr, kr, vb, phase=Phase.REUSE, meta=meta, cfg=cfg, sm_scale=sm, impl=impl)[0]

    def fused():
        return mv.run(qb, kb, vb, phase=Phase.REUSE, meta=meta, cfg=cfg, sm_scale=sm, impl=impl, rope=ra)[0]

    o_u = unfused()  # compile/warm both
    o_f = fused()
    rel = ((o_f.float() - o_u.float()).norm() / o_u.float().norm()).item()
    del o_u, o_f
    ru = run.guarded("op_unfused", S, lambda: run.add(variant="op_unfused", S=S, ms=run.time(unfused, 1500)))
    rf = run.guarded("op_fused", S, lambda: run.add(variant="op_fused", S=S, ms=run.time(fused, 1500),
                                                      rel_l2=rel))
    if ru is not None and rf is not None:
        rf["speedup"] = ru["ms"] / rf["ms"]


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)
    info = env_info()
    log(f"{BENCH}: {info['gpu']}, torch {info['torch']}, triton {info['triton']}, commit {info['commit']}; "
        f"H={args.H} D={args.D} S={args.shapes} op S={args.op_shapes} budget {args.budget:.0f}s")
    plan = [("chain", S) for S in args.shapes] + [("op", S) for S in args.op_shapes]
    # the whole-op row is the one the second target needs: run it right after the first chain
    if len(plan) > 2 and plan[-1][0] == "op":
        plan.insert(1, plan.pop())
    for kind, S in plan:
        if run.left() < (5 if args.smoke else 25):
            run.add(variant=f"{kind}_skipped", S=S, error=f"time budget ({args.budget:.0f}s) spent")
            continue
        log(f"[{kind} S={S}] {time.time() - run.t0:.0f}s elapsed")
        run.guarded(kind, S, lambda: (bench_chain if kind == "chain" else bench_op)(run, S))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        run.write()
    print_table(run.rows, SHOW)
    if not args.no_results and run.rows:
        log(f"appended to {append_rows(BENCH, run.rows)}")
    run.write()
    return run.rows


if __name__ == "__main__":
    main()
