"""Writing clips as images: a frame-grid PNG (rows = clips, columns = frames) and an animated GIF.

Clips are [3, F, H, W] float tensors in [-1, 1]. Frames are upscaled (nearest) so a 32 x 32 clip is
visible. Pillow draws the row labels and writes GIFs; without Pillow (possible on the bare GPU box)
the PNG is written by a small zlib encoder without labels and the GIF is skipped with a message.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import torch


def to_uint8(clip: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1] -> [F, H, W, 3] uint8."""
    x = ((clip.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(1, 2, 3, 0).contiguous()


def _upscale(frames: torch.Tensor, scale: int) -> torch.Tensor:
    return frames.repeat_interleave(scale, 1).repeat_interleave(scale, 2)


def _auto_scale(h: int) -> int:
    return max(1, min(8, 128 // max(h, 1)))


def grid_array(clips, max_frames: int = 16, scale: int | None = None, pad: int = 2,
               label_width: int = 0) -> torch.Tensor:
    """Clips (same size) -> one uint8 image [rows*(h+pad), label_width + cols*(w+pad), 3]."""
    frames = [to_uint8(c)[:max_frames] for c in clips]
    f, h, w, _ = frames[0].shape
    s = scale or _auto_scale(h)
    H, W = h * s + pad, w * s + pad
    out = torch.full((len(frames) * H, label_width + f * W, 3), 255, dtype=torch.uint8)
    for r, fr in enumerate(frames):
        up = _upscale(fr, s)
        for c in range(f):
            out[r * H:r * H + h * s, label_width + c * W:label_width + c * W + w * s] = up[c]
    return out


def write_png(path, image: torch.Tensor) -> Path:
    """Write an [H, W, 3] uint8 image as PNG (Pillow if present, else a minimal encoder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        from PIL import Image

        Image.fromarray(image.numpy()).save(path)
        return path
    except ImportError:
        pass
    h, w, _ = image.shape
    raw = b"".join(b"\x00" + image[y].numpy().tobytes() for y in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)
    return path


def _draw_labels(image: torch.Tensor, labels, row_height: int):
    from PIL import Image, ImageDraw

    im = Image.fromarray(image.numpy())
    d = ImageDraw.Draw(im)
    for r, text in enumerate(labels):
        d.text((4, r * row_height + row_height // 2 - 6), text, fill=(0, 0, 0))
    return im


def write_grid(path, clips, labels=None, max_frames: int = 16, scale: int | None = None) -> Path:
    """PNG grid: one row per clip (labelled when Pillow is available), one column per frame."""
    h = clips[0].shape[-2]
    s = scale or _auto_scale(h)
    try:
        import PIL  # noqa: F401
        have_pil = True
    except ImportError:
        have_pil = False
    lw = 150 if (labels and have_pil) else 0
    img = grid_array(clips, max_frames, s, label_width=lw)
    if lw:
        im = _draw_labels(img, labels, h * s + 2)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        im.save(path)
        return path
    return write_png(path, img)


def write_gif(path, clips, labels=None, fps: int = 8, scale: int | None = None):
    """Animated GIF: the clips side by side (one column each), looping. Returns None without Pillow."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        print(f"[vc_demo] Pillow not installed: skipped GIF {path}")
        return None
    frames = [to_uint8(c) for c in clips]
    f, h, w, _ = frames[0].shape
    s = scale or _auto_scale(h)
    top = 14 if labels else 0
    pad = 2
    images = []
    for t in range(f):
        canvas = torch.full((top + h * s, len(frames) * (w * s + pad), 3), 255, dtype=torch.uint8)
        for i, fr in enumerate(frames):
            canvas[top:, i * (w * s + pad):i * (w * s + pad) + w * s] = _upscale(fr[t:t + 1], s)[0]
        im = Image.fromarray(canvas.numpy())
        if labels:
            d = ImageDraw.Draw(im)
            for i, text in enumerate(labels):
                d.text((i * (w * s + pad) + 2, 1), text, fill=(0, 0, 0))
        images.append(im)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    return path
