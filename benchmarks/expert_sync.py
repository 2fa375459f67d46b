"""What the weight sync should send for the routed experts: bf16 or MXFP4 (results: BENCHMARKS.md,
"Loading the release"). CPU, k3-tiny and k3-small.

The situation measured is post-training the release: a model whose experts are MXFP4 (here: a
briefly pre-trained model with its experts rounded to MXFP4, as the release ships them) is loaded
by the learner (fp32 master weights) and by the engines (bf16). The learner then takes optimizer
steps (SFT on other text at the project's default LR, a stand-in for RL updates) and syncs the
engines either way:

    dense   the experts in bf16, as the learner holds them (cast): 2 bytes a value
    mxfp4   the experts re-quantised to MXFP4 (weight_packed + weight_scale): 4.25 bits a value

For each, the bytes of one update and the train-inference mismatch on held-out text (teacher
forcing): per token |log p_engine - log p_learner| (the learner's fp32 forward against the
engine's bf16 one) and KL(engine || learner) over the whole vocabulary, averaged over positions.

    .venv/bin/python benchmarks/expert_sync.py
"""

from __future__ import annotations

import os
import platform
import time
from datetime import date
from pathlib import Path

import torch

from k3rl.config import LearnerSection
from k3rl.learner.trainer import Trainer
from k3rl.model import build_model, mxfp4
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.tokenizer import ByteTokenizer
from k3rl.types import Trajectory

ROOT = Path(__file__).resolve().parents[1]
SEQ = 64


def chunks(path: Path, n: int, offset: int = 0) -> list[list[int]]:
    ids = ByteTokenizer().encode(path.read_text())
    return [ids[offset + i * SEQ: offset + (i + 1) * SEQ] for i in range(n)]


def batch(seqs: list[list[int]]) -> list[Trajectory]:
    return [Trajectory(env_id="bench/Text-v0", group_id=f"g{i}", prompt_ids=s[:1], completion_ids=s[1:],
                       logprobs=[0.0] * (len(s) - 1), loss_mask=[1] * (len(s) - 1), versions=[0] * (len(s) - 1))
            for i, s in enumerate(seqs)]


def round_experts(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(mxfp4.dequantize(*mxfp4.quantize(p), p.dtype))


def mismatch(learner, engine_model, ids: torch.Tensor) -> tuple[float, float, float]:
    """(mean |dlogp| on the text's tokens, its 99th percentile, mean KL(engine || learner)) in nats."""
    with torch.no_grad():
        lp_l = torch.log_softmax(learner(ids).float(), -1)[:, :-1]
        lp_e = torch.log_softmax(engine_model(ids).float(), -1)[:, :-1]
    nxt = ids[:, 1:, None]
    d = (lp_e.gather(-1, nxt) - lp_l.gather(-1, nxt)).abs().flatten()
    kl = (lp_e.exp() * (lp_e - lp_l)).sum(-1).mean()
    return d.mean().item(), d.quantile(0.99).item(), kl.item()


def run(preset: str, pre_steps: int, steps: list[int], batch_size: int) -> None:
    torch.manual_seed(0)
    train = chunks(ROOT / "README.md", batch_size * 8)
    later = chunks(ROOT / "docs" / "architecture.md", batch_size * 8)
    held_out = torch.tensor(chunks(ROOT / "docs" / "model.md", 4, offset=20_000))
    # 1. a model that has learnt something (random weights predict nearly uniformly)
    t = time.perf_counter()
    pre = Trainer(build_model(preset, seed=0), LearnerSection(sft_steps=pre_steps, optimizer="adamw", sft_lr=3e-3))
    first = last = None
    for s in range(pre_steps):
        m = pre.sft_step(batch(train[(s * batch_size) % len(train):][:batch_size]))
        first, last = first or m["nll"], m["nll"]
    model = pre.model.eval()
    round_experts(model)  # 2. ... shipped with MXFP4 experts, as the release is
    print(f"\n{preset}: pre-trained {pre_steps} SFT steps (nll {first:.2f} -> {last:.2f}), {time.perf_counter() - t:.0f} s; "
          f"experts rounded to MXFP4")
    # 3. the learner (fp32 master) and the engines (bf16) start from it
    trainer = Trainer(model, LearnerSection(sft_steps=max(steps)))
    trainer.model.routed_experts_format = "mxfp4"
    engines = {fmt: EmbeddedEngine(build_model(preset, dtype="bfloat16"), background=False) for fmt in ("dense", "mxfp4")}
    print("| steps | sync | update MB | experts MB | mean abs dlogp | p99 abs dlogp | KL(engine, learner) |")
    print("|---|---|---|---|---|---|---|")
    done = 0
    for k in steps:
        while done < k:
            trainer.sft_step(batch(later[(done * batch_size) % len(later):][:batch_size]))
            done += 1
        for fmt, engine in engines.items():
            update = trainer.export_weights(k + 1, dtype=torch.bfloat16, experts=fmt)
            experts = sum(t.numel() * t.element_size() for b in update.buckets for n, t in b.tensors.items()
                          if ".experts." in n)
            engine.update_weights(update)
            mean, p99, kl = mismatch(trainer.model.eval(), engine.model, held_out)
            print(f"| {k} | {fmt} | {update.nbytes / 1e6:.2f} | {experts / 1e6:.2f} | {mean:.2e} | {p99:.2e} | {kl:.2e} |")


def main() -> None:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    print(f"{date.today()}, {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
          f"torch {torch.__version__}")
    run("k3-tiny", pre_steps=200, steps=[0, 1, 5, 20], batch_size=8)
    run("k3-small", pre_steps=int(os.environ.get("SMALL_PRE_STEPS", "30")), steps=[0, 1, 5], batch_size=4)


if __name__ == "__main__":
    main()
