"""The agentic RL job end to end: real Ray, the embedded K3 engine, MLflow SQLite, Parquet store."""

import functools
import json
import subprocess
import sys

import pytest

from k3rl.config import JobConfig

pytestmark = pytest.mark.slow


def _cfg(tmp_path, *extra):
    return JobConfig.load(None, [
        "name=t", "model.preset=k3-tiny", "rollout.group_size=2", "rollout.prompts_per_step=2",
        "rollout.episodes_per_worker=8", "rollout.sampling.max_tokens_per_turn=24", "rollout.max_context_tokens=512",
        "envs.max_turns=2", "learner.sft_steps=0", "learner.checkpoint_every=1", "learner.micro_batch_tokens=2048",
        f"tracking.runs_dir={tmp_path}/runs", f"tracking.uri=sqlite:///{tmp_path}/runs/mlflow.db",
        "tracking.sample_episodes=1", "ray.num_cpus=4", *extra])


def _sync_run(out) -> dict:
    """A synchronous job whose rollout worker is killed after step 1, then resumed to step 5."""
    from k3rl.job import run_job

    first = run_job(_cfg(out, "rollout.max_policy_lag=0", "learner.steps=3"), kill_worker_at_step=1, quiet=True)
    resumed = run_job(_cfg(out, "rollout.max_policy_lag=0", "learner.steps=5"), resume=True, quiet=True)
    return {"first": first, "resumed": resumed}


def _job(out, *extra, **faults):
    from k3rl.job import run_job

    return functools.partial(run_job, _cfg(out, *extra), quiet=True, **faults)


# the jobs run beside the suite (tests/background.py); the tests assert on what they returned and left
BACKGROUND_JOBS = {
    "sync_run": lambda out: functools.partial(_sync_run, out),
    "ranks": lambda out: _job(out, "learner.steps=2", "learner.data_parallel=fsdp", "learner.world_size=2",
                              "learner.expert_parallel=2", "rollout.max_policy_lag=0", "name=ranks"),
    "bcast": lambda out: _job(out, "learner.steps=2", "rollout.weight_transport=nccl",
                              "rollout.num_inference_workers=2", "rollout.max_policy_lag=0", "name=bcast"),
    "engine_dies": lambda out: _job(out, "learner.steps=3", "rollout.weight_transport=nccl",
                                    "rollout.num_inference_workers=2", "rollout.max_policy_lag=0",
                                    "rollout.weight_sync_timeout_s=30", "name=engine-dies", kill_engine_at_step=1),
}


@pytest.fixture
def sync_run(background_job):
    """(folder, config, first job's summary, resumed job's summary) of the background job `sync_run`."""
    result, out = background_job
    return out, _cfg(out, "rollout.max_policy_lag=0", "learner.steps=3"), result["first"], result["resumed"]


@pytest.mark.background("sync_run")
def test_synchronous_mode_is_on_policy(sync_run):
    _, _, first, resumed = sync_run
    for m in first["history"] + resumed["history"]:
        # every generated token came from the weights the learner then trained (version lag 0) ...
        assert m["staleness/max"] == 0.0 and m["policy_version"] == m["step"]
        # ... so the learner's recomputed log-probs equal the behaviour log-probs: ratios are 1
        assert abs(m["is_ratio_mean"] - 1.0) < 2e-3
        assert m["is_ratio_max"] < 1.01


@pytest.mark.background("sync_run")
def test_killed_rollout_worker_and_resume_lose_and_duplicate_nothing(sync_run):
    from k3rl.store import TrajectoryStore

    tmp, cfg, first, resumed = sync_run
    assert first["completed"] and first["restarts"] >= 1
    rows = TrajectoryStore(tmp / "runs" / "t", readonly=True).summary()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    assert {r["status"] for r in rows} <= {"trained", "failed", "unused"}
    for step in range(1, 6):
        groups = {}
        for r in rows:
            if r["step"] == step and r["status"] == "trained":
                groups.setdefault(r["id"].rsplit("-s", 1)[0], []).append(r["id"])
                assert r["policy_version"] == step  # tagged with the step (and version) that trained it
        # each training step consumed exactly P complete groups of G distinct episodes
        assert len(groups) == 2 and all(len(set(v)) == 2 for v in groups.values()), (step, groups)


@pytest.mark.background("sync_run")
def test_resume_continues_the_curve_in_the_same_mlflow_run(sync_run):
    from mlflow.tracking import MlflowClient

    tmp, cfg, first, resumed = sync_run
    assert resumed["completed"] and resumed["steps"] == 5
    assert resumed["mlflow_run_id"] == first["mlflow_run_id"]
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    run = client.get_run(first["mlflow_run_id"])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")]
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert run.info.status == "FINISHED"
    ckpts = sorted(p.name for p in (tmp / "runs" / "t" / "checkpoints").iterdir())
    assert ckpts == ["latest", *(f"step-{s:06d}" for s in range(1, 6))]  # no temporary directory left


@pytest.mark.background("sync_run")
def test_mlflow_run_has_the_metrics_params_and_artifacts(sync_run):
    from mlflow.tracking import MlflowClient

    tmp, cfg, first, _ = sync_run
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    run = client.get_run(first["mlflow_run_id"])
    metrics = set(run.data.metrics)
    for key in ["reward/mean", "reward/std", "reward/k3rl_KeyLookup-v0/mean", "episodes/success_rate",
                "episodes/turns", "episodes/tokens", "episodes/failed_rate", "throughput/rollout_tokens_per_s",
                "throughput/train_tokens_per_s", "staleness/mean", "policy_version", "time/weight_sync_s", "loss",
                "pg_loss", "grad_norm", "entropy", "kl", "clip_frac", "is_ratio_mean", "is_ratio_max",
                "groups/issued", "workers/restarts"]:
        assert key in metrics, key
    assert "staleness_mean" not in metrics  # one staleness convention
    # the engines' counters, cumulative over an engine's life: tokens decoded grow over the first job's 3
    # steps and start again with the resumed job's engines; no graphs on the CPU
    decoded = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "engine/decode_tokens"),
                                       key=lambda m: m.step)]
    assert len(decoded) == 5 and 0 < decoded[0] < decoded[1] < decoded[2] and decoded[3] < decoded[2], decoded
    assert run.data.metrics["engine/prefill_tokens"] > 0 and run.data.metrics["engine/graph_captures"] == 0
    assert run.data.params["learner.lr"] == str(cfg.learner.lr)
    arts = _artifacts(client, run.info.run_id)
    assert "config.yaml" in arts and "reward_curve.png" in arts
    assert any(a.endswith(".html") for a in arts)


def _artifacts(client, run_id, path=None):
    out = []
    for f in client.list_artifacts(run_id, path):
        out.extend(_artifacts(client, run_id, f.path) if f.is_dir else [f.path.split("/")[-1]])
    return out


@pytest.mark.background("sync_run")
@pytest.mark.parametrize("step", ["2", "5"])  # 5: the last step
def test_replay_cli_shows_a_stored_episode(sync_run, tmp_path, step):
    tmp, cfg, _, _ = sync_run
    html = tmp_path / "ep.html"
    r = subprocess.run([sys.executable, "-m", "k3rl.cli", "replay", str(tmp / "runs" / "t"), "--step", step,
                        "--html", str(html)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "<html" in html.read_text().lower()


@pytest.mark.background("ranks")
def test_learner_on_two_ranks_with_fsdp_and_expert_parallel(background_job):
    """learner.world_size=2: two learner ranks (Ray actors, one gloo process group on loopback)
    train one FSDP2 + expert-parallel model; the weights the engines get and the checkpoint are
    the whole model, which loads into one process."""
    import torch

    from k3rl.model import K3Config, load_hf

    summary, tmp_path = background_job
    assert summary["completed"] and summary["steps"] == 2
    model = load_hf(tmp_path / "runs" / "ranks" / "checkpoints" / "step-000002" / "model")
    tiny = K3Config.preset("k3-tiny")
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert moe.experts.w1.shape[0] == tiny.num_experts  # every expert, not one rank's half
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.background("bcast")
def test_weights_reach_the_engines_by_a_broadcast_group(background_job):
    """rollout.weight_transport=nccl: the learner's rank 0 and two engines form a broadcast group
    (gloo between these CPU processes, NCCL between GPUs: the same code); in synchronous mode
    every token is then sampled from exactly the weights the learner trains (ratios 1)."""
    summary, _ = background_job
    assert summary["completed"] and summary["steps"] == 2
    from k3rl.model import K3Config, K3ForCausalLM

    model_bytes = sum(t.numel() * t.element_size() for t in K3ForCausalLM(K3Config.preset("k3-tiny")).state_dict().values())
    for m in summary["history"]:
        assert m["staleness/max"] == 0.0
        assert abs(m["is_ratio_mean"] - 1.0) < 2e-3 and m["is_ratio_max"] < 1.01
    for m in summary["history"][:-1]:  # nothing is pushed after the last step
        assert m["weight_sync/bytes"] == pytest.approx(model_bytes, rel=0.02)  # the whole model, every step
        assert m["weight_sync/broadcast_s"] > 0 and m["weight_sync/wait_for_engines_s"] >= 0
        assert m["weight_sync/fallbacks"] == 0.0
    assert "weight_sync/bytes" not in summary["history"][-1]


@pytest.mark.background("engine_dies")
def test_an_engine_dying_before_a_broadcast_loses_nothing(background_job):
    """rollout.weight_transport=nccl with engine 0 killed after step 1's training: that step's
    broadcast fails, the same weights go through the object store (the dead engine is restarted
    and replayed them), the group is formed again for step 2, and every step stays on-policy."""
    summary, _ = background_job
    assert summary["completed"] and summary["steps"] == 3
    h = summary["history"]
    assert h[0]["weight_sync/fallbacks"] == 1.0 and "weight_sync/broadcast_s" not in h[0]  # the object store's
    assert h[1]["weight_sync/fallbacks"] == 0.0 and h[1]["weight_sync/new_group"] == 1.0  # group re-formed
    assert h[1]["weight_sync/broadcast_s"] > 0
    for m in h:
        assert m["staleness/max"] == 0.0
        assert abs(m["is_ratio_mean"] - 1.0) < 2e-3 and m["is_ratio_max"] < 1.01


def test_job_against_a_local_ray_start_head_cluster(tmp_path):
    """`ray.address` joins an existing cluster (`ray start --head` on loopback) and trains on a user's
    env from a module outside the package (`envs.imports`), which the cluster's workers get through
    `ray.runtime_env`; the sandboxes it used are gone when the job ends."""
    from pathlib import Path

    import ray
    from ray_head import ray_head

    from k3rl.cluster import free_port
    from k3rl.job import run_job

    tests = str(Path(__file__).resolve().parent)
    ray.shutdown()  # the module's local Ray: this job joins the head's cluster instead
    with ray_head(free_port(), num_cpus=4) as address:
        cfg = _cfg(tmp_path, f"ray.address={address}", "learner.steps=1", "name=cluster", "envs.imports=[faulty_envs]",
                   "envs.train.0.id=faulty/SandboxedLookup-v0", f"ray.runtime_env.env_vars.PYTHONPATH={tests}")
        try:
            summary = run_job(cfg, quiet=True)
        finally:
            ray.shutdown()
    assert summary["completed"] and summary["steps"] == 1
    assert json.loads((tmp_path / "runs" / "cluster" / "summary.json").read_text())["completed"]
    assert summary["buffer"]["trained"] == 4
    ps = subprocess.run(["docker", "ps", "-aq", "--filter", "label=k3rl.job=cluster"], capture_output=True, text=True)
    assert ps.stdout.split() == []
