"""Synthetic trajectories for the learner tests (token-exact records like the rollout produces)."""

from __future__ import annotations

import random

from k3rl.types import Trajectory


def make_trajectories(seed: int, n: int = 8, group_size: int = 4, vocab: int = 256, max_prompt: int = 10,
                      max_completion: int = 20, version: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        P, C = rng.randint(3, max_prompt), rng.randint(4, max_completion)
        out.append(
            Trajectory(
                env_id="test/Synthetic-v0",
                group_id=f"s{seed}-g{i // group_size}",
                prompt_ids=[rng.randrange(vocab) for _ in range(P)],
                completion_ids=[rng.randrange(vocab) for _ in range(C)],
                logprobs=[-rng.uniform(4.5, 6.5) for _ in range(C)],
                loss_mask=[1 if rng.random() < 0.8 else 0 for _ in range(C)],
                versions=[version] * C,
                reward=rng.random(),
            )
        )
    return out
