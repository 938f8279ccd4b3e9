"""The Gluon sm_90 gather kernel (``kernels/sparse_attn_sm90.py``; not used by any default).

On CPU: it compiles for sm_90 offline (``tests/codegen_sparse_sm90.py``) without spills, with the wgmmas not
serialised by ptxas, PV taking P from registers and QK from shared memory in the consumers' key loop, and the
producer's loop gathering every row by cp.async onto mbarriers; its launch configuration's validation and the
launcher's argument checks. On an sm_90 GPU (``requires_sm90``): against the reference (odd S, both group sizes,
both head dims, residual, flag, int64 ids, a broadcast dense selection, key counts below / at / off a multiple of
the key block) with the Triton gather kernel's tolerance, against the Triton kernel itself (the same arithmetic up
to the order of the fp32 sums and the bf16 rounding of P), and NaN / Inf propagating as in the reference. The
8-bit QK variant (int8 K codes): its offline SASS on CPU, and on the GPU against the reference run on the
dequantised codes.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import pinned_codegen
from test_sparse_attn import TOL, make_inputs, rel_l2
from test_vsmooth_attn_sm90 import requires_sm90
from vc_compile.formats import n_keep
from vc_compile.reference.sparse_attn import sparse_attention as ref_sparse
from vc_compile.kernels import configs as CF
from vc_compile.kernels.configs import SparseAttnSm90Config

ROOT = pathlib.Path(__file__).resolve().parents[2]


# the compiles checked: both defaults (C = 128: producer fence and overlap order), the other order at C = 128 and a
# deeper 64-key ring, and the 64-bit offset path (tensors whose in-head offsets pass 2^31) of both defaults; name: C
# and MC-Sparse's default metadata (16-bit numbers of 8-key runs, an int8 residual: "_runs8") at both defaults
COMPILES = {"c64_BN64_s2": 64, "c128_BN128_s2fo": 128, "c128_BN128_s2": 128, "c128_BN64_s4": 128,
            "c64_BN64_s2_off64": 64, "c128_BN128_s2fo_off64": 128, "c64_BN64_s2_runs8": 64,
            "c128_BN128_s2fo_runs8": 128}
RUNS = ([], ["--C", "128", "--configs", "64/4,128/2"], ["--off64"], ["--qk8"], ["--compact"])
QK8_COMPILES = {"c64_BN64_s2_qk8": 64, "c128_BN128_s2fo_qk8": 128}


@pytest.fixture(scope="module")
def codegen():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    out = {}
    for extra in RUNS:
        r = subprocess.run([sys.executable, "-m", "codegen_sparse_sm90", "--json", *extra], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        out.update(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


@pinned_codegen
@pytest.mark.parametrize("variant", sorted(COMPILES))
def test_compiles_for_sm90_without_spills_and_overlaps(codegen, variant):
    st = codegen[variant]
    C = COMPILES[variant]
    bn = int(variant.split("_BN")[1].split("_")[0])
    cfg = CF.sparse_sm90_default(C)
    D = 128
    flags = variant.split("_s")[1].split("_")[0].lstrip("0123456789")
    overlap = "o" in flags
    # nothing spills in the loops (the producer's 40 registers included; the overlap order and the 64-bit offset
    # path at C = 128: 12 bytes outside the loops, 36 with the run numbers' arithmetic), and ptxas keeps the wgmmas
    # asynchronous
    allowed = 40 if variant.endswith("runs8") and overlap else 16 if variant.endswith("off64") or overlap else 0
    assert st["spill_bytes"] <= allowed, st
    assert not st["wgmma_serialized"], st
    assert st["consumer"]["local_memory"] == 0 and st["producer"]["local_memory"] == 0
    # one 12-warp CTA per SM, within the shared memory the config's estimate allows, the registers split as the
    # config says
    stages = int(variant.split("_s")[1].split("_")[0].rstrip("fo"))
    assert st["ctas_per_sm"] == 1
    assert st["smem_bytes"] <= SparseAttnSm90Config(bn, stages).smem_bytes(C, D, D) <= CF.SM90_SMEM_BYTES
    assert {cfg.consumer_regs, cfg.producer_regs} <= set(st["setmaxnreg"]), st["setmaxnreg"]
    c = st["consumer"]
    assert c["found"], "no consumer key loop (a loop around an HGMMA) in the SASS"
    # QK: A = Q from shared memory, D / 16 k-steps; PV: A = P from registers, BN / 16 k-steps; P never goes
    # through shared memory; two wgmma waits per block (PV_j with S_{j+1} in flight, then S_{j+1})
    assert c["hgmma_smem_a"] == D // 16 and c["hgmma_register_a"] == bn // 16, c
    assert c["sts"] == 0 and c["lds"] == 0 and c["warpgroup_waits"] == 2, c
    assert bn // 2 <= c["mufu_ex2"] <= bn // 2 + 4, c  # 64 rows x BN keys / 128 threads, + the two alphas
    if overlap:  # S_j issued -> PV_{j-1} issued -> wait for S_j (PV_{j-1} in flight) -> wait for PV_{j-1}
        assert c["overlap_order_ok"], c
    else:  # softmax -> PV_j issued -> S_{j+1} issued -> wait for PV_j (S_{j+1} in flight) -> wait for S_{j+1}
        assert c["order_ok"] and c["softmax_before_pv"] >= 0.97, c
    p = st["producer"]
    assert p["found"], "no producer loop (a loop with LDGSTS) in the SASS"
    rings = 2 if C == 64 else 1
    # every K and V row of a block by 16-byte cp.async: BN rows x 2 D bytes x 2 tensors / 16 / 128 threads
    assert p["ldgsts"] == rings * bn * 2 * D * 2 // 16 // 128, p
    assert p["arrives"] == 2 * rings, p  # one arrival per tensor, block and ring (noinc, or after the fence)


@pinned_codegen
@pytest.mark.parametrize("variant", sorted(QK8_COMPILES))
def test_qk8_compiles_to_int8_qk_and_a_smaller_gather(codegen, variant):
    """The 8-bit QK variant (int8 K codes): QK as IGMMA (k = 32: D / 32 per block) from the Q codes in shared
    memory, PV unchanged (P from registers), no loop spills, and the producer moving 384 bytes a key (128 of K,
    256 of V) instead of 512."""
    st = codegen[variant]
    C, D = QK8_COMPILES[variant], 128
    bn = int(variant.split("_BN")[1].split("_")[0])
    assert st["spill_bytes"] <= 16 and not st["wgmma_serialized"], st
    c, p = st["consumer"], st["producer"]
    assert c["found"] and c["local_memory"] == 0 and p["local_memory"] == 0
    assert c["igmma_smem_a"] == D // 32 and c["hgmma_smem_a"] == 0 and c["hgmma_register_a"] == bn // 16, c
    assert bn // 2 <= c["mufu_ex2"] <= bn // 2 + 4, c
    if C == 128:
        assert c["overlap_order_ok"], c
    rings = 2 if C == 64 else 1
    assert p["ldgsts"] == rings * bn * (D + 2 * D) // 16 // 128, p


def test_config_validation():
    assert CF.sparse_sm90_default(128) == SparseAttnSm90Config(producer_fence=True, overlap=True)
    assert CF.sparse_sm90_default(64) == SparseAttnSm90Config(64, 2)
    assert SparseAttnSm90Config.from_json(SparseAttnSm90Config(64, 3).to_json()) == SparseAttnSm90Config(64, 3)
    for bad in (dict(block_n=32), dict(block_n=256), dict(stages=1), dict(stages=5), dict(block_n=True),
                dict(consumer_regs=236), dict(producer_regs=16), dict(consumer_regs=248, producer_regs=24),
                dict(consumer_regs=240, producer_regs=32), dict(overlap=1)):
        with pytest.raises(ValueError):
            SparseAttnSm90Config(**bad)
    with pytest.raises(ValueError, match="unknown field"):
        SparseAttnSm90Config.from_json({"block_n": 64, "warps": 4})
    # shared memory: two 128-key rings (C = 64) or four 128-key stages do not fit; the defaults do
    for C, cfg in CF.SPARSE_SM90_DEFAULT.items():
        cfg.check_fits(C, 128, 128)
    SparseAttnSm90Config(128, 3).check_fits(128, 128, 128)  # 224 KB
    for C, cfg in ((64, SparseAttnSm90Config(128, 2)), (128, SparseAttnSm90Config(128, 4))):
        with pytest.raises(ValueError, match="shared memory"):
            cfg.check_fits(C, 128, 128)


def _args(S=200, D=128, DV=128, C=128, dtype=torch.bfloat16, keep=50):
    G = -(-S // C)
    q = torch.zeros(1, 2, S, D, dtype=dtype)
    v = torch.zeros(1, 2, S, DV, dtype=dtype)
    return q, q.clone(), v, torch.zeros(1, 2, S, dtype=torch.int64), torch.zeros(1, 2, G, keep, dtype=torch.int32)


def test_bad_arguments():
    from vc_compile.kernels.sparse_attn_sm90 import sparse_attention_sm90 as f
    q, k, v, sig, idx = _args()
    for kw in (dict(group_size=32), dict(group_size=256), dict(launch=CF.SparseAttnConfig())):
        with pytest.raises((ValueError, TypeError)):
            f(q, k, v, sig, idx, sm_scale=0.1, **{"group_size": 128, **kw})
    with pytest.raises(ValueError, match="shared memory"):
        f(*_args(C=64), sm_scale=0.1, group_size=64, launch=SparseAttnSm90Config(128, 2))
    for bad in (_args(D=256), _args(D=32), _args(dtype=torch.float32)):
        with pytest.raises(ValueError):
            f(*bad, sm_scale=0.1, group_size=128)
    q, k, v, sig, idx = _args()
    with pytest.raises(ValueError, match="idx"):
        f(q, k, v, sig, idx[:, :, :1], sm_scale=0.1, group_size=64)
    with pytest.raises(ValueError, match="sigma"):
        f(q, k, v, sig[:, :, :-1], idx, sm_scale=0.1, group_size=128)
    with pytest.raises(ValueError, match="residual"):
        f(q, k, v, sig, idx, sm_scale=0.1, group_size=128, residual=q[:, :, :-1])
    with pytest.raises(ValueError, match="flag"):
        f(q, k, v, sig, idx, sm_scale=0.1, group_size=128, flag=torch.zeros(1, 2, 128, dtype=torch.int64))
    # 8-bit QK: int8 codes and their per-head scale go together, the scale fp32 [B, H]
    k8 = torch.zeros(k.shape, dtype=torch.int8)
    with pytest.raises(ValueError, match="k_scale"):
        f(q, k8, v, sig, idx, sm_scale=0.1, group_size=128)
    with pytest.raises(ValueError, match="k_scale"):
        f(q, k, v, sig, idx, sm_scale=0.1, group_size=128, k_scale=torch.ones(1, 2))
    with pytest.raises(ValueError, match="k_scale"):
        f(q, k8, v, sig, idx, sm_scale=0.1, group_size=128, k_scale=torch.ones(2))


# ---- on an sm_90 GPU ---------------------------------------------------------------------------------------
def _gluon(*a, **kw):
    from vc_compile.kernels.sparse_attn_sm90 import sparse_attention_sm90
    return sparse_attention_sm90(*a, **kw)


def _triton(q, k, v, sigma, idx, *, group_size, **kw):
    from vc_compile.kernels import sparse_attn as tsa
    return tsa.sparse_attention(q, k, v, sigma, idx, group_size=group_size,
                                launch=CF.sparse_default("bf16", q.shape[-1], group_size), **kw)


@requires_sm90
@pytest.mark.parametrize("C", [64, 128])
@pytest.mark.parametrize("S,D,density", [(4001, 128, 0.15), (4001, 64, 0.3), (333, 128, 0.25), (8190, 128, 0.1)])
def test_gpu_matches_reference_and_triton(C, S, D, density):
    q, k, v, sigma, idx, res = make_inputs(1, 4, S, D, torch.bfloat16, density, C=C, device="cuda")
    for residual in (None, res):
        kw = dict(sm_scale=D ** -0.5, group_size=C, residual=residual, out_dtype=torch.float32)
        out = _gluon(q, k, v, sigma, idx, **kw)
        ref = ref_sparse(q, k, v, sigma, idx, **kw)
        tri = _triton(q, k, v, sigma, idx, **kw)
        assert out.shape == q.shape and torch.isfinite(out).all()
        assert rel_l2(out, ref) < TOL[torch.bfloat16]
        # the same softmax and bf16 P as the Triton kernel: only the order of the fp32 sums differs
        assert rel_l2(out, tri) < 6e-3, rel_l2(out, tri)


@requires_sm90
@pytest.mark.parametrize("C", [64, 128])
def test_gpu_key_counts_and_launch_configs(C):
    """n_keep below one block, exactly a multiple of every block size, and off by 7 (masked tail), for every
    config that fits; int64 ids; an odd group count at C = 64 (the last CTA's second group does not exist)."""
    S, D = 64 * 37 + 5, 128  # G odd at C = 64
    q, k, v, sigma, idx, res = make_inputs(2, 3, S, D, torch.bfloat16, 0.5, C=C, device="cuda")
    cfgs = [c for c in (SparseAttnSm90Config(bn, st) for bn in (64, 128) for st in (2, 3, 4))
            if c.smem_bytes(C, D, D) <= CF.SM90_SMEM_BYTES]
    for keep in (40, 256, 256 + 128 - 7):
        sel = idx[..., :keep].sort(-1).values.contiguous()
        ref = ref_sparse(q, k, v, sigma, sel, sm_scale=D ** -0.5, group_size=C, residual=res, out_dtype=torch.float32)
        for cfg in cfgs:
            for ids in (sel, sel.long()):
                out = _gluon(q, k, v, sigma, ids, sm_scale=D ** -0.5, group_size=C, residual=res,
                             out_dtype=torch.float32, launch=cfg)
                assert rel_l2(out, ref) < TOL[torch.bfloat16], (keep, cfg, ids.dtype)


@requires_sm90
@pytest.mark.parametrize("C", [64, 128])
@pytest.mark.parametrize("run,keep", [(8, 1152), (8, 1112), (64, 1152)])
def test_gpu_runs_and_int8_residual_match_the_expanded_selection(C, run, keep):
    """The MC-Sparse metadata formats: a selection of aligned runs (16-bit run numbers; a masked tail at keep =
    1112) and an int8 residual with its per-token scale give the output of the expanded key ids with the
    dequantised residual (the same keys in the same order and the same fp32 epilogue sum: the same bits), and the
    reference's within the kernel's tolerance; the Triton kernel agrees."""
    from test_sparse_attn import make_runs
    from vc_compile.torch_ops import expand_runs, residual_values, safe_scale
    S, D = 64 * 101, 128  # Sk a multiple of 64; G odd at C = 64
    q, k, v, sigma, _, res = make_inputs(1, 4, S, D, torch.bfloat16, 0.2, C=C, device="cuda")
    G = -(-S // C)
    runs = make_runs(1, 4, S, G, keep, run)  # keep = 1112: 139 runs, not a whole number of 128-key blocks
    tokens = expand_runs(runs, run)
    scale = safe_scale(res.abs().amax(-1), 127.0)  # int8 codes (the default residual)
    codes = torch.round(res / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    kw = dict(sm_scale=D ** -0.5, group_size=C, out_dtype=torch.float32)
    out = _gluon(q, k, v, sigma, runs.contiguous(), run=run, residual=codes, res_scale=scale, **kw)
    same = _gluon(q, k, v, sigma, tokens.to(torch.int32).contiguous(), residual=residual_values(codes, scale), **kw)
    assert torch.equal(out, same)
    ref = ref_sparse(q, k, v, sigma, runs, run=run, residual=codes, res_scale=scale, **kw)
    assert rel_l2(out, ref) < TOL[torch.bfloat16]
    tri = _triton(q, k, v, sigma, runs.contiguous(), run=run, residual=codes, res_scale=scale, **kw)
    assert rel_l2(out, tri) < 6e-3


@requires_sm90
@pytest.mark.parametrize("C", [64, 128])
def test_gpu_order_switches_are_the_same_arithmetic(C):
    """``producer_fence`` (the proxy fence on the writer's side) and ``overlap`` (PV_{j-1} in flight during
    softmax(S_j): the same operations on O in the same order) move synchronisation only: the same bits as the
    default order, with a masked tail."""
    S, D = 64 * 41 + 3, 128
    q, k, v, sigma, idx, res = make_inputs(1, 8, S, D, torch.bfloat16, 0.3, C=C, device="cuda")
    idx = idx[..., :idx.shape[-1] - 3].contiguous()
    kw = dict(sm_scale=D ** -0.5, group_size=C, residual=res, out_dtype=torch.float32)
    bn = 128 if C == 128 else 64
    one = _gluon(q, k, v, sigma, idx, launch=SparseAttnSm90Config(bn, 2), **kw)
    for flags in ("f", "fo"):
        spec = f"{bn}/2{flags}"
        out = _gluon(q, k, v, sigma, idx, launch=SparseAttnSm90Config.from_spec(spec), **kw)
        assert torch.equal(one, out), spec


@requires_sm90
@pytest.mark.parametrize("C", [64, 128])
def test_gpu_value_head_dim_differs(C):
    """D = 64 keys against Dv = 128 values (and back): the K and V gathers share the id vector, not the width."""
    S = 1234
    for D, DV in ((64, 128), (128, 64)):
        q, k, _, sigma, idx, _ = make_inputs(1, 2, S, D, torch.bfloat16, 0.3, C=C, device="cuda")
        v = torch.randn(1, 2, S, DV, device="cuda", dtype=torch.bfloat16)
        res = 0.1 * torch.randn(1, 2, S, DV, device="cuda")
        kw = dict(sm_scale=D ** -0.5, group_size=C, residual=res, out_dtype=torch.float32)
        out = _gluon(q, k, v, sigma, idx, **kw)
        assert out.shape == (1, 2, S, DV)
        assert rel_l2(out, ref_sparse(q, k, v, sigma, idx, **kw)) < TOL[torch.bfloat16], (D, DV)


@requires_sm90
def test_gpu_density_one_broadcast_ids_and_fp16():
    S, D = 2000, 128
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, sigma, _, _ = make_inputs(1, 2, S, D, dtype, 1.0, C=128, device="cuda")
        assert n_keep(S, 1.0) == S
        bcast = torch.arange(S, device="cuda", dtype=torch.int32).expand(1, 2, -(-S // 128), S)  # stride 0
        out = _gluon(q, k, v, sigma, bcast, sm_scale=D ** -0.5, group_size=128, out_dtype=torch.float32)
        assert torch.equal(out, _gluon(q, k, v, sigma, bcast.contiguous(), sm_scale=D ** -0.5, group_size=128,
                                       out_dtype=torch.float32))
        ref = ref_sparse(q, k, v, sigma, bcast, sm_scale=D ** -0.5, group_size=128, out_dtype=torch.float32)
        assert rel_l2(out, ref) < TOL[dtype]
        assert _gluon(q, k, v, sigma, bcast, sm_scale=D ** -0.5, group_size=128).dtype == dtype


@requires_sm90
def test_gpu_residual_is_added_in_the_original_order_and_flag_columns_are_nan():
    S, D = 1000, 128
    q, k, v, sigma, idx, res = make_inputs(1, 2, S, D, torch.bfloat16, 0.25, C=128, device="cuda")
    kw = dict(sm_scale=0.1, group_size=128, out_dtype=torch.float32)
    plain = _gluon(q, k, v, sigma, idx, **kw)
    with_res = _gluon(q, k, v, sigma, idx, residual=res.bfloat16(), **kw)
    assert torch.allclose(with_res - res.bfloat16().float(), plain, atol=1e-5)
    flag = torch.zeros(1, 2, D, dtype=torch.int32, device="cuda")
    flag[0, 1, [3, 77]] = 1
    out = _gluon(q, k, v, sigma, idx, residual=res, flag=flag, **kw)
    ref = ref_sparse(q, k, v, sigma, idx, residual=res, flag=flag, **kw)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.isnan(out[0, 1, :, [3, 77]]).all() and torch.isfinite(out[0, 0]).all()
    ok = ~torch.isnan(ref)
    assert rel_l2(out[ok], ref[ok]) < TOL[torch.bfloat16]


@requires_sm90
@pytest.mark.parametrize("C", [64, 128])
def test_gpu_non_finite_inputs_propagate_as_the_reference(C):
    """NaN in a query row -> that row; NaN in a selected key -> the rows of the groups that selected it; Inf in a
    selected value element -> its column in those rows; a NaN value row no group selected leaks nowhere (the
    key-tail rows are zero-filled, not a duplicate of a real key)."""
    S, D = 1500, 128
    q, k, v, sigma, idx, _ = make_inputs(1, 2, S, D, torch.bfloat16, 0.2, C=C, device="cuda")
    idx = idx[..., :idx.shape[-1] - 5].contiguous()  # a masked tail block
    selected = torch.zeros(1, 2, S, dtype=torch.bool, device="cuda")
    selected.scatter_(2, idx.long().flatten(2), True)
    unsel = (~selected[0, 0]).nonzero().flatten()
    q[0, 0, 11] = float("nan")
    k[0, 1, idx[0, 1, 2, 3]] = float("nan")
    # the Inf in a selected key other than key 0 (the Triton kernel's key-tail rows repeat key 0: p = 0 there, and
    # 0 * Inf would make its masked tails non-finite, which the comparison with it below is not about)
    sel0 = idx[0, 1, 0]
    v[0, 1, sel0[sel0 > 0][0], 5] = float("inf")
    if unsel.numel():
        v[0, 0, unsel[0]] = float("nan")
    kw = dict(sm_scale=D ** -0.5, group_size=C, out_dtype=torch.float32)
    out = _gluon(q, k, v, sigma, idx, **kw)
    ref = ref_sparse(q, k, v, sigma, idx, **kw)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (torch.isnan(out) ^ torch.isnan(ref)).sum()
    assert torch.isnan(out).any()
    fin = torch.isfinite(ref)
    assert torch.isfinite(out[fin]).all() and rel_l2(out[fin], ref[fin]) < TOL[torch.bfloat16]
    # the Triton kernel agrees on the selected-key cases (its key-tail rows repeat key 0, so the unselected NaN
    # row is left out of this comparison) on where the output is non-finite. NOTE not NaN against Inf: a row whose
    # weight for the Inf value underflows to exactly 0 in one kernel's P and not the other's gives NaN there and
    # Inf here. NOTE (H200, 2026-12-03) with the Inf in key 0 (the seeded C = 128 case) the Triton kernel's
    # masked tails read key 0 (0 * Inf) and the two disagreed on finiteness: hence a key other than 0 above.
    v[0, 0] = torch.nan_to_num(v[0, 0])
    tri = _triton(q, k, v, sigma, idx, **kw)
    assert torch.equal(~torch.isfinite(_gluon(q, k, v, sigma, idx, **kw)), ~torch.isfinite(tri))


def test_dispatch_rule(monkeypatch):
    """``dispatch.sparse_kernel``: the Gluon kernel exactly where it runs (an sm_90 GPU, bf16 / fp16 scores, head
    dims 64 / 128, C = 64 / 128), the Triton kernel elsewhere; a launch config picks its kernel; the report's
    label is the same decision. Inputs are stand-ins (device, dtype, shape), so this runs on CPU."""
    import types
    from vc_compile.kernels import dispatch

    def x(D=128, dtype=torch.bfloat16, dev="cuda"):
        return types.SimpleNamespace(device=torch.device(dev, 0) if dev == "cuda" else torch.device(dev),
                                     dtype=dtype, shape=(1, 2, 300, D))
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_is_sm90", lambda index: True)
    q = x()
    assert dispatch.sparse_kernel(q, q, "bf16", 128) == "sparse_attn_sm90"
    assert dispatch.sparse_kernel(x(64, torch.float16), x(64, torch.float16), "bf16", 64) == "sparse_attn_sm90"
    assert dispatch.sparse_label(q, q, "bf16", 128) == "triton/gluon_sm90_gather"
    for why, args in (("FP8 scores", (q, q, "fp8", 128)), ("head dim 256", (x(256), x(256), "bf16", 128)),
                      ("value head dim 32", (q, x(32), "bf16", 128)),
                      ("fp32", (x(dtype=torch.float32),) * 2 + ("bf16", 128)),
                      ("CPU", (x(dev="cpu"), x(dev="cpu"), "bf16", 128))):
        assert dispatch.sparse_kernel(*args) == "sparse_attn", why
    assert dispatch.sparse_kernel(q, q, "bf16", 128, launch=CF.SparseAttnConfig()) == "sparse_attn"
    assert dispatch.sparse_kernel(x(dev="cpu"), x(dev="cpu"), "bf16", 128,
                                  launch=SparseAttnSm90Config()) == "sparse_attn_sm90"
    monkeypatch.setattr(dispatch, "_is_sm90", lambda index: False)  # another GPU
    assert dispatch.sparse_kernel(q, q, "bf16", 128) == "sparse_attn"
    assert dispatch.sparse_label(q, q, "bf16", 128) == "triton"
    monkeypatch.setattr(dispatch, "_is_sm90", lambda index: True)
    from vc_compile.config import VCConfig
    from vc_compile.methods import mcsparse
    from vc_compile.methods.phase import Phase
    cfg = VCConfig(method="mcsparse")
    assert mcsparse.path_label("triton", Phase.REUSE, cfg, q, q) == "triton/gluon_sm90_gather"
    assert mcsparse.path_label("reference", Phase.REUSE, cfg, q, q) == "reference"


def test_spec_parsing():
    assert SparseAttnSm90Config.from_spec("128/2") == SparseAttnSm90Config()
    assert SparseAttnSm90Config.from_spec("64/3fo") == SparseAttnSm90Config(64, 3, producer_fence=True, overlap=True)
    for bad in ("128", "128/2x", "a/b", "128/2fog", "64/3pfw"):  # (p, w, g: removed variants)
        with pytest.raises(ValueError, match="BN/stages"):
            SparseAttnSm90Config.from_spec(bad)
    with pytest.raises(ValueError, match="producer_fence"):
        SparseAttnSm90Config(producer_fence=1)


@requires_sm90
@pytest.mark.parametrize("C", [64, 128])
@pytest.mark.parametrize("S,D,density", [(4001, 128, 0.15), (4001, 64, 0.3), (333, 128, 0.25)])
def test_gpu_qk8_matches_its_dequantised_reference(C, S, D, density):
    """8-bit QK: against the reference run on the dequantised codes (the kernel's own arithmetic up to the fp32
    sums' order and bf16 P: the bf16 tolerance) and against the unquantised reference (the quantisation's own
    error, channel-biased K: the smoothing keeps it below 2e-2 on these inputs)."""
    from vc_compile.reference.sparse_attn_q8 import sparse_attention_qk8
    from vc_compile.kernels.sparse_attn import quantize_k_int8_head
    q, k, v, sigma, idx, res = make_inputs(1, 4, S, D, torch.bfloat16, density, C=C, device="cuda")
    k8, ks = quantize_k_int8_head(k)
    for residual in (None, res):
        kw = dict(sm_scale=D ** -0.5, group_size=C, residual=residual, out_dtype=torch.float32)
        out = _gluon(q, k8, v, sigma, idx, k_scale=ks, **kw)
        assert out.shape == q.shape and torch.isfinite(out).all()
        emu = sparse_attention_qk8(q, k8, ks, v, sigma, idx, **kw)
        assert rel_l2(out, emu) < TOL[torch.bfloat16], rel_l2(out, emu)
        ref = ref_sparse(q, k, v, sigma, idx, **kw)
        assert rel_l2(out, ref) < 2e-2, rel_l2(out, ref)


@requires_sm90
def test_gpu_dispatch_int8_qk_is_the_reference_contract():
    """``sparse_qk="int8"`` through dispatch (what MC-Sparse calls): K quantised per head, the Gluon kernel's 8-bit
    QK, against the reference path's int8 contract (the same codes up to the quantisers' mean rounding)."""
    from vc_compile.kernels import dispatch
    S, D, C = 3001, 128, 128
    q, k, v, sigma, idx, res = make_inputs(1, 4, S, D, torch.bfloat16, 0.2, C=C, device="cuda")
    kw = dict(sm_scale=D ** -0.5, group_size=C, residual=res, out_dtype=torch.float32, qk_format="int8")
    out = dispatch.sparse_attention(dispatch.Impl.TRITON, q, k, v, sigma, idx, **kw)
    ref = dispatch.sparse_attention(dispatch.Impl.REFERENCE, q, k, v, sigma, idx, **kw)
    assert rel_l2(out, ref) < TOL[torch.bfloat16], rel_l2(out, ref)
    assert dispatch.sparse_label(q, v, "int8", C).endswith("+int8_qk")
