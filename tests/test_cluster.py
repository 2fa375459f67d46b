"""A user's own environment, defined in a module outside the package, reaches `k3rl envs check`, the
driver's env-id check and the Ray workers of a job (local Ray and a `ray start --head` cluster), by
`envs.imports` / `--import`, the `k3rl.envs` entry points, and `ray.runtime_env`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ray_head import ray_head

from k3rl.cluster import LOCAL_RAY_ENV, NO_DASHBOARD_RAY_ENV, free_port
from k3rl.config import ConfigError, JobConfig
from k3rl.envs.registration import check_env_ids, import_env_modules

K3RL_BIN = str(Path(sys.executable).with_name("k3rl"))  # the console script a user runs

# A user's env module: registers one ToolEnv (with an oracle, so `envs check` can play it) on import.
ENV_MODULE = textwrap.dedent('''
    import gymnasium
    from k3rl.chat import Message
    from k3rl.envs import ToolEnv, tool

    class Reverse(ToolEnv):
        def generate_task(self, rng, options):
            return "".join(chr(97 + int(i)) for i in rng.integers(26, size=5))
        def opening_messages(self, task):
            return [Message(role="user", content=f"reverse {task} with the tool, then answer with the result")]
        def score(self, final_text):
            return float(final_text.strip() == self.task[::-1])
        @tool
        def reverse(self, text: str) -> str:
            """Reverse the text."""
            return text[::-1]
        def oracle(self, history=None):
            if self.turn == 0:
                return self.say(tool_calls=[{"name": "reverse", "arguments": {"text": self.task}}])
            return self.say(self.task[::-1])

    def register():
        gymnasium.register("{namespace}/Reverse-v0", entry_point=Reverse)
''')


def write_module(directory: Path, name: str, namespace: str, register_on_import: bool = True) -> Path:
    path = directory / f"{name}.py"
    path.write_text(ENV_MODULE.replace("{namespace}", namespace) + ("register()\n" if register_on_import else ""))
    return path


def write_dist(directory: Path, name: str, entry_point: str) -> None:
    """An installed distribution (as pip leaves it) whose k3rl.envs entry point is `entry_point`."""
    info = directory / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f'[k3rl.envs]\n{name} = {entry_point}\n')


def k3rl(*args: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([K3RL_BIN, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_envs_check_finds_a_users_module_by_import(tmp_path):
    write_module(tmp_path, "my_envs", "user")
    r = k3rl("envs", "check", "user/Reverse-v0", "--import", "my_envs", cwd=tmp_path)  # the module is in the cwd
    assert r.returncode == 0, r.stdout + r.stderr
    assert "env checker passed" in r.stdout and "reward 1.0000" in r.stdout
    r = k3rl("envs", "check", "user/Reverse-v0", cwd=tmp_path)  # not imported: refused with the way to do it
    assert r.returncode == 2
    assert "Namespace user not found" in r.stderr and "--import MODULE" in r.stderr
    r = k3rl("envs", "check", "user/Reverse-v0", "--import", "my_env", cwd=tmp_path)
    assert r.returncode == 2
    assert "--import: cannot import 'my_env': ModuleNotFoundError: No module named 'my_env'" in r.stderr


@pytest.mark.parametrize("entry_point", ["plugin_envs", pytest.param("plugin_envs:register", marks=pytest.mark.slow)])
def test_the_entry_point_group_takes_a_module_or_a_function(tmp_path, entry_point):
    site = tmp_path / "site"
    site.mkdir()
    write_module(site, "plugin_envs", "plugin", register_on_import=":" not in entry_point)
    write_dist(site, "plugin_envs", entry_point)
    r = k3rl("envs", "check", "plugin/Reverse-v0", cwd=tmp_path, pythonpath=site)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reward 1.0000" in r.stdout


def test_unknown_env_ids_and_modules_are_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write_module(tmp_path, "driver_envs", "driver")
    with pytest.raises(ConfigError) as e:
        check_env_ids(JobConfig.load(None, ["envs.imports=[driver_envs]", "envs.train.0.id=driver/Revers-v0"]))
    assert "envs.train.0.id: Environment `Revers` doesn't exist in namespace driver. Did you mean: `Reverse`?" in str(e.value)
    check_env_ids(JobConfig.load(None, ["envs.imports=[driver_envs]", "envs.train.0.id=driver/Reverse-v0"]))
    with pytest.raises(ConfigError, match=r"envs.eval.0.id: Environment `Revers` doesn't exist"):  # held-out envs too
        check_env_ids(JobConfig.load(None, ["envs.imports=[driver_envs]", "envs.train.0.id=driver/Reverse-v0",
                                            "envs.eval=[{id: driver/Revers-v0}]"]))
    with pytest.raises(ConfigError, match=r"envs.imports.1: cannot import 'no_such_envs': ModuleNotFoundError"):
        import_env_modules(["driver_envs", "no_such_envs"])
    (tmp_path / "broken_envs.py").write_text("raise RuntimeError('half-written module')\n")
    with pytest.raises(ConfigError, match=r"envs.imports.0: cannot import 'broken_envs': RuntimeError: half-written"):
        import_env_modules(["broken_envs"])


def make_env_in_a_ray_actor(modules: list[str], env_id: str) -> dict:
    """In a Ray worker of the job: import `modules` as the rollout workers do, make the env, play its oracle."""
    import ray

    @ray.remote(num_cpus=1)
    def make(modules, env_id):  # defined here: shipped by value, the worker needs no test module
        import os

        import gymnasium

        from k3rl.envs.registration import import_env_modules
        from k3rl.rollout.episode import run_oracle_episode

        import_env_modules(modules)
        env = gymnasium.make(env_id)
        episode = run_oracle_episode(env, seed=3)
        return {"class": type(env.unwrapped).__name__, "reward": episode.reward,
                "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "RAY_AUTH_MODE", "K3RL_TEST_VAR", *LOCAL_RAY_ENV,
                                                      *NO_DASHBOARD_RAY_ENV)}}

    return ray.get(make.remote(modules, env_id), timeout=300)


@pytest.mark.slow
def test_a_local_job_ships_the_users_module_to_its_workers_by_working_dir(tmp_path, monkeypatch):
    import ray

    from k3rl.cluster import init_ray

    for key in (*LOCAL_RAY_ENV, *NO_DASHBOARD_RAY_ENV):  # set for every test by conftest.py: init_ray must set them
        monkeypatch.delenv(key, raising=False)

    code = tmp_path / "project"
    code.mkdir()
    write_module(code, "shipped_envs", "shipped")
    cfg = JobConfig.load(None, ["ray.num_cpus=2", "envs.imports=[shipped_envs]", f"ray.runtime_env.working_dir={code}",
                                "ray.runtime_env.env_vars.K3RL_TEST_VAR=from-config"])
    ray.shutdown()
    try:
        init_ray(cfg)  # the driver has not imported the module and does not have it on its path
        got = make_env_in_a_ray_actor(cfg.envs.imports, "shipped/Reverse-v0")
    finally:
        ray.shutdown()
    assert got["class"] == "Reverse" and got["reward"] == 1.0
    # and a local Ray starts no idle workers ahead and, without its dashboard, exports no metrics or task events
    assert got["env"] == {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "K3RL_TEST_VAR": "from-config",
                          "RAY_prestart_worker_first_driver": "0", "RAY_enable_metrics_collection": "0",
                          "RAY_enable_core_worker_task_event_to_gcs": "0"}


@pytest.mark.slow
def test_a_cluster_job_ships_the_users_module_by_py_modules(tmp_path):
    """`ray.address` joins a `ray start --head` cluster (stopped through its own process, so other Ray
    processes are untouched); the user's package travels as `ray.runtime_env.py_modules`."""

    from k3rl.cluster import init_ray

    package = tmp_path / "cluster_envs"
    package.mkdir()
    write_module(package, "__init__", "cluster")
    with ray_head(free_port()) as address:
        cfg = JobConfig.load(None, [f"ray.address={address}", "envs.imports=[cluster_envs]",
                                    f"ray.runtime_env.py_modules=[{package}]"])
        init_ray(cfg)
        got = make_env_in_a_ray_actor(cfg.envs.imports, "cluster/Reverse-v0")
        assert got["class"] == "Reverse" and got["reward"] == 1.0
        assert got["env"]["OMP_NUM_THREADS"] == "1"  # the job's env vars reach a cluster's workers too


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_a_job_the_cluster_can_never_hold_is_refused_at_start(tmp_path):
    """More engines than the local Ray's CPUs (one each, beside the learner's), or a GPU engine on a
    cluster without GPUs: run_job refuses as soon as Ray is up, naming the config fields and the
    cluster's totals, instead of waiting out ray.start_timeout_s (1800 s by default)."""
    import ray

    from k3rl.cluster import ClusterResourcesError, check_resources
    from k3rl.job import run_job

    base = ["name=big", "model.preset=k3-tiny", "learner.sft_steps=0", f"tracking.runs_dir={tmp_path}/runs",
            f"tracking.uri=sqlite:///{tmp_path}/runs/mlflow.db", "ray.num_cpus=2"]
    try:
        with pytest.raises(ClusterResourcesError) as e:
            run_job(JobConfig.load(None, [*base, "rollout.num_inference_workers=3"]), quiet=True)
        assert ("this job can never start on this Ray cluster (the cluster has 2 CPUs and 0 GPUs in all on 1 node(s), "
                "at most 2 CPUs and 0 GPUs on one)") in str(e.value)
        assert ("all together the job asks for 4 CPUs, more than the 2 the cluster has: 3 x 1 "
                "(rollout.num_inference_workers x rollout.gpus_per_inference_worker) + 1 x 1 (learner.world_size x "
                "learner.gpus / world_size)") in str(e.value)
        assert "ray.num_cpus for a local Ray" in str(e.value)
        assert ray.is_initialized()  # refused after Ray came up: against the cluster's real resources

        with pytest.raises(ClusterResourcesError, match=r"rollout.num_inference_workers x rollout.gpus_per_inference_"
                                                        r"worker: each of its 1 actor\(s\) asks for 1 CPU and 1 GPU, "
                                                        r"more than any node has"):
            check_resources(JobConfig.load(None, [*base, "rollout.gpus_per_inference_worker=1"]))
        check_resources(JobConfig.load(None, base))  # one engine + one learner rank: fits

        # what fits waits for ray.start_timeout_s, the one deadline of the start, and the error names it
        with pytest.raises(TimeoutError, match=r"waited 1s for the inference engines, the learner ranks and the "
                                               r"teachers' engines to build their models \(ray.start_timeout_s\)"):
            run_job(JobConfig.load(None, [*base, "name=slow", "ray.start_timeout_s=1"]), quiet=True)
    finally:
        ray.shutdown()

