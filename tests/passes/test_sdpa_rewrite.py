"""The Dynamo-level SDPA rewrite: what it rewrites (counters), what it must leave alone (reasons)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import tiny_dit
import vc_compile
from vc_compile.backend import vcattn

BASE = {"experimental": {"compiler": "eager"}, "min_seq_len": 64, "method": "dense"}


pytestmark = pytest.mark.usefixtures("fresh_vcattn")


def compile_capture(fn, options):
    graphs = []

    def backend(gm, ex):
        out = vcattn(gm, ex, options=options)
        graphs.append(gm)
        return out

    return torch.compile(fn, backend=backend, fullgraph=True), graphs


def targets(gm):
    return [n.target for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"]


def qkv(B=1, H=2, S=256, D=64, dtype=torch.bfloat16, Sk=None):
    Sk = Sk or S
    return (torch.randn(B, H, S, D, dtype=dtype), torch.randn(B, H, Sk, D, dtype=dtype),
            torch.randn(B, H, Sk, D, dtype=dtype))


def test_tiny_dit_self_attention_rewritten_cross_attention_kept():
    m, x, ctx = tiny_dit.make()
    cm, graphs = compile_capture(m, BASE)
    with torch.no_grad():
        out = cm(x, ctx)
        ref = m(x, ctx)
    assert counters["vcattn"]["rewrite"] == 2
    assert counters["vcattn"]["rewrite:dense"] == 2
    assert counters["vcattn"]["fallback:cross-attention too short"] == 2
    assert torch.equal(out, ref)  # method dense: the op runs stock SDPA, bit for bit
    ts = targets(graphs[0])
    assert ts.count(torch.ops.vcattn.attention.default) == 2
    rep = vc_compile.report()
    assert [s.rewritten for s in rep.sites] == [True, False, True, False]
    assert all(s.has_identity for s in rep.rewritten)  # the q-projection weight was found
    assert {s.reason for s in rep.fallbacks} == {"cross-attention too short"}


CASES = [
    # an additive mask (a boolean padding mask is rewritten: tests/test_key_padding.py)
    ("masked", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(256, 256, dtype=q.dtype)),
     {}),
    ("causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), {}),
    ("dropout", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), {}),
    ("head_dim unsupported", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), {"D": 80}),
    ("sequence too short", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), {"S": 32}),
    ("cross-attention too short", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), {"Sk": 16}),
    ("dtype unsupported", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), {"dtype": torch.float32}),
    ("gqa", lambda q, k, v: F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], enable_gqa=True), {}),
]


@pytest.mark.parametrize("reason,fn,shape", CASES, ids=[c[0] for c in CASES])
def test_ineligible_calls_stay_stock_sdpa(reason, fn, shape):
    q, k, v = qkv(**shape)
    cm, graphs = compile_capture(fn, BASE)
    with torch.no_grad():
        torch.manual_seed(0)
        out = cm(q, k, v)
        torch.manual_seed(0)
        ref = fn(q, k, v)
    assert counters["vcattn"]["rewrite"] == 0
    assert counters["vcattn"][f"fallback:{reason}"] == 1
    assert torch.ops.vcattn.attention.default not in targets(graphs[0])
    if reason != "dropout":
        assert torch.equal(out, ref)
    assert vc_compile.report().sites[0].reason == reason


def test_requires_grad_stays_stock():
    q, k, v = (t.requires_grad_() for t in qkv())
    cm, _ = compile_capture(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), BASE)
    cm(q, k, v).sum().backward()
    assert counters["vcattn"]["fallback:requires grad"] == 1
    assert q.grad is not None


def test_nested_compile_region_is_rewritten():
    @torch.compiler.nested_compile_region
    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2

    def fn(q, k, v):
        return attn(q, k, v) + attn(k, q, v)

    q, k, v = qkv()
    cm, graphs = compile_capture(fn, BASE)
    with torch.no_grad():
        out = cm(q, k, v)
    assert counters["vcattn"]["rewrite"] >= 1
    assert torch.ops.vcattn.attention.default in targets(graphs[0])
    assert torch.equal(out, fn(q, k, v))


def test_new_node_meta_is_current():
    q, k, v = qkv(S=300)
    cm, graphs = compile_capture(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.1), BASE)
    with torch.no_grad():
        cm(q, k, v)
    node = next(n for n in graphs[0].graph.nodes if n.target is torch.ops.vcattn.attention.default)
    val = node.meta["example_value"]
    assert tuple(val.shape) == (1, 2, 300, 64) and val.dtype == torch.bfloat16
    assert node.args[-1] == 0.1 and "stack_trace" in node.meta


def test_graph_without_sdpa_is_unchanged_and_quiet():
    def fn(x):
        return torch.relu(x) + 1

    cm, graphs = compile_capture(fn, BASE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm(torch.randn(4))
    assert counters["vcattn"]["graphs_without_sdpa"] == 0


def test_hand_written_attention_warns():
    def fn(q, k, v):
        for _ in range(3):
            q = torch.softmax(q @ k.transpose(-1, -2) / 8, -1) @ v
        return q

    cm, _ = compile_capture(fn, BASE)
    with pytest.warns(UserWarning, match="no scaled_dot_product_attention.*by hand"):
        cm(*qkv(dtype=torch.float32))
    assert counters["vcattn"]["graphs_without_sdpa"] == 1
    assert vc_compile.report().graphs_without_sdpa


def test_freed_graph_drops_its_metadata():
    import gc

    from vc_compile.runtime import state

    m, x, ctx = tiny_dit.make()
    cm = torch.compile(m, backend="vcattn", options={**BASE, "method": "vsmooth"})
    with torch.no_grad():
        vc_compile.step(0)
        cm(x, ctx)
    try:
        assert state.bytes_held() > 0
        torch._dynamo.reset()  # frees the compiled graph: its sites' metadata goes with it
        del cm
        gc.collect()
        assert state.bytes_held() == 0
        assert all(s.bytes_held == 0 for s in vc_compile.report().sites)
    finally:
        vc_compile.reset()


def test_mode_with_eager_compiler_warns():
    cm, _ = compile_capture(lambda x: x + 1, {**BASE, "mode": "max-autotune"})
    with pytest.warns(UserWarning, match="no effect with compiler='eager'"):
        cm(torch.randn(3))
