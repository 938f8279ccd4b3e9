"""Minimal safetensors writer, used only when the ``safetensors`` package is missing.

The GPU machine that trains the demo model has no network and may lack ``safetensors``; the format
(8-byte little-endian header length, a JSON header, raw little-endian tensor bytes) is small enough
to write here. Reading always goes through the real package (a dependency of diffusers).
"""
from __future__ import annotations

import json
import struct

import torch

_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}


def save_file(tensors: dict, filename: str, metadata: dict | None = None) -> None:
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        # bytes via a uint8 view: works for bf16, which numpy cannot represent
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
