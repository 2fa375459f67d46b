"""Starting or joining Ray for a job: `init_ray(cfg)`; where a process group of the job listens:
`rendezvous_host(on_cluster)` and `free_port(host)` (the learner's ranks, the weight transports).

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
