"""A multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`: a head and worker nodes, each its own
raylet), whose nodes offer custom resources; `ray.placement` pins each kind of the job's actors to its nodes."""

from __future__ import annotations

import pytest

from k3rl.config import JobConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    loopback = "127.0.0.1"  # every node on loopback: nothing leaves the machine
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": loopback,
                                                      "resources": {"head_node": 1}})
    nodes = {name: c.add_node(node_ip_address=loopback, num_cpus=cpus, resources={name: 8})
             for name, cpus in (("engine_node", 2), ("learner_node", 1), ("worker_node", 1))}
    c.wait_for_nodes()
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def test_placement_puts_engines_learner_and_rollout_workers_on_their_nodes(cluster, tmp_path):
    import ray
    import ray._private.state as ray_state  # the GCS's actor table (the state API needs a dashboard)

    from k3rl.job import run_job

    c, nodes = cluster
    cfg = JobConfig.load(None, [
        "name=placed", "model.preset=k3-tiny", "rollout.group_size=2", "rollout.prompts_per_step=2",
        "rollout.num_inference_workers=2", "rollout.episodes_per_worker=8", "rollout.sampling.max_tokens_per_turn=24",
        "rollout.max_context_tokens=512", "envs.max_turns=2", "learner.sft_steps=0", "learner.checkpoint_every=0",
        "learner.steps=2", "learner.micro_batch_tokens=2048", "tracking.sample_episodes=0",
        f"tracking.runs_dir={tmp_path}/runs", f"tracking.uri=sqlite:///{tmp_path}/runs/mlflow.db",
        f"ray.address={c.address}", "ray.placement.engines={engine_node: 1}",
        "ray.placement.learner={learner_node: 1}", "ray.placement.rollout_workers={worker_node: 1}"])
    summary = run_job(cfg, quiet=True)
    assert summary["completed"], summary
    node_of = {n.node_id: name for name, n in nodes.items()}
    where: dict[str, set[str]] = {}
    for a in ray_state.actors().values():
        where.setdefault(a["ActorClassName"], set()).add(node_of.get(a["Address"]["NodeID"], "head"))
    assert where["EngineWorker"] == {"engine_node"}, where
    assert where["LearnerActor"] == {"learner_node"}, where
    assert where["RolloutWorker"] == {"worker_node"}, where
    assert ray.is_initialized()


def test_a_placement_no_node_offers_is_refused_at_start_naming_the_field(cluster, tmp_path):
    from k3rl.cluster import ClusterResourcesError
    from k3rl.job import run_job

    c, _ = cluster
    cfg = JobConfig.load(None, [
        "name=unplaceable", "model.preset=k3-tiny", "learner.sft_steps=0", f"tracking.runs_dir={tmp_path}/runs",
        f"tracking.uri=sqlite:///{tmp_path}/runs/mlflow.db", f"ray.address={c.address}",
        "ray.placement.learner={gpu_node: 1}"])
    with pytest.raises(ClusterResourcesError, match=r"learner.world_size .*\{'gpu_node': 1.0\} \(ray.placement\)"):
        run_job(cfg, quiet=True)
