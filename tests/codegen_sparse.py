"""Compile the MC-Sparse gather kernel (``sparse_attn._sparse_attn_kernel``) for sm_90 WITHOUT a GPU and
print, per (C, launch config): registers and spills (ptxas -v), shared memory per CTA and the CTAs
that fit on an H200 SM, whether the gathered K/V rows go through cp.async (LDGSTS), how the loop's
wgmma waits sit (TTGIR), whether ptxas serialised the wgmmas (C7514 / C7515), and the SASS instruction mix of
the inner loop (the largest backward branch; both sides of an `if` in it are counted).

    PYTHONPATH=tests python -m codegen_sparse [--S 32760] [--C 64,128] [--configs 64/4/3,32/4/3]
        [--kv-off auto|0|1] [--json] [--dump PREFIX]

Same fake-driver warm-up compile as tests/codegen_stats.py (shapes of the benchmark: B = 1, H = 40,
D = 128, bf16, s = 0.15, residual epilogue on). Never run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter

import codegen_stats as cs  # (pops TRITON_INTERPRET, imports torch and triton)

import torch  # noqa: E402  (after codegen_stats)

SMEM_PER_SM, SMEM_PER_CTA_RESERVED, REGS_PER_SM = 228 * 1024, 1024, 65536
# SASS opcode classes of the loop mix
CLASSES = [("hgmma", ("HGMMA",)), ("warpgroup_sync", ("WARPGROUP", "WARPSYNC")), ("ldgsts", ("LDGSTS", "LDGDEPBAR")),
           ("depbar_bar", ("DEPBAR", "BAR", "SYNCS")), ("mufu", ("MUFU",)), ("fmul", ("FMUL",)), ("ffma", ("FFMA",)),
           ("fadd", ("FADD",)), ("fmnmx", ("FMNMX",)), ("fsetp_fsel", ("FSETP", "FSEL")),
           ("cvt", ("F2FP", "F2F", "I2F")),
           ("shfl", ("SHFL",)), ("lds_sts", ("LDS", "STS", "LDSM")), ("spill", ("STL", "LDL")),
           ("int_addr", ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "IABS", "ISETP", "SEL", "MOV", "R2UR", "UIADD3",
                         "UMOV", "ULEA", "UIMAD", "USHF", "ULOP3", "ISCADD", "PRMT", "S2R", "S2UR", "CS2R", "VIADD",
                         "LDC", "ULDC", "SGXT", "USGXT", "UISETP", "USEL")),
           ("branch", ("BRA", "BSSY", "BSYNC", "VOTE", "PLOP3"))]


def sass_of(ptx: str):
    """(SASS text, whether ptxas serialised the wgmmas: its C7514 / C7515 "Potential Performance Loss" notes)."""
    msg, sass = cs.ptxas(ptx)
    return sass, "are serialized" in msg  # C7514 / C7515 notes


def loop_mix(sass: str) -> dict:
    """Opcode classes between the target and the source of the longest backward branch (the key loop)."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for a, t in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and (best is None or a - int(m.group(1), 16) > best[1] - best[0]):
            best = (int(m.group(1), 16), a)
    if best is None:
        return {}
    body = [t for a, t in ins if best[0] <= a <= best[1]]
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    mix = {"instructions": len(body), **{name: 0 for name, _ in CLASSES}, "other": 0}
    other = Counter()
    for op, n in ops.items():  # the longest matching prefix decides (SHFL is not SHF)
        hits = [(len(pf), name) for name, pfs in CLASSES for pf in pfs if op.startswith(pf)]
        if hits:
            mix[max(hits)[1]] += n
        else:
            mix["other"] += n
            other[op] += n
    mix["other_ops"] = dict(other.most_common())
    return mix


def kernel_stats(k, warps: int) -> dict:
    st = cs.stats(k)
    smem = k.metadata.shared
    regs = max(st["registers"], 1)
    ctas_smem = SMEM_PER_SM // (smem + SMEM_PER_CTA_RESERVED)
    ctas_regs = REGS_PER_SM // ((regs + 7) // 8 * 8 * 32 * warps)
    ttgir = k.asm["ttgir"]
    loop = ttgir[ttgir.find("scf.for"):]
    sass, serialized = sass_of(k.asm["ptx"])
    return {"registers": st["registers"], "spill_bytes": st["spill_bytes"], "smem_bytes": smem,
            "ctas_per_sm": min(ctas_smem, ctas_regs), "ctas_by_smem": ctas_smem, "ctas_by_regs": ctas_regs,
            "async_copies_in_loop": loop.count("async_copy_global_to_local"),
            "wgmma_waits_in_loop": re.findall(r"warp_group_dot_wait[^{]*\{pendings = (\d+)", loop),
            "scf_if_in_loop": loop.count("scf.if"), "wgmma_serialized": serialized,
            "sass_ldgsts": sass.count("LDGSTS"), "loop": loop_mix(sass)}


def compile_one(S, C, cfg):
    from vc_compile.formats import n_keep
    from vc_compile.kernels import sparse_attn as tsa
    B, H, D = 1, 40, 128
    G, keep = -(-S // C), n_keep(S, 0.15)
    q = torch.empty(B, H, S, D, dtype=torch.bfloat16)
    sig = torch.empty(B, H, S, dtype=torch.int64)
    idx = torch.empty(B, H, G, keep, dtype=torch.int32)
    cs.COMPILED.clear()
    try:
        tsa.sparse_attention(q, q, q, sig, idx, sm_scale=D ** -0.5, group_size=C, residual=q, launch=cfg)
    except Exception:  # noqa: BLE001 - host code after the (fake) launch
        pass
    return [kk for name, kk in cs.COMPILED if name == "_sparse_attn_kernel"][-1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--S", type=int, default=32760)
    p.add_argument("--C", default="64,128")
    p.add_argument("--configs", default=None, help="BN/warps/stages,...; default: the shipped config per C")
    p.add_argument("--kv-off", choices=("auto", "0", "1"), default="auto",
                   help="SparseAttnConfig.kv_off (auto = the measured rule: on for C >= 128)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dump", default=None, help="write PREFIX_c<C>_<cfg>.ttgir/.ptx")
    a = p.parse_args(argv)
    cs._install()
    import dataclasses

    from vc_compile.kernels import configs as CF
    kv_off = None if a.kv_off == "auto" else a.kv_off == "1"
    out = {}
    for C in map(int, a.C.split(",")):
        cfgs = ([CF.SparseAttnConfig(*map(int, c.split("/"))) for c in a.configs.split(",")] if a.configs
                else [CF.sparse_default("bf16", 128, C)])
        for cfg in cfgs:
            cfg = dataclasses.replace(cfg, kv_off=kv_off)
            k = compile_one(a.S, C, cfg)
            name = f"c{C}_BN{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}" + ("" if kv_off is None else
                                                                                 f"_kv_off{int(kv_off)}")
            out[name] = kernel_stats(k, cfg.num_warps)
            if a.dump:
                cs.dump_asm(k, f"{a.dump}_{name}")
    cs.print_loops(out, a.json)
    return out


if __name__ == "__main__":
    main()
