"""The embedded K3 engine: continuous batching on our own `K3ForCausalLM`, behind the inference-engine
contract (`contract.py`) that the vLLM adapter implements too.

Its parts, each an object with its own state, and who calls whom:

  EmbeddedEngine   embedded.py        the contract (submit, generate, abort, update_weights, load); the inbox
                                      that hands requests, aborts and updates to the scheduler's thread
    VersionedWeights  weights.py      the model's weights and their version; updates applied between steps
    Scheduler      scheduler.py       owns the sequences (waiting, prefilling, decoding) and runs the step:
                                      admission, prefill, decode and sample, results; it calls
      PrefixCache    prefix_cache.py  states of prompts already computed, for prompts that extend them
      PrefillRunner  prefill.py       plans prompt chunks into forwards and runs them (PrefillGraphs,
                                      prefill_graphs.py, on CUDA)
      DecodeRunner   decode.py        one decode step over the state pool, sampled on the device (CUDA graphs)
      Sampler        sampler.py       a sequence's first token after its prefill; the stop rules
      StatePool      state_pool.py    the decoding sequences' preallocated KDA states and MLA latents

A request inside the engine is a `Seq` (seq.py); `sampling.py` is the sampling arithmetic, shared by
the sampler and the decode step.
"""

from __future__ import annotations

from .contract import EngineLoad, FinishReason, GenerationResult, InferenceEngine

__all__ = ["EmbeddedEngine", "EngineLoad", "FinishReason", "GenerationResult", "InferenceEngine"]


def __getattr__(name: str):
    """EmbeddedEngine on first use: the contract's types come without torch and the model (a rollout
    worker's episode loop needs GenerationResult, not the engine)."""
    if name == "EmbeddedEngine":
        from .embedded import EmbeddedEngine  # deferred: imports torch and the model

        return EmbeddedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
