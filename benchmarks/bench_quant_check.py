"""The quantisation check (option ``quant_check``, ``vc_compile/reference/quant_check.py``) on outlier inputs:
what it reads, what it chooses, and V-Smooth's error with and without it.

    python -m benchmarks.bench_quant_check [--S 2125] [--dims 64,128] [--kinds structured,gaussian] [--no-csv]

Runs on the CPU reference path (the kernels' arithmetic; no GPU needed). Per input kind (``structured``: the
kernel benchmark's channel-biased K and clustered V with 1% token outliers; ``gaussian``), head dim and case
(clean; one K channel x3 / x10 / x100; one key token x3 / x10 / x1000; one value token x1000 / x1e6), the op runs
one V-Smooth step at a fresh site with the check and once with ``quant_check=False``; errors are rel. L2 against
fp64 SDPA on the same bf16 inputs, and each is given as a multiple of the clean case's (``x clean``). The
sharpness check (``max_logit_std``) is off in both, so each row is the quantisation check's own decision.
Rows: ``benchmarks/results/bench_quant_check.csv`` (variant = the case, ``action`` what the check chose).
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch

from benchmarks.common import append_rows, print_table, structured_inputs

BENCH = "bench_quant_check"
CASES = [("clean", None, None, 1), ("K channel x3", "k", "channel", 3), ("K channel x10", "k", "channel", 10),
         ("K channel x100", "k", "channel", 100), ("K token x3", "k", "token", 3), ("K token x10", "k", "token", 10),
         ("K token x1000", "k", "token", 1000), ("V token x1000", "v", "token", 1000),
         ("V token x1e6", "v", "token", 1e6)]


def inputs(kind, S, D, seed=0):
    if kind == "structured":
        return [t.transpose(1, 2).contiguous() for t in structured_inputs(1, 2, S, D, seed=seed)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, S, D, generator=g).bfloat16() for _ in range(3)]


def outlier(x, where, f):
    x = x.clone()
    if where == "channel":
        x[..., 5] = (x[..., 5].float() * f).to(x.dtype)
    else:
        x[:, :, x.shape[2] // 3] = (x[:, :, x.shape[2] // 3].float() * f).to(x.dtype)
    return x


def err(o, q, k, v):
    t = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    return ((o.double() - t).norm() / t.norm()).item()


def one_step(q, k, v, **over):
    import vc_compile
    import vc_compile.ops  # noqa: F401 - registers torch.ops.vcattn.*
    from vc_compile.config import VCConfig
    from vc_compile.runtime import report as _report
    cj = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 1, "max_logit_std": 0,
                                "experimental": {"kernels": "reference"}, **over}).to_json()
    site = _report.register_site(graph="bench", node="n", module="m", shape="?", dtype="?", method="vsmooth",
                                 rewritten=True).site
    with vc_compile.sampling(num_steps=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vc_compile.step(0)
        return torch.ops.vcattn.attention(q, k, v, None, site, cj, None)


def run(S, dims, kinds):
    from vc_compile.reference import quant_check as qc
    rows = []
    for kind in kinds:
        for D in dims:
            base = inputs(kind, S, D)
            clean = None
            for name, which, where, f in CASES:
                q, k, v = base
                if which == "k":
                    k = outlier(k, where, f)
                elif which == "v":
                    v = outlier(v, where, f)
                r = qc.read(q, k, v, "int8", False)
                e_on, e_off = err(one_step(q, k, v), q, k, v), err(one_step(q, k, v, quant_check=False), q, k, v)
                clean = e_off if clean is None else clean
                rows.append(dict(variant=name, B=1, H=2, S=S, D=D, inputs=kind, action=r.action("int8", False),
                                 r_qk=r.r_qk, r_qk_hadamard=r.r_qk_hadamard if r.r_qk_hadamard is not None else "",
                                 r_v=r.r_v, rel_l2=e_on, rel_l2_unchecked=e_off, x_clean=e_on / clean,
                                 x_clean_unchecked=e_off / clean))
                print(f"{kind:10s} D{D} {name:15s} {rows[-1]['action']:8s} r_qk {r.r_qk:.3f} r_v {r.r_v:.3f}  "
                      f"unchecked {e_off:.2e} ({e_off / clean:.1f}x)  checked {e_on:.2e} ({e_on / clean:.1f}x)",
                      flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", type=int, default=2125, help="tokens (not a multiple of the 64 / 128-token blocks)")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--kinds", default="structured,gaussian")
    ap.add_argument("--no-csv", action="store_true")
    a = ap.parse_args(argv)
    rows = run(a.S, [int(x) for x in a.dims.split(",")], [x for x in a.kinds.split(",") if x])
    print_table(rows, ["inputs", "D", "variant", "action", "r_qk", "r_v", "x_clean_unchecked", "x_clean"])
    if not a.no_csv:
        extras = ["inputs", "action", "r_qk", "r_qk_hadamard", "r_v", "rel_l2_unchecked", "x_clean",
                  "x_clean_unchecked"]
        print("rows appended to " + append_rows(BENCH, rows, extras=extras))
    return 0


if __name__ == "__main__":
    sys.exit(main())
