"""`k3rl/Agent-v0` in a real job (Ray, the embedded engine, MLflow SQLite, the Parquet store): the demo's
warm start trains through the three example harnesses in turn (envs.mix: cycle), with a held-out eval:
examples/agents/openai_loop.py (a user's `openai` tool loop), compacting_agent.py (it rewrites its history:
segments) and sandboxed_agent.py (`sandboxed: true`: it runs inside the rollout worker's pooled sandboxes)."""

from __future__ import annotations

import functools

import pytest

from k3rl.config import JobConfig

pytestmark = pytest.mark.slow
LOOP = "k3rl.examples.agents.openai_loop"
AGENT = f"{{id: k3rl/Agent-v0, kwargs: {{agent: '{LOOP}:solve', tasks: '{LOOP}:task'}}}}"
COMPACTING = f"{{id: k3rl/Agent-v0, kwargs: {{agent: 'k3rl.examples.agents.compacting_agent:solve', tasks: '{LOOP}:task'}}}}"
SANDBOXED = (f"{{id: k3rl/Agent-v0, kwargs: {{agent: 'k3rl.examples.agents.sandboxed_agent:solve', tasks: '{LOOP}:task', "
             "sandboxed: true}}")


def _cfg(out) -> JobConfig:
    from pathlib import Path  # the config's own folder: the demo's warm start is read relative to it

    return JobConfig.load(Path(__file__).resolve().parents[1] / "examples" / "demo.yaml", [
        "name=agent-job", f"envs.train=[{AGENT}, {COMPACTING}, {SANDBOXED}]", "envs.mix=cycle", f"envs.eval=[{AGENT[:-1]}, num_tasks: 8, pass_k: 1}}]",
        "learner.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4", "learner.checkpoint_every=0",
        "tracking.eval_every=0", "tracking.sample_episodes=1", f"tracking.runs_dir={out}/runs",
        f"tracking.uri=sqlite:///{out}/runs/mlflow.db", "ray.num_cpus=4"])


def _job(out):
    from k3rl.job import run_job

    return functools.partial(run_job, _cfg(out), quiet=True)


BACKGROUND_JOBS = {"agent_job": _job}


@pytest.mark.background("agent_job")
def test_a_users_openai_agent_trains_in_a_job(background_job):
    from k3rl.store import TrajectoryStore

    summary, out = background_job
    assert summary["completed"] and summary["steps"] == 3, summary
    trained = TrajectoryStore(out / "runs" / "agent-job", readonly=True).read(status="trained")
    assert len(trained) == 3 * 16 and all(t.env_id == "k3rl/Agent-v0" for t in trained)
    # each is the tokens of its agent's model calls
    assert all(t.metadata["model_calls"] >= 1 and t.num_generated > 0 for t in trained if t.error is None)
    assert sum(t.error is None for t in trained) >= 40, [t.error for t in trained if t.error]
    # 12 prompts cycled over the three harnesses: the compacting one's episodes that called the model more than
    # once trained as segments, one a call (how many called twice is the policy's: 16 of 16 in runs here). Its
    # groups are the slowest (up to 4 calls, each a fresh context): `rollout.stragglers: wait` trains them; under
    # `drop` a run here trained none (12 stale, 4 unused), as CI once saw
    assert sum("compacting_agent" in t.metadata["env_kwargs"]["agent"] for t in trained) >= 4
    by_calls = [len(t.segment_starts) == t.metadata["model_calls"] - 1 > 0 for t in trained if t.error is None]
    assert sum(by_calls) >= 1, by_calls
    first = summary["eval"][0]  # before RL: the warm start plays the harness
    assert first["eval/Agent-v0/success"] > 0, summary["eval"]
    assert all(m["tokens"] > 0 for m in summary["history"])
