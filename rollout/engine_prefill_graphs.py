"""The embedded engine's first prefill chunk of fresh prompts through CUDA graphs (issue [12] item 5).

An eager prefill forward of k3-small costs 72-78 ms on an H200 whatever its size (1 x 32 to 32 x 128
tokens), of which the GPU works ~5 ms: it is bound by its ~1,000 launches, and in the RL job it is half
the engine's time (BENCHMARKS.md, "the engines' counters"). Captured, a forward costs its kernels.

Shapes are made few. A chunk of a prompt without images, with `rest` tokens left to prefill, goes
here when its T = ALIGN * floor(min(rest, prefill_chunk) / ALIGN) tokens leave at most `decode_append`
(fed by decode steps) or fill a whole chunk (another chunk follows). Chunks of one T batch into one
forward, padded to a row rung R of ROW_RUNGS with rows of token 0 whose results are dropped (rows
are independent sequences). Two kinds of graph, each captured on first use after an eager warm-up:

  fresh  (R, T)      a prompt's first chunk, nothing cached:
                       cache  = model.new_cache(R)                          (zeros: fresh every replay)
                       logits = decode_forward(model, ids[:R, :T], cache)   (the engine's sync-free layer path)
  cached (R, T, S)   a chunk after a cached prefix of P_b tokens (a prefix-cache hit: the conversation's
                     earlier turns; or the chunk before): the rows' states copied into static buffers of
                     S = the next power of two >= max(P_b) + T latent positions, lengths P_b, then the same
                     forward; the MLA attention masks each row past P_b + t, so one graph serves any P_b.

After a replay the graph's output buffers are copied out (`K3Cache.split` clones each row), since the
next replay writes them again. A capture that fails leaves that shape eager (as DecodeRunner does).
Without graphs (CPU, `enforce_eager`) the same path runs eagerly: the bucketing, padding, copying in
and splitting are tested on the CPU; only the capture is the GPU's.
"""

from __future__ import annotations

import warnings

import torch

from k3rl.learner.model import K3Cache
from k3rl.learner.model.kda import KDACacheEntry
from k3rl.learner.model.mla import MLACacheEntry

from .engine_decode import MIN_CONTEXT, decode_forward, end_failed_capture, rung

ALIGN = 64
ROW_RUNGS = (1, 2, 4, 8, 16, 32)


def bucket(length: int, chunk: int) -> int:
    """The tokens of a chunk here: the largest multiple of ALIGN <= min(length, chunk)."""
    return min(length, chunk) // ALIGN * ALIGN


def context_rung(tokens: int) -> int:
    """Latent positions of a cached chunk's graph: the next power of two >= tokens (at least MIN_CONTEXT)."""
    S = MIN_CONTEXT
    while S < tokens:
        S *= 2
    return S


class PrefillGraphs:
    def __init__(self, model, autocast_dtype, max_tokens: int, use_graphs: bool, max_context: int = 1 << 30):
        self.model, self.autocast_dtype = model, autocast_dtype
        self.device = model.lm_head.weight.device
        self.max_rows, self.max_tokens = ROW_RUNGS[-1], max_tokens // ALIGN * ALIGN
        self.max_context = max_context  # the engine's max_model_len: no graph's buffers past it
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.ids = torch.zeros(self.max_rows, max(self.max_tokens, ALIGN), dtype=torch.int64, device=self.device)
        self.inputs: dict[tuple[int, int], K3Cache] = {}  # (R, S): the cached graphs' static input states
        self.graphs: dict[tuple, tuple] = {}
        self.failed: set[tuple] = set()
        self.mempool = None
        self.runs, self.captures, self.replays = 0, 0, 0  # forwards (graphs or eager), graphs captured, replayed
        self.cached_runs = 0  # forwards of chunks after a cached prefix

    def takes(self, T: int, cached: int = 0) -> bool:
        """Whether a chunk of T tokens after `cached` ones goes here."""
        return (T >= ALIGN and T % ALIGN == 0 and T <= self.max_tokens
                and (not cached or context_rung(cached + T) <= self.max_context))

    def run(self, rows: list[list[int]], caches: list[K3Cache] | None = None):
        """Prefill chunks of T tokens each (T bucketed), fresh or after `caches` (batch-1 caches, read
        only): (logits [B, V] of each chunk's last token, one new K3Cache per row)."""
        B, T = len(rows), len(rows[0])
        cached = [c.host_lengths[0] for c in caches] if caches is not None else []
        if not self.takes(T, max(cached, default=0)) or B > self.max_rows or any(len(r) != T for r in rows) \
                or (caches is not None and len(caches) != B):
            raise ValueError(f"PrefillGraphs: {B} rows of {T} tokens (rows of one length, a multiple of {ALIGN} "
                             f"up to {self.max_tokens}, at most {self.max_rows} rows, one cache per row if any, "
                             f"at most {self.max_context} positions)")
        R = rung(B, ROW_RUNGS)
        self.runs += 1
        self.ids[:B, :T].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        self.ids[B:R, :T].zero_()  # padding rows: token 0, results dropped
        key = (R, T) if caches is None else (R, T, context_rung(max(cached) + T))
        if caches is not None:
            self.cached_runs += 1
            self._load(key, caches, cached)
        if not self.use_graphs or key in self.failed:
            logits, cache = self._forward(key)
        else:
            if key not in self.graphs:
                try:
                    self.graphs[key] = self._capture(key)
                    self.captures += 1
                except RuntimeError as e:  # e.g. an op that syncs: this shape stays eager
                    end_failed_capture(self._stream_before, self.mempool, self.device)
                    self.failed.add(key)
                    self.graphs.clear()  # their pool is abandoned with the failed capture's
                    self.mempool = None
                    warnings.warn(f"engine: CUDA graph capture of prefill shape {key} (rows, tokens[, context]) "
                                  f"failed ({str(e).splitlines()[0][:300]}); prefilling that shape eagerly",
                                  RuntimeWarning, stacklevel=2)
                    if caches is not None:
                        self._load(key, caches, cached)  # the warm-up ran over the inputs: load them again
                    logits, cache = self._forward(key)
                    return logits[:B].clone(), self._rows(cache, B, T, cached)
            graph, (logits, cache) = self.graphs[key]
            graph.replay()
            self.replays += 1
        return logits[:B].clone(), self._rows(cache, B, T, cached)

    def _load(self, key: tuple, caches: list[K3Cache], cached: list[int]) -> None:
        """Copy the rows' states into the static inputs of (R, S): KDA states and conv windows one `cat` per
        tensor, MLA latents row by row (their lengths differ), lengths P_b (0 for padding rows)."""
        R, _, S = key
        B = len(caches)
        if (R, S) not in self.inputs:
            self.inputs[(R, S)] = self._static_inputs(R, S)
        inp = self.inputs[(R, S)]
        for i, e in inp.kda.items():
            torch.cat([c.kda[i].state for c in caches], out=e.state[:B])
            torch.cat([c.kda[i].conv for c in caches], out=e.conv[:B])
        for i, e in inp.mla.items():
            for b, (c, n) in enumerate(zip(caches, cached, strict=True)):
                e.latent[b, :n].copy_(c.mla[i].latent[0, :n])
        inp.lengths.copy_(torch.tensor(cached + [0] * (R - B), dtype=torch.int64), non_blocking=True)

    def _static_inputs(self, R: int, S: int) -> K3Cache:
        template = self.model.new_cache(R, self.autocast_dtype)
        mla = {i: MLACacheEntry(e.latent.new_zeros(R, S, e.latent.shape[-1])) for i, e in template.mla.items()}
        return K3Cache(template.kda, mla, template.lengths, [0] * R)

    def _rows(self, cache: K3Cache, B: int, T: int, cached: list[int]) -> list[K3Cache]:
        """Each real row's state as its own batch-1 cache (copies: the graph writes its outputs again)."""
        head = K3Cache({i: KDACacheEntry(e.state[:B], e.conv[:B]) for i, e in cache.kda.items()},
                       {i: MLACacheEntry(e.latent[:B]) for i, e in cache.mla.items()},
                       cache.lengths[:B] + T, [n + T for n in cached] if cached else [T] * B)
        return head.split()

    def _forward(self, key: tuple):
        R, T = key[0], key[1]
        if len(key) == 2:
            cache = self.model.new_cache(R, self.autocast_dtype)
        else:  # new entry objects over the static inputs: KDA puts its new state in the entry
            inp, S = self.inputs[(R, key[2])], key[2]
            cache = K3Cache({i: KDACacheEntry(e.state, e.conv) for i, e in inp.kda.items()},
                            {i: MLACacheEntry(e.latent) for i, e in inp.mla.items()},
                            inp.lengths, [S - T] * R)  # the bookkeeping sees S positions: one graph, any P_b
        logits, _ = decode_forward(self.model, self.ids[:R, :T], cache)
        return logits, cache

    def _capture(self, key: tuple):
        self._stream_before = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: kernels compiled, the chunk kernel's tables built for (R, T)
            self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            outputs = self._forward(key)
        return graph, outputs
