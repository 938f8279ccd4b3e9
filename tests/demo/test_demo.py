"""Tests of the shipped demo (vc_compile/demo): weights (and the message when they are missing), data,
sampler, the diffusers ``WanPipeline`` path and its scheduler, metrics, the grid/GIF/MP4 writers, capture,
and tiny generations through ``backend="vcattn"``. CPU only; the generations use a 2-layer model of the
demo's architecture (random weights) except the one end-to-end run of ``python -m vc_compile.demo``."""
from __future__ import annotations

import collections
import dataclasses
import math
import warnings

import pytest
import torch

from vc_compile.demo import data, metrics
from vc_compile.demo.model import (DEFAULT_WEIGHTS, FIDELITY_CONFIG, FIDELITY_WEIGHTS, DemoConfig,
                                   DemoWeightsMissing, SpriteTextEncoder, build_transformer, cast_for_inference,
                                   describe_tokens, encode, load_demo, parse_prompt, save_weights)
from vc_compile.demo.sampler import sample, sigmas

# ---------------------------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def demo():
    """(transformer bf16, text encoder, cfg, trained): the shipped weights, else random ones."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the random-weights warning is tested below
        return load_demo(device="cpu", dtype=torch.bfloat16, allow_random=True)


def test_shipped_weights_load_into_wan():
    if not DEFAULT_WEIGHTS.is_file():
        pytest.skip(f"no trained weights shipped yet at {DEFAULT_WEIGHTS} (train with python -m vc_compile.demo.train)")
    from diffusers import WanTransformer3DModel

    assert DEFAULT_WEIGHTS.stat().st_size <= 15e6
    tr, te, cfg, trained = load_demo(allow_random=False)
    assert trained and isinstance(tr, WanTransformer3DModel)
    assert tr.config.attention_head_dim == 128 and tr.config.in_channels == 3
    assert all(torch.isfinite(p).all() for p in tr.parameters())


def test_weights_roundtrip(tmp_path):
    cfg = DemoConfig()
    torch.manual_seed(0)
    tr, te = build_transformer(cfg), SpriteTextEncoder(cfg)
    path = save_weights(tmp_path / "w.safetensors", tr, te, cfg)
    assert path.stat().st_size <= 15e6
    tr2, te2, cfg2, trained = load_demo(path, dtype=torch.float32)
    assert trained and cfg2 == cfg
    for (k, a), b in zip(tr.state_dict().items(), tr2.state_dict().values()):
        assert torch.equal(a.half().float(), b), k
    assert torch.equal(te.colour.weight.half().float(), te2.colour.weight)


def test_missing_weights_say_where_they_come_from(tmp_path):
    """The wheel has no weights: the error names the clone, --weights and training, never random weights."""
    absent = tmp_path / "absent.safetensors"
    with pytest.raises(DemoWeightsMissing) as e:
        load_demo(absent)
    msg = str(e.value)
    assert str(absent) in msg and "clone" in msg and "--weights" in msg and "vc_compile.demo.train" in msg
    assert isinstance(e.value, FileNotFoundError)
    with pytest.warns(UserWarning, match="RANDOM weights"):  # only when asked for
        _, _, _, trained = load_demo(absent, allow_random=True)
    assert not trained


def test_demo_cli_missing_weights_exits_with_the_message(tmp_path):
    from vc_compile.demo.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--weights", str(tmp_path / "absent.safetensors"), "--out", str(tmp_path), "--device", "cpu"])
    assert "clone" in str(e.value.code) and "--random-weights" in str(e.value.code)
    assert not (tmp_path / "grid.png").exists()


def test_demo_without_its_extra_names_the_install(tmp_path, monkeypatch):
    """After a plain ``pip install`` (no Pillow) the demo ended in a raw ModuleNotFoundError: PIL; now it exits
    naming the missing packages and the extra that brings them, before loading anything."""
    import importlib.util

    from vc_compile.demo import __main__ as demo_main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        demo_main.main(["--out", str(tmp_path), "--device", "cpu"])
    assert "pillow" in str(e.value.code) and "vc_compile[demo]" in str(e.value.code)
    assert not (tmp_path / "grid.png").exists()


def test_prompt_parsing():
    t = parse_prompt("red circle right; Blue SQUARE up")
    assert t.shape == (1, 3, 3) and t[0, 2].tolist() == [0, 0, 0]
    assert describe_tokens(t[0]) == "red circle right; blue square up"
    assert parse_prompt("").abs().sum() == 0
    with pytest.raises(ValueError, match="exactly one"):
        parse_prompt("red blue circle right")

def test_int8_storage_halves_the_file_within_its_rounding(tmp_path):
    """int8 storage: matrices as int8 codes with a per-row scale (error <= half a step of its row), vectors fp16,
    about half the bytes of fp16; the loader dequantises."""
    cfg = dataclasses.replace(FIDELITY_CONFIG, num_layers=1)
    torch.manual_seed(0)
    tr, te = build_transformer(cfg), SpriteTextEncoder(cfg)
    p16 = save_weights(tmp_path / "a.safetensors", tr, te, cfg)
    p8 = save_weights(tmp_path / "b.safetensors", tr, te, cfg, storage="int8")
    assert p8.stat().st_size < 0.55 * p16.stat().st_size
    tr2, _, cfg2, trained = load_demo(p8, dtype=torch.float32)
    assert trained and cfg2 == cfg
    for (k, a), b in zip(tr.state_dict().items(), tr2.state_dict().values()):
        if a.dim() >= 2 and a.numel() >= 4096:
            step = a.abs().reshape(a.shape[0], -1).amax(1) / 127
            assert ((a - b).abs().reshape(a.shape[0], -1) <= step[:, None] * 0.5001 + 1e-7).all(), k
        else:
            assert torch.equal(a.half().float(), b), k
    with pytest.raises(ValueError, match="storage"):
        save_weights(tmp_path / "c.safetensors", tr, te, cfg, storage="int4")


def test_fidelity_weights_ship_and_load():
    """The fidelity model: 4 heads x 128, trained last at 21 x 60 x 104 px (32760 tokens), <= 40 MB."""
    if not FIDELITY_WEIGHTS.is_file():
        pytest.skip(f"no fidelity weights at {FIDELITY_WEIGHTS}")
    assert FIDELITY_WEIGHTS.stat().st_size <= 40e6
    tr, te, cfg, trained = load_demo("fidelity", dtype=torch.float32)
    assert trained and cfg.num_attention_heads >= 4 and tr.config.attention_head_dim == 128
    assert cfg.tokens(cfg.frames, cfg.height, cfg.width) == 32760 and cfg.camera
    assert all(torch.isfinite(p).all() for p in tr.parameters())


# ----------------------------------------------------------------------------------------------- data


def test_camera_pans_and_leaves_the_other_choices_alone():
    """A camera pan moves the background (static without one); the seed's other choices stay the same."""
    p0, p1 = data.sample_params(5, 8), data.sample_params(5, 8, camera=True)
    assert all(torch.equal(p0[k], p1[k]) for k in p0) and "camera" not in p0
    moving = p1["camera"].norm(dim=-1) > 0
    assert moving.any() and (~moving).any()
    i = int(moving.nonzero()[0])
    bg = {k: v[i:i + 1] for k, v in p1.items()}
    bg["present"] = torch.zeros_like(bg["present"])
    v = data.render(bg, 3, 32, 32)
    assert (v[:, :, 1] - v[:, :, 0]).abs().max() > 1e-3
    still = dict(bg, camera=torch.zeros_like(bg["camera"]))
    v = data.render(still, 3, 32, 32)
    assert torch.equal(v[:, :, 1], v[:, :, 0])



def test_dataset_deterministic_from_seed():
    v1, t1 = data.make_batch(3, 4, 4, 32, 32)
    v2, t2 = data.make_batch(3, 4, 4, 32, 32)
    v3, t3 = data.make_batch(4, 4, 4, 32, 32)
    assert torch.equal(v1, v2) and torch.equal(t1, t2)
    assert not torch.equal(v1, v3)
    assert v1.shape == (4, 3, 4, 32, 32) and t1.shape == (4, 3, 3)
    assert v1.min() >= -1 and v1.max() <= 1
    assert ((t1 > 0).all(-1).sum(-1) >= 2).all()  # 2-3 sprites per clip


def test_sprite_moves_in_its_direction():
    p = data.sample_params(0, 1, max_sprites=1)
    p.update(present=torch.ones(1, 1, dtype=torch.bool), pos=torch.tensor([[[0.3, 0.5]]]),
             speed=torch.tensor([[1.0 / 32]]), tex_amp=torch.zeros(1, 1))
    bg = dict(p, present=torch.zeros(1, 1, dtype=torch.bool))
    for d, (dx, dy) in {"right": (4, 0), "up": (0, -4)}.items():
        p["direction"] = torch.tensor([[data.DIRECTIONS.index(d)]])
        diff = (data.render(p, 5, 32, 32) - data.render(bg, 5, 32, 32)).abs().sum(1)[0]  # [F, H, W]
        ys, xs = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
        cen = [((diff[f] * xs).sum() / diff[f].sum(), (diff[f] * ys).sum() / diff[f].sum()) for f in (0, 4)]
        assert abs(cen[1][0] - cen[0][0] - dx) < 0.3 and abs(cen[1][1] - cen[0][1] - dy) < 0.3, d

# -------------------------------------------------------------------------------------------- metrics


def test_psnr_known_values():
    x = torch.rand(3, 16, 16)
    assert metrics.psnr(x, x) == math.inf
    assert metrics.psnr(torch.zeros(4, 4), torch.full((4, 4), 0.1), data_range=1.0) == pytest.approx(20.0)
    # [-1, 1] range 2: an offset of 0.2 -> MSE 0.04 -> 10 log10(4 / 0.04) = 20 dB
    assert metrics.psnr(x * 2 - 1, x * 2 - 0.8) == pytest.approx(20.0)


def _ssim_direct(a, b, i, j, data_range):
    """SSIM at pixel (i, j) straight from the definition, with an explicit 11 x 11 window."""
    g = metrics.gaussian_window()
    w = g[:, None] * g[None, :]
    pa, pb = a[i - 5:i + 6, j - 5:j + 6].double(), b[i - 5:i + 6, j - 5:j + 6].double()
    ma, mb = (w * pa).sum(), (w * pb).sum()
    va, vb = (w * (pa - ma) ** 2).sum(), (w * (pb - mb) ** 2).sum()
    cov = (w * (pa - ma) * (pb - mb)).sum()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    return (((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma ** 2 + mb ** 2 + c1) * (va + vb + c2))).item()


def test_ssim_identical_and_direct():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(24, 20, generator=g)
    b = (a + 0.1 * torch.randn(24, 20, generator=g)).clamp(0, 1)
    assert metrics.ssim(a, a, data_range=1.0) == pytest.approx(1.0)
    m = metrics.ssim_map(a[None], b[None], data_range=1.0)[0]
    assert m.shape == (14, 10)
    for i, j in [(5, 5), (10, 7), (18, 14)]:
        assert m[i - 5, j - 5].item() == pytest.approx(_ssim_direct(a, b, i, j, 1.0), abs=1e-12)
    assert metrics.ssim(a, b, data_range=1.0) == pytest.approx(m.mean().item())
    assert metrics.ssim(a, 1 - a, data_range=1.0) < 0.1


def test_ssim_matches_scipy_skimage_recipe():
    """skimage's gaussian SSIM is scipy.ndimage.gaussian_filter(sigma=1.5, truncate=3.5) + crop 5."""
    ndimage = pytest.importorskip("scipy.ndimage")
    import numpy as np

    rng = np.random.default_rng(1)
    a = rng.random((3, 40, 33))
    b = np.clip(a + 0.2 * rng.standard_normal(a.shape), 0, 1)
    ref = []
    for ca, cb in zip(a, b):
        f = lambda x: ndimage.gaussian_filter(x, sigma=1.5, truncate=3.5)  # noqa: E731
        ux, uy = f(ca), f(cb)
        vx, vy, vxy = f(ca * ca) - ux * ux, f(cb * cb) - uy * uy, f(ca * cb) - ux * uy
        c1, c2 = 0.01 ** 2, 0.03 ** 2
        s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux ** 2 + uy ** 2 + c1) * (vx + vy + c2))
        ref.append(s[5:-5, 5:-5].mean())
    ours = metrics.ssim(torch.from_numpy(a), torch.from_numpy(b), data_range=1.0)
    assert ours == pytest.approx(float(np.mean(ref)), abs=1e-10)


def test_video_metrics_layout():
    x = torch.rand(1, 3, 4, 16, 16) * 2 - 1
    m = metrics.compare(x, x)
    assert m["psnr"] == math.inf and m["ssim"] == pytest.approx(1.0) and m["rel_l2"] == 0
    assert m["cos_sim"] == pytest.approx(1.0)

# -------------------------------------------------------------------------------------------- sampler


def test_sampler_convention_with_an_oracle():
    """With the exact velocity of a known x0, Euler lands on x0: checks t, timestep = 1000 t, signs."""
    x0 = torch.linspace(-0.5, 0.5, 3)[None, :, None, None, None]
    seen = []

    def oracle(hidden_states, timestep, encoder_hidden_states, return_dict):
        t = timestep[0].item() / 1000.0
        seen.append(t)
        return ((hidden_states.float() - x0) / t,)

    s = sigmas(4, shift=3.0)
    assert s[0] == 1 and s[-1] == 0 and bool((s[1:] < s[:-1]).all())
    out = sample(oracle, torch.zeros(1, 3, 8), frames=2, height=4, width=4, steps=4, seed=0,
                 dtype=torch.float32, shift=3.0)
    assert torch.allclose(out, x0.expand_as(out), atol=1e-5)
    assert seen == pytest.approx(s[:-1].tolist())

# ------------------------------------------------------------------------------- diffusers WanPipeline

TINY = DemoConfig(num_layers=2, num_attention_heads=1, attention_head_dim=64, ffn_dim=128, text_dim=32,
                  freq_dim=32)


def tiny_model(dtype):
    """(transformer, cond, uncond): the demo's architecture at 2 layers x 1 head x 64, random weights."""
    torch.manual_seed(0)
    tr, te = build_transformer(TINY).eval().requires_grad_(False), SpriteTextEncoder(TINY).eval()
    cast_for_inference(tr, dtype)
    with torch.no_grad():
        cond = encode(te, parse_prompt("red circle right; blue square up", TINY.max_sprites), dtype)
        uncond = encode(te, parse_prompt("", TINY.max_sprites), dtype)
    return tr, cond, uncond


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_pipeline_scheduler_takes_the_samplers_steps(shift):
    """shift 1 (the trained sampler): diffusers' grid is sampler.sigmas exactly; shift 3: the end points
    agree and the interior is within 0.05 (diffusers' shift_terminal stretch is not the sampler's grid)."""
    from vc_compile.demo.pipe import flow_scheduler, max_sigma_gap

    for n in (1, 2, 6, 10, 50):
        sch = flow_scheduler(n, shift)
        sch.set_timesteps(n)
        assert len(sch.timesteps) == n and sch.sigmas[-1] == 0
        assert torch.allclose(sch.timesteps.double(), 1000 * sch.sigmas[:-1].double())
        ref = sigmas(n, shift)
        assert sch.sigmas[0] == pytest.approx(1.0) and sch.sigmas[-2].item() == pytest.approx(ref[-2].item(), abs=1e-6)
        assert max_sigma_gap(n, shift) < (1e-6 if shift == 1.0 else 0.05), n


def test_pipeline_reproduces_the_sampler():
    """WanPipeline (stock, no VAE/text encoder, output_type="latent") = sampler.sample: the same clip up to
    fp32 rounding with an fp32 model (measured 152 dB, max difference 1.4e-6); with bf16 the pipeline's
    bf16 CFG sum and bf16 latents cost precision only (measured 64 dB here; the shipped model at
    2 x 32 x 32 px, 4 steps: 45 dB)."""
    from vc_compile.demo.pipe import build_pipeline, generate

    kw = dict(frames=2, height=16, width=16, steps=3, seed=1, guidance=3.0)
    for dtype, floor in ((torch.float32, 120.0), (torch.bfloat16, 45.0)):
        tr, cond, uncond = tiny_model(dtype)
        pipe = build_pipeline(tr)
        clip = generate(pipe, cond, uncond, progress=False, **kw)
        ref = sample(tr, cond, uncond=uncond, dtype=dtype, **kw)
        assert clip.dtype == torch.float32 and clip.shape == ref.shape == (1, 3, 2, 16, 16)
        assert metrics.psnr(clip, ref, data_range=float(ref.max() - ref.min())) > floor, dtype
    # guidance 1: one forward per step, no negative prompt needed
    calls = []
    h = tr.register_forward_pre_hook(lambda m, a: calls.append(1))
    generate(pipe, cond, None, frames=1, height=16, width=16, steps=2, guidance=1.0, progress=False)
    h.remove()
    assert len(calls) == 2


def _vc_backend():
    try:
        import vc_compile.backend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"vc_compile.backend not importable yet: {e}")


@pytest.mark.parametrize("regional", [False, True], ids=["torch.compile", "compile_repeated_blocks"])
def test_pipeline_through_vcattn_reads_steps_from_the_pipeline(regional):
    """The zero-code path: compiled transformer inside WanPipeline, no vc_compile.step anywhere; every
    attention call learns its step from the pipeline's loop, and the methods' phases follow."""
    _vc_backend()
    from vc_compile.demo.pipe import build_pipeline, base_transformer
    from vc_compile.demo.runner import run_pipeline

    tr, cond, uncond = tiny_model(torch.bfloat16)
    pipe = build_pipeline(tr)
    # 4 steps: MC-Sparse's default schedule is then warmup, anchor, anchor, reuse; V-Smooth's group, reuse x 3
    steps, kw = 4, dict(frames=1, height=32, width=32, seed=0, guidance=3.0, warmup=1, regional=regional,
                        progress=False)
    extra = {"experimental": {"compiler": "eager"}, "min_seq_len": 128}  # 256 tokens; eager keeps the test fast
    dense = run_pipeline(pipe, cond, uncond, "dense", {"method": "dense", **extra}, steps=steps, **kw)
    methods = ({"method": "vsmooth"}, {"method": "mcsparse", "density": 0.25})
    for options in methods[1:] if regional else methods:  # regional: one method keeps the test short
        res = run_pipeline(pipe, cond, uncond, options["method"], {**options, **extra}, steps=steps, **kw)
        assert pipe.transformer is tr and base_transformer(pipe) is tr  # uncompiled afterwards
        assert torch.isfinite(res.clip).all() and res.clip.shape == (1, 3, 1, 32, 32)
        rep = res.report
        # every self-attention: a site per layer, or one site of the shared block graph (regional)
        assert len(rep.rewritten) == (1 if regional else TINY.num_layers)
        sources = sum((s.step_sources for s in rep.rewritten), collections.Counter())
        assert set(sources) and not set(sources) & {"explicit", "timestep", "call-count"}, sources
        phases = rep.phase_counts()
        assert sum(phases.values()) == steps * 2 * TINY.num_layers  # steps x (cond, uncond) x layers
        assert phases["group" if options["method"] == "vsmooth" else "anchor"] > 0
        assert phases["reuse"] > 0  # a later step reused what an earlier one computed
        assert res.attn_ms is not None and res.attn_ms > 0
        assert metrics.psnr(res.clip.clamp(-1, 1), dense.clip.clamp(-1, 1)) > 20.0

def test_the_clip_runs_the_kernels_past_the_speed_gate(monkeypatch):
    """The clip measures fidelity: on a GPU whose measurements gate its small shapes to stock SDPA (the H200 at
    4096 tokens x 2 heads) it would otherwise compare stock SDPA with itself. A user's own speed_gate wins."""
    from vc_compile.demo import pipe as demo_pipe
    from vc_compile.demo.runner import run_pipeline
    seen = []

    def compile_pipe(pipe, opts, regional=False):
        seen.append(dict(opts))
        raise KeyboardInterrupt  # stop before any generation
    monkeypatch.setattr(demo_pipe, "compile_pipe", compile_pipe)
    for options in ({"method": "vsmooth"}, {"method": "vsmooth", "speed_gate": "auto"}):
        with pytest.raises(KeyboardInterrupt):
            run_pipeline(None, None, None, "x", options, frames=1, height=32, width=32, steps=1, seed=0,
                         guidance=1.0)
    assert [o["speed_gate"] for o in seen] == ["off", "auto"]


# -------------------------------------------------------------------------------------------- writers


def _clips(n=2, frames=3, size=16):
    g = torch.Generator().manual_seed(0)
    return [torch.rand(3, frames, size, size, generator=g) * 2 - 1 for _ in range(n)]


def test_grid_is_labelled(tmp_path):
    from PIL import Image

    from vc_compile.demo.media import auto_scale, write_grid

    clips, s = _clips(), auto_scale(16)
    plain = Image.open(write_grid(tmp_path / "plain.png", clips)).convert("RGB")
    im = Image.open(write_grid(tmp_path / "g.png", clips, ["dense", "vsmooth"], title=["a title", "line 2"],
                               notes=[["reference"], ["PSNR 40.00 dB  SSIM 0.9900", "e2e 12 ms"]]))
    im = im.convert("RGB")
    pw, ph = plain.size
    assert pw == 3 * (16 * s + 2)  # no labels: frames only, plus the column header row
    w, h = im.size
    label_w, top = w - pw, h - ph + 18  # top: where the frames start (the plain grid has the header row)
    assert label_w > 100 and h - ph >= 40  # a label column and two title lines above the frame-index row
    import numpy as np

    px = torch.from_numpy(np.asarray(im).copy())
    dark = px.int().sum(-1) < 300
    assert dark[:top - 18, :200].any()  # title text
    assert dark[top - 18:top, label_w:label_w + 16 * s].any()  # "frame 0" above the first column
    assert dark[top:top + 16 * s, :label_w].any() and dark[top + 16 * s + 2:, :label_w].any()  # row labels
    # the frames themselves are pasted unchanged (nearest upscaling of the uint8 clip)
    from vc_compile.demo.media import to_uint8

    ref = to_uint8(clips[1])[2].repeat_interleave(s, 0).repeat_interleave(s, 1)
    y, x = top + 16 * s + 2, label_w + 2 * (16 * s + 2)
    assert torch.equal(px[y:y + 16 * s, x:x + 16 * s], ref)


def test_gif_and_mp4_side_by_side(tmp_path):
    from PIL import Image

    from vc_compile.demo.media import video_encoder_problem, write_gif, write_mp4

    clips = _clips(n=3, frames=4)
    gif = Image.open(write_gif(tmp_path / "d.gif", clips, ["a", "b", "c"]))
    assert gif.n_frames == 4
    if video_encoder_problem():
        pytest.skip(f"MP4 not testable here: {video_encoder_problem()}")
    import imageio
    import numpy as np

    frames = np.stack(imageio.mimread(write_mp4(tmp_path / "d.mp4", clips, ["a", "b", "c"])))
    assert frames.shape[0] == 4 and frames.shape[1] % 16 == 0 and frames.shape[2] % 16 == 0
    assert frames.shape[2] >= 3 * 16 * 8  # three clips side by side, upscaled 8x


def test_mp4_without_encoder_says_what_to_install(tmp_path, monkeypatch):
    import sys

    from vc_compile.demo.media import VideoEncoderMissing, write_mp4

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(VideoEncoderMissing, match="pip install imageio imageio-ffmpeg"):
        write_mp4(tmp_path / "d.mp4", _clips(), ["a", "b"])
    assert not (tmp_path / "d.mp4").exists()

# -------------------------------------------------------------------------------------------- capture


def test_capture_sees_every_attention(demo):
    from vc_compile.demo.capture import capture_sdpa

    tr, te, cfg, _ = demo
    calls = []
    x = torch.randn(1, 3, 2, 16, 16, dtype=torch.bfloat16)
    with capture_sdpa(tr, lambda info, q, k, v: calls.append((info["layer"], info["kind"], tuple(q.shape),
                                                                tuple(k.shape)))):
        tr(hidden_states=x, timestep=torch.tensor([500.0]),
           encoder_hidden_states=encode(te, parse_prompt("red circle up"), torch.bfloat16), return_dict=False)
    selfs = [c for c in calls if c[1] == "self"]
    assert [c[0] for c in selfs] == list(range(cfg.num_layers))
    assert selfs[0][2] == (1, cfg.num_attention_heads, 2 * 8 * 8, cfg.attention_head_dim)
    assert sum(c[1] == "cross" for c in calls) == cfg.num_layers
    assert torch.nn.functional.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"

def test_capture_run_picks_layers_steps_branches(demo, tmp_path):
    from vc_compile.demo.capture import capture_run

    tr, te, cfg, _ = demo
    cond = encode(te, parse_prompt("red circle up"), torch.bfloat16)
    uncond = encode(te, parse_prompt(""), torch.bfloat16)
    kept = capture_run(tr, cond, uncond, frames=1, height=16, width=16, num_steps=2, layers={1}, steps={1},
                       branches=("cond", "uncond"), out=tmp_path)
    assert [(r["layer"], r["step"], r["branch"]) for r in kept] == [(1, 1, "cond"), (1, 1, "uncond")]
    assert kept[0]["q"].shape == (1, cfg.num_attention_heads, 64, cfg.attention_head_dim)
    assert kept[0]["q"].is_contiguous() and not torch.equal(kept[0]["v"], kept[1]["v"])
    saved = torch.load(tmp_path / "qkv_L1_s1_cond.pt")
    assert torch.equal(saved["k"], kept[0]["k"]) and (tmp_path / "index.json").is_file()

def test_row_stats_read_concentration():
    """Top-15% key mass: 1 when every query looks at one key, ~0.15 when attention is uniform."""
    from vc_compile.demo.capture import row_stats

    g = torch.Generator().manual_seed(0)
    S, D = 200, 16
    k = torch.randn(1, 2, S, D)
    st = row_stats(torch.zeros(1, 2, S, D), k, 64, g)  # q = 0: uniform
    assert st["top15pct_mass"] == pytest.approx(30 / 200, abs=1e-6) and st["entropy_ratio"] == pytest.approx(1.0)
    st = row_stats(k * 50, k, 64, g)  # each query is its own key, scaled: one key takes the mass
    assert min(st["top15pct_mass_heads"]) > 0.99 and len(st["top15pct_mass_heads"]) == 2


def test_errors_by_phase_follow_the_schedule():
    """errors_by_phase runs the op's real schedule over captured steps: V-Smooth groups then reuses; a baseline
    that is exact attention scores ~0 (fp32), one that is not scores its error."""
    from vc_compile.demo.capture import errors_by_phase

    _vc_backend()
    torch.manual_seed(0)
    steps = [tuple(torch.randn(1, 2, 96, 64) for _ in range(3)) for _ in range(4)]
    exact = errors_by_phase(steps, torch.nn.functional.scaled_dot_product_attention, n_rows=32)
    assert [e["phase"] for e in exact] == ["call"] * 4 and max(e["rel_l2"] for e in exact) < 1e-5
    off = errors_by_phase(steps, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v) * 1.01,
                          n_rows=32)
    assert all(e["rel_l2"] == pytest.approx(0.01, rel=1e-3) for e in off)
    bf = [tuple(t.bfloat16() for t in s) for s in steps]
    vs = errors_by_phase(bf, {"method": "vsmooth", "min_seq_len": 16, "speed_gate": "off",
                              "experimental": {"kernels": "reference"}}, n_rows=32)
    assert {e["phase"] for e in vs} >= {"group", "reuse"}
    assert all(0 < e["rel_l2"] < 0.05 for e in vs)


# ------------------------------------------------------------------------------ the benchmark's loop


def test_benchmark_loop_through_vcattn():
    """runner.run_config (benchmarks/bench_e2e.py): the demo's own Euler/CFG loop with the step API."""
    _vc_backend()
    from vc_compile.demo.runner import run_config

    tr, cond, uncond = tiny_model(torch.bfloat16)
    kw = dict(frames=1, height=32, width=32, steps=2, seed=0, guidance=3.0, shift=1.0, warmup=1)
    extra = {"experimental": {"compiler": "eager"}, "min_seq_len": 128}  # 256 tokens; eager keeps the test fast
    dense = run_config(tr, cond, uncond, "dense", {"method": "dense", **extra}, **kw)
    res = run_config(tr, cond, uncond, "mcsparse", {"method": "mcsparse", "density": 0.25, **extra}, **kw)
    phases = res.report.phase_counts()
    assert sum(phases.values()) == 2 * 2 * TINY.num_layers and phases["anchor"] > 0
    sources = sum((s.step_sources for s in res.report.rewritten), collections.Counter())
    assert set(sources) == {"explicit"}
    assert metrics.psnr(res.clip.clamp(-1, 1), dense.clip.clamp(-1, 1)) > 20.0

# ------------------------------------------------------------------------------------------ main job


def test_main_job_tiny(tmp_path, monkeypatch, capsys):
    """python -m vc_compile.demo end to end (shipped weights, 1 x 32 x 32, 2 steps), with the MP4 encoder
    hidden: grid, GIF and results are still written and the missing encoder is named; it says up front what to
    expect and, after each clip, how long the rest will take at this machine's pace."""
    _vc_backend()
    import json
    import sys

    from vc_compile.demo.__main__ import main

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    # --random-weights: the shipped weights when present (a clone), random ones in an installed wheel
    rows = main(["--out", str(tmp_path), "--steps", "2", "--frames", "1", "--height", "32", "--width", "32",
                 "--methods", "dense,vsmooth+expcast", "--device", "cpu", "--random-weights"])
    assert [r["method"] for r in rows] == ["dense", "vsmooth+expcast"]
    assert rows[0]["psnr"] == math.inf and rows[1]["ssim"] > 0.5
    for name in ("grid.png", "demo.gif", "results.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert not (tmp_path / "demo.mp4").exists()
    def no_constants(name):  # strict JSON: no Infinity / NaN
        raise AssertionError(f"results.json holds {name}, which is not JSON")
    info = json.loads((tmp_path / "results.json").read_text(), parse_constant=no_constants)
    assert "imageio-ffmpeg" in info["mp4"] and info["tokens"] == 256
    assert info["rows"][0]["psnr"] == "inf"  # the dense clip against itself
    said = capsys.readouterr().out
    assert "2 clips (dense, vsmooth+expcast); expect" in said and "1 of 2 clips in" in said and "s left" in said


def test_demo_set_option_parsing():
    from vc_compile.demo.__main__ import parse_args

    a = parse_args(["--set", "rope_fusion=false", "--set", "density=0.2", "--set", "sparse_qk=bf16"])
    assert a.options == {"rope_fusion": False, "density": 0.2, "sparse_qk": "bf16"}
    with pytest.raises(SystemExit):
        parse_args(["--set", "rope_fusion"])


def test_trainer_fidelity_preset_runs_both_phases(tmp_path):
    """``train --preset fidelity --smoke``: the main phase, then the last phase at its own size; int8 storage;
    the statistics of the stored weights (top-15% key mass per head) and the command that reproduces them."""
    import json

    from vc_compile.demo import train

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train.main(["--preset", "fidelity", "--smoke", "--out", str(tmp_path), "--device", "cpu"])
    stats = json.loads((tmp_path / "train_stats.json").read_text())
    assert stats["phase_iterations"] == [4, 3] and "--final-iters 3" in stats["reproduce"]
    assert stats["config"]["num_attention_heads"] == 4 and stats["config"]["camera"]
    assert len(stats["attention_trained"][0]["layers"][0]["top15pct_mass_heads"]) == 4
    _, _, cfg, trained = load_demo(tmp_path / FIDELITY_WEIGHTS.name)
    assert trained and (cfg.frames, cfg.height, cfg.width) == (3, 16, 24)
    assert stats["val_loss_stored"]["mean"] == pytest.approx(stats[f"val_loss_{stats['saved']}"]["mean"], rel=0.05)
