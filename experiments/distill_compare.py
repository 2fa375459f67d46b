"""Several `experiments/distill.py` runs in one picture: each run's arms, by seed.

    python experiments/distill_compare.py OUT.png RUN.json [RUN.json ...]

Left: each arm's training reward, the mean of the last 5 steps at every step; right: the held-out success
of one sample per task at the sampling temperature (what RL trains), at the runs' evaluation steps. Arms
of one name share a colour; each (seed, device, rate) a line style.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = sys.argv[1], sys.argv[2:]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    colours, runs_seen, styles = {}, {}, ["-", "--", ":", "-."]
    for path in runs:
        run = json.load(open(path))
        seed, device, lr = run["args"]["seed"], run["args"].get("device", "cpu"), run["args"]["rl_lr"]
        style = styles[runs_seen.setdefault((seed, device, lr), len(runs_seen)) % len(styles)]
        for name, rows in run["arms"].items():
            colour = colours.setdefault(name, f"C{len(colours)}")
            steps = [r["step"] for r in rows[1:]]
            reward = [r["reward"] for r in rows[1:]]
            smooth = [sum(reward[max(0, i - 4):i + 1]) / len(reward[max(0, i - 4):i + 1]) for i in range(len(reward))]
            label = f"{name} (seed {seed}, {device}, lr {lr:g})"
            a.plot(steps, smooth, style, color=colour, label=label)
            ev = [r for r in rows if "eval_sampled_success" in r]
            b.plot([r["step"] for r in ev], [r["eval_sampled_success"] for r in ev], style + "o",
                   color=colour, label=label, markersize=3)
    a.set(xlabel="RL step", ylabel="training reward (mean of the last 5 steps)", title="training episodes")
    b.set(xlabel="RL step", ylabel="held-out success, one sample a task", title="held-out tasks (32)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
