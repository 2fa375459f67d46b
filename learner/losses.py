"""RL and SFT objectives for the learner.

Every per-token tensor here is flat over the tokens of a (packed) micro-batch: `[T]`, with
`mask` 1 on the tokens that carry a loss (sampled assistant tokens) and 0 elsewhere.

Three log-probabilities of each sampled token y_t meet in the policy loss:
    logp       log pi_theta(y_t)        the policy being trained (carries the gradient)
    prox       log pi_prox(y_t)         the "old" policy of the PPO ratio (detached)
    behaviour  log mu(y_t)              what the rollout engine recorded when it sampled y_t

    r_t   = exp(logp - prox)            PPO / CISPO ratio
    rho_t = exp(prox - behaviour)       off-policy ratio (staleness + engine mismatch)

Decoupled form (algorithm "grpo" and "cispo"): prox is the policy at the start of this
step (logp detached, one update per batch), and the gap to the behaviour policy is
corrected by truncated importance sampling, w = min(rho, cap) per token, or
min(exp(sum_t log rho_t), cap) per sequence. Tokens with rho_t outside
[ratio_mask_low, ratio_mask_high] are masked out. Algorithm "ppo" takes the behaviour
policy as the old policy (prox = behaviour, so rho = 1) and lets the clip bound staleness.

Per-token terms:
    PPO (asymmetric clip):  pg_t = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
    CISPO:                  pg_t = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp
    KL (k3 estimator):      kl_t = exp(ref - logp) - (ref - logp) - 1            (>= 0)
    entropy:                H_t  = logsumexp(z) - sum_v softmax(z)_v z_v
    total:                  l_t  = keep_t [ w_t pg_t + kl_coef kl_t - entropy_coef H_t ]

Aggregation weights a_t (computed once for the whole step, so micro-batches and data-
parallel ranks add up to exactly the full-batch value):
    token_mean: a_t = 1 / N_tokens                 (loss-mask tokens of the whole batch)
    seq_mean:   a_t = 1 / (N_seqs * n_tokens(seq(t)))
    constant:   a_t = 1 / (N_seqs * L)             L = loss_norm_tokens, a constant (Dr. GRPO)
    loss = sum_t a_t l_t
seq_mean weighs a token of a short sequence more than one of a long sequence, so among
wrong answers (A < 0) the long ones are penalised less per token, and among right ones the
short are favoured: a length bias. token_mean weighs every token alike but ties a sequence's
weight to the batch. Dr. GRPO (Liu et al., 2025) removes both: a constant L, and advantages
without the std division (`advantage: grpo_no_std`), which also drops the bias towards
groups of low reward spread.

Several updates per batch (`ppo_epochs` x `minibatches`): the old policy's log-probs are
recorded once, before the first update, and passed as `prox_logp`; from the second update
on, r_t != 1 and the clip bounds how far each batch moves the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "LossConfig",
    "aggregation_weights",
    "group_advantages",
    "importance_weights",
    "kl_k3",
    "policy_loss",
    "sft_loss",
    "token_entropy",
    "token_logprobs",
]


@dataclass(frozen=True)
class LossConfig:
    algorithm: Literal["grpo", "cispo", "ppo"] = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    tis_cap: float = 2.0
    tis_level: Literal["token", "sequence", "none"] = "token"
    ratio_mask_low: float = 0.0
    ratio_mask_high: float = 10.0
    loss_agg: Literal["token_mean", "seq_mean", "constant"] = "token_mean"

    def __post_init__(self):
        if self.algorithm not in ("grpo", "cispo", "ppo"):
            raise ValueError(f"LossConfig: algorithm must be grpo, cispo or ppo, got {self.algorithm!r}")
        if self.tis_level not in ("token", "sequence", "none"):
            raise ValueError(f"LossConfig: tis_level must be token, sequence or none, got {self.tis_level!r}")
        if self.loss_agg not in ("token_mean", "seq_mean", "constant"):
            raise ValueError(f"LossConfig: loss_agg must be token_mean, seq_mean or constant, got {self.loss_agg!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("LossConfig: clip_low and clip_high must be >= 0")
        if self.tis_cap <= 0:
            raise ValueError(f"LossConfig: tis_cap must be > 0, got {self.tis_cap}")
        if not self.ratio_mask_low < self.ratio_mask_high:
            raise ValueError(
                f"LossConfig: ratio_mask_low ({self.ratio_mask_low}) must be below ratio_mask_high ({self.ratio_mask_high})"
            )

    @classmethod
    def from_section(cls, section) -> LossConfig:
        """From a `k3rl.config.LearnerSection`."""
        return cls(**{k: getattr(section, k) for k in cls.__dataclass_fields__})


# ----------------------------------------------------------------------------------------
# advantages
# ----------------------------------------------------------------------------------------
def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence,
    method: Literal["grpo", "grpo_no_std", "rloo"] = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages, one per sequence.

    grpo:         A_i = (r_i - mean_g) / (std_g + eps)   std_g the unbiased (n-1) std of the group
    grpo_no_std:  A_i = r_i - mean_g                     (Dr. GRPO)
    rloo:         A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g)
    A group of one sample has no baseline: its advantage is 0.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D, got shape {tuple(r.shape)}")
    if len(group_ids) != r.numel():
        raise ValueError(f"group_advantages: {len(group_ids)} group ids for {r.numel()} rewards")
    if method not in ("grpo", "grpo_no_std", "rloo"):
        raise ValueError(f"group_advantages: method must be grpo, grpo_no_std or rloo, got {method!r}")
    index: dict = {}
    gid = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    G = len(index)
    n = torch.zeros(G, dtype=torch.float64).index_add_(0, gid, torch.ones_like(r))
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, gid, r) / n
    centred = r - mean[gid]
    single = n[gid] < 2
    if method == "grpo":
        var = torch.zeros(G, dtype=torch.float64).index_add_(0, gid, centred**2) / (n - 1).clamp_min(1)
        adv = centred / (var.sqrt()[gid] + eps)
    elif method == "grpo_no_std":
        adv = centred
    else:
        adv = centred * n[gid] / (n[gid] - 1).clamp_min(1)
    return torch.where(single, torch.zeros_like(adv), adv).float()


# ----------------------------------------------------------------------------------------
# per-token quantities from logits
# ----------------------------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[y] in fp32: z_y - logsumexp(z). logits [T, V], targets [T] -> [T]."""
    z = logits.float()
    return z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v, in fp32. [T, V] -> [T]."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per sampled token: exp(d) - d - 1 with d = ref - logp."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


# ----------------------------------------------------------------------------------------
# aggregation and importance sampling
# ----------------------------------------------------------------------------------------
def aggregation_weights(mask: torch.Tensor, seq_index: torch.Tensor, mode: str, num_seqs: int | None = None,
                        norm_tokens: int | None = None) -> torch.Tensor:
    """Per-token weights a_t such that sum_t a_t l_t is the token mean, the sequence mean or
    the constant-normalised sum of l over the loss tokens of the batch (see the module
    docstring). Tokens of sequences without loss tokens get weight 0. `seq_index` [T] numbers
    the sequences 0..S-1; `norm_tokens` is L of mode "constant"."""
    m = mask.to(torch.float64)
    if mode == "token_mean":
        total = m.sum()
        return (m / total.clamp_min(1)).float()
    if mode in ("seq_mean", "constant"):
        S = int(num_seqs if num_seqs is not None else (int(seq_index.max()) + 1 if seq_index.numel() else 0))
        per_seq = torch.zeros(S, dtype=torch.float64).index_add_(0, seq_index.long(), m)
        n_seqs = (per_seq > 0).sum().clamp_min(1)
        if mode == "seq_mean":
            return (m / (per_seq[seq_index.long()].clamp_min(1) * n_seqs)).float()
        if not norm_tokens or norm_tokens < 1:
            raise ValueError(f"aggregation_weights: mode 'constant' needs norm_tokens >= 1, got {norm_tokens!r}")
        return (m / (norm_tokens * n_seqs)).float()
    raise ValueError(f"aggregation_weights: mode must be token_mean, seq_mean or constant, got {mode!r}")


def importance_weights(
    prox_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Truncated IS weights against the behaviour policy, and the ratio mask.

    Returns (w [T], keep [T] (bool), rho [T], untruncated w [T]) with rho_t = exp(prox - behaviour) per token,
    keep_t = mask_t and ratio_mask_low <= rho_t <= ratio_mask_high, and
      token level:    w_t = min(rho_t, cap)
      sequence level: w_t = min(exp(sum_{s in seq(t), kept} log rho_s), cap)
      none:           w_t = 1.
    """
    log_rho = (prox_logp - behaviour_logp).detach().float() * mask
    rho = torch.exp(log_rho)
    keep = mask.bool() & (rho >= cfg.ratio_mask_low) & (rho <= cfg.ratio_mask_high)
    if cfg.tis_level == "token":
        raw = rho
    elif cfg.tis_level == "sequence":
        S = int(seq_index.max()) + 1 if seq_index.numel() else 0
        seq_log = torch.zeros(S, dtype=log_rho.dtype, device=log_rho.device)
        seq_log.index_add_(0, seq_index.long(), log_rho * keep)
        raw = torch.exp(seq_log)[seq_index.long()]
    else:
        raw = torch.ones_like(rho)
    return raw.clamp(max=cfg.tis_cap), keep, rho, raw


# ----------------------------------------------------------------------------------------
# the objectives
# ----------------------------------------------------------------------------------------
def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    agg_weights: torch.Tensor,
    seq_index: torch.Tensor,
    cfg: LossConfig,
    *,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The RL loss of one micro-batch: sum_t a_t l_t (see the module docstring).

    `prox_logp` defaults to logp.detach() for "grpo"/"cispo" and to `behaviour_logp` for
    "ppo". `ref_logp` is needed when cfg.kl_coef > 0; `entropy` [T] when
    cfg.entropy_coef != 0 (it is logged whenever given).

    Returns (loss, stats): stats are *sums* over this micro-batch, so that micro-batches
    and ranks add up: `pg_loss`, `kl`, `entropy`, `loss` (a-weighted sums), and the counts
    `tokens`, `clipped`, `masked`, `truncated`, `ratio_sum`, plus `ratio_max`.
    """
    if not (logp.shape == behaviour_logp.shape == advantages.shape == mask.shape == agg_weights.shape):
        raise ValueError(
            "policy_loss: logp, behaviour_logp, advantages, mask and agg_weights must share one shape [T]; got "
            f"{[tuple(t.shape) for t in (logp, behaviour_logp, advantages, mask, agg_weights)]}"
        )
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logp (log-probs of the reference policy)")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("policy_loss: entropy_coef != 0 needs the per-token entropy")
    maskf = mask.float()
    if prox_logp is None:
        prox_logp = behaviour_logp if cfg.algorithm == "ppo" else logp
    prox_logp = prox_logp.detach()
    w, keep, rho, raw_w = importance_weights(prox_logp, behaviour_logp, maskf, seq_index, cfg)
    keepf = keep.float()

    ratio = torch.exp(logp - prox_logp)  # r_t = pi_theta / pi_prox
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    A = advantages.float()
    if cfg.algorithm == "cispo":
        coef = ratio.detach().clamp(lo, hi)  # sg(clip(r))
        pg = -coef * A * logp
        clipped = (ratio.detach() < lo) | (ratio.detach() > hi)
    else:
        unclipped = ratio * A
        clipped_obj = ratio.clamp(lo, hi) * A
        pg = -torch.minimum(unclipped, clipped_obj)
        clipped = ((A > 0) & (ratio.detach() > hi)) | ((A < 0) & (ratio.detach() < lo))

    per_token = w * pg
    a = agg_weights.float() * keepf
    stats: dict[str, torch.Tensor] = {"pg_loss": (a * pg * w).sum().detach()}
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp.detach())
        stats["kl"] = (a * kl).sum().detach()
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None:
        stats["entropy"] = (a * entropy).sum().detach()
        if cfg.entropy_coef != 0:
            per_token = per_token - cfg.entropy_coef * entropy
    loss = (a * per_token).sum()
    stats["loss"] = loss.detach()
    stats["tokens"] = maskf.sum()
    stats["clipped"] = (clipped.float() * keepf).sum()
    stats["masked"] = (maskf - keepf).sum()
    stats["truncated"] = ((raw_w > cfg.tis_cap).float() * keepf).sum()
    stats["ratio_sum"] = (rho * maskf).sum()
    # how far this update moved from the old policy: k3 estimate of KL(pi_theta || pi_prox), summed
    stats["approx_kl"] = (kl_k3(logp.detach(), prox_logp) * keepf).sum()
    stats["ratio_max"] = (rho * maskf).max() if maskf.numel() else torch.zeros(())
    return loss, stats


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, agg_weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy on the loss-mask tokens: sum_t a_t (-logp_t)."""
    a = agg_weights.float() * mask.float()
    loss = -(a * logp).sum()
    return loss, {"loss": loss.detach(), "nll": loss.detach(), "tokens": mask.float().sum()}
