"""torch threads on a shared CPU: a k3-tiny training step (forward and backward, 8 x 300 tokens) on 1 and 2
threads, with OpenMP's active (spinning, the default) and passive wait, alone and beside a second process
doing the same (what the warm start meets when another job or a test shares the machine;
learner/free_cores.py sizes its threads from this).

    python benchmarks/threads.py            # the table (about a minute on 2 cores)
    python benchmarks/threads.py --step 2   # one process: its step time on 2 threads (what the table runs)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def step_time(threads: int, reps: int = 4) -> float:
    import torch

    from k3rl.model.factory import build_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (8, 300))
    model = build_model("k3-tiny", seed=0)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        model(input_ids=ids).float().square().mean().backward()  # the logits
        times.append(time.perf_counter() - t)
    return min(times[1:])


def run(threads: int, policy: str, beside: bool) -> list[float]:
    """Step times of one process (or of two at once, `beside`)."""
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    cmd = [sys.executable, __file__, "--step", str(threads)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2 if beside else 1)]
    return [float(p.communicate()[0].split()[-1]) for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", type=int, help="print one process's step time on this many threads")
    args = ap.parse_args()
    if args.step:
        print(f"{step_time(args.step):.3f}")
        return
    print(f"cores {len(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.2f}")
    print("| threads | OMP_WAIT_POLICY | alone (s) | beside a second such process (s) |")
    print("|---|---|---|---|")
    for policy in ("ACTIVE", "PASSIVE"):
        for threads in (1, 2):
            alone = run(threads, policy, False)[0]
            beside = max(run(threads, policy, True))
            print(f"| {threads} | {policy} | {alone:.2f} | {beside:.2f} |", flush=True)


if __name__ == "__main__":
    main()
