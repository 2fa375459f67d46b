"""Rollouts: the embedded K3 inference engine, the vLLM adapter, the Ray inference pool,
the episode loop, rollout workers and the trajectory buffer."""

from .buffer import TrajectoryBuffer
from .engine import EmbeddedEngine, EngineLoad, GenerationResult, InferenceEngine
from .episode import EpisodeSpec, run_episode
from .pool import EngineSpec, InferencePool, PoolActor
from .vllm_adapter import VLLMEngine

__all__ = [
    "EmbeddedEngine", "EngineLoad", "EngineSpec", "EpisodeSpec", "GenerationResult", "InferenceEngine",
    "InferencePool", "PoolActor", "TrajectoryBuffer", "VLLMEngine", "run_episode",
]
