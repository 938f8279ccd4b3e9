"""The optional FP8 baselines of the kernel benchmarks (benchmarks/common.py), on CPU: without a sm_90 GPU both
report why they are skipped; FA3's FP8 plumbing (per-(batch, head) quantisation, descales, [B, S, H, D] layout)
against SDPA through a stand-in ``flash_attn_func``; and the shim that lets torch's FA3 SDPA backend (what
torchao's FP8 attention runs on) find the fa3-fwd wheel: a no-op without the modules, and, in a subprocess
with stand-in ``fa3_fwd`` ops, the aliases that ``activate_flash_attention_impl("FA3")`` then accepts and
calls through."""
import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_FA3 = any(importlib.util.find_spec(m) is not None for m in ("fa3_fwd_interface", "flash_attn_interface"))


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_fp8_baselines_skip_with_a_reason_on_cpu():
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    for name, status, make in (("fa3-fp8", common.fa3_fp8_status, common.fa3_fp8_fn),
                               ("torchao-fp8", common.torchao_fp8_status, common.torchao_fp8_fn)):
        func, note = status()
        assert func is None
        assert note.startswith(f"{name} skipped") and "sm_90" in note and "GPU" in note
        assert make(q, q, q) is None
    assert common.fa3_fp8_fn(q, q, q, quantize_inside=True) is None
    with common.fa3_sdpa_impl():  # a no-op without torchao-fp8
        pass


def test_fa3_shim_is_a_no_op_without_the_modules():
    names = ("vc_test_absent_src", "vc_test_absent_dst", "vc_test_absent_src_ns", "vc_test_absent_dst_ns")
    assert common._torchao_fa3_shim(*names) is False
    assert names[0] not in sys.modules and names[1] not in sys.modules
    assert not hasattr(torch.ops.vc_test_absent_dst_ns, "fwd")
    if not REAL_FA3:  # the real names: nothing installed here, so nothing to alias
        assert common._torchao_fa3_shim() is False
        assert "flash_attn_interface" not in sys.modules


def test_fa3_shim_leaves_an_importable_destination_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "vc_test_present_src", types.ModuleType("vc_test_present_src"))
    dst = types.ModuleType("vc_test_present_dst")
    monkeypatch.setitem(sys.modules, "vc_test_present_dst", dst)
    assert common._torchao_fa3_shim("vc_test_present_src", "vc_test_present_dst", "vc_test_ps", "vc_test_pd") is False
    assert sys.modules["vc_test_present_dst"] is dst
    assert not hasattr(torch.ops.vc_test_pd, "fwd")


# The two ops of the fa3-fwd 0.0.3 wheel that torch's FA3 backend looks up (schemas as its extension defines them)
FA3_FWD_SCHEMA = (
    "fwd(Tensor q,Tensor k,Tensor v,Tensor(k_new!)? k_new = None,Tensor(v_new!)? v_new = None,Tensor? q_v = None,"
    "Tensor(out!)? out = None,Tensor? cu_seqlens_q = None,Tensor? cu_seqlens_k = None,Tensor? cu_seqlens_k_new = None,"
    "Tensor? seqused_q = None,Tensor? seqused_k = None,int? max_seqlen_q = None,int? max_seqlen_k = None,"
    "Tensor? page_table = None,Tensor? kv_batch_idx = None,Tensor? leftpad_k = None,Tensor? rotary_cos = None,"
    "Tensor? rotary_sin = None,Tensor? seqlens_rotary = None,Tensor? q_descale = None,Tensor? k_descale = None,"
    "Tensor? v_descale = None,float? softmax_scale = None,bool is_causal = False,int window_size_left = -1,"
    "int window_size_right = -1,int attention_chunk = 0,float softcap = 0.0,bool is_rotary_interleaved = False,"
    "Tensor? scheduler_metadata = None,int num_splits = 0,bool? pack_gqa = None,int sm_margin = 0)"
    " -> (Tensor(out!), Tensor, Tensor, Tensor)")
FA3_BWD_SCHEMA = (
    "bwd(Tensor dout,Tensor q,Tensor k,Tensor v,Tensor out,Tensor softmax_lse,Tensor(dq!)? dq = None,"
    "Tensor(dk!)? dk = None,Tensor(dv!)? dv = None,Tensor? cu_seqlens_q = None,Tensor? cu_seqlens_k = None,"
    "Tensor? seqused_q = None,Tensor? seqused_k = None,int? max_seqlen_q = None,int? max_seqlen_k = None,"
    "float? softmax_scale = None,bool is_causal = False,int window_size_left = -1,int window_size_right = -1,"
    "float softcap = 0.0,bool deterministic = False,int sm_margin = 0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")

SHIM_SCRIPT = textwrap.dedent('''
    import sys, types
    import torch
    from benchmarks import common

    seen = {}
    lib = torch.library.Library("fa3_fwd", "DEF")
    lib.define(FWD)
    lib.define(BWD)

    def fwd(q, k, v, *args, **kwargs):
        names = [a.name for a in torch.ops.fa3_fwd.fwd.default._schema.arguments][3:]
        bound = dict(zip(names, args), **kwargs)
        seen.update(bound)
        out = bound["out"]
        out.copy_(torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2).float() for t in (q, k, v))).transpose(1, 2))
        return out, q.new_zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32), q.new_empty(0), q.new_empty(0)

    lib.impl("fwd", fwd, "CPU")
    sys.modules["fa3_fwd_interface"] = fake = types.ModuleType("fa3_fwd_interface")
    assert not hasattr(torch.ops.flash_attn_3, "fwd")
    assert common._torchao_fa3_shim() is True
    assert common._torchao_fa3_shim() is True  # idempotent
    assert sys.modules["flash_attn_interface"] is fake
    for name in ("fwd", "bwd"):
        a, b = (str(getattr(getattr(torch.ops, ns), name).default._schema) for ns in ("flash_attn_3", "fa3_fwd"))
        assert a.split("::", 1)[1] == b.split("::", 1)[1], (a, b)

    from torch.nn.attention import (activate_flash_attention_impl, current_flash_attention_impl,
                                    restore_flash_attention_impl)
    from torch.nn.attention import _fa3
    activate_flash_attention_impl("FA3")  # imports flash_attn_interface, needs flash_attn_3.fwd/bwd
    assert current_flash_attention_impl() == "FA3"
    q, k, v = (torch.randn(1, 16, 2, 32) for _ in range(3))  # [B, S, H, D]
    d = torch.full((1, 2), 0.5)
    out = torch.empty_like(q)
    o, lse = _fa3._fa3_run_forward(q, k, v, None, None, 16, 16, None, False, None, None, None, out=out,
                                   q_descale=d, k_descale=d, v_descale=d)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert o is out and torch.allclose(o.transpose(1, 2), ref, atol=1e-5)
    assert seen["q_descale"] is d and seen.get("is_causal", False) is False and seen["max_seqlen_q"] == 16
    restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    print("SHIM OK")
''')


@pytest.mark.skipif(REAL_FA3, reason="a real FA3 module is installed: the stand-in would clash with it")
@pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"), reason="torch < 2.11")
def test_fa3_shim_aliases_what_torch_fa3_backend_needs():
    script = f"FWD = {FA3_FWD_SCHEMA!r}\nBWD = {FA3_BWD_SCHEMA!r}\n" + SHIM_SCRIPT
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "SHIM OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def _fake_flash_attn_func(calls, as_tuple):
    """FA3's ``flash_attn_func`` signature: plain fp32 attention on the dequantised FP8 inputs [B, S, H, D]."""
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, **kw):
        B, S, H, D = q.shape
        for t in (q, k, v):
            assert t.dtype == torch.float8_e4m3fn and t.shape == (B, S, H, D) and t.stride(-1) == 1
        for d in (q_descale, k_descale, v_descale):
            assert d.dtype == torch.float32 and d.shape == (B, H)
        assert not causal and softmax_scale is None
        calls.append(1)
        deq = [(t.float() * d[:, None, :, None]).transpose(1, 2) for t, d in ((q, q_descale), (k, k_descale),
                                                                                 (v, v_descale))]
        out = F.scaled_dot_product_attention(*deq).transpose(1, 2).to(torch.bfloat16)
        return (out, torch.zeros(B, H, S)) if as_tuple else out
    return flash_attn_func


@pytest.mark.parametrize("layout", ["bshd_view", "bhsd"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_fa3_fp8_plumbing_matches_sdpa(monkeypatch, layout, as_tuple):
    calls = []
    mod = types.ModuleType("fa3_fwd_interface")
    mod.flash_attn_func = _fake_flash_attn_func(calls, as_tuple)
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", mod)
    func = common._fa3_fp8_import()
    assert func is mod.flash_attn_func
    g = torch.Generator().manual_seed(1)
    B, H, S, D = 1, 2, 64, 64
    # q and v far above e4m3's range (448), k deep in its subnormals (< 2^-6), logits ~ N(0, 1.5^2): without the
    # per-head scales (or with wrong descales) the error is ~0.7 or NaN; with them ~0.055
    mags = (300.0, 0.005, 900.0)
    if layout == "bshd_view":
        q, k, v = (m * torch.randn(B, S, H, D, generator=g).bfloat16().transpose(1, 2) for m in mags)
    else:
        q, k, v = (m * torch.randn(B, H, S, D, generator=g).bfloat16() for m in mags)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    fn = common._fa3_fp8_call(func, q, k, v)
    assert calls == []  # quantised here, the kernel only on a call
    out = fn()
    assert calls == [1] and out.shape == (B, H, S, D) and out.dtype == torch.bfloat16
    err = _rel_l2(out, ref)
    assert 1e-3 < err < 0.1, err  # FP8 error, but small
    out2 = common._fa3_fp8_call(func, q, k, v, quantize_inside=True)()
    assert torch.equal(out, out2)


def test_fp8_per_head_scales():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 32, 16, generator=g) * torch.tensor([1.0, 10.0, 1e3, 0.0]).view(1, 4, 1, 1)
    x = x.bfloat16()
    x8, d = common.fp8_per_head(x)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == (2, 32, 4, 16) and d.shape == (2, 4)
    amax = x.float().abs().amax(dim=(2, 3))
    assert torch.allclose(d[:, :3], amax[:, :3] / 448.0) and torch.equal(d[:, 3], torch.ones(2))
    deq = x8.float() * d[:, None, :, None]
    assert torch.isfinite(deq).all()
    assert torch.allclose(deq.abs().amax(dim=(1, 3))[:, :3], amax[:, :3], rtol=1e-6)  # amax maps to 448 exactly
    assert _rel_l2(deq.transpose(1, 2)[:, :3], x.float()[:, :3]) < 0.05
    x8g, dg = common.fp8_per_head(x, groups=2)  # GQA queries: one scale per pair of heads
    assert dg.shape == (2, 2)
    assert torch.allclose(dg, amax.view(2, 2, 2).amax(-1) / 448.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["fa3-fp8", "torchao-fp8"])
def test_fp8_baselines_on_the_gpu(name):
    """Where a baseline is available (sm_90 + its packages): [B, H, S, D] bf16 out, close to SDPA, and torch's
    flash impl as it was before (torchao's runs with FA3 active only inside its call)."""
    status, make = {"fa3-fp8": (common.fa3_fp8_status, common.fa3_fp8_fn),
                    "torchao-fp8": (common.torchao_fp8_status, common.torchao_fp8_fn)}[name]
    func, note = status()
    if func is None:
        pytest.skip(note)
    from torch.nn.attention import current_flash_attention_impl

    before = current_flash_attention_impl()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 1024, 4, 128, device="cuda", generator=g).bfloat16().transpose(1, 2)
               for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    fns = [make(q, k, v)] + ([make(q, k, v, quantize_inside=True)] if name == "fa3-fp8" else [])
    for fn in fns:
        out = fn()
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        assert 1e-3 < _rel_l2(out, ref) < 0.1, (_rel_l2(out, ref), note)
    assert current_flash_attention_impl() == before
    with common.fa3_sdpa_impl():
        assert name != "torchao-fp8" or current_flash_attention_impl() == "FA3"
        out2 = fns[0]()
    assert current_flash_attention_impl() == before
    assert _rel_l2(out2, ref) < 0.1
