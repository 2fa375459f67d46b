"""Image similarity for ChartMatch: how close a render is to the target, in [0, 1].

Both images are flattened onto white (transparency), converted to grayscale, and resized
(box filter, which also blurs away anti-aliasing noise) to `size` = 64 x 48 pixels, with
values in [0, 1]. Then

    d      = mean |render - target|            (per-pixel absolute difference)
    d_void = mean |1 - target|                 (a blank white canvas against the target)
    sim    = clip(1 - d / d_void, 0, 1)

so an exact copy scores 1, an empty canvas 0, and anything at least as far from the target
as a blank canvas 0 as well. Normalising by `d_void` matters: charts are mostly white, so a
plain `1 - d` would give a blank canvas ~0.9.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

SIZE = (64, 48)


def _gray(png: bytes, size: tuple[int, int]) -> np.ndarray:
    img = Image.open(io.BytesIO(png))
    img.load()
    if img.mode in ("RGBA", "LA", "P"):
        img = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, img)
    gray = img.convert("L").resize(size, Image.Resampling.BOX)
    return np.asarray(gray, dtype=np.float64) / 255.0


def image_similarity(render: bytes, target: bytes, size: tuple[int, int] = SIZE) -> float:
    """1 for identical charts, 0 for a blank canvas or worse (see module doc)."""
    a, b = _gray(render, size), _gray(target, size)
    d = float(np.mean(np.abs(a - b)))
    d_void = float(np.mean(np.abs(1.0 - b)))
    if d_void < 1e-9:  # the target itself is blank: only a blank render matches
        return 1.0 if d < 1e-9 else 0.0
    return float(np.clip(1.0 - d / d_void, 0.0, 1.0))
