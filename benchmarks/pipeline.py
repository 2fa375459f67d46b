"""Asynchronous vs synchronous RL pipeline throughput on a long-tailed episode mix.

    python benchmarks/pipeline.py --steps 6 --lags 0,2

Runs the real job (local Ray, embedded k3-tiny engine, learner, buffer, MLflow) on
KeyLookup with a simulated long-tailed environment latency: every env step first waits
`delay * lognormal(0, sigma)` seconds (sandbox starts and slow tools in real agentic RL).
The same budget (steps x prompts x group) runs with `max_policy_lag` 0 (synchronous:
a step's episodes start only after the previous weights are in the engine) and with a
larger lag (asynchronous: rollouts of the next steps overlap training and stragglers).

Reported per lag: episodes/s over the RL steps, the learner's idle fraction (time spent
waiting for rollouts / step time), and the mean staleness of the trained tokens.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after an installed k3rl: spawned children must not find the bare k3rl/ first


def run(lag: int, args, root: Path) -> dict:
    from k3rl.config import JobConfig
    from k3rl.job import run_job

    cfg = JobConfig.load(None, [
        f"name=pipe-lag{lag}", "model.preset=k3-tiny", f"rollout.group_size={args.group}",
        f"rollout.prompts_per_step={args.prompts}", "rollout.episodes_per_worker=64",
        f"rollout.num_rollout_workers={args.workers}", "rollout.sampling.max_tokens_per_turn=32",
        "rollout.max_context_tokens=512", f"rollout.max_policy_lag={lag}", "envs.max_turns=3",
        "envs.train.0.id=k3rl/KeyLookup-v0", f"envs.train.0.kwargs.step_delay_s={args.delay}",
        f"envs.train.0.kwargs.step_delay_sigma={args.sigma}", f"learner.steps={args.steps}",
        "learner.checkpoint_every=0", "learner.sft_steps=0", "tracking.sample_episodes=0",
        f"tracking.runs_dir={root}/runs", f"tracking.uri=sqlite:///{root}/runs/mlflow.db",
    ])
    t0 = time.monotonic()
    summary = run_job(cfg, quiet=True)
    wall = time.monotonic() - t0
    h = summary["history"]
    step_s = sum(m["time/step_s"] for m in h)
    wait_s = sum(m["time/wait_for_rollouts_s"] for m in h)
    episodes = sum(args.prompts * args.group for _ in h)
    return {
        "lag": lag, "steps": len(h), "episodes": episodes, "rl_seconds": step_s, "job_seconds": wall,
        "episodes_per_s": episodes / step_s, "learner_idle": wait_s / step_s,
        "staleness": sum(m.get("staleness/mean", 0.0) for m in h) / len(h),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lags", default="0,2")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--delay", type=float, default=0.3, help="median env-step latency, seconds")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the latency (tail)")
    args = ap.parse_args()
    import ray

    root = Path(tempfile.mkdtemp(prefix="k3rl-pipeline-"))
    results = []
    try:
        for lag in (int(x) for x in args.lags.split(",")):
            results.append(run(lag, args, root))
            ray.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# pipeline: {args.steps} RL steps x {args.prompts} prompts x {args.group} samples, k3-tiny on CPU, "
          f"env latency {args.delay}s x lognormal(0, {args.sigma})")
    print("| max_policy_lag | episodes/s | learner idle | mean staleness | RL seconds |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['lag']} | {r['episodes_per_s']:.2f} | {r['learner_idle']:.0%} | {r['staleness']:.2f} | "
              f"{r['rl_seconds']:.1f} |")
    if len(results) > 1:
        print(f"async / sync episodes/s: {results[-1]['episodes_per_s'] / results[0]['episodes_per_s']:.2f}x")


if __name__ == "__main__":
    main()
