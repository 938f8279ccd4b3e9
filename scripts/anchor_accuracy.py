"""CPU accuracy study of the cheap anchor step, with the plain-PyTorch references only.

    python -m scripts.anchor_accuracy [--capture DIR] [--steps 8] [--S 2048] [--json OUT.json]

An anchor at step tau computes sigma (PDDP), the selection and R = O_dense - O_sparse; the reuse steps
tau+1.. return O_sparse(t) + R (bf16 residual, as ``residual="bf16"``). Variants of the anchor:
  base      today's method: masses from the bf16 q, k with the true fp32 LSE, O_dense = dense attention in bf16
  sel8      the selection from pass 2 on the INT8 codes ("shift" exp, bf16 masses) + pass 1's 8-bit LSE; O_dense bf16
  sel8x     as sel8 with the exact exp2 and fp32 masses (isolates the "shift" exp + bf16 storage)
  q8        sel8's selection AND O_dense = the 8-bit V-Smooth output (one 8-bit dense pass; the default)
  run<R>    (``--runs``) the exact masses of ``base``, but keys selected in aligned runs of R consecutive keys (the
            run's mass = the sum of its keys'; the top ceil(n_keep / R) runs per group): what a gather that moves R
            rows per copy (one TMA box of R rows) would cost in accuracy; O_dense and R as ``base``
Pass 1 runs with the V-Smooth key order pi of k-means on V at tau (as after V-Smooth grouping steps).
Reported per input set: the reuse-step error (rel. L2 against fp64 dense attention, mean over the reuse
steps), the anchor step's own output error, the selection overlap with ``base`` and the exact mass the
selection captures relative to ``base``'s.

Inputs: ``structured`` -- a drifting video-like sequence (tokens on a 3-D grid; q, k carry random Fourier
features of the position, so attention is local and peaked; channel-biased K; clustered V with outlier
tokens; every tensor drifts a little per step); ``demo`` -- the trained demo model's captured q, k, v
(``python -m vc_compile.demo.capture --out DIR --layers 0,2,4 --steps 6,...,13 --num-steps 20``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

from vc_compile import formats, torch_ops  # noqa: E402
from vc_compile.methods.anchor import AnchorConfig, anchor_step  # noqa: E402
from vc_compile.reference import kmeans as RK  # noqa: E402
from vc_compile.reference import select as RS  # noqa: E402
from vc_compile.reference.dense import dense_attention_lse  # noqa: E402
from vc_compile.reference.sparse_attn import sparse_attention  # noqa: E402
from vc_compile.kernels import dispatch  # noqa: E402

C = 128
DENSITY = 0.15


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def truth(q, k, v):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v.double()


def structured_sequence(S: int, H: int, D: int, steps: int, seed: int = 0):
    """Video-like drifting inputs (see the module doc): a list of (q, k, v) bf16 [1, H, S, D]."""
    g = torch.Generator().manual_seed(seed)
    side = round((S / 4) ** 0.5)
    f, y, x = torch.meshgrid(torch.arange(4), torch.arange(side), torch.arange(side), indexing="ij")
    pos = torch.stack([f.flatten() * 2.0, y.flatten(), x.flatten()], -1).float()[:S]
    S = pos.shape[0]
    freq = torch.randn(3, D // 2, generator=g) * 0.35
    phase = torch.rand(D // 2, generator=g) * 6.283
    feat = torch.cat([torch.cos(pos @ freq + phase), torch.sin(pos @ freq + phase)], -1)  # [S, D]
    base_q = 1.2 * feat.expand(H, S, D) + 0.5 * torch.randn(H, S, D, generator=g)
    base_q[:, ::37] *= 4.0  # a few sharp queries
    base_k = (1.2 * feat.expand(H, S, D) + 0.5 * torch.randn(H, S, D, generator=g)
              + 2.0 * torch.randn(H, 1, D, generator=g))
    cent = 2.0 * torch.randn(H, 8, D, generator=g)
    lab = torch.randint(0, 8, (H, S), generator=g)
    base_v = torch.gather(cent, 1, lab[..., None].expand(H, S, D)) + 0.3 * torch.randn(H, S, D, generator=g)
    out = torch.rand(H, S, 1, generator=g) < 0.01
    base_v = base_v + out * 12.0 * torch.randn(H, S, D, generator=g)
    seq = []
    dq, dk, dv = (torch.zeros(H, S, D) for _ in range(3))
    for _ in range(steps):
        q = base_q + dq
        k = base_k + dk
        v = base_v + dv
        seq.append(tuple(t.unsqueeze(0).bfloat16() for t in (q, k, v)))
        dq = dq + 0.08 * torch.randn(H, S, D, generator=g)
        dk = dk + 0.08 * torch.randn(H, S, D, generator=g)
        dv = dv + 0.08 * torch.randn(H, S, D, generator=g)
    return seq


def demo_sequences(cap_dir: str):
    meta = json.loads((Path(cap_dir) / "index.json").read_text())
    by_layer = {}
    for f in meta["files"]:
        by_layer.setdefault(f["layer"], []).append((f["step"], f["file"]))
    for layer, items in sorted(by_layer.items()):
        seq = []
        for _, name in sorted(items):
            d = torch.load(Path(cap_dir) / name)
            seq.append((d["q"], d["k"], d["v"]))
        yield f"demo_L{layer}", seq


def base_anchor(q, k, v, sigma, keep, sm):
    """Today's anchor: exact masses of the bf16 q, k with the true LSE, bf16 O_dense."""
    o, lse = dense_attention_lse(q, k, v, sm_scale=sm)
    mass = RS.group_key_mass(q, k, sigma, lse, sm_scale=sm, group_size=C)
    from vc_compile.reference.topk import select_topk
    idx = select_topk(mass, keep)
    o_sp = sparse_attention(q, k, v, sigma, idx, sm_scale=sm, group_size=C, out_dtype=torch.float32)
    return o.to(q.dtype), idx, o.to(q.dtype).float() - o_sp, mass


def run_selection(mass, keep, R):
    """Keys in aligned runs of R: the top ceil(keep / R) whole runs by summed mass per group, expanded to their
    keys, ascending int32 [B, H, G, ceil(keep / R) * R]. Keys past the last whole run (Sk % R of them; none at
    the study's sizes) are never selected."""
    B, H, G, Sk = mass.shape
    nr = Sk // R
    n = -(-keep // R)
    if n > nr:
        raise ValueError(f"run_selection: {n} runs of {R} keys asked for, {nr} whole runs in {Sk} keys")
    m = mass[..., :nr * R].float().reshape(B, H, G, nr, R).sum(-1)
    runs = m.topk(n, dim=-1).indices.sort(-1).values
    return (runs[..., None] * R + torch.arange(R)).flatten(-2).to(torch.int32)


def study(name, seq, log, runs=()):
    q0, k0, v0 = seq[0]
    B, H, S, D = q0.shape
    sm = D ** -0.5
    keep = formats.n_keep(S, DENSITY)
    impl = dispatch.Impl.REFERENCE
    km = RK.kmeans_perm(v0.float(), torch_ops.default_clusters(S), 4)
    pi = km.perm
    sigma = dispatch.pddp_perm(impl, q0, C)
    truths = [truth(*t) for t in seq]
    o_b, idx_b, r_b, mass_b = base_anchor(q0, k0, v0, sigma, keep, sm)
    variants = {"base": (o_b, idx_b, r_b)}
    for vname, cfg in [("sel8", AnchorConfig(dense_out="bf16")),
                       ("sel8x", AnchorConfig(dense_out="bf16", exp="exact", mass_dtype="fp32")),
                       ("q8", AnchorConfig(dense_out="q8"))]:
        res = anchor_step(impl, q0, k0, v0, sm_scale=sm, group_size=C, keep=keep, key_perm=pi, cfg=cfg,
                          sigma=sigma)
        variants[vname] = (res.out, res.idx, res.residual)
    for R in runs:
        idx = run_selection(mass_b, keep, R)
        o_sp = sparse_attention(q0, k0, v0, sigma, idx, sm_scale=sm, group_size=C, out_dtype=torch.float32)
        variants[f"run{R}"] = (o_b, idx, o_b.float() - o_sp)
    rows = {}
    for vname, (o, idx, r) in variants.items():
        r16 = r.to(torch.bfloat16)
        reuse = [rel(sparse_attention(*seq[t], sigma, idx, sm_scale=sm, group_size=C, residual=r16,
                                      out_dtype=torch.float32), truths[t]) for t in range(1, len(seq))]
        sparse_only = [rel(sparse_attention(*seq[t], sigma, idx, sm_scale=sm, group_size=C,
                                            out_dtype=torch.float32), truths[t]) for t in range(1, len(seq))]
        inter = (torch.zeros(B, H, idx.shape[2], S).scatter_(3, idx.long(), 1.0)
                 * torch.zeros(B, H, idx_b.shape[2], S).scatter_(3, idx_b.long(), 1.0)).sum().item()
        captured = (torch.gather(mass_b, -1, idx.long()).sum() / torch.gather(mass_b, -1, idx_b.long()).sum()).item()
        rows[vname] = {"anchor_out_err": rel(o, truths[0]), "reuse_err_mean": sum(reuse) / len(reuse),
                       "reuse_err_last": reuse[-1], "sparse_only_err_mean": sum(sparse_only) / len(sparse_only),
                       "overlap_vs_base": inter / idx_b.numel(), "captured_vs_base": captured,
                       "residual_rel_to_base": rel(r, r_b)}
        log(f"{name:12s} {vname:6s} " + " ".join(f"{k}={v:.5f}" for k, v in rows[vname].items()))
    rows["base"]["kept_mass_fraction"] = (torch.gather(mass_b, -1, idx_b.long()).sum() / mass_b.sum()).item()
    log(f"{name:12s} kept mass fraction (base selection): {rows['base']['kept_mass_fraction']:.4f}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capture", default=None, help="demo capture directory (index.json)")
    ap.add_argument("--steps", type=int, default=8, help="steps of the structured sequence (1 anchor + reuse)")
    ap.add_argument("--S", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-structured", action="store_true")
    ap.add_argument("--runs", default="", help="comma-separated run lengths R for the run<R> variants, e.g. 8,16")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    runs = [int(r) for r in a.runs.split(",") if r]
    out = {}
    log = lambda m: print(m, flush=True)  # noqa: E731
    if not a.no_structured:
        out["structured"] = study("structured", structured_sequence(a.S, 2, 128, a.steps), log, runs)
    if a.capture and os.path.exists(os.path.join(a.capture, "index.json")):
        for name, seq in demo_sequences(a.capture):
            out[name] = study(name, seq, log, runs)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
