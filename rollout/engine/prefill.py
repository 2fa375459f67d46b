"""The prefill runner: which prompt chunks of the prefilling sequences run in this step and how they
batch into forwards (`plan`), and the forwards themselves (`run`), each extending its sequences' caches.

A chunk is at most `chunk` tokens of one prompt (chunked prefill: a long prompt never stalls the
decoding batch for long), `max_tokens` in all per step, never splitting an image's placeholder run.
Chunks of one length and without images run as one batched forward on stacked caches, the others
alone. With `decode_append`, chunks within that many tokens of each other are cut to the shortest, so
they batch, and the rest of each prompt is fed by decode steps. With prefill graphs
(`prefill_graphs.py`) a chunk cut to a multiple of ALIGN tokens runs through a captured forward; the
prompt's last < ALIGN tokens are fed by decode steps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from k3rl.kernels.varlen import remember_host_copy
from k3rl.model import K3Cache

from .prefill_graphs import ALIGN, PrefillGraphs, bucket
from .seq import Seq


class Chunk(NamedTuple):
    """Prompt tokens [start, end) of `seq`, with the `images` images whose placeholders they hold."""

    seq: Seq
    start: int
    end: int
    images: int


class PrefillRunner:
    """model           the K3ForCausalLM (forwards run under the engine's autocast)
    autocast_dtype  the dtype new caches hold activations in (None: the model's)
    chunk           prompt tokens per chunk
    max_tokens      prompt tokens per step over all chunks
    decode_append   chunks within this many tokens of each other are cut to the shortest (0: off)
    graphs          run chunks that fit a bucket through PrefillGraphs (captured on CUDA unless
                    `use_graphs` is False; eagerly over the same buffers otherwise)"""

    def __init__(self, model, *, autocast_dtype, chunk: int, max_tokens: int, decode_append: int, graphs: bool,
                 use_graphs: bool, max_context: int):
        if graphs and decode_append < ALIGN - 1:
            raise ValueError(f"prefill_graphs feeds up to {ALIGN - 1} prompt tokens by decode steps: it needs "
                             f"decode_append >= {ALIGN - 1}, got {decode_append}")
        self.model, self.autocast_dtype = model, autocast_dtype
        self.device = model.lm_head.weight.device
        self.pad_id = model.config.media_placeholder_token_id
        self.chunk, self.max_tokens, self.decode_append = chunk, max_tokens, decode_append
        self.graphs = (PrefillGraphs(model, autocast_dtype, chunk, use_graphs=use_graphs, max_context=max_context)
                       if graphs else None)
        # the prompt tokens fed by decode steps at most: with prefill graphs, what no graph's bucket covers
        self.feed_max = ALIGN - 1 if graphs else decode_append
        # MoonViT's share of prefill: images through the vision tower and its host seconds (on CUDA the
        # launches, not the kernels: the hooks never synchronise). A prompt's images already in a cached
        # prefix state are not encoded again, so images_encoded counts each image of a conversation once.
        self.images_encoded, self.vision_s, self._vision_t0 = 0, 0.0, 0.0
        self._hooks = [model.vision_tower.register_forward_pre_hook(self._vision_started),
                       model.vision_tower.register_forward_hook(self._vision_done)]

    def close(self) -> None:
        """Take the timing hooks off the model (another engine may be built on it)."""
        for hook in self._hooks:
            hook.remove()

    def _vision_started(self, module, args) -> None:
        self._vision_t0 = time.perf_counter()

    def _vision_done(self, module, args, out) -> None:
        self.vision_s += time.perf_counter() - self._vision_t0

    def new_cache(self):
        """An empty batch-1 cache (under autocast, activations are in its dtype)."""
        return self.model.new_cache(1, self.autocast_dtype)

    def graph_tokens(self, seq: Seq) -> int:
        """The tokens of `seq`'s next chunk if the prefill graphs take it, else 0: no images left to prefill,
        the state so far in `seq.cache` (none or a cached prefix, nothing being shared), and a bucket that
        leaves fewer than ALIGN tokens (fed by decode steps) or fills a whole chunk (another follows)."""
        g = self.graphs
        if g is None or seq.image_cursor < len(seq.images) or seq.split_at > seq.computed:
            return 0
        if (seq.cache.host_lengths if seq.cache is not None else [0]) != [seq.computed]:
            return 0
        rest = len(seq.prompt) - seq.computed
        T = bucket(rest, self.chunk)
        whole = T == bucket(self.chunk, self.chunk)
        return T if g.takes(T, seq.computed) and (rest - T <= self.feed_max or whole) else 0

    def plan(self, prefilling: list[Seq]) -> list[tuple[str, list[Chunk]]]:
        """This step's chunks, in forwards: [(kind, chunks)], kind "fresh" or "cached" for the rows of a
        prefill graph (`run`), else ""."""
        budget = self.max_tokens
        limits = {}
        for seq in prefilling:
            room = seq.split_at - seq.computed if seq.split_at > seq.computed else self.chunk
            limits[seq.id] = min(self.chunk, room, len(seq.prompt) - seq.computed)
        # cut to a graph's bucket; a prompt's last < ALIGN tokens are fed by decode steps
        graphed = {s.id: T for s in prefilling if (T := self.graph_tokens(s))}
        limits.update(graphed)
        if self.decode_append:
            plain = sorted((s for s in prefilling if s.image_cursor == len(s.images) and s.id not in graphed),
                           key=lambda s: limits[s.id])
            shortest = None
            for seq in plain:  # ascending: a chunk within decode_append of the group's shortest joins it
                if shortest is None or limits[seq.id] - shortest > self.decode_append:
                    shortest = limits[seq.id]
                limits[seq.id] = shortest
        chunks: list[Chunk] = []
        for seq in prefilling:
            if budget <= 0:
                break
            end, n_img = self._chunk_end(seq, seq.computed, min(limits[seq.id], budget))
            chunks.append(Chunk(seq, seq.computed, end, n_img))
            budget -= end - seq.computed
        groups: dict[tuple[int, str], list[Chunk]] = {}
        for c in chunks:
            # a graph's rows: all fresh or all after a cached prefix, each of its bucket
            kind = ("cached" if c.start else "fresh") if graphed.get(c.seq.id) == c.end - c.start else ""
            key = (-1 - len(groups), "") if c.images else (c.end - c.start, kind)
            groups.setdefault(key, []).append(c)
        return [(kind, group) for (_, kind), group in groups.items()]

    def _chunk_end(self, seq: Seq, start: int, budget: int) -> tuple[int, int]:
        """End of the next prefill chunk and the images it consumes (never splitting an image's pads)."""
        end = min(len(seq.prompt), start + budget)
        pad = self.pad_id
        pads_before = sum(1 for t in seq.prompt[:start] if t == pad)
        pads_in = sum(1 for t in seq.prompt[start:end] if t == pad)
        # images whose pads are (partly) inside this chunk must be complete: extend the chunk
        last_image, cum = seq.image_cursor, 0
        for i, c in enumerate(seq.pads_per_image):
            cum += c
            if cum > pads_before and cum - c < pads_before + pads_in:
                last_image = i + 1
        need = sum(seq.pads_per_image[:last_image]) - pads_before
        while pads_in < need:
            if seq.prompt[end] == pad:
                pads_in += 1
            end += 1
        return end, last_image - seq.image_cursor

    def run(self, chunks: list[Chunk], kind: str = "") -> Iterator[tuple[Chunk, torch.Tensor | Exception]]:
        """Forward `chunks` (one forward when they batch): yields (chunk, logits [V] after its last token),
        its sequence's state now in `chunk.seq.cache`; or (chunk, the exception) for a chunk whose own
        forward failed (a failed batched or graph forward is retried one chunk at a time to find it)."""
        graphs = self.graphs
        if kind:
            done = []
            try:
                for i in range(0, len(chunks), graphs.max_rows):
                    part = chunks[i : i + graphs.max_rows]
                    logits, caches = graphs.run([c.seq.prompt[c.start : c.end] for c in part],
                                                [c.seq.cache for c in part] if kind == "cached" else None)
                    done += list(zip(part, caches, logits, strict=True))
            except Exception:  # noqa: BLE001 - the eager path below finds the request at fault, if any
                done = None
            if done is not None:
                for c, cache, row in done:
                    c.seq.cache = cache
                    yield c, row
                return
        if len(chunks) > 1:
            try:
                cache = K3Cache.stack([c.seq.cache for c in chunks])
                ids = self._ids([c.seq.prompt[c.start : c.end] for c in chunks])
                logits = self.model(ids, cache=cache)[:, -1]
            except Exception:  # noqa: BLE001 - retry one by one to find the request at fault
                logits = None
            if logits is not None:
                for c, row_cache, row in zip(chunks, cache.split(), logits, strict=True):
                    c.seq.cache = row_cache
                    yield c, row
                return
        for c in chunks:
            seq = c.seq
            images = seq.images[seq.image_cursor : seq.image_cursor + c.images] if c.images else None
            ids = self._ids([seq.prompt[c.start : c.end]])
            try:
                logits = self.model(ids, images=images, cache=seq.cache)
            except Exception as e:  # noqa: BLE001 - a bad prompt fails its own group, nobody else
                yield c, e
                continue
            yield c, logits[0, -1]

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        """Token ids on the engine's device, their host copy handed over (the model's media check reads it
        without waiting for the GPU)."""
        host = torch.tensor(rows)
        # not a blocking copy: that would wait for the decode step in flight
        return remember_host_copy(host.to(self.device, non_blocking=True), host)
