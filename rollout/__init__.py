"""Rollouts: the embedded K3 inference engine, the vLLM adapter, the Ray inference pool,
the episode loop, rollout workers and the trajectory buffer.

The names below are imported on first use, so importing one submodule does not pull in the others: a
Ray actor of the trajectory buffer or the pool's router imports neither torch nor the engine.
"""

from __future__ import annotations

from k3rl.lazy import lazy_getattr

_EXPORTS = {
    "TrajectoryBuffer": "buffer",
    "EmbeddedEngine": "engine",
    "EngineLoad": "engine",
    "GenerationResult": "engine",
    "InferenceEngine": "engine",
    "EpisodeSpec": "episode",
    "run_episode": "episode",
    "EngineSpec": "pool",
    "InferencePool": "pool",
    "PoolActor": "pool",
    "VLLMEngine": "vllm_adapter",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
