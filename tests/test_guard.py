"""The collapse guard (k3rl/guard.py): its verdicts, the learner's snapshot and restore, and a real job
whose learning rate destroys the format being rolled back to a policy that samples well-formed messages."""

from __future__ import annotations

import collections
import copy
import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from k3rl.config import JobConfig, LearnerSection
from k3rl.guard import CollapseError, FormatGuard
from k3rl.store import TrajectoryStore

sys.path.insert(0, str(Path(__file__).resolve().parent / "learner"))
from learner_helpers import make_trajectories  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def test_verdicts_baseline_patience_and_lr_scale():
    g = FormatGuard(baseline_steps=2, max_rise=0.25, patience=2, lr_factor=0.5, max_rollbacks=2)
    assert [g.observe(r) for r in (0.1, 0.3)] == ["ok", "ok"]  # the baseline's batches are never judged
    assert g.baseline == pytest.approx(0.2)
    assert g.observe(0.45) == "ok"  # exactly at the bound is healthy: 0.2 + 0.25
    assert g.observe(0.5) == "hold"  # unhealthy once: patience 2
    assert g.observe(0.4) == "ok"  # a healthy batch resets the run
    assert [g.observe(0.9), g.observe(0.9)] == ["hold", "rollback"]
    assert g.rollbacks == 1 and g.lr_scale == 0.5
    assert g.metrics() == {"guard/rollbacks": 1.0, "guard/lr_scale": 0.5, "guard/baseline": pytest.approx(0.2)}
    assert [g.observe(1.0), g.observe(1.0)] == ["hold", "rollback"]
    assert g.lr_scale == 0.25
    g.observe(1.0)
    with pytest.raises(CollapseError, match=r"collapsed 3 times .*lower learner\.lr"):
        g.observe(1.0)


def test_restore_returns_weights_and_optimizer_state_and_scales_the_rate():
    from k3rl.learner.trainer import Trainer
    from k3rl.model import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    t = Trainer(K3ForCausalLM(K3Config.preset("k3-tiny")), LearnerSection(micro_batch_tokens=64, steps=10, lr=1e-3))
    batch = make_trajectories(0)
    t.train_step(batch)
    t.snapshot()
    good = {k: v.clone() for k, v in t.model.state_dict().items()}
    good_opt = copy.deepcopy(t.optimizer.state_dict())  # state_dict() holds the live tensors
    nxt_lr = t.train_step(batch)["lr"]
    assert any(not torch.equal(good[k], v) for k, v in t.model.state_dict().items())
    assert t.restore(0.5) == {"guard/restored": 1.0, "lr_scale": 0.5}
    assert all(torch.equal(good[k], v) for k, v in t.model.state_dict().items())
    for p, state in t.optimizer.state_dict()["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                assert torch.equal(v.cpu(), good_opt["state"][p][k].cpu()), (p, k)
    # the schedule goes on from the step count, at half the rate
    from k3rl.learner.trainer import lr_at

    m = t.train_step(batch)
    assert m["lr"] == pytest.approx(0.5 * lr_at(t.step - 1, 10, 1e-3, t.cfg.warmup_ratio, t.cfg.min_lr_ratio))
    assert m["lr"] < nxt_lr


def test_restore_without_a_snapshot_says_so():
    from k3rl.learner.trainer import Trainer
    from k3rl.model import K3Config, K3ForCausalLM

    t = Trainer(K3ForCausalLM(K3Config.preset("k3-tiny")), LearnerSection(micro_batch_tokens=64))
    with pytest.raises(RuntimeError, match="no snapshot"):
        t.restore(0.5)


def _guard_config(out: Path) -> JobConfig:
    return JobConfig.load(DEMO, [
        "learner.lr=0.05", "learner.warmup_ratio=0",
        "learner.steps=2", "learner.checkpoint_every=1", "learner.eval_before_training=false",
        "learner.guard.enabled=true", "learner.guard.baseline_steps=1", "learner.guard.patience=1",
        "learner.guard.max_rise=0.2",
        "rollout.max_policy_lag=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.episodes_per_worker=16",
        "rollout.sampling.temperature=0.7", "tracking.sample_episodes=0", "envs.eval=[]",
        "learner.kl_coef=0.05",  # the checkpoint then holds the KL reference: the warm-started weights
        f"tracking.runs_dir={out}/runs", f"tracking.uri=sqlite:///{out}/runs/mlflow.db", "name=guard",
        "tracking.run_name=null",
    ])


def _guard_job(out: Path) -> dict:
    """The job with the destructive rate, the store's rows after it, then a resume to step 3."""
    import ray

    from k3rl.job import run_job

    cfg = _guard_config(out)
    summary = run_job(cfg, quiet=True)
    ray.shutdown()
    rows = TrajectoryStore(out / "runs" / "guard", readonly=True).read()
    before = {t.id: t.metadata["status"] for t in rows}
    step2 = collections.Counter(t.metadata["status"] for t in rows if t.metadata.get("step") == 2)
    cfg3 = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"steps": 3})})
    resumed = run_job(cfg3, resume=True, quiet=True)
    ray.shutdown()
    return {"summary": summary, "before": before, "step2": step2, "resumed": resumed}


# the job and its resume run beside the suite (tests/background.py); the test asserts on what they left
BACKGROUND_JOBS = {"guard": lambda out: functools.partial(_guard_job, out)}


@pytest.mark.slow
@pytest.mark.background("guard")
def test_a_destructive_rate_is_rolled_back_to_the_last_good_policy(background_job):
    """lr 0.05 wrecks the stored warm start's message format (examples/keylookup_warm_start) in one
    update. The guard sees the next batch's format error rate jump and returns the learner to the
    policy that sampled the first batch: the checkpoint after the rollback holds exactly the
    warm-started weights (the checkpoint's KL reference, kept since the start), the one before it
    does not. A resume then continues after the rollback and keeps every row."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    result, tmp_path = background_job
    summary, resumed = result["summary"], result["resumed"]
    client = MlflowClient(tracking_uri=_guard_config(tmp_path).tracking.uri)

    def curve(name):  # the first job's steps (the resume logs step 3 to the same run)
        return {m.step: m.value for m in client.get_metric_history(summary["mlflow_run_id"], name) if m.step <= 2}

    fmt = curve("episodes/format_error_rate")
    assert fmt[2] > fmt[1] + 0.2, fmt  # one update at lr 0.05 broke the format
    assert curve("guard/rollbacks") == {1: 0.0, 2: 1.0} and curve("guard/restored") == {2: 1.0}
    assert curve("guard/lr_scale")[2] == 0.5
    assert "loss" in summary["history"][0] and "loss" not in summary["history"][1]  # the bad batch is not trained

    def weights(step, part):
        d = tmp_path / "runs" / "guard" / "checkpoints" / f"step-{step:06d}" / part
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    warm = weights(2, "reference")  # the KL reference: the warm-started policy
    assert warm and weights(2, "model").keys() == warm.keys()
    assert all(torch.equal(weights(2, "model")[k], v) for k, v in warm.items())  # rolled back exactly
    assert not all(torch.equal(weights(1, "model")[k], v) for k, v in warm.items())  # step 1 had moved it

    # the store said what happened: step 2's batch was stored as rolled back, not as trained, and the
    # checkpoint of step 2 is step 2 (the rollback counts as the learner's step)
    run_dir = tmp_path / "runs" / "guard"
    assert result["step2"]["trained"] == 0 and result["step2"]["rolled_back"] == 4 * 4, result["step2"]
    assert json.loads((run_dir / "checkpoints" / "step-000002" / "trainer.json").read_text())["step"] == 2
    # so the resume continued after step 2 and kept its rows: every episode stored once, none lost
    assert resumed["completed"] and resumed["steps"] == 3 and len(resumed["history"]) == 1, resumed
    before, after = result["before"], TrajectoryStore(run_dir, readonly=True)
    ids = after.ids()
    assert len(ids) == len(set(ids)) and {i: s for i, s in before.items() if s != "unused"}.items() <= \
        {t.id: t.metadata["status"] for t in after.read()}.items()
    assert len(after.read(step=3, status="trained")) > 0
