"""Compile the Gluon sm_90 gather kernel (``kernels/sparse_attn_sm90.py``) for sm_90 WITHOUT a GPU and print,
per (C, launch config): registers and spills (ptxas -v), shared memory per CTA and CTAs per H200 SM, whether
ptxas serialised the wgmmas (C7514 / C7515), and per warp-specialised partition the SASS of its key loop: the
consumers' loop (the backward branch around an HGMMA: its instruction mix, HGMMAs with a register A operand,
shared-memory traffic, warpgroup waits) and the producer's loop (cp.async LDGSTS, mbarrier arrivals).

    PYTHONPATH=tests python -m codegen_sparse_sm90 [--S 32760] [--density 0.15] [--C 64,128] [--configs 128/2,64/3]
        [--off64] [--qk8] [--json] [--dump PREFIX]

Same fake-driver warm-up compile as tests/codegen_stats.py (B = 1, H = 40, D = Dv = 128, bf16, residual and
flag epilogue on, n_keep from the density). Never run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import codegen_sparse as csp  # (pops TRITON_INTERPRET, imports torch and triton)
import codegen_stats as cs

import torch  # noqa: E402  (after codegen_stats)

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_SETMAXREG = re.compile(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)")  # the partitions' register counts


def _op(t: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]


def compile_one(S, C, cfg, density=0.15, D=128, flag=True, residual=True, qk8=False, compact=False):
    from vc_compile.formats import n_keep
    from vc_compile.kernels import sparse_attn_sm90 as g
    B, H = 1, 40
    G, keep = -(-S // C), n_keep(S, density)
    q = torch.empty(B, H, S, D, dtype=torch.bfloat16)
    sig = torch.empty(B, H, S, dtype=torch.int64)
    # compact: MC-Sparse's default metadata (16-bit numbers of 8-key runs, an int8 residual with per-token scales)
    idx = (torch.empty(B, H, G, keep // 8, dtype=torch.int16) if compact
           else torch.empty(B, H, G, keep, dtype=torch.int32))
    res = torch.empty(B, H, S, D, dtype=torch.int8) if compact else q
    extra = dict(run=8, res_scale=torch.empty(B, H, S)) if compact and residual else {}
    fl = torch.empty(B, H, D, dtype=torch.int32) if flag else None
    cs.COMPILED.clear()
    try:
        k = torch.empty(B, H, S, D, dtype=torch.int8) if qk8 else q
        g.sparse_attention_sm90(q, k, q, sig, idx, sm_scale=D ** -0.5, group_size=C, residual=res if residual else None,
                                flag=fl, launch=cfg, k_scale=torch.empty(B, H) if qk8 else None, **extra)
    except Exception:  # noqa: BLE001 - host code after the (fake) launch
        pass
    return [k for name, k in cs.COMPILED if name == "_sparse_attn_sm90_kernel"][-1]


def loops(sass: str) -> list:
    """Every backward branch's body (target .. branch) as a list of instructions, innermost first; instructions
    predicated off for good (``@!PT``: ptxas's placeholders, e.g. ``@!PT LDS RZ, [RZ]`` before a fence) are left
    out."""
    ins = [(int(a, 16), t.strip()) for a, t in _INS.findall(sass) if not t.strip().startswith("@!PT ")]
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA \S*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            out.append([x for _, x in ins[at[int(m.group(1), 16)]:i + 1]])
    return sorted(out, key=len)


def mix(body: list) -> dict:
    """The instruction classes of ``tests/codegen_sparse.py`` over one loop body, and the other opcodes."""
    ops = Counter(_op(t).split(".")[0] for t in body)
    out = {"instructions": len(body), **{name: 0 for name, _ in csp.CLASSES}, "other": 0}
    other = Counter()
    for op, n in ops.items():
        hits = [(len(pf), name) for name, pfs in csp.CLASSES for pf in pfs if op.startswith(pf)]
        if hits:
            out[max(hits)[1]] += n
        else:
            out["other"] += n
            other[op] += n
    out["other_ops"] = dict(other.most_common())
    return out


def consumer_loop(sass: str) -> dict:
    """The shortest loop around an HGMMA (a consumer's key loop; the two consumers compile to two copies)."""
    cands = [b for b in loops(sass) if any(_op(x).startswith("HGMMA") for x in b)]
    if not cands:
        return {"found": False}
    body = cands[0]
    hg = [x for x in body if _op(x).startswith("HGMMA")]
    return {"found": True, "copies": len(cands), **mix(body),
            # PV takes P from registers: HGMMA with a register A operand ("R..., gdesc")
            "hgmma_register_a": sum(1 for x in hg if re.search(r"HGMMA\S* R\d+, R\d+, gdesc", x)),
            "hgmma_smem_a": sum(1 for x in hg if re.search(r"HGMMA\S* R\d+, gdesc", x)),
            # the 8-bit QK variant: QK as IGMMA (S8 x S8 -> S32, k = 32), Q from shared memory
            "igmma_smem_a": sum(1 for x in body if re.search(r"IGMMA\S* R\d+, gdesc", x)),
            "warpgroup_waits": sum(1 for x in body if _op(x).startswith("WARPGROUP.DEPBAR")),
            "sts": sum(1 for x in body if _op(x).startswith("STS")),
            "lds": sum(1 for x in body if _op(x).startswith("LDS")),
            "local_memory": sum(1 for x in body if _op(x).startswith(("LDL", "STL"))),
            "mufu_ex2": sum(1 for x in body if _op(x).startswith("MUFU.EX2")),
            "bar_sync": sum(1 for x in body if _op(x).startswith("BAR.SYNC")), **issue_order(body),
            **overlap_order(body)}


def _marks(body: list) -> tuple:
    """Positions in a consumer block of PV's HGMMAs (register A operand), QK's (shared-memory A), the waits that
    leave one group in flight (``DEPBAR.LE gsb0, 0x1``) and none (``0x0``), and the MUFU.EX2s."""
    at = lambda pat: [i for i, x in enumerate(body) if re.search(pat, x)]  # noqa: E731
    return (at(r"HGMMA\S* R\d+, R\d+, gdesc"), at(r"[HI]GMMA\S* R\d+, gdesc"), at(r"DEPBAR\.LE gsb0, 0x1\b"),
            at(r"DEPBAR\.LE gsb0, 0x0\b"), at(r"MUFU\.EX2"))


def overlap_order(body: list) -> dict:
    """The ``overlap`` order (FlashAttention-3's): S_j's HGMMAs (shared-memory A) issued before PV_{j-1}'s
    (register A), then the wait that leaves PV_{j-1} in flight (``DEPBAR.LE gsb0, 0x1``), the softmax's exp2
    while it runs, then the wait for PV_{j-1} (``0x0``). ``softmax_during_pv``: the share of MUFU.EX2 between
    the two waits."""
    pv, qk, w1, w0, ex2 = _marks(body)
    if not (pv and qk and w1 and w0 and ex2):
        return {"overlap_order_ok": False, "softmax_during_pv": 0.0}
    return {"overlap_order_ok": max(qk) < min(pv) and max(pv) < min(w1) < min(w0),
            "softmax_during_pv": round(sum(min(w1) < i < min(w0) for i in ex2) / len(ex2), 3)}


def issue_order(body: list) -> dict:
    """Whether the consumer's block runs in the intended order: the softmax (MUFU.EX2) before PV_j's first HGMMA
    (register A operand), then S_{j+1}'s HGMMAs (shared-memory A), then the wait that leaves one group in flight
    (``DEPBAR.LE gsb0, 0x1``: PV_j done, S_{j+1} running), then the wait for S_{j+1} (``0x0``)."""
    pv, qk, w1, w0, ex2 = _marks(body)
    if not (pv and qk and w1 and w0 and ex2):
        return {"order_ok": False, "softmax_before_pv": 0.0}
    return {"order_ok": max(pv) < min(qk) and max(qk) < min(w1) < min(w0),
            # ptxas may sink the two row-rescale exponents below the MMA issue; the scores' exp2 stay above it
            "softmax_before_pv": round(sum(i < min(pv) for i in ex2) / len(ex2), 3)}


def producer_loop(sass: str) -> dict:
    """The shortest loop with cp.async (LDGSTS) in it: the producer's per-block body."""
    cands = [b for b in loops(sass) if any(_op(x).startswith("LDGSTS") for x in b)]
    if not cands:
        return {"found": False}
    body = cands[0]
    return {"found": True, **mix(body), "ldgsts": sum(1 for x in body if _op(x).startswith("LDGSTS")),
            "arrives": sum(1 for x in body if "ARRIVE" in _op(x)),
            "local_memory": sum(1 for x in body if _op(x).startswith(("LDL", "STL")))}


def kernel_stats(k) -> dict:
    st = cs.stats(k)
    smem = k.metadata.shared
    sass, serialized = csp.sass_of(k.asm["ptx"])
    return {"registers": st["registers"], "spill_bytes": st["spill_bytes"], "smem_bytes": smem,
            "ctas_per_sm": csp.SMEM_PER_SM // (smem + csp.SMEM_PER_CTA_RESERVED), "wgmma_serialized": serialized,
            "setmaxnreg": sorted({int(x, 16) for x in _SETMAXREG.findall(sass)}),
            "consumer": consumer_loop(sass), "producer": producer_loop(sass)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--S", type=int, default=32760)
    p.add_argument("--density", type=float, default=0.15)
    p.add_argument("--C", default="64,128")
    p.add_argument("--configs", default=None, help="BN/stages,...; default: the kernel's default per C")
    p.add_argument("--off64", action="store_true", help="force the 64-bit offset path (OFF64, for Sk * stride >= 2^31)")
    p.add_argument("--qk8", action="store_true", help="the 8-bit QK variant (int8 K codes, one scale a head)")
    p.add_argument("--compact", action="store_true",
                   help="MC-Sparse's default metadata: int16 numbers of 8-key runs, an int8 residual with its scales")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dump", default=None, help="write PREFIX_c<C>_<cfg>.ttgir/.ptx/.sass")
    a = p.parse_args(argv)
    cs._install()
    from vc_compile.kernels import configs as CF
    if a.off64:
        from vc_compile.kernels import sparse_attn_sm90 as g
        g.needs_64bit_offsets = lambda *extents: True
    out = {}
    for C in map(int, a.C.split(",")):
        cfgs = ([CF.SparseAttnSm90Config.from_spec(c) for c in a.configs.split(",")] if a.configs
                else [CF.sparse_sm90_default(C)])
        for cfg in cfgs:
            k = compile_one(a.S, C, cfg, a.density, qk8=a.qk8, compact=a.compact)
            flags = "".join(f for f, n in cfg.SPEC_FLAGS.items() if getattr(cfg, n))
            name = (f"c{C}_BN{cfg.block_n}_s{cfg.stages}{flags}" + ("_off64" if a.off64 else "")
                    + ("_qk8" if a.qk8 else "") + ("_runs8" if a.compact else ""))
            out[name] = kernel_stats(k)
            if a.dump:
                cs.dump_asm(k, f"{a.dump}_{name}")
                with open(f"{a.dump}_{name}.sass", "w") as f:
                    f.write(csp.sass_of(k.asm["ptx"])[0])
    if a.json:
        print(json.dumps(out))
    else:
        for name, st in out.items():
            cons, prod = st.pop("consumer"), st.pop("producer")
            print(f"{name}: {st}\n    consumer loop: {cons}\n    producer loop: {prod}")
    return out


if __name__ == "__main__":
    main()
