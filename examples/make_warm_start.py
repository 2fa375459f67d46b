"""Store a job's policy after its SFT as a warm start that ships with k3rl, like `agent_warm_start/`:
the HF-layout checkpoint a job wrote (`RUN_DIR/checkpoints/step-000000/model` with `learner.steps=0`, or
any step's), reloaded in bf16 (half the bytes of fp32; the fp32 allow-list stays fp32) and written again.
A job loads it into its own `model.dtype`.

    python -m k3rl.examples.make_warm_start runs/agent-from-scratch examples/agent_warm_start
    python -m k3rl.examples.make_warm_start runs/agent-from-scratch/checkpoints/step-000010/model out/
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from k3rl.model import load_hf, save_hf


def model_dir(source: Path) -> Path:
    """The checkpoint directory of `source`: itself when it holds config.json, else a run folder's
    newest `checkpoints/step-*/model`."""
    if (source / "config.json").is_file():
        return source
    steps = sorted((source / "checkpoints").glob("step-*/model"))
    if not steps:
        raise SystemExit(f"{source} is neither a checkpoint directory (config.json) nor a run folder with "
                         f"checkpoints/step-*/model")
    return steps[-1]


def make_warm_start(source: Path, out: Path) -> Path:
    model = load_hf(model_dir(source), dtype=torch.bfloat16)
    return save_hf(model, out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="a run folder, or a checkpoint directory (config.json)")
    ap.add_argument("out", type=Path, help="the warm start's directory")
    args = ap.parse_args()
    out = make_warm_start(args.source, args.out)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"warm start written to {out} ({size / 2**20:.1f} MiB)")
