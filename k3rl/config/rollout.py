"""`rollout:` the engines, the rollout workers, sampling and the context strategy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import _Section


class SamplingSection(_Section):
    temperature: float = Field(1.0, ge=0.0, description="the policy is softmax(logits / temperature): the engines "
                               "sample and report log-probs at it, the learner trains it (0: greedy, the policy at 1)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens_per_turn: int = Field(64, ge=1)

    @property
    def policy_temperature(self) -> float:
        """tau of the trained policy softmax(logits / tau): the sampling temperature, 1 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0


class ContextSection(_Section):
    """What the episode loop does when an episode's context nears rollout.max_context_tokens
    (rollout/context.py has the rules; each compaction starts a new token-exact segment)."""

    strategy: Literal["none", "drop_tool_outputs", "summarize"] = Field(
        "none", description="none: the episode is truncated when the context is full; drop_tool_outputs: tool "
                            "outputs (and images) older than the last keep_last_turns turns become a placeholder; "
                            "summarize: the policy writes a summary and the next segment starts from the task, "
                            "the summary and the last keep_last_turns turns")
    keep_last_turns: int = Field(1, ge=0, description="turns (an assistant message and its replies) kept whole")
    compact_at: float = Field(0.7, gt=0, le=1, description="compact when the context reaches this share of "
                                                           "rollout.max_context_tokens (the rest is room for the "
                                                           "last reply and the summary)")
    summary_request: str = Field(
        "The context is nearly full and will be cut. Summarise your progress: the facts you still need, exactly, "
        "and what is left to do. Reply without a tool call.", min_length=1,
        description="summarize: the user message that asks the policy for its summary")
    summary_intro: str = Field("Summary of your progress (earlier messages were removed):\n",
                               description="summarize: what precedes the summary in the next segment's user message")


class RolloutSection(_Section):
    engine: Literal["embedded", "vllm"] = "embedded"
    num_inference_workers: int = Field(1, ge=1)
    num_rollout_workers: int = Field(1, ge=1)
    episodes_per_worker: int = Field(8, ge=1, description="episodes one rollout worker runs at once")
    group_size: int = Field(4, ge=1, description="samples per prompt (GRPO group)")
    prompts_per_step: int = Field(8, ge=1)
    max_policy_lag: int = Field(1, ge=0, description="0 = synchronous on-policy")
    partial_rollouts: bool = True
    stragglers: Literal["wait", "drop"] = Field(
        "wait", description="a group the lag bound lets train only at this step (issued at version <= step - lag) "
                            "but still running: wait (the step waits for it; long episodes train as often as short "
                            "ones) or drop (the step takes P groups that finished first and the straggler is "
                            "dropped as stale when it ends: no waiting, but a bias against long episodes)")
    max_context_tokens: int = Field(2048, ge=16)
    context: ContextSection = Field(default_factory=ContextSection)
    max_batch_sequences: int = Field(64, ge=1, description="sequences one engine decodes together")
    compile_decode: bool = Field(
        False, description="embedded engine: torch.compile each decode step's layers (fewer, fused kernels; "
                           "the first step of each new shape compiles, about a minute on a GPU)")
    prefill_graphs: bool | None = Field(
        None, description="embedded engine: prefill chunks without images (multiples of 16 tokens; a prompt's last "
                          "< 16 fed by decode steps) through CUDA graphs, fresh or after a cached prefix (default: "
                          "on a GPU; false: every chunk an eager forward)")
    prefill_wait_steps: int | None = Field(
        None, ge=0, description="embedded engine: while it decodes, a request needing a prefill forward waits until "
                                "the oldest such has waited this many steps, then they prefill together (one batched "
                                "forward instead of one each; 0 = never wait; default: 8 on a GPU, 0 on the CPU)")
    gpus_per_inference_worker: float = Field(0.0, ge=0.0)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    weight_sync_timeout_s: float = Field(
        300.0, gt=0, description="a broadcast (nccl) not finished by then fails; that update then goes through the object store")
    weight_transport: Literal["object_store", "nccl", "cuda_ipc"] = Field(
        "object_store",
        description="how each WeightUpdate reaches the engines: object_store (any cluster), nccl (a broadcast "
                    "group of the learner's rank 0 and the engines, on their own GPUs; gloo when all run on CPUs), "
                    "cuda_ipc (engines sharing the learner's GPU host)")
    dynamic_sampling: bool = Field(
        False, description="drop a finished group whose trainable members all earned the same reward (no GRPO "
                           "signal) and issue a fresh group in its place (DAPO's dynamic sampling)")
    dynamic_sampling_max_refills: int = Field(
        2, ge=0, description="at most this many x prompts_per_step groups are dropped for zero variance per step; "
                             "past that the step trains on the groups it has (dynamic_sampling/refills_exhausted)")
