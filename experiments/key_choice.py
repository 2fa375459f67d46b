"""Which key a KeyLookup policy looks up, per training step and held-out eval, from a run's stored episodes.

    python experiments/key_choice.py runs/<run> [--every 5]

For each eval (greedy `Eg`, sampled `Es`, the untrained policy's `Eu`) and each window of training steps (`T`): the share of episodes
whose first lookup was the requested key (`req`), the task's other key (`other`), or a key the task does
not have (`bad`: the policy did not copy a key from the prompt), and the share of each letter looked up.
A policy that reads the prompt has bad near 0; one that has collapsed onto a letter shows it in the
letters whatever was asked (docs/learning.md, "What the policy looks up").
"""

from __future__ import annotations

import argparse
import collections
import glob
import json

import pyarrow.parquet as pq


def first_lookup(turns: list[dict]) -> str | None:
    for t in turns:
        if t["tool_calls"]:
            args = t["tool_calls"][0]["arguments"]
            try:
                return (json.loads(args) if isinstance(args, str) else args).get("key")
            except (ValueError, AttributeError):
                return "?"
    return None


def key_choice(run_dir: str, every: int = 5) -> dict[tuple[str, int], dict[str, float]]:
    rows = [r for f in sorted(glob.glob(f"{run_dir}/trajectories/*.parquet")) for r in pq.read_table(f).to_pylist()]
    counts: dict[tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        if r["status"] == "eval" and r["policy_version"] == 0:
            where = ("Eu", 0)  # the untrained policy's eval (before the warm start)
        elif r["status"] == "eval":
            where = ("Eg" if r["id"].endswith("greedy") else "Es", r["step"])
        else:
            where = ("T", (r["step"] - 1) // every * every + 1)
        keys, asked = str(r["task_id"]).split("|")
        keys, look = keys.split(), first_lookup(r["turns"])
        c = counts[where]
        c["n"] += 1
        c["req"] += look == asked
        c["other"] += look in keys and look != asked
        c["bad"] += look not in keys
        c[f"key {look}"] += 1
    return {w: {k: (v if k == "n" else v / c["n"]) for k, v in sorted(c.items())} for w, c in sorted(counts.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--every", type=int, default=5, help="training steps a row")
    args = ap.parse_args()
    for (kind, step), c in key_choice(args.run_dir, args.every).items():
        letters = " ".join(f"{k.removeprefix('key ')}:{v:.2f}" for k, v in c.items() if k.startswith("key "))
        print(f"{kind:2} {step:3}  n={c['n']:4}  req {c['req']:.2f}  other {c['other']:.2f}  bad {c['bad']:.2f}  | {letters}")


if __name__ == "__main__":
    main()
