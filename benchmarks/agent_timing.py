"""Where an RL job's time goes, read back from its MLflow run: throughput, the driver's step (waiting for
rollouts, learner forward/backward, weight sync, eval) and the rollout side's episode-seconds (waiting on the
engine, the env's steps and, inside them, sandbox calls, acquiring sandboxes, rendering screens), with the
engine's own counters (prefill, decode, MoonViT's image encoding, images encoded against images sent).

    python benchmarks/agent_timing.py RUN [--tracking-uri sqlite:///runs/mlflow.db] [--skip 2] [--json out.json]

RUN is a run name or id. The first `--skip` steps are left out (start-up: compiles, pools filling). Episodes run
concurrently, so their seconds add up to more than a step: they are shown per step and as shares of the
episodes' total.
"""

from __future__ import annotations

import argparse
import json
import statistics

from rich.console import Console
from rich.table import Table

from k3rl.tracking import find_run, metric_history, mlflow_client

DRIVER = [("time/wait_for_rollouts_s", "waiting for rollouts (learner idle)"),
          ("time/train_s", "learner forward/backward + optimizer"),
          ("time/weight_sync_s", "weight sync to the engines"),
          ("time/eval_s", "held-out evaluation")]
EPISODE = [("episode_time/generate_s", "waiting on the engine (generate)"),
           ("episode_time/env_s", "env steps and resets, of which:"),
           ("episode_time/sandbox_s", "  sandbox calls (exec, read, write)"),
           ("episode_time/sandbox_acquire_s", "  acquiring a sandbox"),
           ("episode_time/render_s", "  rendering screenshots"),
           ("episode_time/reset_s", "  resets")]
ENGINE = [("engine/prefill_s", "prefill (host s)"), ("engine/vision_s", "  of which MoonViT image encoding"),
          ("engine/decode_s", "decode + sampling (host s)"), ("engine/admit_s", "admission (host s)")]


def per_step(series: dict[int, float], steps: list[int], cumulative: bool = False) -> list[float]:
    if not cumulative:
        return [series[s] for s in steps if s in series]
    return [series[s] - series[s - 1] for s in steps if s in series and s - 1 in series]


def timing(run_ref: str, tracking_uri: str, skip: int) -> dict:
    client = mlflow_client(tracking_uri)
    run = find_run(client, run_ref)
    keys = set(run.data.metrics)

    def series(key: str) -> dict[int, float]:
        return dict(metric_history(client, run.info.run_id, key)) if key in keys else {}

    step_s = series("time/step_s")
    steps = sorted(s for s in step_s if s > skip)
    if not steps:
        raise SystemExit(f"run {run_ref} has no RL steps after step {skip}")
    mean = lambda key, cum=False: statistics.mean(per_step(series(key), steps, cum) or [0.0])  # noqa: E731
    out = {"run": run.info.run_name, "run_id": run.info.run_id, "steps": len(steps), "skipped": skip,
           "step_s": mean("time/step_s"),
           "episodes_per_s": mean("throughput/episodes_per_s"),
           "generated_tokens_per_s": mean("throughput/rollout_tokens_per_s"),
           "trained_tokens_per_s_of_train_time": mean("throughput/train_tokens_per_s"),
           "images_per_episode": mean("throughput/images_per_episode"),
           "driver": {k: mean(k) for k, _ in DRIVER}, "episodes": {k: mean(k) for k, _ in EPISODE},
           "engine": {k: mean(k, True) for k, _ in ENGINE}}
    images = per_step(series("engine/images_encoded"), steps, True)
    hits = per_step(series("engine/prefix_hit_images"), steps, True)
    out["engine"]["images_encoded"] = statistics.mean(images or [0.0])
    out["engine"]["images_from_prefix_cache"] = statistics.mean(hits or [0.0])
    return out


def share_table(title: str, unit: str, rows: list[tuple[str, str]], values: dict[str, float], total: float) -> Table:
    """Each row's value and its share of `total`."""
    table = Table(title=title)
    table.add_column("phase")
    table.add_column(unit, justify="right")
    table.add_column("share", justify="right")
    for key, label in rows:
        table.add_row(label, f"{values[key]:.2f}", f"{values[key] / max(total, 1e-9):.0%}")
    return table


def show(t: dict, console: Console) -> None:
    console.print(f"[bold]{t['run']}[/]: {t['steps']} steps after step {t['skipped']}; a step {t['step_s']:.1f} s, "
                  f"{t['episodes_per_s']:.2f} episodes/s, {t['generated_tokens_per_s']:.0f} generated tok/s, "
                  f"{t['images_per_episode']:.2f} images an episode")
    total = t["episodes"]["episode_time/generate_s"] + t["episodes"]["episode_time/env_s"]
    console.print(share_table("a step's wall clock (the driver)", "s / step", DRIVER, t["driver"], t["step_s"]))
    console.print(share_table("the episodes' seconds (concurrent: they add up to more than a step)",
                              "episode-s / step", EPISODE, t["episodes"], total))
    table = Table(title="the engine (host seconds per step; counts per step)")
    table.add_column("counter")
    table.add_column("per step", justify="right")
    for key, label in ENGINE:
        table.add_row(label, f"{t['engine'][key]:.2f}")
    table.add_row("images encoded by MoonViT", f"{t['engine']['images_encoded']:.1f}")
    table.add_row("images found in a cached prefix state", f"{t['engine']['images_from_prefix_cache']:.1f}")
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--tracking-uri", default="sqlite:///runs/mlflow.db")
    ap.add_argument("--skip", type=int, default=2, help="leave out the first steps (start-up)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()
    t = timing(args.run, args.tracking_uri, args.skip)
    show(t, Console())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(t, f, indent=1)


if __name__ == "__main__":
    main()
