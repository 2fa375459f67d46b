"""An episode among its training step, as `k3rl replay` shows it: its group (the GRPO samples of one
prompt: every member's reward and the advantage the trainer gave each of its turns), the step's other
episodes by status, and what its reward is made of (the env's `reward_parts`, kept per turn by the
episode loop).

Advantages are recomputed from the stored group with the trainer's own function
(`k3rl.learner.advantages.batch_advantages`) and the run's learner config: group-relative, so the
group's trained members are all it takes. A distillation teacher's term (learner.distill) is not in
them; episodes that were not trained (eval, failed, stale, zero_variance, unused, rolled_back) have none.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from k3rl.learner.advantages import batch_advantages
from k3rl.render_html import env_turns, reward_note, reward_parts  # noqa: F401 - replay's, from here
from k3rl.types import Trajectory

KINDS = ("trained", "eval", "failed")


def kind_of(row: dict[str, Any]) -> str:
    """What `k3rl replay` browses an episode as: failed (it has an error), eval, or trained; else its status."""
    if row.get("error"):
        return "failed"
    return row.get("status") or "trained"


@dataclass
class Member:
    id: str
    reward: float
    status: str
    error: str | None
    turns: int
    generated: int
    advantages: list[float] | None = None  # one per env turn (one number for every turn of an episode method)


@dataclass
class StepView:
    episode: Trajectory
    step: int | None
    group: list[Member]  # the episode's group at this step, itself included, best first
    method: str | None  # learner.advantage; None when the episode was not trained
    counts: dict[str, int] = field(default_factory=dict)  # the step's episodes by kind

    @property
    def member(self) -> Member:
        return next(m for m in self.group if m.id == self.episode.id)

    @property
    def baseline(self) -> float | None:
        """The mean reward of the group's trained members (the grpo baseline)."""
        trained = [m.reward for m in self.group if m.advantages is not None]
        return sum(trained) / len(trained) if trained else None


def step_views(episodes: list[Trajectory], step_episodes: list[Trajectory], learner_cfg: Any) -> dict[str, StepView]:
    """A StepView of each of `episodes` among `step_episodes` (their step's, from the store); `learner_cfg`
    the run's learner section. Each group's advantages are computed once."""
    groups: dict[str, list[Trajectory]] = {}
    for t in step_episodes:
        groups.setdefault(t.group_id or t.id, []).append(t)
    counts = dict(Counter(kind_of({"error": t.error, "status": t.metadata.get("status")}) for t in step_episodes))
    members: dict[str, list[Member]] = {}
    out = {}
    for episode in episodes:
        key = episode.group_id or episode.id
        if key not in members:
            group = groups.get(key) or [episode]
            trained = [t for t in group if t.metadata.get("status") == "trained" and not t.error]
            advantages = per_turn_advantages(trained, learner_cfg) if trained else {}
            members[key] = sorted((Member(t.id, t.reward, t.metadata.get("status") or "-", t.error, t.num_turns,
                                          t.num_generated, advantages.get(t.id)) for t in group),
                                  key=lambda m: (-m.reward, m.id))
        trained_here = episode.metadata.get("status") == "trained" and not episode.error
        out[episode.id] = StepView(episode, episode.metadata.get("step"), members[key],
                                   learner_cfg.advantage if trained_here else None, counts)
    return out


def per_turn_advantages(trained: list[Trajectory], learner_cfg: Any) -> dict[str, list[float]]:
    """Episode id -> the advantage of each of its env turns (assistant turns compaction did not make)."""
    adv = batch_advantages(trained, learner_cfg)
    out = {}
    for i, t in enumerate(trained):
        if adv.dim() == 1:  # one advantage per episode
            out[t.id] = [float(adv[i])] * max(1, sum(1 for turn in env_turns(t)))
            continue
        P, per_turn = len(t.prompt_ids), []
        for turn in env_turns(t):
            lo, hi = max(turn.start - P, 0), max(turn.end - P, 0)
            first = next((k for k in range(lo, hi) if t.loss_mask[k]), None)
            per_turn.append(float(adv[i, first]) if first is not None else 0.0)
        out[t.id] = per_turn
    return out
