"""`learner:` the RL objective and optimizer, parallelism, and its sub-sections: distillation
teachers, LoRA, MoonEP and the collapse guard."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from .base import _refuse, _Section


class TeacherSpec(_Section):
    """One teacher of on-policy distillation (learner/distill.py)."""

    checkpoint: str = Field(description="HF-layout directory of a K3-architecture checkpoint (any preset; the "
                                        "student's tokenizer and vocabulary)")
    preset: Literal["k3", "k3-small", "k3-tiny"] = "k3-tiny"
    overrides: dict[str, Any] = Field(default_factory=dict, description="K3Config fields replacing the preset's")
    envs: list[str] = Field(default_factory=list, description="env ids whose episodes it scores; [] = every env "
                                                              "no other teacher names")
    coef: float = Field(1.0, gt=0, description="weight of its per-token reverse KL: of the advantage log T - log mu "
                                               "(sampled) or of the loss term KL(pi || T) (exact)")
    estimator: Literal["sampled", "exact"] = Field(
        "sampled", description="sampled: the per-token reverse-KL advantage log T(y_t) - log mu(y_t) of the sampled token, "
                               "under the policy gradient (a teacher's engines return one number a token); exact: the "
                               "per-token reverse KL over the whole vocabulary, sum_v pi(v) (log pi(v) - log T(v)), "
                               "differentiated as a loss term beside the policy gradient (its expected gradient is the "
                               "sampled one's, without the sampling noise; needs the teacher in the learner, engines: 0)")
    clip: float | None = Field(None, gt=0, description="R: log T - log mu clipped to [-R, R] per token (the K3 "
                                                        "report's per-token reward); None = not clipped")
    discount: float = Field(0.0, ge=0, le=1, description="gamma: a token's advantage also sums gamma^k times the "
                                                         "log-ratio of the k-th sampled token after it (1 = the "
                                                         "whole sequence's reverse KL; 0 = each token's own term)")
    engines: int = Field(1, ge=0, description="scoring actors of its own (learner/teacher_engines.py), started by "
                                              "the job beside the inference engines, each scoring a share of the "
                                              "step's episodes; 0 = the learner loads it and scores in its own "
                                              "process")
    gpus_per_engine: float = Field(0.0, ge=0, description="GPUs of each of its engines (0: on the CPU)")

    @model_validator(mode="after")
    def _exact_in_the_learner(self):
        if self.estimator == "exact":
            _refuse([(field, f"{why} (estimator: exact); {fix}") for field, bad, why, fix in (
                ("engines", self.engines != 0, "the exact reverse KL needs the teacher's whole distribution at every "
                 "position, which only a teacher loaded in the learner gives", "set engines: 0, or estimator: sampled"),
                ("clip", self.clip is not None, "clip bounds the sampled token's log-ratio; the exact KL has none",
                 "remove clip"),
                ("discount", self.discount != 0, "discount sums later sampled tokens' log-ratios; the exact KL is "
                 "per position", "set discount: 0"),
            ) if bad])
        return self


class DistillSection(_Section):
    """On-policy distillation: teachers score the student's sampled tokens; their per-token
    reverse-KL advantage is added to the env's (a teacher per env: the multi-teacher setup)."""

    teachers: list[TeacherSpec] = Field(default_factory=list)
    env_coef: float = Field(1.0, ge=0, description="weight of the env's advantage on the episodes a teacher scores: "
                                                   "1 = the two mixed; 0 = pure on-policy distillation (the teacher's "
                                                   "term alone); episodes no teacher scores keep the env's")

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
    """LoRA RL (k3rl/model/lora.py): only low-rank adapters W + (alpha / rank) B A train."""

    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="on an adapted linear layer's input (not on routed experts)")
    targets: list[str] = Field(
        default_factory=lambda: ["attention", "shared_experts", "latent"], min_length=1,
        description="the weights to adapt: the groups attention, shared_experts, routed_experts, latent, or "
                    "regular expressions searched in weight names (e.g. 'self_attn\\.q_proj\\.weight$')")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="the adapters' optimizer, in place of learner.optimizer (AdamW: it fit faster than "
                             "Per-Head Muon on adapters, each at its best learning rate)")
    sync: Literal["adapters", "merged"] = Field(
        "adapters", description="what a weight sync sends: the adapters alone (each engine merges them into its "
                                "own base weights) or the merged weights W + (alpha / rank) B A under the release's names")

    @model_validator(mode="after")
    def _patterns_compile(self):
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
        """The `k3rl.model.lora.LoraSettings` of this section (groups expanded to their patterns)."""
        # lazy: keeps torch (seconds) out of the CLI's start-up
        from k3rl.model.lora import GROUPS, LoraSettings

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


class SftPhase(_Section):
    """A part of the SFT warm start on other demonstrations: from SFT step `from_step` on, the oracle
    episodes of envs.train (or of its entries named in `envs`) with `env_kwargs` merged into each env's
    kwargs (the same tasks; e.g. KeyLookup's `oracle_wrong_key: 0.5`, a careless demonstrator, after
    careful demonstrations taught the message format and the copying). A curriculum: a first phase at
    `from_step: 0` with `envs` replaces the all-envs start (short episodes first, then all of them).
    The rate: one cosine of sft_lr over all sft_steps, restarted by each phase that sets `lr`
    (a cosine from `lr` over that phase and the phases after it without one)."""

    from_step: int = Field(ge=0, description="the first SFT step (0-based) on this phase's demonstrations; 0 only "
                                             "for the first phase, which then replaces the all-envs start")
    env_kwargs: dict[str, Any] = Field(default_factory=dict,
                                       description="merged into every envs.train entry's kwargs for these demonstrations")
    env_kwargs_by_env: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per envs.train id, merged into that env's kwargs after env_kwargs (e.g. "
                                          "a careless demonstrator more often in one env: {k3rl/PythonTool-v0: "
                                          "{oracle_mistakes: 0.8}})")
    envs: list[str] | None = Field(None, min_length=1, description="the envs.train ids whose demonstrations this "
                                                                    "phase trains on; None = all of them")
    lr: float | None = Field(None, gt=0, description="restart the SFT rate's cosine at this peak from from_step on")

    def kwargs_for(self, env_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The kwargs of env `env_id` (whose own are `kwargs`) in this phase's demonstrations."""
        return {**kwargs, **self.env_kwargs, **self.env_kwargs_by_env.get(env_id, {})}


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
    warmup_ratio: float = Field(0.01, ge=0, lt=1, description="linear warmup of the RL steps' rate, as a share of learner.steps")
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
    shared_prefix: Literal["auto"] | bool = Field(
        "auto", description="shared-prefix training: the leading positions a group's samples agree on (the prompt, "
                            "shared earlier turns) run once, KDA's state and conv window and MLA's keys handed to every "
                            "sample's rest (learner/prefix_tree.py); the same loss and gradients as packing each "
                            "sample whole. true: always; false: never; auto: for a step (each minibatch) whose "
                            "saved fraction (tokens the tree saves / positions packed whole) is above "
                            "shared_prefix_min_fraction. Falls back to packing whole, with one log line, under "
                            "context parallelism, QK-Clip or exact-KL teachers; trajectories with images or context "
                            "segments are packed whole")
    shared_prefix_min_fraction: float = Field(
        0.05, ge=0, lt=1, description="learner.shared_prefix: auto uses the tree when the tokens it saves are more "
                                      "than this fraction of the positions packed whole. 0.05 was measured on a "
                                      "CPU, not a GPU (k3-tiny in fp32, groups of 4 and 8: the tree was never "
                                      "slower than packing whole, matched a nothing-shared control from a saved "
                                      "fraction of 0.04-0.05 and paid from about 0.2; "
                                      "benchmarks/results/shared_prefix/). A GPU's kernel launches make the fork's "
                                      "fixed costs weigh more: re-measure on an H200 with the command in "
                                      "benchmarks/shared_prefix.py")
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
    preempt_grace_s: float = Field(
        60.0, gt=0, description="after SIGTERM, SIGHUP or Ctrl-C the job ends at the next step boundary with a "
                               "checkpoint, or this many seconds after the signal with the last checkpoint (the step "
                               "in progress abandoned; --resume re-issues its episodes); exit code 128 + the signal "
                               "(143 SIGTERM, 129 SIGHUP, 130 Ctrl-C)")
    sft_steps: int = Field(0, ge=0, description="SFT warm start on oracle demonstrations")
    sft_warmup_ratio: float = Field(0.01, ge=0, lt=1, description="linear warmup of the SFT rate (sft_lr), as a share "
                                    "of sft_steps; apart from warmup_ratio, which is the RL steps'")
    sft_lr: float = Field(3e-3, gt=0, description="SFT warm-start peak learning rate; in a job left unset it is "
                                                   "the preset's (POST_TRAINING_LR)")
    sft_episodes: int = Field(64, ge=0)
    sft_batch: int | None = Field(None, ge=1, description="demonstrations per SFT step; None = one RL batch "
                                                          "(rollout.prompts_per_step x group_size)")
    sft_phases: list[SftPhase] = Field(default_factory=list, description="later SFT steps on other "
                                       "demonstrations (SftPhase); [] = every step on envs.train's oracle")
    eval_before_training: bool = Field(False, description="roll out the starting policy (untrained, or model.checkpoint's) once: the reward curve's step 0")
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
        starts = [p.from_step for p in self.sft_phases]
        for i, (start, phase) in enumerate(zip(starts, self.sft_phases, strict=True)):
            if start >= self.sft_steps or (i and start <= starts[i - 1]):
                problems.append((f"sft_phases.{i}.from_step", f"{start} must be below sft_steps={self.sft_steps} and "
                                                              f"above the phase before it; phases start in order, "
                                                              f"each inside the warm start"))
            if not (phase.env_kwargs or phase.env_kwargs_by_env or phase.envs or phase.lr):
                problems.append((f"sft_phases.{i}", "changes nothing: set env_kwargs, env_kwargs_by_env, envs or lr "
                                                    "(or remove it)"))
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
