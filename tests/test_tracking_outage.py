"""Tracking never kills training: a real MLflow server that goes away (its port refuses connections, or its
process is killed mid-job) and comes back; the writes wait in a spool on disk and none is lost."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from k3rl.cluster import free_port
from k3rl.tracking import Tracker
from k3rl.tracking_writer import Spool


class MlflowServer:
    """`mlflow server` on a loopback port, its SQLite store and artifacts under `root`."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.proc = root, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'm.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"], stdout=log, stderr=log, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # as `k3rl ui` runs it
        end = time.monotonic() + 90
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
                time.sleep(0.25)
        raise TimeoutError(f"mlflow server on {self.uri} did not answer in 90 s")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Gate:
    """A loopback TCP forwarder in front of the server: `close()` refuses and cuts every connection, as a
    server that went away does; `open()` lets them through again."""

    def __init__(self, target_port: int) -> None:
        self.target, self.port = target_port, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.conns: list[socket.socket] = []
        self.listener: socket.socket | None = None

    def open(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the thread (close alone does not)
        self.listener.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self.conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    s.start()
    yield s
    s.kill()


@pytest.mark.slow
def test_writes_never_wait_for_a_store_that_is_gone_and_a_resume_or_sync_delivers_them(server, tmp_path):
    from typer.testing import CliRunner

    from k3rl.cli import app

    gate = Gate(server.port)
    gate.open()
    run_dir = tmp_path / "run"
    t = Tracker(uri=gate.uri, experiment="outage", run_name="w", run_dir=run_dir, write_deadline_s=0.5)
    t.log_metrics({"x": 0.0}, step=0)
    assert t.flush(10)
    client = MlflowClient(server.uri)
    assert [m.step for m in client.get_metric_history(t.run_id, "x")] == [0]

    gate.close()  # the store is gone: the writes return at once and land in the spool
    t0 = time.monotonic()
    for step in range(1, 4):
        t.log_metrics({"x": float(step)}, step=step)
    t.set_tags({"note": "written while the store was gone"})
    assert time.monotonic() - t0 < 1.0  # a synchronous write to a dead server blocks for minutes
    assert t.flush(10)
    assert [r["kind"] for r in Spool(run_dir).read()] == ["metrics"] * 3 + ["tags"]
    assert t.writer.stats()["spooled"] == 4 and t.writer.stats()["pending"] == 4

    t.writer.close(0)  # the process dies here, without ending its run: the spool is on disk
    gate.open()
    again = Tracker(uri=gate.uri, run_id=t.run_id, run_dir=run_dir, write_deadline_s=0.5)  # a resume replays it first
    assert Spool(run_dir).read() == []
    assert again.metric_history("x") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert client.get_run(t.run_id).data.tags["note"] == "written while the store was gone"

    gate.close()  # gone again at the end: the end waits write_deadline_s, then stays in the spool ...
    again.log_metrics({"x": 4.0}, step=4)
    again.finish("FINISHED")
    assert again.pending == 2 and client.get_run(t.run_id).info.status == "RUNNING"
    (run_dir / "run.json").write_text(json.dumps({"mlflow_run_id": t.run_id}))
    refused = CliRunner().invoke(app, ["sync", str(run_dir), "--tracking-uri", gate.uri])
    assert refused.exit_code == 1 and "2 still wait" in refused.output
    gate.open()  # ... until `k3rl sync` sends it
    synced = CliRunner().invoke(app, ["sync", str(run_dir), "--tracking-uri", gate.uri])
    assert synced.exit_code == 0 and "sent 2 spooled records" in synced.output, synced.output
    assert client.get_run(t.run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(t.run_id, "x")] == [0, 1, 2, 3, 4]
    assert not (run_dir / "tracking_spool.jsonl").exists()
    gate.close()


def test_a_torn_spool_line_is_skipped_and_the_next_record_starts_a_line(tmp_path):
    spool = Spool(tmp_path)
    spool.append([{"kind": "tags", "tags": {"a": "1"}}])
    with open(spool.path, "ab") as f:
        f.write(b'{"kind": "metr')  # a crash mid-append
    spool.append([{"kind": "tags", "tags": {"b": "2"}}])
    assert [r["tags"] for r in spool.read()] == [{"a": "1"}, {"b": "2"}]
    spool.drop_first(1)  # the torn line goes with the record before it
    assert [r["tags"] for r in spool.read()] == [{"b": "2"}]
    spool.drop_first(1)
    assert not spool.path.exists()


@pytest.mark.slow
def test_the_job_finishes_through_a_tracking_server_that_dies_and_comes_back(server, tmp_path, module_ray):
    """The job's metrics go to a real MLflow server, which is killed after step 1 and restarted: the job runs
    through, every step's metrics reach the server, and the run ends FINISHED."""
    from k3rl.config import JobConfig
    from k3rl.job import run_job

    steps = 6
    cfg = JobConfig.load(None, [
        "name=outage", "model.preset=k3-tiny", "rollout.group_size=2", "rollout.prompts_per_step=2",
        "rollout.episodes_per_worker=8", "rollout.sampling.max_tokens_per_turn=24", "rollout.max_context_tokens=512",
        "envs.max_turns=2", "learner.sft_steps=0", "learner.checkpoint_every=0", "learner.micro_batch_tokens=2048",
        f"learner.steps={steps}", f"tracking.runs_dir={tmp_path}/runs", f"tracking.uri={server.uri}",
        "tracking.write_deadline_s=1", "tracking.sample_episodes=1", "tracking.sample_every=1", "ray.num_cpus=4"])
    run_dir = tmp_path / "runs" / "outage"
    client = MlflowClient(server.uri)
    out: dict = {}
    job = threading.Thread(target=lambda: out.update(run_job(cfg, quiet=True)), daemon=True)
    job.start()
    seen_spool = False
    end = time.monotonic() + 600
    while job.is_alive() and time.monotonic() < end:  # after step 1 is in the store: kill the server
        run = json.loads((run_dir / "run.json").read_text()).get("mlflow_run_id") if (run_dir / "run.json").exists() else None
        if run and any(m.step >= 1 for m in client.get_metric_history(run, "reward/mean")):
            break
        time.sleep(0.5)
    server.kill()
    while not seen_spool:  # the job goes on, spooling its metrics (or has just ended, its last ones spooled)
        seen_spool = (run_dir / "tracking_spool.jsonl").exists()
        if not job.is_alive():
            break
        time.sleep(0.2)
    server.start()
    job.join(timeout=600)
    assert not job.is_alive() and out["completed"], out
    assert seen_spool and out["tracking"]["spooled"] > 0
    if not out["tracking"]["pending"]:  # the server came back while the job ran: the spool was replayed into it
        assert out["tracking"]["replayed"] > 0, out["tracking"]
    else:  # the job ended before the server was back: `k3rl sync` delivers the rest
        from k3rl.tracking_writer import replay
        assert replay(client, out["mlflow_run_id"], Spool(run_dir))[1] == 0
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")}) == list(range(1, steps + 1))
    assert not (run_dir / "tracking_spool.jsonl").exists()


def test_records_a_full_queue_spills_reach_the_store_that_is_up(tmp_path):
    """A queue of one, written faster than the store takes it: what overflows goes to the spool on disk, and
    from there into the store, which never went down; nothing waits in the spool at the end."""
    from k3rl.tracking import mlflow_client
    from k3rl.tracking_writer import Writer

    client = mlflow_client(f"sqlite:///{tmp_path}/m.db")
    run = client.create_run(client.create_experiment("spill"))
    w = Writer(client, run.info.run_id, tmp_path / "run", deadline_s=30, queue_size=1)
    for step in range(40):
        w.put({"kind": "metrics", "metrics": [("x", float(step), 1000 + step, step)]})
    assert w.stats()["spooled"] > 0  # the queue did overflow
    assert w.close(timeout=30) == 0
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "x")) == list(range(40))
