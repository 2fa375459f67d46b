"""How fast repeated Quantile Balancing steps (Eq. 14, exact) balance a skewed batch (CPU).

    python benchmarks/qb.py --q 64,256,1024,4096,16384 --steps 10

n = 896 experts, k = 16 routes per token, m = q n / k tokens. Scores are skewed random:
s_ij = sigmoid(N(0, 1) + pop_j) with per-expert popularity pop_j spread evenly over
[-spread, spread] (spread 2: the most popular expert gets ~8x its share before QB). Every step
recomputes the bias from the same batch (Eq. 14, mean-centred) and re-routes it; printed is the
worst expert's |load - q| / q, and the mean over experts, after each step.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after an installed k3rl: spawned children must not find the bare k3rl/ first

import torch  # noqa: E402

from k3rl.model.quantile_balance import (
    quantile_balance,  # noqa: E402
    routing_cutoffs,  # noqa: E402
)


def skewed_scores(m: int, n: int, spread: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    popularity = torch.linspace(-spread, spread, n)[torch.randperm(n, generator=g)]
    return torch.sigmoid(torch.randn(m, n, generator=g) + popularity)


def violations(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[float, float]:
    """(max, mean) over experts of |load_j - q| / q, in percent."""
    m, n = scores.shape
    q = m * k / n
    idx, _ = routing_cutoffs(scores, bias, k)
    dev = (torch.bincount(idx.reshape(-1), minlength=n).double() - q).abs() / q * 100
    return float(dev.max()), float(dev.mean())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--q", default="64,256,1024,4096,16384", help="target loads q = m k / n")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--spread", type=float, default=2.0)
    p.add_argument("--n", type=int, default=896)
    p.add_argument("--k", type=int, default=16)
    args = p.parse_args()
    n, k = args.n, args.k
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print(f"# QB convergence {stamp}, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"n = {n}, k = {k}, popularity spread {args.spread}; cells: max % / mean % of |load - q| / q\n")
    head = ["q", "m", "before"] + [f"step {i}" for i in range(1, args.steps + 1)] + ["s / step"]
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---" for _ in head) + " |", flush=True)
    for q in (int(v) for v in args.q.split(",")):
        m = q * n // k
        scores = skewed_scores(m, n, args.spread)
        bias = torch.zeros(n)
        worst, mean = violations(scores, bias, k)
        cells = [f"{worst:.0f} / {mean:.0f}"]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            bias = quantile_balance(scores, bias, k)
            worst, mean = violations(scores, bias, k)
            cells.append(f"{worst:.2f} / {mean:.2f}")
        per_step = (time.perf_counter() - t0) / args.steps
        print(f"| {q} | {m} | " + " | ".join(cells) + f" | {per_step:.1f} |", flush=True)
        del scores


if __name__ == "__main__":
    main()
