"""`k3rl train` with learner.distill.teachers through the real loop (Ray, the embedded engine, MLflow
on SQLite): the teacher is served by an engine of its own (a Ray actor beside the inference pool) that
scores each step's episodes before the learner trains them, and the step's advantages are those of
the in-learner path on the same (stored) batch; its engine dying ends the job with an error naming
its checkpoint, leaving no actor behind; a teacher checkpoint of another architecture is refused at
start, by field path."""

import functools
import json
import re
from pathlib import Path

import pytest
import torch
from background import k3rl_train

pytestmark = pytest.mark.slow


def settings(tmp_path, name: str, teacher: str, *extra: str) -> list[str]:
    runs, uri = tmp_path / "runs", f"sqlite:///{tmp_path}/runs/mlflow.db"
    return [f"name={name}", "model.preset=k3-tiny", "rollout.group_size=2", "rollout.prompts_per_step=2",
            "rollout.sampling.max_tokens_per_turn=16", "rollout.max_context_tokens=512", "envs.max_turns=1",
            "rollout.max_policy_lag=0", "learner.steps=2", "learner.checkpoint_every=0", "learner.sft_steps=0",
            "learner.micro_batch_tokens=2048", f"learner.distill.teachers=[{{checkpoint: {teacher}, coef: 0.5}}]",
            f"tracking.runs_dir={runs}", f"tracking.uri={uri}", "ray.num_cpus=4", *extra]


def train(tmp_path, name: str, teacher: str, *extra: str) -> dict:
    return k3rl_train(tmp_path, [a for s in settings(tmp_path, name, teacher, *extra) for a in ("--set", s)])


def _teacher_engine_job(out: Path) -> dict:
    from k3rl.model import build_model
    from k3rl.model.checkpoint import save_hf

    save_hf(build_model("k3-tiny", seed=7).eval(), out / "teacher")
    return train(out, "opd", str(out / "teacher"))  # engines: 1 (the default)


def _other_architecture_job(out: Path) -> dict:
    from k3rl.model import build_model
    from k3rl.model.checkpoint import save_hf

    save_hf(build_model("k3-tiny", {"moe_intermediate_size": 32}, seed=0), out / "teacher")
    return train(out, "bad", str(out / "teacher"))


def _exact_teacher_job(out: Path) -> dict:
    from k3rl.model import build_model
    from k3rl.model.checkpoint import save_hf

    save_hf(build_model("k3-tiny", seed=7).eval(), out / "teacher")
    save_hf(build_model("k3-tiny", seed=3).eval(), out / "student")
    spec = f"learner.distill.teachers=[{{checkpoint: {out / 'teacher'}, estimator: exact, engines: 0}}]"
    return train(out, "exact", str(out / "teacher"), spec, f"model.checkpoint={out / 'student'}",
                 "rollout.sampling.temperature=0.7")


# the `k3rl train` jobs run beside the suite (tests/background.py); the tests assert on what they left
BACKGROUND_JOBS = {"teacher_engine": lambda out: functools.partial(_teacher_engine_job, out),
                   "other_architecture": lambda out: functools.partial(_other_architecture_job, out),
                   "exact_teacher": lambda out: functools.partial(_exact_teacher_job, out)}


@pytest.mark.background("teacher_engine")
def test_a_teacher_on_an_engine_of_its_own_scores_the_students_tokens_in_the_job(background_job):
    from mlflow.tracking import MlflowClient

    from k3rl.learner.distill import Teacher, distill_advantages
    from k3rl.model import build_model
    from k3rl.store import TrajectoryStore

    r, tmp_path = background_job
    teacher = build_model("k3-tiny", seed=7).eval()  # the job's teacher (the same seed builds the same weights)
    assert r["returncode"] == 0, r["stdout"][-3000:] + r["stderr"][-3000:]
    summary = json.loads((tmp_path / "runs" / "opd" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/runs/mlflow.db")
    history = {k: [m.value for m in client.get_metric_history(summary["mlflow_run_id"], k)]
               for k in ("reward_mean", "advantage_abs_mean", "distill/episodes_scored", "time/teacher_s")}
    # the untrained student earns 0 on every episode: the env's advantage is 0, what is left is the teacher's
    assert history["reward_mean"] == [0.0, 0.0]
    assert history["distill/episodes_scored"] == [4.0, 4.0] and min(history["time/teacher_s"]) > 0
    # each step's advantages are those the learner computes itself (in-learner teacher) on the stored batch
    store = TrajectoryStore(tmp_path / "runs" / "opd", readonly=True)
    for step, logged in zip((1, 2), history["advantage_abs_mean"], strict=True):
        batch = store.read(step=step, status="trained")
        assert len(batch) == 4
        adv = distill_advantages(batch, torch.zeros(len(batch)), [Teacher(teacher, coef=0.5)])
        sampled = torch.zeros(adv.shape, dtype=torch.bool)
        for i, t in enumerate(batch):
            sampled[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.bool)
        assert logged > 0.05 and abs(logged - float(adv.abs()[sampled].mean())) < 1e-4, (step, logged)


def test_a_teacher_engine_dying_ends_the_job_naming_its_checkpoint_and_leaves_nothing(tmp_path):
    import time

    import ray
    from ray._private.state import actors

    from k3rl.config import JobConfig
    from k3rl.job import run_job
    from k3rl.learner.teacher_engines import TeacherError
    from k3rl.model import build_model
    from k3rl.model.checkpoint import save_hf

    save_hf(build_model("k3-tiny", seed=7), tmp_path / "teacher")
    cfg = JobConfig.load(None, settings(tmp_path, "dies", str(tmp_path / "teacher"), "learner.steps=3"))
    ray.shutdown()
    try:
        with pytest.raises(TeacherError, match=re.escape(f"learner.distill.teachers.0 ({tmp_path / 'teacher'}) "
                                                         "engine 0 died")):
            run_job(cfg, kill_teacher_at_step=1, quiet=True)
        t = time.monotonic()
        while (live := [a["ActorClassName"] for a in actors().values() if a["State"] != "DEAD"]) and \
                time.monotonic() - t < 60:
            time.sleep(1.0)
        assert live == []
    finally:
        ray.shutdown()


@pytest.mark.background("other_architecture")
def test_a_teacher_of_another_architecture_is_refused_at_start(background_job):
    r, _ = background_job
    assert r["returncode"] != 0
    out = r["stdout"] + r["stderr"]
    assert "learner.distill.teachers.0.checkpoint" in out and "moe_intermediate_size" in out, out[-3000:]


@pytest.mark.background("exact_teacher")
def test_an_exact_teacher_in_the_learner_trains_the_job_on_its_kl(background_job):
    """estimator: exact through the job: the learner loads the teacher (engines: 0), starts no teacher engine,
    and logs distill_kl, the mean KL(student || teacher) per taught token, which for step 1 equals the KL of
    the starting student (the job's model.checkpoint) to the teacher over that step's stored episodes."""
    from mlflow.tracking import MlflowClient

    from k3rl.model import build_model
    from k3rl.model.logprobs import chunked_reverse_kl
    from k3rl.store import TrajectoryStore

    r, tmp_path = background_job
    # the job's teacher and student (the same seeds build the same weights)
    teacher, student = build_model("k3-tiny", seed=7).eval(), build_model("k3-tiny", seed=3).eval()
    assert r["returncode"] == 0, r["stdout"][-3000:] + r["stderr"][-3000:]
    summary = json.loads((tmp_path / "runs" / "exact" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/runs/mlflow.db")
    history = {k: [m.value for m in client.get_metric_history(summary["mlflow_run_id"], k)]
               for k in ("distill_kl", "distill/episodes_scored")}
    assert history["distill/episodes_scored"] == [] and len(history["distill_kl"]) == 2  # no teacher engine
    batch = TrajectoryStore(tmp_path / "runs" / "exact", readonly=True).read(step=1, status="trained")
    total, tokens = 0.0, 0.0
    with torch.no_grad():
        for t in batch:
            ids = torch.tensor([t.token_ids])
            kl = chunked_reverse_kl(student(ids, return_hidden=True)[0, :-1], student.lm_head.weight,
                                    teacher(ids, return_hidden=True)[0, :-1], teacher.lm_head.weight, temperature=0.7)
            mask = torch.tensor(t.loss_mask, dtype=torch.float32)
            total += float((kl[len(t.prompt_ids) - 1:] * mask).sum())
            tokens += float(mask.sum())
    assert history["distill_kl"][0] > 0.01
    assert abs(history["distill_kl"][0] - total / tokens) < 1e-3 * max(1.0, total / tokens), (history, total / tokens)
