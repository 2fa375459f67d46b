"""The `k3rl` command line as a user runs it: real subprocesses, a real MLflow server on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from procs import alive, port_open, start_ui

K3RL = [sys.executable, "-m", "k3rl.cli"]


def k3rl(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*K3RL, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.slow
def test_stopping_k3rl_ui_stops_the_mlflow_server_it_started(tmp_path, sig):
    ui, port, started = start_ui(f"sqlite:///{tmp_path}/mlflow.db", tmp_path)
    try:
        assert started, "k3rl ui should run the server as a child process"
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in alive(started)]
        assert not any("huey" in c or "_job_runner" in c for c in commands), commands  # no MLflow job runner
        ui.send_signal(sig)  # to k3rl ui alone, as `kill` or a service manager would (not its process group)
        assert ui.wait(timeout=60) == 128 + sig
        assert alive(started, within_s=30) == set(), "a process of the MLflow server survived"
        assert not port_open(port)
    finally:
        for pid in alive({ui.pid, *started}):  # only what this test started
            os.kill(pid, signal.SIGKILL)


def test_config_show_refuses_what_cannot_work_and_prints_notes():
    r = k3rl("config", "show", "--set", "rollout.engine=vllm")
    assert r.returncode == 2
    assert "learner.routing_replay: rollout.engine 'vllm' does not return the routed experts" in r.stderr
    assert "model.checkpoint: rollout.engine 'vllm' serves an HF-layout checkpoint" in r.stderr
    r = k3rl("config", "show", "--set", "learner.steps=3")
    assert r.returncode == 0, r.stderr
    assert "note: learner.checkpoint_every=10 is more than learner.steps=3" in r.stderr


def test_train_refuses_an_unknown_env_id_before_ray_starts(tmp_path):
    r = k3rl("train", "--set", "envs.train.0.id=k3rl/KeyLokup-v0", "--set", f"tracking.runs_dir={tmp_path}/runs",
             "--set", f"tracking.uri=sqlite:///{tmp_path}/runs/mlflow.db", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "envs.train.0.id: Environment `KeyLokup` doesn't exist in namespace k3rl. Did you mean: `KeyLookup`?" in r.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything started: no run, no Ray


def test_envs_check_suggests_the_registered_id():
    r = k3rl("envs", "check", "KeyLookup-v0")
    assert r.returncode == 2
    assert "Did you mean: `k3rl/KeyLookup-v0`?" in r.stderr
