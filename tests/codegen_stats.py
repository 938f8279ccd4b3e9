"""Compile the Q/K preprocessing kernels for sm_90 on a machine WITHOUT a GPU and print what the code
does per kernel: registers and spills (ptxas -v), layout conversions (TTGIR), global loads/stores by width
(PTX). Used to find why the RoPE prologue was 10x slower than the no-RoPE path (scalar loads, 243
registers; see the NOTE in vc_compile/kernels/preprocess.py) and by tests/passes/test_rope_fuse.py to keep it so.

    PYTHONPATH=tests python -m codegen_stats [--S 32760] [--form interleaved|rotate-half] [--full] [--json]
        [--dump PREFIX]

Triton's JIT is run with a fake driver (target cuda:90) and every launch turned into a warm-up compile;
the tensors are CPU tensors of the benchmark's shapes (B=1, H=40, D=128, bf16 [B, S, H, D]), so the
specialisation (strides divisible by 16, ...) is the GPU run's. Never run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def _tool(name: str) -> str:
    """The path of the CUDA tool our sm_90 kernels are built with: the package's choice of ptxas
    (``kernels/compat.sm90_ptxas``: Triton 3.9's bundled CUDA 12 one), else Triton's own for sm_90."""
    from triton import knobs
    if name == "ptxas":
        from triton.backends.nvidia.compiler import get_ptxas

        from vc_compile.kernels.compat import sm90_ptxas
        return sm90_ptxas() or get_ptxas(90).path
    return getattr(knobs.nvidia, name).path


PTXAS, CUOBJDUMP = _tool("ptxas"), _tool("cuobjdump")


class _FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, d=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


COMPILED = []


def _install():
    driver.set_active(_FakeDriver())
    orig = JITFunction.run

    def run(self, *a, grid, warmup, **kw):
        k = orig(self, *a, grid=grid, warmup=True, **kw)
        COMPILED.append((self.fn.__name__, k))
        return k
    run.__wrapped__ = orig  # Triton's own launch path, as kernels/launch.py reads it
    JITFunction.run = run


_PTXAS_RUNS: dict = {}


def ptxas(ptx: str) -> tuple:
    """(ptxas -v's messages, the SASS text) of one PTX for sm_90a: one ptxas and one cuobjdump run per distinct
    PTX in a process (the resource line, the wgmma notes and the SASS all come from that one build)."""
    if ptx not in _PTXAS_RUNS:
        with tempfile.TemporaryDirectory() as d:
            src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True,
                               check=True)
            sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        _PTXAS_RUNS[ptx] = (r.stdout + r.stderr, sass)
    return _PTXAS_RUNS[ptx]


def stats(k) -> dict:
    ptx = k.asm["ptx"]
    msg = ptxas(ptx)[0]
    regs = re.search(r"Used (\d+) registers", msg)
    spill = re.search(r"(\d+) bytes spill stores", msg)
    return {"registers": int(regs.group(1)) if regs else -1, "spill_bytes": int(spill.group(1)) if spill else -1,
            "convert_layout": k.asm["ttgir"].count("ttg.convert_layout"),
            # conversions of [R > 1, C] tiles: the per-row data path through shared memory (the others move a
            # per-program vector, e.g. K's mean, once)
            "convert_layout_tiles": len([m for m in re.findall(r"ttg\.convert_layout %\S+ : tensor<(\d+)x(\d+)x",
                                                              k.asm["ttgir"]) if int(m[0]) > 1]),
            "loads": dict(Counter(re.findall(r"ld\.global[.\w]*", ptx))),
            "stores": dict(Counter(re.findall(r"st\.global[.\w]*", ptx)))}


def print_loops(out: dict, as_json: bool) -> None:
    """Per kernel: its stats and, on a line of its own, its key loop's (JSON: everything as one object)."""
    if as_json:
        print(json.dumps(out))
        return
    for name, st in out.items():
        loop = st.pop("loop")
        print(f"{name}: {st}\n    loop: {loop}")


def dump_asm(k, prefix: str) -> None:
    """Write a compiled kernel's TTGIR and PTX to PREFIX.ttgir / PREFIX.ptx."""
    for ext in ("ttgir", "ptx"):
        with open(f"{prefix}.{ext}", "w") as f:
            f.write(k.asm[ext])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--S", type=int, default=32760)
    p.add_argument("--form", default="interleaved", choices=("interleaved", "rotate-half"))
    p.add_argument("--full", action="store_true", help="one table value per channel (else Wan's pair table)")
    p.add_argument("--no-rope", action="store_true", help="the kernels without the RoPE prologue")
    p.add_argument("--fused", action="store_true",
                   help="the whole preprocessing (Q, K and V, perm, sm_90 V layout), as a reuse step runs it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dump", default=None, help="write PREFIX_<kernel>.ttgir/.ptx")
    a = p.parse_args(argv)
    _install()
    from vc_compile import formats
    from vc_compile.kernels import preprocess as tpre
    H, D, S = 40, 128, a.S
    q = torch.empty(1, S, H, D, dtype=torch.bfloat16)
    k = torch.empty(1, S, H, D, dtype=torch.bfloat16)
    Dc = D if a.full else D // 2
    spec = formats.RopeSpec(a.form, "BSHD", H, None, None)
    qb, kb = formats.to_bhsd(q, spec), formats.to_bhsd(k, spec)
    ra = None if a.no_rope else formats.rope_args(torch.empty(1, S, 1, Dc), torch.empty(1, S, 1, Dc), spec, tuple(qb.shape))
    try:
        if a.fused:
            perm = torch.empty(1, H, S, dtype=torch.int64)
            tpre.preprocess(qb, kb, kb, perm, sm_scale=D ** -0.5, rope=ra, v_layout="sm90")
        else:
            tpre.preprocess_qk(qb, kb, None, sm_scale=D ** -0.5, rope=ra)
    except Exception:  # noqa: BLE001 - the host code after the (fake) launches may trip on empty CPU tensors
        pass
    out = {}
    for name, kk in COMPILED:
        out[name] = stats(kk)
        if a.dump:
            dump_asm(kk, f"{a.dump}_{name}")
    if a.json:
        print(json.dumps(out))
    else:
        for name, st in out.items():
            print(f"{name}: {st}")
    return out


if __name__ == "__main__":
    main()
