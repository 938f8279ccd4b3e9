"""Prologue fusion (passes/rope_fuse.py, the RoPE prologue of kernels/preprocess.py,
formats.py / torch_ops.apply_rope).

Models compile through ``backend="vcattn"`` with method vsmooth (compiler "eager", head dim 64) twice:
``rope_fusion=True`` and ``False``; the outputs are compared.

Tolerances (why they are what they are):
* The fused op rotates q/k in fp32 and rounds once to bf16, with the products summed in the models' own
  order (``x*cos`` first). Where a model does the same (fp32 tables: real Wan checkpoints keep ``rope``
  in fp32, as ``from_pretrained(torch_dtype=bf16)`` does through ``_keep_in_fp32_modules``; CogVideoX,
  LTX, Cosmos compute ``x.float() * cos``), the rotated values are bit-identical and everything after
  them is the same code on the same numbers: the outputs must be **equal** (reference path and
  interpreted kernels alike).
* Where the model rotates in bf16 (its tables cast to bf16 by ``.to(bf16)``: each product and the sum
  rounded, up to ~1.5 bf16 ulp), the fused rotation is the more exact one and a rotated value may differ
  by one bf16 ulp (2^-8 relative). That moves an INT8 code by at most one step where it sits on a
  rounding boundary; measured relative L2 of the block output 2.2e-3 (Wan), so 1e-2 is asserted.
* Kernel vs reference (interpreter): the kernel's prologue against ``apply_rope`` + the reference
  preprocessing, with the tolerance of tests/kernels/test_preprocess.py (Q codes exact without Hadamard, K codes
  within one step on <= 0.5% of codes since K's mean is summed in another order).
"""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import vc_compile
import vc_compile.backend as backend
from vc_compile import formats, torch_ops
from vc_compile.config import VCConfig
from vc_compile.passes import rope_fuse
from vc_compile.reference import preprocess as ref_pre
from vc_compile.runtime import report as _report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # test_preprocess (tests/kernels/)
import tiny_dit  # noqa: E402
import tiny_diffusers  # noqa: E402
from conftest import INTERPRET, KERNEL_DEVICE, pinned_codegen, requires_cuda  # noqa: E402
from test_preprocess import assert_codes, random_perm  # noqa: E402
from test_rope_detect import (Probe, _cat_not_rotate_half, _pairs_wrong_sign, _plain_mul,  # noqa: E402
                              _stack_unrelated)

BF = torch.bfloat16
pytestmark = pytest.mark.usefixtures("fresh_vcattn")


def opts(fuse=True, kernels="reference", compiler="eager", **kw):
    return {"min_seq_len": 16, "method": "vsmooth", "rope_fusion": fuse,
            "experimental": {"compiler": compiler, "kmeans_init_iters": 2, "kernels": kernels}, **kw}


def _snapshot(gm):
    return [(name, m.code) for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)]


def compile_run(monkeypatch, model, *args, options, **kwargs):
    """Compile + run once; returns (output, list of (graph before fuse_rope, graph after))."""
    snaps = []
    real = rope_fuse.fuse_rope

    def spy(gm, findings, cfg, graph_name="graph"):
        before = _snapshot(gm)
        stats = real(gm, findings, cfg, graph_name=graph_name)
        snaps.append((before, _snapshot(gm), gm))
        return stats

    monkeypatch.setattr(backend, "fuse_rope", spy)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="vcattn", options=options)(*args, **kwargs)
    out = out.sample if hasattr(out, "sample") else out
    return out.float(), snaps


def fuse_counters():
    return {k: v for k, v in counters["vcattn"].items() if k.startswith(("rope_fused", "rope_unfused"))}


def fused_vs_unfused(monkeypatch, model, *args, kernels="reference", **kw):
    """(fused out, unfused out, counters of the fused compile, fused graphs)."""
    vc_compile.reset(report=True)
    counters.clear()
    a, snaps = compile_run(monkeypatch, model, *args, options=opts(True, kernels=kernels), **kw)
    c = fuse_counters()
    sites = [s.rope_fusion for s in vc_compile.report().rewritten]
    vc_compile.reset(report=True)
    counters.clear()
    b, snaps_off = compile_run(monkeypatch, model, *args, options=opts(False, kernels=kernels), **kw)
    assert all(before == after for before, after, _ in snaps_off), "rope_fusion=False changed a graph"
    assert set(fuse_counters()) <= {"rope_unfused:disabled"}
    return a, b, c, snaps, sites


def relerr(a, b):
    return ((a - b).norm() / b.norm()).item()


def ops_of(gm):
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
            if n.target is torch.ops.vcattn.attention.default]


def assert_fused_graph(snaps, n_fused, layout_shape):
    (_, _, gm), = snaps
    fused = [n for n in ops_of(gm) if n.kwargs.get("rope")]
    assert len(fused) == n_fused
    for n in fused:
        x = n.args[0].meta["example_value"]
        assert tuple(x.shape) == layout_shape  # the un-rotated q in the model's layout
        val = n.meta["example_value"]
        assert val.dim() == 4 and val.dtype == x.dtype  # meta['val'] recomputed by the fake impl
        code = gm.code
        assert "setitem" not in code and "empty_like" not in code  # the RoPE producer is gone


# ---- diffusers models ----------------------------------------------------------------------------------
def wan(fp32_rope=True):  # fp32 tables, as from_pretrained(torch_dtype=bf16) leaves them
    return tiny_diffusers.wan(fp32_rope)


def test_wan_interleaved_setitem_fused_equals_unfused(monkeypatch):
    m, args, kw = wan()
    a, b, c, snaps, sites = fused_vs_unfused(monkeypatch, m, *args, **kw)
    assert c == {"rope_fused": 1, "rope_fused:interleaved-setitem": 1}
    assert sites == ["fused"]
    assert_fused_graph(snaps, 1, (1, 192, 2, 64))  # [B, S, H, D] before the permute
    assert torch.equal(a, b)  # fp32 tables: the same rotation bit for bit (module doc)


def test_wan_bf16_tables_within_rounding(monkeypatch):
    m, args, kw = wan(fp32_rope=False)
    a, b, c, _, _ = fused_vs_unfused(monkeypatch, m, *args, **kw)
    assert c == {"rope_fused": 1, "rope_fused:interleaved-setitem": 1}
    assert 0 < relerr(a, b) < 1e-2  # bf16 model RoPE rounds 2-3 times, the fused one once (module doc)


def test_wan_interpreted_kernels_fused_equals_unfused(monkeypatch):
    if not INTERPRET:
        pytest.skip("CPU interpreter test (the GPU path is covered by the benchmark)")
    m, args, kw = wan()
    a, b, c, _, _ = fused_vs_unfused(monkeypatch, m, *args, kernels="triton", **kw)
    assert c == {"rope_fused": 1, "rope_fused:interleaved-setitem": 1}
    assert torch.equal(a, b)


def test_cogvideox_slice_write_fused(monkeypatch):
    m, args, kw = tiny_diffusers.cogvideox()
    a, b, c, snaps, sites = fused_vs_unfused(monkeypatch, m, *args, **kw)
    assert c == {"rope_fused": 1, "rope_fused:slice-write": 1} and sites == ["fused"]
    assert_fused_graph(snaps, 1, (1, 2, 200, 64))  # [B, H, S, D]: CogVideoX rotates after the transpose
    (_, _, gm), = snaps
    (op,) = ops_of(gm)
    spec = formats.parse_spec(op.kwargs["rope"])
    assert (spec.start, spec.stop, spec.form, spec.layout) == (8, None, "interleaved", "BHSD")  # text head
    assert torch.equal(a, b)


def test_ltx_stack_before_head_split_fused(monkeypatch):
    m, args, kw = tiny_diffusers.ltx()
    a, b, c, snaps, sites = fused_vs_unfused(monkeypatch, m, *args, **kw)
    assert c == {"rope_fused": 1, "rope_fused:interleaved-stack": 1} and sites == ["fused"]
    assert_fused_graph(snaps, 1, (1, 48, 128))  # [B, S, C] before the head split
    assert torch.equal(a, b)


def test_cosmos_rotate_half_fused(monkeypatch):
    m, args, _ = tiny_diffusers.cosmos()
    a, b, c, snaps, sites = fused_vs_unfused(monkeypatch, m, *args)
    assert c == {"rope_fused": 1, "rope_fused:rotate-half": 1} and sites == ["fused"]
    assert torch.equal(a, b)


def test_hunyuan_key_padded_is_rewritten_unfused(monkeypatch):
    """HunyuanVideo's joint attentions carry a key-padding mask: rewritten, the op slices q and k by the mask at
    run time, so the RoPE is applied before it, not fused (counted per site)."""
    m, args, kw = tiny_diffusers.hunyuan()
    compile_run(monkeypatch, m, *args, options=opts(), **kw)
    # dual- and single-stream blocks
    assert fuse_counters() == {"rope_unfused:key-padding mask (the op slices q and k: RoPE applied before it)": 2}
    assert counters["vcattn"]["rewrite"] == 2


def test_tiny_dit_inductor_fused(monkeypatch):
    """Through Inductor (compile_fx): the op with its cos/sin/rope arguments compiles and runs."""
    m, x, ctx = tiny_dit.make(seq=64)
    outs = {}
    for fuse in (True, False):
        vc_compile.reset(report=True)
        counters.clear()
        o = opts(fuse, compiler="inductor")
        outs[fuse], _ = compile_run(monkeypatch, m, x, ctx, options=o)
        if fuse:
            assert fuse_counters() == {"rope_fused": 2, "rope_fused:interleaved-stack": 2}
    # tiny_dit rotates with bf16 tables; Inductor computes that RoPE in fp32 (one rounding) like the fused op
    assert relerr(outs[True], outs[False]) < 1e-2


def test_other_methods_and_option_off_are_counted(monkeypatch):
    m, x, ctx = tiny_dit.make(seq=64)
    compile_run(monkeypatch, m, x, ctx, options=opts(method="mcsparse"))
    assert fuse_counters() == {"rope_unfused:method mcsparse": 2}
    counters.clear()
    compile_run(monkeypatch, m, x, ctx, options=opts(False))
    assert fuse_counters() == {"rope_unfused:disabled": 2}


# ---- negative tests: look-alikes and RoPEs that must not be fused ----------------------------------------
class Both(Probe):
    """``q_fn`` applied to q and to k (so a look-alike is the site's only candidate)."""

    def forward(self, x):
        heads = lambda t: t.unflatten(-1, (2, -1)).permute(0, 2, 1, 3)  # noqa: E731
        q = self.q_fn(self, x, heads)
        k = self.q_fn(self, x, heads) if self.q_fn is not None else heads(self.k(x))
        return F.scaled_dot_product_attention(q, k, heads(self.v(x)))


@pytest.mark.parametrize("fn", [_cat_not_rotate_half, _stack_unrelated, _plain_mul, _pairs_wrong_sign])
def test_look_alikes_not_fused(monkeypatch, fn):
    m, x = Both(fn).to(BF), torch.randn(1, 32, 128, dtype=BF)
    out, snaps = compile_run(monkeypatch, m, x, options=opts())
    assert fuse_counters() == {"rope_unfused:unrecognised form": 1}
    assert all(before == after for before, after, _ in snaps)  # graph untouched
    (s,) = vc_compile.report().rewritten
    assert s.rope_fusion == "unfused: unrecognised form"
    assert "RoPE not fused into the kernel at sites: " in str(vc_compile.report())  # named in report()
    assert "unrecognised form" in str(vc_compile.report())


def _rot_half(t, cos, sin):
    return t * cos + torch.cat([-t[..., 32:], t[..., :32]], dim=-1) * sin


class Rotated(Probe):
    """Both q and k rotate-half rotated; ``mode`` adds what must block the fusion."""

    def __init__(self, mode):
        super().__init__(None)
        self.mode = mode

    def forward(self, x):
        heads = lambda t: t.unflatten(-1, (2, -1)).permute(0, 2, 1, 3)  # noqa: E731
        q = _rot_half(heads(self.q(x)), self.cos, self.sin)
        k_sin = self.sin * 0.5 if self.mode == "other table" else self.sin
        k = _rot_half(heads(self.k(x)), self.cos, k_sin)
        o = F.scaled_dot_product_attention(q, k, heads(self.v(x)))
        if self.mode == "other user":
            o = o + q  # the rotated q is read again: it must still be computed
        return o


@pytest.mark.parametrize("mode, reason", [
    ("other user", "rope_unfused:a RoPE intermediate has other users"),
    ("other table", "rope_unfused:q and k rotate with different tables"),
])
def test_recognised_but_blocked(monkeypatch, mode, reason):
    m, x = Rotated(mode).to(BF), torch.randn(1, 32, 128, dtype=BF)
    out, snaps = compile_run(monkeypatch, m, x, options=opts())
    c = fuse_counters()
    assert len(c) == 1 and next(iter(c)).startswith(reason) and "rope_fused" not in c, c
    assert all(before == after for before, after, _ in snaps)
    vc_compile.reset(report=True)
    ref, _ = compile_run(monkeypatch, m, x, options=opts(False))
    assert torch.equal(out, ref)


class TextTail(nn.Module):
    """HunyuanVideo's shape without its mask: rotate tokens [0, 24), cat the unrotated 8-token tail."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(128, 128) for _ in range(3))
        cos, sin = tiny_dit.rope_tables(24, 64)
        self.register_buffer("cos", cos.repeat_interleave(2, -1))
        self.register_buffer("sin", sin.repeat_interleave(2, -1))

    def forward(self, x):
        def rot(t):  # [B, S, H, D]
            v = t[:, :24]
            re, im = v.unflatten(-1, (-1, 2)).unbind(-1)
            r = torch.stack([-im, re], -1).flatten(3)
            return torch.cat([(v.float() * self.cos[:, None] + r.float() * self.sin[:, None]).to(t.dtype),
                              t[:, 24:]], dim=1)

        heads = lambda t: t.unflatten(-1, (2, -1))  # noqa: E731
        q, k = rot(heads(self.q(x))), rot(heads(self.k(x)))
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, heads(self.v(x)))))


def test_token_slice_joined_by_cat_not_fused(monkeypatch):
    m, x = TextTail().to(BF), torch.randn(1, 32, 128, dtype=BF)
    out, snaps = compile_run(monkeypatch, m, x, options=opts())
    assert fuse_counters() == {"rope_unfused:token slice joined by cat": 1}
    assert all(before == after for before, after, _ in snaps)


class SliceWriteThenRead(nn.Module):
    """CogVideoX's in-place slice write, but q is read again after the write: not fusable."""

    def __init__(self, read_after):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(128, 128) for _ in range(3))
        self.read_after = read_after
        cos, sin = tiny_dit.rope_tables(24, 64)
        self.register_buffer("cos", cos.repeat_interleave(2, -1))
        self.register_buffer("sin", sin.repeat_interleave(2, -1))

    def forward(self, x):
        def proj(lin):
            return F.layer_norm(lin(x).unflatten(-1, (2, -1)).transpose(1, 2), (64,))

        def rope(t):
            re, im = t.unflatten(-1, (-1, 2)).unbind(-1)
            return (t.float() * self.cos + torch.stack([-im, re], -1).flatten(3).float() * self.sin).to(t.dtype)

        q, k, v = proj(self.q), proj(self.k), proj(self.v)
        q[:, :, 8:] = rope(q[:, :, 8:])
        k[:, :, 8:] = rope(k[:, :, 8:])
        o = F.scaled_dot_product_attention(q, k, v)
        return o + q.sum() if self.read_after else o


@pytest.mark.parametrize("read_after", [False, True])
def test_slice_write_fused_unless_read_after(monkeypatch, read_after):
    m, x = SliceWriteThenRead(read_after).to(BF), torch.randn(1, 32, 128, dtype=BF)
    out, snaps = compile_run(monkeypatch, m, x, options=opts())
    c = fuse_counters()
    if read_after:
        assert c == {"rope_unfused:slice-write: q/k is read after the in-place rotation": 1}, c
        assert all(before == after for before, after, _ in snaps)
    else:
        assert c == {"rope_fused": 1, "rope_fused:slice-write": 1}
    vc_compile.reset(report=True)
    ref, _ = compile_run(monkeypatch, m, x, options=opts(False))
    assert torch.equal(out, ref)


# ---- kernel prologue vs reference RoPE + reference preprocessing (interpreter on CPU) ---------------------
CASES = [  # form, layout, pair table, D, dtype, S, token range, hadamard
    ("interleaved", "BSHD", True, 64, BF, 200, (None, None), False),
    ("interleaved", "BSHD", True, 128, BF, 130, (None, None), True),
    ("interleaved", "BSC", False, 64, torch.float16, 150, (None, None), False),
    ("interleaved", "BHSD", False, 128, torch.float16, 200, (8, None), False),
    ("rotate-half", "BHSD", False, 64, BF, 70, (None, None), True),
    ("rotate-half", "BSHD", False, 128, BF, 260, (0, -7), False),
]


@pytest.mark.parametrize("form,layout,pair,D,dtype,S,toks,hadamard", CASES)
def test_kernel_prologue_matches_reference(form, layout, pair, D, dtype, S, toks, hadamard):
    from vc_compile.kernels import preprocess as tpl
    B, H = 1, 2
    g = torch.Generator().manual_seed(0)
    shape = {"BSHD": (B, S, H, D), "BHSD": (B, H, S, D), "BSC": (B, S, H * D)}[layout]
    q = torch.randn(*shape, generator=g).to(dtype).to(KERNEL_DEVICE)
    k = (torch.randn(*shape, generator=g) + 3.0).to(dtype).to(KERNEL_DEVICE)  # channel-biased K
    spec = formats.RopeSpec(form, layout, H, *toks)
    S_rot = len(range(*slice(*toks).indices(S)))
    Dc = D // 2 if pair else D
    tshape = {"BSHD": (1, S_rot, 1, Dc), "BHSD": (S_rot, Dc), "BSC": (B, S_rot, H * Dc)}[layout]
    ang = torch.rand(*tshape, generator=g) * 6.3
    cos, sin = ang.cos().to(KERNEL_DEVICE), ang.sin().to(KERNEL_DEVICE)
    qb, kb = formats.to_bhsd(q, spec), formats.to_bhsd(k, spec)
    ra = formats.rope_args(cos, sin, spec, tuple(qb.shape))
    perm = random_perm(B, H, S)
    sm = D ** -0.5
    got = tpl.preprocess_qk(qb, kb, perm, sm_scale=sm, hadamard=hadamard, rope=ra)
    want = ref_pre.preprocess_qk(torch_ops.apply_rope(qb, ra), torch_ops.apply_rope(kb, ra), perm, sm_scale=sm, hadamard=hadamard)
    exact = KERNEL_DEVICE == "cpu" and not hadamard
    assert_codes(got.q8, want.q8, exact=exact, what="q8")
    assert_codes(got.k8, want.k8, exact=False, what="k8")
    if KERNEL_DEVICE == "cpu":
        mean_tol, scale_rtol = 1e-5, 2e-6
    else:
        # on the GPU the kernel's RoPE may contract to FMAs: a rotated value can differ from the reference's by
        # one ulp of the input dtype (eps relative); a row/block scale (its max) by as much, and K's mean
        # over S tokens by up to sqrt(S) such differences of random sign, each ulp(max|k|) / S (H200: 1 of 256
        # means off by one fp16 ulp / S = 1.95e-5, a q_scale by 1.7e-5 relative through the Hadamard)
        eps = torch.finfo(dtype).eps
        mean_tol = eps * 2 ** 0.5 * float(kb.float().abs().amax()) * (1 + S ** 0.5) / S  # |rotated| <= sqrt(2) max
        scale_rtol = eps
    torch.testing.assert_close(got.k_mean, want.k_mean, rtol=0, atol=max(mean_tol, 1e-5))
    torch.testing.assert_close(got.q_scale, want.q_scale, rtol=0 if exact else scale_rtol, atol=0)
    torch.testing.assert_close(got.k_scale, want.k_scale, rtol=scale_rtol, atol=0)
    # the reference entry point with rope= is the same as rotating first
    r2 = ref_pre.preprocess_qk(qb, kb, perm, sm_scale=sm, hadamard=hadamard, rope=ra)
    assert torch.equal(r2.q8, want.q8) and torch.equal(r2.k8, want.k8)


def test_reference_rope_is_the_models_rope():
    """apply_rope == Wan's setitem RoPE (fp32 tables) and diffusers' stack/rotate-half RoPE, bit for bit."""
    pytest.importorskip("diffusers")
    from diffusers.models.embeddings import apply_rotary_emb
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 3, 64, generator=g).to(BF)  # [B, S, H, D]
    ang = torch.rand(40, 32, generator=g) * 6.3
    fc, fs = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)  # [S, D]
    # Wan (transformer_wan.py): pair tables freqs[..., 0::2], written through setitem
    cos, sin = fc[None, :, None, 0::2], fs[None, :, None, 1::2]
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    wan = torch.empty_like(x)
    wan[..., 0::2] = x1 * cos - x2 * sin
    wan[..., 1::2] = x1 * sin + x2 * cos
    spec = formats.RopeSpec("interleaved", "BSHD", 3, None, None)
    xb = formats.to_bhsd(x, spec)
    got = torch_ops.apply_rope(xb, formats.rope_args(cos, sin, spec, tuple(xb.shape)))
    assert torch.equal(got, wan.permute(0, 2, 1, 3))
    # HunyuanVideo / CogVideoX (use_real_unbind_dim=-1) on [B, H, S, D]; Cosmos rotate-half (unbind_dim=-2)
    xh = x.permute(0, 2, 1, 3)
    for form, kw, tabs in (("interleaved", {}, (fc, fs)),
                           ("rotate-half", {"use_real_unbind_dim": -2},
                            (torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)))):
        want = apply_rotary_emb(xh, tabs, **kw)
        spec = formats.RopeSpec(form, "BHSD", 3, None, None)
        got = torch_ops.apply_rope(xh, formats.rope_args(*tabs, spec, tuple(xh.shape)))
        assert torch.equal(got, want), form


# ---- op contract, options, uuid ------------------------------------------------------------------------
def _site():
    return _report.register_site(graph="test", node="n", module="m", shape="?", dtype="bf16",
                                 method="vsmooth", rewritten=True).site


@pytest.mark.parametrize("method", ["vsmooth", "dense"])
def test_opcheck_attention_with_rope(method):
    S, H, D = 200, 2, 64
    q, k = (torch.randn(1, S, H, D, dtype=BF) for _ in range(2))  # un-rotated, [B, S, H, D]
    v = torch.randn(1, S, H, D, dtype=BF).permute(0, 2, 1, 3)
    ang = torch.rand(1, S, 1, D // 2) * 6.3
    spec = formats.RopeSpec("interleaved", "BSHD", H, None, None).to_json("test")
    cfg = VCConfig.from_options({"method": method, "min_seq_len": 16,
                                  "experimental": {"kernels": "reference"}}).to_json()
    kw = {"cos": ang.cos(), "sin": ang.sin(), "rope": spec}
    with vc_compile.sampling(num_steps=10):
        vc_compile.step(0)
        torch.library.opcheck(torch.ops.vcattn.attention.default, (q, k, v, None, _site(), cfg, None), kw)
        out = torch.ops.vcattn.attention(q, k, v, None, _site(), cfg, None, **kw)
        # = the op on q, k rotated beforehand (the reference RoPE), same step/branch state
        ra = formats.rope_args(kw["cos"], kw["sin"], formats.parse_spec(spec), (1, H, S, D))
        qr, kr = (torch_ops.apply_rope(t.permute(0, 2, 1, 3), ra) for t in (q, k))
        want = torch.ops.vcattn.attention(qr, kr, v, None, _site(), cfg, None)
    assert out.shape == (1, H, S, D) and torch.equal(out, want)


def test_runtime_fallback_rotates_first():
    S, H, D = 40, 2, 64  # shorter than min_seq_len: stock SDPA on the rotated q, k
    q, k = (torch.randn(1, S, H, D, dtype=BF) for _ in range(2))
    v = torch.randn(1, H, S, D, dtype=BF)
    cos, sin = torch.rand(S, D).cos(), torch.rand(S, D).sin()
    spec = formats.RopeSpec("rotate-half", "BSHD", H, None, None)
    cfg = VCConfig.from_options({"method": "vsmooth", "min_seq_len": 64}).to_json()
    out = torch.ops.vcattn.attention(q, k, v, None, _site(), cfg, None, cos=cos[:, None], sin=sin[:, None],
                                     rope=spec.to_json())
    ra = formats.rope_args(cos[:, None], sin[:, None], spec, (1, H, S, D))
    qr, kr = (torch_ops.apply_rope(t.permute(0, 2, 1, 3), ra) for t in (q, k))
    assert torch.equal(out, F.scaled_dot_product_attention(qr, kr, v))


def test_uuid_covers_sources_and_options(monkeypatch):
    on, off = VCConfig.from_options({"rope_fusion": True}), VCConfig.from_options({})
    assert rope_fuse.uuid(on) == rope_fuse.uuid(VCConfig.from_options({"rope_fusion": True})) != rope_fuse.uuid(off)
    assert rope_fuse.uuid(on) != rope_fuse.uuid(VCConfig.from_options({"method": "mcsparse", "rope_fusion": True}))
    before = rope_fuse.uuid(on)
    rope_fuse._sources_hash.cache_clear()
    monkeypatch.setattr(rope_fuse.inspect, "getsource", lambda mod: "changed source")
    changed = rope_fuse.uuid(on)
    monkeypatch.undo()
    rope_fuse._sources_hash.cache_clear()
    assert changed != before == rope_fuse.uuid(on)


@requires_cuda
@pytest.mark.parametrize("form,pair", [("interleaved", True), ("interleaved", False), ("rotate-half", False)])
def test_gpu_prologue_matches_reference(form, pair):
    from vc_compile.kernels import preprocess as tpl
    B, H, S, D = 1, 4, 4173, 128
    q = torch.randn(B, S, H, D, device="cuda").bfloat16()
    k = (torch.randn(B, S, H, D, device="cuda") + 3.0).bfloat16()
    ang = torch.rand(1, S, 1, D // 2 if pair else D, device="cuda") * 6.3
    spec = formats.RopeSpec(form, "BSHD", H, None, None)
    qb, kb = formats.to_bhsd(q, spec), formats.to_bhsd(k, spec)
    ra = formats.rope_args(ang.cos(), ang.sin(), spec, tuple(qb.shape))
    perm = random_perm(B, H, S, device="cuda")
    got = tpl.preprocess_qk(qb, kb, perm, sm_scale=D ** -0.5, rope=ra)
    want = ref_pre.preprocess_qk(torch_ops.apply_rope(qb, ra), torch_ops.apply_rope(kb, ra), perm, sm_scale=D ** -0.5)
    # on the GPU the kernel's RoPE may contract to FMAs: a rotated value can differ by one bf16 ulp
    assert_codes(got.q8, want.q8, exact=False, what="q8")
    assert_codes(got.k8, want.k8, exact=False, what="k8")
    torch.testing.assert_close(got.k_mean, want.k_mean, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,fmt,pair,toks", [(BF, "int8", True, (None, None)), (BF, "fp8", False, (3, -5)),
                                                 (torch.float16, "int8", False, (None, None)),
                                                 (torch.float16, "fp8", True, (0, 40))])
def test_kernel_packed_pairs_equal_unpacked(monkeypatch, dtype, fmt, pair, toks):
    """The interleaved prologue's packed path (pairs read as one 32-bit word, codes stored as int16 pairs,
    tables as [R, D/2] or pair words) gives the same codes and scales as the [R, D] path, non-finite
    inputs included. FP8 codes never take it: on the H200 its FP8 codes were wrong in whole channels
    (regression: these FP8 cases failed there with the packed path)."""
    from vc_compile.kernels import preprocess as tpl
    from vc_compile.kernels.configs import PreprocessConfig
    B, H, S, D = 1, 2, 90, 64
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    k = (torch.randn(B, S, H, D, generator=g) + 3.0).to(dtype)
    q[0, 7, 1, 5] = float("nan")
    k[0, 70, 0, 2] = float("inf")
    ang = torch.rand(1, len(range(*slice(*toks).indices(S))), 1, D // 2 if pair else D, generator=g) * 6.3
    q, k, ang = (t.to(KERNEL_DEVICE) for t in (q, k, ang))
    spec = formats.RopeSpec("interleaved", "BSHD", H, *toks)
    qb, kb = formats.to_bhsd(q, spec), formats.to_bhsd(k, spec)
    ra = formats.rope_args(ang.cos(), ang.sin(), spec, tuple(qb.shape))
    perm = random_perm(B, H, S, device=KERNEL_DEVICE)
    calls = []
    real = tpl._quant_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                calls.append((kw["PACKED"], kw["TAB_WORDS"]))
                return real[grid](*a, **kw)
            return launch
    monkeypatch.setattr(tpl, "_quant_kernel", Spy())
    got = tpl.preprocess_qk(qb, kb, perm, sm_scale=D ** -0.5, qk_format=fmt, rope=ra)
    want = tpl.preprocess_qk(qb, kb, perm, sm_scale=D ** -0.5, qk_format=fmt, rope=ra,
                             launch=PreprocessConfig(rope_packed=False))
    assert calls == [(fmt == "int8", fmt == "int8" and not pair), (False, False)]
    for a, b in zip(got, want):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.dtype == tpl.FP8 else a.nan_to_num(7.0),
                               b.view(torch.uint8) if b.dtype == tpl.FP8 else b.nan_to_num(7.0))


@pinned_codegen
def test_rope_prologue_codegen_sm90():
    """The RoPE prologue compiled for sm_90 (offline, tests/codegen_stats.py) looks like the no-RoPE
    kernel: 16-byte vector loads (no scalar 2-byte partner loads or 4-byte table gathers: those made the
    fused chain 10x slower than without RoPE on the H200), no spills, <= 128 registers (2 CTAs/SM)."""
    import json
    import os
    import subprocess
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "codegen_stats", "--json"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not r.stdout.strip():
        pytest.skip(f"offline sm_90 compile unavailable here: {r.stderr.strip()[-300:]}")
    st = json.loads(r.stdout.strip().splitlines()[-1])
    qk, cs = st["_quant_kernel"], st["_stats_kernel"]
    for s in (qk, cs):
        assert s["spill_bytes"] == 0 and s["registers"] <= 128, st
        assert not [w for w in s["loads"] if w in ("ld.global.b16", "ld.global.u16")], st
    # no [R, D] tile through shared memory; a few per-program vectors (K's mean from pass 1's partial sums)
    assert qk["convert_layout_tiles"] == 0 and qk["convert_layout"] <= 6, st
    assert qk["loads"].get("ld.global.v4.b32", 0) >= 40, st
    assert qk["loads"].get("ld.global.b32", 0) <= 20, st  # the K mean, read once per program
    assert set(cs["loads"]) == {"ld.global.v4.b32"}, st
