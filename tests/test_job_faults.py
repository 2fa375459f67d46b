"""The whole job under faults, and every way a job can end: the accounting holds, the store keeps every
episode exactly once, and nothing is left behind (no container with the job's label, no live Ray actor
of the job, no sandbox or Ray process of a dead driver once `k3rl sandbox gc` has run).

The faulty environments live in tests/faulty_envs.py, a user's module outside the package: the job
imports it through `envs.imports`, and the Ray workers find it through `ray.runtime_env`.
"""

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from k3rl.config import JobConfig

pytestmark = pytest.mark.slow
TESTS = str(Path(__file__).resolve().parent)
CHILD_ENV = {**os.environ, "PYTHONPATH": TESTS, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
             "OMP_NUM_THREADS": "1"}


def _job(tmp_path, name, envs, *extra) -> dict:
    """A small job's config as a dict: the test envs, 2 x 2 episodes per step, local Ray."""
    base = JobConfig.load(None, [
        f"name={name}", "rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.episodes_per_worker=4",
        "rollout.sampling.max_tokens_per_turn=24", "rollout.max_context_tokens=512", "envs.max_turns=2",
        "learner.checkpoint_every=1", "learner.micro_batch_tokens=2048", "tracking.sample_episodes=0",
        f"tracking.runs_dir={tmp_path}/runs", f"tracking.uri=sqlite:///{tmp_path}/runs/mlflow.db", "ray.num_cpus=4",
        "sandbox.pool_size=1", "sandbox.max_concurrency=8", *extra]).to_dict()
    base["envs"]["train"] = envs
    base["envs"]["imports"] = ["faulty_envs"]
    base["ray"]["runtime_env"] = {"env_vars": {"PYTHONPATH": TESTS}}
    return base


FLAKY = {"id": "faulty/FlakyLookup-v0", "kwargs": {"num_keys": 2, "tool_failure": 0.3, "reset_fails": 0.25}}
SANDBOXED = {"id": "faulty/SandboxedLookup-v0", "kwargs": {"num_keys": 2}}


BWRAP_BEFORE: set[str] = set()  # bwrap processes of other tests, alive before this module ran


@pytest.fixture(scope="module", autouse=True)
def _bwrap_before():
    BWRAP_BEFORE.update(subprocess.run(["pgrep", "-x", "bwrap"], capture_output=True, text=True).stdout.split())


@pytest.fixture
def no_local_ray():
    """The CLI's jobs run a Ray of their own; none runs in this process (the module's jobs share one)."""
    import ray

    ray.shutdown()


def leftovers(job: str) -> dict[str, list]:
    """What a job may have left: containers with its label, live Ray actors (when Ray is up in this
    process), sandbox processes, and Ray processes whose session has no raylet any more."""
    import ray

    from k3rl.sandboxes.gc import orphaned_ray_processes

    out = {"containers": subprocess.run(["docker", "ps", "-aq", "--filter", f"label=k3rl.job={job}"],
                                        capture_output=True, text=True).stdout.split(),
           "bwrap": [p for p in subprocess.run(["pgrep", "-x", "bwrap"], capture_output=True, text=True).stdout.split()
                     if p not in BWRAP_BEFORE],
           "ray_orphans": [p for p, _ in orphaned_ray_processes()]}
    if ray.is_initialized():
        from ray._private.state import actors

        out["actors"] = [a["ActorClassName"] for a in actors().values() if a["State"] != "DEAD"]
    return out


def nothing_left(job: str, deadline_s: float = 60.0) -> dict[str, list]:
    """Leftovers, after giving processes that are on their way out a moment to go."""
    t = time.monotonic()
    while True:
        found = leftovers(job)
        if not any(found.values()) or time.monotonic() - t > deadline_s:
            return found
        time.sleep(1.0)


def test_fault_injection_of_the_whole_job(tmp_path, module_ray):
    """Envs whose reset and tools fail at random beside a sandboxed env; rollout worker 0 killed after
    step 1 and engine 0 after step 2. The job completes, failures are stored and never trained,
    issued = trained + failed + stale + unused + cancelled, each stored once, nothing left behind."""
    from k3rl.job import run_job
    from k3rl.store import TrajectoryStore

    cfg = JobConfig.from_dict(_job(tmp_path, "faults", [FLAKY, SANDBOXED], "learner.steps=4", "rollout.max_policy_lag=1",
                                   "rollout.num_rollout_workers=2", "rollout.num_inference_workers=2"))
    summary = run_job(cfg, kill_worker_at_step=1, kill_engine_at_step=2, quiet=True)
    assert summary["completed"] and summary["steps"] == 4 and summary["restarts"] >= 1
    assert nothing_left("faults") == {"containers": [], "bwrap": [], "ray_orphans": [], "actors": []}
    rows = TrajectoryStore(tmp_path / "runs" / "faults", readonly=True).summary()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))  # each stored exactly once
    status = {s: [r for r in rows if r["status"] == s] for s in ("trained", "failed", "stale", "unused")}
    assert sum(map(len, status.values())) == len(rows)
    acc, buf = summary["accounting"], summary["buffer"]
    for s, stored in status.items():
        assert buf[s] == len(stored), s
    cancelled = acc["episodes/issued"] - len(rows)  # in flight when the job ended: re-issued by a resume
    assert 0 <= cancelled <= 2 * 2 * 2 * 2  # (1 + lag) P G, for the up to two batches in flight
    assert status["failed"] and all(r["error"] for r in status["failed"])
    assert any("injected" in r["error"] for r in status["failed"])
    assert all(r["error"] is None and r["policy_version"] >= r["step"] - 1 for r in status["trained"])
    assert {r["env_id"] for r in status["trained"]} == {"faulty/FlakyLookup-v0", "faulty/SandboxedLookup-v0"}
    for m in summary["history"]:
        assert m["staleness/max"] <= 1.0


def test_an_actor_dying_fails_the_run_and_leaves_nothing(tmp_path, module_ray):
    """Learner rank 0 killed after step 1: the job raises the actor's death, its MLflow run is FAILED,
    and the engines, workers, buffer and sandboxes are gone."""
    import ray
    from mlflow.tracking import MlflowClient

    from k3rl.job import run_job

    cfg = JobConfig.from_dict(_job(tmp_path, "dies", [SANDBOXED], "learner.steps=3"))
    with pytest.raises(ray.exceptions.RayActorError):
        run_job(cfg, kill_learner_at_step=1, quiet=True)
    assert nothing_left("dies") == {"containers": [], "bwrap": [], "ray_orphans": [], "actors": []}
    run = MlflowClient(cfg.tracking.uri).search_runs([MlflowClient(cfg.tracking.uri).get_experiment_by_name("k3rl").experiment_id])[0]
    assert run.info.status == "FAILED"


def test_a_job_whose_episodes_all_fail_stops_with_their_errors(tmp_path, module_ray):
    from k3rl.job import run_job
    from k3rl.rollout.scheduler import EpisodesFailingError

    every_reset_fails = {"id": "faulty/FlakyLookup-v0", "kwargs": {"num_keys": 2, "reset_fails": 1.0}}
    cfg = JobConfig.from_dict(_job(tmp_path, "allfail", [every_reset_fails], "learner.steps=2"))
    with pytest.raises(EpisodesFailingError, match="RuntimeError: injected: reset failed") as e:
        run_job(cfg, quiet=True)
    assert "empty prompt" not in str(e.value) and "k3rl envs check" in str(e.value)


def _train(config: dict, tmp_path, *args) -> subprocess.Popen:
    path = tmp_path / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen([sys.executable, "-m", "k3rl.cli", "train", str(path), *args], env=CHILD_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    t = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, f"the job ended before {path.name} appeared:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() - t < timeout_s, f"{path.name} did not appear within {timeout_s:.0f}s"
        time.sleep(0.2)


def test_sigkill_of_the_driver_then_gc_then_resume_is_lossless(tmp_path, no_local_ray):
    """SIGKILL the driver mid-run; `k3rl sandbox gc` leaves no container, sandbox or Ray process of it;
    `--resume` finishes, and the store holds every trained episode exactly once, tagged with the step
    that trained it (each step P groups), and every failed one once."""
    from k3rl.store import TrajectoryStore

    config = _job(tmp_path, "killed", [{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 2}}, SANDBOXED],
                  "learner.steps=4", "rollout.max_policy_lag=1")
    run_dir = tmp_path / "runs" / "killed"
    proc = _train(config, tmp_path)
    _wait_for(run_dir / "checkpoints" / "step-000002", proc)
    time.sleep(0.5)  # into step 3
    proc.kill()  # SIGKILL, the driver alone: its Ray processes and containers are on their own
    proc.wait(30)
    gc = subprocess.run([sys.executable, "-m", "k3rl.cli", "sandbox", "gc"], env=CHILD_ENV, capture_output=True,
                        text=True, timeout=300)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    found = nothing_left("killed")
    assert found == {"containers": [], "bwrap": [], "ray_orphans": []}, found

    resumed = _train(config, tmp_path, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    rows = TrajectoryStore(run_dir, readonly=True).summary()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an episode was stored twice"
    for step in range(1, 5):
        trained = [r for r in rows if r["step"] == step and r["status"] == "trained"]
        assert len({r["id"].rsplit("-s", 1)[0] for r in trained}) == 2, (step, trained)
        assert all(step - 1 <= r["policy_version"] <= step for r in trained)
    assert nothing_left("killed") == {"containers": [], "bwrap": [], "ray_orphans": []}


def test_ctrl_c_ends_with_a_checkpoint_and_leaves_nothing(tmp_path, no_local_ray):
    from mlflow.tracking import MlflowClient

    config = _job(tmp_path, "interrupted", [SANDBOXED], "learner.steps=50", "rollout.max_policy_lag=1")
    run_dir = tmp_path / "runs" / "interrupted"
    proc = _train(config, tmp_path)
    _wait_for(run_dir / "checkpoints" / "step-000001", proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]  # stopped by Ctrl-C, after a checkpoint
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert steps and not list((run_dir / "checkpoints").glob(".step-*"))
    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("k3rl").experiment_id])[0]
    assert run.info.status == "KILLED"
    assert nothing_left("interrupted") == {"containers": [], "bwrap": [], "ray_orphans": []}


def test_ctrl_c_during_the_warm_start_ends_the_job_without_training(tmp_path, no_local_ray):
    """Ctrl-C while the SFT warm start runs (a long one): the job ends at once with 130, KILLED, no
    RL step, no checkpoint, nothing left behind."""
    from mlflow.tracking import MlflowClient

    config = _job(tmp_path, "early", [{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 2}}],
                  "learner.steps=5", "learner.sft_steps=2000", "learner.sft_episodes=8",
                  "rollout.sampling.max_tokens_per_turn=128",  # the oracle's messages fit (preflight)
                  "learner.eval_before_training=true")
    proc = _train(config, tmp_path)
    t = time.monotonic()
    for line in proc.stdout:  # the starting policy's evaluation is logged just before the SFT starts
        if "policy before training" in line:
            break
        assert time.monotonic() - t < 300, "the job did not reach its warm start within 300 s"
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    t = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert time.monotonic() - t < 90  # not after the 2000 SFT steps
    run_dir = tmp_path / "runs" / "early"
    assert not list((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").exists() else True
    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("k3rl").experiment_id])[0]
    assert run.info.status == "KILLED" and not client.get_metric_history(run.info.run_id, "reward/mean")[1:]
    assert nothing_left("early") == {"containers": [], "bwrap": [], "ray_orphans": []}


def _same_seeds(out: Path) -> None:
    from k3rl.job import run_job

    for name in ("same-a", "same-b"):  # one after the other on one Ray
        run_job(JobConfig.from_dict(_job(out, name, [{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 2}}],
                                         "learner.steps=2", "rollout.max_policy_lag=0", "learner.checkpoint_every=0")),
                quiet=True)


# the jobs that leave nothing to look at but their results run beside the suite (tests/background.py)
BACKGROUND_JOBS = {"same_seeds": lambda out: functools.partial(_same_seeds, out)}


@pytest.mark.background("same_seeds")
def test_same_seeds_lag_0_one_worker_give_identical_trajectories(background_job):
    from k3rl.store import TrajectoryStore

    _, out = background_job
    runs = [{t.id.split("-", 2)[-1]: t for t in TrajectoryStore(out / "runs" / name, readonly=True).read(status="trained")}
            for name in ("same-a", "same-b")]
    a, b = runs
    assert a.keys() == b.keys() and len(a) == 8
    for k in a:
        assert a[k].token_ids == b[k].token_ids, k
        assert a[k].logprobs == pytest.approx(b[k].logprobs, abs=1e-4)


def test_ctrl_c_wins_over_a_batch_that_is_already_waiting():
    """With max_policy_lag > 0 and rollouts that keep up, the next batch is ready the moment a step
    ends: Ctrl-C (the stop event) must still end the loop instead of training one more step."""
    import asyncio

    from k3rl.job import _unless

    async def ready():
        return "batch"

    async def later(stop):
        await asyncio.sleep(0.05)
        stop.set()
        return "batch"

    async def main():
        stop = asyncio.Event()
        assert await _unless(stop, ready()) == "batch"  # no Ctrl-C: the batch
        stop.set()
        assert await _unless(stop, ready()) is None  # Ctrl-C before the batch was asked for
        stop.clear()
        assert await _unless(stop, later(stop)) is None  # both at once: Ctrl-C wins the tie

    asyncio.run(main())
