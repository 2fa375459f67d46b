"""Runs, and the references to them that `k3rl runs`, `k3rl replay` and `k3rl compare` share.

A run reference is any of: a run folder (`runs/demo-20261205-101500`), a run's name (a folder under
the runs folder, or an MLflow run name: the newest run of that name) or an MLflow run id.
`resolve_run` turns it into a `RunRef`: the run's folder (its episodes, checkpoints and config) and
its MLflow run (its curves), whichever exist.

A run folder, `tracking.runs_dir/<run name>`, holds:

    config.yaml           the resolved config the job ran with (`k3rl train` with it repeats the run)
    run.json              {"mlflow_run_id": ...}: the MLflow run of its curves (a resume continues it)
    summary.json          written when the job ends, however it ends: completed, steps, seconds, eval, ...
    checkpoints/step-N/   a checkpoint every learner.checkpoint_every steps; `latest` names the newest
    trajectories/         every episode once, Parquet (k3rl.store)
    images/<episode>/     the episodes' images as PNG files

The MLflow store (tracking.uri, by default `runs/mlflow.db`) holds the curves, params and artifacts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from k3rl.tracking import RUN_DIR_TAG, TrackingError, find_run, metric_history, mlflow_client, sqlite_path

DEFAULT_URI = "sqlite:///runs/mlflow.db"
REWARD = "reward/mean"
EVAL_SUCCESS = "/success"  # eval/<env>/success: the greedy success rate of the held-out evaluation


class RunNotFoundError(LookupError):
    """A run reference that names no run folder and no MLflow run; the message says where it looked."""


@dataclass
class RunRef:
    name: str
    dir: Path | None  # the run folder, when there is one
    run_id: str | None  # the MLflow run, when there is one
    tracking_uri: str  # the store of run_id (or where it was looked for)


def is_run_dir(path: Path) -> bool:
    return (path / "trajectories").is_dir() or (path / "run.json").is_file()


def resolve_run(ref: str, runs_dir: str | Path = "runs", tracking_uri: str | None = None) -> RunRef:
    """The run `ref` names (see the module doc). `tracking_uri` None: a run folder's own store (its
    config.yaml's tracking.uri), else runs/mlflow.db."""
    for candidate in (Path(ref), Path(runs_dir) / ref):
        if is_run_dir(candidate):
            return _from_dir(candidate, tracking_uri)
    uri = tracking_uri or DEFAULT_URI
    mlrun, why = _mlflow_run(ref, uri)
    if mlrun is None:
        raise RunNotFoundError(f"no run {ref!r}: not a run folder (looked at {Path(ref)} and {Path(runs_dir) / ref}), "
                               f"and {why}; `k3rl runs` lists the runs")
    run_dir = next((Path(d) for d in (mlrun.data.tags.get(RUN_DIR_TAG), Path(runs_dir) / mlrun.info.run_name)
                    if d and is_run_dir(Path(d))), None)
    return RunRef(mlrun.info.run_name, run_dir, mlrun.info.run_id, uri)


def newest_run(runs_dir: str | Path = "runs") -> Path:
    """The run folder under `runs_dir` whose job started last."""
    folders = [d for d in Path(runs_dir).iterdir() if is_run_dir(d)] if Path(runs_dir).is_dir() else []
    if not folders:
        raise RunNotFoundError(f"{runs_dir} holds no runs; name one (a folder, run name or MLflow run id)")
    return max(folders, key=_started)


def _started(folder: Path) -> float:
    marker = next((folder / f for f in ("run.json", "config.yaml") if (folder / f).exists()), folder)
    return marker.stat().st_mtime


def _from_dir(folder: Path, tracking_uri: str | None) -> RunRef:
    meta = _read_json(folder / "run.json")
    return RunRef(folder.name, folder, meta.get("mlflow_run_id"), tracking_uri or store_of(folder))


def store_of(folder: Path) -> str:
    """The MLflow store a run folder's job wrote to: its config's tracking.uri. A relative SQLite path was
    relative to the directory the job ran in: found from the folder's place under tracking.runs_dir."""
    cfg = _read_yaml(folder / "config.yaml").get("tracking") or {}
    uri = cfg.get("uri") or DEFAULT_URI
    db = sqlite_path(uri)
    if db is None or db.is_absolute() or db.exists():
        return uri
    runs_dir = Path(cfg.get("runs_dir") or "runs")
    if not runs_dir.is_absolute():  # folder = <where the job ran>/<runs_dir>/<name>
        ran_in = folder.resolve().parents[len(runs_dir.parts)]
        if (ran_in / db).exists():
            return f"sqlite:///{ran_in / db}"
    return uri


def _mlflow_run(ref: str, uri: str) -> tuple[Any, str]:
    """(the MLflow run named or with id `ref`, None when there is none; why not)."""
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        return None, f"there is no MLflow store at {db} (from {uri}; pass --tracking-uri of the runs' store)"
    try:
        return find_run(mlflow_client(uri), ref), ""
    except TrackingError as e:
        return None, str(e)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


# -- k3rl runs ------------------------------------------------------------------------------------------
@dataclass
class RunRow:
    name: str
    dir: Path | None = None
    run_id: str | None = None
    status: str = "?"
    steps: int | None = None  # RL steps logged (the last step of reward/mean)
    planned: int | None = None  # learner.steps of its config
    started: float | None = None  # unix seconds
    seconds: float | None = None  # how long it ran (so far, when running)
    last_update: float | None = None  # unix seconds of its last logged step
    final: float | None = None
    best: float | None = None
    best_step: int | None = None
    evals: dict[str, tuple[float, int]] = field(default_factory=dict)  # env -> (greedy success, at step)


def list_runs(runs_dir: str | Path = "runs", tracking_uri: str | None = None) -> list[RunRow]:
    """Every run of the runs folder and of the MLflow store(s) (`tracking_uri`, else the folders' own and
    runs/mlflow.db), one row each, oldest first."""
    rows: dict[str, RunRow] = {}  # by MLflow run id, else by folder
    folders = sorted((d for d in Path(runs_dir).iterdir() if is_run_dir(d)), key=_started) \
        if Path(runs_dir).is_dir() else []
    uris = [tracking_uri] if tracking_uri else list(dict.fromkeys([*(store_of(d) for d in folders), DEFAULT_URI]))
    by_dir: dict[Path, RunRow] = {}
    for uri in uris:
        db = sqlite_path(uri)
        if db is not None and not db.exists():
            continue
        client = mlflow_client(uri)
        exps = [e.experiment_id for e in client.search_experiments()]
        for run in client.search_runs(exps, max_results=5000) if exps else []:
            row = _mlflow_row(client, run)
            rows[run.info.run_id] = row
            if row.dir is not None:
                by_dir[row.dir.resolve()] = row
    for d in folders:
        meta = _read_json(d / "run.json")
        row = rows.get(meta.get("mlflow_run_id")) or by_dir.get(d.resolve())
        if row is None:
            row = rows[str(d)] = RunRow(d.name)
        _add_folder(row, d)
    return sorted(rows.values(), key=lambda r: (r.started or 0.0, r.name))


def _mlflow_row(client, run) -> RunRow:
    info, metrics = run.info, run.data.metrics
    tagged = run.data.tags.get(RUN_DIR_TAG)
    row = RunRow(info.run_name, Path(tagged) if tagged and is_run_dir(Path(tagged)) else None, info.run_id,
                 info.status, started=info.start_time / 1000 if info.start_time else None)
    end = info.end_time / 1000 if info.end_time else time.time()
    row.seconds = end - row.started if row.started else None
    points = metric_history(client, info.run_id, REWARD) if REWARD in metrics else []
    if points:
        row.steps, row.final = points[-1]
        row.best, row.best_step = max(((v, s) for s, v in points), key=lambda x: (x[0], -x[1]))  # the first best
        if info.status == "RUNNING":
            row.last_update = max(m.timestamp for m in client.get_metric_history(info.run_id, REWARD)) / 1000
    for key in metrics:
        if key.startswith("eval/") and key.endswith(EVAL_SUCCESS):
            points = metric_history(client, info.run_id, key)
            if points:
                row.evals[key.removeprefix("eval/").removesuffix(EVAL_SUCCESS)] = (points[-1][1], points[-1][0])
    return row


def _add_folder(row: RunRow, folder: Path) -> None:
    """What the run folder adds: its path, the planned steps, and (without MLflow) its summary."""
    row.dir = folder
    planned = (_read_yaml(folder / "config.yaml").get("learner") or {}).get("steps")
    row.planned = planned if isinstance(planned, int) else None
    summary = _read_json(folder / "summary.json")
    if row.run_id is None and summary:  # no MLflow run to ask: what the job wrote when it ended
        row.status = "FINISHED" if summary.get("completed") else "KILLED"
        row.steps, row.seconds = summary.get("steps"), summary.get("seconds")
    if row.started is None:
        row.started = _started(folder)


def print_runs(rows: list[RunRow], console: Console, where: str, runs_dir: str | Path = "runs") -> None:
    if not rows:
        console.print(f"no runs in {where}")
        return
    table = Table(title=f"runs in {where}: final and best are reward/mean; eval is the held-out greedy success")
    elsewhere = any(r.dir is not None and r.dir != Path(runs_dir) / r.name for r in rows)
    for col, justify in (("run", "left"), ("status", "left"), ("steps", "right"), ("started", "left"),
                         ("time", "right"), ("final", "right"), ("best (step)", "right"), ("eval (step)", "left"),
                         *((("folder", "left"),) if elsewhere else ())):
        table.add_column(col, justify=justify, no_wrap=col in ("run", "status", "started"))
    now = time.time()
    for r in rows:
        steps = "-" if r.steps is None else f"{r.steps}" + (f"/{r.planned}" if r.planned else "")
        spent = _duration(r.seconds)
        if r.status == "RUNNING" and r.last_update:
            spent += f", last step {_duration(now - r.last_update)} ago"
        table.add_row(r.name, _status(r.status), steps,
                      datetime.fromtimestamp(r.started).strftime("%m-%d %H:%M") if r.started else "-", spent,
                      "-" if r.final is None else f"{r.final:.3f}",
                      "-" if r.best is None else f"{r.best:.3f} ({r.best_step})",
                      ", ".join(f"{env} {v:.2f} ({s})" for env, (v, s) in sorted(r.evals.items())) or "-",
                      *((str(r.dir) if r.dir is not None else "-",) if elsewhere else ()))
    console.print(table)


def _status(status: str) -> str:
    colour = {"FINISHED": "green", "RUNNING": "cyan", "FAILED": "red", "KILLED": "yellow"}.get(status)
    return f"[{colour}]{status}[/]" if colour else status


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
