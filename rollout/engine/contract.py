"""The inference-engine contract: what rollout workers talk to (`EmbeddedEngine` in `embedded.py`, the
vLLM adapter in `rollout/vllm_adapter.py`): token ids in, token ids plus per-token log-probs (plus, on
request, routed experts) out, versioned weight updates."""

from __future__ import annotations

import asyncio
import concurrent.futures
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from k3rl.types import SamplingParams, WeightUpdate

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class GenerationResult:
    """What one `generate` call returns. Lists run over the generated tokens only."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    routed_experts: list[list[list[int]]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cached_prompt_tokens: int = 0  # prompt tokens whose state came from the prefix cache / a group fork
    worker: str | None = None  # set by InferencePool: which worker served it

    @property
    def version(self) -> int:
        """The newest version that produced a token (-1 when no token was produced)."""
        return max(self.versions, default=-1)


@dataclass
class EngineLoad:
    running: int
    waiting: int
    version: int

    @property
    def total(self) -> int:
        return self.running + self.waiting


class InferenceEngine(ABC):
    """Token in, token out, versioned weights.

    Implementations provide `submit` (non-blocking, returns a concurrent Future);
    `generate` (blocking) and `agenerate` (asyncio: many coroutines share one engine) are
    built on it.
    """

    @property
    @abstractmethod
    def version(self) -> int: ...

    @abstractmethod
    def submit(self, token_ids: list[int], sampling: SamplingParams | None = None, images: list | None = None,
               request_id: str | None = None) -> concurrent.futures.Future: ...

    @abstractmethod
    def update_weights(self, update: WeightUpdate) -> int:
        """Apply `update` between two scheduler steps; returns the new version once applied."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Finish a request early (finish_reason 'abort'); False when it is unknown or already done."""

    @abstractmethod
    def load(self) -> EngineLoad: ...

    def generate(self, token_ids: list[int], sampling: SamplingParams | None = None, images: list | None = None,
                 request_id: str | None = None) -> GenerationResult:
        return self.submit(token_ids, sampling, images, request_id).result()

    async def agenerate(self, token_ids: list[int], sampling: SamplingParams | None = None, images: list | None = None,
                        request_id: str | None = None) -> GenerationResult:
        return await asyncio.wrap_future(self.submit(token_ids, sampling, images, request_id))

    async def aupdate_weights(self, update: WeightUpdate) -> int:
        return await asyncio.get_running_loop().run_in_executor(None, self.update_weights, update)

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
