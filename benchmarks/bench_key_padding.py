"""Joint attention under a key-padding mask (HunyuanVideo's), beside stock SDPA with the mask and on the kept keys.

    python -m benchmarks.bench_key_padding                    # GPU: the HunyuanVideo shapes below, every method
    python -m benchmarks.bench_key_padding --shapes 24x25440x256x64 --methods vsmooth+expcast
    python -m benchmarks.bench_key_padding --smoke            # CPU: tiny shapes, reference kernels, no rows

HunyuanVideo's dual- and single-stream blocks attend over video + text tokens (text padded to 256) with a boolean
[B, 1, 1, S] mask that drops the padding; stock SDPA then runs whatever backend takes the mask. Per shape
(``HxVIDEOxTEXTxKEPT``: heads, video tokens, text tokens, text tokens kept; B = 1, D = 128, bf16, structured
inputs drifting a little each step as ``bench_generation`` makes them), the rows are:

* ``sdpa_masked``: ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask)`` with torch's own backend choice,
  what the model runs stock;
* ``sdpa_kept_cudnn``: cuDNN on the kept keys (every query against k, v[:, :, :L]): what stock could reach if the
  model dropped its padding itself;
* each method through ``torch.ops.vcattn.attention(..., key_mask=mask)``, timed on reuse steps as
  ``bench_op_overhead`` times them (``run_method``: back to back, CUDA events; ``host_ms`` the CPU's time per
  call, which includes the mask's read: two small device-to-host copies).

``speedup_vs_masked`` / ``speedup_vs_kept`` = the baseline's ms / the row's; ``rel_l2`` against fp32 attention on
the kept keys (512 sampled query rows) of a reuse step on the first inputs. Rows go to
``benchmarks/results/bench_key_padding.csv``.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

import vc_compile
import vc_compile.ops  # noqa: F401 - registers torch.ops.vcattn.*
from benchmarks.bench_generation import _SITES, Runner, _phase_counts, _step_phase
from benchmarks.bench_op_overhead import METHODS, burst, run_method
from benchmarks.common import (Drift, append_rows, metrics, parse_methods, print_table, sdpa_backend,
                               truth_rows)
from vc_compile.config import merge_options

BENCH = "bench_key_padding"
# HunyuanVideo (24 heads x 128): 720 x 1280 x 129 frames -> 33 x 45 x 80 latent patches = 118800 video tokens;
# 544 x 960 x 129 -> 33 x 34 x 60 = 67320; 480 x 848 x 61 -> 16 x 30 x 53 = 25440; text padded to 256, a prompt of
# ~64 tokens kept
SHAPES = ((24, 118800, 256, 64), (24, 67320, 256, 64), (24, 25440, 256, 64))
EXTRAS = ["text", "kept", "host_ms", "speedup_vs_masked", "speedup_vs_kept", "kernel_path", "note"]


class PaddedRunner(Runner):
    """A ``Runner`` whose op calls carry the key-padding mask of ``L`` kept keys out of ``S``."""

    def __init__(self, S, L, H, D, seed, device, smoke):
        super().__init__(S, H, D, 50, seed, device, smoke)
        self.L = L
        self.mask = torch.zeros(1, 1, 1, S, dtype=torch.bool, device=device)
        self.mask[..., :L] = True

    def op(self, opts):
        extra = {"min_seq_len": 16, "experimental": {"kernels": "reference"}} if self.smoke else {}
        cfg = vc_compile.VCConfig.from_options(merge_options(opts, extra)).to_json()
        site, mask = next(_SITES), self.mask
        return site, lambda q, k, v: torch.ops.vcattn.attention(q, k, v, None, site, cfg, None, key_mask=mask)


def bench_shape(H, video, text, kept, args, device):
    S, L = video + text, video + kept
    runner = PaddedRunner(S, L, H, 128, args.seed, device, args.smoke)
    base = dict(B=1, H=H, S=S, D=128, density="", text=text, kept=kept)
    q, k, v = (t.transpose(1, 2) for t in Drift(1, H, S, 128, seed=args.seed, device=device).step())
    mask = runner.mask
    rows, ms = [], {}
    stock = {"sdpa_masked": (None, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
             "sdpa_kept_cudnn": ("cudnn" if runner.cuda else "math",
                                 lambda: F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L]))}
    for name, (backend, fn) in stock.items():
        try:
            with sdpa_backend(backend) if backend else contextlib.nullcontext():
                fn()
                host, ms[name] = burst(fn, args.reuse, runner.cuda)
        except RuntimeError as e:  # e.g. no backend takes the mask at this size: said, not timed
            print(f"  {name}: {str(e)[:160]}")
            continue
        rows.append(dict(base, variant=name, ms=ms[name], host_ms=host))
    n_rows = min(512, S)
    sel = torch.randperm(S, generator=torch.Generator().manual_seed(args.seed))[:n_rows].sort().values.to(device)
    truth = truth_rows(q, k[:, :, :L], v[:, :, :L], sel)
    for label in args.methods:
        opts = dict(METHODS[label], speed_gate="off", group_interval=0)
        r = run_method(runner, opts, args.reuse)
        # the error of a reuse step (what the timed calls are) on the first inputs, from a fresh site
        site, call = runner.op(opts)
        with vc_compile.sampling(num_steps=100):
            for i in range(100):
                vc_compile.step(i)
                before = _phase_counts(site)
                out = call(q, k, v)
                if _step_phase(before, _phase_counts(site)) == "reuse":
                    break
        m = metrics(out[:, :, sel].float(), truth)
        rows.append(dict(base, variant=label, rel_l2=m["rel_l2"], cos_sim=m["cos_sim"], **r))
    for r in rows:
        r["speedup_vs_masked"] = ms["sdpa_masked"] / r["ms"] if "sdpa_masked" in ms else float("nan")
        r["speedup_vs_kept"] = ms["sdpa_kept_cudnn"] / r["ms"] if "sdpa_kept_cudnn" in ms else float("nan")
        print(f"  H{H} S{S} (kept {L}) {r['variant']:16s} {r['ms']:.3f} ms  host {r['host_ms']:.3f} ms  "
              f"x masked {r['speedup_vs_masked']:.2f}  x kept {r['speedup_vs_kept']:.2f}  {r.get('note', '')}",
              flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="HxVIDEOxTEXTxKEPT list, e.g. 24x25440x256x64 (default: above)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    ap.add_argument("--reuse", type=int, default=10, help="timed calls per row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, reference kernels, no rows")
    ap.add_argument("--csv", default=None, help="also append rows to this file")
    args = ap.parse_args(argv)
    args.methods = parse_methods(ap, args.methods, METHODS)
    if args.smoke:
        shapes = [(2, 96, 16, 5)]
        args.reuse = min(args.reuse, 2)
    elif args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = SHAPES
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    all_rows = []
    with torch.no_grad():
        for H, video, text, kept in shapes:
            rows = bench_shape(H, video, text, kept, args, device)
            all_rows += rows
            if not args.smoke:
                append_rows(BENCH, rows, args.csv, EXTRAS)
    print_table(all_rows, ["variant", "H", "S", "kept", "ms", "host_ms", "speedup_vs_masked", "speedup_vs_kept",
                           "rel_l2", "kernel_path", "note"])
    return all_rows


if __name__ == "__main__":
    main()
