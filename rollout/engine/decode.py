"""The embedded engine's decode step: one token for every slot of the state pool, sampled on the device.

    logits, routing = the model's forward of one token per sequence over the pool's slots
    tokens          = sample_tokens(logits, per-row params, seeds, counters)      (sampling.py)
    logprobs        = log_softmax(logits.float())[tokens]                          fp32
    out             = [tokens | logprobs | routed experts]  one fp64 row per slot

Inputs come through two static buffers (int64: token, seed, counter, length, and the rows and
tokens of prompt tokens fed beside tokens sampled on the device; fp64: temperature, top_k, top_p),
one non-blocking host-to-device copy each per step; `out` comes back with one
`.tolist()`. On CUDA (unless `enforce_eager`) the whole step is captured in a CUDA graph per
(batch rung, context rung, filtered) and replayed: the batch is padded to the next rung of
`BATCH_RUNGS` (padding rows are free slots of length 0 whose results are ignored), the context
to the next power of two. Weights are read where they lie, so a weight update copied into the
parameters in place is seen by every captured graph.

`decode_forward` is `K3ForCausalLM.forward` for T = 1 with a cache, layer by layer through the
model's own modules, leaving out the forward's host-side input checks (the media-placeholder
test, the routed-expert range check of `latent_experts`, `torch.bincount`'s read of the
largest id in its grouped path), which synchronise with the device and cannot be captured. Decode tokens are sampled tokens (never the placeholder) and routing
ids come from top-k, so the checks have nothing to catch here. With the Triton backend the router's
top-k and weights are one kernel (kernels/moe/router.py) and the routed experts of a small batch two
(kernels/moe/triton_decode_experts.py: the weights read in place); a larger batch takes grouped GEMMs.
"""

from __future__ import annotations

import threading
import time
import warnings

import torch
import torch.nn.functional as F

from k3rl.kernels._backend import resolve_backend
from k3rl.kernels.moe import GROUP_ALIGN, latent_experts_loop
from k3rl.kernels.moe.router import route_topk
from k3rl.kernels.moe.triton_decode_experts import decode_experts_triton
from k3rl.kernels.situ import situ_glu
from k3rl.model.attnres import aggregate
from k3rl.model.common import autocast_dtype, fp32_island
from k3rl.model.kda import KimiDeltaAttention
from k3rl.model.model import allow_layer_recompiles
from k3rl.model.moe import MoEGate

from .sampling import policy_logprobs, sample_tokens
from .state_pool import StatePool

# Held through every CUDA graph capture in this process (decode steps and prefill chunks). Code that works on
# the device beside the engine (a weight transport's receive: IPC handles opened, copies, device syncs) holds
# it too: a device-wide sync from another thread invalidates a capture in progress. Steps that replay graphs
# or run eagerly need no guard, so a slow weight transfer never stops decoding.
CAPTURE_LOCK = threading.Lock()

BATCH_RUNGS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_CAPTURE_FAILURES = 3
MIN_CONTEXT = 64


def _grouped_experts(z, idx, p, w1, w3, w2, beta_gate: float, beta_up: float) -> torch.Tensor:
    """The routed experts of a decode batch with grouped GEMMs, no sort and no host sync.

    Route r = (token r // k, its (r % k)-th expert e_r) gets row start[e_r] + rank_r of one
    buffer of per-expert groups padded to GROUP_ALIGN rows, where rank_r counts the earlier
    routes to e_r (a running sum over a one-hot); the k outputs of a token are then summed in
    fp32 in routing order, u_t = sum_j p_tj h_tj (deterministic: no atomics).
    """
    N, dim = z.shape
    E, k = w1.shape[0], idx.shape[1]
    flat = idx.reshape(-1)
    # [E, R]: routes to each expert so far (a scan along the last dim: a scan along the first is serial on CUDA)
    seen = (torch.arange(E, device=z.device)[:, None] == flat[None, :]).long().cumsum(1)
    padded = (seen[:, -1] + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = torch.cumsum(padded, 0)
    pos = (ends - padded)[flat] + seen.gather(0, flat[None, :]).squeeze(0) - 1
    M = -(-(flat.numel() + E * (GROUP_ALIGN - 1)) // GROUP_ALIGN) * GROUP_ALIGN  # static bound on the rows
    x = z.new_zeros(M, dim).index_copy(0, pos, z.unsqueeze(1).expand(N, k, dim).reshape(-1, dim))
    offs = ends.to(torch.int32)
    a = situ_glu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
                 torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs), beta_gate, beta_up)
    h = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)[pos].view(N, k, -1)
    return (h.float() * p.float()[..., None]).sum(1).to(z.dtype)


def _routed_experts(experts, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """RoutedExperts.forward without latent_experts' input checks (and without its syncs on CUDA)."""
    if experts.precision == "mxfp4":  # MXFP4 weights, MXFP8 activations: RoutedExperts.forward itself (its held
        return experts(z, idx, p)  # bytes on CUDA take kernels/moe/triton_mx_experts.py: no host sync there)
    w1, w3, w2 = experts.w1, experts.w3, experts.w2
    if (dt := autocast_dtype(z)) is not None:  # not an autocast op: cast like one (as RoutedExperts does)
        w1, w3, w2 = w1.to(dt), w3.to(dt), w2.to(dt)
    z = z.to(w1.dtype)
    few = 4 * idx.numel() <= w1.shape[0]  # few routes: their experts read in place, two kernels
    grouped_ok = hasattr(torch, "_grouped_mm") and z.dtype == torch.bfloat16
    # the decode kernel takes any dtype and batch (the loop syncs on its counts: no CUDA graph); grouped
    # GEMMs (bf16 only) pay for many routes
    path = resolve_backend(experts.backend, "latent_experts", z, w1, has_triton=True)
    if path != "triton":
        fn = latent_experts_loop
    elif few or not grouped_ok:
        fn = decode_experts_triton
    else:
        fn = _grouped_experts
    return fn(z, idx, p, w1, w3, w2, experts.beta_gate, experts.beta_up)


def _route(gate, flat: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MoEGate.forward for inference: (p [N, k] fp32, idx [N, k]); s = sigmoid(x_fp32 W_r,fp32^T), the top-k
    of s + b and their weights in one kernel on CUDA (kernels/moe/router.py)."""
    with fp32_island(flat):
        logits = F.linear(flat.float(), gate.weight.float())  # a no-op cast: the engine keeps W_r in fp32
    return route_topk(logits, gate.e_score_correction_bias, gate.top_k, gate.renormalize, gate.scaling,
                      backend=backend)


def _moe(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """StableLatentMoE.forward (inference): (y, experts used [N, k])."""
    flat = x.reshape(-1, x.shape[-1])
    p, idx = _route(moe.gate, flat, moe.experts.backend)
    u = _routed_experts(moe.experts, moe.routed_expert_down_proj(flat), idx, p)
    y = moe.shared_experts(flat) + moe.routed_expert_up_proj(moe.routed_expert_norm(u))
    return y.reshape(x.shape), idx


def keep_fp32_island_weights(model) -> None:
    """Hold the weights that the model only ever reads widened to fp32 (the router's W_r, KDA's W_beta:
    `F.linear(x.float(), w.float())`) in fp32, so a step does not widen them again: the same values
    (a weight update is copied in with a cast), two kernels fewer per layer."""
    for module in model.modules():
        if isinstance(module, MoEGate):
            w = module.weight
        elif isinstance(module, KimiDeltaAttention):
            w = module.b_proj.weight
        else:
            continue
        if w.dtype in (torch.bfloat16, torch.float16):
            w.data = w.data.float()


def attnres_queries(model) -> list[torch.Tensor]:
    """Every Block AttnRes pseudo-query gamma * w of a decode step in fp32, in the order the step uses
    them (per layer: before the mixer, before the MLP; then the output's): the products of
    `query_vector`, computed in a handful of kernels instead of three per aggregation."""
    m = model.model
    pairs = [(layer.self_attention_res_proj, layer.self_attention_res_norm) for layer in m.layers]
    pairs = [p for layer, pa in zip(m.layers, pairs, strict=True) for p in (pa, (layer.mlp_res_proj, layer.mlp_res_norm))]
    pairs.append((m.output_attn_res_proj, m.output_attn_res_norm))
    w = torch.cat([proj.weight for proj, _ in pairs])  # [n, d]
    gamma = torch.stack([norm.weight for _, norm in pairs])
    return list((gamma.float() * w.float()).unbind(0))


def _layer(layer, bank: list, partial: torch.Tensor, entry, step, queries):
    """K3DecoderLayer.forward with a cache (docs/model.md §4.3)."""
    a = aggregate(bank + [partial], next(queries), layer.eps, layer.backend)
    if layer.is_block_start:
        bank, partial = bank + [partial], None
    x = layer.input_layernorm(a)
    t = layer.self_attn(x, cache=entry, step=step) if layer.is_mla else layer.self_attn(x, cache=entry)
    partial = t if partial is None else partial + t
    m = aggregate(bank + [partial], next(queries), layer.eps, layer.backend)
    y = layer.post_attention_layernorm(m)
    f, experts = _moe(layer.mlp, y) if layer.is_moe else (layer.mlp(y), None)
    return bank, partial + f, experts


def decode_forward(model, ids: torch.Tensor, cache, layer_fn=_layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [B, V] of the last of ids [B, T] appended to `cache`, and the experts used [B, n_moe, k] (None
    without MoE; for T = 1, a decode step). `layer_fn`: `_layer` or a compiled `_layer` (DecodeRunner's
    `compile`). With T > 1 over a K3Cache (then `cache.advance(T)`) it is a prefill forward without the
    model forward's host syncs, which a CUDA graph can capture."""
    step = cache.decode_step(ids.shape[1])
    queries = iter(attnres_queries(model))
    bank, partial, routes = [], model.model.embed_tokens(ids), []
    for layer in model.model.layers:
        bank, partial, experts = layer_fn(layer, bank, partial, cache.layer(layer.layer_idx), step, queries)
        if experts is not None:
            routes.append(experts)
    m = model.model
    last = [x[:, -1:] for x in bank + [partial]]  # Agg is per position: only the last one's logits are needed
    logits = model.lm_head(m.norm(aggregate(last, next(queries), model.config.rms_norm_eps,
                                            model.config.kernel_backend)))[:, -1]
    return logits, (torch.stack([r.view(ids.shape[0], ids.shape[1], -1)[:, -1] for r in routes], dim=1)
                    if routes else None)


def end_failed_capture(stream_before, mempool, device: torch.device) -> None:
    """After a failed CUDA graph capture: the stream current before it made current again, and the caching
    allocator no longer routing this thread's allocations to the graphs' memory pool (the capture context
    can leave both behind, and every later capture then fails with "already recording to mempool")."""
    torch.cuda.set_stream(stream_before)
    end_allocate = getattr(torch._C, "_cuda_endAllocateToPool", None)  # private: torch 2.11 and 2.13 have it
    if mempool is not None and end_allocate is not None:
        try:
            end_allocate(device.index or 0, mempool)
        except RuntimeError:
            pass  # capture_end had ended it


def rung(n: int, rungs) -> int:
    return next(r for r in rungs if r >= n)


def context_rung(tokens: int) -> int:
    """Latent positions a captured forward covers: the next power of two >= tokens (at least MIN_CONTEXT)."""
    S = MIN_CONTEXT
    while S < tokens:
        S *= 2
    return S


class DecodeRunner:
    """Runs decode steps over the first rows of a StatePool, eagerly or through CUDA graphs.

    `compile`: each layer's step through `torch.compile(_layer)` (regional: layers of one shape share a
    compiled graph), fusing the small elementwise kernels between the Triton kernels and GEMVs, which
    stay as they are. A shape's first step compiles (in the warm-up before its graph capture). One
    compiled function serves every batch rung (a copy per rung is no faster)."""

    def __init__(self, model, pool: StatePool, banned: int | None, use_graphs: bool, compile: bool = False):
        self.model, self.pool, self.banned = model, pool, banned
        self.layer_fn = _layer
        if compile:
            allow_layer_recompiles(len(model.model.layers))
            self.layer_fn = torch.compile(_layer)
        self.use_graphs = use_graphs and pool.device.type == "cuda"
        self.pad = self.use_graphs  # pad the batch to its rung (graphs need it; settable to test the padding)
        N = pool.num_slots
        self.batch_rungs = tuple(sorted({r for r in BATCH_RUNGS if r < N} | {N}))
        # token, seed, counter, length; then (feed) rows whose token is a prompt token from the host, those tokens
        self.ints = torch.zeros(6, N, dtype=torch.int64, device=pool.device)
        self.floats = torch.zeros(3, N, dtype=torch.float64, device=pool.device)  # temperature, top_k, top_p
        self.n_moe = len(model.moe_layer_ids)
        self.graphs: dict[tuple, tuple] = {}
        self.graph_generation = pool.generation
        self.mempool = None
        self.eager_keys: set[tuple] = set()  # shapes whose capture failed: decoded eagerly
        self.capture_failures: list[str] = []
        self.captures, self.capture_s = 0, 0.0  # graphs captured (warm-up step included in the seconds)

    def routed_experts(self, row: list[float]) -> list[list[int]]:
        """The experts each MoE layer chose, from one of `step`'s out rows brought to the host."""
        k = self.model.config.num_experts_per_token
        experts = [int(e) for e in row[2:]]
        return [experts[m : m + k] for m in range(0, len(experts), k)]

    def context_rung(self, longest: int) -> int:
        """Positions the attention covers: room for the longest sequence's next token, at most max_len."""
        return min(context_rung(longest + 1), self.pool.max_len)

    def step(self, n: int, tokens: list[int] | torch.Tensor, seeds: list[int], counters: list[int],
             params: list[tuple], filtered: bool, feed: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode slots [0, n): feed `tokens` (a list, or a tensor on the device: an earlier step's samples,
        read there without a sync), sample with `params` [(temperature, top_k, top_p)]. `feed` {row: token}:
        rows whose token comes from the host instead of the device tensor (a prompt tail, decode_append),
        carried by the same host-to-device copy as the other inputs.

        Returns (out [B, 2 + n_moe * k] fp64 rows: token, logprob, routed experts; logits [B, V]) for the
        padded batch B >= n; rows >= n are padding."""
        lengths = self.pool.lengths[:n]
        S = self.context_rung(max(lengths))
        self.pool.ensure_capacity(S)
        B = rung(n, self.batch_rungs) if self.pad else n
        pad = B - n
        zeros = [0] * pad
        on_device = isinstance(tokens, torch.Tensor)
        host_tokens = [0] * n if on_device else tokens
        host = host_tokens + zeros + seeds + zeros + counters + zeros + lengths + zeros  # flat: fast
        F = len(feed) if on_device and feed else 0
        if F:  # (row, token) pairs, padded to B columns (F <= n <= B)
            host += [*feed, *[0] * (B - F), *feed.values(), *[0] * (B - F)]
        ints = torch.tensor(host, dtype=torch.int64).view(-1, B)
        params = params + [(0.0, 0, 1.0)] * pad  # padding rows: greedy, unfiltered
        floats = torch.tensor([x for column in zip(*params, strict=True) for x in column],
                              dtype=torch.float64).view(3, B)
        self.ints[: ints.shape[0], :B].copy_(ints, non_blocking=True)
        self.floats[:, :B].copy_(floats, non_blocking=True)
        if on_device:
            self.ints[0, :n].copy_(tokens)  # after the host rows, in stream order
            if F:
                self.ints[0].index_copy_(0, self.ints[4, :F], self.ints[5, :F])
        self.pool.lengths[:n] = [x + 1 for x in lengths]
        if not self.use_graphs:
            return self._run(B, S, filtered, lengths + zeros)
        if self.graph_generation != self.pool.generation:  # the latent buffers moved: recapture
            self.graphs.clear()
            # a memory pool whose graphs are all gone cannot be shared by a new capture (PyTorch asserts
            # its use count > 0): the new graphs share a new one
            self.mempool = None
            self.graph_generation = self.pool.generation
        key = (B, S, filtered)
        if key in self.eager_keys:
            return self._run(B, S, filtered, lengths + zeros)
        if key not in self.graphs:
            t0 = time.perf_counter()
            try:
                self.graphs[key] = self._capture(B, S, filtered)
            except RuntimeError as e:  # e.g. cudaErrorStreamCaptureInvalidated: decode this shape eagerly
                self._capture_failed(key, e)
                return self._run(B, S, filtered, lengths + zeros)
            finally:
                self.captures += 1
                self.capture_s += time.perf_counter() - t0
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _capture_failed(self, key: tuple, error: RuntimeError) -> None:
        """A capture that failed must not stop the engine: nothing of it ran (the warm-up's state was
        put back before the capture began), so the step is decoded eagerly. The capture context can
        leave its stream current and the allocator still routing that stream's allocations to the
        graphs' pool (every later capture then fails with "already recording to mempool"): both are
        undone, and later captures get a new pool. The shape stays eager; after MAX_CAPTURE_FAILURES
        failures the runner stops capturing."""
        if self.pool.device.type == "cuda":
            end_failed_capture(self._stream_before_capture, self.mempool, self.pool.device)
        self.graphs.clear()  # their pool is abandoned (not released: a failed capture's count is unknown)
        self.mempool = None
        self.eager_keys.add(key)
        self.capture_failures.append(f"{key}: {str(error).splitlines()[0][:300]}")
        if len(self.capture_failures) >= MAX_CAPTURE_FAILURES:
            self.use_graphs = False
        warnings.warn(
            f"engine: CUDA graph capture of decode shape (batch, context, filtered) = {key} failed ({error}); "
            f"decoding that shape eagerly{'; graphs now off for this engine' if not self.use_graphs else ''}",
            RuntimeWarning, stacklevel=2,
        )  # fmt: skip

    def _run(self, B: int, S: int, filtered: bool, host_lengths: list[int]):
        ints, floats = self.ints[:, :B], self.floats[:, :B]
        cache = self.pool.view(B, S, ints[3], host_lengths)
        logits, routes = decode_forward(self.model, ints[0][:, None], cache, self.layer_fn)
        self.pool.write_back(cache)
        tokens = sample_tokens(logits, floats[0], floats[1], floats[2], ints[1], ints[2], self.banned, filtered)
        cols = [tokens[:, None].double(), policy_logprobs(logits, tokens, floats[0])[:, None].double()]
        if routes is not None:
            cols.append(routes.flatten(1).double())
        return torch.cat(cols, dim=1), logits

    def _capture(self, B: int, S: int, filtered: bool):
        """Capture one decode step at (B, S). A warm-up run first (kernel compilation, library
        handles) on saved copies of the state it changes, which are put back afterwards."""
        host_lengths = [S - 1] * B  # what the model's bookkeeping sees: not fresh, no growth past S
        self._stream_before_capture = torch.cuda.current_stream()
        saved = [(e.state[:B].clone(), e.conv[:B].clone()) for e in self.pool.kda.values()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(B, S, filtered, host_lengths)
        torch.cuda.current_stream().wait_stream(stream)
        for e, (state, conv) in zip(self.pool.kda.values(), saved, strict=True):
            e.state[:B].copy_(state)
            e.conv[:B].copy_(conv)
        del saved
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK, torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            outputs = self._run(B, S, filtered, host_lengths)
        return graph, outputs
