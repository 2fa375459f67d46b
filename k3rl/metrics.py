"""Step metrics, from the small per-episode stats the driver sees (never whole trajectories).

Policy versions, one convention everywhere:

    version 0      the engines' own seeded init (serves only the untrained evaluation)
    version s      the policy that training step s (1, 2, ...) updates; the initial weights
                   (after the optional SFT warm start) are version 1, and step s pushes s + 1
    staleness      of a trained token = s - (version that sampled it); 0 is on-policy, and the
                   scheduler keeps it <= rollout.max_policy_lag for every trained token

A Trajectory's `versions` hold, per completion token, the version that sampled it (-1 for
tokens the model did not sample); the store's `policy_version` of an episode is the oldest
version that sampled any of its tokens, and its `step` is the step that trained it.

Held-out evaluation (`envs.eval`) logged at step s measures the policy after s RL steps, version
s + 1 (step 0: the warm-started policy, before the first RL step); `eval_metrics`.
"""

from __future__ import annotations

import math
from typing import Any

from rich.table import Table

from k3rl.types import Trajectory


def episode_stats(traj: Trajectory) -> dict[str, Any]:
    """What the driver learns of one finished episode (a few numbers; the tokens stay behind)."""
    gen = [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m]
    return {
        "id": traj.id, "group_id": traj.group_id, "env_id": traj.env_id, "reward": float(traj.reward),
        "error": traj.error, "failed_at": traj.metadata.get("failed_at"), "truncated": bool(traj.truncated),
        "turns": traj.num_turns, "tokens": len(traj.token_ids), "generated": len(gen),
        "min_version": min(gen) if gen else None, "max_version": max(gen) if gen else None,
        "version_sum": sum(gen), "seconds": float(traj.timings.get("episode_s", 0.0)),
        "parse_errors": int(traj.metadata.get("parse_errors", 0)), "images": len(traj.images),
        "timings": {k: float(v) for k, v in traj.timings.items()},
    }


def success(reward: float) -> bool:
    """An episode succeeded when it earned the full reward (1)."""
    return reward >= 1.0 - 1e-6


def trainable(stats: dict[str, Any]) -> bool:
    """An episode enters the loss only when it did not fail and has sampled tokens."""
    return not stats.get("error") and stats.get("generated", 0) > 0


def step_metrics(batch: list[dict[str, Any]], step: int) -> dict[str, float]:
    """Reward, success, length and staleness of the episodes trained at `step` (by env too), and
    the share of the batch's episodes that failed (stored, never trained)."""
    trained = [s for s in batch if trainable(s)]
    if not trained:
        return {}
    n = len(trained)
    rewards = [s["reward"] for s in trained]
    m = _mean_std("reward", rewards)
    m["episodes/success_rate"] = sum(map(success, rewards)) / n
    m["episodes/failed_rate"] = 1.0 - n / len(batch)
    m["episodes/truncated_rate"] = sum(bool(s.get("truncated")) for s in trained) / n
    # episodes with a malformed assistant message: the first sign of a policy losing its format
    m["episodes/format_error_rate"] = sum(s.get("parse_errors", 0) > 0 for s in trained) / n
    m["episodes/turns"] = sum(s["turns"] for s in trained) / n
    m["episodes/tokens"] = sum(s["tokens"] for s in trained) / n
    m["episodes/generated_tokens"] = sum(s["generated"] for s in trained) / n
    tokens = sum(s["generated"] for s in trained)
    if tokens:
        m["staleness/mean"] = step - sum(s["version_sum"] for s in trained) / tokens
        m["staleness/max"] = float(step - min(s["min_version"] for s in trained if s["generated"]))
    by_env: dict[str, list[float]] = {}
    for s in trained:
        by_env.setdefault(s["env_id"], []).append(s["reward"])
    for env_id, rs in by_env.items():
        m.update(_mean_std(f"reward/{env_id.replace('/', '_')}", rs))
    m.update(episode_time(batch))
    return m


def episode_time(batch: list[dict[str, Any]]) -> dict[str, float]:
    """Where the batch's episodes spent their time, summed over them (they run concurrently, so these add
    up to more than a step): `episode_time/<phase>_s` for waiting on the engine (generate), the env's steps
    (env), and the env's own phases inside them: sandbox calls, acquiring a sandbox, rendering screens,
    resets."""
    out: dict[str, float] = {}
    for s in batch:
        for phase, seconds in (s.get("timings") or {}).items():
            out[f"episode_time/{phase}"] = out.get(f"episode_time/{phase}", 0.0) + seconds
    return out


def rollout_metrics(stats: list[dict[str, Any]], version: int) -> dict[str, float]:
    """Reward and success of a set of episodes that are not trained (the untrained evaluation)."""
    if not stats:
        return {}
    m = _mean_std("reward", [s["reward"] for s in stats])
    m["episodes/success_rate"] = sum(success(s["reward"]) for s in stats) / len(stats)
    m["episodes/failed"] = float(sum(bool(s.get("error")) for s in stats))
    m["policy_version"] = float(version)
    return m


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c succeeded (Chen et al. 2021):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that k of the n samples, drawn without replacement, hold at least one success."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(name: str, k: int, tasks: list[list[dict[str, Any]]], version: int) -> dict[str, float]:
    """The held-out metrics of one eval env. `tasks`: per task, the stats of its greedy episode first,
    then of its n sampled ones. A failed episode counts as reward 0, no success. pass@k is logged as
    `pass_at_<k>`: MLflow allows no '@' in a metric's name; pass@1 (the success rate at the policy's
    temperature, which RL raises when the greedy policy already succeeds) always, beside it."""
    greedy = [t[0] for t in tasks]

    def pass_at(j: int) -> float:
        return sum(pass_at_k(len(t) - 1, sum(success(s["reward"]) for s in t[1:]), j) for t in tasks) / len(tasks)

    return {f"eval/{name}/success": sum(success(s["reward"]) for s in greedy) / len(tasks),
            f"eval/{name}/reward": sum(s["reward"] for s in greedy) / len(tasks),
            # pass@1 = the sampled policy's own success rate (c / n per task), beside pass@k
            f"eval/{name}/pass_at_1": pass_at(1),
            f"eval/{name}/pass_at_{k}": pass_at(k),
            f"eval/{name}/failed": float(sum(bool(s.get("error")) for t in tasks for s in t)),
            "eval/policy_version": float(version)}


def _mean_std(prefix: str, xs: list[float]) -> dict[str, float]:
    mean = sum(xs) / len(xs)
    return {f"{prefix}/mean": mean, f"{prefix}/std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))}


def step_table(step: int, total: int, m: dict[str, float]) -> Table:
    """The live table the driver shows (one row: the last step)."""
    t = Table(title=f"k3rl train — step {step}/{total}", show_header=True, header_style="bold")
    cols = {"reward": ("reward/mean", ".3f"), "success": ("episodes/success_rate", ".2f"),
            "turns": ("episodes/turns", ".2f"), "gen tok/s": ("throughput/rollout_tokens_per_s", ".0f"),
            "train tok/s": ("throughput/train_tokens_per_s", ".0f"), "staleness": ("staleness/mean", ".2f"),
            "sync s": ("time/weight_sync_s", ".2f"), "loss": ("loss", ".4f"), "failed": ("episodes/failed", ".0f"),
            "restarts": ("workers/restarts", ".0f")}
    for col in cols:
        t.add_column(col, justify="right")
    t.add_row(*(format(m.get(key, float("nan")), fmt) for key, fmt in cols.values()))
    return t
