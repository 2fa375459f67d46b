"""Advantages of a step's episodes: one per episode, or one per turn (`learner.advantage`).

Episode advantages (grpo, grpo_no_std, rloo; learner.losses.group_advantages): one number per
episode from its reward, baselined within its group (the episodes of one prompt). An episode cut
into context segments (rollout.context) is still one episode: the group baseline is over
episodes, and every segment, the summarisation turn included, trains with the episode's
advantage.

Per-turn advantages (turn_grpo, turn_grpo_no_std), from the env's step rewards r_0 .. r_{T-1}
of an episode's T environment turns (Turn.reward of its assistant turns):

    G_k   = sum_{j >= k} gamma^(j - k) r_j                    discounted return from turn k
    b_k   = mean of G_k over the group's episodes that have a turn k
    A_k   = G_k - b_k                                         turn_grpo_no_std
    A_k   = (G_k - b_k) / (std_k + eps)                       turn_grpo (std_k: unbiased, over the same episodes)

A_k is broadcast to the sampled tokens of turn k. The step rewards are the env's, as it gave
them: an episode the loop truncated has reward 0 as a whole (what grpo trains on), but the steps
that earned a reward before the cut keep it here. A shaped episode reward (an overlong penalty)
adds its difference to the episode's last env turn. The format penalty (learner.format_penalty)
is charged to the turn that wrote the malformed message (r_k - penalty where turn k's message
could not be parsed or was cut), not to the episode's end: a turn after it did nothing wrong.
Why it matters (docs/learning.md, "Malformed messages buy retries"): an env that answers a
malformed message with an error and a new turn gives the malformed turn the return of a second
try, above that of a wrong answer, so without the penalty per-turn credit learns to write them. A turn index reached by a single episode of
its group has no baseline: A_k = 0 there (as group_advantages gives a group of one). A
summarisation turn is no env step: it gets the advantage of the env turn that follows it (the
last env turn when none follows).

The bias of a per-turn-index baseline, written down:
  * survivor bias: turn k exists only in episodes that lasted more than k turns, so b_k is the
    mean return of the survivors, not of the group. With a terminal reward (r only at the
    end, gamma = 1: G_k = R for every k) a long episode is compared at its late turns only
    with other long episodes: if long episodes fail more often, their late turns get a low
    baseline and a less negative advantage than their early turns, where the short successful
    episodes pull the baseline up. Equal-length groups have no such bias.
  * std normalisation reweights turns by index: dividing by std_k makes every turn index
    weigh the same however much its returns vary, so late indices, estimated from few
    survivors (small, noisy std_k), get large advantages. turn_grpo_no_std keeps the returns'
    own scale; with few long episodes prefer it, or a larger group.
  * the discount: gamma < 1 makes early turns of long episodes see less of the final reward.
"""

from __future__ import annotations

import torch

from k3rl.types import Trajectory

from .losses import group_advantages

TURN_METHODS = ("turn_grpo", "turn_grpo_no_std")

__all__ = ["TURN_METHODS", "batch_advantages", "env_turn_rewards", "is_overlong", "step_advantages", "token_advantages",
           "turn_advantages", "turn_returns"]


def turn_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_k = r_k + gamma G_{k+1}: the discounted return from each turn."""
    out, g = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        g = rewards[k] + gamma * g
        out[k] = g
    return out


def env_turn_rewards(t: Trajectory, format_penalty: float = 0.0) -> list[float]:
    """The step rewards of an episode's env turns (its assistant turns that compaction did not make),
    each less `format_penalty` where the turn's message was malformed (Turn.error: unparsable or cut)."""
    return [turn.reward - (format_penalty if turn.error else 0.0)
            for turn in t.turns if turn.role == "assistant" and turn.compaction is None]


def turn_advantages(turn_rewards: list[list[float]], group_ids: list[str], gamma: float = 1.0,
                    normalise: bool = True, eps: float = 1e-6) -> list[list[float]]:
    """A_k of every turn of every episode (see the module doc), from each episode's step rewards."""
    if len(turn_rewards) != len(group_ids):
        raise ValueError(f"turn_advantages: {len(group_ids)} group ids for {len(turn_rewards)} episodes")
    returns = [turn_returns(r, gamma) for r in turn_rewards]
    at: dict[tuple[str, int], list[float]] = {}  # the group's returns at each turn index
    for g, gs in zip(group_ids, returns, strict=True):
        for k, gk in enumerate(gs):
            at.setdefault((g, k), []).append(gk)
    out = []
    for g, gs in zip(group_ids, returns, strict=True):
        adv = []
        for k, gk in enumerate(gs):
            xs = at[(g, k)]
            if len(xs) < 2:  # nobody to compare with
                adv.append(0.0)
                continue
            mean = sum(xs) / len(xs)
            a = gk - mean
            if normalise:
                a /= (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 + eps
            adv.append(a)
        out.append(adv)
    return out


def token_advantages(t: Trajectory, per_turn: list[float]) -> torch.Tensor:
    """[len(completion_ids)]: each sampled token gets its turn's advantage (a summarisation turn
    the next env turn's); tokens not sampled get 0."""
    out = torch.zeros(len(t.completion_ids))
    P = len(t.prompt_ids)
    k = 0
    for turn in t.turns:
        if turn.role != "assistant" or turn.compaction == "carried":
            continue
        a = per_turn[min(k, len(per_turn) - 1)] if per_turn else 0.0
        lo, hi = max(turn.start - P, 0), max(turn.end - P, 0)
        out[lo:hi] = a * torch.tensor(t.loss_mask[lo:hi], dtype=torch.float32)
        if turn.compaction is None:
            k += 1
    return out


def step_advantages(trajectories: list[Trajectory], rewards: torch.Tensor | list[float], method: str,
                    gamma: float = 1.0, format_penalty: float = 0.0) -> torch.Tensor:
    """What `build_micro_batches` takes: [N] episode advantages from `rewards` (grpo, grpo_no_std,
    rloo), or [N, C] per-token advantages (turn_grpo*; C the longest completion). `rewards` may be
    shaped (e.g. an overlong penalty): per turn, the difference to the episode's reward is added
    to its last env turn. `format_penalty` (per turn only; episode methods take it in `rewards`) is
    subtracted from each malformed turn's reward."""
    group_ids = [t.group_id for t in trajectories]
    if method not in TURN_METHODS:
        return group_advantages(rewards, group_ids, method)
    missing = [t.id for t in trajectories if not t.group_id]
    if missing:
        raise ValueError(f"{len(missing)} trajectories have no group_id (e.g. {missing[0]}); per-turn advantages "
                         "need the samples of one prompt to share a group_id")
    shaped = torch.as_tensor(rewards, dtype=torch.float64).tolist()
    turn_rewards = []
    for t, r in zip(trajectories, shaped, strict=True):
        rs = env_turn_rewards(t, format_penalty)
        if rs:
            rs[-1] += r - t.reward
        turn_rewards.append(rs)
    per_turn = turn_advantages(turn_rewards, group_ids, gamma, normalise=method == "turn_grpo")
    out = torch.zeros(len(trajectories), max(len(t.completion_ids) for t in trajectories))
    for i, (t, a) in enumerate(zip(trajectories, per_turn, strict=True)):
        out[i, :len(t.completion_ids)] = token_advantages(t, a)
    return out


def is_overlong(t: Trajectory) -> bool:
    """Cut by the per-turn token limit or the context (not by max_turns or the env)."""
    return t.truncated and t.metadata.get("truncated_by") in ("max_tokens", "context")


def batch_advantages(trajectories: list[Trajectory], cfg) -> torch.Tensor:
    """The advantages the trainer gives a batch before any distillation term, from the learner section `cfg`
    (`learner.advantage`, `overlong`, `format_penalty`, `turn_gamma`): [N], or [N, C] per token. The
    format guard: per episode, an episode with a malformed message earns `format_penalty` less; per turn,
    the malformed turn does. `k3rl replay` shows a group's advantages with this same function."""
    shaped = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
    if getattr(cfg, "overlong", "none") == "penalty":
        shaped = shaped - cfg.overlong_penalty * torch.tensor([is_overlong(t) for t in trajectories], dtype=torch.bool)
    penalty = getattr(cfg, "format_penalty", 0.0)
    if cfg.advantage not in TURN_METHODS:
        malformed = torch.tensor([t.metadata.get("parse_errors", 0) > 0 for t in trajectories], dtype=torch.bool)
        shaped = shaped - penalty * malformed
    return step_advantages(trajectories, shaped, cfg.advantage, getattr(cfg, "turn_gamma", 1.0), format_penalty=penalty)
