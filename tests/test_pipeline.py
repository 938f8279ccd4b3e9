"""``vc_compile.enable(pipe)`` / ``disable(pipe)`` on real diffusers pipelines, the ``callback_on_step_end`` step
signal, the ``VCATTN_METHOD`` switch and the attention-backend check.

Tiny random-weight Wan 2.1 / Wan 2.2 (two experts) pipelines, no VAE or text encoder, ``compiler="eager"``
(Dynamo + rewrite + op, no Inductor), reference kernels on CPU. Every test that drives a pipeline checks
that its steps came from the callback (``step_sources == {"callback": n}``), so a diffusers upgrade that
breaks the signal fails here. Run against diffusers 0.42.1 and 0.35.0 (the oldest with Wan 2.2's
``transformer_2``; the minimum in pyproject's ``diffusers`` extra).
"""
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("diffusers")

import vc_compile  # noqa: E402
from vc_compile.config import VCConfig, VCConfigError  # noqa: E402
from vc_compile.runtime import pipeline_calls, state  # noqa: E402
from vc_compile.runtime.steps import TRACKER  # noqa: E402

from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel  # noqa: E402

BF = torch.bfloat16
OPTS = {"min_seq_len": 64, "kmeans_iters": 1, "experimental": {"compiler": "eager", "kmeans_init_iters": 2}}
pytestmark = pytest.mark.usefixtures("fresh_vcattn")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("VCATTN_METHOD", raising=False)


def wan(two_experts=False, layers=2):
    def make():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=64, num_layers=layers, rope_max_seq_len=32).to(BF).eval()

    torch.manual_seed(0)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    extra = dict(transformer_2=make(), boundary_ratio=0.875) if two_experts else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=make(), scheduler=sched, **extra)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed
    call = dict(prompt_embeds=torch.randn(1, 8, 16, generator=g(1)).to(BF),
                negative_prompt_embeds=torch.randn(1, 8, 16, generator=g(2)).to(BF),
                height=128, width=128, num_frames=9, guidance_scale=5.0, output_type="latent")
    return pipe, call  # 3 latent frames x 8 x 8 patches = 192 video tokens


def run(pipe, call, steps, seed=3, **kw):
    with torch.no_grad():
        return pipe(**{**call, **kw}, num_inference_steps=steps,
                    generator=torch.Generator().manual_seed(seed)).frames.float()


def relerr(a, b):
    return ((a - b).norm() / b.norm()).item()


def sites():
    return vc_compile.report().rewritten


def compiled(module) -> bool:
    return module._compiled_call_impl is not None


# ---- Wan 2.1: regional compile, steps from the callback, undo ------------------------------------------
def test_enable_wan21_regional_steps_from_callback_and_disable():
    pipe, call = wan()
    ref = run(pipe, call, 4)
    cls = type(pipe)
    assert vc_compile.enable(pipe, method="vsmooth", **OPTS) is pipe
    blocks = list(pipe.transformer.blocks)
    assert all(compiled(b) for b in blocks) and not compiled(pipe.transformer)  # regional by default
    assert isinstance(pipe, cls) and type(pipe).__name__ == cls.__name__
    out = run(pipe, call, 4)
    (site,) = sites()  # one block graph serves both blocks
    assert site.step_sources == {"callback": 4 * 2 * 2}  # steps x CFG x blocks
    assert site.phases == {"group": 2, "reuse": 14}  # 1 grouping step (step 0) per block, in the cond branch
    assert {k[2] for k in state.keys()} == {0, 1}  # cond / uncond kept apart
    assert relerr(out, ref) < 0.05
    assert counters["stats"]["unique_graphs"] == 1
    gen = TRACKER.generation
    run(pipe, call, 3)  # a second call: a new generation, no new graph
    assert TRACKER.generation > gen and counters["stats"]["unique_graphs"] == 1

    assert vc_compile.disable(pipe) is pipe
    assert type(pipe) is cls and not any(compiled(b) for b in blocks) and not state.keys()
    calls = site.calls
    assert torch.equal(run(pipe, call, 4), ref)  # eager again, bit for bit
    assert site.calls == calls


# ---- Wan 2.2: both experts, one graph, separate metadata ------------------------------------------------
def test_enable_wan22_two_experts():
    pipe, call = wan(two_experts=True, layers=1)
    ref = run(pipe, call, 6)
    vc_compile.enable(pipe, method="mcsparse", density=0.5, **OPTS)
    assert compiled(pipe.transformer.blocks[0]) and compiled(pipe.transformer_2.blocks[0])
    out = run(pipe, call, 6)
    # UniPC shift 3, 6 steps: t = 999, 937 (expert 1), 857, 750, 600, 376 (expert 2); mcsparse n = 6:
    # (V-Smooth) warm-up step 0, anchors {1, 3}; expert 2's first step (2) has no metadata of its own and anchors
    (site,) = sites()
    assert site.phases == {"warmup": 2, "anchor": 6, "reuse": 4}, site.phases
    assert site.step_sources == {"callback": 12}
    p1 = {b.attn1.to_q.weight.data_ptr() for b in pipe.transformer.blocks}
    p2 = {b.attn1.to_q.weight.data_ptr() for b in pipe.transformer_2.blocks}
    assert {k[1] for k in state.keys()} == p1 | p2
    assert relerr(out, ref) < 0.05
    vc_compile.disable(pipe)
    assert not compiled(pipe.transformer.blocks[0]) and not compiled(pipe.transformer_2.blocks[0])


# ---- the user's callback is kept --------------------------------------------------------------------------
def test_user_callbacks_are_chained_not_clobbered():
    from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback

    pipe, call = wan(layers=1)
    vc_compile.enable(pipe, method="dense", **OPTS)
    seen = []

    def plain(p, i, t, kw):
        seen.append(("plain", i, sorted(kw)))
        return kw

    run(pipe, call, 3, callback_on_step_end=plain)
    assert seen == [("plain", i, ["latents"]) for i in range(3)]

    class Scale(PipelineCallback):  # asks for prompt_embeds: its tensor_inputs must still reach the pipeline
        tensor_inputs = ["latents", "prompt_embeds"]

        def callback_fn(self, p, i, t, kw):
            seen.append(("scale", i, sorted(kw)))
            return kw

    seen.clear()
    run(pipe, call, 2, callback_on_step_end=Scale())
    assert seen == [("scale", i, ["latents", "prompt_embeds"]) for i in range(2)]
    seen.clear()
    run(pipe, call, 2, callback_on_step_end=MultiPipelineCallbacks([Scale()]))
    assert [s[:2] for s in seen] == [("scale", 0), ("scale", 1)]
    (site,) = sites()
    assert site.step_sources == {"callback": (3 + 2 + 2) * 2}
    assert site.phases == {"dense": 14}


def test_user_callback_changes_latents_as_without_enable():
    """A callback that edits the latents has the same effect with and without enable (method dense: the
    op runs stock SDPA, so the outputs are equal up to the compiled graph's rounding)."""
    pipe, call = wan(layers=1)

    def halve_at_1(p, i, t, kw):
        return {"latents": kw["latents"] * 0.5} if i == 1 else kw

    ref = run(pipe, call, 3, callback_on_step_end=halve_at_1)
    vc_compile.enable(pipe, method="dense", **OPTS)
    out = run(pipe, call, 3, callback_on_step_end=halve_at_1)
    assert relerr(out, ref) < 1e-2
    assert relerr(run(pipe, call, 3), ref) > 0.05  # the callback matters


# ---- options: VCConfig, whole model, re-enable, components ---------------------------------------------
def test_vcconfig_options_whole_model_and_reenable():
    pipe, call = wan(layers=1)
    cfg = VCConfig(method="vsmooth", min_seq_len=64, kmeans_iters=1,
                   experimental={"compiler": "eager", "kmeans_init_iters": 2})
    vc_compile.enable(pipe, options=cfg, regional=False)
    assert compiled(pipe.transformer) and not compiled(pipe.transformer.blocks[0])
    run(pipe, call, 2)
    assert {s.method for s in sites()} == {"vsmooth"}
    # a second enable undoes the first: new options, regional again
    vc_compile.enable(pipe, options=cfg, method="dense")
    assert not compiled(pipe.transformer) and compiled(pipe.transformer.blocks[0])
    assert vc_compile.pipeline.enabled_options(pipe)["method"] == "dense"
    with pytest.raises(ValueError, match="no component"):
        vc_compile.enable(pipe, components=["transformer_3"], **OPTS)
    with pytest.raises(VCConfigError, match="density"):
        vc_compile.enable(pipe, method="mcsparse", density=2.0)


def test_a_second_enable_lists_each_site_once_in_the_report(monkeypatch):
    """``report()`` after a second ``enable``: the same options run the same graphs (one row a site, its calls
    counted on); other options (or regional -> whole) replace the undone compile's rows instead of adding a second
    row per site; back to the first options, its graph's rows (the stock-SDPA cross-attention too) return."""
    import weakref

    from vc_compile import pipeline

    from vc_compile.runtime import report as _report

    # pipelines other tests of this process left enabled would count as other enabled pipelines
    monkeypatch.setattr(pipeline, "_OWNERS", weakref.WeakKeyDictionary())
    _report.site(10 ** 6)  # an op called by hand with a site id of its own, then forgotten: it moves no watermark
    vc_compile.reset(report=True)
    pipe, call = wan(layers=1)

    def rows():
        return sorted((s.module, s.method if s.rewritten else "sdpa", s.calls) for s in vc_compile.report().sites)

    vc_compile.enable(pipe, method="vsmooth", **OPTS)
    run(pipe, call, 2)
    first = rows()
    assert [r[:2] for r in first] == [("WanTransformerBlock.attn1", "vsmooth"), ("WanTransformerBlock.attn2", "sdpa")]
    vc_compile.enable(pipe, method="vsmooth", **OPTS)
    run(pipe, call, 2)
    assert rows() == [("WanTransformerBlock.attn1", "vsmooth", 8), ("WanTransformerBlock.attn2", "sdpa", 0)]
    vc_compile.enable(pipe, method="vsmooth", regional=False, **OPTS)
    run(pipe, call, 2)
    assert rows() == [("blocks.0.attn1", "vsmooth", 4), ("blocks.0.attn2", "sdpa", 0)]
    vc_compile.enable(pipe, method="dense", **OPTS)
    run(pipe, call, 2)
    assert rows() == [("WanTransformerBlock.attn1", "dense", 4), ("WanTransformerBlock.attn2", "sdpa", 0)]
    vc_compile.enable(pipe, method="vsmooth", **OPTS)
    run(pipe, call, 2)
    assert rows() == [("WanTransformerBlock.attn1", "vsmooth", 4), ("WanTransformerBlock.attn2", "sdpa", 0)]
    other, _ = wan(layers=1)  # another enabled pipeline: whose rows are whose is unknown, so every row stays
    vc_compile.enable(other, method="vsmooth", **OPTS)
    vc_compile.enable(pipe, method="dense", **OPTS)
    run(pipe, call, 2)
    assert [r[1] for r in rows()].count("vsmooth") == 1 and [r[1] for r in rows()].count("dense") == 1


def test_enable_validates_before_changing_anything():
    pipe, _ = wan(layers=1)
    with pytest.raises(VCConfigError, match="unknown vcattn option"):
        vc_compile.enable(pipe, desnity=0.2)
    assert not compiled(pipe.transformer.blocks[0]) and not pipeline_calls.is_tracked(pipe)
    tr = pipe.transformer
    pipe.transformer = torch.compile(tr, backend="vcattn")
    with pytest.raises(ValueError, match=r"already torch.compile'd.*_orig_mod"):
        vc_compile.enable(pipe)
    assert not compiled(tr.blocks[0]) and not pipeline_calls.is_tracked(pipe)
    pipe.transformer = tr
    # a component that is no module (the scheduler): a clear error naming the transformers, raised before the
    # transformer listed first is compiled (it used to be compiled, then AttributeError, and disable() failed)
    for comps in (["transformer", "scheduler"], ["scheduler"]):
        with pytest.raises(ValueError, match=r"\['scheduler'\].*not torch.nn.Modules.*components=\['transformer'\]"):
            vc_compile.enable(pipe, components=comps, **OPTS)
        assert not compiled(tr.blocks[0]) and not pipeline_calls.is_tracked(pipe) and pipe.transformer is tr


def test_enable_a_bare_module():
    pipe, call = wan(layers=1)
    tr = pipe.transformer
    assert vc_compile.enable(tr, method="dense", **OPTS) is tr
    assert compiled(tr.blocks[0])
    run(pipe, call, 2)  # the pipeline itself is not tracked: the frame probe gives its steps
    (site,) = sites()
    assert site.step_sources == {"diffusers": 4}
    vc_compile.disable(tr)
    assert not compiled(tr.blocks[0])


def test_vcconfig_validated_when_built():
    with pytest.raises(VCConfigError, match="method='bogus'"):
        VCConfig(method="bogus")
    with pytest.raises(VCConfigError, match="density"):
        VCConfig(density="0.5")
    assert VCConfig(method="mcsparse", head_dims=[64]).head_dims == (64,)
    assert VCConfig(method="mcsparse") == VCConfig.from_options({"method": "mcsparse"})


def test_backend_accepts_a_vcconfig():
    m = torch.nn.Linear(4, 4)
    f = torch.compile(m, backend="vcattn", options=VCConfig(experimental={"compiler": "eager"}))
    x = torch.randn(2, 4)
    torch.testing.assert_close(f(x), m(x))


# ---- the VCATTN_METHOD switch -----------------------------------------------------------------------------
def test_env_switch_off_and_method(monkeypatch):
    pipe, call = wan(layers=1)
    ref = run(pipe, call, 2)
    monkeypatch.setenv("VCATTN_METHOD", "off")
    vc_compile.enable(pipe, method="vsmooth", **OPTS)
    assert not compiled(pipe.transformer.blocks[0]) and not pipeline_calls.is_tracked(pipe)
    assert torch.equal(run(pipe, call, 2), ref)

    monkeypatch.setenv("VCATTN_METHOD", "Dense")  # case-insensitive
    vc_compile.enable(pipe, method="vsmooth", **OPTS)
    run(pipe, call, 2)
    assert {s.method for s in sites()} == {"dense"}

    monkeypatch.setenv("VCATTN_METHOD", "fast")
    with pytest.raises(VCConfigError, match="VCATTN_METHOD='fast'.*off, auto, dense, vsmooth, mcsparse"):
        vc_compile.enable(pipe)


def test_env_switch_at_backend_compile(monkeypatch):
    """``torch.compile(backend="vcattn")`` reads the switch when it compiles: off = Inductor/eager with no
    rewrite (no call site), a method = that method."""
    pipe, call = wan(layers=1)
    tr = pipe.transformer
    monkeypatch.setenv("VCATTN_METHOD", "off")
    pipe.transformer = torch.compile(tr, backend="vcattn", options={"method": "vsmooth", **OPTS})
    run(pipe, call, 2)
    assert not vc_compile.report().sites and counters["vcattn"]["rewrite"] == 0
    torch._dynamo.reset()
    monkeypatch.setenv("VCATTN_METHOD", "mcsparse")
    pipe.transformer = torch.compile(tr, backend="vcattn", options={"method": "vsmooth", **OPTS})
    run(pipe, call, 2)
    assert {s.method for s in sites()} == {"mcsparse"}


# ---- attention backends -------------------------------------------------------------------------------------
def _processors(model):
    return [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]


def test_attention_backend_reset_and_restored(monkeypatch):
    ad = pytest.importorskip("diffusers.models.attention_dispatch")
    pipe, call = wan(layers=1)
    procs = _processors(pipe.transformer)
    assert procs, "diffusers >= 0.35 processors carry _attention_backend"
    flash = ad.AttentionBackendName("flash")
    for p in procs:  # what set_attention_backend("flash") records (without flash-attn installed)
        monkeypatch.setattr(p, "_attention_backend", flash)
    with pytest.warns(UserWarning, match=r"attention backend\(s\) \['flash'\].*set to 'native'"):
        vc_compile.enable(pipe, method="dense", **OPTS)
    assert all(p._attention_backend == "native" for p in procs)
    run(pipe, call, 2)
    assert len(sites()) == 1  # the self-attention was seen and rewritten
    vc_compile.disable(pipe)
    assert all(p._attention_backend is flash for p in procs)
    with pytest.warns(UserWarning, match=r"keeps the diffusers attention backend\(s\) \['flash'\]"):
        vc_compile.enable(pipe, method="dense", reset_attention_backend=False, **OPTS)
    assert all(p._attention_backend is flash for p in procs)


def test_global_attention_backend_is_overridden_per_model(monkeypatch):
    ad = pytest.importorskip("diffusers.models.attention_dispatch")
    monkeypatch.setattr(ad._AttentionBackendRegistry, "_active_backend", ad.AttentionBackendName("flash"))
    pipe, _ = wan(layers=1)
    with pytest.warns(UserWarning, match="flash"):
        vc_compile.enable(pipe, method="dense", **OPTS)
    assert all(p._attention_backend == "native" for p in _processors(pipe.transformer))
    vc_compile.disable(pipe)
    assert all(p._attention_backend is None for p in _processors(pipe.transformer))


# ---- copies and shared modules ------------------------------------------------------------------------------
def test_an_enabled_pipeline_pickles_and_copies_as_not_enabled():
    """pickle.dumps raised (enable swaps the pipeline's class for an unimportable subclass) and a deepcopy said
    "enabled" while it ran stock (torch drops a module's compiled call on copy). Now both copies are the
    pipeline's own class, not enabled, and say so; the original stays enabled."""
    import copy
    import pickle

    from vc_compile.pipeline import enabled_options
    pipe, call = wan()
    cls = type(pipe)
    vc_compile.enable(pipe, method="vsmooth", **OPTS)
    for c in (pickle.loads(pickle.dumps(pipe)), copy.deepcopy(pipe)):
        assert type(c) is cls and enabled_options(c) is None
        assert not any(compiled(b) for b in c.transformer.blocks)
        vc_compile.enable(c, method="vsmooth", **OPTS)  # a copy can be enabled on its own
        assert all(compiled(b) for b in c.transformer.blocks)
        vc_compile.disable(c)
    assert enabled_options(pipe) is not None and all(compiled(b) for b in pipe.transformer.blocks)


def test_two_pipelines_sharing_a_transformer_keep_it_until_both_are_disabled():
    """disable(p1) un-compiled the transformer p2 shares, p2 still saying it was enabled. Now the shared modules
    stay compiled while another enabled pipeline holds them."""
    from vc_compile.pipeline import enabled_options
    p1, call = wan()
    p2 = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=p1.transformer,
                     scheduler=p1.scheduler)
    vc_compile.enable(p1, method="vsmooth", **OPTS)
    vc_compile.enable(p2, method="vsmooth", **OPTS)
    vc_compile.disable(p1)
    assert enabled_options(p2) is not None and all(compiled(b) for b in p1.transformer.blocks)
    vc_compile.disable(p2)
    assert not any(compiled(b) for b in p1.transformer.blocks)
