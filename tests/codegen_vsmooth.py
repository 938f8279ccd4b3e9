"""Compile the Gluon sm_90 V-Smooth kernel (``kernels/vsmooth_attn_sm90.py``) for sm_90 WITHOUT a GPU and
print per variant: registers and spills (ptxas -v), shared memory and CTAs per H200 SM, and how the key
loop overlaps the MMAs with the softmax. Shared-memory P~ (the default): the SASS between the loop's
``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (S_j ready, PV_{j-1} still running) and its ``0x0`` wait (PV_{j-1} done)
must hold the softmax (MUFU.EX2 or the ExpCast FMNMX clamps); a compiler that sinks the softmax below the
PV wait serialises the loop again (it did, before the softmax results were passed through the wait: 31
instructions in the window). Register P~ (``p_operand="registers"``): in the key loop both MMAs are issued
after the softmax and PV takes P~ from registers (``QGMMA ... R, gdesc``), with no P~ stores to shared
memory.

    PYTHONPATH=tests python -m codegen_vsmooth [--S 32760] [--json]

Same fake-driver warm-up compile as tests/codegen_stats.py (B = 1, H = 40). Never run under
TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import codegen_sparse as csp  # (pops TRITON_INTERPRET, imports torch and triton)
import codegen_stats as cs

import torch  # noqa: E402  (after codegen_stats)

from vc_compile.kernels.configs import (MeanTerm, POperand, RowSum, VSmoothSm90Config,  # noqa: E402
                                          vsmooth_sm90_default)

_REG = dict(p_operand=POperand.REGISTERS)
_MS = dict(rowsum=RowSum.MMA, mean=MeanTerm.TF32_WINDOW)
VARIANTS = {  # name: (head dim, expcast, mean, launch config: None = the kernel's default at --S)
    "d128_exp2": (128, False, True, None), "d128_expcast": (128, True, True, None),
    "d128_naive": (128, False, False, None), "d64_exp2": (64, False, True, None),
    "d64_expcast": (64, True, True, None),
    # V-Smooth's long-head default before MS: warp-specialised register P~, row sums on the ALUs
    "d128_exp2_ws": (128, False, True, VSmoothSm90Config(**_REG, warp_specialize=True)),
    "d128_exp2_preg": (128, False, True, VSmoothSm90Config(**_REG)),  # register P~, no warp specialisation
    "d128_expcast_smem": (128, True, True, VSmoothSm90Config()),  # shared-memory P~ (the A/B baseline)
    "d128_expcast_ws": (128, True, True, VSmoothSm90Config(**_REG, warp_specialize=True)),
    "d64_expcast_preg": (64, True, True, VSmoothSm90Config(**_REG)),  # the D = 64 default below 6144 rows
    "d128_exp2_ms_nows": (128, False, True, VSmoothSm90Config(**_REG, **_MS)),  # MS without warp specialisation
}


def compile_one(S, D, expcast, mean, config=None):
    from vc_compile.formats import QKQuant, VQuant
    from vc_compile.kernels import vsmooth_attn_sm90 as g
    B, H, S_pad = 1, 40, -(-S // 128) * 128
    q8 = torch.empty(B, H, S, D, dtype=torch.int8)
    vm = torch.empty(B, H, S_pad // 128, D)
    qk = QKQuant(q8, torch.empty(B, H, S), q8, torch.empty(B, H, -(-S // 64)), torch.empty(B, H, D), D ** -0.5)
    vq = VQuant(torch.empty(B, H, D, S_pad, dtype=torch.float8_e4m3fn), torch.empty(B, H, D), vm, S,
                zero_mean=not mean)
    cs.COMPILED.clear()
    try:
        g.vsmooth_attention_sm90(qk, vq, expcast=expcast, launch=config or vsmooth_sm90_default(D, expcast, S))
    except Exception:  # noqa: BLE001 - host code after the (fake) launch
        pass
    return [k for name, k in cs.COMPILED if name.startswith("_vsmooth_attn_sm90")][-1]


def overlap_window(sass: str) -> dict:
    """Opcode counts between the first ``DEPBAR.LE gsb0, 0x1`` and the next ``0x0`` wait (the key loop)."""
    ins = [t.strip() for t in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    try:
        lo = next(i for i, t in enumerate(ins) if re.search(r"DEPBAR\.LE gsb0, 0x1\b", t))
    except StopIteration:
        return {"found": False}
    hi = next((i for i in range(lo + 1, len(ins)) if re.search(r"DEPBAR\.LE gsb0, 0x0\b", ins[i])), len(ins))
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in ins[lo:hi])
    return {"found": True, "instructions": hi - lo, "mufu_ex2": ops.get("MUFU.EX2", 0),
            "fmnmx": sum(n for op, n in ops.items() if op.startswith("FMNMX")),
            "sts": sum(n for op, n in ops.items() if op.startswith("STS"))}


def key_loops(sass: str) -> list:
    """Every innermost key loop (a backward branch around a QK IGMMA, under 1500 instructions): a list of
    instruction lists. Register-P~ ExpCast kernels have two per consumer (the byte-mask clamp and the FMNMX clamp,
    chosen per program by ``bytemask_ok``)."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA \S*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = [x for _, x in ins[at[int(m.group(1), 16)]:i + 1]]
            if any("IGMMA" in x for x in body) and len(body) < 1500:
                out.append(body)
    return out


def loop_stats(sass: str) -> dict:
    """Local-memory (spill) instructions inside the key loops, and the FMNMX count of the shortest loop and the
    largest over the loops (ExpCast: the row max 64 + its tree, + 64 clamps unless the byte mask packs the clamp)."""
    loops = key_loops(sass)
    op = lambda x: re.sub(r"^@!?U?P\w+\s+", "", x).split()[0]  # noqa: E731
    return {"key_loops": len(loops),
            "loop_local_memory": sum(1 for b in loops for x in b if op(x).startswith(("LDL", "STL"))),
            "fmnmx_shortest_loop": sum(1 for x in min(loops, key=len) if op(x).startswith("FMNMX")) if loops else -1,
            "fmnmx_most": max((sum(1 for x in b if op(x).startswith("FMNMX")) for b in loops), default=-1)}


def register_p_loop(sass: str) -> dict:
    """Order of the MMAs and the softmax in the key loop (the backward branch around a QK IGMMA) of a
    register-P~ kernel: the next block's IGMMA, then the softmax, then a QGMMA with a register A operand."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    loop = None
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA \S*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = [x for _, x in ins[at[int(m.group(1), 16)]:i + 1]]
            if any("IGMMA" in x for x in body) and (loop is None or len(body) < len(loop)):
                loop = body
    if loop is None:
        return {"found": False}
    soft = [k for k, x in enumerate(loop) if "MUFU.EX2" in x or re.sub(r"^@!?U?P\w+\s+", "", x).startswith("FMNMX")]
    ig = max(k for k, x in enumerate(loop) if "IGMMA" in x)  # the last QK instruction of the next block
    qg = [k for k, x in enumerate(loop) if re.search(r"QGMMA\S* R\d+, R\d+, gdesc", x)]
    op = lambda x: re.sub(r"^@!?U?P\w+\s+", "", x).split()[0]  # noqa: E731
    return {"found": True, "instructions": len(loop),
            # share of the softmax (exp2 or ExpCast clamps) issued after the next block's QK MMA
            "softmax_after_qk": round(sum(k > ig for k in soft) / max(len(soft), 1), 3),
            # PV from registers after (at least 97% of) the softmax: ptxas may sink the two row-rescale exponents
            # exp2(m_old - m_new), needed only by the fold, below the MMA issue (MS)
            "pv_from_registers_after_softmax": bool(qg) and bool(soft) and sum(k < min(qg) for k in soft)
            >= 0.97 * len(soft),
            "sts": sum(1 for x in loop if op(x).startswith("STS")),
            "lds": sum(1 for x in loop if op(x).startswith("LDS")),
            # MS: the row-sum MMA (N = 8) and the mean term's tf32 MMAs in the loop; no fp16 row sum (unpacks)
            "rowsum_mma": sum(1 for x in loop if op(x).startswith("QGMMA.64x8x32")),
            "tf32_mma": sum(1 for x in loop if op(x).startswith("HGMMA") and "TF32" in op(x)),
            "fp8_unpack": sum(1 for x in loop if op(x).startswith("F2FP.F16.E4M3.UNPACK"))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--S", type=int, default=32760)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    cs._install()
    out = {}
    for name, (D, expcast, mean, config) in VARIANTS.items():
        k = compile_one(a.S, D, expcast, mean, config)
        st = csp.kernel_stats(k, k.metadata.num_warps)
        sass, _ = csp.sass_of(k.asm["ptx"])
        out[name] = {key: st[key] for key in ("registers", "spill_bytes", "smem_bytes", "ctas_per_sm",
                                              "wgmma_serialized")}
        cfg = config or vsmooth_sm90_default(D, expcast, a.S)
        out[name]["register_p"] = cfg.p_operand == POperand.REGISTERS
        out[name]["ms"] = int(cfg.mma_sums)
        out[name]["mean"] = mean
        # ptxas's F2FP...PACK_AB_MERGE_C with a live C operand: every register-P~ exp2 compile that had these
        # returned wrong or NaN rows on the H200 (docs/design/e4m3x4-packing.md); e4m3x4 packs P~ so that none appear
        out[name]["f2fp_merge_chained"] = len(re.findall(r"PACK_AB_MERGE_C R\d+, R\d+, R\d+, R\d+", sass))
        out[name]["window"] = register_p_loop(sass) if out[name]["register_p"] else overlap_window(sass)
        out[name].update(loop_stats(sass))
        out[name]["byte_mask"] = bool(expcast and out[name]["register_p"] and cfg.byte_mask)
    if a.json:
        print(json.dumps(out))
    else:
        for name, st in out.items():
            print(f"{name}: {st}")


if __name__ == "__main__":
    main()
