"""The InferenceEngine contract on vLLM (`pip install k3rl[vllm]`).

When to use which engine:
  * `EmbeddedEngine` (default): our own K3 code, CPU or one GPU, exact to the learner's
    forward (same modules, fp32 log-probs), returns routed experts for routing replay, keeps
    decoding across weight updates (partial rollouts, a version per token). Use it for
    development, tests, small models, and whenever exactness matters more than throughput.
  * `VLLMEngine`: vLLM's paged, CUDA-graph, tensor-parallel engine. Use it for large models
    and high-throughput rollouts on GPU clusters, with a vLLM that implements the Kimi-K3
    architecture natively.

What the adapter does:
  * serves an HF-layout K3 checkpoint directory (`config.json` + safetensors: what
    `k3rl.model.save_hf` writes), token ids in (`TokensPrompt`), token ids and
    per-token log-probs out (`logprobs=0`: the sampled token only, `logprobs_mode=
    "raw_logprobs"`, i.e. log-softmax of the raw logits at temperature 1, unfiltered: the
    same distribution as the embedded engine reports);
  * registers the architecture through vLLM's out-of-tree registry when the installed vLLM
    lacks it (`register_k3_architecture`). The registered class `K3ForVLLM` runs our own
    `K3ForCausalLM` with its decoding cache. It keeps one sequence's state, so it is only
    correct with `max_num_seqs=1`, no prefix caching and eager mode, which the adapter sets:
    a correctness fallback, not a fast path;
  * vLLM starts its engine in other processes: for them to see the registration, the package
    declares `register_k3_architecture` as a `vllm.general_plugins` entry point;
  * updates weights through vLLM's worker-extension RPC: `collective_rpc("k3rl_load_weights",
    args=(PackedUpdate.to_wire(),))` (plain lists and numpy byte arrays, which vLLM's msgpack
    serialiser carries) calls `model.load_weights(...)` on every worker with the official
    HF names. The switch drains first: new requests wait, running ones finish, then the
    weights change, so a request never spans two versions (vLLM has no per-token version).
  * routed experts are not available from vLLM: requesting them raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k3rl.images import from_png
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.state_dict_adapter import from_hf
from k3rl.types import SamplingParams, WeightUpdate

from .engine import EngineLoad, GenerationResult, InferenceEngine
from .transport.packing import PackedUpdate

K3_ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiK3ForCausalLM")


def vllm_available() -> bool:
    try:
        # optional dependency (k3rl[vllm]): the check itself
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _require_vllm():
    try:
        # optional dependency (k3rl[vllm])
        import vllm
    except ImportError as e:
        raise ImportError("the vLLM engine needs vLLM: pip install 'k3rl[vllm]' (on a CUDA machine), "
                          "or use the embedded engine (rollout.engine: embedded)") from e
    return vllm


# ----------------------------------------------------------------------------------------------
# sampling params and outputs (plain functions, independent of vLLM's classes)
# ----------------------------------------------------------------------------------------------


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Our SamplingParams -> keyword arguments of `vllm.SamplingParams`."""
    if params.return_routed_experts:
        raise ValueError("the vLLM engine cannot return routed experts; use the embedded engine for routing "
                         "replay, or set learner.routing_replay: false")
    return {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # vLLM: -1 (or 0 in newer releases) disables
        "max_tokens": params.max_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop_strings) or None,
        "include_stop_str_in_output": True,  # token in, token out: keep every sampled token
        "seed": params.seed,
        "logprobs": 0 if params.logprobs else None,  # 0: the sampled token's log-prob only
        "detokenize": bool(params.stop_strings),
        "skip_special_tokens": False,
        "ignore_eos": True,  # stop only on what the request names (the chat template's <|end_of_msg|>)
    }


def result_from_output(request_id: str, prompt_len: int, completion: Any, version: int, stop_ids: list[int],
                       aborted: bool = False) -> GenerationResult:
    """One `vllm.CompletionOutput` -> GenerationResult (log-probs of the sampled tokens)."""
    ids = list(completion.token_ids)
    logprobs: list[float] = []
    for tok, entry in zip(ids, completion.logprobs or [], strict=False):
        lp = entry[tok]
        logprobs.append(float(getattr(lp, "logprob", lp)))
    if completion.logprobs is not None and len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
    reason = completion.finish_reason
    stop_reason = completion.stop_reason
    if aborted or reason == "abort":
        finish = "abort"
    elif reason == "stop" or (ids and ids[-1] in stop_ids):
        finish = "stop"
        if stop_reason is None and ids and ids[-1] in stop_ids:
            stop_reason = ids[-1]
    else:
        finish = "length"
    return GenerationResult(request_id=request_id, token_ids=ids, logprobs=logprobs, versions=[version] * len(ids),
                            finish_reason=finish, prompt_tokens=prompt_len, stop_reason=stop_reason)


# ----------------------------------------------------------------------------------------------
# out-of-tree architecture (fallback when vLLM has no Kimi-K3 of its own)
# ----------------------------------------------------------------------------------------------


class K3ForVLLM(nn.Module):
    """vLLM model interface around `K3ForCausalLM` (one sequence at a time, eager).

    vLLM calls `forward(input_ids, positions)` with the new tokens of the running sequence;
    position 0 starts a new sequence (a fresh K3Cache), later chunks continue the cache.
    `forward` returns the logits, which `compute_logits` passes through. The model keeps its
    own state, so vLLM must not allocate paged KV for it (`is_attention_free`).
    """

    is_attention_free = True  # vLLM's IsAttentionFree marker: no paged KV cache for this class

    def __init__(self, *, vllm_config=None, prefix: str = "", config=None):
        super().__init__()
        if config is None:
            hf = vllm_config.model_config.hf_config
            raw = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
            config = K3Config.from_hf_dict(raw)
            sched = getattr(vllm_config, "scheduler_config", None)
            if sched is not None and getattr(sched, "max_num_seqs", 1) != 1:
                raise ValueError("the k3rl fallback K3 model for vLLM holds one sequence: start vLLM with "
                                 "max_num_seqs=1 (VLLMEngine does), or use a vLLM with native Kimi-K3 support")
        self.k3 = K3ForCausalLM(config)
        self._cache = None
        self._next_position = 0

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.k3.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **_: Any) -> torch.Tensor:
        ids = input_ids.reshape(1, -1)
        start = int(positions.reshape(-1)[0])
        if start == 0 or self._cache is None or start != self._next_position:
            if start != 0:
                raise RuntimeError(f"K3ForVLLM: vLLM continued a sequence at position {start} but the cache is at "
                                   f"{self._next_position}; disable prefix caching (VLLMEngine does)")
            self._cache = self.k3.new_cache(1)
        logits = self.k3(ids, cache=self._cache)
        self._next_position = start + ids.shape[1]
        return logits[0]

    def compute_logits(self, hidden_states: torch.Tensor, *_: Any) -> torch.Tensor:
        return hidden_states  # forward already returned logits

    def load_weights(self, weights) -> set[str]:
        expected = self.k3.state_dict()
        state, unexpected = from_hf(dict(weights), expected)
        if unexpected:
            raise ValueError(f"K3ForVLLM.load_weights: {len(unexpected)} unknown tensors, e.g. {unexpected[:3]}")
        with torch.no_grad():
            for name, t in state.items():
                expected[name].copy_(t.to(expected[name].device, expected[name].dtype))
        return {f"k3.{n}" for n in state}


def register_k3_architecture() -> bool:
    """Register `K3ForVLLM` for the Kimi-K3 architecture names the installed vLLM lacks.

    Returns True when something was registered (False: vLLM already supports Kimi-K3)."""
    vllm = _require_vllm()
    _register_hf_config()
    registry = vllm.ModelRegistry
    supported = set(registry.get_supported_archs())
    added = False
    for arch in K3_ARCHITECTURES:
        if arch not in supported:
            registry.register_model(arch, "k3rl.rollout.vllm_adapter:K3ForVLLM")  # lazy: no CUDA at import
            added = True
    return added


def _register_hf_config() -> None:
    """Let transformers' AutoConfig (which vLLM uses to read config.json) parse model_type kimi_k3."""
    # optional dependency: transformers comes with vLLM
    from transformers import AutoConfig, PretrainedConfig

    try:
        AutoConfig.for_model("kimi_k3")
        return  # transformers (or a plugin) already knows it
    except ValueError:
        pass

    class KimiK3Config(PretrainedConfig):
        model_type = "kimi_k3"  # every key of config.json is kept as an attribute (to_dict gives it back)

    AutoConfig.register("kimi_k3", KimiK3Config)


class K3WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`): receives k3rl weight updates."""

    def k3rl_load_weights(self, wire: dict) -> int:
        update = PackedUpdate.from_wire(wire).to_update()
        self.model_runner.model.load_weights(weights=list(update.state_dict().items()))
        return update.version


# ----------------------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------------------


class VLLMEngine(InferenceEngine):
    """InferenceEngine on vLLM's asynchronous engine (runs its own event loop in a thread)."""

    def __init__(self, checkpoint: str | Path, *, dtype: str = "bfloat16", seed: int = 0, version: int = 0,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85, max_model_len: int | None = None,
                 max_num_seqs: int = 256, name: str = "vllm", engine_args: dict[str, Any] | None = None):
        vllm = _require_vllm()
        path = Path(checkpoint)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json; save the model with k3rl.model.save_hf")
        fallback = register_k3_architecture()
        args = {
            "model": str(path),
            "dtype": dtype,
            "seed": seed,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_num_seqs": max_num_seqs,
            "skip_tokenizer_init": not (path / "tokenizer.json").exists(),
            "logprobs_mode": "raw_logprobs",
            "worker_extension_cls": "k3rl.rollout.vllm_adapter.K3WorkerExtension",
        }
        if max_model_len:
            args["max_model_len"] = max_model_len
        if fallback:  # our one-sequence fallback model: see K3ForVLLM
            args.update(max_num_seqs=1, enable_prefix_caching=False, enforce_eager=True)
        args.update(engine_args or {})
        self.name = name
        self.has_tokenizer = not args["skip_tokenizer_init"]
        self.max_model_len = max_model_len or json.loads((path / "config.json").read_text()).get(
            "text_config", {}).get("max_position_embeddings")
        self._version = version
        self._inflight: dict[str, concurrent.futures.Future] = {}
        self._running = 0  # requests inside vLLM (touched only on the engine's event loop)
        self._aborted: set[str] = set()
        self._idle = None  # asyncio.Event, set when nothing is in flight
        self._gate = None  # asyncio.Lock held during a weight switch
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        self._ids = itertools.count()

        async def build():
            # optional dependency (k3rl[vllm])
            from vllm.engine.arg_utils import AsyncEngineArgs

            self._idle, self._gate = asyncio.Event(), asyncio.Lock()
            self._idle.set()
            engine_cls = vllm.AsyncLLMEngine
            return engine_cls.from_engine_args(AsyncEngineArgs(**args))

        self.engine = asyncio.run_coroutine_threadsafe(build(), self._loop).result()

    @property
    def version(self) -> int:
        return self._version

    def submit(self, token_ids, sampling=None, images=None, request_id=None) -> concurrent.futures.Future:
        sampling = sampling or SamplingParams()
        if sampling.stop_strings and not self.has_tokenizer:
            raise ValueError("stop_strings need a tokenizer.json in the checkpoint directory; pass stop_token_ids")
        request_id = request_id or f"{self.name}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        fut = asyncio.run_coroutine_threadsafe(self._generate(list(token_ids), sampling, images, request_id), self._loop)
        self._inflight[request_id] = fut
        fut.add_done_callback(lambda _: self._inflight.pop(request_id, None))
        return fut

    async def _generate(self, ids: list[int], sampling: SamplingParams, images, request_id: str) -> GenerationResult:
        # optional dependency (k3rl[vllm])
        from vllm import SamplingParams as VSamplingParams

        # optional dependency (k3rl[vllm])
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=ids)
        if images:
            prompt["multi_modal_data"] = {"image": [from_png(bytes(im)) if isinstance(im, (bytes, bytearray)) else im
                                                    for im in images]}
        params = VSamplingParams(**sampling_kwargs(sampling))
        async with self._gate:  # wait while a weight switch is in progress
            self._running += 1
            self._idle.clear()
        version = self._version
        final = None
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                final = out
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
        aborted = request_id in self._aborted
        self._aborted.discard(request_id)
        if final is None:
            if aborted:
                return GenerationResult(request_id=request_id, token_ids=[], logprobs=[], versions=[],
                                        finish_reason="abort", prompt_tokens=len(ids))
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        return result_from_output(request_id, len(ids), final.outputs[0], version, sampling.stop_token_ids,
                                  aborted=aborted)

    def update_weights(self, update: WeightUpdate) -> int:
        if update.version <= self._version:
            raise ValueError(f"weight update v{update.version} is not newer than the engine's v{self._version}")
        packed = PackedUpdate.pack(update)

        async def switch():
            async with self._gate:  # no new request starts...
                await self._idle.wait()  # ...and the running ones finish: the switch is atomic
                await self.engine.collective_rpc("k3rl_load_weights", args=(packed.to_wire(),))
                if hasattr(self.engine, "reset_prefix_cache"):
                    await self.engine.reset_prefix_cache()  # states of the old version must not be reused
                self._version = update.version
            return self._version

        return asyncio.run_coroutine_threadsafe(switch(), self._loop).result()

    def abort(self, request_id: str) -> bool:
        if request_id not in self._inflight:
            return False
        self._aborted.add(request_id)
        asyncio.run_coroutine_threadsafe(self.engine.abort(request_id), self._loop).result()
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._inflight), waiting=0, version=self._version)

    def close(self) -> None:
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
