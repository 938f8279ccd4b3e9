"""The sm_90 Gluon kernel's launch configurations side by side: speed and fidelity of each, beside SDPA cuDNN and
the FP8 baselines of the same run (FA3's FP8 kernel, torchao's FP8 op, where installed).

    python -m benchmarks.bench_vsmooth_attn_sm90 [--shapes 40x32760x128,40x75600x128] [--modes expcast,exp2]
        [--configs '[{"stages": 3}, ...]'] [--inputs structured,rising] [--no-csv] [--smoke]

Per shape and mode (``exp2`` = V-Smooth, ``expcast`` = V-Smooth + ExpCast), the kernel alone on the runtime's
preprocessing (k-means order, V in the sm_90 layout), once with the measured default launch
(``configs.vsmooth_sm90_default``) and once per entry of ``--configs`` (fields over that default; the pseudo-field
``"bytemask_guard": false`` keeps the byte-mask clamp where its build spills, ``vsmooth_attn_sm90.BytemaskGuard``,
whose choice the ``note`` column names). Columns:
median ms, x cuDNN, x FA3 FP8, rel. L2 against an fp32 reference on 512 sampled query rows, the largest
difference from the default launch's output, and NaN counts. Inputs: ``structured`` (the kernel benchmark's:
channel-biased K, clustered V with token outliers) and ``rising`` (sharp logits whose row maxima keep rising
along the keys: every block moves the max of some rows, the worst case for a lazily updated max).
--smoke: argument handling and table printing only (no GPU: nothing is timed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from benchmarks.common import (add_speedup, append_rows, attn_flops, bench_ms, metrics, print_table,
                               run_fp8_baselines, sdpa_fn, truth_rows)

BENCH = "bench_vsmooth_attn_sm90"


def log(*a):
    print(*a, flush=True)


def rising_inputs(B, H, S, D, seed=1, device="cuda"):
    """Sharp logits (std ~6 in natural units) whose maxima rise along the keys: a key's projection on a fixed
    direction grows linearly with its position, and every query leans on that direction."""
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(H, 1, D, device=device, generator=g), dim=-1)
    pos = torch.linspace(0.0, 1.0, S, device=device).view(1, S, 1)
    q = torch.randn(B, H, S, D, device=device, generator=g) + 3.0 * u
    k = 0.5 * torch.randn(B, H, S, D, device=device, generator=g) + (8.0 * pos) * u
    v = torch.randn(B, H, S, D, device=device, generator=g)
    return [t.bfloat16() for t in (q, k, v)]


def parse_shapes(text):
    out = []
    for item in text.split(","):
        h, s, d = (int(x) for x in item.lower().split("x"))
        out.append((h, s, d))
    return out


def run(shapes, modes, extra, inputs, n_rows=512, sink=None):
    from benchmarks.bench_vsmooth_attn import make_inputs, runtime_pre
    from vc_compile import torch_ops
    from vc_compile.kernels import kmeans as tkm
    from vc_compile.kernels.configs import vsmooth_sm90_default
    from vc_compile.kernels.vsmooth_attn_sm90 import BYTEMASK_GUARD as guard
    from vc_compile.kernels.vsmooth_attn_sm90 import vsmooth_attention_sm90

    rows = []
    for H, S, D in shapes:
        for kind in inputs:
            q, k, v = make_inputs(1, H, S, D) if kind == "structured" else rising_inputs(1, H, S, D)
            log(f"\n=== H={H} S={S} D={D} inputs={kind} ===")
            idx = torch.randperm(S, device=q.device)[:n_rows].sort().values
            truth = truth_rows(q, k, v, idx)
            flops = attn_flops(1, H, S, S, D)
            wu, rep = (25, 200) if S <= 40000 else (50, 600)
            base = dict(B=1, H=H, S=S, D=D, density=1.0, inputs=kind)
            here = []

            def add(variant, ms, out=None, **kw):
                row = dict(base, variant=variant, ms=ms, tflops=flops / ms * 1e-9, **kw)
                if out is not None:
                    mt = metrics(out[:, :, idx].float(), truth)
                    row.update(rel_l2=mt["rel_l2"], cos_sim=mt["cos_sim"],
                               nan=int(torch.isnan(out).sum().item()))
                here.append(row)
                log(f"  {variant:44s} {ms:9.3f} ms  rel_l2 {row.get('rel_l2', float('nan')):.3e}")
                return row

            fn = sdpa_fn(q, k, v, "cudnn")
            add("sdpa_cudnn", bench_ms(fn, wu, rep), fn())
            run_fp8_baselines(q, k, v, lambda name, fn, note: add(name, bench_ms(fn, wu, rep), fn(), note=note),
                              log)
            K = torch_ops.default_clusters(S)
            perm = tkm.kmeans_perm(v, K, 10).perm
            for mode in modes:
                ec = mode == "expcast"
                qk, vq = runtime_pre(q, k, v, perm, D ** -0.5, True, ec)
                default = vsmooth_sm90_default(D, ec, S)
                ref_out = None
                for spec in [{}] + list(extra):
                    name = f"{mode}_kernel" + ("" if not spec else ":" + ",".join(f"{a}={b}" for a, b in spec.items()))
                    spec = dict(spec)
                    # bytemask_guard=false: the byte-mask clamp kept where its build spills (the guard's A/B)
                    guard.enabled = bool(spec.pop("bytemask_guard", True))
                    guard.clear()
                    try:  # (a launch the config refuses over this mode's default is logged and skipped)
                        cfg = dataclasses.replace(default, **spec)
                        call = lambda cfg=cfg: vsmooth_attention_sm90(qk, vq, expcast=ec, launch=cfg)  # noqa: E731
                        out = call()
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001
                        log(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    diff = float("nan") if ref_out is None else (out.float() - ref_out.float()).abs().max().item()
                    ref_out = out if ref_out is None else ref_out
                    t = bench_ms(call, wu, rep)
                    add(name, t, out, max_diff_vs_default=diff, launch=json.dumps(cfg.to_json(), sort_keys=True),
                        note=guard.summary() or "")
                guard.enabled = True
                del qk, vq, ref_out
            cud = next(r["ms"] for r in here if r["variant"] == "sdpa_cudnn")
            for r in here:
                r["speedup_vs_cudnn"] = cud / r["ms"]
            add_speedup(here, "fa3-fp8", "speedup_vs_fa3")
            add_speedup(here, "torchao-fp8", "speedup_vs_torchao")
            rows += here
            if sink is not None:  # rows land per shape: a run cut short keeps what it measured
                sink(here)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="40x32760x128,40x75600x128", help="HxSxD, comma-separated (B = 1)")
    ap.add_argument("--modes", default="expcast,exp2")
    ap.add_argument("--configs", default="[]", help="JSON list of launch-field overrides, e.g. '[{\"stages\": 3}]'")
    ap.add_argument("--inputs", default="structured")
    ap.add_argument("--no-csv", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="parse the arguments and print an empty table")
    a = ap.parse_args(argv)
    shapes = parse_shapes(a.shapes)
    extra = json.loads(a.configs)
    if not isinstance(extra, list) or not all(isinstance(x, dict) for x in extra):
        raise SystemExit("--configs must be a JSON list of objects (launch fields over the default)")
    modes = [m for m in a.modes.split(",") if m]
    if any(m not in ("expcast", "exp2") for m in modes):
        raise SystemExit(f"--modes: 'expcast' and/or 'exp2', got {a.modes!r}")
    cols = ["H", "S", "inputs", "variant", "ms", "speedup_vs_cudnn", "speedup_vs_fa3", "speedup_vs_torchao",
            "rel_l2", "max_diff_vs_default", "nan"]
    if a.smoke or not torch.cuda.is_available():
        log(f"shapes {shapes}, modes {modes}, configs {extra}: " + ("smoke run" if a.smoke else "no GPU: nothing timed"))
        print_table([], cols)
        return 0
    extras = ["inputs", "max_diff_vs_default", "nan", "launch", "speedup_vs_fa3", "speedup_vs_torchao", "note"]
    sink = None if a.no_csv else (lambda rows: log("rows appended to " + append_rows(BENCH, rows, extras=extras)))
    rows = run(shapes, modes, extra, [x for x in a.inputs.split(",") if x], sink=sink)
    print_table(rows, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
