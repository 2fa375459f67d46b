"""Shared-prefix training against packing every sample whole: the learner's step time and peak memory.

    # CPU, a tiny shape (a check that it runs; CPU timings say little about a GPU)
    python benchmarks/shared_prefix.py --preset k3-tiny --groups 2 --group-sizes 4 --prompts 256 --completions 32
    # the threshold of learner.shared_prefix: auto on a shared CPU (CPU seconds, one thread), sweeping the
    # saved fraction by the prompt/completion ratio: what set shared_prefix_min_fraction's 0.05
    python benchmarks/shared_prefix.py --preset k3-tiny --groups 2 --group-sizes 4 8 --prompts 1 2 4 8 16 32 \
        --completions 48 --micro-batch-tokens 4096 --steps 12 --warmup 2 --clock process --threads 1
    # one H200 (issue 25, item 4): k3-small, groups of 8 and 16, shared prompts of 1K, 4K and 16K tokens
    python benchmarks/shared_prefix.py --preset k3-small --device cuda --group-sizes 8 16 --prompts 1024 4096 16384 \
        --completions 256 --json shared_prefix.json
    # the same with MLA's Triton flash kernel (the prefix's keys read in place, not copied per branch)
    python benchmarks/shared_prefix.py --preset k3-small --device cuda --group-sizes 16 --prompts 4096 16384 \
        --completions 256 --attention-kernel flash --json shared_prefix_flash.json
    # one H200, the threshold again (shared_prefix_min_fraction wants this, not the CPU's): saved fractions
    # from 0 (prompt 1: the control, nothing shared) through 0.02, 0.04, 0.08, 0.15 to 0.25 (group of 4; a
    # little more at 16); the tree pays from the first fraction whose ratio beats the control's
    python benchmarks/shared_prefix.py --preset k3-small --device cuda --groups 8 --group-sizes 4 16 \
        --prompts 1 32 64 128 256 512 --completions 1024 --micro-batch-tokens 16384 --steps 10 --json threshold.json

Each case is one RL batch of `--groups` groups, every sample of a group with the same prompt of P tokens
and a completion of its own of C tokens (loss on the completion). The same batch is trained with
`learner.shared_prefix` off (each sample packed whole) and on (each group's prompt run once, forked to
its samples: learner/prefix_tree.py), alternately (packed, tree, tree, packed, ...), `--steps` times each after `--warmup` steps of each,
on one model; the step is `Trainer.train_step` (forward, loss, backward, clipping, the optimizer). The
report: median step seconds of each, their ratio, the tokens each forward ran, the shared fraction, and
on CUDA the peak memory allocated in a step of each (reset before it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time

import torch

if importlib.util.find_spec("k3rl") is None:  # not installed: the source tree (an installed k3rl wins)
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3rl.config import LearnerSection  # noqa: E402
from k3rl.learner.trainer import Trainer  # noqa: E402
from k3rl.model import K3Config, K3ForCausalLM  # noqa: E402
from k3rl.types import Trajectory  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grouped_batch(groups: int, size: int, prompt: int, completion: int, seed: int) -> list[Trajectory]:
    """`groups` x `size` trajectories: one prompt a group, a completion a sample (byte-range ids: never
    the media placeholder)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        p = [rng.randrange(256) for _ in range(prompt)]
        for _ in range(size):
            out.append(Trajectory(
                env_id="bench", group_id=f"g{g}", prompt_ids=p,
                completion_ids=[rng.randrange(256) for _ in range(completion)],
                logprobs=[-5.7 + rng.uniform(-0.3, 0.3) for _ in range(completion)],
                loss_mask=[1] * completion, versions=[0] * completion, reward=rng.random(),
            ))  # fmt: skip
    return out


def timed_step(trainer: Trainer, batch: list[Trajectory], device: torch.device,
               clock=time.perf_counter) -> tuple[float, float | None, dict]:
    """(seconds, peak GiB allocated during the step on CUDA, the step's metrics)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t = clock()
    metrics = trainer.train_step(batch)
    sync(device)
    seconds = clock() - t
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak, metrics


# wall: seconds a step takes; process: the CPU seconds this process spent in it (all its threads), which
# other work on a shared CPU moves less than the wall clock (use it with --threads 1 there)
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def run_case(model, args, device, size: int, prompt: int, completion: int) -> dict:
    bf16 = args.bf16 if args.bf16 is not None else device.type == "cuda"
    seq = prompt + completion - 1  # positions a sample packs
    budget = args.micro_batch_tokens or max(seq, 16)
    trainers = {}
    for shared in (False, True):
        cfg = LearnerSection(micro_batch_tokens=budget, bf16=bf16, routing_replay=False, shared_prefix=shared,
                             activation_checkpointing=args.activation_checkpointing, optimizer="adamw", lr=1e-6,
                             steps=10**6)  # fmt: skip
        trainers[shared] = Trainer(model, cfg, device=device)  # one model: the two see the same weights
    batch = grouped_batch(args.groups, size, prompt, completion, seed=size * 100_003 + prompt + 7 * completion)
    times = {False: [], True: []}
    peaks = {False: [], True: []}
    metrics = {}
    for i in range(args.warmup + args.steps):
        # alternated, in the order packed, tree, tree, packed, ...: drift on the machine and whatever the
        # step before leaves behind (caches, the allocator) hit both alike
        for shared in ((False, True) if i % 2 == 0 else (True, False)):
            s, peak, m = timed_step(trainers[shared], batch, device, CLOCKS[args.clock])
            if i >= args.warmup:
                times[shared].append(s)
                peaks[shared].append(peak)
            metrics[shared] = m
    packed, tree = statistics.median(times[False]), statistics.median(times[True])
    on = metrics[True]
    return {
        "group_size": size, "groups": args.groups, "prompt": prompt, "completion": completion,
        "positions": int(on["tokens"]),
        "tree_tokens": int(on["tokens"] - on["learner/shared_prefix_tokens_saved"]),
        "shared_fraction": on["learner/shared_prefix_fraction"],
        # what learner.shared_prefix: auto compares with shared_prefix_min_fraction: tokens saved / positions
        "saved_fraction": on["learner/shared_prefix_tokens_saved"] / on["tokens"],
        "packed_step_s": packed, "shared_step_s": tree, "speedup": packed / tree,
        "packed_peak_gib": max(peaks[False]) if device.type == "cuda" else None,
        "shared_peak_gib": max(peaks[True]) if device.type == "cuda" else None,
        "micro_batch_tokens": budget, "micro_batches": {"packed": metrics[False]["micro_batches"],
                                                        "shared": on["micro_batches"]},
    }  # fmt: skip


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny", choices=["k3-tiny", "k3-small"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--groups", type=int, default=1, help="groups a batch")
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096, 16384], help="shared prompt lengths")
    ap.add_argument("--completions", type=int, nargs="+", default=[256], help="completion lengths (each a case)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="default: one sample's positions (prompt + completion - 1), so packing whole runs one "
                         "sample a micro-batch and the tree a group's prompt and as many branches as fit")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on for cuda")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="process: CPU seconds of this process, for a CPU shared with other work")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--attention-kernel", default="sdpa", choices=["sdpa", "flash"],
                    help="MLA's attention on the GPU: SDPA (the shared prefix copied per branch) or the Triton flash "
                         "kernel (read in place)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.device(device):
        model = K3ForCausalLM(K3Config.preset(args.preset).model_copy(update={"attention_kernel": args.attention_kernel}))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.preset} on {name}; {args.groups} group(s) a batch; {args.clock} seconds, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'G':>3} {'prompt':>6} {'compl':>5} {'positions':>9} {'tree':>7} {'shared':>6} {'saved':>5} "
          f"{'packed s':>9} {'shared s':>9} {'x':>5} {'peak GiB packed/shared':>22}")
    results = []
    for size in args.group_sizes:
        for completion in args.completions:
            for prompt in args.prompts:
                r = run_case(model, args, device, size, prompt, completion)
                results.append(r | {"preset": args.preset, "device": name, "bf16": args.bf16, "clock": args.clock,
                                    "attention_kernel": args.attention_kernel,
                                    "threads": torch.get_num_threads()})
                mem = "-" if r["packed_peak_gib"] is None else f"{r['packed_peak_gib']:.2f}/{r['shared_peak_gib']:.2f}"
                print(f"{size:>3} {prompt:>6} {completion:>5} {r['positions']:>9} {r['tree_tokens']:>7} "
                      f"{r['shared_fraction']:>6.2f} {r['saved_fraction']:>5.2f} {r['packed_step_s']:>9.3f} "
                      f"{r['shared_step_s']:>9.3f} {r['speedup']:>5.2f} {mem:>22}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
