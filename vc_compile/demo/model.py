"""The demo model: a small video DiT that *is* diffusers' ``WanTransformer3DModel``.

Why the real class: the demo and the end-to-end benchmark must exercise the same client path as Wan
2.1/2.2 (3-axis interleaved RoPE written through ``setitem`` before the permute, the attention
dispatcher, SDPA, cross-attention to text), so nothing here re-implements the transformer.

* Latent = pixels: RGB in [-1, 1], ``in_channels = out_channels = 3``, patch (1, 2, 2); a clip of
  F x H x W pixels becomes F * (H/2) * (W/2) tokens (16 x 32 x 32 -> 4096).
* Head dim 128 (the target head dim of the kernels), 2 heads, hidden 256, 6 layers, FFN 768:
  about 6.1M parameters, 12.2 MB in fp16.
* "Text" conditioning: :class:`SpriteTextEncoder`, one token per sprite (back to front). A token is
  the sum of learned colour, shape, direction and slot embeddings (``text_dim`` = 64); an absent
  sprite uses index 0 ("none") for all three. All-"none" is the unconditional (CFG) prompt.
  Wan's cross-attention has no positional encoding, hence one composite token per sprite: a bag of
  separate colour/shape/direction words could not say which colour belongs to which shape.

One safetensors file holds both modules (keys ``transformer.*`` and ``text_encoder.*``, fp16) and the
JSON :class:`DemoConfig` in its metadata. The file is part of the git repository, not of the wheel:
without it :func:`load_demo` raises :class:`DemoWeightsMissing`, whose message says where the file comes
from. Random weights only on request (``allow_random=True``, the demo's ``--random-weights``), with a
loud warning: random weights give near-uniform attention, which makes 8-bit and sparse attention look
far safer than they are.
"""
from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import torch
from torch import nn

COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta", "orange", "white")
SHAPES = ("circle", "square", "triangle", "diamond")
DIRECTIONS = ("right", "left", "down", "up")
# RGB in [-1, 1]
COLOUR_RGB = {
    "red": (0.95, -0.75, -0.75), "green": (-0.7, 0.85, -0.7), "blue": (-0.7, -0.5, 0.95),
    "yellow": (0.95, 0.9, -0.8), "cyan": (-0.8, 0.9, 0.9), "magenta": (0.9, -0.75, 0.9),
    "orange": (0.95, 0.2, -0.9), "white": (0.95, 0.95, 0.95),
}
# unit velocity (dx, dy) in image coordinates (y grows downwards)
DIRECTION_XY = {"right": (1.0, 0.0), "left": (-1.0, 0.0), "down": (0.0, 1.0), "up": (0.0, -1.0)}

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "vc_demo_wan_2x128_6l.safetensors"
# The fidelity model: 4 heads x 128, trained last on Wan 2.1 480p's token grid (21 x 30 x 52 = 32760 tokens).
FIDELITY_WEIGHTS = WEIGHTS_DIR / "vc_fidelity_wan_4x128_3l.safetensors"
# Modules diffusers keeps in fp32 when a Wan model is loaded in bf16 (WanTransformer3DModel).
DEFAULT_PROMPT = "red circle right; blue square down; yellow triangle left"
KEEP_FP32 = ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Architecture of the demo model (stored in the weights file's metadata)."""

    num_layers: int = 6
    num_attention_heads: int = 2
    attention_head_dim: int = 128
    ffn_dim: int = 768
    text_dim: int = 64
    freq_dim: int = 64
    channels: int = 3
    patch_size: tuple = (1, 2, 2)
    max_sprites: int = 3
    # training clip size (the model also runs at other sizes; RoPE positions extrapolate)
    frames: int = 16
    height: int = 32
    width: int = 32
    # the training clips' camera pans (``data.render``): the background and every sprite drift together
    camera: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DemoConfig":
        d = json.loads(text)
        d["patch_size"] = tuple(d["patch_size"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def tokens(self, frames: int, height: int, width: int) -> int:
        pt, ph, pw = self.patch_size
        return (frames // pt) * (height // ph) * (width // pw)


# The fidelity model (``python -m vc_compile.demo.train --preset fidelity``): the demo's design at a width where
# attention is most of a step, its last training phase on 21 x 60 x 104 px = 32760 tokens (Wan 2.1 480p).
FIDELITY_CONFIG = DemoConfig(num_layers=3, num_attention_heads=4, ffn_dim=1024, frames=21, height=60, width=104,
                             camera=True)
MODELS = {"demo": DEFAULT_WEIGHTS, "fidelity": FIDELITY_WEIGHTS}


def resolve_weights(weights):
    """A weights path from a path or a model name ("demo": the small CPU demo model, "fidelity")."""
    if weights is None:
        return DEFAULT_WEIGHTS
    return MODELS.get(str(weights), Path(weights))


class SpriteTextEncoder(nn.Module):
    """Tiny learned "text encoder": tokens [B, N, 3] (colour, shape, direction; 0 = none) -> [B, N, text_dim]."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        d = cfg.text_dim
        self.colour = nn.Embedding(len(COLOURS) + 1, d)
        self.shape = nn.Embedding(len(SHAPES) + 1, d)
        self.direction = nn.Embedding(len(DIRECTIONS) + 1, d)
        self.slot = nn.Embedding(cfg.max_sprites, d)
        for emb in (self.colour, self.shape, self.direction, self.slot):
            nn.init.normal_(emb.weight, std=1.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        slots = torch.arange(tokens.shape[1], device=tokens.device)
        return (self.colour(tokens[..., 0]) + self.shape(tokens[..., 1]) + self.direction(tokens[..., 2])
                + self.slot(slots)[None]) * 0.5


def build_transformer(cfg: DemoConfig):
    """A freshly initialised ``WanTransformer3DModel`` with the demo architecture."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=tuple(cfg.patch_size), num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim, in_channels=cfg.channels, out_channels=cfg.channels,
        text_dim=cfg.text_dim, freq_dim=cfg.freq_dim, ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    )


def parse_prompt(prompt: str, max_sprites: int = 3) -> torch.Tensor:
    """``"red circle right; blue square up"`` -> tokens [1, max_sprites, 3] (back to front, 0 = none).

    Each ``;``- or ``,``-separated part names a colour, a shape and a direction, in any order.
    An empty prompt is the unconditional one.
    """
    toks = torch.zeros(1, max_sprites, 3, dtype=torch.long)
    parts = [p for p in re.split(r"[;,]", prompt.lower()) if p.strip()]
    if len(parts) > max_sprites:
        raise ValueError(f"at most {max_sprites} sprites, got {len(parts)}: {prompt!r}")
    for i, part in enumerate(parts):
        words = part.split()
        for j, vocab in enumerate((COLOURS, SHAPES, DIRECTIONS)):
            hits = [w for w in words if w in vocab]
            if len(hits) != 1:
                raise ValueError(f"sprite {part.strip()!r} must name exactly one of {vocab}")
            toks[0, i, j] = vocab.index(hits[0]) + 1
    return toks


def describe_tokens(tokens: torch.Tensor) -> str:
    """Inverse of :func:`parse_prompt` for one clip's tokens [N, 3]."""
    parts = []
    for c, s, d in tokens.tolist():
        if c and s and d:
            parts.append(f"{COLOURS[c - 1]} {SHAPES[s - 1]} {DIRECTIONS[d - 1]}")
    return "; ".join(parts) or "(unconditional)"


INT8_SCALE = ".int8_row_scale"  # key suffix of a quantised matrix's per-row scales


def quantize_int8(w: torch.Tensor):
    """(int8 codes, fp32 per-row scales) of a matrix: symmetric, absmax / 127 per output row (dim 0)."""
    rows = w.detach().float().reshape(w.shape[0], -1)
    scale = (rows.abs().amax(1) / 127.0).clamp_min(1e-12)
    return torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8).reshape(w.shape), scale


def state_dict_for_saving(transformer, text_encoder, dtype=torch.float16, storage: str = "fp16") -> dict:
    """The tensors of the weights file. ``storage="int8"``: every matrix of 4096 or more elements as int8 codes
    with per-row fp32 scales (half the bytes of fp16); vectors, norms and small tensors stay fp16."""
    if storage not in ("fp16", "int8"):
        raise ValueError(f"storage must be 'fp16' or 'int8', got {storage!r}")
    sd = {f"transformer.{k}": v for k, v in transformer.state_dict().items()}
    sd.update({f"text_encoder.{k}": v for k, v in text_encoder.state_dict().items()})
    out = {}
    for k, v in sd.items():
        if storage == "int8" and v.dim() >= 2 and v.numel() >= 4096 and v.is_floating_point():
            out[k], out[k + INT8_SCALE] = (t.to("cpu").contiguous() for t in quantize_int8(v))
        else:
            out[k] = v.detach().to("cpu", dtype).contiguous()
    return out


def dequantize(tensors: dict) -> dict:
    """Float tensors of a weights file: int8 matrices times their per-row scales, the rest as stored."""
    out = {}
    for k, v in tensors.items():
        if k.endswith(INT8_SCALE):
            continue
        scale = tensors.get(k + INT8_SCALE)
        out[k] = v.float() if scale is None else (v.float().reshape(v.shape[0], -1) * scale.float()[:, None]
                                                  ).reshape(v.shape)
    return out


def save_weights(path, transformer, text_encoder, cfg: DemoConfig, extra_meta: dict | None = None,
                 storage: str = "fp16"):
    """Write both modules (fp16, or int8 matrices: :func:`state_dict_for_saving`) and the config into one
    safetensors file."""
    meta = {"vc_demo_config": cfg.to_json(), "format": "pt", "storage": storage}
    meta.update({k: str(v) for k, v in (extra_meta or {}).items()})
    tensors = state_dict_for_saving(transformer, text_encoder, storage=storage)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=meta)
    return Path(path)


def _read_weights(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def cast_for_inference(transformer, dtype):
    """Cast like ``from_pretrained(torch_dtype=dtype)``: Wan's ``_keep_in_fp32_modules`` stay fp32."""
    for name, p in transformer.named_parameters():
        if not any(k in name.split(".") for k in KEEP_FP32):
            p.data = p.data.to(dtype)
    return transformer


class DemoWeightsMissing(FileNotFoundError):
    """The demo's weights file is not where it was looked for; the message says where it comes from."""


def missing_weights_message(path) -> str:
    path = Path(path)
    fidelity = path.name == FIDELITY_WEIGHTS.name
    what = ("fidelity model's weights (12 MB)" if fidelity else "demo weights (12 MB)")
    train = ("python -m vc_compile.demo.train --preset fidelity --out train_out  (one GPU, ~8 min)" if fidelity
             else "python -m vc_compile.demo.train --out train_out  (one GPU, ~6 min)")
    return (
        f"vc_compile demo: no weights file at {path}.\n"
        f"The trained {what} live in the vc_compile git repository "
        f"(vc_compile/demo/weights/{path.name}), not in the pip package. Either\n"
        f"  * run the demo from a fresh clone of the repository (bash tools/demo.sh), or\n"
        f"  * pass the file: python -m vc_compile.demo --weights /path/to/clone/vc_compile/demo/weights/"
        f"{path.name}  (load_demo(weights=...) in Python), or\n"
        f"  * train your own: {train}, then --weights train_out/{path.name}.\n"
        f"--random-weights (allow_random=True) runs untrained weights instead: it shows the mechanics only, "
        f"and its PSNR/SSIM figures are far too kind (near-uniform attention).")


def load_demo(weights=None, device="cpu", dtype=torch.bfloat16, allow_random: bool = False, seed: int = 0):
    """Load (transformer, text_encoder, cfg, trained) for inference.

    ``weights``: a safetensors path or a model name (``"demo"``, ``"fidelity"``: :data:`MODELS`); default: the
    demo model's file in ``vc_compile/demo/weights/`` (present in a clone of the repository, not in the wheel). A missing file raises :class:`DemoWeightsMissing`
    (what to do is in its message), unless ``allow_random``: then seeded random weights,
    ``trained=False`` and a loud warning. The transformer's parameters are cast to ``dtype`` except Wan's
    fp32 modules; the text encoder stays fp32 (its output is cast by :func:`encode`).
    """
    path = resolve_weights(weights)
    cfg, trained = (FIDELITY_CONFIG if path == FIDELITY_WEIGHTS else DemoConfig()), path.is_file()
    if trained:
        tensors, meta = _read_weights(path)
        tensors = dequantize(tensors)
        if "vc_demo_config" in meta:
            cfg = DemoConfig.from_json(meta["vc_demo_config"])
    elif not allow_random:
        raise DemoWeightsMissing(missing_weights_message(path))
    else:
        warnings.warn(
            f"vc_compile demo: weights file {path} not found; using RANDOM weights (asked for). Random weights "
            "give near-uniform attention, so the errors of 8-bit and sparse attention are UNDERSTATED.",
            stacklevel=2)
    torch.manual_seed(seed)
    transformer, text_encoder = build_transformer(cfg), SpriteTextEncoder(cfg)
    if trained:
        tsd = {k[len("transformer."):]: v.float() for k, v in tensors.items() if k.startswith("transformer.")}
        esd = {k[len("text_encoder."):]: v.float() for k, v in tensors.items() if k.startswith("text_encoder.")}
        transformer.load_state_dict(tsd, strict=True)
        text_encoder.load_state_dict(esd, strict=True)
    transformer.eval().requires_grad_(False)
    text_encoder.eval().requires_grad_(False)
    cast_for_inference(transformer, dtype)
    return transformer.to(device), text_encoder.to(device), cfg, trained


def encode(text_encoder, tokens: torch.Tensor, dtype) -> torch.Tensor:
    """tokens [B, N, 3] -> encoder_hidden_states [B, N, text_dim] in ``dtype``."""
    dev = next(text_encoder.parameters()).device
    return text_encoder(tokens.to(dev)).to(dtype)
