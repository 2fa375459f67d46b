"""Image helpers shared by environments, the chat template and the vision tower.

`image_grid` is the MoonViT-V2 resize rule of docs/model.md §7.1; the chat template uses it to
know how many `<|media_pad|>` tokens an image takes (gh * gw / 4), and the vision
preprocessing uses the same numbers, so the two can never disagree.
"""

from __future__ import annotations

import io
import math

from PIL import Image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def to_png(image: Image.Image | bytes) -> bytes:
    """PNG bytes of a PIL image (bytes already PNG pass through after a check)."""
    if isinstance(image, (bytes, bytearray)):
        if not bytes(image).startswith(PNG_MAGIC):
            raise ValueError("expected PNG bytes")
        return bytes(image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def from_png(data: bytes) -> Image.Image:
    if not data.startswith(PNG_MAGIC):
        raise ValueError("expected PNG bytes (they start with \\x89PNG)")
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) read from the PNG header without decoding the pixels."""
    if not data.startswith(PNG_MAGIC) or len(data) < 24:
        raise ValueError("expected PNG bytes")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def resized_size(width: int, height: int, patch_size: int = 14, in_patch_limit: int = 65536,
                 side_patch_limit: int = 512) -> tuple[int, int]:
    """Size after the MoonViT-V2 resize rule (docs/model.md §7.1 steps 1-2); never upscales.

    s = min(1, sqrt(limit / (max(1, w // p) * max(1, h // p))), side/w, side/h), side = side_patch_limit * p
    """
    side = side_patch_limit * patch_size
    s = min(
        1.0,
        math.sqrt(in_patch_limit / (max(1, width // patch_size) * max(1, height // patch_size))),
        side / width,
        side / height,
    )
    new_w = min(max(1, int(width * s)), side)
    new_h = min(max(1, int(height * s)), side)
    return new_w, new_h


def image_grid(width: int, height: int, patch_size: int = 14, merge: int = 2, in_patch_limit: int = 65536,
               side_patch_limit: int = 512) -> tuple[int, int]:
    """(gh, gw): patch rows and columns after resizing and padding to multiples of patch*merge."""
    w, h = resized_size(width, height, patch_size, in_patch_limit, side_patch_limit)
    unit = patch_size * merge
    pw, ph = math.ceil(w / unit) * unit, math.ceil(h / unit) * unit
    return ph // patch_size, pw // patch_size


def num_image_tokens(width: int, height: int, patch_size: int = 14, merge: int = 2, in_patch_limit: int = 65536,
                     side_patch_limit: int = 512) -> int:
    """Tokens one image takes in the LM stream: gh * gw / merge^2."""
    gh, gw = image_grid(width, height, patch_size, merge, in_patch_limit, side_patch_limit)
    return (gh * gw) // (merge * merge)
