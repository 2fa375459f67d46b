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
from typing import Any

import ray

from k3rl.config import JobConfig

# Communication settings the actors must share with the driver: NCCL_NVLS_ENABLE=0 and its
# relatives keep NVLink multicast off on shared GPU hosts; a worker without them would not.
FORWARDED_ENV_PREFIXES = ("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_", "TORCH_NCCL_")


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
        ray.init(address="local", num_cpus=cfg.ray.num_cpus or max(4, os.cpu_count() or 1),
                 include_dashboard=cfg.ray.include_dashboard, **common)


class ClusterResourcesError(RuntimeError):
    """The job asks for more than the Ray cluster has: its actors would wait for ever."""


def job_requests(cfg: JobConfig) -> list[tuple[str, int, float, float]]:
    """The job's actors that hold resources, all running at once: (the config fields that size them,
    how many, CPUs each, GPUs each). Rollout workers, the buffer and the pool's router take none."""
    r, learner = cfg.rollout, cfg.learner
    ranks = learner.world_size if learner.data_parallel == "fsdp" else 1
    return [("rollout.num_inference_workers x rollout.gpus_per_inference_worker", r.num_inference_workers, 1.0,
             r.gpus_per_inference_worker),
            ("learner.world_size x learner.gpus / world_size", ranks, 1.0, learner.gpus / ranks),
            *((f"learner.distill.teachers.{i}.engines x gpus_per_engine", t.engines, 1.0, t.gpus_per_engine)
              for i, t in enumerate(learner.distill.teachers) if t.engines)]


def check_resources(cfg: JobConfig) -> None:
    """Refuse, before anything waits, a job this Ray cluster can never place: an actor larger than
    every node (an actor runs on one), or all of them together more than the cluster's total
    (sum over actors of count x per-actor request <= ray.cluster_resources())."""
    total = ray.cluster_resources()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    have = f"the cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all on {len(nodes)} " \
           f"node(s), at most {max((n.get('CPU', 0) for n in nodes), default=0):g} CPUs and " \
           f"{max((n.get('GPU', 0) for n in nodes), default=0):g} GPUs on one"
    requests = [r for r in job_requests(cfg) if r[1] > 0]
    problems = [f"{fields}: each of its {count} actor(s) asks for {cpus:g} CPU and {gpus:g} GPU, more than any node has"
                for fields, count, cpus, gpus in requests
                if not any(n.get("CPU", 0) >= cpus and n.get("GPU", 0) >= gpus for n in nodes)]
    for k, kind in ((2, "CPU"), (3, "GPU")):
        need = sum(r[1] * r[k] for r in requests)
        if need > total.get(kind, 0) + 1e-9:
            parts = " + ".join(f"{r[1]} x {r[k]:g} ({r[0]})" for r in requests if r[k])
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
