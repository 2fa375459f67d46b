"""Synthetic trajectories for the learner tests (token-exact records like the rollout produces)."""

from __future__ import annotations

import gc
import os
import random
import warnings
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

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


@contextmanager
def gloo_group(rank: int, world: int, port: int, timeout: float | None = None):
    """One rank of a loopback gloo group for a spawned test worker: joined on entry, destroyed on exit."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            **({"timeout": timedelta(seconds=timeout)} if timeout else {}))
    try:
        yield
        # a clean end: every rank done (rank 0's writes too) before any tears its pairs down, and the
        # collectives' leftover work objects freed while the interpreter is whole; gloo aborted a rank that
        # tore down alone once in CI ("terminate called without an active exception", SIGABRT)
        dist.barrier()
        gc.collect()
    finally:
        dist.destroy_process_group()
