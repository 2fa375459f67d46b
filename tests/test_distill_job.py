"""`k3rl train` with learner.distill.teachers through the real loop (Ray, the embedded engine, MLflow
on SQLite): the learner loads the teacher from its checkpoint and its per-token advantage enters
the steps; a teacher checkpoint of another architecture is refused at start, by field path."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def train(tmp_path, name: str, teacher: str, *extra: str) -> subprocess.CompletedProcess:
    runs, uri = tmp_path / "runs", f"sqlite:///{tmp_path}/runs/mlflow.db"
    sets = [f"name={name}", "model.preset=k3-tiny", "rollout.group_size=2", "rollout.prompts_per_step=2",
            "rollout.sampling.max_tokens_per_turn=16", "rollout.max_context_tokens=512", "envs.max_turns=1",
            "rollout.max_policy_lag=0", "learner.steps=2", "learner.checkpoint_every=0", "learner.sft_steps=0",
            "learner.micro_batch_tokens=2048", f"learner.distill.teachers=[{{checkpoint: {teacher}, coef: 0.5}}]",
            f"tracking.runs_dir={runs}", f"tracking.uri={uri}", "ray.num_cpus=4", *extra]
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "k3rl.cli", "train", *args], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env={**os.environ, "COLUMNS": "200"})


def test_a_teacher_scores_the_students_tokens_in_the_job(tmp_path):
    from mlflow.tracking import MlflowClient

    from k3rl.learner.model import build_model
    from k3rl.learner.model.checkpoint import save_hf

    torch.manual_seed(0)
    save_hf(build_model("k3-tiny", seed=7), tmp_path / "teacher")
    r = train(tmp_path, "opd", str(tmp_path / "teacher"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "opd" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/runs/mlflow.db")
    history = {k: [m.value for m in client.get_metric_history(summary["mlflow_run_id"], k)]
               for k in ("reward_mean", "advantage_abs_mean")}
    # the untrained student earns 0 on every episode: the env's advantage is 0, what is left is the teacher's
    assert history["reward_mean"] == [0.0, 0.0]
    assert len(history["advantage_abs_mean"]) == 2 and min(history["advantage_abs_mean"]) > 0.05


def test_a_teacher_of_another_architecture_is_refused_at_start(tmp_path):
    from k3rl.learner.model import build_model
    from k3rl.learner.model.checkpoint import save_hf

    save_hf(build_model("k3-tiny", {"moe_intermediate_size": 32}, seed=0), tmp_path / "teacher")
    r = train(tmp_path, "bad", str(tmp_path / "teacher"))
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "learner.distill.teachers.0.checkpoint" in out and "moe_intermediate_size" in out, out[-3000:]
