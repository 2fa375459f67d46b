"""The tracker's writes, off the training loop: a bounded queue drained by one thread, with retries,
a deadline, and a spool on disk for whatever the store would not take.

A job must never die or stall because MLflow is slow or down: a locked SQLite file blocks a call for
20 s and then raises; a down tracking server blocks one for minutes. So `Tracker` (k3rl/tracking.py)
hands every write of a job (metrics, tags, artifacts, the run's end) to a `Writer`, which returns at
once. Its thread sends each record, retrying with backoff until `deadline_s` after the record was
queued; a record it cannot send by then is appended to `<run_dir>/tracking_spool.jsonl` (fsync'd, so
it survives a crash), and while the store stays down new records go straight there. Every
`probe_s` the thread tries again; once a write goes through, the spool is replayed in order and
emptied. A full queue spills to the spool too, so the caller never waits and nothing is dropped.
What is still spooled when the job ends is replayed by `k3rl train --resume` or `k3rl sync`.

Artifacts are copied under `<run_dir>/tracking_spool/` before they are queued, so their bytes survive
as the spool's records do. Traces (sample episodes as MLflow traces) are best-effort: they cannot be
spooled, and a trace the store would not take is counted (`dropped_traces`) and logged, not retried.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, RunTag

log = logging.getLogger("k3rl.tracking")
SPOOL_FILE = "tracking_spool.jsonl"
SPOOL_DIR = "tracking_spool"  # artifacts waiting to be sent


class Spool:
    """Records the store has not taken yet: one JSON object a line, appended and fsync'd."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / SPOOL_FILE
        self.files = Path(run_dir) / SPOOL_DIR
        self.lock = threading.Lock()

    def append(self, records: list[dict]) -> None:
        data = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock, open(self.path, "ab+") as f:
            end = f.seek(0, os.SEEK_END)
            if end > 0:  # after a torn line (a crash mid-append) the next record starts a line of its own
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    data = b"\n" + data
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict]:
        """The spooled records in order; a torn last line (a crash mid-append) is skipped with a warning."""
        with self.lock:
            if not self.path.exists():
                return []
            lines = self.path.read_text(encoding="utf-8").splitlines()
        out = []
        for i, line in enumerate(lines):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("tracking spool %s: line %d is torn (a crash while writing it); skipped", self.path, i + 1)
        return out

    def drop_first(self, n: int) -> None:
        """Forget the first `n` records (sent by a replay); records appended meanwhile stay."""
        with self.lock:
            if n <= 0 or not self.path.exists():
                return
            lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
            while lines and n > 0:  # torn lines (skipped by read) go with the records around them
                n -= _parses(lines.pop(0))
            if not lines:
                self.path.unlink()
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(lines), encoding="utf-8")
            os.replace(tmp, self.path)

    def keep_file(self, src: Path, name: str) -> str:
        """A copy of an artifact's file under the spool folder; its path, for the record."""
        dest = self.files / f"{time.time_ns()}-{threading.get_ident()}" / name
        for _ in range(3):  # the writer removes the spool's folder when its last artifact is sent: make it again
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dest)
                break
            except FileNotFoundError:
                continue
        return str(dest)


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def send(client, run_id: str, record: dict) -> None:
    """One record to the store (raises what MLflow raises)."""
    kind = record["kind"]
    if kind == "metrics":
        client.log_batch(run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in record["metrics"]])
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in record["tags"].items()])
    elif kind == "artifact":
        client.log_artifact(run_id, record["file"], artifact_path=record["artifact_path"])
        held = Path(record["file"]).parent
        shutil.rmtree(held, ignore_errors=True)
        with contextlib.suppress(OSError):  # the spool's folder goes with its last artifact
            held.parent.rmdir()
    elif kind == "terminate":
        client.set_terminated(run_id, status=record["status"])
    else:
        raise ValueError(f"unknown tracking record kind {kind!r}")


class Writer:
    """Sends records to the store from a thread; see the module's docstring."""

    def __init__(self, client, run_id: str, run_dir: str | Path, deadline_s: float = 60.0, probe_s: float = 10.0,
                 queue_size: int = 1024) -> None:
        self.client, self.run_id = client, run_id
        self.spool = Spool(run_dir)
        self.deadline_s, self.probe_s = deadline_s, probe_s
        self.q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.down_since: float | None = None  # monotonic time the store was found down; None: up
        self.next_probe = 0.0
        self.sent = self.spooled = self.replayed = self.dropped_traces = 0
        self.spilled = False  # records put in the spool by a full queue, not by a down store
        self.spooled_at_start = len(self.spool.read())  # a resumed run's spool: replayed first
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="k3rl-tracking-writer", daemon=True)
        self.thread.start()

    # -- the caller's side: never blocks on the store ------------------------------------
    def put(self, record: dict) -> None:
        record = {**record, "queued": time.time()}
        try:
            self.q.put_nowait(record)
        except queue.Full:  # the store is far behind: the record goes to disk now, in the caller's thread
            self.spool.append([record])
            self.spooled += 1
            self.spilled = True  # the thread replays it once the queue is idle, even with the store up

    def put_trace(self, fn: Callable[[], Any]) -> None:
        """A best-effort write (an MLflow trace): tried once in the thread, counted when it fails."""
        self.put({"kind": "call", "fn": fn})

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the queue to drain; True if it did."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.q.unfinished_tasks == 0:
                return True
            time.sleep(0.02)
        return self.q.unfinished_tasks == 0

    def close(self, timeout: float) -> int:
        """Drain the queue and the spool (up to `timeout` s in all: a store that is down gets that long to
        come back); what is left stays spooled, for a resume or `k3rl sync`. Returns how many records that is."""
        end = time.monotonic() + timeout
        self.flush(timeout)
        while self.down_since is not None and time.monotonic() < end:
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            self.next_probe = 0.0  # the thread retries the spool now
        self.closing.set()
        self.thread.join(timeout=max(1.0, timeout))
        if not self.thread.is_alive() and self.spool.read():  # a last try, for records a full queue spilled too
            self._replay()
        left = []
        while True:
            try:
                r = self.q.get_nowait()
            except queue.Empty:
                break
            if r["kind"] != "call":
                left.append(r)
        if left:
            self.spool.append(left)
        return len(self.spool.read())

    def stats(self) -> dict[str, int]:
        return {"sent": self.sent, "spooled": self.spooled, "replayed": self.replayed,
                "dropped_traces": self.dropped_traces, "pending": len(self.spool.read())}

    # -- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.spooled_at_start:
            self._replay()
        while not self.closing.is_set():
            try:
                r = self.q.get(timeout=0.1)
            except queue.Empty:
                if (self.down_since is not None and time.monotonic() >= self.next_probe) or self.spilled:
                    self.spilled = False
                    self._replay()
                continue
            try:
                self._handle(r)
            except Exception:  # the spool itself failed (a full disk): say so loudly, keep the thread alive
                log.exception("a %s record could neither reach MLflow nor the spool %s: it is lost", r["kind"],
                              self.spool.path)
            finally:
                self.q.task_done()

    def _handle(self, r: dict) -> None:
        if r["kind"] == "call":
            if self.down_since is None:
                try:
                    r["fn"]()
                    return
                except Exception as e:  # noqa: BLE001 - best effort by design
                    log.warning("an MLflow trace was not stored (%s: %s)", type(e).__name__, e)
            self.dropped_traces += 1
            return
        if self.down_since is not None:  # keep order: nothing new goes through before the spool is replayed
            if time.monotonic() < self.next_probe or not self._replay():
                self.spool.append([r])
                self.spooled += 1
                return
        if self._send_until_deadline(r):
            self.sent += 1
        else:
            self.spool.append([r])
            self.spooled += 1

    def _send_until_deadline(self, r: dict) -> bool:
        wait = 0.25
        while True:
            try:
                send(self.client, self.run_id, r)
                if self.down_since is not None:
                    log.warning("the MLflow store is back after %.0f s", time.monotonic() - self.down_since)
                self.down_since = None
                return True
            except Exception as e:  # noqa: BLE001 - any store error: retry, then spool
                left = r["queued"] + self.deadline_s - time.time()
                if left <= 0 or self.closing.is_set():
                    if self.down_since is None:
                        log.warning("the MLflow store %s does not take writes (%s: %.200s); metrics go to %s until it "
                                    "is back, and are replayed then (or by `k3rl sync`)",
                                    self.client.tracking_uri, type(e).__name__, e, self.spool.path)
                        self.down_since = time.monotonic()
                    self.next_probe = time.monotonic() + self.probe_s
                    return False
                time.sleep(min(wait, left))
                wait = min(wait * 2, 4.0)

    def _replay(self) -> bool:
        """Send the spooled records in order; True when the spool is empty afterwards."""
        sent, left = replay(self.client, self.run_id, self.spool)
        self.replayed += sent
        if left:  # still down: try again later
            self.next_probe = time.monotonic() + self.probe_s
            if self.down_since is None:
                self.down_since = time.monotonic()
            return False
        if sent:
            log.warning("replayed %d tracking records from %s into MLflow", sent, self.spool.path)
        self.down_since = None
        return True


def replay(client, run_id: str, spool: Spool) -> tuple[int, int]:
    """Send `spool`'s records in order until one fails; keep the rest. (sent, still spooled)."""
    records = spool.read()
    for i, r in enumerate(records):
        try:
            send(client, run_id, r)
        except Exception:  # noqa: BLE001 - the store is still down
            spool.drop_first(i)
            return i, len(records) - i
    spool.drop_first(len(records))
    return len(records), 0
