"""Preemption: a scheduler's SIGTERM (or SIGHUP), sent from outside the job's process group, ends the job
like Ctrl-C: a checkpoint at the next step boundary (or, past learner.preempt_grace_s, the last one), the
MLflow run KILLED, the summary written, nothing left behind, exit 143; `--resume` then finishes with every
episode stored exactly once."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import yaml
from test_job_faults import SANDBOXED, TESTS, _bwrap_before, _job, nothing_left  # noqa: F401 (a fixture)

# the children and their Ray workers see the same code as this process (PYTHONPATH may point elsewhere too)
PYTHONPATH = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
CHILD_ENV = {**os.environ, "PYTHONPATH": PYTHONPATH, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
             "OMP_NUM_THREADS": "1"}


def _train(config: dict, tmp_path, *args) -> subprocess.Popen:
    """`k3rl train` in a session of its own, as a scheduler starts it."""
    config["ray"]["runtime_env"] = {"env_vars": {"PYTHONPATH": PYTHONPATH}}
    path = tmp_path / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen([sys.executable, "-m", "k3rl.cli", "train", str(path), *args], env=CHILD_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_sigterm_checkpoints_ends_killed_leaves_nothing_and_resume_is_lossless(tmp_path):
    from mlflow.tracking import MlflowClient

    from k3rl.store import TrajectoryStore

    config = _job(tmp_path, "preempted", [{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 2}}, SANDBOXED],
                  "learner.steps=40", "learner.checkpoint_every=0", "rollout.max_policy_lag=1")
    run_dir = tmp_path / "runs" / "preempted"
    proc = _train(config, tmp_path)
    seen = []
    for line in proc.stdout:  # one line per step in a log
        seen.append(line)
        if re.search(r"\bstep 2: reward", line):
            break
    else:
        pytest.fail("the job ended before step 2:\n" + "".join(seen)[-3000:])
    os.kill(proc.pid, signal.SIGTERM)  # from outside its process group, as a scheduler does
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["signal"] == signal.SIGTERM and not summary["completed"] and not summary["abandoned_step"]
    stopped_at = summary["steps"]
    assert 2 <= stopped_at < 40
    assert (run_dir / "checkpoints" / f"step-{stopped_at:06d}").is_dir()  # checkpoint_every=0: the stop's own
    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("k3rl").experiment_id])[0]
    assert run.info.status == "KILLED"
    assert nothing_left("preempted") == {"containers": [], "bwrap": [], "ray_orphans": []}

    total = stopped_at + 2
    resumed = _train(config, tmp_path, "--resume", "--set", f"learner.steps={total}")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    rows = TrajectoryStore(run_dir, readonly=True).summary()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an episode was stored twice"
    for step in range(1, total + 1):
        trained = [r for r in rows if r["step"] == step and r["status"] == "trained"]
        assert len({r["id"].rsplit("-s", 1)[0] for r in trained}) == 2, (step, trained)
    assert nothing_left("preempted") == {"containers": [], "bwrap": [], "ray_orphans": []}


@pytest.mark.slow
def test_sigterm_while_the_job_starts_releases_what_started_and_ends_the_run_killed(tmp_path):
    """A scheduler may preempt a job before its first step, while Ray, the tracker, the engines and the
    learner start (minutes for a large model). The stop handler is in place from the start: the start is
    cancelled, what had started is released, the MLflow run ends KILLED and `k3rl train` exits 143. (It
    was installed after the start, so such a SIGTERM killed the driver outright: the run stayed RUNNING
    and its actors and sandboxes outlived it.)"""
    import time

    from mlflow.tracking import MlflowClient

    config = _job(tmp_path, "early", [{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 2}}, SANDBOXED],
                  "learner.steps=5", "learner.checkpoint_every=0")
    run_dir = tmp_path / "runs" / "early"
    proc = _train(config, tmp_path)
    end = time.monotonic() + 300
    while not (run_dir / "run.json").exists():  # written by Job.start once the MLflow run exists
        assert proc.poll() is None and time.monotonic() < end, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:]
    assert "while the job was starting" in out and "step 1:" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_while_starting"] and summary["signal"] == signal.SIGTERM and summary["steps"] == 0
    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("k3rl").experiment_id])[0]
    assert run.info.status == "KILLED" and "StoppedWhileStarting" in run.data.tags["k3rl.error"]
    assert nothing_left("early") == {"containers": [], "bwrap": [], "ray_orphans": []}


def test_sighup_and_sigterm_stop_the_job_and_the_grace_bounds_the_wait_for_the_step():
    """Each of SIGTERM, SIGHUP and SIGINT sets the stop and names itself; a step that never reaches its
    boundary is abandoned once learner.preempt_grace_s has passed after the signal."""
    from k3rl.config import JobConfig
    from k3rl.job import Stop

    assert JobConfig.load(None, []).learner.preempt_grace_s == 60.0

    async def main(sig):
        stop = Stop(grace_s=0.2)
        reached = []
        async with stop.grace():
            os.kill(os.getpid(), sig)
            await stop.wait()  # the handler ran
            assert stop.signal == sig
            await asyncio.Event().wait()  # a step that never ends
            reached.append("never")
        return stop, reached

    previous = {s: signal.getsignal(s) for s in Stop.SIGNALS}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            stop, reached = asyncio.run(main(sig))
            assert stop.abandoned and not reached
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def test_a_stop_that_comes_with_a_ready_batch_leaves_its_groups_to_the_checkpoint():
    """A stop signal in the same turn as the step's batch: the stop wins (no step more), and the batch's
    groups go back to the scheduler's open groups, which the checkpoint records (`Job.save`) and a resume
    re-issues under their ids; before, they were stored unused, rolled back and never re-issued."""
    from k3rl.config import JobConfig
    from k3rl.job import _unless
    from k3rl.rollout.scheduler import Group, Scheduler, episode_specs

    cfg = JobConfig.load(None, ["rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_policy_lag=0"])

    async def main():
        sched = Scheduler(cfg, "tie", lambda i: None, buffer=None)  # no worker: nothing is issued here
        for index in range(2):  # two finished groups sampled by version 0: step 1's batch, ready
            g = Group(index, episode_specs(cfg, "tie", index, 0), 0)
            g.results = {s["id"]: {"min_version": 0, "max_version": 0, "generated": 5, "reward": float(k),
                                   "error": None} for k, s in enumerate(g.specs)}
            sched.open[g.id] = g
        sched.next_index = 2
        stop = asyncio.Event()
        asyncio.get_running_loop().call_soon(stop.set)  # the signal lands in the turn the batch is handed out
        assert await _unless(stop, sched.next_batch(1), undo=sched.put_back) is None
        return sched.open_indices()

    assert asyncio.run(main()) == [0, 1]
