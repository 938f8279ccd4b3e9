"""Ulysses context parallelism on 2 x H200: vcattn V-Smooth and MC-Sparse vs SDPA cuDNN.

    torchrun --nproc-per-node 2 -m benchmarks.bench_context_parallel                 # S=75600, H=40, D=128
    torchrun --nproc-per-node 2 -m benchmarks.bench_context_parallel --density 0.15 --csv $OUT/cp.csv
    torchrun --nproc-per-node 2 -m benchmarks.bench_context_parallel --diffusers     # + a Wan CP check
    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_context_parallel --smoke   # CPU, gloo

Every rank holds S/N tokens of all H heads ([B, S/N, H, D], the diffusers layout). The Ulysses block
(``vc_compile.parallel.ulysses_attention``: all-to-all to [B, H/N, S, D], SDPA, all-to-all back) is
compiled once per variant with ``backend="vcattn"`` (Inductor), so every variant runs the same graph and
the same collectives; only the local attention differs:

* ``ulysses_sdpa_cudnn``: ``method="dense"`` (the op runs stock SDPA; cuDNN is forced around the call),
  the baseline. ``ulysses_sdpa_cudnn_eager``: the same block uncompiled.
* ``ulysses_vsmooth_reuse`` / ``_group``: V-Smooth at a reuse step (cached k-means order) and at a
  grouping step (k-means + attention). ``ulysses_vsmooth_expcast_reuse``: with ExpCast-FP8.
* ``ulysses_mcsparse_reuse`` / ``_anchor``: MC-Sparse at ``--density`` (sparse + residual / the
  two-pass selection step).
* ``local_*``: the same local attention without the all-to-alls ([B, H/N, S, D] per rank), and
  ``a2a_only``: the four all-to-alls alone; ``ulysses_* - local_*`` is the communication + layout cost.

Timing: fixed iteration counts on every rank (``do_bench`` picks its count per process, which would
desynchronise the collectives), CUDA events, barrier before each variant; ``ms`` is the slowest rank's
median. ``tflops`` = dense attention FLOPs per GPU (4 B (H/N) S^2 D) over ``ms`` (effective for sparse);
``speedup_vs_cudnn`` against the ``ulysses``/``local`` cuDNN row of the same scope. Fidelity: 256 sampled
query rows per rank, all heads, against an fp32 reference of the full-sequence attention; worst rank.
Phases are read back from ``vc_compile.report()`` and checked, so a row never times the wrong phase.
Rows are appended (rank 0) to ``benchmarks/results/bench_context_parallel.csv``.

--diffusers: a 2-layer ``WanTransformer3DModel`` (8 heads x 128, 75600 tokens) with diffusers' own
Ulysses hooks (``enable_diffusers_ulysses``): one forward per method, rewrite counters from every rank,
output against the cuDNN run. --smoke: CPU, gloo, S = 512, H = 4, D = 64, nothing written.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import vc_compile
from benchmarks.common import append_rows, attn_flops, metrics, prefer_cudnn, print_table
from vc_compile.parallel import _all_to_all, enable_diffusers_ulysses, ulysses_attention

BENCH = "bench_context_parallel"
EXTRAS = ["world", "scope", "phases", "compiler", "max_rank_spread_ms", "note"]
STEPS = 1000  # one sampling run longer than all calls of a variant (phase_for builds range(STEPS) per call)


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def make_global(B, S, H, D, device, seed=0):
    """[B, S, H, D] q, k, v (identical on every rank): channel-biased K, clustered V + token outliers,
    peaked softmax, like benchmarks/bench_vsmooth_attn.py."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    q = (1.5 * r(B, S, H, D)).bfloat16()
    k = (r(B, S, H, D) + 3.0 * r(1, 1, H, D)).bfloat16()
    centers = 2.0 * r(H, 64, D)
    lab = torch.randint(0, 64, (B, S, H), device=device, generator=g)
    v = centers[torch.arange(H, device=device).view(1, 1, H), lab] + 0.4 * r(B, S, H, D)
    v = v + (torch.rand(B, S, H, 1, device=device, generator=g) < 0.01) * 12.0 * r(B, S, H, D)
    return q, k, v.bfloat16()


def truth(q, k, v, rows):
    """fp32 attention of the query rows ``rows`` (global indices) over the whole sequence: [B, n, H, D]."""
    out = []
    for h in range(q.shape[2]):
        s = q[:, rows, h].float() @ k[:, :, h].float().transpose(-1, -2) * q.shape[-1] ** -0.5
        out.append(torch.softmax(s, -1) @ v[:, :, h].float())
    return torch.stack(out, 2)


class Ulysses(torch.nn.Module):
    def forward(self, q, k, v):
        return ulysses_attention(q, k, v)


class Local(torch.nn.Module):
    def forward(self, q, k, v):  # [B, H/N, S, D]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def time_fixed(fn, warmup, iters, cuda):
    """Median ms over a fixed number of iterations (the same count on every rank)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def across_ranks(x: float, op):
    t = torch.tensor([x], dtype=torch.float64, device=_DEV)
    dist.all_reduce(t, op=op)
    return t.item()


def worst_metrics(out, ref):
    m = metrics(out.float(), ref.float())
    return {"rel_l2": across_ranks(m["rel_l2"], dist.ReduceOp.MAX),
            "cos_sim": across_ranks(m["cos_sim"], dist.ReduceOp.MIN)}


_DEV = "cpu"


def main():
    global _DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=75600)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--csv", default=None, help="also copy the results CSV here (rank 0)")
    ap.add_argument("--methods", default=None,
                    help="comma-separated subset of sdpa_cudnn,vsmooth_reuse,vsmooth_group,"
                         "vsmooth_expcast_reuse,mcsparse_reuse,mcsparse_anchor (sdpa_cudnn is always run)")
    ap.add_argument("--scopes", default="ulysses,local", help="ulysses and/or local")
    ap.add_argument("--diffusers", action="store_true", help="also check diffusers' Wan under Ulysses")
    ap.add_argument("--smoke", action="store_true", help="CPU + gloo dry run: S=512, H=4, D=64, no rows")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    if "RANK" not in os.environ:
        sys.exit("bench_context_parallel: launch with torchrun --nproc-per-node 2 (see the docstring)")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        _DEV = f"cuda:{local}"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=15))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.smoke:
        torch.set_num_threads(1)
        args.seq, args.heads, args.dim, args.density = 512, 4, 64, 0.25
        args.compiler, args.warmup, args.iters = "eager", 1, 2
    elif not cuda:
        sys.exit("bench_context_parallel: needs CUDA GPUs (or --smoke)")
    B, S, H, D = 1, args.seq, args.heads, args.dim
    if S % world or H % world:
        sys.exit(f"S={S} and H={H} must be divisible by the world size {world}")
    S_loc, H_loc = S // world, H // world
    log(f"{BENCH}: world={world}, B={B} S={S} H={H} D={D}, per rank [B, {S_loc}, {H}, {D}] -> "
        f"[B, {H_loc}, {S}, {D}]; density={args.density}; compiler={args.compiler}")

    q, k, v = make_global(B, S, H, D, _DEV)
    sl = slice(rank * S_loc, (rank + 1) * S_loc)
    ql, kl, vl = (t[:, sl].contiguous() for t in (q, k, v))
    gen = torch.Generator(device="cpu").manual_seed(1 + rank)
    rows_loc = torch.randperm(S_loc, generator=gen)[:256].sort().values.to(_DEV)
    ref_rows = truth(q, k, v, rows_loc + rank * S_loc)  # [B, n, H, D]
    # the local-only variants attend over this rank's heads: the same numbers as after the all-to-all
    hs = slice(rank * H_loc, (rank + 1) * H_loc)
    qh, kh, vh = (t[:, :, hs].permute(0, 2, 1, 3).contiguous() for t in (q, k, v))
    ref_local = truth(q[:, :, hs], k[:, :, hs], v[:, :, hs], rows_loc).permute(0, 2, 1, 3)  # [B, Hl, n, D]
    del q, k, v
    if cuda:
        torch.cuda.empty_cache()

    base = {"min_seq_len": 64, "experimental": {"compiler": args.compiler}, "num_steps": STEPS}
    methods = {
        "sdpa_cudnn": ({**base, "method": "dense"}, {"dense"}),
        "vsmooth_reuse": ({**base, "method": "vsmooth", "group_fraction": 0.0}, {"reuse"}),
        "vsmooth_group": ({**base, "method": "vsmooth", "group_fraction": 1.0}, {"group"}),
        "vsmooth_expcast_reuse": ({**base, "method": "vsmooth", "expcast": True, "group_fraction": 0.0},
                                  {"reuse"}),
        "mcsparse_reuse": ({**base, "method": "mcsparse", "density": args.density, "warmup_steps": 0,
                            "anchor_steps": (0,)}, {"reuse"}),
        "mcsparse_anchor": ({**base, "method": "mcsparse", "density": args.density, "warmup_steps": 0,
                             "anchor_interval": 1}, {"anchor"}),
    }
    if args.methods:
        keep = {"sdpa_cudnn", *args.methods.split(",")}
        unknown = keep - set(methods)
        if unknown:
            sys.exit(f"unknown --methods {sorted(unknown)}; known: {sorted(methods)}")
        methods = {k: v for k, v in methods.items() if k in keep}
    flops = attn_flops(B, H_loc, S, S, D)  # per GPU
    rows, base_ms, written = [], {}, [0]

    def flush():
        """Append the rows not written yet (rank 0): a timeout later keeps what was measured."""
        new = rows[written[0]:]
        written[0] = len(rows)
        if rank != 0 or args.smoke or not new:
            return
        for r in new:
            for c in EXTRAS:
                r.setdefault(c, "")
        path = append_rows(BENCH, new)
        if args.csv:
            with open(path) as f_in, open(args.csv, "w", newline="") as f_out:
                f_out.write(f_in.read())

    def record(variant, scope, ms, out=None, ref=None, phases="", density=1.0, note=""):
        ms_max = across_ranks(ms, dist.ReduceOp.MAX)
        ms_min = across_ranks(ms, dist.ReduceOp.MIN)
        r = {"variant": variant, "B": B, "H": H, "S": S, "D": D, "density": density, "ms": ms_max,
             "tflops": flops / (ms_max * 1e-3) / 1e12 if scope != "comm" else "", "world": world,
             "scope": scope, "phases": phases, "compiler": args.compiler,
             "max_rank_spread_ms": ms_max - ms_min, "note": note}
        if scope in base_ms:
            r["speedup_vs_cudnn"] = base_ms[scope] / ms_max
        if out is not None:
            r.update(worst_metrics(out, ref))
        rows.append(r)
        log(f"  {variant:32s} {ms_max:9.2f} ms  {r.get('rel_l2', '')}")

    # communication alone: 3 all-to-alls in, 1 out, the same sizes as the Ulysses block
    x5 = ql.reshape(B, S_loc, world, H_loc, D).permute(2, 1, 0, 3, 4).contiguous()

    def a2a():
        for _ in range(4):
            _all_to_all(x5, dist.group.WORLD)

    dist.barrier()
    record("a2a_only", "comm", time_fixed(a2a, args.warmup, args.iters, cuda))
    flush()

    with prefer_cudnn():
        # eager Ulysses with cuDNN (what diffusers' native backend runs without compile)
        dist.barrier()
        eager = Ulysses()
        with torch.no_grad():
            ms = time_fixed(lambda: eager(ql, kl, vl), args.warmup, args.iters, cuda)
            out = eager(ql, kl, vl)
        record("ulysses_sdpa_cudnn_eager", "ulysses", ms, out[:, rows_loc], ref_rows, "eager")

        scopes = [sc for sc in (("ulysses", Ulysses, (ql, kl, vl), ref_rows),
                                ("local", Local, (qh, kh, vh), ref_local)) if sc[0] in args.scopes.split(",")]
        for scope, mod_cls, inputs, ref in scopes:
            for name, (opts, want) in methods.items():
                torch._dynamo.reset()
                vc_compile.reset(report=True)
                cm = torch.compile(mod_cls(), backend="vcattn", options=opts)
                counter = itertools.count()

                def call():
                    vc_compile.step(next(counter))
                    return cm(*inputs)

                dist.barrier()
                with torch.no_grad(), vc_compile.sampling(num_steps=STEPS):
                    call()  # compile + the first step (grouping / anchor for reuse variants)
                    ms = time_fixed(call, args.warmup, args.iters, cuda)
                    out = call()
                rep = vc_compile.report()
                ph = {}
                for s in rep.rewritten:
                    for p, n in s.phases.items():
                        ph[p] = ph.get(p, 0) + n
                timed = {p for p, n in ph.items() if n > 1}  # the first call may be another phase
                note = "" if timed == want else f"PHASES {sorted(timed)} != {sorted(want)}"
                if note:
                    print(f"rank {rank}: {scope}_{name}: {note}", flush=True)
                dens = args.density if name.startswith("mcsparse") else 1.0
                o = out[:, rows_loc] if scope == "ulysses" else out[:, :, rows_loc]
                if name == "sdpa_cudnn":
                    base_ms[scope] = across_ranks(ms, dist.ReduceOp.MAX)
                record(f"{scope}_{name}", scope, ms, o, ref, " ".join(f"{p}:{n}" for p, n in sorted(ph.items())),
                       dens, note)
                del cm, out
                vc_compile.reset(report=True)
                if cuda:
                    torch.cuda.empty_cache()
                flush()

    if args.diffusers:
        rows += diffusers_check(args, cuda, rank, world)
        flush()

    if rank == 0:
        for r in rows:
            for c in EXTRAS:
                r.setdefault(c, "")
        print_table(rows, ["variant", "scope", "density", "ms", "tflops", "speedup_vs_cudnn", "rel_l2",
                           "cos_sim", "phases", "max_rank_spread_ms", "note"])
        print("smoke run: no rows written" if args.smoke else
              f"rows appended to {Path(__file__).parent / 'results' / (BENCH + '.csv')}")
    dist.barrier()
    dist.destroy_process_group()


def diffusers_check(args, cuda, rank, world):
    """diffusers' own Ulysses (hooks + TemplatedUlyssesAttention, 'native' backend) with vcattn."""
    from diffusers import WanTransformer3DModel
    from torch._dynamo.utils import counters

    heads = 8 if not args.smoke else 4
    frames, hh, ww = (21, 90, 160) if not args.smoke else (2, 16, 32)  # 75600 / 256 tokens
    torch.manual_seed(0)
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128 if cuda else 64,
                              in_channels=16, out_channels=16, text_dim=256, freq_dim=256,
                              ffn_dim=2048 if cuda else 256, num_layers=2).to(_DEV, torch.bfloat16).eval()
    enable_diffusers_ulysses(m, world)
    g = torch.Generator(device=_DEV).manual_seed(5)
    x = torch.randn(1, 16, frames, hh, ww, device=_DEV, generator=g, dtype=torch.bfloat16)
    ctx = torch.randn(1, 512, 256, device=_DEV, generator=g, dtype=torch.bfloat16)
    t = torch.tensor([500], device=_DEV)
    S = frames * (hh // 2) * (ww // 2)
    rows, ref = [], None
    for name, opts in (("dense", {"method": "dense"}), ("vsmooth", {"method": "vsmooth", "expcast": False}),
                       ("mcsparse", {"method": "mcsparse", "density": args.density, "warmup_steps": 0,
                                     "anchor_steps": (0,)})):
        torch._dynamo.reset()
        counters.clear()
        vc_compile.reset(report=True)
        cm = torch.compile(m, backend="vcattn", options={"min_seq_len": 1024 if cuda else 64,
                                                          "experimental": {"compiler": args.compiler}, **opts})
        dist.barrier()
        with torch.no_grad(), prefer_cudnn(), vc_compile.sampling(num_steps=3):
            for i in range(3):  # mcsparse: anchor, reuse, reuse; vsmooth: group, reuse, reuse
                vc_compile.step(i)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = cm(x, t, ctx, return_dict=False)[0]
                if cuda:
                    torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) * 1e3
        rewrites = torch.tensor([counters["vcattn"]["rewrite"]], device=_DEV)
        allr = [torch.zeros_like(rewrites) for _ in range(world)]
        dist.all_gather(allr, rewrites)
        if ref is None:
            ref = out.float()
        mm = metrics(out.float(), ref)
        ph = " ".join(f"{p}:{n}" for p, n in sorted(sum((s.phases for s in vc_compile.report().rewritten),
                                                         __import__("collections").Counter()).items()))
        note = f"rewrites per rank {[int(r.item()) for r in allr]}"
        log(f"  diffusers_wan_ulysses_{name}: {note}, last step {ms:.1f} ms, rel_l2 vs dense {mm['rel_l2']:.3g}")
        rows.append({"variant": f"diffusers_wan_ulysses_{name}", "B": 1, "H": heads, "S": S,
                     "D": 128 if cuda else 64, "density": args.density if name == "mcsparse" else 1.0,
                     "ms": across_ranks(ms, dist.ReduceOp.MAX), "rel_l2": mm["rel_l2"], "cos_sim": mm["cos_sim"],
                     "world": world, "scope": "diffusers", "phases": ph, "compiler": args.compiler,
                     "note": note + "; model forward (2 blocks), rel_l2 vs the dense run"})
        del cm
    return rows


if __name__ == "__main__":
    main()
