"""How the 8-bit paths' error grows with the sharpness of attention (docs/fidelity_notes.md, the table).

    python -m scripts.sharpness_table [--S 1024] [--D 64,128] [--stds 1,2,5,10,20,35,50,100]

Random q, k, v (B = 1, H = 2, bf16), q scaled so the logits q.k / sqrt(D) have the given std; each method runs one
step through ``vcattn::attention`` on the CPU reference path (``max_logit_std=0``: the sharpness check off, so
the 8-bit path runs whatever the spread); rel. L2 of the whole output against fp64 SDPA on the same bf16 inputs.
Also prints the op's own reading (``ops.logit_std``) of each input.
"""
import argparse
import math
import warnings

import torch
import torch.nn.functional as F

import vc_compile
from vc_compile import ops
from vc_compile.config import VCConfig
from vc_compile.runtime import report as _report

METHODS = {"vsmooth": {"method": "vsmooth", "expcast": False}, "expcast": {"method": "vsmooth", "expcast": True},
           "hadamard": {"method": "vsmooth", "hadamard": True}}


def run(q, k, v, opts):
    site = _report.register_site(graph="sharpness", node="n", module="m", shape="?", dtype="?", method="x",
                                 rewritten=True).site
    cj = VCConfig.from_options({"min_seq_len": 1, "max_logit_std": 0, "experimental": {"kernels": "reference"},
                                **opts}).to_json()
    with vc_compile.sampling(num_steps=2):
        vc_compile.step(0)
        return torch.ops.vcattn.attention(q, k, v, None, site, cj, None)


def rel(o, ref):
    return ((o.double() - ref).norm() / ref.norm()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--S", type=int, default=1024)
    ap.add_argument("--D", default="64,128")
    ap.add_argument("--stds", default="1,2,5,10,20,35,50,100")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")  # the reference path's "runs the plain-PyTorch reference" note
    for D in (int(x) for x in a.D.split(",")):
        print(f"S = {a.S}, D = {D}: logit std (op's reading) | bf16 SDPA | " + " | ".join(METHODS))
        for std in (float(x) for x in a.stds.split(",")):
            g = torch.Generator().manual_seed(int(std))
            q, k, v = (torch.randn(1, 2, a.S, D, generator=g) for _ in range(3))
            q, k, v = (t.bfloat16() for t in (q * std, k, v))
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
            errs = [rel(F.scaled_dot_product_attention(q, k, v), ref)]
            errs += [rel(run(q, k, v, o), ref) for o in METHODS.values()]
            reading = ops.logit_std(q, k, 1 / math.sqrt(D))
            print(f"{std:g} ({reading:.1f}) | " + " | ".join(f"{e:.2e}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
