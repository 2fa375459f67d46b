"""TrajectoryStore: every finished episode, appended to Parquet, with its images as PNG files.

Layout under the run directory `root`:

    root/trajectories/part-000000.parquet   one file per flush (zstd, the Trajectory Arrow schema
    root/trajectories/part-000001.parquet   plus `step`, `policy_version` and `status` columns for filtering)
    root/images/<episode_id>/<turn>_<k>.png the k-th image of turn `turn`, for browsing
    root/images/.staging/                   image temp files before they are renamed into place

Crash safety: a part (and every PNG) is written to a hidden temp file in the same directory,
fsync'd, then published under its final name (`os.link` for parts: atomic, and it refuses to
overwrite another writer's part; `os.replace` for PNGs) and the directory is fsync'd. Readers only ever list
`part-*.parquet`, so a writer killed at any instant leaves either a complete part or nothing
visible; its temp file (named with the writer's pid) is removed by the next store opened
on the directory once that pid is gone. Images are written before the part that refers to
them, so a visible episode always has its PNGs.

`append` takes a snapshot (the Arrow row and the PNG bytes), so changing a Trajectory object
after appending it does not change what is stored.

Episodes are unique by id: `append` drops an id the store already holds (a re-run episode of a
restarted worker is not counted twice) and reads keep the first copy if two writers raced.

Appends cost O(1) in the number of parts: the store lists `trajectories/` and reads every part's ids
once, when it is opened (and again after `rollback`, or when another writer took a part number),
then keeps the next part number and the id index up to date itself. The index (`IdIndex`) holds
12 bytes an episode (a 64-bit hash of the id and its part's number), not the id strings, so a
week-long job's millions of episodes cost tens of MB; a hash match is confirmed against that part's
ids, so the dedup stays exact.

The job writes an episode once its fate is decided (`status`: trained, failed, stale,
zero_variance, unused, eval, rolled_back), tagged with the training `step` it was decided at. Resuming from the checkpoint of step
k first calls `rollback(k)`: rows decided after step k are removed (their training was lost
with the driver), and the resumed job re-issues those episodes under the same ids, so every
episode ends in the store exactly once with the step that trained it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from k3rl.types import Trajectory

PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")
# Columns added to the Trajectory schema in the files so a reader can filter without parsing metadata.
EXTRA_COLUMNS = [("step", pa.int64()), ("policy_version", pa.int64()), ("status", pa.string())]
PART_SCHEMA = pa.schema([*Trajectory.arrow_schema(), *(pa.field(n, t) for n, t in EXTRA_COLUMNS)])


class StoreError(RuntimeError):
    """A trajectory store that cannot be read or written as asked."""


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, renamed, removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def fsync_file(path: Path) -> None:
    """Make a file's contents durable (before it is published under its final name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path, *, overwrite: bool) -> bool:
    """Give the finished temp file its final name: replace, or (overwrite=False) link-if-absent."""
    try:
        if overwrite:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)  # atomic create-if-absent: never clobbers another writer's part
            except FileExistsError:
                return False
        fsync_dir(final.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _meta_int(meta: dict, key: str) -> int | None:
    value = meta.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _id_hash(episode_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(episode_id.encode(), digest_size=8).digest(), "little")


class IdIndex:
    """Which part may hold an episode id, in 12 bytes an id: sorted arrays of the ids' 64-bit hashes
    and their parts' numbers, plus a dict of at most RECENT new entries, merged into the arrays
    when full (np.insert at their sorted positions: one O(n) copy per RECENT ids). Two ids share a
    hash with probability n / 2^64 per lookup, so `parts_of` names candidates and the caller
    confirms with the part's ids."""

    RECENT = 8192

    def __init__(self) -> None:
        self._hashes = np.empty(0, np.uint64)
        self._parts = np.empty(0, np.int32)
        self._recent: dict[int, list[int]] = {}  # hash -> part numbers, not yet merged
        self._num_recent = 0

    def __len__(self) -> int:
        return len(self._hashes) + self._num_recent

    def add(self, episode_ids: Iterable[str], part: int) -> None:
        for i in episode_ids:
            self._recent.setdefault(_id_hash(i), []).append(part)
            self._num_recent += 1
            if self._num_recent >= self.RECENT:
                self._merge()

    def _merge(self) -> None:
        h = np.fromiter((k for k, ps in self._recent.items() for _ in ps), np.uint64, self._num_recent)
        p = np.fromiter((q for ps in self._recent.values() for q in ps), np.int32, self._num_recent)
        order = np.argsort(h, kind="stable")
        at = np.searchsorted(self._hashes, h[order])
        self._hashes, self._parts = np.insert(self._hashes, at, h[order]), np.insert(self._parts, at, p[order])
        self._recent, self._num_recent = {}, 0

    def parts_of(self, episode_id: str) -> list[int]:
        """Parts that may hold this id (usually none; one when it is held)."""
        h = _id_hash(episode_id)
        lo, hi = np.searchsorted(self._hashes, np.uint64(h), "left"), np.searchsorted(self._hashes, np.uint64(h), "right")
        return [int(q) for q in self._parts[lo:hi]] + self._recent.get(h, [])


class TrajectoryStore:
    """Append-only, crash-safe store of finished episodes under `root` (a run directory).

    Writers buffer `append`ed episodes and write one Parquet part per `flush` (automatic every
    `flush_every` episodes or once the oldest buffered one is `flush_interval_s` old). Reads see
    what has been flushed to disk (by any writer); call `flush()` first to include your buffer.
    Open with `readonly=True` to only read (nothing is created or cleaned).
    """

    def __init__(self, root: str | Path, *, flush_every: int = 64, flush_interval_s: float = 30.0,
                 write_images: bool = True, readonly: bool = False) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.root = Path(root)
        self.parts_dir = self.root / "trajectories"
        self.images_dir = self.root / "images"
        self.staging_dir = self.images_dir / ".staging"  # image temp files, renamed into place
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.write_images = write_images
        self.readonly = readonly
        self._lock = threading.RLock()
        # snapshots taken at append time: later changes to a Trajectory object do not leak in
        self._buffer: list[dict] = []  # Arrow rows (Trajectory.to_arrow_row + the filter columns)
        self._buffer_images: list[tuple[str, int, int, bytes]] = []  # (episode id, turn, k, png)
        self._buffer_since: float | None = None
        self._buffer_ids: set[str] = set()  # ids in the buffer (at most flush_every)
        self._index: IdIndex | None = None  # ids on disk, by part: built at open (writers) or first use
        self._next_part = 0  # the number this writer's next part tries first
        if readonly:
            if not self.parts_dir.is_dir():
                raise StoreError(f"{self.root} holds no trajectory store (no {self.parts_dir.name}/ directory)")
        else:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
            self.staging_dir.mkdir(parents=True, exist_ok=True)
            self.clean_stray_temp_files()
            self._rescan()

    # -- files -------------------------------------------------------------------------
    def parts(self) -> list[Path]:
        """Published part files in write order (lists the directory: for reads, never per append)."""
        if not self.parts_dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.parts_dir.iterdir() if (m := PART_RE.match(p.name))]
        return [p for _, p in sorted(found)]

    def _part_path(self, number: int) -> Path:
        return self.parts_dir / f"part-{number:06d}.parquet"

    def _rescan(self) -> None:
        """Index every part's ids and find the next free part number: at open, after a rollback, or
        when another writer published a part (the only times the directory changed behind us)."""
        index, last = IdIndex(), -1
        for p in self.parts():
            number = int(PART_RE.match(p.name).group(1))
            index.add(self._read_part_column(p, "id"), number)
            last = number
        self._index, self._next_part = index, last + 1

    def clean_stray_temp_files(self) -> list[Path]:
        """Remove temp files left by writers that died mid-write (their pid is gone)."""
        removed = []
        for directory in (self.parts_dir, self.staging_dir):
            if not directory.is_dir():
                continue
            for p in directory.iterdir():
                m = TMP_RE.match(p.name)
                if m and not _pid_alive(int(m.group("pid"))):
                    p.unlink(missing_ok=True)
                    removed.append(p)
        return removed

    def image_path(self, episode_id: str, turn: int, k: int) -> Path:
        return self.images_dir / episode_id / f"{turn}_{k}.png"

    # -- writing -----------------------------------------------------------------------
    def append(self, trajectory: Trajectory) -> bool:
        """Buffer one finished episode; False (and nothing stored) when its id is already held."""
        if self.readonly:
            raise StoreError(f"store {self.root} was opened read-only")
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"append takes a k3rl.Trajectory, got {type(trajectory).__name__}")
        with self._lock:
            if self.contains(trajectory.id):
                return False
            row = trajectory.to_arrow_row()
            for name, kind in EXTRA_COLUMNS:
                value = trajectory.metadata.get(name)
                row[name] = _meta_int(trajectory.metadata, name) if kind == pa.int64() else (
                    None if value is None else str(value))
            self._buffer.append(row)
            if self.write_images:
                self._buffer_images += [(trajectory.id, ti, k, png) for ti, turn in enumerate(trajectory.turns)
                                        for k, png in enumerate(turn.images)]
            self._buffer_ids.add(trajectory.id)
            if self._buffer_since is None:
                self._buffer_since = time.monotonic()
            if len(self._buffer) >= self.flush_every or time.monotonic() - self._buffer_since >= self.flush_interval_s:
                self.flush()
            return True

    def extend(self, trajectories: Iterable[Trajectory]) -> int:
        """Append several; returns how many were new."""
        return sum(self.append(t) for t in trajectories)

    @property
    def pending(self) -> int:
        """Episodes buffered and not yet on disk."""
        return len(self._buffer)

    def flush(self) -> Path | None:
        """Write the buffered episodes as one new part (images first); returns its path."""
        with self._lock:
            if not self._buffer:
                return None
            self._write_images(self._buffer_images)
            path = self._write_part(pa.Table.from_pylist(self._buffer, schema=PART_SCHEMA))
            self._buffer, self._buffer_images, self._buffer_ids, self._buffer_since = [], [], set(), None
            return path

    def close(self) -> None:
        if not self.readonly:
            self.flush()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_images(self, images: list[tuple[str, int, int, bytes]]) -> None:
        """The images as PNG files: all written to temp files in images/.staging, fsync'd, renamed
        into images/<episode>/, then each touched directory fsync'd once."""
        written: list[tuple[Path, Path]] = []
        try:
            for episode_id, turn, k, png in images:
                final = self.image_path(episode_id, turn, k)
                if final.exists():
                    continue
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp = _temp_name(self.staging_dir / f"{episode_id}-{turn}_{k}.png")
                written.append((tmp, final))
                tmp.write_bytes(png)
            for tmp, _ in written:
                fsync_file(tmp)
            for tmp, final in written:
                os.replace(tmp, final)
        finally:
            for tmp, _ in written:
                tmp.unlink(missing_ok=True)
        for directory in {final.parent for _, final in written} | ({self.images_dir} if written else set()):
            fsync_dir(directory)

    def _write_part(self, table: pa.Table) -> Path:
        """Publish `table` as the next part and index its ids; another writer's parts, found when
        their number is taken, are indexed too (a rescan)."""
        if self._index is None:
            self._rescan()
        taken = False
        while True:
            final = self._part_path(self._next_part)
            tmp = _temp_name(final)
            try:
                with open(tmp, "wb") as f:
                    pq.write_table(table, f, compression="zstd")
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            if _publish(tmp, final, overwrite=False):
                break
            self._next_part, taken = self._next_part + 1, True  # another writer published this number first
        if taken:
            self._rescan()  # it includes our new part
        else:
            self._index.add(table.column("id").to_pylist(), self._next_part)
            self._next_part += 1
        return final

    def rollback(self, step: int) -> int:
        """Remove every episode decided after training step `step` (rows with step > `step`);
        returns how many were removed. Each affected part is rewritten without those rows (new
        part published first, then the old one unlinked: a crash in between leaves duplicates,
        which reads drop, and the next rollback removes again)."""
        if self.readonly:
            raise StoreError(f"store {self.root} was opened read-only")
        removed = 0
        with self._lock:
            self.flush()
            for p in self.parts():
                steps = self._read_part_column(p, "step")
                keep = [s is None or s <= step for s in steps]
                if all(keep):
                    continue
                removed += keep.count(False)
                table = self._read_part(p).filter(pa.array(keep))
                if table.num_rows:
                    self._write_part(table.cast(PART_SCHEMA))
                p.unlink()
                fsync_dir(self.parts_dir)
            self._rescan()
        return removed

    # -- reading -----------------------------------------------------------------------
    def _read_part(self, path: Path, filters=None) -> pa.Table:
        try:
            return pq.read_table(path, filters=filters)
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreError(f"cannot read trajectory part {path}: {e}") from e

    def _read_part_column(self, path: Path, column: str) -> list:
        try:
            with pq.ParquetFile(path) as f:  # lighter than read_table for one small file
                return f.read(columns=[column]).column(column).to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreError(f"cannot read trajectory part {path}: {e}") from e

    def contains(self, episode_id: str) -> bool:
        """True when an episode with this id is buffered by this writer or on disk: in a part that was
        there when the store was opened (or rescanned) or that this writer published since."""
        with self._lock:
            if episode_id in self._buffer_ids:
                return True
            if self._index is None:
                self._rescan()
            return any(episode_id in self._read_part_column(self._part_path(q), "id")
                       for q in self._index.parts_of(episode_id))  # a hash match, confirmed

    @staticmethod
    def _filter(step: int | None, episode: str | None, status: str | None = None):
        """A pyarrow filter expression (evaluated while reading, before any row is decoded)."""
        expr = None
        if status is not None:
            expr = pc.field("status") == status
        if step is not None:
            by_step = pc.field("step") == int(step)
            expr = by_step if expr is None else expr & by_step
        if episode is not None:
            prefix = pc.starts_with(pc.field("id"), pattern=episode)
            expr = prefix if expr is None else expr & prefix
        return expr

    def iter_all(self, step: int | None = None, episode: str | None = None,
                 status: str | None = None) -> Iterator[Trajectory]:
        """Every stored episode once (first copy of an id wins), in write order; optionally only
        those decided at training `step`, with `status`, and/or whose id starts with `episode`."""
        filters = self._filter(step, episode, status)
        schema_names = set(Trajectory.arrow_schema().names)
        seen: set[str] = set()
        for p in self.parts():
            for row in self._read_part(p, filters).to_pylist():
                if row["id"] in seen:
                    continue
                seen.add(row["id"])
                yield Trajectory.from_arrow_row({k: v for k, v in row.items() if k in schema_names})

    def read(self, step: int | None = None, episode: str | None = None, status: str | None = None) -> list[Trajectory]:
        """Stored episodes, optionally only those decided at training `step` (metadata["step"]),
        with `status` (metadata["status"]) and/or whose id starts with `episode` (a full id or a prefix)."""
        return list(self.iter_all(step=step, episode=episode, status=status))

    def ids(self) -> list[str]:
        """Episode ids on disk, in write order, without duplicates."""
        seen: dict[str, None] = {}
        for p in self.parts():
            for i in self._read_part_column(p, "id"):
                seen.setdefault(i, None)
        return list(seen)

    def count(self) -> int:
        """Number of distinct episodes on disk."""
        return len(self.ids())

    def summary(self) -> list[dict]:
        """One small dict per stored episode (id, env_id, step, policy_version, status, reward,
        error, num_turns) read without decoding the turns."""
        cols = ["id", "env_id", "step", "policy_version", "status", "reward", "error"]
        seen: set[str] = set()
        out = []
        for p in self.parts():
            try:
                names = set(pq.read_schema(p).names)  # parts written before a column existed lack it
                table = pq.read_table(p, columns=[c for c in cols if c in names] + ["turns"])
            except (pa.ArrowInvalid, OSError) as e:
                raise StoreError(f"cannot read trajectory part {p}: {e}") from e
            num_turns = pc.list_value_length(table.column("turns")).to_pylist()
            rows = table.select([c for c in cols if c in names]).to_pylist()
            for r, n in zip(rows, num_turns, strict=True):
                r = {c: r.get(c) for c in cols}
                if r["id"] in seen:
                    continue
                seen.add(r["id"])
                r["num_turns"] = n
                out.append(r)
        return out
