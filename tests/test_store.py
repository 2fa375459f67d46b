"""TrajectoryStore: Parquet parts + PNGs, dedup by id, filters, and crash safety under SIGKILL."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from k3rl.images import png_size, to_png
from k3rl.store import IdIndex, StoreError, TrajectoryStore
from k3rl.types import ToolCall, Trajectory, Turn


def png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    return to_png(Image.new("RGB", (w, h), color))


def make_episode(i: int, gen_tokens: int = 12, step: int | None = None, image: bool = True) -> Trajectory:
    """A deterministic 2-turn tool-use episode numbered i (same i -> equal trajectory)."""
    rng = random.Random(i)
    t = Trajectory(id=f"ep{i:05d}", env_id="k3rl/Test-v0", seed=i, prompt_ids=[rng.randrange(256) for _ in range(6)],
                   metadata={"step": i // 4 if step is None else step, "policy_version": i // 4})
    turns = [Turn(role="user", text=f"task {i}", images=[png(8 + i % 5, 6, (i % 256, 0, 0))] if image else [],
                  start=0, end=6)]
    for k in range(2):
        lp = [-rng.random() * 3 for _ in range(gen_tokens)]
        s, e = t.append([rng.randrange(256) for _ in range(gen_tokens)], generated=True, logprobs=lp, version=i // 4 + k)
        call = [ToolCall(name="add", arguments={"a": i, "b": k}, id=f"c{i}-{k}")] if k == 0 else []
        turns.append(Turn(role="assistant", text=f"answer {k}", tool_calls=call, start=s, end=e))
        if k == 0:
            s, e = t.append([rng.randrange(256) for _ in range(5)], generated=False)
            turns.append(Turn(role="tool", text=str(i + k), tool_name="add", tool_index=1, start=s, end=e,
                              images=[png(4, 3 + k, (0, 255, 0))] if image else []))
    t.turns = turns
    t.reward = float(i % 3) / 2
    t.terminated = True
    t.timings = {"episode_s": 0.5 + i}
    return t


def test_roundtrip_parts_images_and_filters(tmp_path):
    eps = [make_episode(i) for i in range(10)]
    with TrajectoryStore(tmp_path / "run", flush_every=4) as store:
        assert store.extend(eps) == 10
        # two automatic flushes of 4, then 2 buffered until close
        assert [p.name for p in store.parts()] == ["part-000000.parquet", "part-000001.parquet"]
        assert store.pending == 2
    reader = TrajectoryStore(tmp_path / "run", readonly=True)
    assert len(reader.parts()) == 3
    got = reader.read()
    assert [t.id for t in got] == [t.id for t in eps]
    assert got == eps  # token ids, float64 log-probs, images, tool calls: exact
    assert reader.count() == 10
    # step filter reads metadata["step"] through the extra column
    assert [t.id for t in reader.read(step=1)] == ["ep00004", "ep00005", "ep00006", "ep00007"]
    assert reader.read(step=99) == []
    assert [t.id for t in reader.read(episode="ep0000")] == [f"ep0000{i}" for i in range(10)]
    assert [t.id for t in reader.read(step=2, episode="ep00009")] == ["ep00009"]
    # the PNGs on disk are the episode's images, byte for byte
    for t in eps:
        for ti, turn in enumerate(t.turns):
            for k, img in enumerate(turn.images):
                assert reader.image_path(t.id, ti, k).read_bytes() == img
    assert png_size(reader.image_path("ep00003", 0, 0).read_bytes()) == (11, 6)
    summary = reader.summary()
    assert [(s["id"], s["step"], s["num_turns"]) for s in summary[:2]] == [("ep00000", 0, 4), ("ep00001", 0, 4)]
    # the files are plain Parquet with the Trajectory schema plus the filter columns
    schema = pq.read_schema(reader.parts()[0])
    assert set(Trajectory.arrow_schema().names) | {"step", "policy_version", "status"} == set(schema.names)


def test_dedup_on_append_and_on_read(tmp_path):
    store = TrajectoryStore(tmp_path, flush_every=100)
    a = make_episode(1)
    assert store.append(a) is True
    assert store.append(a) is False  # buffered copy already held
    assert store.contains("ep00001") and not store.contains("ep00002")
    store.flush()
    again = TrajectoryStore(tmp_path)  # a restarted writer sees what is on disk
    assert again.contains("ep00001")
    assert again.append(make_episode(1)) is False
    # two writers that both accepted the same id before either flushed: reads keep the first copy
    w1, w2 = TrajectoryStore(tmp_path), TrajectoryStore(tmp_path)
    first, second = make_episode(7), make_episode(7)
    second.reward = 42.0
    assert w1.append(first) and w2.append(second)
    w1.flush()
    w2.flush()
    assert len(w1.parts()) == 3  # distinct part numbers, nothing overwritten
    got = TrajectoryStore(tmp_path, readonly=True).read(episode="ep00007")
    assert len(got) == 1 and got[0].reward == first.reward
    assert TrajectoryStore(tmp_path, readonly=True).count() == 2


def test_bad_input_and_unreadable_part(tmp_path):
    with pytest.raises(StoreError, match="no trajectories/ directory"):
        TrajectoryStore(tmp_path / "missing", readonly=True)
    with pytest.raises(ValueError, match="flush_every"):
        TrajectoryStore(tmp_path, flush_every=0)
    store = TrajectoryStore(tmp_path)
    with pytest.raises(TypeError, match="k3rl.Trajectory"):
        store.append({"id": "x"})
    ro = TrajectoryStore(tmp_path, readonly=True)
    with pytest.raises(StoreError, match="read-only"):
        ro.append(make_episode(0))
    # a part that is not Parquet (e.g. disk corruption) is named in the error
    (tmp_path / "trajectories" / "part-000000.parquet").write_bytes(b"not parquet")
    with pytest.raises(StoreError, match="part-000000.parquet"):
        ro.read()


def test_append_takes_a_snapshot(tmp_path):
    store = TrajectoryStore(tmp_path, flush_every=10)
    t = make_episode(2)
    store.append(t)
    t.reward = -5.0  # changed after appending (e.g. by the caller's bookkeeping)
    t.metadata["step"] = 99
    t.turns[0].images.clear()
    store.flush()
    (got,) = store.read()
    assert got == make_episode(2)
    assert store.read(step=99) == [] and store.image_path(t.id, 0, 0).read_bytes() == got.turns[0].images[0]


def test_stray_temp_files_of_dead_writers_are_ignored_and_cleaned(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    parts, staging = tmp_path / "trajectories", tmp_path / "images" / ".staging"
    TrajectoryStore(tmp_path, flush_every=1).append(make_episode(2))
    half = parts / f".part-000009.parquet.tmp-{dead_pid}-00ff"
    half.write_bytes(b"PAR1" + os.urandom(100))  # the start of a Parquet file, cut off
    dead_img = staging / f".ep00003-0_0.png.tmp-{dead_pid}-00ff"
    live_img = staging / f".ep00004-0_0.png.tmp-{os.getpid()}-00ff"  # a writer still at work
    dead_img.write_bytes(b"\x89PNG")
    live_img.write_bytes(b"\x89PNG")
    assert [t.id for t in TrajectoryStore(tmp_path, readonly=True).read()] == ["ep00002"]
    assert half.exists() and dead_img.exists()  # readers leave the directory alone
    TrajectoryStore(tmp_path)
    assert not half.exists() and not dead_img.exists() and live_img.exists()


def test_time_based_flush(tmp_path):
    store = TrajectoryStore(tmp_path, flush_every=1000, flush_interval_s=0.0)
    store.append(make_episode(3))
    assert store.pending == 0 and store.count() == 1


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from test_store import make_episode
    from k3rl.store import TrajectoryStore

    store = TrajectoryStore({root!r}, flush_every={every})
    i = 0
    while True:
        store.append(make_episode(i, gen_tokens={gen}))
        i += 1
        if store.pending == 0:
            print("flushed", i, flush=True)
    """
)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _unpublished_temps(parts_dir: Path) -> list[Path]:
    """Temp parts whose final name is not published yet: their writer is inside the write
    (a temp seen after publishing exists only for the instant between link and unlink)."""
    return [tmp for tmp in parts_dir.glob(".part-*.tmp-*")
            if _size(tmp) > 0 and not (parts_dir / tmp.name[1:].split(".tmp-")[0]).exists()]


def _kill_writer_mid_write(root: Path, every: int, gen: int) -> str:
    """Start a writer, SIGKILL it as soon as it is inside the write of its third part; its stdout."""
    script = WRITER.format(tests=str(Path(__file__).parent), root=str(root), every=every, gen=gen)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    parts_dir = root / "trajectories"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list(parts_dir.glob("part-*.parquet"))) >= 2 and _unpublished_temps(parts_dir):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        out = proc.stdout.read()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, f"writer exited by itself with {proc.returncode}"
    return out


def test_sigkill_mid_write_leaves_only_complete_parts(tmp_path):
    """A real writer process is SIGKILLed while a part is being written: every visible part is
    complete, holds exactly whole flushes of the episodes the writer produced, and the temp file
    it left is invisible to readers and removed by the next writer."""
    every, gen = 6, 20_000  # ~2 MB of log-probs per part: a write takes long enough to be caught in
    for attempt in range(5):  # on a loaded machine the write may finish before the kill lands: retry
        root = tmp_path / f"run{attempt}"
        out = _kill_writer_mid_write(root, every, gen)
        parts_dir = root / "trajectories"
        stray = _unpublished_temps(parts_dir)
        if stray:
            break
    assert len(stray) == 1, "never killed the writer inside a write"
    flushed = max([int(line.split()[1]) for line in out.splitlines() if line.startswith("flushed")], default=0)
    reader = TrajectoryStore(root, readonly=True)
    assert stray[0].exists()  # read-only open does not touch the directory
    got = reader.read()
    # only whole flushes are visible, and every flush the writer reported is there
    assert len(got) % every == 0 and len(got) >= flushed >= 2 * every
    assert [t.id for t in got] == [f"ep{i:05d}" for i in range(len(got))]
    for t in got:
        assert t == make_episode(int(t.id[2:]), gen_tokens=gen)
        for ti, turn in enumerate(t.turns):
            for k, img in enumerate(turn.images):
                on_disk = reader.image_path(t.id, ti, k).read_bytes()
                assert on_disk == img
                Image.open(io.BytesIO(on_disk)).verify()
    # a new writer cleans the dead writer's temp file and continues the numbering
    writer = TrajectoryStore(root, flush_every=1)
    assert not any(p.exists() for p in stray)
    assert writer.append(make_episode(len(got), gen_tokens=8))
    assert writer.parts()[-1].name == f"part-{len(got) // every:06d}.parquet"
    assert writer.count() == len(got) + 1


def test_rollback_removes_what_was_decided_after_the_checkpoint_step(tmp_path):
    """Resume from the checkpoint of step 2: rows decided at steps 3+ go (their training was lost),
    rows of steps <= 2 and rows without a step stay; the removed ids can be appended again."""
    store = TrajectoryStore(tmp_path, flush_every=3)
    for i in range(10):
        store.append(Trajectory(id=f"e{i}", env_id="x", prompt_ids=[1],
                                metadata={"step": i // 2 if i < 8 else None, "status": "trained"}))
    store.flush()
    assert store.rollback(2) == 2  # e6 e7 (step 3) go; e4 e5 (step 2) stay
    assert sorted(store.ids()) == ["e0", "e1", "e2", "e3", "e4", "e5", "e8", "e9"]
    assert store.append(Trajectory(id="e6", env_id="x", prompt_ids=[1], metadata={"step": 3, "status": "failed"}))
    store.flush()
    assert [t.metadata["status"] for t in store.read(step=3)] == ["failed"]
    assert len(store.read(status="trained")) == 8
    assert TrajectoryStore(tmp_path, readonly=True).count() == 9


def test_appends_neither_list_the_directory_nor_read_parts_once_open(tmp_path, monkeypatch):
    """Appends cost O(1) in the number of parts: the store lists trajectories/ and reads the parts'
    ids when it opens, then keeps its next part number and id index itself. Only a duplicate's
    confirmation reads one part (the one its hash names)."""
    with TrajectoryStore(tmp_path, flush_every=1, write_images=False) as first:
        first.extend(make_episode(i, image=False) for i in range(20))
    store = TrajectoryStore(tmp_path, flush_every=4, write_images=False)  # opening lists and reads, once
    calls: dict[str, int] = {}

    def counting(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for module, name in [(os, "listdir"), (os, "scandir"), (pq, "read_table"), (pq, "ParquetFile")]:
        counting(module, name)
    assert store.extend(make_episode(i, image=False) for i in range(20, 60)) == 40  # 10 new parts
    assert calls == {}, f"appends listed the directory or read parts: {calls}"
    assert store.append(make_episode(3, image=False)) is False  # held in an old part: that part is read
    assert store.append(make_episode(41, image=False)) is False  # held in a part this writer wrote
    assert calls.get("listdir", 0) + calls.get("scandir", 0) == 0
    assert calls.get("read_table", 0) + calls.get("ParquetFile", 0) == 2
    monkeypatch.undo()
    assert [p.name for p in store.parts()] == [f"part-{i:06d}.parquet" for i in range(30)]
    assert TrajectoryStore(tmp_path, readonly=True).ids() == [f"ep{i:05d}" for i in range(60)]


def test_id_index_is_exact_when_hashes_collide(tmp_path, monkeypatch):
    """The index keeps 64-bit hashes, not ids: a hash match is confirmed against the part's ids, so
    two ids with one hash are still told apart (forced here: every id hashes alike)."""
    monkeypatch.setattr("k3rl.store._id_hash", lambda episode_id: 7)
    store = TrajectoryStore(tmp_path, flush_every=2, write_images=False)
    assert store.extend(make_episode(i, image=False) for i in range(6)) == 6
    assert not store.contains("ep00099") and store.contains("ep00004")
    assert store.append(make_episode(2, image=False)) is False
    assert store.rollback(0) == 2  # ep00004, ep00005 (step 1) go; the index is rebuilt
    assert not store.contains("ep00004") and store.contains("ep00003")
    assert store.append(make_episode(4, image=False)) is True
    store.flush()
    assert TrajectoryStore(tmp_path, readonly=True).count() == 5


def test_id_index_merges_and_stays_compact(monkeypatch):
    """Many ids: each found in its part after the recent entries are merged into the sorted arrays
    (several merges, small ones here), unknown ids in none, at 12 bytes an id plus the few recent."""
    monkeypatch.setattr(IdIndex, "RECENT", 500)
    index = IdIndex()
    for part in range(50):
        index.add((f"run-g{part:07d}-s{k}" for k in range(64)), part)
    assert len(index) == 3200 and index._num_recent == 3200 % 500  # 6 merges
    assert all(index.parts_of(f"run-g{part:07d}-s{k}") == [part] for part in range(50) for k in range(64))
    assert index.parts_of("run-g0000050-s0") == []
    assert list(index._hashes) == sorted(index._hashes)
    assert index._hashes.nbytes + index._parts.nbytes == 12 * 3000
