"""What an agentic run's episodes chose, per env and step: the choices RL can learn against the copying it
cannot. Reads a run's trajectory store (training episodes and held-out eval episodes apart):

    ScreenRead   the requested panel shown first, or another one
    PythonTool   the task's own product run (`print(a*b)`), the sum instead (`print(a+b)`, the careless
                 oracle's choice), another program (a miscopied number), or no tool at all
    LongHorizon  a summary that keeps a code (`code D`) or not, and episodes cut short (context, turns)

    python experiments/agent_choices.py RUN_DIR [--steps 0,12,24]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

from k3rl.store import TrajectoryStore


def first_call(turns) -> dict | None:
    calls = [c for t in turns if t.role == "assistant" for c in t.tool_calls]
    return calls[0].arguments if calls else None


def classify(trajectory) -> list[str]:
    """The labels of one episode (see the module's docstring)."""
    turns, env = trajectory.turns, trajectory.env_id
    labels = ["success"] if trajectory.reward >= 0.999 else []
    if "ScreenRead" in env:
        wanted = re.search(r"read (\w)", turns[0].text).group(1)
        call = first_call(turns)
        labels.append("right panel" if call and call.get("panel") == wanted else "other panel")
    elif "PythonTool" in env:
        a, b = turns[0].text.split("*")
        code = (first_call(turns) or {}).get("code")
        labels.append({None: "no tool", f"print({a}*{b})": "a*b", f"print({a}+{b})": "a+b"}.get(code, "miscopied"))
    elif "LongHorizon" in env:
        summaries = [t.text for t in turns if t.compaction == "summary"]
        labels.append("summary keeps a code" if any(s.startswith("code") for s in summaries) else "summary drops it")
        if trajectory.truncated:
            labels.append("cut short")
    return labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--steps", help="comma-separated steps to show (default: all)")
    a = ap.parse_args()
    keep = {int(s) for s in a.steps.split(",")} if a.steps else None
    counts: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for t in TrajectoryStore(a.run, readonly=True).read():
        step = t.metadata.get("step", 0)
        if keep is not None and step not in keep:
            continue
        kind = "eval" if t.metadata.get("status") == "eval" else "train"
        c = counts[(kind, step, t.env_id.split("/")[-1])]
        c["episodes"] += 1
        c.update(classify(t))
    for (kind, step, env), c in sorted(counts.items()):
        n = c.pop("episodes")
        print(f"{kind:5} step {step:3} {env:15} {n:3} episodes: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))


if __name__ == "__main__":
    main()
