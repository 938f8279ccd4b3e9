"""Real diffusers 0.42 pipelines, unmodified, with ``torch.compile(transformer, backend="vcattn")``.

Tiny random-weight configs (research/clients.md) with ``attention_head_dim=64`` (the rewrite takes head
dims 64/128), ``vae=None`` (``output_type="latent"`` never decodes; the pipelines fall back to their
default scale factors), no text encoders (``prompt_embeds`` are given). Each test drives the real
pipeline ``__call__`` and checks what a user relies on: the phase sequence per call site follows the
schedule with steps read from the pipeline frame (``step_sources == {"diffusers": n}``), metadata is kept
per expert / block / CFG branch / resolution (``state.keys()``), steps/phases/branches never recompile,
and the output stays within the method's tolerance of the eager pipeline.

Cost: ``compiler="eager"`` (Dynamo + rewrite + op, no Inductor) everywhere but one test; the methods
run their plain-PyTorch reference on CPU.
"""
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("diffusers")

import vc_compile  # noqa: E402
from vc_compile.runtime import state  # noqa: E402
from vc_compile.runtime.steps import TRACKER  # noqa: E402

import tiny_diffusers  # noqa: E402

from diffusers import (  # noqa: E402
    CogVideoXDDIMScheduler, CogVideoXPipeline, FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline, HunyuanVideoTransformer3DModel, LTXPipeline, LTXVideoTransformer3DModel,
    MochiPipeline, MochiTransformer3DModel, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel)

BF = torch.bfloat16
TOL = {"dense": 0.0, "vsmooth": 0.05, "mcsparse": 0.05}  # relative L2 of the final latents vs eager


pytestmark = pytest.mark.usefixtures("fresh_vcattn")


def opts(method="dense", **kw):
    return {"min_seq_len": 64, "method": method, "kmeans_iters": 1,
            "experimental": {"compiler": "eager", "kmeans_init_iters": 2}, **kw}


def _quiet(p):
    p.set_progress_bar_config(disable=True)
    return p


def _embeds(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF)


def wan(two_experts=False, layers=1):
    def make():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=64, num_layers=layers, rope_max_seq_len=32).to(BF).eval()

    torch.manual_seed(0)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    extra = dict(transformer_2=make(), boundary_ratio=0.875) if two_experts else {}
    pipe = _quiet(WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=make(), scheduler=sched,
                              **extra))
    call = dict(prompt_embeds=_embeds(1, 8, 16, seed=1), negative_prompt_embeds=_embeds(1, 8, 16, seed=2),
                height=128, width=128, num_frames=9, guidance_scale=5.0, output_type="latent")
    return pipe, call  # 3 latent frames x 8 x 8 patches = 192 video tokens


def run(pipe, call, steps, seed=3, **kw):
    with torch.no_grad():
        return pipe(**{**call, **kw}, num_inference_steps=steps,
                    generator=torch.Generator().manual_seed(seed)).frames.float()


def relerr(a, b):
    return ((a - b).norm() / b.norm()).item()


def self_attn(rep):
    """Rewritten sites (self-attention; cross-attention to 8 text tokens stays SDPA)."""
    return rep.rewritten


def q_ptrs(transformer, blocks="blocks", attn="attn1"):
    return {getattr(b, attn).to_q.weight.data_ptr() for b in getattr(transformer, blocks)}


def graphs():
    return counters["stats"]["unique_graphs"]


# ---- Wan 2.1: CFG as two forwards per step -------------------------------------------------------------
def test_wan21_two_calls_per_step_two_generations():
    pipe, call = wan()
    ref = run(pipe, call, 4)
    ref2 = run(pipe, call, 3, width=192)
    eager_tr = pipe.transformer
    pipe.transformer = torch.compile(eager_tr, backend="vcattn", options=opts("vsmooth"))

    out = run(pipe, call, 4)
    rep = vc_compile.report()
    sites = self_attn(rep)
    assert len(sites) == 1 and len(rep.fallbacks) == 1
    assert {s.reason for s in rep.fallbacks} == {"cross-attention too short"}
    # 4 steps x (cond, uncond): 1 grouping step (step 0), its k-means in the cond branch only (the uncond branch
    # reuses that grouping: share_grouping)
    for s in sites:
        assert s.phases == {"group": 1, "reuse": 7}
        assert s.step_sources == {"diffusers": 8}
        assert s.has_identity
    keys = state.keys()
    assert {k[2] for k in keys} == {0, 1}  # cond and uncond each keep a slot (one grouping for both)
    assert {k[1] for k in keys} == q_ptrs(eager_tr)  # keyed by the block's q-projection weight
    assert relerr(out, ref) < TOL["vsmooth"]
    assert graphs() == 1
    gen1 = TRACKER.generation

    # generation 2: other step count and resolution (3 x 8 x 12 = 288 tokens): one shape recompile only
    vc_compile.reset(report=True)
    out2 = run(pipe, call, 3, width=192)
    assert TRACKER.generation > gen1
    sites = self_attn(vc_compile.report())
    for s in sites:  # 1 grouping step (step 0), in the cond branch
        assert s.phases == {"group": 1, "reuse": 5} and s.step_sources == {"diffusers": 6}
    assert {k[3][2] for k in state.keys()} == {288}  # nothing kept from the first resolution
    assert relerr(out2, ref2) < TOL["vsmooth"]
    assert graphs() == 2
    # generation 3 at the same resolution: steps, phases and branches add no graph
    run(pipe, call, 2, width=192)
    assert graphs() == 2


# ---- Wan 2.2 A14B: two experts, one shared graph --------------------------------------------------------
def test_wan22_two_experts_share_a_graph_not_metadata():
    pipe, call = wan(two_experts=True)
    ref = run(pipe, call, 6)
    e1, e2 = pipe.transformer, pipe.transformer_2
    o = opts("mcsparse", density=0.5)
    pipe.transformer = torch.compile(e1, backend="vcattn", options=o)
    pipe.transformer_2 = torch.compile(e2, backend="vcattn", options=o)
    written = []
    put = state.put

    def spy(key, meta):
        written.append(key)
        put(key, meta)

    state.put = spy
    try:
        out = run(pipe, call, 6)
    finally:
        state.put = put
    written = [k for k in written if k[-1] != "warmup"]  # the sparse metadata (not the warm-up's grouping)
    # UniPC shift 3, 6 steps: t = 999, 937 (>= 875: expert 1), 857, 750, 600, 376 (expert 2)
    assert graphs() == 1  # both experts run the same compiled graph
    # mcsparse, n = 6: (V-Smooth) warm-up step 0, anchors {1, 3}; expert 2's first step (2) has no metadata
    # of its own and anchors instead of reusing expert 1's selection
    for s in self_attn(vc_compile.report()):
        assert s.phases == {"warmup": 2, "anchor": 6, "reuse": 4}, s.phases
        assert s.step_sources == {"diffusers": 12}
    p1, p2 = q_ptrs(e1), q_ptrs(e2)
    assert not p1 & p2
    assert {k[1] for k in written} == p1 | p2
    # expert 1 wrote only at its anchor step (before any expert-2 key), expert 2 from its first step
    n1 = 2 * len(p1)  # one anchor step x (cond, uncond) per block
    assert all(k[1] in p1 for k in written[:n1]) and all(k[1] in p2 for k in written[n1:])
    assert len(written) == n1 + 2 * n1  # expert 2 anchors at steps 2 and 3
    assert {k[2] for k in written} == {0, 1}
    assert relerr(out, ref) < TOL["mcsparse"]


# ---- Wan, regional compile: one block graph for every block ---------------------------------------------
def test_wan_compile_repeated_blocks_keys_per_block():
    pipe, call = wan(layers=3)
    ref = run(pipe, call, 4)
    pipe.transformer.compile_repeated_blocks(backend="vcattn", options=opts("vsmooth"), fullgraph=True)
    out = run(pipe, call, 4)
    rep = vc_compile.report()
    (site,) = self_attn(rep)  # one graph, one self-attention site, serving 3 blocks
    assert site.has_identity
    assert site.calls == 3 * 2 * 4
    assert site.phases == {"group": 3, "reuse": 21}  # step 0 of each block groups in the cond branch
    assert site.step_sources == {"diffusers": 24}
    keys = state.keys()
    assert {k[1] for k in keys} == q_ptrs(pipe.transformer)
    assert len(keys) == 3 * 2  # per block, per branch
    assert relerr(out, ref) < TOL["vsmooth"]
    assert graphs() == 1


# ---- HunyuanVideo: joint attention with a text padding mask ----------------------------------------------
def test_hunyuan_joint_attention_runs_on_the_kept_keys():
    torch.manual_seed(0)
    tr = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(16, 24, 24)).to(BF).eval()
    pipe = _quiet(HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=tr, vae=None,
                                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                                       text_encoder_2=None, tokenizer_2=None))
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[:, 5:] = 0  # 3 padding tokens
    call = dict(prompt_embeds=_embeds(1, 8, 16, seed=1), pooled_prompt_embeds=_embeds(1, 8, seed=2),
                prompt_attention_mask=mask, height=128, width=128, num_frames=9, guidance_scale=6.0,
                output_type="latent")
    ref = run(pipe, call, 3)
    pipe.transformer = torch.compile(tr, backend="vcattn", options=opts("vsmooth"))
    out = run(pipe, call, 3)
    rep = vc_compile.report()
    # dual- and single-stream blocks: joint attention over 192 video + 8 text tokens with a boolean [B, 1, 1, S]
    # mask dropping the 3 padding tokens: the method runs on the first 197 keys; the text refiner's per-query
    # [B, 1, S, S] mask stays stock SDPA, said so
    mods = {s.module: s for s in rep.sites}  # module paths (passes/names.py), e.g. transformer_blocks.0.attn
    joint = [s for m, s in mods.items() if m.startswith(("transformer_blocks.", "single_transformer_blocks."))]
    refiner = [s for m, s in mods.items() if m.startswith("context_embedder.token_refiner.")]
    assert len(joint) == 2 and refiner
    for s in joint:
        assert s.rewritten and s.key_padding == "197 of 200 keys" and not s.runtime_fallbacks
        assert s.phases == {"group": 1, "reuse": 2}
    assert {s.reason for s in refiner} == {"masked"} and not any(s.rewritten for s in refiner)
    # the counter counts per compiled graph; the report has one record per call site (the recompile
    # for the pipeline's timestep dtype, below, finds the same sites)
    assert counters["vcattn"]["rewrite"] == len(joint) * graphs()
    assert counters["vcattn"]["fallback:masked"] == len(refiner) * graphs()
    assert relerr(out, ref) < TOL["vsmooth"]
    # the pipeline itself changes the timestep dtype after step 0 (one diffusers-side recompile);
    # a second generation adds no graph
    n = graphs()
    run(pipe, call, 2)
    assert graphs() == n


# ---- HunyuanVideo 1.5: a per-query mask (valid_i & valid_j), the valid tokens reordered first ----------------
def test_hunyuan15_per_query_padding_mask_runs_on_the_kept_block():
    import diffusers

    if not hasattr(diffusers, "HunyuanVideo15Transformer3DModel"):
        pytest.skip(f"diffusers {diffusers.__version__} has no HunyuanVideo 1.5")
    torch.manual_seed(0)
    HunyuanVideo15Transformer3DModel = diffusers.HunyuanVideo15Transformer3DModel
    tr = HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, num_layers=2,
        num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=8, rope_axes_dim=(16, 24, 24),
        task_type="t2v").to(BF).eval()
    m1, m2 = torch.ones(1, 12, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)
    m1[:, 7:], m2[:, 4:] = 0, 0  # 5 + 2 padding tokens; the 4 image tokens of t2v are invalid too
    args = (torch.randn(1, 4, 3, 16, 16).to(BF), torch.tensor([500.0]).to(BF))
    kw = dict(encoder_hidden_states=_embeds(1, 12, 16, seed=1), encoder_attention_mask=m1,
              encoder_hidden_states_2=_embeds(1, 6, 8, seed=2), encoder_attention_mask_2=m2,
              image_embeds=torch.zeros(1, 4, 8).to(BF), return_dict=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = tr(*args, **kw)[0].float()
        ctr = torch.compile(tr, backend="vcattn", options=opts("vsmooth", min_seq_len=256))
        with vc_compile.sampling(num_steps=3):
            for i in range(3):
                vc_compile.step(i)
                out = ctr(*args, **kw)[0].float()
    # its graph pieces without attention are listed, not warned of: its attention is rewritten
    assert vc_compile.report().graphs_without_sdpa
    assert not [w for w in caught if "no scaled_dot_product_attention" in str(w.message)]
    # 768 video + 4 byt5 + 7 mllm tokens kept of 790: the [B, 1, S, S] mask's first 779 rows keep the first 779 keys
    (s,) = vc_compile.report().rewritten
    assert s.key_padding == "779 of 790 keys" and s.phases == {"group": 2, "reuse": 4} and not s.runtime_fallbacks
    assert relerr(out, ref) < TOL["vsmooth"]


# ---- CogVideoX: batched CFG, direct SDPA in [B, H, S, D] -------------------------------------------------
def cogvideox():
    tr = tiny_diffusers.cogvideox_transformer()
    pipe = _quiet(CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=tr,
                                    scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing")))
    call = dict(prompt_embeds=_embeds(1, 8, 16, seed=1), negative_prompt_embeds=_embeds(1, 8, 16, seed=2),
                height=128, width=128, num_frames=9, guidance_scale=6.0, output_type="latent")
    return pipe, call  # 8 text + 3 x 8 x 8 video = 200 joint tokens


def test_cogvideox_batched_cfg_and_batch_change():
    pipe, call = cogvideox()
    ref = run(pipe, call, 4)
    tr = pipe.transformer
    pipe.transformer = torch.compile(tr, backend="vcattn", options=opts("vsmooth"))
    out = run(pipe, call, 4)
    sites = self_attn(vc_compile.report())
    assert len(sites) == 1
    for s in sites:  # one call per step, B = 2 (uncond, cond) in one batch
        assert s.shape.startswith("2x2x200x64")
        assert s.phases == {"group": 1, "reuse": 3} and s.step_sources == {"diffusers": 4}
    keys = state.keys()
    assert {k[2] for k in keys} == {0} and {k[3][0] for k in keys} == {2}
    assert {k[1] for k in keys} == q_ptrs(tr, "transformer_blocks")
    for k in keys:  # per-(b, h) permutations: the CFG rows never share one
        assert state.get(k).perm.shape[:2] == (2, 2)
    assert relerr(out, ref) < TOL["vsmooth"]
    assert graphs() == 1
    # a new batch (two prompts -> B = 4): fresh metadata, grouping again from step 0
    vc_compile.reset(report=True)
    run(pipe, call, 3, prompt_embeds=_embeds(2, 8, 16, seed=4), negative_prompt_embeds=_embeds(2, 8, 16, seed=5))
    for s in self_attn(vc_compile.report()):
        assert s.phases == {"group": 1, "reuse": 2}
    assert {k[3][0] for k in state.keys()} == {4}


# ---- LTX-Video: batched CFG, RoPE before the head split, masked cross-attention ----------------------------
def test_ltx_batched_cfg():
    torch.manual_seed(0)
    tr = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                    num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
                                    num_layers=1, caption_channels=16).to(BF).eval()
    pipe = _quiet(LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                              tokenizer=None, transformer=tr))
    ones = torch.ones(1, 8, dtype=torch.long)
    call = dict(prompt_embeds=_embeds(1, 8, 16, seed=1), prompt_attention_mask=ones,
                negative_prompt_embeds=_embeds(1, 8, 16, seed=2), negative_prompt_attention_mask=ones,
                height=256, width=256, num_frames=9, guidance_scale=3.0, output_type="latent")
    ref = run(pipe, call, 4)
    pipe.transformer = torch.compile(tr, backend="vcattn", options=opts("mcsparse", density=0.5))
    out = run(pipe, call, 4)
    rep = vc_compile.report()
    (site,) = rep.rewritten
    assert site.shape == "2x2x128x64"
    # mcsparse, n = 4: (V-Smooth) warm-up step 0 (round(0.8) = 1), anchors {1, 2}, reuse 3
    assert site.phases == {"warmup": 1, "anchor": 2, "reuse": 1}
    assert site.step_sources == {"diffusers": 4}
    assert [s.reason for s in rep.fallbacks] == ["masked"]  # cross-attention carries the text mask bias
    assert relerr(out, ref) < TOL["mcsparse"]
    assert graphs() == 1


# ---- Mochi: attention behind graph breaks ----------------------------------------------------------------
def mochi():
    torch.manual_seed(0)
    tr = MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=64, num_layers=1,
                                 pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=4,
                                 max_sequence_length=16).to(BF).eval()
    pipe = _quiet(MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True), vae=None,
                                text_encoder=None, tokenizer=None, transformer=tr))
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[:, 6:] = 0
    call = dict(prompt_embeds=_embeds(1, 8, 16, seed=1), prompt_attention_mask=mask,
                negative_prompt_embeds=_embeds(1, 8, 16, seed=2),
                negative_prompt_attention_mask=torch.ones(1, 8, dtype=torch.long),
                height=128, width=128, num_frames=7, guidance_scale=4.5, output_type="latent")
    return pipe, call


def test_mochi_graph_breaks_warn_then_capture():
    pipe, call = mochi()
    ref = run(pipe, call, 3)
    tr = pipe.transformer
    pipe.transformer = torch.compile(tr, backend="vcattn", options=opts("vsmooth"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(pipe, call, 3)
    rep = vc_compile.report()
    assert not rep.rewritten  # the joint attention runs eagerly between graphs: nothing to rewrite
    assert rep.graphs_without_sdpa and counters["vcattn"]["no_sdpa:graph-break"] >= 1
    msgs = [str(w.message) for w in caught if "vcattn" in str(w.message)]
    assert msgs and all("capture_dynamic_output_shape_ops" in m for m in msgs)
    assert torch.equal(out, ref)

    # as the warning says: capture the nonzero() -> one graph, per-sample SDPA with unbacked lengths
    torch._dynamo.reset()
    vc_compile.reset(report=True)
    counters.clear()
    pipe.transformer = torch.compile(tr, backend="vcattn", options=opts("vsmooth"))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out = run(pipe, call, 4)
    rep = vc_compile.report()
    assert counters["vcattn"]["graphs_without_sdpa"] == 0
    assert len(rep.rewritten) == 2  # one SDPA per sample (the batched CFG rows, split by the loop)
    for s in rep.rewritten:
        assert s.shape.split("x")[2].startswith("u")  # the joint length is an unbacked SymInt
        assert s.phases == {"group": 1, "reuse": 3} and s.step_sources == {"diffusers": 4}
    # Mochi's timesteps go upwards; steps come from the pipeline frame, so that does not matter
    assert list(pipe.scheduler.timesteps) == sorted(pipe.scheduler.timesteps)
    pipe.transformer = tr
    ref4 = run(pipe, call, 4)
    assert relerr(out, ref4) < TOL["vsmooth"]


# ---- a third-party attention backend hides SDPA ----------------------------------------------------------
@torch.library.custom_op("vctest::fake_sageattn", mutates_args=())
def _fake_sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Stands in for sageattention's kernel: an opaque op taking [B, S, H, D]."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).contiguous()


@_fake_sageattn.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def test_wan_sage_backend_warns(monkeypatch):
    """diffusers' ``set_attention_backend("sage")`` needs sageattention + CUDA; simulate its kernel with an
    opaque custom op registered as the 'sage' backend (what the real one looks like to Dynamo)."""
    from diffusers.models import attention_dispatch as ad

    def sage(query, key, value, attn_mask=None, is_causal=False, scale=None, return_lse=False,
             _parallel_config=None):
        return _fake_sageattn(query, key, value)

    name = ad.AttentionBackendName.SAGE
    monkeypatch.setattr(ad, "_check_attention_backend_requirements", lambda backend: None)
    monkeypatch.setitem(ad._AttentionBackendRegistry._backends, name, sage)
    monkeypatch.setitem(ad._AttentionBackendRegistry._constraints, name, [])
    # set_attention_backend also sets diffusers' process-wide active backend: restore it afterwards
    monkeypatch.setattr(ad._AttentionBackendRegistry, "_active_backend",
                        ad._AttentionBackendRegistry._active_backend)
    pipe, call = wan()
    pipe.transformer.set_attention_backend("sage")
    pipe.transformer = torch.compile(pipe.transformer, backend="vcattn", options=opts())
    with pytest.warns(UserWarning, match=r"set_attention_backend\('native'\)"):
        run(pipe, call, 2)
    assert counters["vcattn"]["no_sdpa:third-party"] == 1
    assert vc_compile.report().graphs_without_sdpa and not vc_compile.report().sites


# ---- the Inductor path -----------------------------------------------------------------------------------
def test_wan_inductor_reduce_overhead_cpu():
    """The one Inductor compile of a real pipeline: mode='reduce-overhead' (CUDA graphs are skipped by
    Inductor on CPU; graph partitioning is still requested), 1 layer to keep the compile short."""
    pipe, call = wan()
    ref = run(pipe, call, 3)
    pipe.transformer = torch.compile(pipe.transformer, backend="vcattn",
                                     options={"mode": "reduce-overhead", "min_seq_len": 64})
    out = run(pipe, call, 3)
    (site,) = self_attn(vc_compile.report())
    assert site.phases == {"group": 1, "reuse": 5} and site.step_sources == {"diffusers": 6}
    assert relerr(out, ref) < TOL["vsmooth"]
    run(pipe, call, 2)
    assert graphs() == 1


# ---- Lumina2: embedders split off by graph breaks, the attention in another graph ---------------------------
def test_lumina2_graph_pieces_without_attention_do_not_warn():
    """Lumina2's embedders compile as graph pieces without attention while its attention is rewritten in
    another graph: no "no attention reached the compiled graphs" warning (that warning is for Mochi, where no
    graph gets a rewritten attention), the pieces still listed in ``report().graphs_without_sdpa``."""
    from diffusers import Lumina2Transformer2DModel
    torch.manual_seed(0)
    tr = Lumina2Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, hidden_size=128, num_layers=2,
                                   num_refiner_layers=1, num_attention_heads=2, num_kv_heads=2, multiple_of=16,
                                   cap_feat_dim=32, axes_dim_rope=(16, 24, 24), axes_lens=(300, 512, 512)).to(BF).eval()
    args = (torch.randn(1, 4, 16, 16).to(BF), torch.tensor([0.5]), _embeds(1, 8, 32, seed=1),
            torch.ones(1, 8, dtype=torch.bool))
    c = torch.compile(tr, backend="vcattn", options=opts("vsmooth", min_seq_len=1))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), vc_compile.sampling(num_steps=3):
        warnings.simplefilter("always")
        for i in range(3):
            vc_compile.step(i)
            c(*args)
    rep = vc_compile.report()
    assert rep.rewritten and rep.graphs_without_sdpa
    assert not [w for w in caught if "no scaled_dot_product_attention" in str(w.message)]
