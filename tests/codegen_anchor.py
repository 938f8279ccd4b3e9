"""Compile the anchor-step kernels (``anchor_mass._mass_kernel``, ``topk._topk_kernel``) for sm_90 WITHOUT a GPU
and print registers, spills, shared memory, CTAs per H200 SM, the loop's wgmma waits and the SASS instruction
mix of the innermost hot loop (as tests/codegen_sparse.py; same fake-driver warm-up compile).

    PYTHONPATH=tests python -m codegen_anchor [--S 32760] [--C 128] [--json]

Mass kernel variants: exp in {exact, shift} x groups per program (256 / C and 128 / C) x key permutation on;
top-K: digit in {4, 8} x mass dtype in {bf16, fp32}. Never run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse

import codegen_sparse as cg  # (pops TRITON_INTERPRET, imports torch and triton)
import codegen_stats as cs

import torch  # noqa: E402  (after codegen_stats)


def hot_loop(sass: str, marker: str) -> dict:
    """Opcode mix of the SHORTEST backward-branch body containing ``marker`` (the MMA loop: IGMMA; the top-K
    chunk loops: the histogram's POPC / the scan's SHFL): codegen_sparse.loop_mix takes the longest body, which
    here is the TMA-barrier retry tail jumping back over the whole kernel."""
    import re
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for a, t in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            body = [x for b, x in ins if int(m.group(1), 16) <= b <= a]
            if any(marker in x for x in body) and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        return {}
    text = "\n".join(f"/*{i:04x}*/ {t};" for i, t in enumerate(best))
    # loop_mix on the isolated body: its longest backward branch is now the loop itself
    return cg.loop_mix(text + f"\n/*{len(best):04x}*/ BRA 0x0000;")


def stats(k, warps, marker):
    st = cg.kernel_stats(k, warps)
    sass, _ = cg.sass_of(k.asm["ptx"])
    st["loop"] = hot_loop(sass, marker)
    return st


def compile_mass(S, C, cfg, perm=True):
    from vc_compile.formats import QKQuant
    from vc_compile.kernels import anchor_mass as TA
    B, H, D = 1, 40, 128
    q8 = torch.zeros(B, H, S, D, dtype=torch.int8)
    qk = QKQuant(q8, torch.zeros(B, H, S), q8, torch.zeros(B, H, -(-S // 64)), torch.zeros(B, H, D), 0.1)
    sig = torch.zeros(B, H, S, dtype=torch.int64)
    cs.COMPILED.clear()
    prep = TA.PreparedQueries(torch.zeros(B * H, -(-S // (C * cfg.groups_per_program)) * C * cfg.groups_per_program,
                                          D, dtype=torch.int8), None, None, S, C, -(-S // C), 0, cfg.exp)
    prep.Sp = prep.q8s.shape[1]
    prep.a = prep.b = torch.zeros(B * H, prep.Sp)
    try:
        TA.mass_heads(prep, qk, 0, 12, key_perm=sig if perm else None, launch=cfg, mass_dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - host code after the (fake) launch
        print("note:", type(e).__name__, e)
    return [kk for name, kk in cs.COMPILED if name == "_mass_kernel"][-1]


def compile_topk(S, C, cfg, dtype):
    from vc_compile.kernels import topk as TK
    m = torch.zeros(1, 4, -(-S // C), -(-S // 64) * 64, dtype=dtype)[..., :S]  # rows padded as mass_heads does
    cs.COMPILED.clear()
    try:
        TK.select_topk(m, 4928, launch=cfg)
    except Exception as e:  # noqa: BLE001
        print("note:", type(e).__name__, e)
    return [kk for name, kk in cs.COMPILED if name == "_topk_kernel"][-1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--S", type=int, default=32760)
    p.add_argument("--C", type=int, default=128)
    p.add_argument("--json", action="store_true")
    p.add_argument("--dump", default=None, help="write PREFIX_<variant>.ttgir/.ptx")
    p.add_argument("--only", default="", help="'mass' or 'topk': compile only those kernels")
    a = p.parse_args(argv)
    cs._install()
    from vc_compile.kernels import configs as KC
    out = {}
    for exp in ("exact", "shift") if a.only != "topk" else ():
        for ng in sorted({max(1, 256 // a.C), max(1, 128 // a.C)}):
            cfg = KC.AnchorMassConfig(groups_per_program=ng, exp=exp)
            k = compile_mass(a.S, a.C, cfg)
            name = f"mass_c{a.C}_ng{ng}_{exp}"
            out[name] = stats(k, cfg.num_warps, "IGMMA")
            if a.dump:
                cs.dump_asm(k, f"{a.dump}_{name}")
    for dtype in (torch.bfloat16, torch.float32) if a.only != "mass" else ():
        for digit in (4, 8):
            cfg = KC.TopKConfig(digit=digit)
            k = compile_topk(a.S, a.C, cfg, dtype)
            name = f"topk_{str(dtype)[6:]}_d{digit}"
            out[name] = stats(k, cfg.num_warps, "POPC" if digit == 8 else "P2R")
            if a.dump:
                cs.dump_asm(k, f"{a.dump}_{name}")
    cs.print_loops(out, a.json)
    return out


if __name__ == "__main__":
    main()
