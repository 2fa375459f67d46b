"""A request inside the embedded engine: its state from admission to its result
(`Seq`), a decode step in flight (`Launch`), and how its images are keyed for the prefix cache."""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from k3rl.images import from_png
from k3rl.types import SamplingParams

from .contract import FinishReason


def image_digest(image) -> str:
    if isinstance(image, (bytes, bytearray)):
        return hashlib.sha256(bytes(image)).hexdigest()
    if isinstance(image, Image.Image):
        return hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()
    raise TypeError(f"images must be PNG bytes or PIL images, got {type(image).__name__}")


def as_pil(image):
    return from_png(bytes(image)) if isinstance(image, (bytes, bytearray)) else image


@dataclass(eq=False)
class Seq:
    id: str
    prompt: list[int]
    images: list  # PIL images
    digests: tuple[str, ...]
    pads_per_image: list[int]
    params: SamplingParams
    seed: int  # int64: the n-th token is drawn with uniform(seed, n)
    future: concurrent.futures.Future
    submitted: float = field(default_factory=time.monotonic)
    waited: int = 0  # scheduler steps spent waiting for admission (prefill_wait_steps)
    cache: Any = None  # K3Cache (batch 1) while prefilling
    feed: list[int] = field(default_factory=list)  # prompt tokens still to feed by decode steps (decode_append)
    split_at: int = 0  # a prefix other prompts share: a prefill chunk ends here and its state is cached
    slot: int = -1  # its slot in the state pool while decoding
    flushing: bool = False  # finished: its last token is fed once more, then the result goes out
    computed: int = 0  # prompt tokens already in the cache
    image_cursor: int = 0  # images already consumed by prefill chunks
    cached_prompt_tokens: int = 0
    state_version: int = -1  # the version its cache was started under
    leader: Seq | None = None  # a prefill of the same prompt this one waits for
    followers: list[Seq] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [V] logits to sample the next token from
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    out_routed: list[list[list[int]]] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: int | str | None = None

    @property
    def key(self) -> tuple:
        return (tuple(self.prompt), self.digests)


@dataclass(eq=False)
class Launch:
    """A decode step on the device: its rows are the sequences in `seqs` (slot order at launch)."""

    seqs: list[Seq]
    out: torch.Tensor  # [B, 2 + n_moe k] fp64 (the runner's buffers under CUDA graphs)
    logits: torch.Tensor  # [B, V]
    version: int
    fed: list[int]  # per row: 0 it fed a sampled token; 1 the prompt's last token (it samples the
    #                 first one); 2 a prompt token with more to feed (its row is no sample)
