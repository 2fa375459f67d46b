"""Starting or joining Ray for a job: `init_ray(cfg)`; refusing a job the cluster can never hold:
`check_resources(cfg)`; where a process group of the job listens: `rendezvous_host(on_cluster)`
and `free_port(host)` (the learner's ranks, the weight transports).

`ray.address` unset starts a fresh local Ray; set (`auto`, `host:port`, `ray://host:10001`) joins
that cluster. Either way the job's Ray `runtime_env` is `ray.runtime_env` from the config (how a
cluster's workers get the user's code: `working_dir`, `py_modules`, `pip`...) with the environment
variables every process of the job needs merged under its `env_vars` (the user's values win).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from k3rl.config import JobConfig

# Communication settings the actors must share with the driver: NCCL_NVLS_ENABLE=0 and its
# relatives keep NVLink multicast off on shared GPU hosts; a worker without them would not.
FORWARDED_ENV_PREFIXES = ("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_", "TORCH_NCCL_", "K3RL_LEARNER_THREADS")


# A local Ray for a job, set before ray.init() (its processes inherit them; a user's own values win):
# - no idle workers started for the first driver: the job's actors start their own, with the job's runtime_env,
#   and the ones started ahead stayed idle for the whole job, having cost a Python start each;
LOCAL_RAY_ENV = {"RAY_prestart_worker_first_driver": "0"}
# - without a dashboard, nothing reads Ray's own metrics and task events, and a driver that ran the job from a
#   thread other than its main one waited at ray.shutdown() for their last flushes to time out (the core worker's
#   task-event buffer, then OpenTelemetry's metrics).
NO_DASHBOARD_RAY_ENV = {"RAY_enable_metrics_collection": "0", "RAY_enable_core_worker_task_event_to_gcs": "0"}


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def job_runtime_env(cfg: JobConfig) -> dict[str, Any]:
    """`ray.runtime_env` with the job's own env vars merged under its `env_vars`."""
    runtime_env = dict(cfg.ray.runtime_env)
    user_vars = runtime_env.get("env_vars") or {}  # a mapping (the config checks it)
    job_vars = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "OMP_NUM_THREADS": "1",
                **_forwarded_env()}
    runtime_env["env_vars"] = {**job_vars, **{str(k): str(v) for k, v in user_vars.items()}}
    return runtime_env


def init_ray(cfg: JobConfig) -> None:
    """Start a local Ray, or join the cluster at `cfg.ray.address`, with the job's runtime_env.
    Does nothing when Ray is already initialised in this process."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    common = {"namespace": cfg.ray.namespace, "log_to_driver": False, "runtime_env": job_runtime_env(cfg)}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, **common)
    else:  # address="local": always a fresh local Ray, never a cluster that happens to run here
        quiet = {**LOCAL_RAY_ENV, **({} if cfg.ray.include_dashboard else NO_DASHBOARD_RAY_ENV)}
        os.environ.update({k: v for k, v in quiet.items() if k not in os.environ})
        ray.init(address="local", num_cpus=cfg.ray.num_cpus or max(4, os.cpu_count() or 1),
                 include_dashboard=cfg.ray.include_dashboard, **common)


def on_driver_node() -> dict[str, Any]:
    """Ray options that keep an actor on the driver's node. The job's singletons (the trajectory buffer, the
    engine pool's router) go there: a job outlives the loss of any node but the driver's, whose loss ends it
    anyway, and these must outlive the nodes of engines and workers. Not `soft`: a soft affinity let Ray put
    them on another node (seen with Ray 2.x on a cluster_utils.Cluster); they take no resources, so they fit."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


class ClusterResourcesError(RuntimeError):
    """The job asks for more than the Ray cluster has: its actors would wait for ever."""


@dataclass(frozen=True)
class ActorRequest:
    """What one kind of the job's actors asks Ray for: the config fields that size it, how many, and each
    one's CPUs and GPUs. The actors are made with `options()`, and `check_resources` sums the same numbers."""

    fields: str
    count: int
    cpus: float
    gpus: float
    resources: dict[str, float] = field(default_factory=dict)  # custom ones: ray.placement

    def options(self) -> dict[str, Any]:
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, **({"resources": self.resources} if self.resources else {})}


def engine_request(cfg: JobConfig) -> ActorRequest:
    r = cfg.rollout
    return ActorRequest("rollout.num_inference_workers x rollout.gpus_per_inference_worker", r.num_inference_workers,
                        1.0, r.gpus_per_inference_worker, dict(cfg.ray.placement.engines))


def learner_request(cfg: JobConfig) -> ActorRequest:
    learner = cfg.learner
    ranks = learner.world_size if learner.data_parallel == "fsdp" else 1
    return ActorRequest("learner.world_size x learner.gpus / world_size", ranks, 1.0, learner.gpus / ranks,
                        dict(cfg.ray.placement.learner))


def teacher_request(cfg: JobConfig, i: int) -> ActorRequest:
    t = cfg.learner.distill.teachers[i]
    return ActorRequest(f"learner.distill.teachers.{i}.engines x gpus_per_engine", t.engines, 1.0, t.gpus_per_engine,
                        dict(cfg.ray.placement.teachers))


def rollout_worker_request(cfg: JobConfig) -> ActorRequest:
    """Rollout workers take no CPU slot (their work is waiting: on engines, sandboxes), only placement."""
    return ActorRequest("rollout.num_rollout_workers", cfg.rollout.num_rollout_workers, 0.0, 0.0,
                        dict(cfg.ray.placement.rollout_workers))


def job_requests(cfg: JobConfig) -> list[ActorRequest]:
    """The job's actors that hold resources, all running at once. Rollout workers, the buffer and the pool's
    router take none."""
    return [engine_request(cfg), learner_request(cfg), rollout_worker_request(cfg),
            *(teacher_request(cfg, i) for i in range(len(cfg.learner.distill.teachers)))]


def check_resources(cfg: JobConfig) -> None:
    """Refuse, before anything waits, a job this Ray cluster can never place: an actor larger than
    every node (an actor runs on one), or all of them together more than the cluster's total
    (sum over actors of count x per-actor request <= ray.cluster_resources())."""
    total = ray.cluster_resources()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    have = f"the cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all on {len(nodes)} " \
           f"node(s), at most {max((n.get('CPU', 0) for n in nodes), default=0):g} CPUs and " \
           f"{max((n.get('GPU', 0) for n in nodes), default=0):g} GPUs on one"
    requests = [r for r in job_requests(cfg) if r.count > 0]
    def fits(r: ActorRequest, n: dict) -> bool:
        return all(n.get(k, 0) >= v for k, v in {"CPU": r.cpus, "GPU": r.gpus, **r.resources}.items())

    problems = [f"{r.fields}: each of its {r.count} actor(s) asks for {r.cpus:g} CPU and {r.gpus:g} GPU"
                + (f" and {r.resources} (ray.placement)" if r.resources else "") + ", more than any node has"
                for r in requests if not any(fits(r, n) for n in nodes)]
    for kind in ("CPU", "GPU"):
        each = (lambda r: r.cpus) if kind == "CPU" else (lambda r: r.gpus)
        need = sum(r.count * each(r) for r in requests)
        if need > total.get(kind, 0) + 1e-9:
            parts = " + ".join(f"{r.count} x {each(r):g} ({r.fields})" for r in requests if each(r))
            problems.append(f"all together the job asks for {need:g} {kind}s, more than the {total.get(kind, 0):g} "
                            f"the cluster has: {parts}")
    if problems:
        raise ClusterResourcesError(f"this job can never start on this Ray cluster ({have}):\n  " + "\n  ".join(problems)
                                    + "\nAsk for less in those config fields, or run on a larger cluster "
                                      "(ray.address; ray.num_cpus for a local Ray).")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now: where a process group's store can listen."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rendezvous_host(on_cluster: bool) -> str:
    """Where a process group's store listens (on the node of its rank 0): loopback when the job
    runs its own local Ray (every process is on this machine), the node's address on a cluster."""
    if not on_cluster:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()
