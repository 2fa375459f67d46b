"""Per-Head Muon or AdamW for LoRA adapters: SFT of a LoRA-adapted k3-tiny (CPU).

    python experiments/lora_optimizer.py --steps 40

Two tasks, each step one `Trainer.sft_step` (cosine LR over the steps, peak from a 3-point grid
per optimizer), LoRA r=8, alpha=16 on attention, shared experts and latent projections:
  fit   the same 16 byte sequences every step (8 random printable bytes, then the same bytes
        again): how fast the adapters fit a fixed batch; score = its completion NLL at the end
  copy  a fresh batch of such sequences every step; score = the completion NLL of a held-out batch
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from k3rl.config import LearnerSection, LoraSection  # noqa: E402
from k3rl.learner.trainer import Trainer  # noqa: E402
from k3rl.model import build_model  # noqa: E402
from k3rl.types import Trajectory  # noqa: E402

GRIDS = {"muon": [1e-2, 3e-2, 1e-1], "adamw": [3e-3, 1e-2, 3e-2]}


def copy_batch(rng: random.Random, n: int = 16, length: int = 8) -> list[Trajectory]:
    out = []
    for i in range(n):
        prompt = [rng.randrange(32, 127) for _ in range(length)]
        completion = [*prompt, 10]
        out.append(Trajectory(env_id="bench/Copy-v0", group_id=f"g{i}", prompt_ids=prompt, completion_ids=completion,
                              logprobs=[0.0] * len(completion), loss_mask=[1] * len(completion),
                              versions=[0] * len(completion), reward=1.0))
    return out


def held_out_nll(trainer: Trainer, batch: list[Trajectory]) -> float:
    lps = trainer.logprobs(batch)
    return -sum(sum(x) for x in lps) / sum(len(x) for x in lps)


def run(task: str, optimizer: str, lr: float, steps: int, seed: int = 0) -> tuple[float, float]:
    torch.manual_seed(seed)
    section = LearnerSection(sft_lr=lr, sft_steps=steps, micro_batch_tokens=512, routing_replay=False,
                             lora=LoraSection(rank=8, alpha=16, optimizer=optimizer))
    trainer = Trainer(build_model("k3-tiny", seed=seed), section)
    rng, held_out = random.Random(1 + seed), copy_batch(random.Random(99 + seed))
    start = held_out_nll(trainer, held_out)
    for _ in range(steps):
        trainer.sft_step(held_out if task == "fit" else copy_batch(rng))
    return start, held_out_nll(trainer, held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tasks", default="fit,copy")
    parser.add_argument("--seed", type=int, default=0, help="of the model's init and the data")
    parser.add_argument("--lrs", default="", help="optimizer=lr,... to run instead of the grids, e.g. muon=0.03,adamw=0.01")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [(o, float(lr)) for o, lr in (x.split("=") for x in args.lrs.split(",") if x)]
    runs = runs or [(o, lr) for o, grid in GRIDS.items() for lr in grid]
    for task in args.tasks.split(","):
        for optimizer, lr in runs:
            t0 = time.perf_counter()
            start, end = run(task, optimizer, lr, args.steps, args.seed)
            print(f"{task:4s} {optimizer:6s} lr={lr:g} seed {args.seed}: NLL {start:.3f} -> {end:.3f} after "
                  f"{args.steps} steps ({time.perf_counter() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
