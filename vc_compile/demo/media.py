"""Writing clips for people to look at: a labelled frame grid (PNG), an animated GIF and an MP4.

Clips are [3, F, H, W] float tensors in [-1, 1] (latent = pixels). Frames are upscaled (nearest) so a
32 x 32 clip is visible. Pillow draws every label (it is a requirement of the ``demo`` extra); the MP4
goes through diffusers' ``export_to_video``, which needs ``imageio`` and ``imageio-ffmpeg`` (also in the
``demo`` extra): without them :func:`write_mp4` raises :class:`VideoEncoderMissing`, whose message says
what to install, and the caller still has the grid and the GIF.

* :func:`write_grid`: rows = clips (a label and up to three lines of figures on the left), columns =
  frames (the frame index above each column), an optional title (up to three lines) on top.
* :func:`write_gif` / :func:`write_mp4`: the clips side by side, each under its label, one video frame
  per clip frame.
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

BG, INK, GREY = (255, 255, 255), (0, 0, 0), (90, 90, 90)


class VideoEncoderMissing(RuntimeError):
    """No MP4 encoder: diffusers' ``export_to_video`` needs ``imageio`` and ``imageio-ffmpeg``."""


def to_uint8(clip: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1] -> [F, H, W, 3] uint8."""
    x = ((clip.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(1, 2, 3, 0).contiguous()


def _upscale(frames: torch.Tensor, scale: int) -> torch.Tensor:
    return frames.repeat_interleave(scale, 1).repeat_interleave(scale, 2)


def auto_scale(h: int) -> int:
    """Integer upscale that makes a frame about 128 px high (at most 8x)."""
    return max(1, min(8, 128 // max(h, 1)))


def font(size: int):
    """Pillow's bundled font at ``size`` px; the fixed bitmap font where Pillow lacks FreeType."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or no FreeType: one size only
        return ImageFont.load_default()


def _text_width(draw, text: str, f) -> int:
    x0, _, x1, _ = draw.textbbox((0, 0), text, font=f)
    return x1 - x0


def write_grid(path, clips, labels=None, *, notes=None, title=None, max_frames: int = 16,
               scale: int | None = None, pad: int = 2) -> Path:
    """PNG grid: one row per clip, one column per frame (at most ``max_frames``).

    ``labels``: one name per row (bold-ish, first line); ``notes``: per row a string or a list of up to
    three lines of figures drawn under the name (e.g. PSNR/SSIM and time); ``title``: a string or lines
    above the grid. Column headers give the frame index.
    """
    frames = [to_uint8(c)[:max_frames] for c in clips]
    f, h, w, _ = frames[0].shape
    s = scale or auto_scale(h)
    cw, ch = w * s + pad, h * s + pad
    f_label, f_note, f_title = font(15), font(12), font(16)
    title_lines = [title] if isinstance(title, str) else list(title or [])
    note_lines = [([n] if isinstance(n, str) else list(n or [])) for n in (notes or [None] * len(frames))]
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    label_w = 0
    if labels or notes:
        texts = [(t, f_label) for t in (labels or [])] + [(t, f_note) for ls in note_lines for t in ls]
        label_w = max(_text_width(probe, t, fn) for t, fn in texts) + 16 if texts else 0
    top_title = 8 + 20 * len(title_lines) if title_lines else 0
    top_cols = 18
    top = top_title + top_cols
    W, H = label_w + f * cw, top + len(frames) * ch
    W = max([W] + [_text_width(probe, t, f_title) + 12 for t in title_lines])
    im = Image.new("RGB", (W, H), BG)
    d = ImageDraw.Draw(im)
    for i, line in enumerate(title_lines):
        d.text((6, 4 + 20 * i), line, fill=INK, font=f_title)
    for c in range(f):
        text = f"frame {c}" if c == 0 else str(c)
        x = label_w + c * cw + (w * s - _text_width(d, text, f_note)) // 2
        d.text((x, top_title + 2), text, fill=GREY, font=f_note)
    for r, fr in enumerate(frames):
        up = _upscale(fr, s).numpy()
        y = top + r * ch
        for c in range(f):
            im.paste(Image.fromarray(up[c]), (label_w + c * cw, y))
        lines = ([(labels[r], f_label)] if labels else []) + [(t, f_note) for t in note_lines[r]]
        block = sum(18 if fn is f_label else 15 for _, fn in lines)
        ty = y + max(0, (h * s - block) // 2)
        for t, fn in lines:
            d.text((6, ty), t, fill=INK if fn is f_label else GREY, font=fn)
            ty += 18 if fn is f_label else 15
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path)
    return path


def side_by_side(clips, labels=None, scale: int | None = None, multiple: int = 1, pad: int = 2) -> list:
    """One PIL image per frame: the clips side by side, each under its label. ``multiple``: pad the
    image to a multiple of this many pixels (video codecs want 16)."""
    frames = [to_uint8(c) for c in clips]
    f, h, w, _ = frames[0].shape
    s = scale or auto_scale(h)
    f_label = font(12)
    top = 18 if labels else 0
    cw = w * s + pad
    W, H = len(frames) * cw, top + h * s
    W, H = -(-W // multiple) * multiple, -(-H // multiple) * multiple
    ups = [_upscale(fr, s).numpy() for fr in frames]
    out = []
    for t in range(f):
        im = Image.new("RGB", (W, H), BG)
        d = ImageDraw.Draw(im)
        for i, up in enumerate(ups):
            im.paste(Image.fromarray(up[t]), (i * cw, top))
            if labels:
                d.text((i * cw + 2, 2), labels[i], fill=INK, font=f_label)
        out.append(im)
    return out


def write_gif(path, clips, labels=None, fps: int = 8, scale: int | None = None) -> Path:
    """Animated GIF: the clips side by side, looping."""
    images = side_by_side(clips, labels, scale)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    return path


def video_encoder_problem() -> str | None:
    """None when diffusers' ``export_to_video`` can write MP4 here, else what is missing and the fix."""
    try:
        import imageio  # noqa: F401
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as e:  # noqa: BLE001 - ImportError, or imageio-ffmpeg without its binary
        return (f"no MP4 encoder ({type(e).__name__}: {e}); diffusers' export_to_video needs imageio and "
                "imageio-ffmpeg: pip install imageio imageio-ffmpeg (both in vc_compile's 'demo' extra)")
    return None


def write_mp4(path, clips, labels=None, fps: int = 8, scale: int | None = None) -> Path:
    """MP4 (H.264 through diffusers' ``export_to_video``): the clips side by side, each labelled.
    Raises :class:`VideoEncoderMissing` when imageio / imageio-ffmpeg are not installed."""
    problem = video_encoder_problem()
    if problem:
        raise VideoEncoderMissing(problem)
    from diffusers.utils import export_to_video

    images = side_by_side(clips, labels, scale, multiple=16)  # H.264 macro blocks: no rescaling
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    export_to_video(images, str(path), fps=fps, quality=8)  # 8 of 10: sprite edges stay sharp
    return path
