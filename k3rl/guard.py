"""The collapse guard: roll a policy back when its sampled messages stop parsing.

What it guards against (docs/learning.md, "Why the warm-started policy loses its format"): an RL
update pushes down tokens the policy was sure of in failing episodes, the next batch samples
malformed messages in those contexts, fails, and pushes further; within a few steps the format
error rate climbs and the reward with it. The reward alone does not bring the format back.

The signal is the share of a batch's episodes with a malformed assistant message
(`episodes/format_error_rate`), which every batch has. A batch is judged *before* it is trained
on, so the verdict is on the policy that sampled it:

    baseline   b = mean rate of the first `baseline_steps` batches (the warm-started policy)
    unhealthy  rate > b + max_rise
    ok         the policy that sampled the batch is kept as the last good one (a snapshot)
    rollback   `patience` unhealthy batches in a row: the learner returns to the last good
               snapshot, its learning rate is multiplied by `lr_factor`, the batch is not trained
    collapse   a rollback beyond `max_rollbacks`: the job ends with an error saying what to change

With max_policy_lag > 0 a batch may mix the last two versions; the verdict is then on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Verdict = Literal["ok", "hold", "rollback"]

__all__ = ["CollapseError", "FormatGuard", "Verdict"]


class CollapseError(RuntimeError):
    """The policy collapsed more often than `learner.guard.max_rollbacks` allows."""


@dataclass
class FormatGuard:
    baseline_steps: int = 3
    max_rise: float = 0.25
    patience: int = 2
    lr_factor: float = 0.5
    max_rollbacks: int = 3
    seen: list[float] = field(default_factory=list)
    unhealthy_run: int = 0
    rollbacks: int = 0

    @classmethod
    def from_config(cls, section) -> FormatGuard:
        return cls(section.baseline_steps, section.max_rise, section.patience, section.lr_factor,
                   section.max_rollbacks)

    @property
    def baseline(self) -> float | None:
        if len(self.seen) < self.baseline_steps:
            return None
        return sum(self.seen[: self.baseline_steps]) / self.baseline_steps

    @property
    def lr_scale(self) -> float:
        return self.lr_factor ** self.rollbacks

    def observe(self, format_error_rate: float) -> Verdict:
        """The verdict on the policy that sampled a batch with this format error rate."""
        self.seen.append(format_error_rate)
        base = self.baseline
        if base is None or format_error_rate <= base + self.max_rise:
            self.unhealthy_run = 0
            return "ok"
        self.unhealthy_run += 1
        if self.unhealthy_run < self.patience:
            return "hold"  # unhealthy, not yet for long enough: train on, keep the last good snapshot
        self.unhealthy_run = 0
        self.rollbacks += 1
        if self.rollbacks > self.max_rollbacks:
            raise CollapseError(
                f"the policy's format collapsed {self.rollbacks} times (format error rate {format_error_rate:.2f} "
                f"against a baseline of {base:.2f} + learner.guard.max_rise {self.max_rise}), after "
                f"{self.max_rollbacks} rollbacks with the learning rate cut to {self.lr_factor ** self.max_rollbacks:g}x; "
                f"lower learner.lr, raise learner.kl_coef or learner.format_penalty, or sample at a lower "
                f"rollout.sampling.temperature")
        return "rollback"

    def metrics(self) -> dict[str, float]:
        m = {"guard/rollbacks": float(self.rollbacks), "guard/lr_scale": self.lr_scale}
        if self.baseline is not None:
            m["guard/baseline"] = self.baseline
        return m
