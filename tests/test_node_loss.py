"""A multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`) loses a node mid-job: its raylet and
every process on it are killed, as when a machine goes away.

- A node of engines and rollout workers: the job finishes on the rest. The engines and workers that were there
  are restarted on the node that is left, and their episodes are re-run there or stored as failed.
- The learner's node: the job stops within a deadline with the learner's death (never a hang), its last
  checkpoint stands, and `--resume` on a cluster with a learner node again finishes the job with every episode
  stored once.

The GCS is told to declare a node dead after 3 missed health checks a second apart (Ray's defaults: 5, 3 s
apart), so the tests wait seconds instead of half a minute."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from k3rl.config import JobConfig

pytestmark = pytest.mark.slow

LOOPBACK = "127.0.0.1"  # every node on loopback: nothing leaves the machine
HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@pytest.fixture
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK, "_system_config": HEALTH})
    yield c
    ray.shutdown()
    c.shutdown()


def _node(c, cpus: int, resource: str):
    return c.add_node(node_ip_address=LOOPBACK, num_cpus=cpus, resources={resource: 8})


def _cfg(c, tmp_path: Path, name: str, *overrides: str) -> JobConfig:
    return JobConfig.load(None, [
        f"name={name}", "model.preset=k3-tiny", "rollout.group_size=2", "rollout.prompts_per_step=2",
        "rollout.episodes_per_worker=8", "rollout.sampling.max_tokens_per_turn=24", "rollout.max_context_tokens=512",
        "envs.max_turns=2", "learner.sft_steps=0", "learner.micro_batch_tokens=2048", "tracking.sample_episodes=0",
        f"tracking.runs_dir={tmp_path}/runs", f"tracking.uri=sqlite:///{tmp_path}/runs/mlflow.db",
        f"ray.address={c.address}", "ray.placement.learner={learner_node: 1}", *overrides])


def _start(cfg: JobConfig, resume: bool = False) -> tuple[threading.Thread, dict]:
    from k3rl.job import run_job

    out: dict = {}

    def job():
        try:
            out["summary"] = run_job(cfg, resume, quiet=True)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e

    t = threading.Thread(target=job, daemon=True)
    t.start()
    return t, out


def _wait_for_step(cfg: JobConfig, job: threading.Thread, step: int, deadline_s: float = 300) -> None:
    """Until the job's MLflow run has metrics of `step` (the driver logged that step)."""
    from mlflow.tracking import MlflowClient

    run_json = Path(cfg.tracking.runs_dir) / cfg.name / "run.json"
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert job.is_alive(), "the job ended before the node could be lost"
        run = json.loads(run_json.read_text()).get("mlflow_run_id") if run_json.exists() else None
        if run and any(m.step >= step for m in MlflowClient(cfg.tracking.uri).get_metric_history(run, "reward/mean")):
            return
        time.sleep(0.5)
    raise AssertionError(f"no step {step} within {deadline_s:.0f} s")


def _where(nodes: dict) -> dict[str, list[str]]:
    """Live actor class -> the names of the nodes they run on."""
    import ray._private.state as ray_state  # the GCS's actor table (the state API needs a dashboard)

    node_of = {n.node_id: name for name, n in nodes.items()}
    where: dict[str, list[str]] = {}
    for a in ray_state.actors().values():
        if a["State"] == "ALIVE":
            where.setdefault(a["ActorClassName"], []).append(node_of.get(a["Address"]["NodeID"], "head"))
    return where


def test_losing_a_node_of_engines_and_workers_the_job_finishes_on_the_rest(cluster, tmp_path):
    from k3rl.store import TrajectoryStore

    c = cluster
    nodes = {"learner": _node(c, 1, "learner_node"), "a": _node(c, 2, "work"), "b": _node(c, 2, "work")}
    c.wait_for_nodes()
    steps = 5
    cfg = _cfg(c, tmp_path, "nodeloss", f"learner.steps={steps}", "learner.checkpoint_every=0",
               "rollout.num_inference_workers=2", "rollout.num_rollout_workers=2", "rollout.max_policy_lag=1",
               "ray.placement.engines={work: 1}", "ray.placement.rollout_workers={work: 1}")
    job, out = _start(cfg)
    _wait_for_step(cfg, job, 1)
    where = _where(nodes)
    placed = where.get("EngineWorker", []) + where.get("RolloutWorker", [])
    lost = max(("a", "b"), key=placed.count)  # the node with most of them (Ray may have packed them all there)
    assert placed.count(lost) >= 1, where
    assert where["TrajectoryBuffer"] == ["head"] and where["PoolActor"] == ["head"], where  # with the driver
    c.remove_node(nodes[lost], allow_graceful=False)  # its raylet and every process on it killed
    job.join(timeout=600)
    assert not job.is_alive(), "the job hung after losing a node"
    assert "error" not in out, repr(out.get("error"))
    summary = out["summary"]
    assert summary["completed"] and summary["steps"] == steps, summary
    history = summary["history"]
    # what ran on the lost node was restarted on the one left: a rollout worker or an engine (or both)
    restarts = summary["restarts"] + history[-1].get("engine/restarts", 0)
    assert restarts >= 1, (summary["restarts"], history[-1])
    rows = TrajectoryStore(Path(summary["run_dir"]), readonly=True).summary()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))  # each episode stored once, a re-run one too
    assert sum(r["status"] == "trained" for r in rows) == sum(int(m["sequences"]) for m in history)


def test_losing_the_learners_node_stops_the_job_in_time_and_resume_finishes_it(cluster, tmp_path):
    import ray

    from k3rl.store import TrajectoryStore

    c = cluster
    nodes = {"learner": _node(c, 1, "learner_node"), "work": _node(c, 2, "work")}
    c.wait_for_nodes()
    steps = 5
    cfg = _cfg(c, tmp_path, "learnerloss", f"learner.steps={steps}", "learner.checkpoint_every=1",
               "ray.placement.engines={work: 1}", "ray.placement.rollout_workers={work: 1}")
    job, out = _start(cfg)
    _wait_for_step(cfg, job, 2)
    # step 2's metrics can reach MLflow before its checkpoint is renamed into place (a loaded host once saw only
    # step-000001 then): the node goes once that checkpoint is there
    ckpt, end = Path(cfg.tracking.runs_dir) / cfg.name / "checkpoints" / "step-000002", time.monotonic() + 120
    while not ckpt.exists() and time.monotonic() < end and job.is_alive():
        time.sleep(0.2)
    assert _where(nodes)["LearnerActor"] == ["learner"]
    lost_at = time.monotonic()
    c.remove_node(nodes["learner"], allow_graceful=False)
    job.join(timeout=180)
    assert not job.is_alive(), "the job hung after losing the learner's node"
    stopped_s = time.monotonic() - lost_at
    assert isinstance(out.get("error"), ray.exceptions.RayActorError), out
    run_dir = Path(cfg.tracking.runs_dir) / cfg.name
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert saved and saved[-1] >= "step-000002", saved

    # a node for the learner again (a replacement machine): the resume finishes the job
    _node(c, 1, "learner_node")
    c.wait_for_nodes()
    job, out = _start(cfg, resume=True)
    job.join(timeout=600)
    assert "error" not in out, repr(out.get("error"))
    assert out["summary"]["completed"] and out["summary"]["steps"] == steps, out["summary"]
    rows = TrajectoryStore(run_dir, readonly=True).summary()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    print(f"learner's node lost: the job stopped {stopped_s:.1f} s later")
