"""What NaN/Inf propagation and the MC-Sparse guard cost on a reuse step (kernels/finite_flags.py).

    python -m benchmarks.bench_finite_flags                    # H200: S in {32760, 75600}, H = 40, D = 128
    python -m benchmarks.bench_finite_flags --sizes 32760 --csv $OUT/bench_finite_flags.csv
    python -m benchmarks.bench_finite_flags --smoke            # CPU dry run (Triton interpreter, tiny)

Rows (``variant``), B = 1, bf16, density 0.15, C = 128 (the MC-Sparse defaults), a random sorted selection
per group and PDDP groups of the queries, all timed in one process with ``triton.testing.do_bench``:
* ``sdpa_cudnn``: the dense baseline (``speedup_vs_cudnn`` of every row is against it).
* ``kv_read_torch``: ``k.sum() + v.sum()`` in fp32: torch reading K and V once (the bandwidth yardstick).
* ``flags``: ``finite_flags(k, v)`` alone; ``flags_probe``: with the guard's 16 probe rows per head, plus
  ``probe_error`` (the whole measurement). ``gbps`` = 2 B H S D * 2 bytes / time.
* ``reuse_base``: the gather kernel + bf16 residual epilogue = the reuse step before the NaN/Inf flags.
* ``reuse_flags``: flags + gather kernel with the flag epilogue = a reuse step with propagate_nonfinite=True.
* ``reuse_guard``: flags + probe, gather, probe_error and the asynchronous read-back = guard on.
``overhead_pct`` = (time / reuse_base - 1) * 100. ``rel_l2``: reuse_flags / reuse_guard against reuse_base
on the same clean inputs (must be exactly 0: the flags are all 0). The run also checks that a NaN in the
last key of the last head is flagged at this size (64-bit offsets).
"""
from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: the interpreter runs the kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.common import append_rows, attn_flops, bench_ms, print_table, sdpa_fn  # noqa: E402
from vc_compile.formats import n_keep  # noqa: E402
from vc_compile.methods.mcsparse_guard import GuardState  # noqa: E402
from vc_compile.kernels import dispatch  # noqa: E402

EXTRAS = ["overhead_pct", "gbps", "group_size", "note"]


def bench_size(B, H, S, D, C, density, dev, log):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    sm = D ** -0.5
    G = (S + C - 1) // C
    keep = n_keep(S, density)
    sigma = torch.stack([torch.randperm(S, device=dev) for _ in range(B * H)]).view(B, H, S)
    idx = torch.empty(B, H, G, keep, device=dev, dtype=torch.int32)
    for h in range(H):  # a random sorted top-keep per group, one head at a time (rand is G x S)
        idx[:, h] = torch.rand(B, G, S, device=dev).topk(keep, dim=-1).indices.sort(-1).values.int()
    res = (0.01 * torch.randn(B, H, S, D, device=dev)).bfloat16()
    guard = GuardState.new(q)
    kv_bytes = 2 * B * H * S * D * 2

    T = dispatch.Impl.TRITON  # as the runtime launches them (dispatch: launch configs, tuning lookup)

    def gather(flag=None):
        return dispatch.sparse_attention(T, q, k, v, sigma, idx, sm_scale=sm, group_size=C, residual=res, flag=flag)

    def flags(kk=k, probe=None):
        return dispatch.finite_flags(T, kk, v, probe=probe)

    def reuse_flags():
        flag, _ = flags()
        return gather(flag)

    def reuse_guard():
        flag, part = flags(probe=(q, guard.rows, sm))
        out = gather(flag)
        guard.record(dispatch.probe_error(T, out, guard.rows, part))
        guard.poll()
        return out

    def flags_probe():
        flag, part = flags(probe=(q, guard.rows, sm))
        return dispatch.probe_error(T, res, guard.rows, part)

    base_out = gather()
    checks = {"reuse_flags": reuse_flags(), "reuse_guard": reuse_guard()}
    # correctness at this size: the last key of the last head
    k2 = k.clone()
    k2[-1, -1, -1, -1] = float("nan")
    flag, _ = flags(k2)
    assert int(flag.sum()) == D and bool(flag[-1, -1].all()), "the NaN in the last key was not flagged"
    del k2
    quick = dev != "cuda"
    wu, rp = (1, 1) if quick else ((10, 40) if S > 40000 else (25, 100))
    t = {}
    fns = [("sdpa_cudnn", sdpa_fn(q, k, v, "cudnn") if dev == "cuda" else (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))),
           ("kv_read_torch", lambda: k.sum(dtype=torch.float32) + v.sum(dtype=torch.float32)),
           ("flags", flags), ("flags_probe", flags_probe),
           ("reuse_base", gather), ("reuse_flags", reuse_flags), ("reuse_guard", reuse_guard)]
    for name, fn in fns:
        t[name] = bench_ms(fn, warmup=wu, rep=rp)
        log(f"S={S} {name}: {t[name]:.3f} ms")
    rows = []
    fl = attn_flops(B, H, S, S, D)
    for name, _ in fns:
        r = {"variant": name, "B": B, "H": H, "S": S, "D": D, "density": 1.0 if name == "sdpa_cudnn" else keep / S,
             "ms": t[name], "speedup_vs_cudnn": t["sdpa_cudnn"] / t[name], "group_size": C}
        if name.startswith("reuse") or name == "sdpa_cudnn":
            r["tflops"] = fl / (t[name] * 1e-3) / 1e12
        if name.startswith("reuse_") and name != "reuse_base":
            r["overhead_pct"] = (t[name] / t["reuse_base"] - 1) * 100
            o = checks[name].float()
            r["rel_l2"] = ((o - base_out.float()).norm() / base_out.float().norm()).item()
        if name in ("flags", "flags_probe", "kv_read_torch"):
            r["gbps"] = kv_bytes / (t[name] * 1e-3) / 1e9
            r["overhead_pct"] = t[name] / t["reuse_base"] * 100
        r["note"] = {"flags": "overhead_pct = share of reuse_base", "flags_probe": "incl. probe_error",
                     "reuse_guard": "incl. async read-back", "kv_read_torch": "k.sum() + v.sum(), fp32"}.get(name, "")
        rows.append(r)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32760,75600")
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="CPU: interpreter, B = 1, H = 2, S = 300, D = 64")
    ap.add_argument("--csv", default=None, help="also append the rows to this CSV")
    a = ap.parse_args(argv)
    log = lambda m: print(f"[finite_flags] {m}", flush=True)  # noqa: E731
    rows = []
    if a.smoke:
        rows += bench_size(1, 2, 300, 64, 64, 0.3, "cpu", log)
    else:
        for S in (int(x) for x in a.sizes.split(",")):
            rows += bench_size(1, 40, S, 128, a.group_size, a.density, "cuda", log)
    print()
    print_table(rows, ["variant", "S", "density", "ms", "speedup_vs_cudnn", "overhead_pct", "gbps", "rel_l2"])
    if a.smoke:
        print("[finite_flags] smoke run: rows not written")
        return rows
    path = append_rows("bench_finite_flags", rows, extras=EXTRAS)
    print(f"[finite_flags] appended {len(rows)} rows to {path}")
    if a.csv:
        print(f"[finite_flags] also to {append_rows('bench_finite_flags', rows, path=a.csv, extras=EXTRAS)}")
    return rows


if __name__ == "__main__":
    main()
