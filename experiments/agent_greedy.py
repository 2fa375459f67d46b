"""Held-out greedy success of an agentic policy on examples/agent.yaml's three eval envs, with and without
the modality each needs (the settings of tests/envs/test_agentic_ablations.py), through the episode loop
and the embedded engine. For choosing a warm start before a job is spent on it.

    python experiments/agent_greedy.py POLICY_DIR [--tasks 16] [--envs 0,1,2] [--ablate]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "envs"))
import test_agentic_ablations as ab  # noqa: E402

from k3rl.model import load_hf  # noqa: E402
from k3rl.rollout.engine import EmbeddedEngine  # noqa: E402

NAMES = ["ScreenRead", "PythonTool", "LongHorizon"]
ABLATIONS = [({"blank_images": True}, []), ({"tool_available": False}, []), ({}, ["rollout.context.strategy=none"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policy", type=Path)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--envs", default="0,1,2")
    ap.add_argument("--ablate", action="store_true", help="also play each env without its modality")
    a = ap.parse_args()
    ab.TASKS = a.tasks
    torch.manual_seed(0)
    eng = EmbeddedEngine(load_hf(a.policy, dtype=torch.float32), max_num_seqs=a.tasks)
    ab.engine = lambda: eng
    for i in map(int, a.envs.split(",")):
        eps = ab.play(i)
        rewards = [round(t.reward, 2) for t in eps]
        line = f"{NAMES[i]:12s} success {ab.success(eps):.2f} reward {sum(rewards) / len(rewards):.2f}"
        if i == 0:
            line += f" read rate {ab.read_rate(eps):.2f}"
        if a.ablate:
            kwargs, overrides = ABLATIONS[i]
            off = ab.play(i, overrides, **kwargs)
            line += f" | without its modality: success {ab.success(off):.2f}"
        print(line, rewards, flush=True)


if __name__ == "__main__":
    main()
