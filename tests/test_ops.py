"""The vcattn:: custom ops: schema, fake impls, and torch.library.opcheck (the contract Inductor relies on)."""
import math

import pytest
import torch
import torch.nn.functional as F

import vc_compile
from vc_compile.config import VCConfig
from vc_compile.reference import pddp, select
from vc_compile.runtime import report as _report


def qkv(S=200, D=64, dtype=torch.bfloat16, strided=False):
    if strided:  # [B, S, H, D] projections seen through a permute, as in diffusers
        return tuple(torch.randn(1, S, 2, D, dtype=dtype).permute(0, 2, 1, 3) for _ in range(3))
    return tuple(torch.randn(1, 2, S, D, dtype=dtype) for _ in range(3))


def site(method):
    return _report.register_site(graph="test", node="n", module="m", shape="?", dtype="bf16",
                                 method=method, rewritten=True).site


@pytest.mark.parametrize("method", ["dense", "vsmooth", "mcsparse"])
@pytest.mark.parametrize("strided", [False, True])
def test_opcheck_attention(method, strided):
    q, k, v = qkv(strided=strided)
    cfg = VCConfig.from_options({"method": method, "min_seq_len": 16, "density": 0.5}).to_json()
    # opcheck calls the op with copies of its arguments, and a copy of ident at an address an earlier copy had
    # is, to MC-Sparse's identity check, possibly another block's weight (the site then refuses, and outputs
    # differ between opcheck's passes); None: the caller's own site, one block (ops.identity_problem)
    ident = None if method == "mcsparse" else torch.randn(4, 4)
    with vc_compile.sampling(num_steps=10):
        vc_compile.step(0)  # every call is a new branch of step 0: fresh metadata, deterministic
        torch.library.opcheck(torch.ops.vcattn.attention.default, (q, k, v, ident, site(method), cfg, None))


def test_attention_fake_and_real_agree_on_layout():
    q, k, v = qkv(strided=True)
    cfg = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 16}).to_json()
    out = torch.ops.vcattn.attention(q, k, v, None, site("vsmooth"), cfg, None)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = torch.ops.vcattn.attention(fq, fk, fv, None, 1, cfg, None)
    assert fake.shape == out.shape and fake.stride() == out.stride() and fake.dtype == out.dtype


def test_runtime_short_sequence_falls_back_with_reason():
    q, k, v = qkv(S=40)
    s = site("vsmooth")
    cfg = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 64}).to_json()
    out = torch.ops.vcattn.attention(q, k, v, None, s, cfg, None)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert _report.site(s).runtime_fallbacks["sequence too short"] == 1


@pytest.mark.parametrize("expcast", [False, True])
def test_opcheck_vsmooth_attention(expcast):
    q, k, v = qkv()
    perm = torch.stack([torch.randperm(200) for _ in range(2)]).view(1, 2, 200)
    torch.library.opcheck(torch.ops.vcattn.vsmooth_attention.default,
                          (q, k, v, perm, expcast, True, "int8", True, None))


def test_opcheck_sparse_attention():
    q, k, v = qkv()
    sigma = pddp.pddp_perm(q, 64)
    idx = torch.sort(torch.randperm(200)[:64]).values.int().expand(1, 2, 4, 64).contiguous()
    res = torch.randn(1, 2, 200, 64, dtype=torch.bfloat16) * 0.01
    torch.library.opcheck(torch.ops.vcattn.sparse_attention.default, (q, k, v, sigma, idx, res, 64, None))
    out = torch.ops.vcattn.sparse_attention(q, k, v, sigma, idx, None, 64, None)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("method", ["vsmooth", "mcsparse"])
def test_warmup_steps_run_stock_sdpa_for_every_method(method):
    """Regression: V-Smooth's run() ignored the DENSE phase, so with ``warmup_steps > 0`` the warm-up ran
    8-bit attention while report() counted it as stock SDPA. Warm-up outputs must equal SDPA bit for bit
    and the first step after the warm-up must not."""
    q, k, v = qkv(S=256)
    s = site(method)
    # MC-Sparse's default warm-up is the V-Smooth path (tests/methods/test_mcsparse_warmup.py); its stock-SDPA
    # warm-up is warmup_attention="sdpa", checked here with V-Smooth's warmup_steps
    cfg = VCConfig.from_options({"method": method, "min_seq_len": 16, "warmup_steps": 2, "density": 0.5,
                                 "anchor_steps": (2,), "warmup_attention": "sdpa"}).to_json()
    ref = F.scaled_dot_product_attention(q, k, v)
    outs = []
    with vc_compile.sampling(num_steps=4):
        for i in range(3):
            vc_compile.step(i)
            outs.append(torch.ops.vcattn.attention(q, k, v, None, s, cfg, None))
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)
    assert not torch.equal(outs[2], ref)
    rec = _report.site(s)
    assert rec.phases["dense"] == 2 and rec.kernel_path["sdpa"] == 2
