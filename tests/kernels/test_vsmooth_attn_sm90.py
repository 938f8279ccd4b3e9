"""The Gluon sm_90 V-Smooth kernel (``kernels/vsmooth_attn_sm90.py``).

On CPU: it compiles for sm_90 (offline, ``tests/codegen_vsmooth.py``) without spills, two or more CTAs per
SM, and with the softmax inside the window where PV_{j-1} runs on the tensor cores (the point of the kernel);
its launch configurations' validation; the dispatch rule (``kernels/dispatch.py``). On an sm_90 GPU: against the reference and an fp32
truth with the Triton kernel's tolerances (tests/kernels/test_vsmooth_attn.py explains them), and against the Triton
kernel itself: the same arithmetic up to the order of fp32 additions (two-level PV accumulation in both, the
row sum of P~ in fp16 as the Triton kernel's ROWSUM = 2, or exact by an MMA in the MS configurations, the default
from 4096 / 6144 rows), so <= 1e-2 relative L2 (measured <= 1.6e-2 max abs on bf16 outputs of magnitude ~2, i.e.
one bf16 step).
"""
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import requires_cuda, pinned_codegen
from test_vsmooth_attn import REF_TOL, attn, make_qkv, quantise, rel, truth_of
from vc_compile.formats import sm90_key_order, sm90_mean_groups
from vc_compile.reference import preprocess as ref_pre
from vc_compile.reference import vsmooth_attn as ref
from vc_compile.kernels import configs as C
from vc_compile.kernels import dispatch
from vc_compile.kernels.configs import MeanTerm, POperand, RowSum, VSmoothSm90Config

T = dispatch.Impl.TRITON
SMEM = VSmoothSm90Config()  # shared-memory P~: the reference configuration of the register-P~ comparisons
REG = VSmoothSm90Config(p_operand=POperand.REGISTERS)
MS = dict(rowsum=RowSum.MMA, mean=MeanTerm.TF32_WINDOW)
MS_WS = VSmoothSm90Config(p_operand=POperand.REGISTERS, warp_specialize=True, **MS)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (H100/H200)")


@pytest.fixture(scope="module")
def codegen():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "codegen_vsmooth", "--json"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


VARIANTS = ["d128_exp2", "d128_expcast", "d128_naive", "d64_exp2", "d64_expcast", "d128_exp2_ws",
            "d128_exp2_preg", "d128_expcast_smem", "d128_expcast_ws", "d64_expcast_preg", "d128_exp2_ms_nows"]


@pinned_codegen
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_for_sm90_without_spills_and_overlaps(codegen, variant):
    st = codegen[variant]
    # nothing spills in a key loop; the byte-mask clamp's once-per-program guard (``bytemask_ok``) costs ptxas
    # 16 bytes of stack in the prologue of the warp-specialised kernel (measured: no loop instruction touches it)
    assert st["loop_local_memory"] == 0 and not st["wgmma_serialized"]
    assert st["spill_bytes"] <= (16 if st["byte_mask"] else 0)
    if st["byte_mask"]:  # a byte-mask loop without the 64 FMNMX clamps, and the FMNMX-clamp loop beside it
        assert st["fmnmx_shortest_loop"] <= 80 and st["fmnmx_most"] >= 140
    # no chained F2FP.MERGE_C: the SASS pattern of every wrong / NaN register-P~ exp2 compile
    # (docs/design/e4m3x4-packing.md)
    assert st["f2fp_merge_chained"] == 0
    w = st["window"]
    assert w["found"], "no key loop found in the SASS"
    if st["register_p"]:
        # P~ never goes through shared memory: PV takes it from registers after the softmax
        assert w["sts"] == 0 and w["pv_from_registers_after_softmax"]
        # both MMAs are issued after the softmax (MS: ptxas may sink the 2 alpha exponents)
        assert w["softmax_after_qk"] <= (0.02 if st["ms"] else 0.0)
        if st["ms"]:  # row sums by MMA (4 k-steps of N = 8), the mean term by 3 tf32 MMAs per 8 blocks
            assert w["rowsum_mma"] == 4 and w["fp8_unpack"] == 0 and w["lds"] == 0
            assert w["tf32_mma"] == (3 if st["mean"] else 0)
        else:
            assert w["rowsum_mma"] == 0 and w["tf32_mma"] == 0
        # the warp-specialised configs (12 warps: two consumer warp groups + the producer's) fill an SM alone
        assert st["ctas_per_sm"] >= 1
        return
    assert st["ctas_per_sm"] >= 2  # 8 warps per SM: the other CTA's softmax also hides MMA latency
    assert w["instructions"] > 0
    # the whole softmax of a [64, 128] tile (64 scores per thread) runs while PV_{j-1} is in flight
    if "expcast" in variant:
        assert w["fmnmx"] >= 64
    else:
        assert w["mufu_ex2"] >= 64
    assert w["sts"] >= 16  # P~_j goes to shared memory (PV's A operand) inside the window too


def _tf32(x):
    """What a tf32 MMA reads of an fp32 value: the top 19 bits (10 stored mantissa bits)."""
    return (x.contiguous().view(torch.int32) & -8192).view(torch.float32)


def test_ms_mean_groups_layout_matches_a_dense_reference():
    """``sm90_mean_groups``: per (b, h) and window w of 8 key blocks, tile 2 w holds tf32(mu'^T) [D, 8] and tile 2 w + 1
    the rest, blocks past nb zero; hi + lo = mu' exactly, and hi is exactly tf32."""
    BH, nb, D = 3, 19, 64  # 19 blocks: two full windows and one of 3
    mu = torch.randn(BH, nb, D, dtype=torch.float64).mul(50).float()
    t = sm90_mean_groups(mu).view(BH, 3, 2, D, 8)
    pad = torch.zeros(BH, 24, D)
    pad[:, :nb] = mu
    want = pad.view(BH, 3, 8, D).transpose(-1, -2)
    assert torch.equal(t[:, :, 0], _tf32(want)) and torch.equal(t[:, :, 0] + t[:, :, 1], want)
    assert torch.equal(t[:, 2, :, :, 3:], torch.zeros_like(t[:, 2, :, :, 3:]))


def test_ms_window_slot_lands_in_a_operand_column_i():
    """``mean_slot`` puts block i of a window in accumulator column 2 (i % 4) + i // 4; ``MeanWindow.flush``'s
    relabelling (reshape [BM, 4, 2], swap the last two axes) must bring it to A-operand column i, the row of
    mu'_i in the tile."""
    for i in range(8):
        x = torch.zeros(1, 8)
        x[0, 2 * (i % 4) + i // 4] = 1.0
        y = x.reshape(1, 4, 2).permute(0, 2, 1).reshape(1, 8)
        assert y[0].nonzero().flatten().tolist() == [i]


def test_ms_hi_lo_split_is_needed_for_large_means():
    """The mean term R mu' as ``MeanWindow.flush`` forms it (R_hi mu_hi + R_lo mu_hi + R_hi mu_lo, each operand read as
    tf32) against one tf32 product, with mu' ~100x the residual's scale (a channel mean 64-128x the residual range):
    the single product is off by up to 2^-10 of the mean term (measured 1.1e-3), i.e. 12% of the attention-dependent
    part; the split stays at ~2^-20 of the mean term (6e-7), 6e-5 of that part."""
    gen = torch.Generator().manual_seed(0)
    BM, D = 64, 128
    R = torch.rand(BM, 8, generator=gen) * 3e4  # row sums of P~ (<= 128 * 256), rescaled by the alphas
    mu = 64 * (1 + torch.rand(1, 8, D, generator=gen)) * 448 / 3  # mu' = mu / v_scale, v_scale = amax(resid) / 448
    tiles = sm90_mean_groups(mu).view(2, D, 8)
    mhi, mlo = tiles[0].T, tiles[1].T  # [8, D]
    rhi = _tf32(R)
    rlo = R - rhi
    exact = R.double() @ mu[0].double()
    split = (rhi.double() @ mhi.double() + _tf32(rlo).double() @ mhi.double() + rhi.double() @ _tf32(mlo).double())
    single = _tf32(R).double() @ _tf32(mu[0]).double()
    part = R.double().sum(1, keepdim=True) * 448 / 3  # the attention-dependent part: ~1 in units of the residual
    assert ((single - exact).abs() / part).max() > 3e-2
    assert ((split - exact).abs() / exact.abs()).max() < 2e-6 and ((split - exact).abs() / part).max() < 2e-4


def test_register_p_key_order_is_a_permutation_of_each_block():
    from vc_compile.kernels import vsmooth_attn_sm90 as g
    order = g.key_order_sm90(128)
    assert sorted(order) == list(range(128)) and order != list(range(128))
    # within a 32-key k-step of the MMA, the 4 lanes of a quad keep their own 8 keys (no data crosses threads)
    for k, n in enumerate(order):
        assert k // 32 == n // 32 and (k // 4) % 4 == (n // 2) % 4
    # p_operand's reshape / permute of P~ is the same relabelling, so P~' V' = P~ V with V's rows in `order`
    P, V = torch.randn(64, 128, dtype=torch.float64), torch.randn(128, 32, dtype=torch.float64)
    idx = torch.tensor(order)
    relabelled = P.reshape(64, 4, 2, 2, 4, 2).permute(0, 1, 2, 4, 3, 5).reshape(64, 128)
    assert torch.equal(relabelled, P[:, idx])
    assert torch.allclose(relabelled @ V[idx], P @ V, rtol=0, atol=1e-12)
    # the format layer and the kernel agree on the order
    assert order == sm90_key_order(128)


def test_default_tables_by_rows():
    """The measured defaults (configs.VSMOOTH_SM90_SHORT / _LONG): warp-specialised register P~ with row sums and
    the mean term by MMA from 4096 (ExpCast, D = 128: PV summed on the tensor cores over windows of 8 blocks) /
    6144 rows, below that shared-memory P~ (D = 128) or register P~ (D = 64)."""
    d = C.vsmooth_sm90_default
    assert d(128, True, 32760) == d(128, True, 4096) == dataclasses.replace(MS_WS, pv_window=8)
    assert d(128, True, 4095) == SMEM
    assert d(128, False, 75600) == d(128, False, 8190) == d(128, False, 6144) == MS_WS
    assert d(128, False, 6143) == SMEM
    assert d(64, True, 32760) == d(64, False, 32760) == MS_WS
    assert d(64, True, 4096) == d(64, False, 4096) == REG
    assert C.sm90_regime(128, True, 4096) == "long" and C.sm90_regime(128, False, 4096) == "short"
    for D in (64, 128):
        for e in (False, True):
            for S in (100, 5000, 40000):
                cands = C.vsmooth_sm90_candidates(D, e, S)
                assert cands[0] == d(D, e, S) and len(set(cands)) == len(cands) == 6


def test_pv_window_is_safe_on_smoothed_v_only():
    """Why ``pv_window`` needs V-Smooth's block means, on the CPU emulation of the kernel (``fp22_window_sums``:
    the FP8 MMA's running sum and each product aligned to the largest and cut to 13 bits, the model that reproduces
    the H200's numbers). Smoothed V: the residual changes sign within a block, the window's sum stays of the size
    of its products, and a window of 8 blocks leaves the error where the per-block fold has it (H200, S = 2048:
    6.778e-3 -> 6.783e-3; here 6.18e-3 -> 6.17e-3). Unsmoothed V: its mean piles up in the sum and every product
    loses low bits (H200 7.97e-3 -> 1.59e-2; here 7.56e-3 -> 1.49e-2), so the kernel, and the emulation, fold per
    block whenever the mean term is off (``zero_mean``)."""
    from vc_compile.reference import vsmooth_attn_sm90 as emu
    S = 2048
    q, k, v = make_qkv(1, 1, S, 128, torch.bfloat16, device="cpu")
    rows = torch.arange(0, S, 64)
    truth = torch.softmax((q[:, :, rows].double() @ k.double().transpose(-1, -2)) * 128 ** -0.5, -1) @ v.double()
    err = lambda qk, vq, w: rel(emu.attention(qk, vq, rows=rows, out_dtype=torch.float32, pv_window=w), truth)  # noqa: E731
    qk, vq = quantise(q, k, v, "int8", True)
    assert err(qk, vq, 8) <= 1.02 * err(qk, vq, 1)
    qk, vq = quantise(q, k, v, "int8", False)
    forced = vq._replace(zero_mean=False)  # v_mean is all zeros: the window runs, the mean term adds nothing
    assert err(qk, forced, 8) >= 1.6 * err(qk, forced, 1)
    assert torch.equal(emu.attention(qk, vq, rows=rows, out_dtype=torch.float32, pv_window=8),
                       emu.attention(qk, vq, rows=rows, out_dtype=torch.float32, pv_window=1))


def test_config_validation():
    """Named fields and str enums; the combinations the kernel has no code for are refused, naming the field."""
    assert VSmoothSm90Config(p_operand="registers", rowsum="mma", mean="tf32_window").mma_sums
    assert VSmoothSm90Config.from_json(MS_WS.to_json()) == MS_WS
    with pytest.raises(ValueError, match="rowsum='mma' takes P~ from registers"):
        VSmoothSm90Config(**MS)
    with pytest.raises(ValueError, match="warp specialisation needs p_operand='registers'"):
        VSmoothSm90Config(warp_specialize=True)
    with pytest.raises(ValueError, match="4 warps and block_m = 64"):
        VSmoothSm90Config(p_operand="registers", warp_specialize=True, block_m=128)
    with pytest.raises(ValueError, match="goes with mean='tf32_window'"):
        VSmoothSm90Config(p_operand="registers", rowsum="mma")
    with pytest.raises(ValueError, match="rowsum is 'fp16'"):
        VSmoothSm90Config(rowsum="fp32")
    with pytest.raises(ValueError, match="p_operand.*accepted"):
        VSmoothSm90Config(p_operand="tmem")
    with pytest.raises(ValueError, match="pv_window > 1 is built on the warp-specialised"):
        VSmoothSm90Config(p_operand="registers", rowsum="mma", mean="tf32_window", pv_window=8)
    with pytest.raises(ValueError, match="pv_window=3; accepted"):
        dataclasses.replace(MS_WS, pv_window=3)
    assert VSmoothSm90Config.from_json(dataclasses.replace(MS_WS, pv_window=4).to_json()).pv_window == 4
    with pytest.raises(TypeError, match="VSmoothSm90Config"):
        from vc_compile.kernels import vsmooth_attn_sm90 as g
        g.vsmooth_attention_sm90(None, None, launch=(64, 4, 2, 1, 1, 1, 1))


def test_dispatch_rule_on_cpu():
    cpu = torch.device("cpu")
    assert not dispatch.uses_sm90(cpu, "int8")
    assert dispatch.vsmooth_kernel(cpu, "int8") == "vsmooth_attn"
    assert dispatch.vsmooth_kernel(cpu, "int8", launch=MS_WS) == "vsmooth_attn_sm90"  # a config picks its kernel
    assert dispatch.vsmooth_kernel(cpu, "int8", launch=C.VSmoothTritonConfig()) == "vsmooth_attn"


def _both(qk, vq, expcast, return_lse=False, out_dtype=torch.bfloat16):
    """(the runtime's kernel on this GPU: Gluon, the Triton kernel at its default)."""
    o = dispatch.vsmooth_attention(T, qk, vq, expcast=expcast, return_lse=return_lse, out_dtype=out_dtype)
    t = attn(qk, vq, expcast=expcast, return_lse=return_lse, out_dtype=out_dtype)
    return o, t


@requires_sm90
def test_gpu_dispatches_to_sm90():
    cuda = torch.device("cuda")
    assert dispatch.uses_sm90(cuda, "int8") and dispatch.vsmooth_kernel(cuda, "int8") == "vsmooth_attn_sm90"
    assert not dispatch.uses_sm90(cuda, "fp8")  # FP8 Q/K: the Triton kernel
    assert dispatch.vsmooth_kernel(cuda, "int8", launch=C.VSMOOTH_TRITON_DEFAULT[(128, False)]) == "vsmooth_attn"


@requires_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [100, 256, 4096, 4173])
@pytest.mark.parametrize("expcast", [False, True])
def test_gpu_matches_reference_truth_and_triton(D, S, expcast):
    """S = 100: one (tail) block only; 256: no tail; 4173: full blocks + a 77-key tail."""
    q, k, v = make_qkv(1, 4, S, D, torch.bfloat16, device="cuda")
    truth = truth_of(q, k, v)
    for smooth in (True, False):
        qk, vq = quantise(q, k, v, "int8", smooth)
        (o, lse), (t, tlse) = _both(qk, vq, expcast, return_lse=True)
        ro, rlse = ref.vsmooth_attention(qk, vq, expcast=expcast, return_lse=True)
        assert torch.isfinite(o).all()
        assert rel(o, ro) <= REF_TOL
        assert rel(o, truth) <= 1.25 * rel(ro, truth) + 1e-3
        assert rel(o, t) <= 1e-2
        assert (lse - rlse).abs().mean().item() <= 1e-2 and (lse - tlse).abs().mean().item() <= 1e-3
        # the exp2 path forms its logits with one rounding fewer than the Triton kernel (the scales fold
        # into the exponent's FFMA), so an element at an FP8 rounding boundary may round the other way:
        # one P~ element off by one code changes l by at most 1/16 of l, log2(1 + 1/16) = 0.0875
        assert (lse - tlse).abs().max().item() <= 0.0875


@requires_sm90
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_gpu_out_dtypes(out_dtype):
    q, k, v = make_qkv(2, 3, 777, 128, torch.float16, device="cuda")
    qk, vq = quantise(q, k, v)
    o, t = _both(qk, vq, False, out_dtype=out_dtype)
    assert o.dtype == out_dtype and rel(o, t) <= 1e-2


@requires_sm90
@pytest.mark.parametrize("expcast", [False, True])
def test_gpu_zero_sm_scale_uniform_rows(expcast):
    """qs = 0 on every row: the tail block must scale before its -inf mask (0 * -inf = NaN otherwise)."""
    q, k, v = make_qkv(1, 2, 200, 64, torch.bfloat16, device="cuda")
    qk, vq = ref_pre.preprocess_qk(q, k, sm_scale=0.0), ref_pre.preprocess_v(v)
    o = dispatch.vsmooth_attention(T, qk, vq, expcast=expcast, out_dtype=torch.float32)
    assert torch.isfinite(o).all()
    assert rel(o, v.float().mean(dim=2, keepdim=True).expand_as(o)) <= 2e-2


@requires_sm90
@pytest.mark.parametrize("expcast", [False, True])
def test_gpu_nan_rows_stay_nan(expcast):
    """A NaN in one query row: that row NaN (q_scale NaN), every other row finite and as the Triton kernel."""
    q, k, v = make_qkv(1, 2, 300, 128, torch.bfloat16, device="cuda")
    q[0, 1, 17, 5] = float("nan")
    qk, vq = quantise(q, k, v)
    o, t = _both(qk, vq, expcast)
    bad = ~torch.isfinite(o).all(-1)
    assert bad[0, 1, 17] and int(bad.sum()) == 1
    keep = ~bad
    assert rel(o[keep], t[keep]) <= 1e-2


@requires_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [100, 256, 300, 2048, 4173])
@pytest.mark.parametrize("config", [REG, VSmoothSm90Config(p_operand="registers", warp_specialize=True),
                                    VSmoothSm90Config(p_operand="registers", warp_specialize=True, stages=3),
                                    MS_WS, VSmoothSm90Config(p_operand="registers", **MS),
                                    dataclasses.replace(MS_WS, pv_window=2), dataclasses.replace(MS_WS, pv_window=8)],
                         ids=["reg", "reg_ws", "reg_ws_s3", "ms_ws", "ms", "ms_ws_w2", "ms_ws_w8"])
@pytest.mark.parametrize("expcast", [False, True])
def test_gpu_register_p_configs_match_shared_memory_p(D, S, config, expcast):
    """P~ in registers (keys relabelled, V^T reordered), with and without warp specialisation, against the
    shared-memory-P~ kernel: the same codes and scales, only the order of fp32 additions in PV and of the fp16
    row sum differs (measured max abs 2e-3 on outputs ~1 at S = 32760). S = 300 leaves the second consumer warp
    group of the warp-specialised kernel with rows past S. On the exp2 path (V-Smooth and naive 8-bit) these
    compiles returned wrong or NaN rows with the mean term on until P~ was packed by ``e4m3x4``
    (docs/design/e4m3x4-packing.md).
    MS (row sums and the mean term by MMA): row sums exact in fp32 instead of an fp16 sum,
    the mean term added per 8 blocks (S = 2048: 16 blocks, both windows full; 4173: four full windows and a
    1-block one). ``pv_window``: PV summed by the FP8 MMA over 2 / 8 blocks before each fp32 fold (S = 4173: a
    window cut short by the last block)."""
    from vc_compile.kernels import vsmooth_attn_sm90 as g
    q, k, v = make_qkv(1, 3, S, D, torch.bfloat16, device="cuda")
    for smooth in (True, False):
        qk, vq = quantise(q, k, v, "int8", smooth)
        o, lse = g.vsmooth_attention_sm90(qk, vq, expcast=expcast, return_lse=True, launch=config)
        t, tlse = g.vsmooth_attention_sm90(qk, vq, expcast=expcast, return_lse=True, launch=SMEM)
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()
        assert rel(o, t) <= 1e-2
        assert (lse - tlse).abs().max().item() <= 1e-2


@requires_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [100, 300, 4173])
@pytest.mark.parametrize("config", [SMEM, VSmoothSm90Config(p_operand="registers", warp_specialize=True), MS_WS],
                         ids=["smem", "reg_ws", "ms_ws"])
def test_gpu_folded_expcast_matches_two_roundings_and_reference(D, S, config):
    """The Gluon kernel's ExpCast on full blocks (the code's rounding folded into one FFMA) against the Triton
    kernel, which forms the code with the reference's two roundings (s, then the code; the Gluon kernel's
    key-tail block does the same): codes move by <= |qk| / 2C < 0.08 of a code (``softmax_block``), so a few per
    mille of them round the other way (CPU emulation: 0.5%, against 0.003% for the two roundings), each by one
    code. Bound: the reference tolerance. (Before the two-roundings full-block variant was deleted this compared
    the two modes inside the Gluon kernel; the Triton kernel's arithmetic is that variant's.)"""
    from vc_compile.kernels import vsmooth_attn_sm90 as g
    q, k, v = make_qkv(1, 3, S, D, torch.bfloat16, device="cuda")
    truth = truth_of(q, k, v)
    for smooth in (True, False):
        qk, vq = quantise(q, k, v, "int8", smooth)
        o, lse = g.vsmooth_attention_sm90(qk, vq, expcast=True, return_lse=True, launch=config)
        t, tlse = attn(qk, vq, expcast=True, return_lse=True)
        ro = ref.vsmooth_attention(qk, vq, expcast=True)
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()
        assert rel(o, ro) <= REF_TOL and rel(o, t) <= 1e-2
        assert rel(o, truth) <= 1.1 * rel(t, truth) + 1e-3
        assert (lse - tlse).abs().max().item() <= 1e-2


@requires_sm90
@pytest.mark.parametrize("expcast", [False, True])
def test_gpu_pv_window_keeps_the_two_level_accuracy(expcast):
    """``pv_window=8`` leaves PV in the FP8 MMA's accumulator (~13-bit running sum) for 8 blocks before each fp32
    fold: on a long head its error against fp32 stays the two-level kernel's (H200, 40 x 32760: 6.206e-3 vs
    6.203e-3), where summing every block in the MMA (FA3's way) measured 1.5-1.7x. Structured inputs (outliers in
    V), 20000 keys: <= 1.02x the one-block window's error."""
    from vc_compile.kernels import vsmooth_attn_sm90 as g
    q, k, v = make_qkv(1, 2, 20000, 128, torch.bfloat16, device="cuda")
    truth = truth_of(q, k, v)
    qk, vq = quantise(q, k, v, "int8", True)
    w1 = g.vsmooth_attention_sm90(qk, vq, expcast=expcast, launch=MS_WS)
    w8 = g.vsmooth_attention_sm90(qk, vq, expcast=expcast, launch=dataclasses.replace(MS_WS, pv_window=8))
    assert torch.isfinite(w8).all()
    assert rel(w8, truth) <= 1.02 * rel(w1, truth)


@requires_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("expcast", [False, True])
@pytest.mark.parametrize("window", [1, 8])
def test_gpu_ms_mean_term_keeps_fp32_accuracy_on_large_means(D, expcast, window):
    """MS adds the mean term r mu' by tf32 MMAs. V = residual + 64 x a channel bias: the output is ~64 while its
    attention-dependent part is ~1, so an 11-bit (one tf32 MMA) mean term would be off by 3-12% of that part
    (``test_ms_hi_lo_split_is_needed_for_large_means``); the hi / lo split (3 MMAs) keeps ~2^-20. Against the
    shared-memory-P~ kernel (mean term in fp32 FFMAs), fp32 outputs, error relative to the attention-dependent part
    O - mean(V): <= 2e-3 (the codes and scales are the same; what differs is the fp32 summation order and the fp16
    vs exact row sum, ~1e-3)."""
    from vc_compile.kernels import vsmooth_attn_sm90 as g
    q, k, v = make_qkv(1, 2, 2500, D, torch.bfloat16, device="cuda")
    bias = 64 * (1 + torch.rand(D, device="cuda"))
    v = (v.float() + bias).to(torch.bfloat16)
    qk, vq = quantise(q, k, v, "int8", True)
    ms = g.vsmooth_attention_sm90(qk, vq, expcast=expcast, out_dtype=torch.float32,
                                  launch=dataclasses.replace(MS_WS, pv_window=window))
    sm = g.vsmooth_attention_sm90(qk, vq, expcast=expcast, out_dtype=torch.float32, launch=SMEM)
    part = sm - v.float().mean(dim=2, keepdim=True)
    # window 8: the FP8 MMA sums 8 blocks of P~ R before the fp32 fold, +15-20% on this kernel-to-kernel
    # difference (H200: 2.31-2.35e-3; on structured inputs 1.06e-3 vs 0.88e-3 at the same error against fp64);
    # a one-MMA tf32 mean term would be 3-12% off, so the bound still tells the hi / lo split apart
    assert ((ms - sm).norm() / part.norm()).item() <= (2e-3 if window == 1 else 2.5e-3)


# ---- ExpCast's clamp as a byte mask (``softmax.codes_masked``) --------------------------------------------
def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode) on Python ints: result byte i from selector nibble i, bits 0-2 the byte of
    {b, a} (a: 0-3), bit 3 replicating that byte's top bit."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        out |= (0xFF if byte & 0x80 else 0x00) << (8 * i) if nib & 8 else byte << (8 * i)
    return out


def _run_codes_masked_ptx(words):
    """Execute ``CODES_MASKED_PTX`` as written (its prmt / not / and lines) on four 32-bit words."""
    import re
    from vc_compile.kernels.vsmooth_attn_sm90_softmax import CODES_MASKED_PTX
    text = CODES_MASKED_PTX.value if hasattr(CODES_MASKED_PTX, "value") else CODES_MASKED_PTX
    reg = {f"${i + 1}": w for i, w in enumerate(words)}
    ops = 0
    for line in text.split("\n"):
        line = line.strip().strip("{}").strip()
        if line.startswith(".reg") or not line:
            continue
        m = re.match(r"(prmt\.b32|not\.b32|and\.b32)\s+([^;]+);", line)
        assert m, f"unexpected PTX line {line!r}"
        op, args = m.group(1), [x.strip() for x in m.group(2).split(",")]
        if op == "prmt.b32":
            reg[args[0]] = _prmt(reg[args[1]], reg[args[2]], int(args[3], 16))
        elif op == "not.b32":
            reg[args[0]] = ~reg[args[1]] & 0xFFFFFFFF
        else:
            reg[args[0]] = reg[args[1]] & reg[args[2]]
        ops += 1
    assert ops == 6  # 4 PRMT, NOT + AND (one LOP3 in SASS)
    return reg["$0"]


def test_byte_mask_clamp_is_the_fmnmx_clamp():
    """The packed byte-mask clamp gives the bytes of max(y, 2^23) for every y the FFMA can produce while codes stay
    >= -2^22: codes 0..126 (y = 2^23 + c), every half-step below code 0 down to -2^22 (y in [2^22, 2^23), ulp
    1/2), NaN and -Inf (+Inf cannot leave the FFMA with finite coefficients); checked by running the kernel's
    PTX text on the words."""
    import random
    import struct
    bits = lambda f: struct.unpack("<I", struct.pack("<f", f))[0]  # noqa: E731
    C = 8388608.0
    ys = [C + c for c in range(127)] + [C - d / 2 for d in range(1, 4000)] + [C / 2, C / 2 + 0.5, C - 0.5]
    rng = random.Random(0)
    ys += [C - rng.uniform(0, C / 2) for _ in range(4000)]  # any point of [2^22, 2^23)
    words = [bits(y) for y in ys] + [0x7FC00000, 0xFF800000]  # + NaN, -Inf: FMNMX(., 2^23) = 2^23, code 0
    want = [bits(max(y, C)) & 0xFF for y in ys] + [0, 0]
    words, want = words + words[:(-len(words)) % 4], want + want[:(-len(want)) % 4]  # whole words of 4
    for i in range(0, len(words), 4):
        got = _run_codes_masked_ptx(words[i:i + 4])
        assert [(got >> (8 * j)) & 0xFF for j in range(4)] == want[i:i + 4], (i, [hex(w) for w in words[i:i + 4]])


def test_byte_mask_guard_bounds_every_code():
    """``bytemask_ok``'s condition 8 ks qs <= 1 keeps the lowest possible code above -2^22 at D <= 128 (the mask
    reads exponent 149; a code below -2^22 would land in exponent 148, whose bit 23 is clear): the widest INT8 score
    range is 2 * 127^2 * D."""
    for D in (64, 128):
        lowest = 119.65 - 1.0 * 2 * 127 ** 2 * D
        assert lowest > -2 ** 22


@requires_sm90
@pytest.mark.parametrize("S", [300, 4173])
@pytest.mark.parametrize("scale", [1.0, 20.0, 60.0])
def test_gpu_byte_mask_matches_fmnmx_clamp_bit_for_bit(S, scale):
    """byte_mask on and off give the same bits (the same codes, clamped in the packing instead of by FMNMX);
    scale = 60 makes 8 ks qs > 1 so ``bytemask_ok`` sends the program to the FMNMX-clamp loop. NOTE there (8 ks
    qs = 7-8, base-2 logits up to ~1e4) ExpCast's single-FFMA code is out of its exact range (8 ks qs < ~0.6)
    and every ExpCast kernel, shared-memory P~ included, returns NaN rows (H200, 2026-12-02): the same NaN
    rows with and without the byte mask, which is what this test checks; the op keeps such sites on stock
    SDPA through ``max_logit_std``."""
    from vc_compile.kernels import vsmooth_attn_sm90 as g
    q, k, v = make_qkv(1, 3, S, 128, torch.bfloat16, device="cuda")
    q, k = (q.float() * scale).bfloat16(), (k.float() * scale).bfloat16()
    qk, vq = quantise(q, k, v, "int8", True)
    on = g.vsmooth_attention_sm90(qk, vq, expcast=True, launch=MS_WS)
    off = g.vsmooth_attention_sm90(qk, vq, expcast=True, launch=VSmoothSm90Config(
        p_operand=POperand.REGISTERS, warp_specialize=True, byte_mask=False, **MS))
    assert MS_WS.byte_mask
    torch.testing.assert_close(on, off, rtol=0, atol=0, equal_nan=True)
    if scale <= 20:
        t = g.vsmooth_attention_sm90(qk, vq, expcast=True, launch=SMEM)
        assert torch.isfinite(on).all() and rel(on, t) <= 1e-2


_GUARD_CODE = r"""
import torch
from triton.runtime import driver
import codegen_stats as cs
import codegen_fingerprint as fp
driver.set_active(cs._FakeDriver())
from triton.runtime.jit import JITFunction
from vc_compile.kernels import vsmooth_attn_sm90 as g
from vc_compile.kernels.configs import vsmooth_sm90_default
from triton import knobs
knobs.runtime.launch_enter_hook = None  # the binder's path would build launch metadata (a loaded kernel) for a chain

built = []
orig = JITFunction.run
def run(self, *a, grid, warmup, **kw):  # build (never launch); the build reads as loaded with SPILL bytes of spills
    k = orig(self, *a, grid=grid, warmup=True, **kw)
    if k._run is None:  # first seen: a new build; its launcher records nothing
        built.append(kw["BYTEMASK"])
        k._run = lambda *args: None
        k.n_spills = SPILL // 4
    return orig(self, *a, grid=grid, warmup=False, **kw)
run.__wrapped__ = orig
JITFunction.run = run
cfg = vsmooth_sm90_default(128, True, 32760)
assert cfg.byte_mask
qk, vq = fp._vs_inputs(32760, 128, True)
for _ in range(3):
    g.vsmooth_attention_sm90(qk, vq, expcast=True, launch=cfg)
print("RESULT", built, g.BYTEMASK_GUARD.summary())
"""


@pytest.mark.parametrize("spill", [16, 372])
def test_byte_mask_guard_takes_the_fmnmx_clamp_where_the_build_spills(spill):
    """The ExpCast default's byte-mask clamp is kept where its build spills what Triton 3.6's does (16 bytes) and
    replaced by the FMNMX clamp (the same bits: ``test_gpu_byte_mask_matches_fmnmx_clamp_bit_for_bit``) from the
    next launch on where it spills what Triton 3.9's does (372 bytes): offline sm_90 builds, the loaded kernel's
    spill count faked (only a GPU loads a kernel)."""
    from offline_sm90 import result_line
    line, why = result_line(f"SPILL = {spill}\n" + _GUARD_CODE)
    if spill == 16:  # built once (the later calls are remembered launches or cache hits), never swapped
        assert line.startswith("RESULT [1") and "0" not in line.split("]")[0] and line.endswith("None"), why
    else:
        assert line.startswith("RESULT [1, 0"), why
        assert "spilled up to 372 bytes" in line and "FMNMX clamp runs there" in line, why


def test_byte_mask_guard_reads_only_loaded_kernels():
    from vc_compile.kernels.vsmooth_attn_sm90 import BytemaskGuard

    class Loaded:
        n_spills = 20  # 80 bytes

    g = BytemaskGuard(limit=64)
    g.check(("a",), object())  # an offline build: nothing to read, nothing decided
    assert g.spilled == {} and g.summary() is None
    g.check(("a",), Loaded())
    assert g.spilled == {("a",): True} and "80 bytes" in g.summary()
    Loaded.n_spills = 4
    g.check(("b",), Loaded())
    assert g.spilled[("b",)] is False and len(g.swapped) == 1
    g.clear()
    assert g.summary() is None
