"""RoPE producer recognition (vc_compile/passes/rope_detect.py), analysis only.

Every compile goes through ``backend="vcattn"`` (compiler "eager", method dense, head dim 64) with the
backend's ``detect_rope`` wrapped by a spy that snapshots every graph before and after the pass: the
pass must leave the graph exactly as ``rewrite_sdpa`` produced it (same nodes, same code). Outputs are
compared bit for bit with a compile whose detector is switched off.

HunyuanVideo's three attentions and LTX's cross-attention carry masks, so they stay stock SDPA; the
detector runs on those SDPA nodes too (their report records get ``rope`` as well), so the HunyuanVideo
checks below are on stock SDPA nodes.

Cosmos: its tiny config runs with ``concat_padding_mask=False`` (the padding-mask resize needs
torchvision, which is not installed here); the attention and its RoPE are unaffected.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import vc_compile
import vc_compile.backend as backend
from vc_compile.passes import fx_nodes, rope_detect
from vc_compile.passes.rope_detect import RopeMatch

import tiny_dit  # noqa: E402
import tiny_diffusers  # noqa: E402

BF = torch.bfloat16
OPTS = {"experimental": {"compiler": "eager"}, "min_seq_len": 16, "method": "dense"}


pytestmark = pytest.mark.usefixtures("fresh_vcattn")


def _snapshot(gm):
    return [(name, m.code, [(n.name, n.op, str(n.target), repr(n.args), repr(n.kwargs)) for n in m.graph.nodes])
            for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)]


def compile_run(monkeypatch, model, *args, detector=True, **kwargs):
    """Compile + run once; returns (output, findings). Asserts that detect_rope changes no graph."""
    findings = []

    def spy(gm, graph_name="graph"):
        if not detector:
            return []
        before = _snapshot(gm)
        out = rope_detect.detect_rope(gm, graph_name=graph_name)
        assert _snapshot(gm) == before, "detect_rope changed the graph"
        findings.extend(out)
        return out

    monkeypatch.setattr(backend, "detect_rope", spy)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="vcattn", options=OPTS)(*args, **kwargs)
    out = out.sample if hasattr(out, "sample") else out
    return out, findings


def rope_counters():
    return {k: v for k, v in counters["vcattn"].items() if k.startswith("rope:")}


def check_unchanged(monkeypatch, model, ref, *args, **kwargs):
    vc_compile.reset(report=True)
    out, found = compile_run(monkeypatch, model, *args, detector=False, **kwargs)
    assert not found and torch.equal(out, ref)


def sites_by_module(part):
    return [s for s in vc_compile.report().sites if part in s.module]


# ---- diffusers models ----------------------------------------------------------------------------------
def test_wan_interleaved_setitem(monkeypatch):
    m, args, _ = tiny_diffusers.wan()
    out, found = compile_run(monkeypatch, m, *args)
    assert rope_counters() == {"rope:interleaved-setitem": 1, "rope:none": 1}  # attn1 self, attn2 cross
    (self_attn,) = [f for f in found if f.form != "none"]
    r = self_attn.result
    assert isinstance(r, RopeMatch) and r.layout == "BSHD" and r.q.token_slice is None
    assert r.q.input.meta["example_value"].shape == (1, 192, 2, 64)  # the un-rotated, head-split q
    assert fx_nodes.node_name(r.q.input) == "unflatten" and r.q.cos is not r.q.sin
    (s1,), (s2,) = sites_by_module("attn1"), sites_by_module("attn2")
    assert s1.rewritten and s1.rope == "interleaved-setitem BSHD" and s2.rope == "none"
    assert vc_compile.report().to_dict()["sites"][0]["rope"] == s1.rope
    check_unchanged(monkeypatch, m, out, *args)


def test_skyreels_interleaved_setitem(monkeypatch):
    from diffusers import SkyReelsV2Transformer3DModel
    torch.manual_seed(0)
    m = SkyReelsV2Transformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64,
                                     in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64,
                                     num_layers=1, rope_max_seq_len=32).to(BF).eval()
    args = (torch.randn(1, 4, 3, 16, 16, dtype=BF), torch.tensor([999]), torch.randn(1, 8, 16, dtype=BF))
    out, found = compile_run(monkeypatch, m, *args)
    assert rope_counters() == {"rope:interleaved-setitem": 1, "rope:none": 1}
    assert [s.rope for s in vc_compile.report().rewritten] == ["interleaved-setitem BSHD"]
    check_unchanged(monkeypatch, m, out, *args)


def test_mochi_per_sample_cat_after_transpose(monkeypatch):
    """Mochi: strided pairs ``x[..., 0::2]`` on [B, S, H, D], transpose, then a per-sample cat with the
    valid text tokens along S (needs capture_dynamic_output_shape_ops, else it runs eagerly)."""
    from diffusers import MochiTransformer3DModel
    torch.manual_seed(0)
    m = MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=64, num_layers=1,
                                pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=4,
                                max_sequence_length=16).to(BF).eval()
    args = (torch.randn(1, 4, 3, 16, 16, dtype=BF), torch.randn(1, 8, 16, dtype=BF), torch.tensor([999]),
            torch.ones(1, 8, dtype=torch.long))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out, found = compile_run(monkeypatch, m, *args)
        # the attention pooler (masked, stock SDPA) has no RoPE
        assert rope_counters() == {"rope:interleaved-stack": 1, "rope:none": 1}
        (s,) = vc_compile.report().rewritten
        assert s.rope == "interleaved-stack BSHD tokens 0:192"
        check_unchanged(monkeypatch, m, out, *args)


def test_hunyuan_stack_on_video_slice_then_cat(monkeypatch):
    m, args, kw = tiny_diffusers.hunyuan(padded_text=True)
    out, found = compile_run(monkeypatch, m, *args, **kw)
    # the joint attentions carry a key-padding mask (rewritten), the refiner a per-query one (stock SDPA): the
    # detector ran on every SDPA node
    assert counters["vcattn"]["rewrite"] == 2
    assert rope_counters() == {"rope:interleaved-stack": 2, "rope:none": 1}  # dual, single; refiner: none
    for prefix in ("transformer_blocks.", "single_transformer_blocks."):  # module paths: blocks.0.attn
        (s,) = [x for x in vc_compile.report().sites if x.module.startswith(prefix)]
        assert s.rewritten and s.rope == "interleaved-stack BSHD tokens 0:192"
    (ref,) = sites_by_module("token_refiner")
    assert ref.rope == "none"
    for f in found:
        if f.form == "interleaved-stack":
            assert f.result.q.token_slice == (0, 192) == f.result.k.token_slice  # 192 video + 8 text
    check_unchanged(monkeypatch, m, out, *args, **kw)


def test_cogvideox_in_place_slice_write(monkeypatch):
    m, args, kw = tiny_diffusers.cogvideox()
    out, found = compile_run(monkeypatch, m, *args, **kw)
    assert rope_counters() == {"rope:slice-write": 1}
    (f,) = found
    r = f.result
    assert r.layout == "BHSD" and r.q.inner == "interleaved-stack"
    assert r.q.token_slice == (8, None) == r.k.token_slice  # text tokens 0:8 stay unrotated
    assert r.q.input.meta["example_value"].shape == (1, 2, 200, 64)
    for t in (r.q.cos, r.q.sin):  # cos/sin are forward inputs: table[None, None].to(device)
        assert fx_nodes.strip(t).args[0].op == "placeholder"
    (s,) = vc_compile.report().sites
    assert s.rewritten and s.rope == "slice-write BHSD (interleaved-stack) tokens 8:"
    check_unchanged(monkeypatch, m, out, *args, **kw)


def test_ltx_stack_before_head_split(monkeypatch):
    m, args, kw = tiny_diffusers.ltx()
    out, found = compile_run(monkeypatch, m, *args, **kw)
    assert rope_counters() == {"rope:interleaved-stack": 1, "rope:none": 1}  # attn1; attn2 (masked): none
    (s1,), (s2,) = sites_by_module("attn1"), sites_by_module("attn2")
    assert s1.rewritten and s1.rope == "interleaved-stack BSC" and s2.rope == "none"
    (f,) = [f for f in found if f.form != "none"]
    assert f.result.q.input.meta["example_value"].shape == (1, 48, 128)  # [B, S, C], before the head split
    check_unchanged(monkeypatch, m, out, *args, **kw)


def test_cosmos_rotate_half(monkeypatch):
    m, args, _ = tiny_diffusers.cosmos()
    out, found = compile_run(monkeypatch, m, *args)
    assert rope_counters() == {"rope:rotate-half": 1, "rope:none": 1}
    (s1,), (s2,) = sites_by_module("attn1"), sites_by_module("attn2")
    assert s1.rewritten and s1.rope == "rotate-half BHSD" and s2.rope == "none"
    check_unchanged(monkeypatch, m, out, *args)


def test_tiny_dit_stack_pairs(monkeypatch):
    m, x, ctx = tiny_dit.make(seq=64)
    out, found = compile_run(monkeypatch, m, x, ctx)
    assert rope_counters() == {"rope:interleaved-stack": 2, "rope:none": 2}
    rw = vc_compile.report().rewritten
    assert len(rw) == 2 and {s.rope for s in rw} == {"interleaved-stack BSHD"}
    for f in found:
        if f.form != "none":
            assert fx_nodes.node_name(f.result.q.input) == "unflatten"  # q = self.q(y).unflatten(...)
            assert f.result.q.cos.meta["example_value"].shape == (1, 64, 1, 32)
    check_unchanged(monkeypatch, m, out, x, ctx)


# ---- synthetic forms and look-alikes -------------------------------------------------------------------
class Probe(nn.Module):
    """One self-attention over [B, S, H=2, D=64]; ``q_fn`` builds q (k, v stay plain projections)."""

    def __init__(self, q_fn, S=32):
        super().__init__()
        self.q, self.k, self.v, self.w = (nn.Linear(128, 128) for _ in range(4))
        self.q_fn = q_fn
        cos, sin = tiny_dit.rope_tables(S, 64)
        self.register_buffer("cos", torch.cat([cos, cos], -1)[None, None])  # rotate-half tables [1,1,S,64]
        self.register_buffer("sin", torch.cat([sin, sin], -1)[None, None])

    def forward(self, x):
        heads = lambda t: t.unflatten(-1, (2, -1)).permute(0, 2, 1, 3)  # noqa: E731
        q = self.q_fn(self, x, heads)
        return F.scaled_dot_product_attention(q, heads(self.k(x)), heads(self.v(x)))


def _rot_half_slices(m, x, heads):
    q = heads(m.q(x))
    return q * m.cos + torch.cat([-q[..., 32:], q[..., :32]], dim=-1) * m.sin


def _rot_half_chunk(m, x, heads):
    q = heads(m.q(x))
    a, b = q.chunk(2, dim=-1)
    return (q.float() * m.cos.float() + torch.cat([-b, a], dim=-1).float() * m.sin.float()).to(q.dtype)


def _stack_unrelated(m, x, heads):  # stack/flatten of two unrelated projections
    a = m.q(x).unflatten(-1, (2, -1))[..., :32]
    b = m.w(x).unflatten(-1, (2, -1))[..., :32]
    return torch.stack([a, b], dim=-1).flatten(-2).permute(0, 2, 1, 3)


def _cat_not_rotate_half(m, x, heads):  # x*cos + cat([x2, x1])*sin: no negation, not a rotation
    q = heads(m.q(x))
    return q * m.cos + torch.cat([q[..., 32:], q[..., :32]], dim=-1) * m.sin


def _cat_channels(m, x, heads):  # a plain channel concatenation
    return torch.cat([heads(m.q(x))[..., :32], heads(m.w(x))[..., 32:]], dim=-1)


def _cat_heads(m, x, heads):  # head 0 rotated, head 1 not: a cat that is not along the tokens
    q = heads(m.q(x))
    q0 = q[:, :1]
    return torch.cat([q0 * m.cos + torch.cat([-q0[..., 32:], q0[..., :32]], dim=-1) * m.sin, q[:, 1:]], dim=1)


def _plain_mul(m, x, heads):  # an elementwise gate, not a rotation
    return heads(m.q(x) * torch.sigmoid(m.w(x)))


def _pairs_wrong_sign(m, x, heads):  # interleaved pairs with x1*cos + x2*sin: not a rotation
    q = m.q(x).unflatten(-1, (2, -1))
    x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = m.cos[..., :32].transpose(1, 2), m.sin[..., :32].transpose(1, 2)
    return torch.stack([x1 * c + x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).permute(0, 2, 1, 3)


@pytest.mark.parametrize("fn", [_rot_half_slices, _rot_half_chunk])
def test_synthetic_rotate_half_variants(monkeypatch, fn):
    out, found = compile_run(monkeypatch, Probe(fn).to(BF), torch.randn(1, 32, 128, dtype=BF))
    # q rotated, k not: the site as a whole is unrecognised (step 2 folds q and k alike) ...
    assert rope_counters() == {"rope:unrecognised": 1}
    assert found[0].result == "q and k differ (q: rotate-half BHSD, k: none)"


def test_synthetic_rotate_half_on_q_and_k(monkeypatch):
    class Both(Probe):
        def forward(self, x):
            heads = lambda t: t.unflatten(-1, (2, -1)).permute(0, 2, 1, 3)  # noqa: E731
            rot = lambda t: t * self.cos + torch.cat([-t[..., 32:], t[..., :32]], -1) * self.sin  # noqa: E731
            return F.scaled_dot_product_attention(rot(heads(self.q(x))), rot(heads(self.k(x))), heads(self.v(x)))

    x = torch.randn(1, 32, 128, dtype=BF)
    m = Both(None).to(BF)
    out, found = compile_run(monkeypatch, m, x)
    assert rope_counters() == {"rope:rotate-half": 1}
    r = found[0].result
    assert r.layout == "BHSD" and fx_nodes.node_name(r.q.input) == "permute" and r.q.input is not r.k.input
    check_unchanged(monkeypatch, m, out, x)


def test_synthetic_strided_pairs_cos_first(monkeypatch):
    """Mochi-style pairs ``x[..., 0::2]``, factors written first, and a cos table that is itself strided
    (``table[..., 0::2]``, as Wan slices its tables): the table must not be taken for the pair."""
    class Strided(Probe):
        def forward(self, x):
            c = self.cos.transpose(1, 2)[..., 0::2]  # [1, S, 1, 32]
            s = self.sin.transpose(1, 2)[..., 1::2]

            def rot(t):  # [B, S, H, D]
                xe, xo = t[..., 0::2], t[..., 1::2]
                return torch.stack([c * xe - s * xo, s * xe + c * xo], dim=-1).flatten(-2)

            split = lambda t: t.unflatten(-1, (2, -1))  # noqa: E731
            q, k = rot(split(self.q(x))), rot(split(self.k(x)))
            return F.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in (q, k, split(self.v(x)))))

    m, x = Strided(None).to(BF), torch.randn(1, 32, 128, dtype=BF)
    out, found = compile_run(monkeypatch, m, x)
    assert rope_counters() == {"rope:interleaved-stack": 1}
    r = found[0].result
    assert r.layout == "BSHD" and fx_nodes.node_name(r.q.input) == "unflatten"
    assert fx_nodes.strip(r.q.cos).args[1][1] == slice(0, None, 2)  # the cos table, not x's even half
    check_unchanged(monkeypatch, m, out, x)


@pytest.mark.parametrize("fn, reason", [
    (_stack_unrelated, "q: stack/flatten: the two halves are not (x1*cos - x2*sin"),
    (_cat_not_rotate_half, "q: cat is not rotate-half [-x2, x1]"),
    (_cat_channels, "q: cat along the channel dim that is not rotate-half"),
    (_cat_heads, "q: cat along dim 1, which is not the token axis"),
    (_plain_mul, "q: an elementwise multiply that is neither a normalisation nor x*cos + rot(x)*sin"),
    (_pairs_wrong_sign, "q: stack/flatten: the two halves are not (x1*cos - x2*sin, x1*sin + x2*cos)"),
])
def test_look_alikes_are_unrecognised(monkeypatch, fn, reason):
    m, x = Probe(fn).to(BF), torch.randn(1, 32, 128, dtype=BF)
    out, found = compile_run(monkeypatch, m, x)
    assert rope_counters() == {"rope:unrecognised": 1}
    (f,) = found
    assert isinstance(f.result, str) and f.result.startswith(reason), f.result
    (s,) = vc_compile.report().sites
    assert s.rewritten and s.rope == f"unrecognised: {f.result}"  # the rewrite itself is unaffected
    check_unchanged(monkeypatch, m, out, x)


def test_no_attention_no_findings():
    gm = torch.fx.symbolic_trace(nn.Linear(4, 4))
    code = gm.code
    assert rope_detect.detect_rope(gm) == [] and gm.code == code and rope_counters() == {}
