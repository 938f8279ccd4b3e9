"""SASS fingerprints of every kernel configuration a default or a tuner candidate can launch, compiled for
sm_90 WITHOUT a GPU (the fake-driver warm-up compile of tests/codegen_stats.py): per case and kernel the
SHA-256 of the SASS instruction stream (kernel name stripped), its length and the length of the key loop
(the longest backward branch). Two runs that print the same fingerprints compiled to the same machine code.

    PYTHONPATH=tests python -m codegen_fingerprint --out before.json [--only gluon,triton,sparse,pre,aux]
    PYTHONPATH=tests python -m codegen_fingerprint --compare before.json after.json

Used for the kernel-layer redesign: "speed unchanged" checked as "same SASS" for every default.
Never run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time

import codegen_sparse as csp  # (pops TRITON_INTERPRET, imports torch and triton)
import codegen_stats as cs

import torch  # noqa: E402  (after codegen_stats)

S_MAIN = 32760  # the benchmark's length: a key tail, S not a multiple of 16
FMNMX = "_fmnmx"  # a case's suffix for the build the byte-mask guard falls back to


def _loops(ins):
    """The bodies of every loop (a backward branch to an earlier instruction), branch targets normalised: the
    steady state of the kernel, to tell a change there from one in the prologue / epilogue."""
    bodies = []
    last_exit = max((i for i, t in enumerate(ins) if re.search(r"\bEXIT\b", t)), default=len(ins))
    for i, t in enumerate(ins[:last_exit]):  # (after the last EXIT: stubs that branch back into the body)
        m = re.search(r"BRA\s+0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) // 16 < i:
            bodies.append("\n".join(re.sub(r"0x[0-9a-f]+", "ADDR", x) if "BRA" in x else x
                                    for x in ins[int(m.group(1), 16) // 16:i + 1]))
    return bodies


def fingerprint(k) -> dict:
    sass, serialized = csp.sass_of(k.asm["ptx"])
    name = k.name if hasattr(k, "name") else ""
    ins = [t.strip() for t in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    if name:
        ins = [t.replace(name, "<kernel>") for t in ins]
    loop = csp.loop_mix(sass).get("instructions", 0)
    loops = _loops(ins)
    st = cs.stats(k)
    out = {"sha": hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16], "n": len(ins), "loop": loop,
           "registers": st["registers"], "spill_bytes": st["spill_bytes"],
           "loops_sha": hashlib.sha256("\n--\n".join(sorted(set(loops))).encode()).hexdigest()[:16],
           "serialized": serialized, "shared": k.metadata.shared}
    if "sparse_attn_sm90" in name:  # the gather kernel's two partitions' key loops
        import codegen_sparse_sm90 as cg
        ks = cg.kernel_stats(k)
        out["consumer_loop"] = ks["consumer"].get("instructions", 0)
        out["producer_loop"] = ks["producer"].get("instructions", 0)
    elif "sm90" in name:  # the Gluon kernel's key-loop windows (tests/codegen_vsmooth.py)
        import codegen_vsmooth as cv
        rp, ow = cv.register_p_loop(sass), cv.overlap_window(sass)
        out["preg_loop"] = rp.get("instructions", 0) if rp.get("found") else 0
        out["smem_window"] = ow.get("instructions", 0) if ow.get("found") else 0
    return out


def _run(fn):
    cs.COMPILED.clear()
    try:
        fn()
    except Exception:  # noqa: BLE001 - host code after the (fake) launches may trip on empty CPU tensors
        pass
    return list(cs.COMPILED)


# ---- the cases (through the current API) ----------------------------------------------------------------
def _vs_inputs(S, D, mean, fp8=False):
    from vc_compile.formats import QKQuant, VQuant
    B, H, S_pad = 1, 40, -(-S // 128) * 128
    q8 = torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn if fp8 else torch.int8)
    vm = torch.empty(B, H, S_pad // 128, D)
    qk = QKQuant(q8, torch.empty(B, H, S), q8, torch.empty(B, H, -(-S // 64)), torch.empty(B, H, D), D ** -0.5)
    try:
        vq = VQuant(torch.empty(B, H, D, S_pad, dtype=torch.float8_e4m3fn), torch.empty(B, H, D), vm, S,
                    not mean)
    except TypeError:  # 4f44cc9: the zero-mean flag was a tensor attribute
        vq = VQuant(torch.empty(B, H, D, S_pad, dtype=torch.float8_e4m3fn), torch.empty(B, H, D), vm, S)
        if not mean:
            vm._vc_zero_mean = True
    return qk, vq


def gluon_cases():
    try:  # the redesign
        from vc_compile.kernels import configs as C
        table = {(D, e): (C.VSMOOTH_SM90_SHORT[(D, e)], C.VSMOOTH_SM90_LONG[(D, e)][1])
                 for D in (64, 128) for e in (False, True)}

        def launch(qk, vq, D, e, which, lse, out_dtype, over=None):
            import dataclasses

            from vc_compile.kernels import vsmooth_attn_sm90 as g
            g.vsmooth_attention_sm90(qk, vq, expcast=e, launch=dataclasses.replace(table[(D, e)][which], **(over or {})),
                                     return_lse=lse, out_dtype=out_dtype)
    except ImportError:  # 4f44cc9
        from vc_compile.kernels import vsmooth_attn_sm90 as g
        table = {k: (g.DEFAULT_CONFIG[k], g.LONG_CONFIG[k][1]) for k in g.DEFAULT_CONFIG}

        def launch(qk, vq, D, e, which, lse, out_dtype, over=None):
            if over:
                raise NotImplementedError("launch overrides need the redesign's configs")
            g.vsmooth_attention_sm90(qk, vq, expcast=e, config=table[(D, e)][which], return_lse=lse,
                                     out_dtype=out_dtype)
    out = []
    for D in (128, 64):
        for e in (False, True):
            for mean in (True, False):
                for which in (0, 1):
                    out.append((f"gluon_d{D}_{'expcast' if e else 'exp2'}_{'mean' if mean else 'naive'}_"
                                f"{'long' if which else 'short'}", (32760, D, e, mean, which, False, None)))
    for which in (0, 1):
        out.append((f"gluon_d128_exp2_mean_{'long' if which else 'short'}_S32768", (32768, 128, False, True, which,
                                                                                   False, None)))
        out.append((f"gluon_d128_expcast_mean_{'long' if which else 'short'}_S32768", (32768, 128, True, True, which,
                                                                                      False, None)))
        out.append((f"gluon_d128_exp2_mean_{'long' if which else 'short'}_lse", (32760, 128, False, True, which,
                                                                                True, None)))
    out.append(("gluon_d128_exp2_mean_long_f32", (32760, 128, False, True, 1, False, torch.float32)))
    # what the byte-mask guard (vsmooth_attn_sm90.BytemaskGuard) runs where a byte-mask build spills: the FMNMX clamp
    for S, tag in ((32760, ""), (32768, "_S32768")):
        out.append((f"gluon_d128_expcast_mean_long{tag}{FMNMX}", (S, 128, True, True, 1, False, None,
                                                                 {"byte_mask": False})))

    def make(args):
        S, D, e, mean, which, lse, od = args[:7]

        def fn():
            qk, vq = _vs_inputs(S, D, mean)
            launch(qk, vq, D, e, which, lse, od or torch.bfloat16, *args[7:])
        return fn
    return [(n, make(a)) for n, a in out]


def triton_cases():
    from vc_compile.kernels import vsmooth_attn as tva
    try:
        from vc_compile.kernels import configs as C
        cands = {k: list(v) for k, v in C.VSMOOTH_TRITON_CANDIDATES.items()}

        def launch(qk, vq, e, cfg):
            tva.vsmooth_attention(qk, vq, expcast=e, launch=cfg)

        def label(cfg):
            return (f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}_rs{int(cfg.rowsum.code)}"
                    f"_mean{int(cfg.mean.code)}")
    except ImportError:
        cands = {k: [tva.as_config(v) for v in vs] for k, vs in tva.CANDIDATES.items()}

        def launch(qk, vq, e, cfg):
            tva.vsmooth_attention(qk, vq, expcast=e, config=cfg)

        def label(c):
            return f"{c['BM']}x{c['BN']}w{c['num_warps']}s{c['num_stages']}_rs{c['ROWSUM']}_mean{c['MEAN']}"
    out = []
    for (D, e), cs_ in sorted(cands.items()):
        for i, cfg in enumerate(cs_):
            for fp8 in (False, True):
                for mean in ((True, False) if i == 0 and not fp8 else (True,)):
                    name = (f"triton_d{D}_{'expcast' if e else 'exp2'}_{'fp8' if fp8 else 'int8'}_"
                            f"{'mean' if mean else 'naive'}_{label(cfg)}")

                    def fn(D=D, e=e, cfg=cfg, fp8=fp8, mean=mean):
                        qk, vq = _vs_inputs(S_MAIN, D, mean, fp8)
                        launch(qk, vq, e, cfg)
                    out.append((name, fn))
    return out


def sparse_cases():
    from vc_compile.kernels import sparse_attn as tsa
    try:
        from vc_compile.kernels import configs as C
        swept = [(c.block_n, c.num_warps, c.num_stages) for c in C.SPARSE_SWEPT]

        def default(fmt, D, Cg):
            c = C.sparse_default(fmt, D, Cg)
            return c.block_n, c.num_warps, c.num_stages

        def launch(q, k, v, sig, idx, D, Cg, cfg, fmt, res):
            tsa.sparse_attention(q, k, v, sig, idx, sm_scale=D ** -0.5, group_size=Cg, residual=res,
                                 qk_format=fmt, launch=C.SparseAttnConfig(*cfg))
    except ImportError:
        swept = list(tsa.SWEPT)

        def default(fmt, D, Cg):
            return tsa.default_config(fmt, D, Cg)

        def launch(q, k, v, sig, idx, D, Cg, cfg, fmt, res):
            tsa.sparse_attention_launch(q, k, v, sig, idx, sm_scale=D ** -0.5, group_size=Cg, residual=res,
                                        qk_format=fmt, config=cfg)
    cases = [("bf16", 128, 128, c, True) for c in swept]
    cases += [(fmt, D, Cg, default(fmt, D, Cg), True) for fmt in ("bf16", "fp8") for D, Cg in
              ((128, 64), (64, 64), (64, 128)) + (((128, 128),) if fmt == "fp8" else ())]
    cases += [(fmt, 128, 128, default(fmt, 128, 128), False) for fmt in ("bf16", "fp8")]
    out = []
    for fmt, D, Cg, cfg, res in cases:
        def fn(fmt=fmt, D=D, Cg=Cg, cfg=cfg, res=res):
            from vc_compile.formats import n_keep
            B, H, S = 1, 40, S_MAIN
            q = torch.empty(B, H, S, D, dtype=torch.bfloat16)
            sig = torch.empty(B, H, S, dtype=torch.int64)
            idx = torch.empty(B, H, -(-S // Cg), n_keep(S, 0.15), dtype=torch.int32)
            launch(q, q, q, sig, idx, D, Cg, cfg, fmt, q if res else None)
        out.append((f"sparse_{fmt}_d{D}_c{Cg}_BN{cfg[0]}w{cfg[1]}s{cfg[2]}_res{int(res)}", fn))

    def runs8(Cg=128):  # MC-Sparse's default metadata: int16 numbers of 8-key runs, an int8 residual
        from vc_compile.formats import n_keep
        B, H, S, D = 1, 40, S_MAIN, 128
        q = torch.empty(B, H, S, D, dtype=torch.bfloat16)
        idx = torch.empty(B, H, -(-S // Cg), n_keep(S, 0.15) // 8, dtype=torch.int16)
        tsa.sparse_attention(q, q, q, torch.empty(B, H, S, dtype=torch.int32), idx, sm_scale=D ** -0.5, group_size=Cg,
                             residual=torch.empty(B, H, S, D, dtype=torch.int8), res_scale=torch.empty(B, H, S),
                             run=8, launch=C.sparse_default("bf16", D, Cg))
    out.append(("sparse_bf16_d128_c128_runs8_res1", runs8))
    return out


def pre_cases():
    from vc_compile import formats
    from vc_compile.kernels import preprocess as tpre
    H, D, S = 40, 128, S_MAIN
    out = []
    for form, full in (("interleaved", False), ("interleaved", True), ("rotate-half", True), (None, False)):
        def fn(form=form, full=full):
            q = torch.empty(1, S, H, D, dtype=torch.bfloat16)
            spec = formats.RopeSpec(form or "interleaved", "BSHD", H, None, None)
            qb = formats.to_bhsd(q, spec)
            Dc = D if full else D // 2
            ra = None if form is None else formats.rope_args(torch.empty(1, S, 1, Dc), torch.empty(1, S, 1, Dc), spec,
                                                       tuple(qb.shape))
            tpre.preprocess_qk(qb, qb, None, sm_scale=D ** -0.5, rope=ra)
        out.append((f"pre_qk_{form or 'norope'}{'_full' if full else ''}", fn))
    for had, fmt, perm in ((True, "int8", True), (False, "fp8", True), (False, "int8", True)):
        def fn(had=had, fmt=fmt, perm=perm):
            q = torch.empty(1, H, S, D, dtype=torch.bfloat16)
            p = torch.empty(1, H, S, dtype=torch.int64) if perm else None
            tpre.preprocess_qk(q, q, p, sm_scale=D ** -0.5, hadamard=had, qk_format=fmt)
        out.append((f"pre_qk_had{int(had)}_{fmt}_perm{int(perm)}", fn))
    for smooth in (True, False):
        def fn(smooth=smooth):
            v = torch.empty(1, H, S, D, dtype=torch.bfloat16)
            tpre.preprocess_v(v, torch.empty(1, H, S, dtype=torch.int64), smooth=smooth)
        out.append((f"pre_v_smooth{int(smooth)}", fn))
    return out


def aux_cases():
    out = []

    def km():
        from vc_compile.kernels import kmeans as tkm
        tkm.kmeans_perm(torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16), 32, 1)
    out.append(("kmeans", km))

    def mass():
        from vc_compile.kernels import select as tsel
        q = torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16)
        tsel.group_key_mass(q, q, torch.zeros(1, 8, 4096, dtype=torch.int64), torch.zeros(1, 8, 4096),
                            sm_scale=0.1, group_size=128)
    out.append(("group_mass", mass))

    def kq():
        from vc_compile.kernels import sparse_attn as tsa
        tsa.quantize_k_fp8(torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16))
    out.append(("quant_k_fp8", kq))

    def pd():
        from vc_compile.kernels import pddp as tp
        tp.pddp_perm(torch.randn(1, 2, 4096, 128, dtype=torch.bfloat16), 128)
    out.append(("pddp", pd))
    return out


def sm90_sparse_cases():
    """The Gluon gather kernel: its default per group size, the 8-bit QK variant, the 64-bit offset path."""
    import codegen_sparse_sm90 as cg
    from vc_compile.kernels import configs as C
    out = []
    for Cg, qk8 in ((64, False), (128, False), (128, True)):
        out.append((f"sm90_sparse_c{Cg}{'_qk8' if qk8 else ''}",
                    lambda Cg=Cg, qk8=qk8: cg.compile_one(S_MAIN, Cg, C.sparse_sm90_default(Cg), qk8=qk8)))
    for Cg in (64, 128):  # MC-Sparse's default metadata: int16 numbers of 8-key runs, an int8 residual
        out.append((f"sm90_sparse_c{Cg}_runs8",
                    lambda Cg=Cg: cg.compile_one(S_MAIN, Cg, C.sparse_sm90_default(Cg), compact=True)))
    return out


def anchor_cases():
    """The anchor step's kernels: the 8-bit group-key mass (its defaults per group size, both exponent modes) and
    the radix top-K, the finiteness flags with and without the sampled-row probe, the gather kernel's K quantisers."""
    import codegen_anchor as ca
    from vc_compile.kernels import configs as C
    out = [(f"mass_c{Cg}_{exp.value}", lambda Cg=Cg, exp=exp: ca.compile_mass(S_MAIN, Cg, C.anchor_mass_default(Cg, exp)))
           for Cg in (64, 128) for exp in (C.ExpMode.SHIFT, C.ExpMode.EXACT)]
    out += [(f"topk_{str(dt)[6:]}", lambda dt=dt: ca.compile_topk(S_MAIN, 128, C.TOPK_DEFAULT, dt))
            for dt in (torch.bfloat16, torch.float32)]

    def flags(probe):
        from vc_compile.kernels import finite_flags as tff
        k = torch.empty(1, 40, S_MAIN, 128, dtype=torch.bfloat16)
        p = (k, torch.empty(1, 40, 16, dtype=torch.int32), 0.1) if probe else None
        f, parts = tff.finite_flags(k, k, p, launch=C.FiniteFlagsConfig())
        if parts is not None:
            tff.probe_error(k, p[1], parts)
    out += [(f"flags_probe{int(p)}", lambda p=p: flags(p)) for p in (False, True)]

    def kquant():
        from vc_compile.kernels import sparse_attn as tsa
        tsa.quantize_k_int8_head(torch.empty(1, 40, S_MAIN, 128, dtype=torch.bfloat16))
    out.append(("quant_k_int8_head", kquant))
    return out


FAMILIES = {"gluon": gluon_cases, "sm90_sparse": sm90_sparse_cases, "anchor": anchor_cases, "triton": triton_cases, "sparse": sparse_cases, "pre": pre_cases, "aux": aux_cases}


def compare(a_path, b_path) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    bad = loops_only = 0
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        same = x is not None and y is not None and x["sha"] == y["sha"]
        same_loops = x is not None and y is not None and x.get("loops_sha") == y.get("loops_sha") is not None
        bad += not same and not same_loops
        loops_only += not same and same_loops
        fx = f"{x['n']:5d} ins, loop {x['loop']:4d}" if x else "missing"
        fy = f"{y['n']:5d} ins, loop {y['loop']:4d}" if y else "missing"
        tag = "same " if same else ("loops" if same_loops else "DIFF ")
        print(f"{tag}  {key:66s} {fx} | {fy}")
    print(f"{len(set(a) | set(b)) - bad - loops_only} identical SASS, {loops_only} with identical loops (prologue / "
          f"epilogue differ), {bad} different")
    return 1 if bad else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=",".join(FAMILIES))
    p.add_argument("--compare", nargs=2, default=None)
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    cs._install()
    res = {}
    for fam in a.only.split(","):
        for name, fn in FAMILIES[fam]():
            t0 = time.time()
            for i, (kname, k) in enumerate(_run(fn)):
                res[f"{name}#{i}"] = dict(fingerprint(k), kernel=kname)
            print(f"{name}: {len([x for x in res if x.startswith(name + '#')])} kernels, {time.time() - t0:.0f}s",
                  file=sys.stderr, flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1, sort_keys=True)
    if not a.out:
        print(json.dumps(res, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
