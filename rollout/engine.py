"""The embedded K3 engine: `EmbeddedEngine` implements the inference-engine contract
(`engine_contract.py`: `InferenceEngine`, `GenerationResult`, `EngineLoad`, re-exported here) on our
own `K3ForCausalLM` with continuous batching.

One scheduler step (`EmbeddedEngine.step`), always in this order (3 and 4 in `engine_prefill.py`, a
request's state in `engine_seq.py`, 5 and 6 in `engine_sample.py`):
  1. apply a pending weight update (only here, between steps: the switch is atomic),
  2. finish aborted requests (their tokens so far, finish_reason "abort"),
  3. admit waiting requests: reuse the longest cached prefix, or join a prefill of the same
     prompt already in progress (a GRPO group prefills once and forks the state), or start
     a prefill,
  4. prefill: up to `prefill_chunk` prompt tokens per prefilling sequence, `max_prefill_tokens`
     in all (chunked prefill, so a long prompt never stalls the decoding batch for long);
     chunks of equal length from several sequences run as one batched forward,
  5. decode: one forward of the last sampled token of every decoding sequence over the
     preallocated state pool (`state_pool.py`: one slot per sequence, the decoding ones in the
     leading slots), sampling and log-probs on the device, all in one CUDA graph on CUDA
     (`engine_decode.py`); sequences that finished prefill take a free slot,
  6. sample one token for every sequence whose prefill finished in 4, bring the step's tokens
     to the host at once (one `.tolist()`), check stop tokens / stop strings / max tokens; a
     finished sequence keeps its slot for one more decode step (its last token is fed once,
     see below), then it is finished and its slot is refilled from the last occupied one.

On CUDA an eager forward costs its ~2,500 launches (~100 ms of host time for k3-small) whatever
its tokens, and a decode step is one graph: so there (by default) a prompt that extends a cached
prefix by a short tail joins the decoding batch at once and is fed its tail one token per step
(`decode_append`), prefill chunks within that many tokens of each other are cut to the shortest so
they batch (the rest of each is fed), and a prompt that shares a long start with an earlier one (a
system prompt) is prefilled up to the shared part, cached, and the prompts that share it wait for it
(`share_prefix`). Results are the prefill path's, to float rounding.

Overlap (on CUDA by default): step 5 of the next iteration is launched before step 6 reads this
one's tokens, which it takes on the device, so the host's work of 1-4 and 6 runs while the GPU
decodes; results are the same as without it (`_decode_and_sample` says why). A step in flight when
a weight update arrives finishes with the weights it started with, and its tokens say so.

Because logits are computed and sampled within the same step, every token is produced by
exactly one weight version, reported per token in `GenerationResult.versions`. The states of
tokens processed before an update are kept (as in partial rollouts); the prefix cache is
emptied at every update, so a new request never starts from a state of an older version.

Log-probs: `logprobs[i] = log softmax(logits / tau)[token_i]` in fp32 at the request's temperature
tau (1 when greedy) with no top-k / top-p filtering, i.e. the policy's own distribution, exactly
what the learner gives for the same context at the job's temperature (see `rollout/sampling.py`). They
are always returned (one logsumexp per token). The media placeholder id is never sampled.

Routed experts (on request): `routed_experts[i][m]` are the k experts that MoE layer m chose
for completion token i *as an input*, i.e. at token i's position in a training forward of
prompt + completion. The last token is fed through the model once more, in the decode step
after the one that sampled it, before the result is returned (this also leaves a state
covering the whole sequence, offered to the prefix cache for the next turn).

Seeds: a request's n-th token is drawn with the uniform hash(seed, n) (`sampling.py`), so a
seeded request gives the same tokens alone, in any batch, and on any device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import uuid
from collections import deque

import torch

from k3rl.types import SamplingParams, WeightUpdate

from .engine_contract import EngineLoad, FinishReason, GenerationResult, InferenceEngine  # noqa: F401 (re-exported)
from .engine_decode import DecodeRunner, keep_fp32_island_weights
from .engine_prefill import AdmitAndPrefill
from .engine_prefill_graphs import ALIGN, PrefillGraphs
from .engine_sample import DecodeAndSample
from .engine_seq import Launch, Seq, as_pil, image_digest
from .prefix_cache import PrefixCache
from .sampling import request_seed, validate
from .state_pool import StatePool


class EmbeddedEngine(AdmitAndPrefill, DecodeAndSample, InferenceEngine):
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
                     64 on CUDA, where an eager forward costs ~100 ms of launches and a graph step a few,
                     and 0, off, on the CPU). Results are the prefill path's, to float rounding
    share_prefix     a new prompt whose first tokens (at least this many beyond its cached prefix) an
                     earlier prompt shares, e.g. a system prompt and tool schemas that differ only in the
                     task, is prefilled up to the shared part, whose state is cached, and prompts that
                     arrive meanwhile wait for it, then extend it (default 64 on CUDA, 0, off, on the CPU)
    prefill_wait_steps  while a decoding batch runs, a request that needs a prefill forward waits until the
                     oldest such request has waited this many scheduler steps, then they all prefill
                     together: prompts that arrive over several steps (an RL job's first turns, as the
                     envs reset) share one batched forward instead of one eager forward each (default 8
                     on CUDA: the RL job on an H200 1.3-1.5x the episodes/s, BENCHMARKS.md; 0, off, on the
                     CPU; with nothing decoding a prefill never waits). Results are unchanged
    overlap          launch decode step t+1 before step t's tokens reach the host (they are fed on the
                     device), so the scheduler's Python runs while the GPU decodes (default: on CUDA).
                     Every result is the same as without it (see `_decode_and_sample`)
    compile_decode   run each decode step's layers through `torch.compile` (regional; DecodeRunner): fewer,
                     fused kernels a step (k3-small on an H200 at batch 64: 3.93 -> 3.11 ms a step, BENCHMARKS.md).
                     Off by default: each new shape's first step compiles (about a minute on a GPU the first
                     time, longer on a CPU)
    prefill_graphs   prefill chunks without images, cut to a multiple of 16 tokens (a prompt's last < 16
                     fed by decode steps), run through CUDA graphs per (row rung, tokens, context rung):
                     a fresh prompt's first chunk, and a chunk after a cached prefix (a conversation's
                     next turn) (engine_prefill_graphs.py). Default: on for CUDA without enforce_eager (the RL
                     job on an H200 1.28-1.35x the episodes/s, BENCHMARKS.md); off on the CPU, where set on the
                     same bucketing runs eagerly
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
        if max_prefill_tokens is None:  # a CUDA forward costs its launches (~100 ms eager) more than its tokens
            max_prefill_tokens = 8192 if str(model.lm_head.weight.device).startswith("cuda") else 2048
        if max_num_seqs < 1 or prefill_chunk < 1 or max_prefill_tokens < 1:
            raise ValueError("max_num_seqs, prefill_chunk and max_prefill_tokens must be >= 1")
        cuda = str(model.lm_head.weight.device).startswith("cuda")
        if prefill_wait_steps is None:
            prefill_wait_steps = 8 if cuda else 0
        if prefill_wait_steps < 0:
            raise ValueError(f"prefill_wait_steps must be >= 0, got {prefill_wait_steps}")
        self.prefill_wait_steps = prefill_wait_steps
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {autocast_dtype!r}")
        if tokenizer is None:
            from k3rl.tokenizer import ByteTokenizer

            tokenizer = ByteTokenizer()
        self.model = model.eval()
        keep_fp32_island_weights(model)
        self.config = model.config
        self.tokenizer = tokenizer
        self.device = model.lm_head.weight.device
        self.autocast_dtype = autocast_dtype
        self.vocab_size = self.config.vocab_size
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        if prefix_cache_size is None:
            prefix_cache_size = max(32, 2 * max_num_seqs) if self.device.type == "cuda" else 32
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.name = name
        self._version = version
        self._lora_base: dict[str, torch.Tensor] | None = None  # unmerged weights under LoRA adapters syncs
        self._cv = threading.Condition()
        self._incoming: deque[Seq] = deque()
        self._aborts: set[str] = set()
        self._updates: list[tuple[WeightUpdate, concurrent.futures.Future]] = []
        self._live: dict[str, Seq] = {}
        self._closed = False
        # scheduler-owned state
        self._waiting: deque[Seq] = deque()
        self._prefilling: list[Seq] = []
        self._decoding: list[Seq] = []  # in the state pool, seq i in slot i; each has a token to feed
        self._pool = StatePool(model, max_num_seqs, self.max_model_len, dtype=autocast_dtype)
        self._runner = DecodeRunner(model, self._pool, banned=self.config.media_placeholder_token_id,
                                    use_graphs=not enforce_eager, compile=compile_decode)
        self._pending_ready: list[Seq] = []  # admitted with the whole prompt cached: sample this step
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        if prefill_graphs is None:
            prefill_graphs = self.device.type == "cuda" and not enforce_eager
        if decode_append is None:  # prefill graphs feed their prompts' tails by decode steps, on the CPU too
            decode_append = 64 if self.device.type == "cuda" or prefill_graphs else 0
        self.decode_append = decode_append
        self._feeders: list[Seq] = []  # admitted to decode_append: join the pool this step
        if prefill_graphs and self.decode_append < ALIGN - 1:
            raise ValueError(f"prefill_graphs feeds up to {ALIGN - 1} prompt tokens by decode steps: it needs "
                             f"decode_append >= {ALIGN - 1}, got {self.decode_append}")
        # the prompt tokens fed by decode steps at most: with prefill graphs, what no graph's bucket covers
        self._feed_max = ALIGN - 1 if prefill_graphs else self.decode_append
        self._prefill_graphs = (PrefillGraphs(model, autocast_dtype, prefill_chunk, use_graphs=not enforce_eager,
                                              max_context=self.max_model_len)
                                if prefill_graphs else None)
        share_prefix = (64 if self.device.type == "cuda" else 0) if share_prefix is None else share_prefix
        self._prefix = PrefixCache(prefix_cache_size, share_prefix, self.config.media_placeholder_token_id)
        self._inflight: Launch | None = None  # a decode step launched ahead, its rows not yet read
        self._step_lock = threading.Lock()
        # host seconds per phase of `step` (a CUDA phase's time is its launches plus what it waits for)
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "prefix_hit_tokens": 0,
                      "launched_ahead": 0, "fed_prompt_tokens": 0, "prefill_forwards": 0, "prefill_s": 0.0, "decode_s": 0.0, "admit_s": 0.0}
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
        dequantised to `dtype`, or what `save_hf` wrote)."""
        from k3rl.model import build_model

        return cls(build_model(preset, overrides, dtype=dtype, device=device, seed=seed, checkpoint=checkpoint), **kw)

    # ----- contract ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

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
        """The lock the scheduler holds through every step. Other code of this process that works on
        the GPU beside the engine (a weight transport's receive: IPC handles opened, copies, device
        syncs) holds it too, so that nothing touches the device while a step captures a CUDA graph:
        a device-wide sync from another thread invalidates the capture."""
        return self._step_lock

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
            waiting = len(self._incoming) + len(self._waiting)
            return EngineLoad(running=len(self._live) - waiting, waiting=waiting, version=self._version)

    def metrics(self) -> dict[str, float]:
        """Counters since the engine started: tokens prefilled and decoded, prefix-cache hits, host seconds
        per scheduler phase, CUDA graphs captured (recaptures after the state pool grows included) and the
        seconds they took."""
        r, g = self._runner, self._prefill_graphs
        return {**{k: float(v) for k, v in self.stats.items()}, "graph_captures": float(r.captures),
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
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this engine holds at most {self.max_model_len} per "
                             "sequence (max_model_len), prompt plus completion")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling must be a k3rl.SamplingParams, got {type(params).__name__}")
        validate(params, self.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer; construct the engine with tokenizer=...")
        images = list(images or [])
        digests = tuple(image_digest(im) for im in images)
        pil = [as_pil(im) for im in images]
        pads = []
        n_pad = sum(1 for t in ids if t == self.config.media_placeholder_token_id)
        if pil:
            from k3rl.model import preprocess_media

            pads = [preprocess_media([im], self.config.vision_config).tokens_per_item()[0] for im in pil]
        if n_pad != sum(pads):
            raise ValueError(
                f"the prompt holds {n_pad} <|media_pad|> tokens (id {self.config.media_placeholder_token_id}) but "
                f"{len(pil)} image(s) need {sum(pads)} (per image {pads}); render images with k3rl.chat"
            )
        return Seq(id=request_id or uuid.uuid4().hex, prompt=ids, images=pil, digests=digests, pads_per_image=pads,
                    params=params, seed=request_seed(params.seed), future=concurrent.futures.Future())

    # ----- scheduler ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._closed or self._incoming or self._aborts or self._updates or self._has_work()):
                    self._cv.wait()
                if self._closed:
                    return
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 - a failed step fails its requests, the loop goes on
                self._fail_all(e)

    def _has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._decoding or self._feeders)

    def _fail_all(self, error: BaseException) -> None:
        followers = [f for p in self._prefilling for f in p.followers]
        for seq in [*self._waiting, *self._prefilling, *followers, *self._decoding, *self._pending_ready, *self._feeders]:
            if not seq.future.done():
                seq.future.set_exception(error)
        with self._cv:
            self._live.clear()
        self._waiting.clear()
        self._prefilling.clear()
        self._pending_ready.clear()
        self._feeders.clear()
        self._inflight = None
        for s in self._decoding:
            self._pool.free(s.slot)
        self._decoding.clear()

    @torch.no_grad()
    def step(self) -> None:
        """One scheduler iteration (see the module docstring)."""
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        with self._step_lock, autocast:
            with self._cv:
                updates, self._updates = self._updates, []
                aborts, self._aborts = self._aborts, set()
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            for update, fut in updates:
                try:
                    fut.set_result(self._apply_update(update))
                except Exception as e:  # noqa: BLE001 - the caller gets the reason, the engine keeps its weights
                    fut.set_exception(e)
            if aborts:
                self._abort(aborts)
            t0 = time.perf_counter()
            self._admit()
            t1 = time.perf_counter()
            ready = self._prefill()
            t2 = time.perf_counter()
            if ready or self._decoding or self._inflight or self._feeders:
                self._decode_and_sample(ready)
            st = self.stats
            st["steps"] += 1
            st["admit_s"] += t1 - t0
            st["prefill_s"] += t2 - t1
            st["decode_s"] += time.perf_counter() - t2

    # 1. weights
    def _apply_update(self, update: WeightUpdate) -> int:
        from k3rl.model.state_dict_adapter import from_hf

        if update.version <= self._version:
            raise ValueError(f"weight update v{update.version} is not newer than the engine's v{self._version}; "
                             "versions must increase")
        merged = self._merge_lora_adapters(update)
        new_base, update = merged is update and update.full, merged
        expected = self.model.state_dict()
        # a partial update may carry some experts of a layer (the others keep their values); a
        # full one must carry all of them, so nothing is filled in and the gaps are reported.
        # Experts come as `.weight` or as MXFP4 `.weight_packed` + `.weight_scale` (dequantised here)
        state, unexpected = from_hf(update.state_dict(), expected, fill_missing_experts=not update.full)
        if unexpected:
            raise ValueError(f"weight update v{update.version} has {len(unexpected)} names the model does not have, "
                             f"e.g. {unexpected[:3]}; send official HF names (state_dict_adapter.to_hf)")
        for name, t in state.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                raise ValueError(f"weight update v{update.version}: {name} has shape {tuple(t.shape)}, the model "
                                 f"expects {tuple(expected[name].shape)}")
        if update.full:
            missing = sorted(set(expected) - set(state))
            if missing:
                raise ValueError(f"weight update v{update.version} is marked full but lacks {len(missing)} tensors, "
                                 f"e.g. {missing[:3]}; send them or set full=False")
        # validated: now copy everything (nothing runs in between, so the switch is atomic)
        for name, t in state.items():
            expected[name].copy_(t.to(device=expected[name].device, dtype=expected[name].dtype))
        self._version = update.version
        if new_base:
            self._lora_base = None  # whole new weights: later LoRA adapters are merged into these
        self._prefix.clear()  # states of the old version must not seed new requests
        return self._version

    def _merge_lora_adapters(self, update: WeightUpdate) -> WeightUpdate:
        """An adapters-only update (learner.lora.sync: adapters) as the weights it stands for,
        W + (alpha / r) B A, with W the engine's weights from before the first adapters update
        (kept aside then: each version is merged into the base, never into merged weights).
        Any other update is returned as it is."""
        from k3rl.model.lora import is_adapter_update, lora_targets, merge_adapters
        from k3rl.model.state_dict_adapter import to_hf

        adapters = update.state_dict()
        if not is_adapter_update(adapters):
            return update
        if self._lora_base is None:
            weights = to_hf(self.model.state_dict(), experts="dense")
            self._lora_base = {n: weights[n].clone() for n in lora_targets(adapters) if n in weights}
        merged = merge_adapters(self._lora_base, adapters)
        return WeightUpdate.from_state_dict(update.version, merged, full=False, transport=update.transport)

    # 2. aborts
    def _abort(self, ids: set[str]) -> None:
        for queue in (self._waiting, self._feeders):
            for s in [s for s in queue if s.id in ids]:
                queue.remove(s)
                self._finish(s, "abort")
        for leader in list(self._prefilling):
            for f in [f for f in leader.followers if f.id in ids]:
                leader.followers.remove(f)
                self._finish(f, "abort")
            if leader.id in ids:
                if leader.followers:  # the first follower takes over the prefill of the group
                    heir, rest = leader.followers[0], leader.followers[1:]
                    heir.leader, heir.followers, heir.cache, heir.computed = None, rest, leader.cache, leader.computed
                    heir.image_cursor, heir.cached_prompt_tokens = leader.image_cursor, leader.cached_prompt_tokens
                    heir.state_version = leader.state_version
                    for f in rest:
                        f.leader = heir
                    self._prefilling[self._prefilling.index(leader)] = heir
                else:
                    self._prefilling.remove(leader)
                leader.followers = []
                self._finish(leader, "abort")
        aborted = [s for s in self._decoding if s.id in ids and not s.flushing]
        for s in aborted:
            s.finish = "abort"
        self._finish_decoding(aborted)  # their last sampled token is fed once, as for any finished sequence
