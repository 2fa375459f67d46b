"""`envs:` the training envs, the held-out evaluation and the modules that register envs."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from .base import _refuse, _Section

# built-in envs whose observations hold images (the vLLM engine cannot take them)
IMAGE_ENVS = ("k3rl/ChartMatch-v0", "k3rl/ScreenRead-v0")


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
    mix: Literal["sample", "cycle"] = Field(
        "sample", description="how a group's env is chosen from envs.train: sample (at random by weight) or cycle "
                              "(in turn, each env as many times a round as its whole-number weight: with weights "
                              "2, 1, 1 groups cycle A B C A; every env in every step of a multiple of the round's "
                              "length of prompts)")
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

    def env_of_group(self, index: int, rng) -> EnvSpec:
        """The training env of prompt group `index` (`rng`: the group's own random stream)."""
        if self.mix == "cycle":
            rounds = self.cycle()
            return rounds[index % len(rounds)]
        return rng.choices(self.train, weights=[e.weight for e in self.train])[0]

    def cycle(self) -> list[EnvSpec]:
        """envs.mix cycle's round: pass r takes every env whose weight is over r (weights 2, 1, 1: A B C A)."""
        return [e for r in range(int(max(e.weight for e in self.train))) for e in self.train if e.weight > r]

    @model_validator(mode="after")
    def _cycle_weights(self):
        if self.mix == "cycle":
            _refuse([(f"train.{i}.weight", f"{e.weight} with envs.mix: cycle, which takes each env as many times a "
                                            f"round as its weight; use a whole number (1, 2, ...), or envs.mix: "
                                            f"sample")
                     for i, e in enumerate(self.train) if e.weight != int(e.weight) or e.weight < 1])
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
