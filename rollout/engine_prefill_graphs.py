"""The embedded engine's first prefill chunk of fresh prompts through CUDA graphs (issue [12] item 5).

An eager prefill forward of k3-small costs 72-78 ms on an H200 whatever its size (1 x 32 to 32 x 128
tokens), of which the GPU works ~5 ms: it is bound by its ~1,000 launches, and in the RL job it is half
the engine's time (BENCHMARKS.md, "the engines' counters"). Captured, a forward costs its kernels.

Shapes are made few: a fresh prompt of L tokens (no images, no shared prefix being split off, at most
`prefill_chunk + decode_append` tokens) prefills its first T = ALIGN * floor(min(L, prefill_chunk) / ALIGN)
tokens here, and the rest (< ALIGN) is fed by decode steps (the engine's `decode_append`). Prompts of
one bucket T batch into one forward, padded to a row rung R of ROW_RUNGS with rows of token 0 whose
results are dropped (rows are independent sequences). One graph per (R, T), captured on first use
after an eager warm-up:

    cache  = model.new_cache(R)                      (zeros: fresh every replay)
    logits = decode_forward(model, ids[:R, :T], cache)   (the engine's sync-free layer path)
    cache.advance(T)

After a replay the graph's output buffers are copied out (`K3Cache.split` clones each row), since the
next replay writes them again. A capture that fails leaves that shape eager (as DecodeRunner does).
Without graphs (CPU, `enforce_eager`) the same path runs eagerly: the bucketing, padding and splitting
are tested on the CPU; only the capture is the GPU's.
"""

from __future__ import annotations

import warnings

import torch

from .engine_decode import decode_forward, end_failed_capture, rung

ALIGN = 64
ROW_RUNGS = (1, 2, 4, 8, 16, 32)


def bucket(length: int, chunk: int) -> int:
    """The tokens of a fresh prompt's first chunk here: the largest multiple of ALIGN <= min(length, chunk)."""
    return min(length, chunk) // ALIGN * ALIGN


class PrefillGraphs:
    def __init__(self, model, autocast_dtype, max_tokens: int, use_graphs: bool):
        self.model, self.autocast_dtype = model, autocast_dtype
        self.device = model.lm_head.weight.device
        self.max_rows, self.max_tokens = ROW_RUNGS[-1], max_tokens // ALIGN * ALIGN
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.ids = torch.zeros(self.max_rows, max(self.max_tokens, ALIGN), dtype=torch.int64, device=self.device)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.failed: set[tuple[int, int]] = set()
        self.mempool = None
        self.runs, self.captures, self.replays = 0, 0, 0  # forwards (graphs or eager), graphs captured, replayed

    def takes(self, T: int) -> bool:
        return T >= ALIGN and T % ALIGN == 0 and T <= self.max_tokens

    def run(self, rows: list[list[int]]):
        """Prefill fresh prompts of T tokens each (T bucketed): (logits [B, V], one K3Cache per row)."""
        B, T = len(rows), len(rows[0])
        if not self.takes(T) or B > self.max_rows or any(len(r) != T for r in rows):
            raise ValueError(f"PrefillGraphs: {B} rows of {T} tokens (rows of one length, a multiple of {ALIGN} "
                             f"up to {self.max_tokens}, at most {self.max_rows} rows)")
        R = rung(B, ROW_RUNGS)
        self.runs += 1
        self.ids[:B, :T].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        self.ids[B:R, :T].zero_()  # padding rows: token 0, results dropped
        key = (R, T)
        if not self.use_graphs or key in self.failed:
            logits, cache = self._forward(R, T)
        else:
            if key not in self.graphs:
                try:
                    self.graphs[key] = self._capture(R, T)
                    self.captures += 1
                except RuntimeError as e:  # e.g. an op that syncs: this shape stays eager
                    end_failed_capture(self._stream_before, self.mempool, self.device)
                    self.failed.add(key)
                    self.graphs.clear()  # their pool is abandoned with the failed capture's
                    self.mempool = None
                    warnings.warn(f"engine: CUDA graph capture of prefill shape (rows, tokens) = {key} failed "
                                  f"({str(e).splitlines()[0][:300]}); prefilling that shape eagerly",
                                  RuntimeWarning, stacklevel=2)
                    logits, cache = self._forward(R, T)
                    return logits[:B].clone(), cache.split()[:B]
            graph, (logits, cache) = self.graphs[key]
            graph.replay()
            self.replays += 1
        return logits[:B].clone(), cache.split()[:B]

    def _forward(self, R: int, T: int):
        cache = self.model.new_cache(R, self.autocast_dtype)
        logits, _ = decode_forward(self.model, self.ids[:R, :T], cache)
        cache.advance(T)
        return logits, cache

    def _capture(self, R: int, T: int):
        self._stream_before = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: kernels compiled, the chunk kernel's tables built for (R, T)
            self._forward(R, T)
        torch.cuda.current_stream().wait_stream(stream)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            outputs = self._forward(R, T)
        return graph, outputs
