"""The learner's trainer: trajectories in, one optimizer step out, metrics back.

    trainer = Trainer(K3ForCausalLM(K3Config.preset("k3-tiny")), job.learner)
    metrics = trainer.train_step(trajectories)       # RL (group-relative advantages, PPO/CISPO)
    metrics = trainer.sft_step(demonstrations)       # cross-entropy on loss-mask tokens
    update  = trainer.export_weights(version)        # WeightUpdate of official HF names
    trainer.save_checkpoint(dir); trainer.load_checkpoint(dir)

One step: group advantages over the whole batch -> split into `minibatches` parts of whole
groups, each packed into micro-batches by token budget (cu_seqlens, no padding) -> with
several updates per batch, the old policy's log-probs of every micro-batch recorded first ->
`ppo_epochs` times, for each minibatch: for each micro-batch forward (bf16 autocast when
enabled; routing replay when enabled), per-token log-probs in fp32, loss, backward
(gradients accumulate), then clip the gradient norm and step the optimizer at the step's
LR -> Quantile Balancing bias update unless frozen. One step is one policy version, however
many optimizer updates it makes.

With `data_parallel="fsdp"` every rank calls the same methods with the *same* full batch;
each rank trains on its share of micro-batches and FSDP2 reduces the gradients. With
`expert_parallel=ep > 1` the routed experts are also sharded over groups of ep ranks
(expert_parallel.py): FSDP ignores the expert slices, whose gradients are summed by the
all-to-all backward and scaled here to the full-batch gradient. With `moon_ep.enabled` they are
sharded with MoonEP instead (moon_ep.py: redundant copies of hot experts, a fixed number of rows
per rank pair), replanned after each step unless planned per batch; every step then logs the load
imbalance (max / mean rows per rank) and the dropped routes. With `context_parallel=N` (= world_size)
every rank gets the same micro-batches and trains on its `ContextParallel` shard of their positions
(docs/parallel.md); the same x W loss scaling makes FSDP's average the sum over the ranks' positions.

Beside it: `update.py` an optimizer update and what follows it (LR schedule, clipping, QK-Clip,
the QB bias update, MoonEP's replan), `parallelize.py` the sharding applied to the model,
`export.py` the WeightUpdate of its weights, `checkpoint.py` save and load.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from k3rl.model import build_model
from k3rl.model.lora import apply_lora
from k3rl.types import Trajectory, WeightUpdate

from . import checkpoint as ckpt
from . import export
from .advantages import batch_advantages, is_overlong
from .data import MicroBatch, build_micro_batches, shard_micro_batches
from .distill import (
    distill_advantages,
    exact_kl_weights,
    exact_teachers,
    load_teachers,
    per_completion,
    teacher_hidden,
)
from .distributed import all_reduce_max, all_reduce_sum, full_state_dict, rank_and_world
from .losses import LossConfig, policy_loss, sft_loss
from .optim import PerHeadMuon, param_groups
from .parallelize import parallelize
from .qk_clip import MaxLogitTracker, QKClip
from .update import apply_qk_clip, clip_and_step, lr_at, moon_ep_step, qb_update, sft_lr_at

__all__ = ["Trainer", "lr_at"]

log = logging.getLogger(__name__)


def _to_host(tree):
    """A copy of a (nested) state dict with every tensor cloned to host memory."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_host(v) for v in tree)
    return copy.deepcopy(tree)


def _abs_mean_over_tokens(adv: torch.Tensor, trajectories: list[Trajectory]) -> float:
    """Mean |advantage|: over episodes when [N], over the sampled tokens when [N, C] (not the padding)."""
    if adv.dim() == 1:
        return float(adv.abs().mean())
    mask = torch.zeros(adv.shape, dtype=torch.bool)
    for i, t in enumerate(trajectories):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.bool)
    return float(adv.abs()[mask].mean()) if mask.any() else 0.0


def to_host(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Scalar statistics kept on the device during a step, brought to the host in one read."""
    if not values:
        return values
    device = next(iter(values.values())).device  # (a gloo collective leaves its sums on the CPU)
    flat = torch.stack([v.reshape(()).double().to(device) for v in values.values()]).cpu()
    return dict(zip(values, flat, strict=True))


class Trainer:
    """Trains a K3ForCausalLM (or any model with the same forward contract) from trajectories.

    Built from a `k3rl.config.LearnerSection`; `Trainer.from_job(job)` builds the model too.
    """

    def __init__(self, model: nn.Module, config, device: str | torch.device | None = None,
                 qk_clip_tau: float | None = None, temperature: float = 1.0):
        self.cfg = config
        # the policy is softmax(logits / temperature), the distribution the engines sample from (the
        # job's rollout.sampling.temperature); SFT stays maximum likelihood at temperature 1
        if not temperature > 0:
            raise ValueError(f"the policy temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.rank, self.world_size = rank_and_world()
        if config.data_parallel == "fsdp" and config.world_size != self.world_size:
            raise ValueError(
                f"learner.world_size is {config.world_size} but the process group has {self.world_size} ranks; "
                "start one process per rank (or set world_size to match)"
            )
        if config.data_parallel == "none":
            self.rank, self.world_size = 0, 1
        model.to(self.device)
        self.model_config = getattr(model, "config", None)
        # model switches owned by the learner config
        if hasattr(model, "gradient_checkpointing"):
            model.gradient_checkpointing = config.activation_checkpointing
        elif config.activation_checkpointing:
            raise ValueError("activation_checkpointing is on but the model has no gradient_checkpointing switch")
        if hasattr(model, "set_qb_frozen"):
            model.set_qb_frozen(config.qb_frozen)
        # the reference policy for the KL term: a frozen copy of the starting weights
        self.reference = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        # LoRA (k3rl/model/lora.py): adapters on the built model, before any sharding; the rest frozen
        self.lora = getattr(config, "lora", None)
        if self.lora is not None:
            apply_lora(model, self.lora.settings())
        self.expert_parallel = getattr(config, "expert_parallel", 1)
        self.context_parallel = parallelize(model, config, self.device, self.world_size)
        self.model = model
        self.sharded = config.data_parallel == "fsdp"
        self.loss_cfg = LossConfig.from_section(config)

        groups, self.param_summary = param_groups(model, lr=config.lr, weight_decay=config.weight_decay)
        optimizer = self.lora.optimizer if self.lora is not None else config.optimizer
        if optimizer == "adamw":
            for g in groups:
                g["kind"], g["block_rows"] = "adamw", None
        self.optimizer = PerHeadMuon(groups, lr=config.lr, weight_decay=config.weight_decay)
        self.trainable = [p for g in groups for p in g["params"]]
        # QK-Clip on the MLA heads (docs/model.md §8.3), off unless a threshold tau is given
        tau = qk_clip_tau if qk_clip_tau is not None else getattr(config, "qk_clip_tau", None)
        self.qk_clip = self.max_logits = None
        if tau is not None:
            c = self.model_config
            self.qk_clip = QKClip(c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, tau=tau)
            self.max_logits = MaxLogitTracker(model)

        # on-policy distillation: teachers scoring the student's sampled tokens (learner/distill.py)
        distill = getattr(config, "distill", None)
        self.teachers = load_teachers(distill.teachers if distill else [], device=str(self.device))
        self.env_coef = distill.env_coef if distill else 1.0  # 0: pure on-policy distillation
        if exact_teachers(self.teachers) and self.context_parallel is not None:
            raise ValueError("learner.distill.teachers: estimator 'exact' runs the teacher over whole micro-batches, "
                             "which context parallelism splits across ranks; use estimator: sampled with "
                             "learner.context_parallel, or train without context parallelism")

        # shared-prefix training (learner/prefix_tree.py), where it applies; else every sequence packed whole.
        # true: always; auto: for a packing whose saved fraction is above shared_prefix_min_fraction
        setting = getattr(config, "shared_prefix", False)
        self.shared_prefix = setting is True or setting == "auto"
        self.shared_prefix_min_fraction = getattr(config, "shared_prefix_min_fraction", 0.0) if setting == "auto" else None
        off = self._shared_prefix_off() if self.shared_prefix else None
        if off:  # said once, here; a warning only where the config asked for it outright
            (log.warning if setting is True else log.info)(
                "learner.shared_prefix: packing every sequence whole instead: %s", off)
            self.shared_prefix = False
        self._said_packed_whole = False  # the one log line for trajectories with images or segments
        self.prefix_stats = self._no_prefix_stats()  # this step's, for the metrics

        self.step = 0  # RL optimizer steps done
        self.lr_scale = 1.0  # cut by the collapse guard's rollbacks (k3rl/guard.py)
        self._good: tuple | None = None  # the last good policy's weights and optimizer state (snapshot)
        self.sft_step_count = 0  # SFT optimizer steps done
        self.data_position = {"trajectories": 0, "sft_trajectories": 0, "tokens": 0}
        self.data_state: dict = {}  # free-form cursor of the caller's data source, saved with checkpoints

    @torch.no_grad()
    def reset_reference(self) -> None:
        """Make the current weights the KL reference policy (e.g. after an SFT warm start).

        The reference is an unsharded frozen copy on every rank; under FSDP (with or without
        expert parallelism) the current weights are gathered into it: collective there. With
        LoRA the reference stays the base model (the weights the adapters are added to)."""
        if self.reference is None or self.lora is not None:
            return
        if self.sharded:
            state = self.full_state_dict()  # collective: every rank gathers the whole model
            self.reference.load_state_dict({k: v.to(self.device) for k, v in state.items()}, strict=True)
        else:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    @classmethod
    def from_job(cls, job, device: str | torch.device | None = None) -> Trainer:
        """Build the model of `job.model` (preset + overrides, optional HF checkpoint) and its trainer.
        The master weights are fp32 whatever `job.model.dtype` (the engines' dtype) is."""
        model = build_model(job.model.preset, job.model.k3_overrides, seed=job.model.seed,
                            checkpoint=job.model.checkpoint or None)
        return cls(model, job.learner, device=device, temperature=job.rollout.sampling.policy_temperature)

    # ------------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------------
    @staticmethod
    def _no_prefix_stats() -> dict[str, int]:
        return {"positions": 0, "saved": 0, "shared": 0, "tokens_saved": 0, "packings": 0, "trees": 0}

    def _prefix_metrics(self) -> dict[str, float]:
        """The step's shared-prefix statistics (then reset), over its packings (one a minibatch): the
        fraction of its positions that lie in a shared prefix, the fraction the tree saves (what
        shared_prefix: auto compares with its threshold; reported whether the tree ran or not), the
        tokens the forward did not run thanks to it (per forward pass) and the fraction of packings
        that ran as trees."""
        st, self.prefix_stats = self.prefix_stats, self._no_prefix_stats()
        if not self.shared_prefix:
            return {}
        positions = max(1, st["positions"])
        return {"learner/shared_prefix_fraction": st["shared"] / positions,
                "learner/shared_prefix_saved_fraction": st["saved"] / positions,
                "learner/shared_prefix_tokens_saved": float(st["tokens_saved"]),
                "learner/shared_prefix_used": st["trees"] / max(1, st["packings"])}  # fmt: skip

    def _shared_prefix_off(self) -> str | None:
        """Why shared prefixes cannot apply to this trainer (None: they can)."""
        if self.context_parallel is not None:
            return "context parallelism splits each packed sequence over ranks, which the prefix tree does not do"
        if self.max_logits is not None:
            return "QK-Clip's max logits are taken per packed document, missing the branches' reads of their prefix"
        if exact_teachers(self.teachers):
            return "exact-KL teachers score the packed sequences position by position, not the tree"
        return None

    def _autocast(self):
        if not self.cfg.bf16:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _moe_shape(self) -> tuple[int, int]:
        c = self.model_config
        if c is None or not hasattr(c, "moe_layer_ids"):
            return 0, 0
        return len(c.moe_layer_ids), c.num_experts_per_token

    @contextmanager
    def _qb_paused(self, paused: bool = True):
        """Forwards inside do not add to the Quantile Balancing histograms (fillers, replay probes)."""
        if not paused or not hasattr(self.model, "qb_frozen"):
            yield
            return
        before = self.model.qb_frozen
        self.model.qb_frozen = True
        try:
            yield
        finally:
            self.model.qb_frozen = before

    def _replay_routes(self, mb: MicroBatch, media=None) -> torch.Tensor | None:
        """Recorded experts for every position; positions without a record take the routes the
        current model picks (one extra forward without gradients, not counted by QB)."""
        if not self.cfg.routing_replay:
            return None
        routes = mb.routed_experts
        probe = routes is not None and bool((routes < 0).any())
        if self.world_size > 1:  # the probe forward is collective (FSDP, EP): all ranks run it or none
            probe = float(all_reduce_max(torch.tensor(float(probe)))) > 0
        if probe:
            with torch.no_grad(), self._autocast(), self._qb_paused():
                _, own = self.model(mb.input_ids, images=media, cu_seqlens=mb.cu_seqlens, return_routing=True,
                                    context_parallel=self.context_parallel, prefix_tree=mb.tree)
            if routes is not None:
                routes = torch.where(routes < 0, own.to(routes.dtype), routes)
        return routes

    def _forward_logprobs(self, model: nn.Module, mb: MicroBatch, routes: torch.Tensor | None,
                          media=None, temperature: float | None = None, distill_from=()):
        """(log p(target) [T], entropy [T]) in fp32 under softmax(logits / temperature) (default: the
        policy's); the [T, V] logits are never materialised. With `distill_from` (teachers' hidden states
        and heads), also KL(pi || teacher) per position, [n_teachers, T]."""
        with self._autocast():
            out = model(mb.input_ids, images=media, cu_seqlens=mb.cu_seqlens, routed_experts=routes,
                        targets=mb.targets[None], context_parallel=self.context_parallel,
                        temperature=self.temperature if temperature is None else temperature,
                        distill_from=distill_from, prefix_tree=mb.tree)
        if mb.tree is not None:  # tree positions -> the unshared positions the loss columns cover
            out = tuple(mb.tree.unshare(x) for x in out)
        if distill_from:
            return out[0][0], out[1][0], out[2][:, 0]
        return out[0][0], out[1][0]

    def _recording_logits(self):
        return self.max_logits.recording() if self.max_logits is not None else nullcontext()

    def _clip_and_step(self, lr: float) -> float:
        return clip_and_step(self.model, self.optimizer, self.trainable, lr, self.cfg.grad_clip, self.expert_parallel,
                             self.world_size)

    def _micro_batches(self, trajectories, advantages) -> tuple[list[MicroBatch], int]:
        n_moe, k = self._moe_shape()
        sharing = {}  # what the prefix tree saves (or would), filled by build_micro_batches
        mbs = build_micro_batches(
            trajectories, self.cfg.micro_batch_tokens, self.cfg.loss_agg, advantages,
            num_moe_layers=n_moe if self.cfg.routing_replay else 0, top_k=k,
            loss_norm_tokens=getattr(self.cfg, "loss_norm_tokens", None),
            defer=self.context_parallel is None,  # loss columns built after the forward is queued
            shared_prefix=self.shared_prefix, shared_prefix_min_fraction=self.shared_prefix_min_fraction,
            sharing=sharing, media_placeholder=getattr(self.model_config, "media_placeholder_token_id", None),
        )  # fmt: skip
        total_positions = sum(mb.positions for mb in mbs)
        if self.shared_prefix:
            st = self.prefix_stats
            st["positions"] += sharing["positions"]
            st["saved"] += sharing["saved"]  # what the tree saves, or would have
            st["shared"] += sharing["shared"]
            st["tokens_saved"] += sharing["saved"] if sharing["used"] else 0
            st["packings"] += 1
            st["trees"] += int(sharing["used"])
            if sharing["used"] and not self._said_packed_whole and any(t.images and t.segment_starts
                                                                       for t in trajectories):  # fmt: skip
                log.info("learner.shared_prefix: trajectories with both images and context segments are packed whole")
                self._said_packed_whole = True
        # the ranks of a context-parallel group share micro-batches: deal them to the data-parallel groups
        cp = self.context_parallel and self.cfg.context_parallel or 1
        groups = self.world_size // cp
        mine = shard_micro_batches(mbs, self.rank // cp, groups) if groups > 1 else mbs
        if self.context_parallel is not None:
            mine = [self.context_parallel.shard_micro_batch(mb) for mb in mine]
        return [mb.to(self.device) for mb in mine], total_positions

    # ------------------------------------------------------------------------------------
    # RL
    # ------------------------------------------------------------------------------------
    def _minibatches(self, indices: list[int], trajectories: list[Trajectory]) -> list[list[int]]:
        """`indices` split into `learner.minibatches` parts of whole groups, in an order drawn
        from (seed, step): the same on every rank, a different one each step."""
        groups: dict[str, list[int]] = {}
        for i in indices:
            groups.setdefault(trajectories[i].group_id or trajectories[i].id, []).append(i)
        order = list(groups.values())
        n = min(getattr(self.cfg, "minibatches", 1), len(order))
        if n > 1:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step)
            order = [order[j] for j in torch.randperm(len(order), generator=g).tolist()]
        return [[i for grp in order[m::n] for i in grp] for m in range(n)]

    @torch.no_grad()
    def _prepare(self, mb: MicroBatch, old_policy: bool, batch: list[Trajectory] = ()) -> dict:
        """What every update of a micro-batch reuses: its images, replayed routes, the reference
        policy's log-probs (KL), with several updates per batch the old policy's log-probs
        (recorded before the first update: the PPO ratio's denominator), and with exact-KL teachers
        each position's weight in their KL term (`batch`: the trajectories `mb.seq_index` indexes; the
        teachers' hidden states, [T, d'] each, are formed at the update, one micro-batch at a time)."""
        media = mb.media(self.model)
        routes = self._replay_routes(mb, media)
        prep = {"media": media, "routes": routes, "prox": None, "ref": None, "distill": ()}
        exact = exact_teachers(self.teachers)
        if exact:
            mb.ready()
            weights = exact_kl_weights(batch, self.teachers, mb.seq_index, mb.mask, mb.agg_weights)
            prep["distill"] = list(zip(exact, weights, strict=True))
        if old_policy:
            with self._qb_paused():
                prep["prox"] = self._forward_logprobs(self.model, mb, routes, media)[0].detach()
        if self.reference is not None:
            prep["ref"] = self._forward_logprobs(self.reference, mb, routes, media)[0]
        return prep

    def _rl_micro_batch(self, mb: MicroBatch, prep: dict, sums: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; adds its statistics to `sums` and
        returns its largest importance ratio."""
        distill = prep["distill"]  # (exact teacher, its weights [T]) pairs
        teachers = [teacher_hidden(self.teachers[k], mb) for k, _ in distill]
        with self._qb_paused(not mb.traj_indices):  # a zero-weight filler is not data
            logp, entropy, *kl = self._forward_logprobs(self.model, mb, prep["routes"], prep["media"],
                                                        distill_from=teachers)
        mb.ready()  # the loss columns, converted on the host while the GPU runs the forward
        if self.loss_cfg.entropy_coef == 0:
            entropy = entropy.detach()  # logged only
        loss, stats = policy_loss(
            logp, mb.behaviour_logp, mb.advantages, mb.mask, mb.agg_weights, mb.seq_index, self.loss_cfg,
            prox_logp=prep["prox"], ref_logp=prep["ref"], entropy=entropy,
        )  # fmt: skip
        if distill:  # exact on-policy distillation: + sum_t coef a_t KL(pi || T)_t, averaged as the policy loss is
            term = sum((w * kl_k).sum() for (_, w), kl_k in zip(distill, kl[0], strict=True))
            loss = loss + term
            stats["loss"] = stats["loss"] + term.detach()
            stats["distill_kl"] = sum(((w > 0) * kl_k).sum() for (_, w), kl_k in zip(distill, kl[0], strict=True))
            stats["distill_tokens"] = sum((w > 0).sum() for _, w in distill)
        # FSDP averages over ranks; the loss is a partial sum (of the rank's micro-batches, and under context
        # parallelism of their positions), so x W makes the gradient the sum over ranks: the whole batch's
        (loss * self.world_size).backward()
        # kept on the device (read once at the end of the step): a read here would make the host wait
        # for this backward before it could queue the next micro-batch or the optimizer
        ratio_max = stats.pop("ratio_max").detach().double()
        for k, v in stats.items():
            sums[k] = sums.get(k, 0) + v.detach().double()
        return ratio_max

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One RL step on a batch of trajectories (groups of samples per prompt): group-relative
        advantages over the whole batch, then `ppo_epochs` passes of `minibatches` optimizer
        updates each (one update by default)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        missing = [t.id for t in trajectories if not t.group_id]
        if missing and cfg.advantage in ("grpo", "grpo_no_std", "rloo"):
            raise ValueError(
                f"{len(missing)} trajectories have no group_id (e.g. {missing[0]}); group-relative advantages "
                "need the samples of one prompt to share a group_id"
            )
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
        overlong = torch.tensor([is_overlong(t) for t in trajectories], dtype=torch.bool)
        malformed = torch.tensor([t.metadata.get("parse_errors", 0) > 0 for t in trajectories], dtype=torch.bool)
        mode = getattr(cfg, "overlong", "none")
        # the overlong and format penalties shape the rewards (learner/advantages.py)
        adv = batch_advantages(trajectories, cfg)  # [N], or [N, C] per token
        if self.teachers:
            adv = distill_advantages(trajectories, adv, self.teachers, cfg.micro_batch_tokens, self.temperature,
                                     self.env_coef)
        keep = [i for i in range(len(trajectories)) if not (mode == "filter" and overlong[i])]
        epochs = getattr(cfg, "ppo_epochs", 1)
        parts = []  # (micro-batches, prepared inputs) of each minibatch
        total_positions = 0
        minis = self._minibatches(keep, trajectories) if keep else []
        old_policy = epochs * len(minis) > 1
        if not self.model.training:  # a walk over every module: host time, the GPU idle
            self.model.train()
        for idx in minis:
            mbs, n = self._micro_batches([trajectories[i] for i in idx], adv[idx])
            total_positions += n
            parts.append((mbs, [self._prepare(mb, old_policy, [trajectories[i] for i in idx]) for mb in mbs]))
        lr = lr_at(self.step, cfg.steps, cfg.lr, cfg.warmup_ratio, cfg.min_lr_ratio) * self.lr_scale

        sums: dict[str, torch.Tensor] = {}
        ratio_max = torch.zeros((), dtype=torch.float64, device=self.device)
        norms, qk = [], {}
        for _ in range(epochs if parts else 0):
            for mbs, preps in parts:
                with self._recording_logits():  # MLA max logits for QK-Clip, when it is on
                    for mb, prep in zip(mbs, preps, strict=True):
                        ratio_max = torch.maximum(ratio_max, self._rl_micro_batch(mb, prep, sums))
                norms.append(self._clip_and_step(lr))
                qk = apply_qk_clip(self.qk_clip, self.max_logits, self.world_size)
        sums = to_host({**all_reduce_sum(sums), "ratio_max": all_reduce_max(ratio_max)})
        ratio_max = sums.pop("ratio_max")
        qb_layers = qb_update(self.model, self.cfg.qb_frozen, self.world_size)
        moon = moon_ep_step(self.model, replan=not self.cfg.moon_ep.plan_per_batch)
        self.step += 1
        self.data_position["trajectories"] += len(trajectories)
        self.data_position["tokens"] += total_positions

        tokens = max(1.0, float(sums.get("tokens", 0)))
        dt = time.perf_counter() - t0
        updates = max(1, len(norms))
        metrics = {
            # loss statistics: means over the updates of the step (each update's loss is a mean)
            "loss": float(sums.get("loss", float("nan"))) / updates,
            "pg_loss": float(sums.get("pg_loss", float("nan"))) / updates,
            "entropy": float(sums["entropy"]) / updates if "entropy" in sums else float("nan"),
            "kl": float(sums["kl"]) / updates if "kl" in sums else 0.0,
            # exact distillation: KL(pi || T) per taught token, the mean over the step's updates
            **({"distill_kl": float(sums["distill_kl"]) / max(1.0, float(sums["distill_tokens"]))}
               if "distill_kl" in sums else {}),
            # token fractions over every update's tokens
            "clip_frac": float(sums.get("clipped", 0)) / tokens,
            "approx_kl": float(sums.get("approx_kl", 0)) / tokens,
            "ratio_masked_frac": float(sums.get("masked", 0)) / tokens,
            "tis_truncated_frac": float(sums.get("truncated", 0)) / tokens,
            "is_ratio_mean": float(sums.get("ratio_sum", 0)) / tokens,
            "is_ratio_max": float(ratio_max),
            "grad_norm": sum(norms) / updates,
            "grad_norm_max": max(norms, default=0.0),
            "updates": float(len(norms)),
            "lr": lr,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(trajectories) > 1 else 0.0,
            "advantage_abs_mean": _abs_mean_over_tokens(adv, trajectories),
            "overlong_frac": float(overlong.double().mean()),
            "malformed_frac": float(malformed.double().mean()),
            "loss_tokens": float(sums.get("tokens", 0)) / epochs,
            "tokens": float(total_positions),
            "sequences": float(len(keep)),
            "micro_batches": float(sum(len(m) for m, _ in parts)),
            "qb_layers_updated": float(qb_layers),
            **qk,
            **moon,
            "step": float(self.step),
            "step_time_s": dt,
            "tokens_per_s": total_positions * epochs / dt if dt > 0 else 0.0,
            **self._prefix_metrics(),
        }
        return metrics

    # ------------------------------------------------------------------------------------
    # SFT
    # ------------------------------------------------------------------------------------
    def sft_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One SFT step: cross-entropy on the loss-mask tokens of demonstration trajectories
        (LR: cosine over `sft_steps` peaking at `sft_lr`, restarted by phases that set `lr`: sft_lr_at)."""
        t0 = time.perf_counter()
        mbs, total_positions = self._micro_batches(trajectories, None)
        lr = sft_lr_at(self.sft_step_count, self.cfg)
        self.model.train()
        sums: dict[str, torch.Tensor] = {}
        with self._recording_logits():
            for mb in mbs:
                media = mb.media(self.model)
                routes = self._replay_routes(mb, media)
                with self._qb_paused(not mb.traj_indices):
                    logp, _ = self._forward_logprobs(self.model, mb, routes, media, temperature=1.0)
                loss, stats = sft_loss(logp, mb.ready().mask, mb.agg_weights)
                (loss * self.world_size).backward()
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0) + v.detach().double()  # read once, after the step
        sums = all_reduce_sum(sums)
        grad_norm = self._clip_and_step(lr)
        sums = to_host(sums)
        qk = apply_qk_clip(self.qk_clip, self.max_logits, self.world_size)
        qb_layers = qb_update(self.model, self.cfg.qb_frozen, self.world_size)
        moon = moon_ep_step(self.model, replan=not self.cfg.moon_ep.plan_per_batch)
        self.sft_step_count += 1
        self.data_position["sft_trajectories"] += len(trajectories)
        self.data_position["tokens"] += total_positions
        dt = time.perf_counter() - t0
        return {
            "loss": float(sums["loss"]),
            "nll": float(sums["nll"]),
            "grad_norm": grad_norm,
            "lr": lr,
            "loss_tokens": float(sums["tokens"]),
            "tokens": float(total_positions),
            "sequences": float(len(trajectories)),
            "micro_batches": float(len(mbs)),
            "qb_layers_updated": float(qb_layers),
            **qk,
            **moon,
            "sft_step": float(self.sft_step_count),
            "step_time_s": dt,
            "tokens_per_s": total_positions / dt if dt > 0 else 0.0,
            **self._prefix_metrics(),
        }

    @torch.no_grad()
    def logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """The current policy's log-prob of every completion token (0.0 where loss_mask is 0)."""
        self.model.eval()
        mbs = build_micro_batches(trajectories, self.cfg.micro_batch_tokens, "token_mean")
        out: list[list[float] | None] = [None] * len(trajectories)
        for mb in mbs:
            mb = mb.to(self.device)
            logp = self._forward_logprobs(self.model, mb, None, mb.media(self.model))[0]
            for s, values in per_completion(logp, mb, trajectories).items():  # segment by segment
                out[s] = values.double().tolist()
        self.model.train()
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------
    # weights and checkpoints
    # ------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Our (unsharded, CPU) state dict; collective under FSDP (call on every rank)."""
        if self.sharded:
            return full_state_dict(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def export_weights(self, version: int, dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20,
                       to_cpu: bool = True, experts: str | None = None) -> WeightUpdate:
        """Every weight under the release's name (`state_dict_adapter.to_hf`), as a versioned WeightUpdate.

        `dtype` casts floating tensors except the fp32 allow-list (docs/model.md §1.5). `experts`:
        "mxfp4" sends the routed experts quantised as the release stores them (weight_packed +
        weight_scale, 4.25 bits a value), "dense" as the model holds them (cast to `dtype`); by
        default "mxfp4" under `model.expert_precision: mxfp4` (the values the learner's forward
        quantises its master weights to), else as the model's weights came (`model.routed_experts_format`:
        "mxfp4" when the learner and the engines started from the release), so the engines keep holding
        what they started with. `to_cpu=False` keeps the tensors where the model is (for a GPU-to-GPU broadcast
        or CUDA IPC). Under FSDP this is collective: call it on every rank (each gets the same update).
        With LoRA: `sync: merged` sends W + (alpha / r) B A for every weight, `sync: adapters` only the
        adapters (learner/export.py; `dtype` and `experts` do not apply)."""
        return export.weight_update(self, version, dtype, bucket_bytes, to_cpu, experts)

    def snapshot(self) -> None:
        """Keep the current weights and optimizer state, in host memory, as the last good policy (the
        collapse guard's, k3rl/guard.py). Under FSDP each rank keeps its own shards."""
        self._good = (_to_host(self.model.state_dict()), _to_host(self.optimizer.state_dict()))

    def restore(self, lr_scale: float) -> dict[str, float]:
        """In place of a training step: return to the last snapshot and train on with the learning rate
        scaled by `lr_scale`. The step counter counts this step (the schedule does not rewind, and the
        job's checkpoint of this step loads as this step); the KL reference is untouched."""
        if self._good is None:
            raise RuntimeError("restore: no snapshot was taken; call snapshot() on a good policy first")
        weights, optim = self._good
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(optim)
        self.lr_scale = lr_scale
        self.step += 1
        return {"guard/restored": 1.0, "lr_scale": lr_scale}

    def save_checkpoint(self, directory) -> None:
        """Model (official HF layout), optimizer, QB state, RNG, counters and data position.
        Collective under FSDP: call on every rank with the same directory."""
        ckpt.save(self, directory)

    def load_checkpoint(self, directory) -> None:
        """Restore everything `save_checkpoint` wrote, so the next step equals the uninterrupted one."""
        ckpt.load(self, directory)
