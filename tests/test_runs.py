"""`k3rl runs` and the run references `k3rl replay` and `k3rl compare` share, on real MLflow SQLite stores and
run folders laid out as a job lays them out (config.yaml, run.json, summary.json)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from k3rl.compare import compare_runs
from k3rl.config import JobConfig
from k3rl.runs import RunNotFoundError, list_runs, print_runs, resolve_run, store_of
from k3rl.tracking import Tracker


def job_folder(runs, name: str, steps: int, tracker: Tracker | None = None, summary: dict | None = None):
    """A run folder as `k3rl train` writes it: its config (a relative store, as the defaults), run.json, summary.json."""
    folder = runs / name
    JobConfig.load(None, [f"tracking.run_name={name}", f"learner.steps={steps}"]).save(folder / "config.yaml")
    if tracker is not None:
        (folder / "run.json").write_text(json.dumps({"mlflow_run_id": tracker.run_id}))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "trajectories").mkdir()
    return folder


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory where jobs ran with the default tracking settings: runs/ and runs/mlflow.db."""
    root = tmp_path_factory.mktemp("work")
    runs, uri = root / "runs", f"sqlite:///{root}/runs/mlflow.db"
    done = Tracker(uri=uri, experiment="k3rl", run_name="done", run_dir=runs / "done")
    for step, reward in enumerate([0.5, 0.7, 0.9, 0.8]):
        done.log_metrics({"reward/mean": reward, "reward/std": 0.1}, step=step)
    for step, success in ((0, 0.4), (3, 0.75)):
        done.log_metrics({"eval/KeyLookup-v0/success": success, "eval/KeyLookup-v0/pass_at_4": 0.9}, step=step)
    done.finish()
    job_folder(runs, "done", 3, done, {"completed": True, "steps": 3, "seconds": 60.0})
    live = Tracker(uri=uri, experiment="k3rl", run_name="live", run_dir=runs / "live")
    live.log_metrics({"reward/mean": 0.3}, step=1)
    job_folder(runs, "live", 30, live)
    job_folder(runs, "offline", 10, summary={"completed": False, "steps": 4, "seconds": 12.5})  # no MLflow store of its own
    return root, uri, {"done": done.run_id, "live": live.run_id}


def test_runs_lists_each_run_once_with_status_steps_rewards_and_eval(workdir):
    root, uri, ids = workdir
    rows = {r.name: r for r in list_runs(root / "runs", uri)}
    assert sorted(rows) == ["done", "live", "offline"]
    done, live, offline = rows["done"], rows["live"], rows["offline"]
    assert (done.status, done.steps, done.planned, done.final, done.best, done.best_step) == ("FINISHED", 3, 3, 0.8, 0.9, 2)
    assert done.evals == {"KeyLookup-v0": (0.75, 3)} and done.run_id == ids["done"]
    assert done.dir == root / "runs" / "done"
    assert (live.status, live.steps, live.planned) == ("RUNNING", 1, 30) and live.last_update is not None
    assert (offline.status, offline.steps, offline.seconds, offline.run_id) == ("KILLED", 4, 12.5, None)

    console = Console(record=True, width=250, color_system=None)
    print_runs(list(rows.values()), console, str(root / "runs"))
    text = console.export_text()
    line = next(x for x in text.splitlines() if "done" in x)
    assert "FINISHED" in line and "3/3" in line and "0.800" in line and "0.900 (2)" in line and "KeyLookup-v0 0.75 (3)" in line
    assert "last step" in next(x for x in text.splitlines() if "live" in x)  # how long ago a running job last logged

    from k3rl.cli import app

    result = CliRunner().invoke(app, ["runs", str(root / "runs")], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert all(name in result.output for name in ("done", "live", "offline"))  # the folders' own store, found


def test_a_run_reference_is_a_folder_a_name_or_an_mlflow_id(workdir, tmp_path, monkeypatch):
    root, uri, ids = workdir
    monkeypatch.chdir(tmp_path)  # elsewhere: the folder's relative store is found from its place under runs/
    folder = root / "runs" / "done"
    assert store_of(folder) == f"sqlite:///{root / 'runs' / 'mlflow.db'}"
    by_folder = resolve_run(str(folder))
    assert (by_folder.name, by_folder.dir, by_folder.run_id) == ("done", folder, ids["done"])
    by_name = resolve_run("done", runs_dir=root / "runs")  # a folder under the runs folder
    assert by_name.dir == folder and by_name.run_id == ids["done"]
    by_id = resolve_run(ids["live"], tracking_uri=uri)  # only MLflow knows it: its folder from the run's tag
    assert (by_id.name, by_id.dir) == ("live", (root / "runs" / "live").resolve())
    with pytest.raises(RunNotFoundError, match=r"no run 'gone': not a run folder .*no MLflow run named or with id "
                                               r"'gone'.*runs there: done, live.*`k3rl runs` lists the runs"):
        resolve_run("gone", runs_dir=root / "runs", tracking_uri=uri)

    # compare takes the same references, and a folder brings its own store
    console = Console(record=True, width=200, color_system=None)
    rows = compare_runs([str(folder), "live"], out=tmp_path / "c.png", runs_dir=root / "runs", console=console)
    assert [(r["name"], r["final"]) for r in rows] == [("done", 0.8), ("live", 0.3)]
