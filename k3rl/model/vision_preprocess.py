"""MoonViT-V2 image and video preprocessing (docs/model.md §7.1).

    s    = min(1, sqrt(limit / (max(1, w//14) max(1, h//14))), 7168/w, 7168/h)   never upscale
    new  = min(max(1, floor(w s)), 7168) (same for h), bicubic
    alpha composited over an 8-px chessboard (255 / 180, white top-left) after resizing
    pad right/bottom with black to multiples of 28 (patch 14 x merge 2)
    x    = (x/255 - 0.5)/0.5        (the padding becomes -1)
    patches [gh*gw, 3, 14, 14] row-major, grid_thw = (1, gh, gw); gh*gw/4 LM tokens per image

A video (a list of frames) is cut into chunks of up to `init_pos_emb_time` (4) frames; each
chunk is one media item with grid (t, gh, gw) and gh*gw/4 tokens (temporal pooling).
The resize rule is `k3rl.images.resized_size`, the same one the chat template uses to count
`<|media_pad|>` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from k3rl.images import resized_size

from .config import VisionConfig

MERGE = 2  # sd2_tpool merges 2x2 patches


@dataclass
class MediaBatch:
    """Patches of several media items, concatenated in order.

    pixel_values [sum_i t_i*gh_i*gw_i, 3, p, p]; grid_thw [items, 3] int64.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    def tokens_per_item(self) -> list[int]:
        return [int(gh * gw) // (MERGE * MERGE) for _, gh, gw in self.grid_thw.tolist()]

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_item())

    def to(self, device=None, dtype=None) -> MediaBatch:
        return MediaBatch(self.pixel_values.to(device=device, dtype=dtype), self.grid_thw.to(device=device))

    @staticmethod
    def cat(batches: Sequence[MediaBatch]) -> MediaBatch:
        return MediaBatch(
            torch.cat([b.pixel_values for b in batches]), torch.cat([b.grid_thw for b in batches])
        )


def _chessboard(width: int, height: int, cell: int = 8) -> Image.Image:
    ys, xs = np.mgrid[0:height, 0:width]
    light = ((ys // cell + xs // cell) % 2) == 0  # white at the top-left
    board = np.where(light, 255, 180).astype(np.uint8)
    return Image.fromarray(np.stack([board] * 3, axis=-1), "RGB")


def _to_rgb(img: Image.Image) -> Image.Image:
    has_alpha = img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info)
    if not has_alpha:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    board = _chessboard(*rgba.size).convert("RGBA")
    return Image.alpha_composite(board, rgba).convert("RGB")


def _frame_patches(img: Image.Image, size: tuple[int, int], patch: int) -> tuple[np.ndarray, int, int]:
    """Resize to `size`, composite alpha, pad to multiples of patch*2, normalise, cut patches."""
    if img.size != size:
        img = img.resize(size, Image.BICUBIC)
    rgb = np.asarray(_to_rgb(img))  # [h, w, 3] uint8
    unit = patch * MERGE
    h, w = rgb.shape[:2]
    ph, pw = -(-h // unit) * unit, -(-w // unit) * unit
    padded = np.zeros((ph, pw, 3), dtype=np.uint8)  # black padding
    padded[:h, :w] = rgb
    gh, gw = ph // patch, pw // patch
    # cut into patches while still bytes (the transposing copy, the costly part for a large screenshot, then
    # moves a quarter of the data), then x = (p / 255 - 0.5) / 0.5 in place: the same floats as normalising first
    patches = padded.reshape(gh, patch, gw, patch, 3).transpose(0, 2, 4, 1, 3).astype(np.float32)
    patches = patches.reshape(gh * gw, 3, patch, patch)
    patches /= 255.0
    patches -= 0.5
    patches /= 0.5
    return patches, gh, gw


def _as_image(item) -> Image.Image:
    if isinstance(item, Image.Image):
        return item
    if isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim in (2, 3):
        return Image.fromarray(item)
    raise TypeError(
        f"media item must be a PIL image, a uint8 HxW[xC] array, or a list of those (a video); got {type(item).__name__}"
    )


def preprocess_media(items: Sequence, config: VisionConfig) -> MediaBatch:
    """Images (PIL or uint8 arrays) and videos (lists of frames) -> one MediaBatch, in order."""
    if not items:
        raise ValueError("preprocess_media: no media items given")
    p = config.patch_size
    pixel, grids = [], []
    for item in items:
        if isinstance(item, (list, tuple)):  # a video: chunks of up to init_pos_emb_time frames
            frames = [_as_image(f) for f in item]
            if not frames:
                raise ValueError("preprocess_media: a video needs at least one frame")
            size = resized_size(*frames[0].size, p, config.video_in_patch_limit, config.patch_limit_on_one_side)
            for start in range(0, len(frames), config.init_pos_emb_time):
                chunk = [_frame_patches(f, size, p) for f in frames[start : start + config.init_pos_emb_time]]
                gh, gw = chunk[0][1], chunk[0][2]
                pixel.extend(c[0] for c in chunk)
                grids.append((len(chunk), gh, gw))
        else:
            img = _as_image(item)
            size = resized_size(*img.size, p, config.in_patch_limit, config.patch_limit_on_one_side)
            patches, gh, gw = _frame_patches(img, size, p)
            pixel.append(patches)
            grids.append((1, gh, gw))
    return MediaBatch(
        pixel_values=torch.from_numpy(np.concatenate(pixel, axis=0)),
        grid_thw=torch.tensor(grids, dtype=torch.int64),
    )
