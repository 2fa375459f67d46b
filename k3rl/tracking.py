"""Experiment tracking in MLflow: params, metrics per step, artifacts (config, episodes as HTML,
the reward-curve PNG), sample episodes as traces (`k3rl.traces`), resume by run id.

Default store: SQLite under `runs/` (the file store is deprecated) with the artifacts in a
local directory beside it, so nothing leaves the disk; a team points `uri` at a server.
Everything goes through one `MlflowClient` (no global "active run"), so several trackers can
live in one process (tests, Ray actors) without stepping on each other.
"""

from __future__ import annotations

import fcntl
import io
import logging
import math
import os
import posixpath
import re
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import matplotlib
import mlflow
from matplotlib.figure import Figure
from mlflow.entities import Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from k3rl import __version__
from k3rl.render_html import render_episode_html
from k3rl.traces import log_episode_trace
from k3rl.tracking_writer import Spool, Writer, replay, send
from k3rl.types import Trajectory

try:  # MLflow's own limits, so we never send what it would reject
    from mlflow.utils.validation import (
        MAX_ENTITY_KEY_LENGTH,
        MAX_METRICS_PER_BATCH,
        MAX_PARAM_VAL_LENGTH,
        MAX_PARAMS_TAGS_PER_BATCH,
        MAX_TAG_VAL_LENGTH,
    )
except ImportError:  # pragma: no cover - older MLflow
    MAX_ENTITY_KEY_LENGTH, MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH = 250, 1000, 6000
    MAX_PARAMS_TAGS_PER_BATCH, MAX_TAG_VAL_LENGTH = 100, 8000

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
RUN_DIR_TAG = "k3rl.run_dir"
ERROR_TAG = "k3rl.error"  # why a run ended FAILED or KILLED
_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /:]")
log = logging.getLogger("k3rl.tracking")


class TrackingError(RuntimeError):
    """An MLflow store, experiment or run that cannot be used as asked."""


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI (relative to the working directory), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):])


def clean_key(key: str) -> str:
    """A param/metric name MLflow accepts: allowed characters only, a normalised relative path,
    at most MAX_ENTITY_KEY_LENGTH characters."""
    key = _BAD_KEY_CHARS.sub("_", str(key)).strip("/ ")
    key = posixpath.normpath(key).lstrip("/") if key else "_"
    if key in (".", "..") or key.startswith("../"):
        key = key.replace(".", "_")
    return key[:MAX_ENTITY_KEY_LENGTH]


def truncate_value(value: str, limit: int = MAX_PARAM_VAL_LENGTH) -> str:
    """`value` cut to `limit` characters, ending with a marker that says how much was cut."""
    if len(value) <= limit:
        return value
    cut = len(value) - limit
    while True:  # the marker's length depends on the number it prints: iterate to the fixed point
        marker = f"...[truncated {cut} chars]"
        keep = limit - len(marker)
        if len(value) - keep == cut:
            return value[:keep] + marker
        cut = len(value) - keep


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys (`{"a": {"b": 1}}` -> `{"a.b": 1}`)."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def mlflow_client(uri: str):
    """An MlflowClient on `uri`; for a SQLite URI the directory of the database is created first, and
    the store is opened under a file lock: MLflow creates and migrates a new database's schema on
    first use, and two jobs doing that at once on one new file both failed (`table _alembic_tmp_metrics
    already exists`), as three demo jobs started together did."""

    path = sqlite_path(uri)
    if path is None:
        return MlflowClient(tracking_uri=uri)
    # the file's absolute path: MLflow caches a store per URI string, so a relative URI opened again after a
    # chdir would reach the first directory's database
    path = path.absolute()
    uri = f"sqlite:///{path}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.exists() or path.stat().st_size == 0:
            _copy_schema(path)
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # opens the store: creates / migrates the schema
    return client


def _schema_template() -> Path:
    """An empty MLflow SQLite database with this MLflow version's schema, made once per machine under
    `$K3RL_CACHE_DIR` (default ~/.cache/k3rl). Creating a database runs all of MLflow's schema migrations;
    copying this file does not. The template holds no experiment: MLflow adds its
    default one (id 0, artifacts beside the new file) when it opens the copy, as it does a new database."""
    cache = Path(os.environ.get("K3RL_CACHE_DIR") or Path.home() / ".cache" / "k3rl")
    template = cache / f"mlflow-{mlflow.__version__}-schema.db"
    if template.exists():
        return template
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{template.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                db = Path(tmp) / "schema.db"
                MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments(max_results=1)
                with sqlite3.connect(db) as con:  # no default experiment: its artifact path would be the template's
                    con.execute("DELETE FROM experiments")
                con.close()
                os.replace(db, template)
    return template


def _copy_schema(path: Path) -> None:
    """Start the new database `path` as a copy of the schema template; on any failure leave it to MLflow,
    which creates the schema itself."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(_schema_template(), tmp)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - a read-only home or a full cache disk: MLflow makes the schema itself
        tmp.unlink(missing_ok=True)
        log.debug("no MLflow schema template (%s): the store creates its schema", e)


def find_run(client, name_or_id: str, experiment: str | None = None):
    """An MLflow run by id, or by run name (the newest run of that name) in any experiment
    (or only in `experiment`). Raises TrackingError listing what exists when nothing matches."""
    if re.fullmatch(r"[0-9a-f]{32}", name_or_id):
        try:
            return client.get_run(name_or_id)
        except MlflowException:
            pass
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        exp_ids = [exp.experiment_id] if exp is not None else []
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments()]
    if exp_ids:
        escaped = name_or_id.replace("'", "\\'")
        runs = client.search_runs(exp_ids, filter_string=f"attributes.run_name = '{escaped}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if runs:
            return runs[0]
    known = client.search_runs(exp_ids, order_by=["attributes.start_time DESC"], max_results=20) if exp_ids else []
    names = ", ".join(sorted({r.info.run_name for r in known})) or "none"
    raise TrackingError(f"no MLflow run named or with id {name_or_id!r} in {client.tracking_uri} "
                        f"(runs there: {names})")


class Tracker:
    """One MLflow run. `run_id` given: resume that run (its status goes back to RUNNING and new
    metrics continue its curves); otherwise a new run named `run_name` in `experiment`.

    `artifact_root`: local directory for the experiment's artifacts (default: `artifacts/`
    next to the SQLite file); only used when the experiment is created.

    `run_dir` given (a job's run folder): the run is tagged with it, and every write after the start
    (metrics, tags, artifacts, the end) goes through a `Writer` (k3rl/tracking_writer.py) that never
    blocks the caller: a store that is slow or down delays the writes, spools them to the run folder
    after `write_deadline_s`, and gets them when it is back. Without it every call writes at once.
    """

    def __init__(self, uri: str = "sqlite:///runs/mlflow.db", experiment: str = "k3rl", run_name: str | None = None,
                 run_id: str | None = None, artifact_root: str | Path | None = None,
                 tags: Mapping[str, str] | None = None, run_dir: str | Path | None = None,
                 write_deadline_s: float = 60.0, probe_s: float = 10.0) -> None:
        self.uri = uri
        if run_dir is not None and uri.startswith(("http://", "https://")):
            # one attempt per call, 10 s at most (MLflow's defaults: 7 retries, 120 s): the writer retries itself,
            # up to write_deadline_s. These are read at each call, and a user's own settings stand.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.client = mlflow_client(uri)
        self.writer: Writer | None = None
        self.pending = 0  # records still spooled when the run ended
        self._last_ms = 0  # the timestamp of the latest metrics
        if run_id is not None:
            try:
                run = self.client.get_run(run_id)
            except MlflowException as e:
                raise TrackingError(f"cannot resume MLflow run {run_id!r}: it is not in {uri} ({e.message}). "
                                    f"Start a new run (no run_id) or point uri at the store that holds it") from None
            if run_dir is not None:  # what the last process could not send, its end included, before RUNNING
                sent, left = replay(self.client, run_id, Spool(run_dir))
                if left:
                    raise TrackingError(f"MLflow run {run_id} in {uri} does not take the {left} records spooled in "
                                        f"{Path(run_dir) / 'tracking_spool.jsonl'}; is the store writable?")
                if sent:
                    log.warning("replayed %d tracking records the last process spooled", sent)
            self.run_id = run.info.run_id
            self.experiment_id = run.info.experiment_id
            self.run_name = run.info.run_name
            self.client.update_run(self.run_id, status="RUNNING")
            self.resumed = True
        else:
            self.experiment_id = self._experiment(experiment, artifact_root)
            all_tags = {"k3rl.version": _k3rl_version(), **(tags or {})}
            if run_dir is not None:
                all_tags[RUN_DIR_TAG] = str(Path(run_dir).resolve())
            run = self.client.create_run(self.experiment_id, run_name=run_name,
                                         tags={clean_key(k): truncate_value(str(v), MAX_TAG_VAL_LENGTH)
                                               for k, v in all_tags.items()})
            self.run_id = run.info.run_id
            self.run_name = run.info.run_name
            self.resumed = False
        self.artifact_uri = run.info.artifact_uri
        self.finished = False
        if run_dir is not None:
            self.writer = Writer(self.client, self.run_id, run_dir, deadline_s=write_deadline_s,
                                 probe_s=min(probe_s, write_deadline_s))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writer has handed everything logged so far to the store (or spooled it), up to
        `timeout` s (default: the write deadline); True when nothing is left in its queue."""
        if self.writer is None:
            return True
        return self.writer.flush(self.writer.deadline_s if timeout is None else timeout)

    def _write(self, record: dict) -> None:
        """Metrics or tags to the store: through the writer when there is one, else now."""
        if self.writer is not None:
            self.writer.put(record)
        else:
            send(self.client, self.run_id, record)

    def _experiment(self, name: str, artifact_root: str | Path | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            location = None
            if artifact_root is None and (db := sqlite_path(self.uri)) is not None:
                artifact_root = db.parent / "artifacts"
            if artifact_root is not None:
                directory = Path(artifact_root).resolve() / clean_key(name).replace("/", "_")
                directory.mkdir(parents=True, exist_ok=True)
                location = str(directory)
            try:
                return self.client.create_experiment(name, artifact_location=location)
            except MlflowException:  # another process created it first
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    # -- params --------------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> dict[str, str]:
        """Log a (flat or nested) dict as params, in batches of MLflow's maximum size. Values longer
        than MLflow allows are truncated with a `...[truncated N chars]` marker. On a resumed
        run, params already logged with the same value are skipped; a changed value cannot
        replace an MLflow param, so it is recorded as the tag `param_changed.<key>`.
        Returns what was logged (cleaned key -> value)."""
        existing = self.client.get_run(self.run_id).data.params
        new: dict[str, str] = {}
        changed: dict[str, str] = {}
        for key, value in flatten(params).items():
            k = clean_key(key)
            v = truncate_value("None" if value is None else str(value))
            if k in existing:
                if existing[k] != v:
                    changed[k] = v
                continue
            new[k] = v
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        tags = [RunTag(clean_key(f"param_changed.{k}"), truncate_value(v, MAX_TAG_VAL_LENGTH)) for k, v in changed.items()]
        for i in range(0, len(tags), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=tags[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        return new

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        items = [(clean_key(k), truncate_value(str(v), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._write({"kind": "tags", "tags": dict(items[i:i + MAX_PARAMS_TAGS_PER_BATCH])})

    # -- metrics -------------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log numbers at a training step (ints, floats, numpy/torch scalars; NaN/inf allowed)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        # strictly increasing per run, so that of two values logged at one step the later wins even within a ms
        now = self._last_ms = max(int(time.time() * 1000), self._last_ms + 1)
        items = []
        for key, value in metrics.items():
            try:
                number = float(value.item() if hasattr(value, "item") else value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r:.80}") from None
            items.append((clean_key(key), number, now, step))
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self._write({"kind": "metrics", "metrics": items[i:i + MAX_METRICS_PER_BATCH]})

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of a metric, sorted by step (the last value logged at a step wins)."""
        self.flush()
        return metric_history(self.client, self.run_id, key)

    # -- artifacts -----------------------------------------------------------------------
    def log_artifact_bytes(self, data: bytes, artifact_path: str) -> str:
        """Store bytes as the artifact `artifact_path` (e.g. "episodes/step_3/x.html")."""
        artifact_path = clean_key(artifact_path)
        directory, name = posixpath.split(artifact_path)
        with tempfile.TemporaryDirectory(prefix="k3rl-artifact-") as tmp:
            local = Path(tmp) / name
            local.write_bytes(data)
            self._log_artifact(local, directory or None)
        return artifact_path

    def _log_artifact(self, local: Path, directory: str | None) -> None:
        if self.writer is None:
            self.client.log_artifact(self.run_id, str(local), artifact_path=directory)
        else:  # a copy in the run folder, kept until the store has it
            self.writer.put({"kind": "artifact", "file": self.writer.spool.keep_file(local, local.name),
                             "artifact_path": directory})

    def log_artifact_text(self, text: str, artifact_path: str) -> str:
        return self.log_artifact_bytes(text.encode("utf-8"), artifact_path)

    def log_artifact_file(self, path: str | Path, artifact_path: str | None = None) -> str:
        """Copy a local file into the run's artifacts (under the directory `artifact_path`)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cannot log artifact {path}: no such file")
        self._log_artifact(path, artifact_path)
        return posixpath.join(artifact_path, path.name) if artifact_path else path.name

    def list_artifacts(self, path: str | None = None) -> list[str]:
        """Artifact paths (files, recursively) under `path`."""
        self.flush()
        out = []
        for info in self.client.list_artifacts(self.run_id, path):
            out.extend(self.list_artifacts(info.path) if info.is_dir else [info.path])
        return out

    def log_episode_html(self, trajectory: Trajectory, step: int) -> str:
        """The episode rendered as one self-contained HTML page (images inline), stored as
        `episodes/step_<step>/<episode id>.html`."""
        html = render_episode_html(trajectory, title=f"step {step} · episode {trajectory.id}")
        return self.log_artifact_text(html, f"episodes/step_{step:06d}/{trajectory.id}.html")

    def log_episode_trace(self, trajectory: Trajectory, step: int) -> str:
        """The episode as an MLflow trace of this run (a span per turn and tool call, the reward;
        see `k3rl.traces`), tagged `k3rl.step`; returns the trace id (None: handed to the writer, which
        stores it when the store takes it and otherwise counts it dropped: a sample, not a metric)."""
        if self.writer is not None:
            self.writer.put_trace(lambda: log_episode_trace(self.client, self.experiment_id, self.run_id, trajectory,
                                                            step))
            return None
        return log_episode_trace(self.client, self.experiment_id, self.run_id, trajectory, step)

    def log_reward_curve_png(self, metrics: Iterable[str] | None = None, artifact_path: str = "reward_curve.png") -> str | None:
        """Plot the run's reward curves (default: `reward/mean` and every per-environment `reward/<env>/mean`) from what is in
        the store and store the PNG. Returns its artifact path, or None when nothing was logged or the
        store cannot be read (a warning then: the curves are in the store or the spool, only the picture is missing)."""
        if not self.flush():
            log.warning("MLflow is behind (its writes are spooled): no reward-curve picture for run %s", self.run_id)
            return None
        try:
            return self._reward_curve_png(metrics, artifact_path)
        except Exception as e:  # noqa: BLE001 - a store that went down after the flush: no picture, no failure
            log.warning("could not draw the reward curves of run %s: %s", self.run_id, e)
            return None

    def _reward_curve_png(self, metrics: Iterable[str] | None, artifact_path: str) -> str | None:
        keys = list(metrics) if metrics is not None else sorted(
            k for k in self.client.get_run(self.run_id).data.metrics
            if k.startswith("reward/") and k.endswith("/mean"))  # reward/mean and reward/<env>/mean
        curves = {k: h for k in keys if (h := self.metric_history(k))}
        if not curves:
            return None
        png = plot_curves(curves, title=f"{self.run_name}: reward", ylabel="reward")
        return self.log_artifact_bytes(png, artifact_path)

    # -- end -------------------------------------------------------------------------------
    def finish(self, status: str = "FINISHED") -> None:
        """End the run with `status` (FINISHED, FAILED or KILLED). Only the first call counts."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        if self.finished:
            return
        self.finished = True
        if self.writer is None:
            self.client.set_terminated(self.run_id, status=status)
            return
        self.writer.put({"kind": "terminate", "status": status})
        self.pending = self.writer.close(timeout=self.writer.deadline_s)
        if self.pending:
            log.warning("MLflow did not take %d records of run %s (the run's end included); they are kept in %s: "
                        "`k3rl sync %s` sends them when the store is back (`k3rl train --resume` does too)",
                        self.pending, self.run_id, self.writer.spool.path, self.writer.spool.path.parent)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """FINISHED when the block ends normally (or by sys.exit(0)), FAILED on an exception, KILLED on
        KeyboardInterrupt, SystemExit or cancellation; the error is kept as the tag `k3rl.error`. A failure
        to reach the store here is logged, never raised over the block's own exception."""
        if self.finished:
            return
        status = exit_status(exc_type, exc)
        try:
            if status != "FINISHED":
                self.set_tags({ERROR_TAG: f"{exc_type.__name__}: {exc}"})
            self.finish(status)
        except Exception:
            if exc_type is None:
                raise
            log.exception("could not mark MLflow run %s %s", self.run_id, status)


def exit_status(exc_type: type[BaseException] | None, exc: BaseException | None) -> str:
    """The MLflow status of a run whose `with` block ended with `exc` (None: normally)."""
    if exc_type is None or (issubclass(exc_type, SystemExit) and getattr(exc, "code", None) in (0, None)):
        return "FINISHED"
    return "FAILED" if issubclass(exc_type, Exception) else "KILLED"


def metric_history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        prev = by_step.get(m.step)
        if prev is None or m.timestamp >= prev[0]:
            by_step[m.step] = (m.timestamp, m.value)
    return [(s, v) for s, (_, v) in sorted(by_step.items())]


def plot_curves(curves: Mapping[str, list[tuple[int, float]]], title: str, ylabel: str, xlabel: str = "step") -> bytes:
    """Line plot of named (step, value) series as PNG bytes (matplotlib, Agg backend, no display)."""
    matplotlib.use("Agg", force=False)
    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    for label, points in curves.items():
        xs = [s for s, v in points if math.isfinite(v)]
        ys = [v for s, v in points if math.isfinite(v)]
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return figure_png(fig, [ax])


def figure_png(fig, axes) -> bytes:
    """A matplotlib figure as PNG bytes, its axes gridded and with legends."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _k3rl_version() -> str:
    return __version__
