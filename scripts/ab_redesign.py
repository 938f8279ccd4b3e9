"""Same speed before and after the kernel-layer redesign? Times, at the checked-out commit, the
kernels as the runtime launches them by default (no launch config: the measured defaults) on the benchmark's
shapes, and compares two such runs. Works at 4f44cc9 and a3d8650 (before) and after (it adapts to each API).

    git worktree add /tmp/vc_base 4f44cc9 && cp scripts/ab_redesign.py /tmp/vc_base/scripts/
    (cd /tmp/vc_base && python3 -m scripts.ab_redesign --out /tmp/ab_base.json)   # before
    python3 -m scripts.ab_redesign --out /tmp/ab_new.json                          # after (this checkout)
    (cd /tmp/vc_base && python3 -m scripts.ab_redesign --out /tmp/ab_base2.json)  # before again (drift)
    python3 -m scripts.ab_redesign --compare /tmp/ab_base.json /tmp/ab_new.json /tmp/ab_base2.json

Run from the checkout's root (``python3 -m``: its vc_compile is imported). Rows: the V-Smooth attention kernel
alone (Gluon on sm_90 for INT8 Q/K; exp2, ExpCast, naive 8-bit; D = 128 at S = 8190 / 32760 / 75600, D = 64 at
32760), the Triton kernel with FP8 Q/K, the sparse gather kernel's reuse step (bf16 / fp8 QK, C = 64 / 128,
s = 0.15), the V-Smooth preprocessing, k-means and PDDP. ``--compare`` prints each row's median ms and the ratio
new / old (and old2 / old, the run-to-run spread); a row outside +-2% is flagged.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _bench(fn, ms_budget=400.0):
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=int(ms_budget), return_mode="median"))


def _api():
    """(vsmooth(qk, vq, expcast), vsmooth_fp8_triton(qk, vq, expcast), sparse(q, k, v, sigma, idx, C, res, fmt))."""
    from vc_compile.kernels import sparse_attn as tsa
    try:  # after the redesign
        from vc_compile.kernels import dispatch
        T = dispatch.Impl.TRITON

        def vs(qk, vq, ec):
            return dispatch.vsmooth_attention(T, qk, vq, expcast=ec)

        def sp(q, k, v, sigma, idx, C, res, fmt):
            return dispatch.sparse_attention(T, q, k, v, sigma, idx, sm_scale=q.shape[-1] ** -0.5, group_size=C,
                                             residual=res, qk_format=fmt)
    except ImportError:  # 4f44cc9
        from vc_compile.kernels import vsmooth_attn as tva

        def vs(qk, vq, ec):
            return tva.vsmooth_attention(qk, vq, expcast=ec)

        def sp(q, k, v, sigma, idx, C, res, fmt):
            return tsa.sparse_attention(q, k, v, sigma, idx, sm_scale=q.shape[-1] ** -0.5, group_size=C,
                                        residual=res, qk_format=fmt)
    return vs, sp


def run(quick: bool) -> dict:
    try:
        from vc_compile.formats import n_keep
    except ImportError:  # before formats.py (a3d8650 and earlier)
        from vc_compile.reference.select import n_keep
    from vc_compile.kernels import kmeans as tkm
    from vc_compile.kernels import pddp as tpddp
    from vc_compile.kernels import preprocess as tpre
    vs, sp = _api()
    dev = "cuda"
    out = {}
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(32760, 128), (8190, 128)] if quick else [(32760, 128), (75600, 128), (8190, 128), (32760, 64)]
    H = 40
    for S, D in shapes:
        q, k, v = (torch.randn(1, S, H, D, device=dev, generator=g).bfloat16().permute(0, 2, 1, 3) for _ in range(3))
        k = (k.float() + 3.0 * torch.randn(1, H, 1, D, device=dev, generator=g)).bfloat16()
        perm = torch.stack([torch.randperm(S, device=dev, generator=g) for _ in range(H)]).view(1, H, S)
        qk = tpre.preprocess_qk(q, k, perm, sm_scale=D ** -0.5)
        for name, smooth, ec in (("vsmooth", True, False), ("expcast", True, True), ("naive8", False, False)):
            vq = tpre.preprocess_v(v, perm if smooth else None, smooth=smooth)
            out[f"{name}_kernel_S{S}_D{D}"] = _bench(lambda: vs(qk, vq, ec))
        if (S, D) == (32760, 128):
            qk8 = tpre.preprocess_qk(q, k, perm, sm_scale=D ** -0.5, qk_format="fp8")
            vq = tpre.preprocess_v(v, perm)
            out[f"vsmooth_fp8qk_kernel_S{S}_D{D}"] = _bench(lambda: vs(qk8, vq, False))
            out[f"preprocess_qk_S{S}_D{D}"] = _bench(lambda: tpre.preprocess_qk(q, k, perm, sm_scale=D ** -0.5))
            out[f"preprocess_v_S{S}_D{D}"] = _bench(lambda: tpre.preprocess_v(v, perm))
            km = tkm.kmeans_perm(v, 256, 10)
            out[f"kmeans3_S{S}_D{D}"] = _bench(lambda: tkm.kmeans_perm(v, 256, 3, init=km.centroids))
            res = (0.01 * torch.randn(1, H, S, D, device=dev, generator=g)).bfloat16()
            keep = n_keep(S, 0.15)
            for C in (128, 64):
                out[f"pddp_C{C}_S{S}_D{D}"] = _bench(lambda: tpddp.pddp_perm(q, C))
                sigma = tpddp.pddp_perm(q, C)
                G = -(-S // C)
                idx = torch.rand(1, H, G, S, device=dev, generator=g).topk(keep, -1).indices.sort(-1).values.int()
                for fmt in ("bf16", "fp8"):
                    out[f"sparse_reuse_{fmt}_C{C}_S{S}_D{D}"] = _bench(lambda: sp(q, k, v, sigma, idx, C, res, fmt))
                del idx
        del q, k, v, qk
        torch.cuda.empty_cache()
    return out


def compare(paths, csv_path=None, note="") -> int:
    """Print the rows of old.json / new.json (/ old_again.json) side by side; ``csv_path``: also append them to
    that CSV (``benchmarks/results/ab_redesign.csv``'s columns: ms = new, old_ms, old2_ms and the ratios)."""
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    old, new = runs[0]["ms"], runs[1]["ms"]
    spread = runs[2]["ms"] if len(runs) > 2 else None
    print(f"old: {runs[0]['commit']}  new: {runs[1]['commit']}  ({runs[0]['gpu']})")
    print(f"{'row':40s} {'old ms':>10s} {'new ms':>10s} {'new/old':>8s}" + ("  old2/old" if spread else ""))
    bad = 0
    for key in old:
        if key not in new:
            print(f"{key:40s} missing in new")
            bad += 1
            continue
        r = new[key] / old[key]
        flag = "" if abs(r - 1) <= 0.02 else "  <-- outside +-2%"
        bad += bool(flag)
        extra = f"  {spread[key] / old[key]:8.3f}" if spread and key in spread else ""
        print(f"{key:40s} {old[key]:10.3f} {new[key]:10.3f} {r:8.3f}{extra}{flag}")
    print(f"{len(old) - bad} of {len(old)} rows within +-2%")
    if csv_path:
        _append_csv(csv_path, runs, note)
    return 1 if bad else 0


def _append_csv(path, runs, note):
    import csv
    import datetime
    import os
    import re
    cols = ["date", "commit", "gpu", "torch", "triton", "bench", "variant", "B", "H", "S", "D", "density", "ms",
            "tflops", "speedup_vs_cudnn", "rel_l2", "cos_sim", "old_commit", "old_ms", "old2_ms", "new_over_old",
            "old2_over_old", "new_over_old2", "note"]
    old, new = runs[0]["ms"], runs[1]["ms"]
    spread = runs[2]["ms"] if len(runs) > 2 else {}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    new_file = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, cols)
        if new_file:
            w.writeheader()
        for key in old:
            if key not in new:
                continue
            m = re.search(r"_S(\d+)_D(\d+)$", key)
            o2 = spread.get(key)
            w.writerow({"date": date, "commit": runs[1]["commit"], "gpu": runs[1]["gpu"],
                        "torch": runs[1].get("torch", ""), "triton": runs[1].get("triton", ""), "bench": "ab_redesign",
                        "variant": key, "B": 1, "H": 40, "S": m.group(1) if m else "", "D": m.group(2) if m else "",
                        "ms": f"{new[key]:.4f}", "old_commit": runs[0]["commit"], "old_ms": f"{old[key]:.4f}",
                        "old2_ms": f"{o2:.4f}" if o2 else "", "new_over_old": f"{new[key] / old[key]:.4f}",
                        "old2_over_old": f"{o2 / old[key]:.4f}" if o2 else "",
                        "new_over_old2": f"{new[key] / o2:.4f}" if o2 else "", "note": note})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="D = 128 at S = 32760 and 8190 only")
    ap.add_argument("--compare", nargs="+", default=None, help="old.json new.json [old_again.json]")
    ap.add_argument("--csv", default=None, help="with --compare: append the rows to this CSV")
    ap.add_argument("--note", default="", help="with --csv: the rows' note")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(a.compare, a.csv, a.note)
    if not torch.cuda.is_available():
        print("ab_redesign: needs a CUDA GPU", file=sys.stderr)
        return 1
    import os
    import subprocess
    import triton
    commit = os.environ.get("VC_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                           capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    ms = run(a.quick)
    rec = {"commit": commit, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "ms": ms, "s": time.time() - t0}
    for key, val in ms.items():
        print(f"{key:40s} {val:10.3f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
