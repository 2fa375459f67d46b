"""What a job runs on and records to: `sandbox:` (the tools' containers), `tracking:` (MLflow)
and `ray:` (the cluster)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import _refuse, _Section


class SandboxSection(_Section):
    backend: Literal["auto", "docker", "bwrap", "none"] = Field(
        "auto", description="auto: Docker when a daemon answers and the image is built, else bubblewrap; none: "
                            "tools run as plain host processes with NO isolation (asked for by name only, for tools "
                            "that need none, e.g. on a GPU machine without Docker)")
    image: str | None = Field(
        None, description="Docker image of the sandboxes (backend docker or auto); None: k3rl-sandbox:<version> from "
                          "`k3rl sandbox build`. Another image needs python3 and a user 1000 (e.g. FROM that image)")
    memory_mb: int = Field(512, ge=32, description="memory of one sandbox; Python needs 32 MB or more")
    cpus: float = Field(1.0, gt=0)
    pids: int = Field(128, ge=8)
    exec_timeout_s: float = Field(10.0, gt=0)
    pool_size: int = Field(4, ge=0, description="warm sandboxes kept ready")
    max_concurrency: int = Field(16, ge=1)
    starts_per_second: float = Field(4.0, gt=0)


class TrackingSection(_Section):
    uri: str = Field("sqlite:///runs/mlflow.db", description="MLflow tracking URI (sqlite:///... or http://server)")
    experiment: str = "k3rl"
    run_name: str | None = None
    runs_dir: str = "runs"
    sample_every: int = Field(5, ge=1, description="log sample episodes every this many steps (and at the last)")
    sample_episodes: int = Field(4, ge=0, description="episodes rendered as HTML artifacts per logging step")
    eval_every: int = Field(0, ge=0, description="run envs.eval every this many RL steps (and after the last); "
                                                 "0: only before the first RL step")
    write_deadline_s: float = Field(
        60.0, gt=0, description="a metric the store has not taken this long after it was logged (retried meanwhile, "
                                "off the training loop) is spooled to <run dir>/tracking_spool.jsonl and sent when the "
                                "store is back; training never waits for MLflow")


class PlacementSection(_Section):
    """Custom Ray resources each kind of actor asks for, to pin it to the nodes that offer them (a node
    started with `ray start --resources='{"engine_node": 8}'`). Empty: anywhere that has its CPUs/GPUs."""

    engines: dict[str, float] = Field(default_factory=dict, description="each inference engine's custom resources")
    learner: dict[str, float] = Field(default_factory=dict, description="each learner rank's custom resources")
    teachers: dict[str, float] = Field(default_factory=dict, description="each teacher engine's custom resources")
    rollout_workers: dict[str, float] = Field(default_factory=dict,
                                              description="each rollout worker's (its episodes' sandboxes run there)")

    @model_validator(mode="after")
    def _positive(self):
        _refuse([(f"{kind}.{name}", f"a resource amount must be > 0, got {amount}")
                 for kind in ("engines", "learner", "teachers", "rollout_workers")
                 for name, amount in getattr(self, kind).items() if not amount > 0])
        return self


class RaySection(_Section):
    placement: PlacementSection = Field(default_factory=PlacementSection)
    address: str | None = Field(None, description="None starts a local Ray; 'auto' or ray://host:port joins a cluster")
    num_cpus: int | None = Field(None, ge=1)
    namespace: str = "k3rl"
    include_dashboard: bool = False
    start_timeout_s: float = Field(
        1800.0, gt=0, description="the inference engines, the learner ranks and the teachers' engines must have "
                                  "built their models within this (and a resume loaded its checkpoint within it again); "
                                  "requests the cluster can never meet are refused at once instead")
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime_env of the job (working_dir, py_modules, pip, env_vars...): how a cluster's "
                    "workers get the user's code; its env_vars are merged over the ones the job sets")

    @model_validator(mode="after")
    def _env_vars_mapping(self):
        env_vars = self.runtime_env.get("env_vars")
        if env_vars is not None and not isinstance(env_vars, dict):
            _refuse([("runtime_env.env_vars", f"must map variable names to values, got {env_vars!r}")])
        return self
