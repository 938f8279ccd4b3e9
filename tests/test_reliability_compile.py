"""Reliability seen through compiled graphs: ``dynamic=True``, grad-mode recompiles keep a call site's
metadata, the fallback warning, module paths in ``report()`` and the one-time note that the CPU path is
the plain-PyTorch reference.

Everything compiles with ``compiler="eager"`` (Dynamo + the rewrite + the op, no Inductor) on tiny shapes.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import tiny_dit
import vc_compile
from vc_compile.config import merge_options
from vc_compile.passes import sdpa_rewrite
from vc_compile.runtime import state

BF = torch.bfloat16
BASE = {"min_seq_len": 16, "method": "dense", "experimental": {"compiler": "eager"}}

pytestmark = pytest.mark.usefixtures("fresh_vcattn")


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    import collections

    from vc_compile.runtime.runtime import current

    monkeypatch.setattr(current(), "said", collections.defaultdict(set))  # every one-time note due again


def f(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def qkv(S=40, D=64, H=2, dtype=BF):
    return tuple(torch.randn(1, H, S, D, dtype=dtype) for _ in range(3))


def frames():
    return counters["stats"]["unique_graphs"]


def vc_warnings(caught, word="stay stock"):
    return [str(w.message) for w in caught if "vcattn" in str(w.message) and word in str(w.message)]


# ---- dynamic shapes -------------------------------------------------------------------------------
@torch.no_grad()
def test_dynamic_true_rewrites_a_qkv_function():
    """Before: nothing rewritten, report 'head_dim unsupported' with shape 1xs34xs0xs77, no warning.
    Now the head dim is guarded (specialised) and the sequence length stays symbolic."""
    cf = torch.compile(f, backend="vcattn", dynamic=True, options=BASE)
    for S in (34, 40, 57):
        q, k, v = qkv(S)
        assert torch.equal(cf(q, k, v), f(q, k, v))  # method dense: stock SDPA through the op
    assert frames() == 1  # no recompile across S
    (site,) = vc_compile.report().sites
    assert site.rewritten and site.calls == 3
    dims = site.shape.split("x")
    assert dims[-1] == "64" and not dims[2].isdigit()  # D specialised, S symbolic
    # another head dim: the guard fails, one recompile; 80 stays stock, 128 is rewritten
    cf(*qkv(40, D=80))
    cf(*qkv(40, D=128))
    cf(*qkv(50, D=128))
    rep = vc_compile.report()
    assert [(s.rewritten, s.reason) for s in rep.sites] == [
        (True, None), (False, "head_dim unsupported"), (True, None)]
    assert [s.shape.split("x")[-1].isdigit() for s in rep.sites] == [True, False, True]
    assert frames() == 3


class Attn(torch.nn.Module):
    """Self-attention of a token sequence [B, S, C] (heads split off C: the head dim is C // H, static)."""

    def __init__(self, dim=128, heads=2, dtype=BF):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim, dtype=dtype) for _ in range(3))

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (self.h, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


@torch.no_grad()
def test_diffusers_style_mark_dynamic_on_the_sequence():
    m = Attn()
    cm = torch.compile(m, backend="vcattn", options=BASE)
    for S in (64, 48, 40):
        x = torch.randn(2, S, 128, dtype=BF)
        torch._dynamo.mark_dynamic(x, 1)
        assert torch.equal(cm(x), m(x))
    assert frames() == 1
    (site,) = vc_compile.report().sites
    assert site.rewritten and site.calls == 3 and not site.shape.split("x")[2].isdigit()


@torch.no_grad()
def test_diffusers_wan_mark_dynamic_frames():
    """diffusers' recipe for several resolutions: mark the latent's frame dim dynamic (S = 64 * frames)."""
    import tiny_diffusers

    m, (x, t, ctx), _ = tiny_diffusers.wan()
    cm = torch.compile(m, backend="vcattn", options=BASE)
    for n in (3, 5, 7):
        xs = torch.randn(1, 4, n, 16, 16, dtype=BF)
        torch._dynamo.mark_dynamic(xs, 2)
        assert torch.equal(cm(xs, t, ctx).sample, m(xs, t, ctx).sample)
    assert frames() == 1
    selfattn = vc_compile.report().sites[0]
    assert selfattn.module == "blocks.0.attn1" and selfattn.rewritten and selfattn.calls == 3
    assert selfattn.shape.endswith("x64") and "s" in selfattn.shape.split("x")[2]


@torch.no_grad()
def test_head_dim_marked_dynamic_stays_stock_and_says_why():
    """Specialising a dim the user marked dynamic would be a ConstraintViolationError: stock SDPA, and
    the warning names the fix."""
    q, k, v = qkv(40)
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 3)
    cf = torch.compile(f, backend="vcattn", options=BASE)
    with pytest.warns(UserWarning, match="head dim is marked dynamic.*maybe_mark_dynamic"):
        assert torch.equal(cf(q, k, v), f(q, k, v))
    (site,) = vc_compile.report().sites
    assert not site.rewritten and site.reason == sdpa_rewrite.HEAD_DIM_DYNAMIC


# ---- a warning when sites stay stock ----------------------------------------------------------------
def test_requires_grad_model_warns_names_no_grad():
    """The README one-liner on a bf16 model without no_grad: before, nothing rewritten and nothing said."""
    m, x, ctx = tiny_dit.make(seq=64)
    cm = torch.compile(m, backend="vcattn", options=BASE)
    with pytest.warns(UserWarning, match=r"0 of 4 .*require grad.*torch\.no_grad\(\).*inference_mode"):
        cm(x, ctx)
    assert not vc_compile.report().rewritten


@torch.no_grad()
def test_fp32_model_warns_names_bf16():
    m, x, ctx = tiny_dit.make(dtype=torch.float32, seq=64)
    cm = torch.compile(m, backend="vcattn", options=BASE)
    with pytest.warns(UserWarning, match=r"float32.*bf16/fp16.*torch\.bfloat16"):
        cm(x, ctx)


@torch.no_grad()
def test_partial_rewrite_for_short_cross_attention_is_quiet_but_all_short_warns():
    m, x, ctx = tiny_dit.make(seq=64)
    cm = torch.compile(m, backend="vcattn", options=BASE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm(x, ctx)  # self-attention rewritten, the 7-token text cross-attention stock by design
    assert not vc_warnings(caught)
    torch._dynamo.reset()
    cm = torch.compile(m, backend="vcattn", options={**BASE, "min_seq_len": 1024})
    with pytest.warns(UserWarning, match=r"0 of 4 .*min_seq_len=1024.*'min_seq_len'"):
        cm(x, ctx)


@torch.no_grad()
def test_masked_attention_warns_unless_it_is_short_anyway():
    """Long masked attention (HunyuanVideo's joint attention) is worth a warning; a short masked one
    (Mochi's 1-query caption pooling) would stay stock anyway: quiet."""
    def g(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = qkv(40)
    with pytest.warns(UserWarning, match=r"0 of 1 .*'masked'"):  # additive: a boolean padding mask is rewritten
        torch.compile(g, backend="vcattn", options=BASE)(q, k, v, torch.zeros(40, 40, dtype=q.dtype))
    torch._dynamo.reset()

    def pool(q, k, v, mask):  # another function: not deduplicated against g's warning
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(pool, backend="vcattn", options=BASE)(q[:, :, :1], k, v, torch.ones(1, 40, dtype=torch.bool))
    assert not vc_warnings(caught) and vc_compile.report().sites[-1].reason == "masked"


@torch.no_grad()
def test_fallback_warning_is_per_graph_and_can_be_silenced():
    """Two graphs with the same problem warn twice under Python's default filter (which shows one
    message text once per location); warn_fallbacks=False silences it."""
    m1, x, ctx = tiny_dit.make(dtype=torch.float32, seq=64)
    m2 = Attn(dtype=torch.float32)  # another model (two instances of one class would share a graph)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        torch.compile(m1, backend="vcattn", options=BASE)(x, ctx)
        torch.compile(m2, backend="vcattn", options=BASE)(x)
    assert frames() == 2
    msgs = vc_warnings(caught)
    assert len(msgs) == 2 and all("float32" in m for m in msgs)
    assert counters["vcattn"]["fallback_warnings"] == 2
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(m1, backend="vcattn", options={**BASE, "warn_fallbacks": False})(x, ctx)


class TwoAttn(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.a, self.b = Attn(dtype=dtype), Attn(dtype=dtype)

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y)


@torch.no_grad()
def test_fallback_warning_once_per_model_and_reason_across_graph_breaks():
    """A model cut into pieces by graph breaks (here 2) says the same thing once, not once per piece."""
    m = TwoAttn(torch.float32)
    x = torch.randn(2, 64, 128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(m, backend="vcattn", options=BASE)(x)
    assert frames() == 2 and len(vc_compile.report().sites) == 2
    assert len(vc_warnings(caught)) == 1 and counters["vcattn"]["fallback_warnings"] == 1
    assert [s.module for s in vc_compile.report().sites] == ["TwoAttn.a", "TwoAttn.b"]  # no list index: qualified


# ---- the reference path says once that it is the reference -------------------------------------------
@torch.no_grad()
def test_cpu_reference_path_says_so_once_per_method():
    q, k, v = qkv(40)
    opts = merge_options(BASE, {"method": "vsmooth", "experimental": {"kmeans_init_iters": 1}})
    with pytest.warns(RuntimeWarning, match="vsmooth runs the plain-PyTorch reference.*slow.*kernels"):
        torch.compile(f, backend="vcattn", options=opts)(q, k, v)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # (f has no q projection: MC-Sparse refuses the site with its own warning, tested in test_hostile.py)
        warnings.filterwarnings("ignore", message=".*instead of MC-Sparse")
        torch.compile(f, backend="vcattn", options=opts)(q, k, v)  # once per process and method
        torch._dynamo.reset()
        ref = merge_options(opts, {"method": "mcsparse", "experimental": {"kernels": "reference"}})
        torch.compile(f, backend="vcattn", options=ref)(q, k, v)
        torch._dynamo.reset()
        torch.compile(f, backend="vcattn", options=BASE)(q, k, v)  # dense: stock SDPA, no reference
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="mcsparse runs the plain-PyTorch reference"):
        torch.compile(f, backend="vcattn", options={**opts, "method": "mcsparse"})(q, k, v)


# ---- module paths ----------------------------------------------------------------------------------
@torch.no_grad()
def test_report_module_paths_whole_model_regional_function():
    m, x, ctx = tiny_dit.make(seq=64)
    torch.compile(m, backend="vcattn", options=BASE)(x, ctx)
    assert [s.module for s in vc_compile.report().sites] == ["blocks.0", "blocks.0", "blocks.1", "blocks.1"]
    torch._dynamo.reset()
    vc_compile.reset(report=True)
    for b in m.blocks:  # regional: one graph for every Block
        b.compile(backend="vcattn", options=BASE)
    m(x, ctx)
    assert [s.module for s in vc_compile.report().sites] == ["Block", "Block"]
    torch._dynamo.reset()
    vc_compile.reset(report=True)
    torch.compile(f, backend="vcattn", options=BASE)(*qkv(40))
    assert [s.module for s in vc_compile.report().sites] == ["f()"]
    assert "f()" in str(vc_compile.report())


@torch.no_grad()
def test_report_module_paths_diffusers_wan():
    import tiny_diffusers

    m, args, kw = tiny_diffusers.wan()
    torch.compile(m, backend="vcattn", options=BASE)(*args, **kw)
    assert [s.module for s in vc_compile.report().sites] == ["blocks.0.attn1", "blocks.0.attn2"]
    torch._dynamo.reset()
    vc_compile.reset(report=True)
    m.compile_repeated_blocks(backend="vcattn", options=BASE)
    m(*args, **kw)
    assert [s.module for s in vc_compile.report().sites] == ["WanTransformerBlock.attn1",
                                                             "WanTransformerBlock.attn2"]


@pytest.mark.parametrize("src, path", [
    ("L['self'].__dict__['_modules']['blocks'].0.attn1", "blocks.0.attn1"),
    ("L['self']._modules['blocks']._modules['3'].attn", "blocks.3.attn"),
    ("L['self'].blocks[2].attn1", "blocks.2.attn1"),
    ("L['self'].attn1", "attn1"),
    ("L['self']", ""),
    ("L['model'].transformer_blocks.0", "model.transformer_blocks.0"),
    ("G['pipe'].transformer.blocks.1", "pipe.transformer.blocks.1"),
    ("blocks.0.attn1", "blocks.0.attn1"),
])
def test_dynamo_source_to_module_path(src, path):
    from vc_compile.passes import names

    assert names.source_to_path(src) == path


# ---- a grad-mode recompile keeps the call site's metadata ---------------------------------------------
@pytest.mark.parametrize("first, second", [("no_grad", "inference_mode"), ("inference_mode", "no_grad")])
def test_grad_mode_switch_keeps_site_metadata(first, second):
    """Before: the recompiled graph got new site ids, so its metadata started over (an extra anchor)."""
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    m, x, ctx = tiny_dit.make(seq=64)
    opts = {**BASE, "method": "mcsparse", "warmup_steps": 0, "anchor_steps": (0,), "density": 0.5,
            "group_size": 64}
    cm = torch.compile(m, backend="vcattn", options=opts)
    with vc_compile.sampling(num_steps=4):
        for i, mode in enumerate((first, second, first, second)):
            vc_compile.step(i)
            with modes[mode]():
                cm(x, ctx)
    assert frames() == 2  # torch recompiles for the grad mode
    rep = vc_compile.report()
    selfattn = [s for s in rep.rewritten if "Sk" not in s.shape]
    assert len(selfattn) == 2  # one record per call site, not one per graph
    assert all(s.phases == {"anchor": 1, "reuse": 3} for s in selfattn)
    assert len({k[:2] for k in state.keys()}) == 2


@torch.no_grad()
def test_same_code_other_options_or_model_keep_separate_sites():
    """The stable site identity includes the options and the dtype; two models share sites but not
    metadata (the block identity keys it)."""
    m1, x, ctx = tiny_dit.make(seq=64)
    m2, _, _ = tiny_dit.make(seq=64)
    c1 = torch.compile(m1, backend="vcattn", options=BASE)
    vs = merge_options(BASE, {"method": "vsmooth", "experimental": {"kmeans_init_iters": 1}})
    c2 = torch.compile(m2, backend="vcattn", options=vs)
    c1(x, ctx)
    c2(x, ctx)
    rw = vc_compile.report().rewritten
    assert len(rw) == 4 and len({s.site for s in rw}) == 4
