"""The embedded engine's prefill chunks without images through CUDA graphs: a fresh prompt's first chunk,
and a chunk after a cached prefix.

An eager prefill forward costs about the same whatever its size: the host's launches of its kernels,
not the GPU's work, bound it. Captured, a forward costs its kernels.

Shapes are made few. A chunk of a prompt without images, with `rest` tokens left to prefill, goes
here when its T = ALIGN * floor(min(rest, prefill_chunk) / ALIGN) tokens leave fewer than ALIGN (fed by
decode steps) or fill a whole chunk (another chunk follows). Chunks of one T and kind batch into one
forward, padded to a row rung R of ROW_RUNGS with rows of token 0 whose results are dropped (rows are
independent sequences). Every forward runs over static state buffers: the first R rows of one set of
KDA states and conv windows (32 rows), and of MLA latents of S positions, S = the next power of two >=
the longest row's cached tokens + T (one buffer per S, of at most ROW_POSITIONS rows x positions: a
group too large for it runs in parts; a chunk past ROW_POSITIONS runs eagerly). The rows' states are
copied in (one `cat` per KDA tensor, MLA latents row by row), and the forward writes its new states back:

  fresh  (R, T, S)   a prompt's first chunk: the KDA states zeroed, then
                       logits = decode_forward(model, ids[:R, :T], cache over the buffers)
                     (the engine's sync-free layer path; the MLA attention the naive form over the chunk)
  cached (R, T, S)   a chunk after a cached prefix of P_b tokens (a prefix-cache hit: a conversation's
                     earlier turns; or the chunk before): the same forward at lengths P_b, the MLA
                     attention masked per row past P_b + t, so one graph serves any P_b.

Each (R, T, S, kind) is captured in a CUDA graph on first use, after an eager warm-up, and replayed;
its only output of its own is the logits (the states live in the shared buffers), so graphs cost
little memory. After a replay the rows' states are copied out (`K3Cache.split` clones each row).
A capture that fails leaves that shape eager (as DecodeRunner does). Without graphs (CPU,
`enforce_eager`) the same path runs eagerly: the bucketing, padding, copying in and out are tested
on the CPU; only the capture is the GPU's.
"""

from __future__ import annotations

import warnings

import torch

from k3rl.model import K3Cache
from k3rl.model.kda import KDACacheEntry
from k3rl.model.mla import MLACacheEntry

from .decode import CAPTURE_LOCK, context_rung, decode_forward, end_failed_capture, rung

ALIGN = 16
ROW_RUNGS = (1, 2, 4, 8, 16, 32)
ROW_POSITIONS = 1 << 15  # rows x latent positions of one S's buffers (k3-small: 4 MLA layers, 151 MB)


def bucket(length: int, chunk: int) -> int:
    """The tokens of a chunk here: the largest multiple of ALIGN <= min(length, chunk)."""
    return min(length, chunk) // ALIGN * ALIGN


class PrefillGraphs:
    def __init__(self, model, autocast_dtype, max_tokens: int, use_graphs: bool, max_context: int = 1 << 30):
        self.model, self.autocast_dtype = model, autocast_dtype
        self.device = model.lm_head.weight.device
        self.max_rows, self.max_tokens = ROW_RUNGS[-1], max_tokens // ALIGN * ALIGN
        self.max_context = max_context  # the engine's max_model_len: no buffers past it
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.ids = torch.zeros(self.max_rows, max(self.max_tokens, ALIGN), dtype=torch.int64, device=self.device)
        self.state: K3Cache | None = None  # KDA states, conv windows, lengths of max_rows rows (made on first use)
        self.latents: dict[int, dict[int, torch.Tensor]] = {}  # S -> MLA layer -> [rows_at(S), S, C]
        self.graphs: dict[tuple, tuple] = {}
        self.failed: set[tuple] = set()
        self.mempool = None
        self.runs, self.captures, self.replays = 0, 0, 0  # forwards (graphs or eager), graphs captured, replayed
        self.cached_runs = 0  # forwards of chunks after a cached prefix

    def takes(self, T: int, cached: int = 0) -> bool:
        """Whether a chunk of T tokens after `cached` ones goes here."""
        S = context_rung(cached + T)
        return (T >= ALIGN and T % ALIGN == 0 and T <= self.max_tokens
                and S <= context_rung(self.max_context) and S <= ROW_POSITIONS)

    def rows_at(self, S: int) -> int:
        """The most rows one forward over S latent positions takes (a row rung)."""
        return max(r for r in ROW_RUNGS if r * S <= ROW_POSITIONS or r == 1)

    def run(self, rows: list[list[int]], caches: list[K3Cache] | None = None):
        """Prefill chunks of T tokens each (T bucketed), fresh or after `caches` (batch-1 caches, read
        only): (logits [B, V] of each chunk's last token, one new K3Cache per row)."""
        B, T = len(rows), len(rows[0])
        cached = [c.host_lengths[0] for c in caches] if caches is not None else [0] * B
        if not self.takes(T, max(cached)) or B > self.max_rows or any(len(r) != T for r in rows) \
                or len(cached) != B:
            raise ValueError(f"PrefillGraphs: {B} rows of {T} tokens (rows of one length, a multiple of {ALIGN} "
                             f"up to {self.max_tokens}, at most {self.max_rows} rows, one cache per row if any, "
                             f"at most {self.max_context} positions)")
        S = context_rung(max(cached) + T)
        if B > self.rows_at(S):  # more rows than one S's buffers hold: in parts
            n = self.rows_at(S)
            parts = [self.run(rows[i : i + n], caches[i : i + n] if caches is not None else None)
                     for i in range(0, B, n)]
            return torch.cat([p[0] for p in parts]), [c for p in parts for c in p[1]]
        R = rung(B, ROW_RUNGS)
        key = (R, T, S, caches is None)
        self.runs += 1
        self.cached_runs += caches is not None
        self.ids[:B, :T].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        self.ids[B:R, :T].zero_()  # padding rows: token 0, results dropped
        self._load(key, caches, cached)
        if not self.use_graphs or key in self.failed:
            logits = self._forward(key)
        elif key not in self.graphs:
            try:
                self.graphs[key] = self._capture(key)
                self.captures += 1
                self._load(key, caches, cached)  # the warm-up wrote the buffers: load them again
            except RuntimeError as e:  # e.g. an op that syncs: this shape stays eager
                end_failed_capture(self._stream_before, self.mempool, self.device)
                self.failed.add(key)
                self.graphs.clear()  # their pool is abandoned with the failed capture's
                self.mempool = None
                warnings.warn(f"engine: CUDA graph capture of prefill shape {key} (rows, tokens, context, fresh) "
                              f"failed ({str(e).splitlines()[0][:300]}); prefilling that shape eagerly",
                              RuntimeWarning, stacklevel=2)
                self._load(key, caches, cached)  # the warm-up wrote the buffers: load them again
                logits = self._forward(key)
        if key in self.graphs:
            graph, logits = self.graphs[key]
            graph.replay()
            self.replays += 1
        return logits[:B].clone(), self._rows(key, B, cached)

    def _inputs(self, R: int, S: int, host_lengths: list[int] | None = None) -> K3Cache:
        """The static buffers of a forward of R rows over S positions: views of their first R rows (the same
        addresses every time, as a graph needs), in new entry objects (a KDA forward puts its new state in
        its entry)."""
        if self.state is None:
            self.state = self.model.new_cache(self.max_rows, self.autocast_dtype)
        if S not in self.latents:
            n = self.rows_at(S)
            self.latents[S] = {i: e.latent.new_zeros(n, S, e.latent.shape[-1]) for i, e in self.state.mla.items()}
        st = self.state
        return K3Cache({i: KDACacheEntry(e.state[:R], e.conv[:R]) for i, e in st.kda.items()},
                       {i: MLACacheEntry(lat[:R]) for i, lat in self.latents[S].items()}, st.lengths[:R],
                       host_lengths or [0] * R)

    def _load(self, key: tuple, caches: list[K3Cache] | None, cached: list[int]) -> None:
        """The rows' states into the buffers: KDA states and conv windows one `cat` per tensor, MLA latents
        row by row (their lengths differ), lengths P_b (0 for padding rows). A fresh chunk's states are
        zeroed by its forward."""
        R, _, S, _ = key
        inp = self._inputs(R, S)
        if caches is not None:
            B = len(caches)
            for i, e in inp.kda.items():
                torch.cat([c.kda[i].state for c in caches], out=e.state[:B])
                torch.cat([c.kda[i].conv for c in caches], out=e.conv[:B])
            for i, e in inp.mla.items():
                for b, (c, n) in enumerate(zip(caches, cached, strict=True)):
                    e.latent[b, :n].copy_(c.mla[i].latent[0, :n])
        inp.lengths.copy_(torch.tensor(cached + [0] * (R - len(cached)), dtype=torch.int64), non_blocking=True)

    def _rows(self, key: tuple, B: int, cached: list[int]) -> list[K3Cache]:
        """Each real row's state as its own batch-1 cache (copies: the next forward writes the buffers)."""
        _, T, S, _ = key
        head = self._inputs(B, S, [n + T for n in cached])
        head.lengths = head.lengths + T
        return head.split()

    def _forward(self, key: tuple) -> torch.Tensor:
        """The chunk's forward over the (R, S) buffers, its new states written back into them; the logits."""
        R, T, S, fresh = key
        # for a cached chunk the bookkeeping sees S positions, so one graph serves any P_b (the attention
        # masks by the lengths on the device)
        cache = self._inputs(R, S, None if fresh else [S - T] * R)
        kda = {i: (e.state, e.conv) for i, e in cache.kda.items()}
        latents = {i: e.latent for i, e in cache.mla.items()}
        if fresh:
            for state, conv in kda.values():
                state.zero_()
                conv.zero_()
        logits, _ = decode_forward(self.model, self.ids[:R, :T], cache)
        for i, (state, conv) in kda.items():
            state.copy_(cache.kda[i].state)
            conv.copy_(cache.kda[i].conv)
        if any(e.latent is not latents[i] for i, e in cache.mla.items()):
            raise RuntimeError("PrefillGraphs: the forward reallocated an MLA latent buffer")  # S covers it
        return logits

    def _capture(self, key: tuple):
        self._stream_before = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: kernels compiled, the chunk kernel's tables built for (R, T)
            for _ in range(2):  # one was not enough for the first capture on an H100 (torch 2.11): it failed with
                self._forward(key)  # "operation not permitted when stream is capturing"; two, as PyTorch's recipe
        torch.cuda.current_stream().wait_stream(stream)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK, torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            logits = self._forward(key)
        return graph, logits
