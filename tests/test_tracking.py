"""Tracker against a real MLflow SQLite store in a temp dir (one store for the module: the
first start-up runs MLflow's migrations)."""

from __future__ import annotations

import base64
import contextlib
import io
import math
import os
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image
from test_store import make_episode

from k3rl.images import PNG_MAGIC, png_size
from k3rl.tracking import MAX_PARAM_VAL_LENGTH, Tracker, TrackingError, clean_key, find_run, truncate_value


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root}/mlflow.db", root


def test_params_metrics_artifacts_on_local_disk(store):
    uri, root = store
    tracker = Tracker(uri=uri, experiment="exp-a", run_name="alpha", run_dir=root / "runs" / "alpha")
    nested = {"learner": {"lr": 0.003, "steps": 20}, "name": "job", "envs": {"train": [{"id": "k3rl/KeyLookup-v0"}]}}
    many = {f"p{i:03d}": i for i in range(250)}  # more than one batch of 100
    long = "x" * (MAX_PARAM_VAL_LENGTH + 500)
    logged = tracker.log_params({**nested, **many, "long": long, "bad key$%": None})
    assert logged["learner.lr"] == "0.003" and logged["bad key__"] == "None"
    for step in range(5):
        tracker.log_metrics({"reward/mean": step * 0.25, "reward/k3rl/KeyLookup-v0/mean": step * 0.2,
                             "reward/std": 0.1, "loss/pg": 1.0 / (step + 1), "count": step}, step=step)
    tracker.log_metrics({"reward/mean": 0.9}, step=4)  # re-logged at a step: the last value wins
    tracker.log_metrics({"grad_norm": float("nan")}, step=0)
    assert tracker.flush()  # with a run folder the writes go through the writer's thread

    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    params = run.data.params
    assert len(params) == 3 + 250 + 2 + 1
    assert params["learner.steps"] == "20" and params["p249"] == "249"
    assert params["envs.train"] == "[{'id': 'k3rl/KeyLookup-v0'}]"
    assert len(params["long"]) == MAX_PARAM_VAL_LENGTH
    cut = int(re.search(r"\.\.\.\[truncated (\d+) chars\]$", params["long"]).group(1))
    assert params["long"].startswith("x" * 100) and params["long"].count("x") + cut == len(long)
    assert tracker.metric_history("reward/mean") == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75), (4, 0.9)]
    assert math.isnan(client.get_metric_history(tracker.run_id, "grad_norm")[0].value)
    assert run.data.tags["k3rl.run_dir"] == str((root / "runs" / "alpha").resolve())

    with pytest.raises(TypeError, match="metric 'bad' must be a number"):
        tracker.log_metrics({"bad": "high"}, step=1)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        tracker.log_metrics({"x": 1.0}, step=-1)

    # artifacts: text, bytes, a file, an episode page, the reward curve
    tracker.log_artifact_text("name: job\n", "config/job.yaml")
    (root / "note.txt").write_text("hello")
    assert tracker.log_artifact_file(root / "note.txt") == "note.txt"
    with pytest.raises(FileNotFoundError, match="no such file"):
        tracker.log_artifact_file(root / "missing.txt")
    ep = make_episode(3, step=4)
    page_path = tracker.log_episode_html(ep, step=4)
    assert page_path == f"episodes/step_000004/{ep.id}.html"
    curve = tracker.log_reward_curve_png()
    assert curve == "reward_curve.png"
    assert set(tracker.list_artifacts()) == {"config/job.yaml", "note.txt", page_path, "reward_curve.png"}
    tracker.finish()
    assert client.get_run(tracker.run_id).info.status == "FINISHED"

    # everything lies on the local disk next to the database
    art_dir = root / "artifacts" / "exp-a" / tracker.run_id / "artifacts"
    assert client.get_experiment_by_name("exp-a").artifact_location == str(root / "artifacts" / "exp-a")
    assert (art_dir / "config" / "job.yaml").read_text() == "name: job\n"
    png = (art_dir / "reward_curve.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and png_size(png) == (800, 450)
    # two curves (reward/mean and the per-env mean, not reward/std): matplotlib's first two colours only
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    pixels = {tuple(int(x) for x in px) for px in np.unique(rgb, axis=0)}
    assert {(31, 119, 180), (255, 127, 14)} <= pixels and (44, 160, 44) not in pixels
    page = (art_dir / page_path).read_text()
    inline = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [base64.b64decode(s) for s in inline] == ep.images  # every image inline, byte for byte
    assert "add" in page and "&quot;a&quot;: 3" in page and "policy version 1" in page


def test_resume_by_run_id_continues_the_run(store):
    uri, _ = store
    first = Tracker(uri=uri, experiment="exp-b", run_name="beta")
    first.log_params({"lr": 0.1, "steps": 10})
    first.log_metrics({"reward/mean": 0.1}, step=1)
    first.finish("KILLED")

    client = MlflowClient(uri)
    resumed = Tracker(uri=uri, experiment="exp-b", run_id=first.run_id)
    assert resumed.resumed and resumed.run_name == "beta"
    assert client.get_run(first.run_id).info.status == "RUNNING"
    # params already there are skipped; a changed one cannot be overwritten in MLflow -> a tag says so
    assert resumed.log_params({"lr": 0.1, "steps": 20, "new": 1}) == {"new": "1"}
    resumed.log_metrics({"reward/mean": 0.2}, step=2)
    resumed.finish()
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1", "steps": "10", "new": "1"}
    assert run.data.tags["param_changed.steps"] == "20"
    assert resumed.metric_history("reward/mean") == [(1, 0.1), (2, 0.2)]
    assert len(client.search_runs([run.info.experiment_id])) == 1  # no second run was made

    assert find_run(client, "beta").info.run_id == first.run_id
    assert find_run(client, first.run_id).info.run_name == "beta"
    with pytest.raises(TrackingError, match=r"no MLflow run named or with id 'gamma'.*beta"):
        find_run(client, "gamma")
    with pytest.raises(TrackingError, match="cannot resume MLflow run '0+'"):
        Tracker(uri=uri, run_id="0" * 32)
    with pytest.raises(ValueError, match="status must be one of"):
        resumed.finish("DONE")


def test_context_manager_marks_failed_runs(store):
    uri, _ = store
    with pytest.raises(RuntimeError), Tracker(uri=uri, experiment="exp-b", run_name="crash") as t:
        t.log_metrics({"reward/mean": 0.0}, step=0)
        raise RuntimeError("boom")
    assert MlflowClient(uri).get_run(t.run_id).info.status == "FAILED"
    assert t.log_reward_curve_png(metrics=["nothing/here"]) is None


@pytest.mark.parametrize("ending, status", [
    ("raise RuntimeError('the learner died')", "FAILED"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGINT)", "KILLED"),  # Ctrl-C
])
def test_a_job_process_marks_its_run_by_how_it_ended(store, ending, status):
    """A driver that wraps its job in the Tracker leaves no run RUNNING when it crashes or is stopped."""
    import subprocess
    import sys

    uri, _ = store
    code = (f"from k3rl.tracking import Tracker\n"
            f"with Tracker(uri={uri!r}, experiment='crashes', run_name={ending!r}) as t:\n"
            f"    print(t.run_id, flush=True)\n"
            f"    t.log_metrics({{'reward/mean': 0.5}}, step=1)\n"
            f"    {ending}\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode == 0) == (status == "FINISHED"), r.stderr
    run = MlflowClient(uri).get_run(r.stdout.split()[0])
    assert run.info.status == status
    assert run.data.metrics["reward/mean"] == 0.5
    if ending.startswith("raise RuntimeError"):
        assert run.data.tags["k3rl.error"] == "RuntimeError: the learner died"


@pytest.mark.parametrize("error, status", [
    (None, "FINISHED"), (SystemExit(0), "FINISHED"), (SystemExit(2), "KILLED"), (KeyboardInterrupt(), "KILLED"),
    (ValueError("bad batch"), "FAILED"),
])
def test_the_status_follows_how_the_block_ended(store, error, status):
    uri, _ = store
    with pytest.raises(type(error)) if error else contextlib.nullcontext(), Tracker(uri=uri, experiment="exp-c") as t:
        if error:
            raise error
    assert MlflowClient(uri).get_run(t.run_id).info.status == status


def test_finish_counts_once_and_the_block_error_is_never_masked(store):
    uri, _ = store
    client = MlflowClient(uri)
    with Tracker(uri=uri, experiment="exp-b", run_name="twice") as t:
        t.finish("KILLED")  # the driver decided; leaving the block does not overwrite it
        t.finish("FINISHED")
    assert client.get_run(t.run_id).info.status == "KILLED"
    # the store refuses the end-of-run calls (a run it does not hold): the block's own error still surfaces
    with pytest.raises(ValueError, match="the job's own error"), Tracker(uri=uri, experiment="exp-b") as t:
        real_run, t.run_id = t.run_id, "0" * 32
        raise ValueError("the job's own error")
    client.set_terminated(real_run, "FAILED")


def test_key_and_value_limits():
    assert clean_key("reward/mean/k3rl/KeyLookup-v0") == "reward/mean/k3rl/KeyLookup-v0"
    assert clean_key("a//b/./c/") == "a/b/c"
    assert clean_key("/abs") == "abs" and clean_key("x" * 300) == "x" * 250
    for n in (10, 6000, 6001, 7000, 10**6):
        v = truncate_value("y" * n, 6000)
        assert len(v) == min(n, 6000)
        if n > 6000:
            kept = v.index("...[")
            assert v.endswith(f"...[truncated {n - kept} chars]")


def test_sqlite_directory_is_created(tmp_path, monkeypatch):
    """The default relative URI works from a fresh working directory (runs/ is created), and from another
    one later in the same process (MLflow caches a store per URI string: the relative URI reached the first
    directory's database)."""
    for where in (tmp_path / "a", tmp_path / "b"):
        where.mkdir()
        monkeypatch.chdir(where)
        t = Tracker(experiment="k3rl", run_name="default")
        t.finish()
        assert Path("runs/mlflow.db").is_file(), f"no runs/mlflow.db in {where}"
        client = MlflowClient(f"sqlite:///{where}/runs/mlflow.db")
        assert Path(client.get_experiment_by_name("k3rl").artifact_location) == where / "runs" / "artifacts" / "k3rl"
        assert [r.info.run_name for r in client.search_runs([client.get_experiment_by_name("k3rl").experiment_id])] == [
            "default"]


def _schema(db: Path) -> list[str]:
    """Every table's and index's definition, its lines sorted: MLflow's migrations write the same schema with
    indexes, and constraints within a table, in an order that varies from run to run."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        return sorted(sorted(line.strip().rstrip(",").strip() for line in sql.replace("(", "(\n").splitlines())
                      for (sql,) in con.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL"))


def test_a_new_store_is_a_copy_of_the_schema_template_that_mlflow_would_have_made(tmp_path, monkeypatch):
    """A new SQLite store starts as a copy of a cached, empty database of this MLflow version's schema (a copy
    takes milliseconds, MLflow's migrations about a second). The copy must be what MLflow itself makes: the
    same tables and indexes, the same schema version, and its default experiment beside the new store, not
    the template's. A cache that cannot be written leaves MLflow to make the schema."""
    monkeypatch.setenv("K3RL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    Tracker(f"sqlite:///{tmp_path}/a/mlflow.db", experiment="e", run_name="r").finish()
    (template,) = (tmp_path / "cache").glob("mlflow-*-schema.db")
    MlflowClient(f"sqlite:///{tmp_path}/own/mlflow.db").search_experiments()  # MLflow alone, no template
    copied, own = tmp_path / "a" / "mlflow.db", tmp_path / "own" / "mlflow.db"
    assert _schema(copied) == _schema(own) == _schema(template)
    version = "SELECT version_num FROM alembic_version"
    with contextlib.closing(sqlite3.connect(copied)) as a, contextlib.closing(sqlite3.connect(own)) as b:
        assert a.execute(version).fetchall() == b.execute(version).fetchall()
    client = MlflowClient(f"sqlite:///{copied}")
    assert client.get_experiment("0").artifact_location == MlflowClient(f"sqlite:///{own}").get_experiment(
        "0").artifact_location
    assert [r.info.run_name for r in client.search_runs([client.get_experiment_by_name("e").experiment_id])] == ["r"]
    with contextlib.closing(sqlite3.connect(template)) as t:
        assert t.execute("SELECT COUNT(*) FROM experiments").fetchone() == (0,)  # nothing of the first store in it

    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("K3RL_CACHE_DIR", str(tmp_path / "not-a-dir"))
    Tracker(f"sqlite:///{tmp_path}/b/mlflow.db", experiment="e", run_name="r2").finish()
    assert _schema(tmp_path / "b" / "mlflow.db") == _schema(own)


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_jobs_starting_together_on_a_new_sqlite_store_all_get_their_run(tmp_path):
    """Three processes open one new SQLite store at the same moment (three demo seeds started together):
    MLflow creates and migrates the schema on first use, and without the store's file lock two of them
    failed in that migration. Each must get its own run in the one experiment."""
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path}/new/mlflow.db"
    go = tmp_path / "go"
    code = ("import sys, time, pathlib\n"
            "from k3rl.tracking import Tracker\n"
            "print('ready', flush=True)\n"
            f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.001)\n"
            f"t = Tracker({uri!r}, experiment='together', run_name='r' + sys.argv[1]); t.finish()\n")
    # an empty schema cache too: the three also race to make the schema template (k3rl.tracking._schema_template)
    env = {**os.environ, "K3RL_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(3)]
    for p in procs:  # every process imported mlflow and waits on the file
        assert p.stdout.readline() == "ready\n", p.communicate(timeout=120)[1][-1500:]
    go.touch()
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(e[-1500:] for e in errors)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("together").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["r0", "r1", "r2"]
