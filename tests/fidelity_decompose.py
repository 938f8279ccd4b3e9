"""Where the 8-bit attention error comes from, per method: the decomposition of docs/methods.md, which
tests/reference/test_fidelity_vsmooth.py measures. (The study's command line over input families, sizes and captured
q, k, v is the script scripts/fidelity_decompose.py at commit 7684991, removed since.)

For a case (q, k, v and sampled query rows) each method's output is compared with the fp32 truth and its error
split as (SPEC 3.2)
    O_q - O = -(P - P_q) V - P_q (V - V_q) + rest,   (P - P_q) = (P - P_qk) + (P_qk - P_q)

* ``qk``: (P - P_qk) V, P_qk = the exact softmax of the method's quantised logits (QK error folded into P);
* ``p``:  (P_qk - P_q) V, P_q = what the method's PV product effectively applies (P~ 2^(m_j - m) / l: FP8 or
  ExpCast rounding, row sums, online rescaling);
* ``v``:  P_q (V - V_q), V_q the effective values (FP8 V; for V-Smooth the FP8 residual + block means);
* ``rest``: what is left (fp22 accumulation, bf16 output).
Reported: ||term|| / ||O|| per term and each term's share of the summed squares (the benchmark's
err_share_pv is the ``v`` share of qk + p + v).

Methods (all plain-PyTorch emulations, any device; bf16 output like the kernels):
sage2 (SageAttention2 sm_90, Q smoothing on), sage2_noq (the released sm_90 INT8 path: no Q smoothing), naive8
(exp2 + cast, per-channel FP8 V, identity order), vsmooth (exp2 + cast, k-means order, block means),
expcast (mode 3 as shipped), and the variants under study (``METHODS`` below). ``measure(..., kernel=True)`` (CUDA): also the
shipped kernels (vc_compile.kernels) on the same rows, to confirm the emulation.
"""
from __future__ import annotations

import math
import time

import torch

import fidelity_inputs as FI

from vc_compile import formats, torch_ops
from vc_compile.reference import kmeans as ref_km
from vc_compile.reference import preprocess as ref_pre
from vc_compile.reference import sage2
from vc_compile.reference import vsmooth_attn_sm90 as emu

TERMS = ("qk", "p", "v", "rest")


def log(*a):
    print(*a, flush=True)


class Case:
    """One (q, k, v) and its sampled rows, with the fp32 truth and the shared k-means order."""

    def __init__(self, q, k, v, rows, n_clusters=None, iters=3):
        self.q, self.k, self.v, self.rows = q, k, v, rows
        self.S, self.D = q.shape[2], q.shape[3]
        self.sm = self.D ** -0.5
        self.truth = self.dense(None)
        K = n_clusters or torch_ops.default_clusters(self.S)
        self.perm = ref_km.kmeans_perm(v, K, iters).perm

    def dense(self, perm):
        """(P [B, H, n, Sk] fp32 in the key order ``perm``, O fp32) from the bf16 inputs."""
        k = self.k if perm is None else ref_pre.apply_perm(self.k, perm)
        s = (self.q[:, :, self.rows].double() @ k.double().transpose(-1, -2)) * self.sm
        p = torch.softmax(s, -1)
        if perm is None:
            return (p @ self.v.double()).float()
        return p.float()


def split(case, out, p_eff, v_eff, s2, perm):
    """Error terms (dict of [B, H, n, D] fp64) of one method; s2 = its quantised base-2 logits (key order perm)."""
    P = case.dense(perm).double() if perm is not None else torch.softmax(
        (case.q[:, :, case.rows].double() @ case.k.double().transpose(-1, -2)) * case.sm, -1)
    V = (case.v if perm is None else ref_pre.apply_perm(case.v, perm)).double()
    Pqk = torch.softmax(s2.double() * math.log(2.0), -1)
    Pq = p_eff.double()
    t = {"qk": (Pqk - P) @ V, "p": (Pq - Pqk) @ V, "v": Pq @ (v_eff.double() - V)}
    t["rest"] = out.double() - case.truth.double() - t["qk"] - t["p"] - t["v"]
    return t


def vsmooth_logits(qk, rows):
    ks = qk.k_scale.repeat_interleave(formats.BLOCK_K, -1)[..., :qk.k8.shape[2]]
    return (qk.q8[:, :, rows].float() @ qk.k8.float().transpose(-1, -2)) * qk.q_scale[:, :, rows, None] \
        * ks[:, :, None, :]


def run_ours(case, *, order=True, smooth=True, p_mode="exp2", offset=None, vq_fn=None, qk_kw=None, **kw):
    perm = case.perm if order else None
    qk = ref_pre.preprocess_qk(case.q, case.k, perm, sm_scale=case.sm, **(qk_kw or {}))
    vq = (vq_fn or ref_pre.preprocess_v)(case.v, perm, smooth=smooth)
    out, parts = emu.attention(qk, vq, p_mode=p_mode, offset=offset, rows=case.rows, return_parts=True, **kw)
    return out, parts["p_eff"], parts["v_eff"], vsmooth_logits(qk, case.rows), perm


def run_sage2(case, smooth_q=True):
    sq = sage2.quantize(case.q, case.k, case.v, sm_scale=case.sm, smooth_q=smooth_q)
    out, parts = sage2.attention(sq, rows=case.rows, return_parts=True)
    return out.bfloat16(), parts["p_eff"], parts["v_eff"], sage2.logits(sq, case.rows), None


METHODS = {
    "sage2": lambda c: run_sage2(c, True),
    "sage2_noq": lambda c: run_sage2(c, False),
    "naive8": lambda c: run_ours(c, order=False, smooth=False),
    "vsmooth": lambda c: run_ours(c),
    "vsmooth448": lambda c: run_ours(c, offset=8.807),
    "expcast": lambda c: run_ours(c, p_mode="expcast"),
    "expcast126": lambda c: run_ours(c, p_mode="expcast", offset=126.0),
    # ExpCast's fix: every 128-key block quantised against its own max (floored 32 below the running max)
    "vsmooth_blk": lambda c: run_ours(c, block_ref=32.0),
    "expcast_blk": lambda c: run_ours(c, p_mode="expcast", block_ref=32.0),
    "naive8_blk": lambda c: run_ours(c, order=False, smooth=False, block_ref=32.0),
    "expcast126_blk": lambda c: run_ours(c, p_mode="expcast", offset=126.0, block_ref=32.0),
}


def kernel_rows(case, method):
    """The shipped kernels (CUDA) on the case, for --kernel: output rows [B, H, n, D] fp32 or None."""
    from vc_compile.kernels import preprocess as tpre
    from vc_compile.kernels import vsmooth_attn as tattn

    if method not in ("naive8", "vsmooth", "expcast"):
        return None
    perm = None if method == "naive8" else case.perm.to(case.q.device)
    qk = tpre.preprocess_qk(case.q, case.k, perm, sm_scale=case.sm)
    vq = tpre.preprocess_v(case.v, perm, smooth=method != "naive8")
    return tattn.vsmooth_attention(qk, vq, expcast=method == "expcast")[:, :, case.rows].float()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def measure(case, methods, kernel=False):
    """{method: row dict} for one case."""
    res = {}
    base = case.truth.double().norm().item()
    for name in methods:
        t0 = time.time()
        out, p_eff, v_eff, s2, perm = METHODS[name](case)
        terms = split(case, out, p_eff, v_eff, s2, perm)
        e = out.double() - case.truth.double()
        row_err = (e.pow(2).sum(-1) / case.truth.double().pow(2).sum(-1).clamp_min(1e-30)).sqrt()
        sq = {t: terms[t].pow(2).sum().item() for t in TERMS}
        tot = sq["qk"] + sq["p"] + sq["v"]
        r = dict(variant=name, rel_l2=rel(out, case.truth),
                 cos_sim=torch.nn.functional.cosine_similarity(out.double().flatten(), case.truth.double().flatten(),
                                                               0).item(),
                 row_rel_l2_median=row_err.median().item(), row_rel_l2_p99=row_err.flatten().quantile(0.99).item())
        for t in TERMS:
            r[f"rel_{t}"] = math.sqrt(sq[t]) / base
            if t != "rest":
                r[f"share_{t}"] = sq[t] / max(tot, 1e-300)
        if kernel and torch.cuda.is_available():
            ko = kernel_rows(case, name)
            if ko is not None:
                r["kernel_rel_l2"] = rel(ko, case.truth)
                r["kernel_vs_emu"] = rel(ko, out.float())
        res[name] = r
        log(f"    {name:14s} rel_l2 {r['rel_l2']:.3e}  qk {r['rel_qk']:.2e} p {r['rel_p']:.2e} v {r['rel_v']:.2e} "
            f"rest {r['rel_rest']:.2e}  share v {r['share_v']:.2f}  ({time.time() - t0:.0f} s)"
            + (f"  kernel {r['kernel_rel_l2']:.3e} (vs emu {r['kernel_vs_emu']:.1e})" if "kernel_rel_l2" in r else ""))
    return res
