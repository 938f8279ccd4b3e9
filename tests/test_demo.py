"""Tests of the shipped demo (vc_compile/demo): weights, data, sampler, metrics, capture, and a tiny
generation through ``backend="vcattn"``. CPU only, about a minute on 2 cores."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from vc_compile.demo import data, metrics
from vc_compile.demo.model import (DEFAULT_WEIGHTS, DemoConfig, SpriteTextEncoder, build_transformer,
                                   describe_tokens, encode, load_demo, parse_prompt, save_weights)
from vc_compile.demo.sampler import sample, sigmas

# ---------------------------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def demo():
    """(transformer bf16, text encoder, cfg, trained): the shipped weights, else random ones."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the random-weights warning is tested below
        return load_demo(device="cpu", dtype=torch.bfloat16)


def test_shipped_weights_load_into_wan():
    if not DEFAULT_WEIGHTS.is_file():
        pytest.skip(f"no trained weights shipped yet at {DEFAULT_WEIGHTS} (train with python -m vc_compile.demo.train)")
    from diffusers import WanTransformer3DModel

    assert DEFAULT_WEIGHTS.stat().st_size <= 15e6
    tr, te, cfg, trained = load_demo(allow_random=False)
    assert trained and isinstance(tr, WanTransformer3DModel)
    assert tr.config.attention_head_dim == 128 and tr.config.in_channels == 3
    assert all(torch.isfinite(p).all() for p in tr.parameters())


@pytest.mark.parametrize("writer", ["safetensors", "fallback"])
def test_weights_roundtrip(tmp_path, monkeypatch, writer):
    cfg = DemoConfig()
    torch.manual_seed(0)
    tr, te = build_transformer(cfg), SpriteTextEncoder(cfg)
    if writer == "fallback":  # the GPU box may lack the safetensors package: our own writer
        import sys

        monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    path = save_weights(tmp_path / "w.safetensors", tr, te, cfg)
    assert path.stat().st_size <= 15e6
    tr2, te2, cfg2, trained = load_demo(path, dtype=torch.float32)
    assert trained and cfg2 == cfg
    for (k, a), b in zip(tr.state_dict().items(), tr2.state_dict().values()):
        assert torch.equal(a.half().float(), b), k
    assert torch.equal(te.colour.weight.half().float(), te2.colour.weight)


def test_missing_weights_warn_loudly(tmp_path):
    with pytest.warns(UserWarning, match="RANDOM weights"):
        _, _, _, trained = load_demo(tmp_path / "absent.safetensors")
    assert not trained
    with pytest.raises(FileNotFoundError):
        load_demo(tmp_path / "absent.safetensors", allow_random=False)


def test_prompt_parsing():
    t = parse_prompt("red circle right; Blue SQUARE up")
    assert t.shape == (1, 3, 3) and t[0, 2].tolist() == [0, 0, 0]
    assert describe_tokens(t[0]) == "red circle right; blue square up"
    assert parse_prompt("").abs().sum() == 0
    with pytest.raises(ValueError, match="exactly one"):
        parse_prompt("red blue circle right")

# ----------------------------------------------------------------------------------------------- data


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

# ------------------------------------------------------------------------------ through backend=vcattn


def _vc_backend():
    try:
        import vc_compile.backend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"vc_compile.backend not importable yet: {e}")


def test_two_step_generation_through_vcattn(demo):
    """dense, vsmooth and mcsparse through the demo runner (step API, reset, profile report)."""
    _vc_backend()
    from vc_compile.demo.runner import run_config

    tr, te, cfg, _ = demo
    cond = encode(te, parse_prompt("red circle right; blue square up"), torch.bfloat16)
    uncond = encode(te, parse_prompt(""), torch.bfloat16)
    kw = dict(frames=1, height=32, width=32, steps=2, seed=0, guidance=3.0, shift=1.0, warmup=1)
    extra = {"experimental": {"compiler": "eager"}, "min_seq_len": 128}  # 256 tokens; eager keeps the test fast
    dense = run_config(tr, cond, uncond, "dense", {"method": "dense", **extra}, **kw)
    for options in ({"method": "vsmooth"}, {"method": "mcsparse", "density": 0.25}):
        res = run_config(tr, cond, uncond, options["method"], {**options, **extra}, **kw)
        assert torch.isfinite(res.clip).all() and res.clip.shape == (1, 3, 1, 32, 32)
        rep = res.report
        assert len(rep.rewritten) >= cfg.num_layers  # every self-attention
        phases = rep.phase_counts()
        assert sum(phases.values()) == 2 * 2 * cfg.num_layers  # 2 steps x (cond, uncond) x layers
        assert phases["group" if options["method"] == "vsmooth" else "anchor"] > 0
        assert res.attn_ms is not None and res.attn_ms > 0
        assert metrics.psnr(res.clip.clamp(-1, 1), dense.clip.clamp(-1, 1)) > 20.0


def test_main_job_tiny(tmp_path):
    _vc_backend()
    from vc_compile.demo.__main__ import main

    rows = main(["--out", str(tmp_path), "--steps", "2", "--frames", "1", "--height", "32", "--width", "32",
                 "--methods", "dense,vsmooth+expcast", "--device", "cpu"])
    assert [r["method"] for r in rows] == ["dense", "vsmooth+expcast"]
    assert rows[0]["psnr"] == math.inf and rows[1]["ssim"] > 0.5
    for name in ("grid.png", "demo.gif", "results.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_demo_set_option_parsing():
    from vc_compile.demo.__main__ import parse_args

    a = parse_args(["--set", "rope_fusion=false", "--set", "density=0.2", "--set", "sparse_qk=bf16"])
    assert a.options == {"rope_fusion": False, "density": 0.2, "sparse_qk": "bf16"}
    with pytest.raises(SystemExit):
        parse_args(["--set", "rope_fusion"])
