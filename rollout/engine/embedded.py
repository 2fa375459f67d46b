"""The embedded K3 engine: `EmbeddedEngine` implements the inference-engine contract (`contract.py`:
`InferenceEngine`, `GenerationResult`, `EngineLoad`) on our own `K3ForCausalLM` with continuous batching.

The engine is the front desk: it validates requests (`Seq`, `seq.py`) and hands them, with aborts and
weight updates, from the callers' threads to the scheduler's through its inbox; it runs the steps (in a
thread of its own, or driven by `generate` when `background=False`), applies weight updates between two
steps (`weights.py`), and builds the parts the scheduler calls (the map is in `__init__.py`).

Log-probs: `logprobs[i] = log softmax(logits / tau)[token_i]` in fp32 at the request's temperature
tau (1 when greedy) with no top-k / top-p filtering, i.e. the policy's own distribution, exactly
what the learner gives for the same context at the job's temperature (see `sampling.py`). They
are always returned (one logsumexp per token). The media placeholder id is never sampled.

Seeds: a request's n-th token is drawn with the uniform hash(seed, n) (`sampling.py`), so a
seeded request gives the same tokens alone, in any batch, and on any device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import uuid
from collections import deque

import torch

from k3rl.model import build_model, preprocess_media
from k3rl.model.factory import as_dtype, model_config
from k3rl.model.moe import RoutedExperts
from k3rl.tokenizer import ByteTokenizer
from k3rl.types import SamplingParams, WeightUpdate

from .contract import EngineLoad, GenerationResult, InferenceEngine
from .decode import CAPTURE_LOCK, DecodeRunner, keep_fp32_island_weights
from .prefill import PrefillRunner
from .prefix_cache import PrefixCache
from .sampler import Sampler
from .sampling import request_seed, validate
from .scheduler import Scheduler
from .seq import Seq, as_pil, image_digest
from .state_pool import StatePool
from .weights import VersionedWeights


class EmbeddedEngine(InferenceEngine):
    """Continuous-batching engine on `K3ForCausalLM` (CPU or CUDA).

    model            a K3ForCausalLM (its device and dtype are used as they are)
    tokenizer        decodes tokens for stop strings (default: the byte tokenizer)
    max_num_seqs     sequences decoded together at most; more requests wait. Their decode state is
                     preallocated (one slot each: KDA states, conv windows, MLA latents)
    prefill_chunk    prompt tokens per prefill forward (chunked prefill)
    max_prefill_tokens  prompt tokens processed per step over all prefilling sequences (default 8192 on
                     CUDA, 2048 on the CPU)
    prefix_cache_size   cached prefix states kept (LRU; default on CUDA 2 x max_num_seqs, at least 32, so
                     every running conversation keeps its last turn's; 32 on the CPU); 0 disables reuse
                     (groups submitted together still prefill once)
    background       run the scheduler in a thread (default). Without it, `generate` and
                     `agenerate` drive `step()` themselves (single-threaded, deterministic),
                     and `abort` / `update_weights` run the steps they need to take effect.
    enforce_eager    never capture CUDA graphs (they are used on CUDA only, by default)
    decode_append    a prompt that extends a cached prefix by at most this many tokens (a later turn: the
                     tool's output and the next header) joins the decoding batch at once and is fed one
                     token per decode step, instead of waiting for a prefill forward of its own (default
                     64 on CUDA, where an eager forward costs its kernel launches and a decode step is one
                     graph, and 0, off, on the CPU). Results are the prefill path's, to float rounding
    share_prefix     a new prompt whose first tokens (at least this many beyond its cached prefix) an
                     earlier prompt shares, e.g. a system prompt and tool schemas that differ only in the
                     task, is prefilled up to the shared part, whose state is cached, and prompts that
                     arrive meanwhile wait for it, then extend it (default 64 on CUDA, 0, off, on the CPU)
    prefill_wait_steps  while a decoding batch runs, a request that needs a prefill forward waits until the
                     oldest such request has waited this many scheduler steps, then they all prefill
                     together: prompts that arrive over several steps (an RL job's first turns, as the
                     envs reset) share one batched forward instead of one eager forward each (default 8
                     on CUDA, 0, off, on the CPU; with nothing decoding a prefill never waits). Results are
                     unchanged
    overlap          launch decode step t+1 before step t's tokens reach the host (they are fed on the
                     device), so the scheduler's Python runs while the GPU decodes (default: on CUDA).
                     Every result is the same as without it (see `Scheduler._decode_and_sample`)
    compile_decode   run each decode step's layers through `torch.compile` (regional; DecodeRunner): fewer,
                     fused kernels a step. Off by default: each new shape's first step compiles, which is
                     slow (slower on a CPU)
    prefill_graphs   prefill chunks without images, cut to a multiple of 16 tokens (a prompt's last < 16
                     fed by decode steps), run through CUDA graphs per (row rung, tokens, context rung):
                     a fresh prompt's first chunk, and a chunk after a cached prefix (a conversation's
                     next turn) (prefill_graphs.py). Default: on for CUDA without enforce_eager; off on the
                     CPU, where set on the same bucketing runs eagerly
    autocast_dtype   run every forward under torch.autocast(autocast_dtype): an fp32 model then computes
                     as the learner does with learner.bf16 (fp32 weights and norms, bf16 products), the
                     mode that brings the engine's log-probs closest to the learner's (benchmarks/mismatch.py);
                     it reads fp32 weights, so it costs bandwidth. Weight casts are not cached (a CUDA graph
                     captures them, so a weight update copied in place is still seen)
    """

    def __init__(self, model, *, tokenizer=None, version: int = 0, max_num_seqs: int = 64, prefill_chunk: int = 512,
                 max_prefill_tokens: int | None = None, prefix_cache_size: int | None = None, max_model_len: int | None = None,
                 background: bool = True, name: str = "embedded", enforce_eager: bool = False,
                 autocast_dtype: torch.dtype | None = None, overlap: bool | None = None,
                 decode_append: int | None = None, share_prefix: int | None = None, compile_decode: bool = False,
                 prefill_wait_steps: int | None = None, prefill_graphs: bool | None = None):
        cuda = str(model.lm_head.weight.device).startswith("cuda")
        if max_prefill_tokens is None:  # a CUDA forward costs its launches more than its tokens
            max_prefill_tokens = 8192 if cuda else 2048
        if max_num_seqs < 1 or prefill_chunk < 1 or max_prefill_tokens < 1:
            raise ValueError("max_num_seqs, prefill_chunk and max_prefill_tokens must be >= 1")
        if prefill_wait_steps is None:
            prefill_wait_steps = 8 if cuda else 0
        if prefill_wait_steps < 0:
            raise ValueError(f"prefill_wait_steps must be >= 0, got {prefill_wait_steps}")
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {autocast_dtype!r}")
        if tokenizer is None:
            tokenizer = ByteTokenizer()
        self.model = model.eval()
        keep_fp32_island_weights(model)
        self.config = model.config
        self.tokenizer = tokenizer
        self.device = model.lm_head.weight.device
        self.autocast_dtype = autocast_dtype
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.name = name
        # the inbox: what callers' threads hand the scheduler's (under _cv), and every request in flight
        self._cv = threading.Condition()
        self._incoming: deque[Seq] = deque()
        self._aborts: set[str] = set()
        self._updates: list[tuple[WeightUpdate, concurrent.futures.Future]] = []
        self._live: dict[str, Seq] = {}
        self._closed = False
        self.weights = VersionedWeights(model, version)
        gpu = self.device.type == "cuda"
        if prefill_graphs is None:
            prefill_graphs = gpu and not enforce_eager
        if decode_append is None:  # prefill graphs feed their prompts' tails by decode steps, on the CPU too
            decode_append = 64 if gpu or prefill_graphs else 0
        if prefix_cache_size is None:
            prefix_cache_size = max(32, 2 * max_num_seqs) if gpu else 32
        share_prefix = (64 if gpu else 0) if share_prefix is None else share_prefix
        pool = StatePool(model, max_num_seqs, self.max_model_len, dtype=autocast_dtype)
        banned = self.config.media_placeholder_token_id  # input-only: never sampled (an image cannot follow it)
        self.scheduler = Scheduler(
            weights=self.weights, pool=pool,
            prefix=PrefixCache(prefix_cache_size, share_prefix, self.config.media_placeholder_token_id),
            prefill=PrefillRunner(model, autocast_dtype=autocast_dtype, chunk=prefill_chunk,
                                  max_tokens=max_prefill_tokens, decode_append=decode_append, graphs=prefill_graphs,
                                  use_graphs=not enforce_eager, max_context=self.max_model_len),
            decoder=DecodeRunner(model, pool, banned=banned, use_graphs=not enforce_eager, compile=compile_decode),
            sampler=Sampler(tokenizer, banned, self.device, self.max_model_len),
            prefill_wait_steps=prefill_wait_steps, overlap=gpu if overlap is None else overlap, name=name,
            forget=self._forget)
        self._step_lock = threading.Lock()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=f"{name}-scheduler", daemon=True)
            self._thread.start()

    # ----- construction ----------------------------------------------------------------------
    @classmethod
    def from_preset(cls, preset: str = "k3-tiny", *, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                    checkpoint: str | None = None, overrides: dict | None = None, **kw) -> EmbeddedEngine:
        """An engine on `build_model(preset, overrides, ...)`: the learner's architecture and seeded
        init, or the weights of an HF-layout `checkpoint` directory (the release, its MXFP4 experts
        dequantised to `dtype`, or what `save_hf` wrote). Under expert_precision mxfp4 the engine holds its
        routed experts as MXFP4 bytes (`RoutedExperts.hold_mxfp4_`), as a weight sync sends them."""
        held = model_config(preset, overrides).expert_precision == "mxfp4"
        # held experts are quantised from the fp32 init, as the learner's masters are (version 0 agrees)
        first = "float32" if held and checkpoint is None else dtype
        model = build_model(preset, overrides, dtype=first, device=device, seed=seed, checkpoint=checkpoint)
        if held:
            for module in model.modules():
                if isinstance(module, RoutedExperts):
                    module.hold_mxfp4_(read_dtype=as_dtype(dtype))
        if first != dtype:
            model.to_param_dtype(as_dtype(dtype))
        return cls(model, **kw)

    # ----- contract ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.weights.version

    def submit(self, token_ids, sampling=None, images=None, request_id=None) -> concurrent.futures.Future:
        seq = self._make_seq(token_ids, sampling or SamplingParams(), images, request_id)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"engine {self.name} is closed")
            if seq.id in self._live:
                raise ValueError(f"request id {seq.id!r} is already in flight; use a unique id per request")
            self._live[seq.id] = seq
            self._incoming.append(seq)
            self._cv.notify_all()
        return seq.future

    def generate(self, token_ids, sampling=None, images=None, request_id=None) -> GenerationResult:
        fut = self.submit(token_ids, sampling, images, request_id)
        if self._thread is None:
            while not fut.done():
                self.step()
        return fut.result()

    async def agenerate(self, token_ids, sampling=None, images=None, request_id=None) -> GenerationResult:
        fut = self.submit(token_ids, sampling, images, request_id)
        if self._thread is None:  # cooperative: whichever coroutine runs next drives a step for all
            while not fut.done():
                self.step()
                await asyncio.sleep(0)
        return await asyncio.wrap_future(fut)

    def update_weights(self, update: WeightUpdate) -> int:
        if not isinstance(update, WeightUpdate):
            raise TypeError(f"update_weights expects a k3rl.WeightUpdate, got {type(update).__name__}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._updates.append((update, fut))
            self._cv.notify_all()
        if self._thread is None:
            self.step()
        return fut.result()

    @property
    def device_lock(self) -> threading.Lock:
        """The lock every CUDA graph capture of the engine holds (`decode.CAPTURE_LOCK`). Other code of this
        process that works on the GPU beside the engine (a weight transport's receive: IPC handles opened,
        copies, device syncs) holds it too, so that nothing touches the device while a step captures a
        graph: a device-wide sync from another thread invalidates the capture. Only captures: a receive,
        however slow, never stops the steps that decode (it once held the step lock, and a slow transfer
        spent the running episodes' time budgets)."""
        return CAPTURE_LOCK

    def abort(self, request_id: str) -> bool:
        with self._cv:
            if request_id not in self._live:
                return False
            self._aborts.add(request_id)
            self._cv.notify_all()
        if self._thread is None:
            fut = self._live[request_id].future
            while not fut.done():  # a decoding request is finished by the next decode step
                self.step()
        return True

    def load(self) -> EngineLoad:
        with self._cv:
            waiting = len(self._incoming) + len(self.scheduler.waiting)
            return EngineLoad(running=len(self._live) - waiting, waiting=waiting, version=self.version)

    @property
    def stats(self) -> dict[str, float]:
        """The scheduler's counters: steps, tokens prefilled, decoded, fed by decode steps and found in the
        prefix cache, forwards, steps launched ahead, host seconds per phase."""
        return self.scheduler.stats

    @property
    def decode_append(self) -> int:
        return self.scheduler.prefill.decode_append

    @property
    def prefill_wait_steps(self) -> int:
        return self.scheduler.prefill_wait_steps

    def metrics(self) -> dict[str, float]:
        """Counters since the engine started: tokens prefilled and decoded, prefix-cache hits, host seconds
        per scheduler phase, CUDA graphs captured (recaptures after the state pool grows included) and the
        seconds they took."""
        r, g = self.scheduler.decoder, self.scheduler.prefill.graphs
        p = self.scheduler.prefill
        return {**{k: float(v) for k, v in self.stats.items()}, "graph_captures": float(r.captures),
                "images_encoded": float(p.images_encoded), "vision_s": p.vision_s,
                "capture_s": r.capture_s, "graphs": float(len(r.graphs)),
                **({"prefill_graph_runs": float(g.runs), "prefill_graph_captures": float(g.captures),
                    "prefill_graph_cached_runs": float(g.cached_runs),
                    "prefill_graph_replays": float(g.replays)} if g is not None else {})}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.scheduler.prefill.close()
        err = RuntimeError(f"engine {self.name} was closed before the request finished")
        for seq in list(self._live.values()):
            if not seq.future.done():
                seq.future.set_exception(err)
        self._live.clear()

    # ----- request intake ------------------------------------------------------------------------
    def _make_seq(self, token_ids, params: SamplingParams, images, request_id) -> Seq:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("the prompt is empty; pass at least one token id")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this engine holds at most {self.max_model_len} per "
                             "sequence (max_model_len), prompt plus completion")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling must be a k3rl.SamplingParams, got {type(params).__name__}")
        validate(params, self.config.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer; construct the engine with tokenizer=...")
        images = list(images or [])
        digests = tuple(image_digest(im) for im in images)
        pil = [as_pil(im) for im in images]
        pads = []
        n_pad = sum(1 for t in ids if t == self.config.media_placeholder_token_id)
        if pil:
            pads = [preprocess_media([im], self.config.vision_config).tokens_per_item()[0] for im in pil]
        if n_pad != sum(pads):
            raise ValueError(
                f"the prompt holds {n_pad} <|media_pad|> tokens (id {self.config.media_placeholder_token_id}) but "
                f"{len(pil)} image(s) need {sum(pads)} (per image {pads}); render images with k3rl.chat"
            )
        return Seq(id=request_id or uuid.uuid4().hex, prompt=ids, images=pil, digests=digests, pads_per_image=pads,
                    params=params, seed=request_seed(params.seed), future=concurrent.futures.Future())

    # ----- the scheduler's thread ------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._closed or self._has_work()):
                    self._cv.wait()
                if self._closed:
                    return
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 - a failed step fails its requests, the loop goes on
                self.scheduler.fail_all(e)
                with self._cv:
                    self._live.clear()

    def _has_work(self) -> bool:
        """Whether a step has anything to do: the inbox holds something, or the scheduler does."""
        return bool(self._incoming or self._aborts or self._updates or self.scheduler.has_work())

    def _forget(self, request_id: str) -> None:
        with self._cv:
            self._live.pop(request_id, None)

    @torch.no_grad()
    def step(self) -> None:
        """One engine step: weight updates and aborts from the inbox, then the scheduler's step (the order
        is in `scheduler.py`)."""
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        with self._step_lock, autocast:
            with self._cv:
                updates, self._updates = self._updates, []
                aborts, self._aborts = self._aborts, set()
                self.scheduler.add(self._incoming)
                self._incoming.clear()
            for update, fut in updates:  # 1. only here, between steps: the switch is atomic
                try:
                    version = self.weights.apply(update)
                    self.scheduler.weights_changed()
                    fut.set_result(version)
                except Exception as e:  # noqa: BLE001 - the caller gets the reason, the engine keeps its weights
                    fut.set_exception(e)
            if aborts:  # 2.
                self.scheduler.abort(aborts)
            self.scheduler.step()  # 3-6.
