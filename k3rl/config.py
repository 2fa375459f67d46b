"""One job configuration: `JobConfig`, loaded from YAML with `--set a.b.c=value` overrides.

Unknown keys, bad values and combinations of fields that cannot work together are rejected
before anything starts, each with the dotted path of the field and what to change
(`ConfigError`). Combinations that work but may surprise are listed by `JobConfig.notes()`.
The validated config (every default filled in) is what gets printed, saved next to a run and
logged to MLflow as params.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FieldProblems(ValueError):
    """Raised by a cross-field check: (dotted path relative to the section, what is wrong and what to do)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{path}: {message}" for path, message in problems))


def _refuse(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise FieldProblems(problems)


class ModelSection(_Section):
    preset: Literal["k3", "k3-small", "k3-tiny"] = "k3-tiny"
    overrides: dict[str, Any] = Field(default_factory=dict, description="K3Config fields replacing the preset's")
    checkpoint: str | None = Field(None, description="HF-layout directory to load the weights from")
    tokenizer: str = Field("byte", description="'byte', or a directory with the checkpoint's tiktoken.model + "
                                               "tokenizer_config.json (the official K3 files), or a tokenizer.json")
    dtype: Literal["float32", "bfloat16"] = "float32"
    thinking: bool = Field(False, description="thinking mode of the chat template")
    seed: int = 0

    def k3_config(self):
        """The K3Config this section describes (preset + overrides), validated: the one combination
        of the two (`k3rl.learner.model.model_config`) that the learner and the engines build from."""
        from k3rl.learner.model import model_config

        try:
            return model_config(self.preset, self.overrides)
        except ValidationError as e:
            raise ConfigError(_format(e, prefix="model.overrides")) from None

    def _k3_config_or_problems(self) -> tuple[Any, list[tuple[str, str]]]:
        from k3rl.learner.model import K3Config

        try:
            return K3Config.model_validate({**K3Config.preset(self.preset).model_dump(), **self.overrides}), []
        except ValidationError as e:
            return None, [(f"overrides.{'.'.join(str(p) for p in err['loc'])}".rstrip("."),
                           err["msg"].removeprefix("Value error, ") if err["type"] != "extra_forbidden" else "not a K3Config field")
                          for err in e.errors()]


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


class RolloutSection(_Section):
    engine: Literal["embedded", "vllm"] = "embedded"
    num_inference_workers: int = Field(1, ge=1)
    num_rollout_workers: int = Field(1, ge=1)
    episodes_per_worker: int = Field(8, ge=1, description="episodes one rollout worker runs at once")
    group_size: int = Field(4, ge=1, description="samples per prompt (GRPO group)")
    prompts_per_step: int = Field(8, ge=1)
    max_policy_lag: int = Field(1, ge=0, description="0 = synchronous on-policy")
    partial_rollouts: bool = True
    max_context_tokens: int = Field(2048, ge=16)
    context: ContextSection = Field(default_factory=ContextSection)
    max_batch_sequences: int = Field(64, ge=1, description="sequences one engine decodes together")
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


class TeacherSpec(_Section):
    """One teacher of on-policy distillation (learner/distill.py)."""

    checkpoint: str = Field(description="HF-layout directory of a K3-architecture checkpoint (any preset; the "
                                        "student's tokenizer and vocabulary)")
    preset: Literal["k3", "k3-small", "k3-tiny"] = "k3-tiny"
    overrides: dict[str, Any] = Field(default_factory=dict, description="K3Config fields replacing the preset's")
    envs: list[str] = Field(default_factory=list, description="env ids whose episodes it scores; [] = every env "
                                                              "no other teacher names")
    coef: float = Field(1.0, gt=0, description="weight of its per-token reverse-KL advantage, log T - log mu")
    clip: float | None = Field(None, gt=0, description="R: log T - log mu clipped to [-R, R] per token (the K3 "
                                                        "report's per-token reward); None = not clipped")
    engines: int = Field(1, ge=0, description="scoring actors of its own (rollout/teacher.py), started by the job "
                                              "beside the inference engines, each scoring a share of the step's "
                                              "episodes; 0 = the learner loads it and scores in its own process")
    gpus_per_engine: float = Field(0.0, ge=0, description="GPUs of each of its engines (0: on the CPU)")


class DistillSection(_Section):
    """On-policy distillation: teachers score the student's sampled tokens; their per-token
    reverse-KL advantage is added to the env's (a teacher per env: the multi-teacher setup)."""

    teachers: list[TeacherSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_teacher_per_env(self):
        problems, seen = [], {}
        for i, t in enumerate(self.teachers):
            for e in t.envs:
                if e in seen:
                    problems.append((f"teachers.{i}.envs", f"{e} is already taught by teachers.{seen[e]}; "
                                                           "name each env in one teacher only"))
                seen.setdefault(e, i)
        if sum(not t.envs for t in self.teachers) > 1:
            problems.append(("teachers", "more than one teacher has envs: []; only one may take the envs no "
                                         "teacher names"))
        _refuse(problems)
        return self


LORA_GROUPS = ("attention", "shared_experts", "routed_experts", "latent")


class LoraSection(_Section):
    """LoRA RL (learner/lora.py): only low-rank adapters W + (alpha / rank) B A train."""

    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="on an adapted linear layer's input (not on routed experts)")
    targets: list[str] = Field(
        default_factory=lambda: ["attention", "shared_experts", "latent"], min_length=1,
        description="the weights to adapt: the groups attention, shared_experts, routed_experts, latent, or "
                    "regular expressions searched in weight names (e.g. 'self_attn\\.q_proj\\.weight$')")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="the adapters' optimizer, in place of learner.optimizer (AdamW: measured ahead of "
                             "Per-Head Muon on adapters, BENCHMARKS.md 'LoRA')")
    sync: Literal["adapters", "merged"] = Field(
        "adapters", description="what a weight sync sends: the adapters alone (each engine merges them into its "
                                "own base weights) or the merged weights W + (alpha / rank) B A under the release's names")

    @model_validator(mode="after")
    def _patterns_compile(self):
        import re

        problems = []
        for i, t in enumerate(self.targets):
            if t in LORA_GROUPS:
                continue
            try:
                re.compile(t)
            except re.error as e:
                problems.append((f"targets.{i}", f"{t!r} is neither a group ({', '.join(LORA_GROUPS)}) nor a regular "
                                                 f"expression ({e})"))
        _refuse(problems)
        return self

    def settings(self):
        """The `k3rl.learner.lora.LoraSettings` of this section (groups expanded to their patterns)."""
        from k3rl.learner.lora import GROUPS, LoraSettings

        patterns = [p for t in self.targets for p in GROUPS.get(t, [t])]
        return LoraSettings(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=patterns)


class MoonEPSection(_Section):
    """MoonEP (learner/moon_ep.py; K3 report §5.2.1): expert parallel with redundant copies of the
    hot experts and a fixed number of rows per rank pair; needs learner.expert_parallel > 1."""

    enabled: bool = False
    slots: int = Field(1, ge=0, description="redundant expert slots per rank (at most num_experts - "
                                            "num_experts / expert_parallel); num_experts / expert_parallel "
                                            "make a per-batch plan exact for any routing")
    margin: float = Field(1.25, gt=0, description="rows per rank pair = ceil(margin x the plan's largest load x "
                                                  "micro_batch_tokens x k); a route beyond them is dropped")
    plan_per_batch: bool = Field(False, description="plan the copies from each forward's own routes (the report's "
                                                    "way); false: from the routes of the previous step")
    allow_drops: bool = Field(False, description="a route beyond its pair's capacity counts as zero "
                                                 "(moe/dropped_routes); false: it stops the step with an error")


class GuardSection(_Section):
    """The collapse guard (k3rl/guard.py, docs/learning.md): a policy whose sampled messages stop parsing is
    rolled back to the last policy that sampled well-formed ones, and the learning rate is cut."""

    enabled: bool = False
    baseline_steps: int = Field(3, ge=1, description="the first batches' mean format error rate is the baseline")
    max_rise: float = Field(0.25, gt=0, le=1, description="a batch whose format error rate exceeds the baseline "
                                                          "by more than this is unhealthy")
    patience: int = Field(2, ge=1, description="unhealthy batches in a row before a rollback")
    lr_factor: float = Field(0.5, gt=0, lt=1, description="the learning rate is multiplied by this at each rollback")
    max_rollbacks: int = Field(3, ge=1, description="one more collapse ends the job with an error")


class LearnerSection(_Section):
    algorithm: Literal["grpo", "cispo", "ppo"] = "grpo"
    advantage: Literal["grpo", "grpo_no_std", "rloo", "turn_grpo", "turn_grpo_no_std"] = Field(
        "grpo", description="grpo / grpo_no_std / rloo: one advantage per episode from its reward; turn_grpo "
                            "(_no_std): per turn, the discounted return of the env's step rewards from that turn "
                            "on minus the group's mean at that turn index (learner/advantages.py)")
    turn_gamma: float = Field(1.0, ge=0, le=1, description="discount of the per-turn returns of turn_grpo")
    optimizer: Literal["muon", "adamw"] = "muon"
    lr: float = Field(3e-3, gt=0, description="RL peak learning rate; in a job left unset it is the preset's "
                                               "post-training rate (POST_TRAINING_LR)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_ratio: float = Field(0.01, ge=0, lt=1)
    weight_decay: float = Field(0.1, ge=0)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    entropy_coef: float = Field(0.0)
    tis_cap: float = Field(2.0, gt=0, description="truncated importance sampling cap")
    tis_level: Literal["token", "sequence", "none"] = "token"
    ratio_mask_low: float = Field(0.0, ge=0)
    ratio_mask_high: float = Field(10.0, gt=0)
    loss_agg: Literal["token_mean", "seq_mean", "constant"] = Field(
        "token_mean", description="token_mean | seq_mean | constant (Dr. GRPO: a sequence's token sum over "
                                  "loss_norm_tokens, no length bias; pair with advantage: grpo_no_std)")
    loss_norm_tokens: int = Field(1024, ge=1, description="L of loss_agg: constant")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch")
    minibatches: int = Field(
        1, ge=1, description="optimizer updates per pass: the batch split into this many minibatches (whole groups). "
                             "With ppo_epochs x minibatches > 1 the old policy's log-probs are recorded before the "
                             "first update and the clip acts")
    overlong: Literal["none", "filter", "penalty"] = Field(
        "none", description="episodes cut by max_tokens_per_turn or the context: filter = not trained (their "
                            "reward still enters the group baseline); penalty = reward - overlong_penalty")
    overlong_penalty: float = Field(0.5, ge=0)
    format_penalty: float = Field(
        0.0, ge=0, description="subtracted from the reward of an episode with a malformed assistant message, or with "
                               "per-turn advantages from the reward of each malformed turn (the format guard, "
                               "docs/learning.md: RL's reward says nothing of the message format, so without it the "
                               "format drifts, and a malformed answer that buys a retry is worth a second try)")
    micro_batch_tokens: int = Field(4096, ge=16)
    grad_clip: float = Field(1.0, gt=0)
    qk_clip_tau: float | None = Field(None, gt=0, description="QK-Clip threshold for the MLA logits (K2 used 100); None = off")
    bf16: bool = False
    activation_checkpointing: bool = False
    routing_replay: bool = Field(
        True, description="train with the experts the engine routed each token to (the embedded engine records "
                          "them; vLLM cannot: set false with rollout.engine: vllm)")
    qb_frozen: bool = True
    steps: int = Field(20, ge=0)
    checkpoint_every: int = Field(10, ge=0)
    sft_steps: int = Field(0, ge=0, description="SFT warm start on oracle demonstrations")
    sft_lr: float = Field(3e-3, gt=0, description="SFT warm-start peak learning rate; in a job left unset it is "
                                                   "the preset's (POST_TRAINING_LR)")
    sft_episodes: int = Field(64, ge=0)
    eval_before_training: bool = Field(False, description="roll out the untrained policy once: the reward curve's step 0")
    data_parallel: Literal["none", "fsdp"] = "none"
    world_size: int = Field(1, ge=1)
    expert_parallel: int = Field(
        1, ge=1, description="ranks sharing the routed experts (EP, with FSDP); divides world_size and num_experts"
    )
    context_parallel: int = Field(
        1, ge=1, description="ranks that split each packed micro-batch's sequence (context parallelism: KCP for "
                             "KDA, the gathered latent for MLA; docs/parallel.md); with FSDP, equal to world_size "
                             "for now")
    context_parallel_zigzag: bool = Field(
        False, description="zigzag layout of the context-parallel split: every rank gets the same attention work")
    moon_ep: MoonEPSection = Field(default_factory=MoonEPSection)
    gpus: float = Field(0.0, ge=0.0)
    seed: int = 0
    distill: DistillSection = Field(default_factory=DistillSection)
    lora: LoraSection | None = Field(None, description="LoRA RL: only adapters train; absent = full fine-tuning")
    guard: GuardSection = Field(default_factory=GuardSection)

    @model_validator(mode="after")
    def _refuse_what_cannot_work(self):
        problems = self._lora_problems()
        if self.ratio_mask_low >= self.ratio_mask_high:
            problems.append(("ratio_mask_low", f"{self.ratio_mask_low} must be below ratio_mask_high "
                                               f"({self.ratio_mask_high})"))
        ep = self.expert_parallel
        if ep > 1 and self.data_parallel != "fsdp":
            problems.append(("expert_parallel", f"expert_parallel={ep} needs data_parallel='fsdp' (FSDP shards all "
                                                f"but the experts); set learner.data_parallel: fsdp"))
        if self.world_size % ep:
            problems.append(("expert_parallel", f"expert_parallel={ep} must divide world_size={self.world_size}"))
        if self.moon_ep.enabled and ep == 1:
            problems.append(("moon_ep.enabled", "MoonEP balances expert parallel, which is off (expert_parallel=1); "
                                                "set learner.expert_parallel > 1, or learner.moon_ep.enabled: false"))
        if self.world_size > 1 and self.data_parallel != "fsdp":
            problems.append(("world_size", f"world_size={self.world_size} needs data_parallel='fsdp' (the learner's "
                                           f"ranks share one model); set learner.data_parallel: fsdp"))
        per_rank = self.gpus / self.world_size
        if self.world_size > 1 and self.gpus > 0 and (per_rank < 1 or per_rank != int(per_rank)):
            problems.append(("gpus", f"gpus={self.gpus} over world_size={self.world_size} ranks is {per_rank:g} GPU "
                                     f"per rank; the ranks' NCCL group needs whole GPUs, one or more per rank "
                                     f"(e.g. gpus={self.world_size})"))
        problems += self._context_parallel_problems()
        if self.sft_steps > 0 and self.sft_episodes == 0:
            problems.append(("sft_episodes", f"is 0, but sft_steps={self.sft_steps} needs oracle demonstrations to "
                                             f"train on; set learner.sft_episodes > 0, or learner.sft_steps: 0"))
        _refuse(problems)
        return self

    def _context_parallel_problems(self) -> list[tuple[str, str]]:
        cp = self.context_parallel
        if cp == 1:
            return []
        problems = []
        if cp != self.world_size or self.data_parallel != "fsdp":
            problems.append(("context_parallel", f"context_parallel={cp} needs data_parallel: fsdp with world_size "
                                                 f"equal to it (every rank splits every micro-batch; data parallelism "
                                                 f"beyond it is not supported yet); set learner.world_size: {cp} and "
                                                 f"learner.data_parallel: fsdp"))
        if self.expert_parallel > 1:
            problems.append(("context_parallel", "context parallelism with expert_parallel > 1 is not supported; "
                                                 "set learner.expert_parallel: 1, or learner.context_parallel: 1"))
        if self.tis_level == "sequence":
            problems.append(("tis_level", "'sequence' multiplies a sequence's token ratios, which context "
                                          "parallelism splits over ranks; set learner.tis_level: token (or none), "
                                          "or learner.context_parallel: 1"))
        if self.lora is not None:
            problems.append(("context_parallel", "context parallelism with LoRA is not supported; remove "
                                                 "learner.lora, or set learner.context_parallel: 1"))
        return problems

    def _lora_problems(self) -> list[tuple[str, str]]:
        if self.lora is None:
            return []
        problems = []
        if self.data_parallel != "none":
            problems.append(("lora", "LoRA is not supported with data_parallel: fsdp or expert_parallel (untested "
                                     "with sharded frozen weights); set learner.data_parallel: none, or remove "
                                     "learner.lora"))
        if self.qk_clip_tau is not None:
            problems.append(("lora", "QK-Clip rescales the frozen attention weights, which LoRA keeps as the "
                                     "engines' base; set learner.qk_clip_tau: null, or remove learner.lora"))
        if self.lora.sync == "adapters" and not self.qb_frozen:
            problems.append(("lora.sync", "'adapters' sends only the adapters, but qb_frozen: false also changes the "
                                          "router biases; set learner.lora.sync: merged (or learner.qb_frozen: true)"))
        return problems


# built-in envs whose observations hold images (the vLLM engine cannot take them)
IMAGE_ENVS = ("k3rl/ChartMatch-v0",)


class EnvSpec(_Section):
    id: str = Field(description="a registered Gymnasium id, e.g. k3rl/KeyLookup-v0")
    weight: float = Field(1.0, gt=0)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class EvalSpec(_Section):
    """Held-out evaluation on one env: `num_tasks` tasks (seeds apart from training's), each run once
    greedily and `samples` times at the job's temperature (pass@`pass_k` from them)."""

    id: str = Field(description="a registered Gymnasium id, e.g. k3rl/KeyLookup-v0")
    name: str | None = Field(None, description="the metrics' name, eval/<name>/...; default: the id without "
                                               "its namespace (k3rl/KeyLookup-v0 -> KeyLookup-v0)")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    num_tasks: int = Field(16, ge=1)
    pass_k: int | None = Field(None, ge=1, description="k of pass@k; None: envs.eval_pass_k")
    samples: int | None = Field(None, ge=1, description="sampled episodes per task (n >= pass_k); None: pass_k")

    @property
    def metric_name(self) -> str:
        return self.name or self.id.rsplit("/", 1)[-1]


class EnvsSection(_Section):
    train: list[EnvSpec] = Field(default_factory=lambda: [EnvSpec(id="k3rl/KeyLookup-v0")], min_length=1)
    eval: list[EvalSpec] = Field(
        default_factory=list, description="held-out evaluation: before RL and every tracking.eval_every steps")
    eval_pass_k: int = Field(4, ge=1, description="k of pass@k for the envs.eval specs that do not set pass_k")
    imports: list[str] = Field(
        default_factory=list,
        description="modules imported in every process that makes envs (the driver, the rollout workers) before "
                    "the env ids are looked up; a module registers its envs with gymnasium.register on import")
    max_turns: int = Field(4, ge=1)
    episode_time_budget_s: float = Field(120.0, gt=0)

    @model_validator(mode="after")
    def _module_names(self):
        _refuse([(f"imports.{i}", f"{name!r} is not a module name (dotted Python identifiers, e.g. mypkg.envs); "
                                  f"a file is imported by its module name once its directory is on PYTHONPATH "
                                  f"(or in ray.runtime_env.working_dir / py_modules)")
                 for i, name in enumerate(self.imports)
                 if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name)])
        return self

    def eval_sizes(self, spec: EvalSpec) -> tuple[int, int]:
        """(k, n) of an eval spec: pass@k is estimated from n sampled episodes per task."""
        k = spec.pass_k or self.eval_pass_k
        return k, spec.samples or k

    @model_validator(mode="after")
    def _eval_specs(self):
        problems, seen = [], {}
        for i, spec in enumerate(self.eval):
            name = spec.metric_name
            if not re.fullmatch(r"[\w.\-]+", name):
                problems.append((f"eval.{i}.name", f"{name!r} cannot name metrics (eval/<name>/success): use letters, "
                                                   f"digits, '_', '-', '.'"))
            if name in seen:
                problems.append((f"eval.{i}.name", f"{name!r} is also the metrics' name of envs.eval.{seen[name]}; "
                                                   f"give one of them a name of its own"))
            seen.setdefault(name, i)
            k, n = self.eval_sizes(spec)
            if n < k:
                problems.append((f"eval.{i}.samples", f"{n} sampled episodes per task cannot estimate pass@{k}; "
                                                      f"set samples >= pass_k ({k})"))
        _refuse(problems)
        return self


class SandboxSection(_Section):
    backend: Literal["auto", "docker", "bwrap"] = "auto"
    image: str | None = Field(
        None, description="Docker image of the sandboxes (backend docker or auto); None: k3rl-sandbox:<version> from "
                          "`k3rl sandbox build`. Another image needs python3 and a user 1000 (e.g. FROM that image)")
    memory_mb: int = Field(512, ge=32, description="memory of one sandbox; Python needs 32 MB or more")
    cpus: float = Field(1.0, gt=0)
    pids: int = Field(128, ge=8)
    exec_timeout_s: float = Field(10.0, gt=0)
    pool_size: int = Field(4, ge=0, description="warm sandboxes kept ready")
    max_concurrency: int = Field(16, ge=1)
    starts_per_second: float = Field(4.0, gt=0)


class TrackingSection(_Section):
    uri: str = Field("sqlite:///runs/mlflow.db", description="MLflow tracking URI (sqlite:///... or http://server)")
    experiment: str = "k3rl"
    run_name: str | None = None
    runs_dir: str = "runs"
    sample_every: int = Field(5, ge=1, description="log sample episodes every this many steps (and at the last)")
    sample_episodes: int = Field(4, ge=0, description="episodes rendered as HTML artifacts per logging step")
    eval_every: int = Field(0, ge=0, description="run envs.eval every this many RL steps (and after the last); "
                                                 "0: only before the first RL step")


class RaySection(_Section):
    address: str | None = Field(None, description="None starts a local Ray; 'auto' or ray://host:port joins a cluster")
    num_cpus: int | None = Field(None, ge=1)
    namespace: str = "k3rl"
    include_dashboard: bool = False
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime_env of the job (working_dir, py_modules, pip, env_vars...): how a cluster's "
                    "workers get the user's code; its env_vars are merged over the ones the job sets")

    @model_validator(mode="after")
    def _env_vars_mapping(self):
        env_vars = self.runtime_env.get("env_vars")
        if env_vars is not None and not isinstance(env_vars, dict):
            _refuse([("runtime_env.env_vars", f"must map variable names to values, got {env_vars!r}")])
        return self


# Post-training peak learning rates (RL, SFT warm start) per preset, used when a job leaves
# learner.lr / learner.sft_lr unset. Post-training moves a trained model a little: rates one to
# two orders below pre-training's, smaller the wider the model (Muon's update RMS is matched to
# AdamW's, so these read as AdamW rates). k3-tiny's are the demo's, measured (docs/learning.md):
# RL at 1e-4 keeps the held-out success over 30 steps (at 1e-3 one update already drops confident
# tokens by 9 nats); SFT at 3e-3 over 60 steps learns the copies KeyLookup needs (greedy held-out
# success 0.72), at 1e-2 only the message format (0.03). k3-small's and k3's follow the width
# scaling of published post-training and are not measured here.
POST_TRAINING_LR: dict[str, tuple[float, float]] = {
    "k3-tiny": (1e-4, 3e-3),
    "k3-small": (1e-5, 1e-4),
    "k3": (2e-6, 1e-5),
}


class JobConfig(_Section):
    name: str = "k3rl-job"
    model: ModelSection = Field(default_factory=ModelSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    envs: EnvsSection = Field(default_factory=EnvsSection)
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    ray: RaySection = Field(default_factory=RaySection)

    @model_validator(mode="before")
    @classmethod
    def _post_training_lr(cls, data: Any) -> Any:
        """learner.lr and learner.sft_lr, when left unset, from the preset's POST_TRAINING_LR."""
        if not isinstance(data, dict) or not isinstance(data.get("learner", {}), dict):
            return data
        model = data.get("model", {})
        preset = model.get("preset", "k3-tiny") if isinstance(model, dict) else getattr(model, "preset", "k3-tiny")
        if preset not in POST_TRAINING_LR:
            return data  # the preset field reports the unknown name
        learner = dict(data.get("learner", {}))
        lr, sft_lr = POST_TRAINING_LR[preset]
        learner.setdefault("lr", lr)
        learner.setdefault("sft_lr", sft_lr)
        return {**data, "learner": learner}

    @model_validator(mode="after")
    def _refuse_what_cannot_work(self):
        _refuse(self._model_problems() + self._engine_problems() + self._weight_transport_problems()
                + self._sandbox_problems() + self._context_parallel_problems())
        return self

    def _context_parallel_problems(self) -> list[tuple[str, str]]:
        if self.learner.context_parallel == 1:
            return []
        return [(f"envs.{section}.{i}.id", f"{spec.id} puts images in the prompts, and the vision tower does not "
                                           f"run context-parallel; set learner.context_parallel: 1")
                for section in ("train", "eval") for i, spec in enumerate(getattr(self.envs, section))
                if spec.id in IMAGE_ENVS]

    def _model_problems(self) -> list[tuple[str, str]]:
        k3, problems = self.model._k3_config_or_problems()
        problems = [(f"model.{path}", message) for path, message in problems]
        if k3 is None:
            return problems
        ep = self.learner.expert_parallel
        if ep > 1 and k3.num_experts % ep:
            problems.append(("learner.expert_parallel", f"learner.expert_parallel={ep} must divide the model's "
                                                        f"num_experts={k3.num_experts}"))
        problems += self._moon_ep_problems(k3.num_experts)
        from k3rl.tokenizer import ByteTokenizer

        if self.model.tokenizer == "byte" and k3.vocab_size < ByteTokenizer.vocab_size:
            problems.append(("model.overrides.vocab_size", f"{k3.vocab_size} is smaller than the byte tokenizer's "
                                                           f"{ByteTokenizer.vocab_size} ids; raise it, or set "
                                                           f"model.tokenizer to the directory of a real tokenizer (the checkpoint's tiktoken.model + tokenizer_config.json)"))
        return problems

    def _moon_ep_problems(self, num_experts: int) -> list[tuple[str, str]]:
        moon, learner = self.learner.moon_ep, self.learner
        if not moon.enabled or learner.expert_parallel < 2:
            return []
        problems = []
        most = num_experts - num_experts // learner.expert_parallel
        if moon.slots > most:
            problems.append(("learner.moon_ep.slots", f"{moon.slots} is more than the {most} experts a rank is not "
                                                      f"home to (num_experts={num_experts}, expert_parallel="
                                                      f"{learner.expert_parallel}); lower it"))
        if self.rollout.max_context_tokens > learner.micro_batch_tokens:
            problems.append(("learner.moon_ep", f"MoonEP sizes its dispatch for micro_batch_tokens="
                                                f"{learner.micro_batch_tokens} tokens a rank, but an episode of "
                                                f"rollout.max_context_tokens={self.rollout.max_context_tokens} makes a "
                                                f"longer micro-batch; raise learner.micro_batch_tokens to at least "
                                                f"{self.rollout.max_context_tokens}"))
        return problems

    def _engine_problems(self) -> list[tuple[str, str]]:
        if self.rollout.engine != "vllm":
            return []
        problems = []
        if self.learner.lora is not None and self.learner.lora.sync == "adapters":
            problems.append(("learner.lora.sync", "rollout.engine 'vllm' takes whole weights; set "
                                                  "learner.lora.sync: merged (or rollout.engine: embedded)"))
        if self.rollout.sampling.temperature not in (0.0, 1.0):
            problems.append(("rollout.sampling.temperature", "rollout.engine 'vllm' reports log-probs at temperature 1 "
                             "(logprobs_mode raw_logprobs), and the learner trains softmax(logits / temperature): "
                             "set temperature 1 (or rollout.engine: embedded)"))
        if self.learner.routing_replay:
            problems.append(("learner.routing_replay", "rollout.engine 'vllm' does not return the routed experts "
                                                       "that routing replay trains with; set "
                                                       "learner.routing_replay: false (or rollout.engine: embedded)"))
        if not self.model.checkpoint:
            problems.append(("model.checkpoint", "rollout.engine 'vllm' serves an HF-layout checkpoint directory; "
                                                 "set model.checkpoint to one (save_hf writes it), or use "
                                                 "rollout.engine: embedded"))
        for section in ("train", "eval"):
            for i, spec in enumerate(getattr(self.envs, section)):
                if spec.id in IMAGE_ENVS:
                    problems.append((f"envs.{section}.{i}.id", f"{spec.id} puts images in the prompts, and "
                                     "rollout.engine 'vllm' serves text only (k3rl's K3 model class for vLLM has "
                                     "no image input); use rollout.engine: embedded"))
        return problems

    def _weight_transport_problems(self) -> list[tuple[str, str]]:
        t, learner_gpus, engine_gpus = self.rollout.weight_transport, self.learner.gpus, self.rollout.gpus_per_inference_worker
        where = "rollout.weight_transport"
        if t == "nccl" and (learner_gpus > 0) != (engine_gpus > 0):
            return [(where, f"'nccl' needs the learner and the engines on the same kind of device "
                            f"(learner.gpus={learner_gpus}, rollout.gpus_per_inference_worker={engine_gpus}): NCCL "
                            f"between GPUs, gloo between CPU processes")]
        if t == "nccl" and engine_gpus > 0 and (engine_gpus < 1 or learner_gpus / self.learner.world_size < 1):
            return [(where, f"'nccl' needs one whole GPU per process (learner.gpus={learner_gpus} over "
                            f"{self.learner.world_size} rank(s), rollout.gpus_per_inference_worker={engine_gpus}): "
                            f"NCCL cannot connect two processes on one GPU; use 'cuda_ipc' when the engines share the "
                            f"learner's GPU")]
        if t == "cuda_ipc" and not (learner_gpus > 0 and engine_gpus > 0):
            return [(where, f"'cuda_ipc' needs the learner and the engines on GPUs of one host "
                            f"(learner.gpus={learner_gpus}, rollout.gpus_per_inference_worker={engine_gpus})")]
        return []

    def _sandbox_problems(self) -> list[tuple[str, str]]:
        if self.sandbox.image and self.sandbox.backend == "bwrap":
            return [("sandbox.image", f"{self.sandbox.image!r} is a Docker image, but sandbox.backend is 'bwrap'; "
                                      f"set sandbox.backend: docker (or auto), or remove sandbox.image")]
        return []

    def notes(self) -> list[str]:
        """Settings that work but may not do what was meant (printed by `k3rl train` and `k3rl config show`)."""
        out = []
        learner, episodes = self.learner, self.rollout.prompts_per_step * self.rollout.group_size
        if learner.checkpoint_every > learner.steps:
            out.append(f"learner.checkpoint_every={learner.checkpoint_every} is more than learner.steps="
                       f"{learner.steps}: only the final checkpoint is written")
        if learner.steps == 0 and learner.sft_steps == 0:
            out.append("learner.steps and learner.sft_steps are 0: the job trains nothing")
        if self.tracking.sample_episodes > episodes:
            out.append(f"tracking.sample_episodes={self.tracking.sample_episodes} is more than the {episodes} "
                       f"episodes of a step (rollout.prompts_per_step x rollout.group_size): all of them are logged")
        if self.sandbox.pool_size > self.sandbox.max_concurrency:
            out.append(f"sandbox.pool_size={self.sandbox.pool_size} is more than sandbox.max_concurrency="
                       f"{self.sandbox.max_concurrency}: at most {self.sandbox.max_concurrency} are kept warm")
        return out

    # -- loading ---------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
        data: dict[str, Any] = {}
        if path is not None:
            path = Path(path)
            if not path.exists():
                raise ConfigError(f"config file {path} does not exist")
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path} is not valid YAML: {e}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{path} must hold a mapping at the top level, found {type(data).__name__}")
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_format(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_yaml())
        return path

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values (MLflow params)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and value:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                for i, v in enumerate(value):
                    walk(f"{prefix}.{i}", v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out


class ConfigError(ValueError):
    """A config that cannot be used; the message names each bad field by its dotted path."""


def _format(error: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        path = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "<root>")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldProblems):  # a cross-field check: paths relative to the section that raised it
            base = ".".join(p for p in (prefix, loc) if p)
            lines += [f"{base}.{field}: {message}" if base else f"{field}: {message}" for field, message in cause.problems]
        elif err["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key (check the spelling; `k3rl config show` prints every valid key)")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{path}: {err['msg']}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            idx = _index(part, node, key)
            node = node[idx]
            continue
        if part not in node or node[part] is None:
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[_index(last, node, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"override {item!r}: {'.'.join(parts[:-1])} is a value, not a section")


def _index(part: str, node: list, key: str) -> int:
    if not part.isdigit():
        raise ConfigError(f"override {key!r}: {part!r} must be a list index")
    idx = int(part)
    if idx == len(node):
        node.append({})
    if idx >= len(node):
        raise ConfigError(f"override {key!r}: index {idx} is past the end of a list of {len(node)}")
    return idx
