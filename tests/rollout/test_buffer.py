import asyncio

import pytest

from k3rl.rollout.buffer import TrajectoryBuffer
from k3rl.types import Trajectory


def _t(i, g, reward=0.0, error=None):
    return Trajectory(id=f"e{i}", env_id="x", group_id=g, prompt_ids=[1], reward=reward, error=error)


def test_groups_are_released_only_when_complete_and_in_order():
    async def go():
        b = TrajectoryBuffer(group_size=2)
        await b.put(_t(0, "a"))
        await b.put(_t(1, "b"))
        assert b.ready_groups() == 0 and b.pending_episodes() == 2
        await b.put(_t(2, "b"))
        await b.put(_t(3, "a", error="sandbox crashed"))
        groups = await b.get_groups(2, timeout=1)
        assert [[t.id for t in g] for g in groups] == [["e1", "e2"], ["e0", "e3"]]
        assert b.get_stats()["failed"] == 1

    asyncio.run(go())


def test_duplicates_are_dropped_exactly_once():
    async def go():
        b = TrajectoryBuffer(group_size=1)
        assert await b.put(_t(0, "a", reward=1.0))
        assert not await b.put(_t(0, "a", reward=0.5))  # a retried episode that had arrived
        assert not await b.put(_t(0, "a").to_json())
        groups = await b.get_groups(1, timeout=1)
        assert groups[0][0].reward == 1.0
        assert b.get_stats()["duplicates"] == 2 and b.get_stats()["received"] == 1

    asyncio.run(go())


def test_get_waits_and_times_out_and_capacity_applies_back_pressure():
    async def go():
        b = TrajectoryBuffer(group_size=1, capacity_groups=1)
        with pytest.raises(asyncio.TimeoutError):
            await b.get_groups(1, timeout=0.05)
        await b.put(_t(0, "a"))
        blocked = asyncio.ensure_future(b.put(_t(1, "b")))
        await asyncio.sleep(0.05)
        assert not blocked.done()  # the buffer is full: the producer waits, nothing is dropped
        first = await b.get_groups(1, timeout=1)
        assert await asyncio.wait_for(blocked, 1)
        second = await b.get_groups(1, timeout=1)
        assert [first[0][0].id, second[0][0].id] == ["e0", "e1"]

    asyncio.run(go())


def test_buffer_writes_every_accepted_episode_to_the_store(tmp_path):
    from k3rl.store import TrajectoryStore

    async def go():
        b = TrajectoryBuffer(group_size=2, store_dir=str(tmp_path))
        for i in range(4):
            await b.put(_t(i, f"g{i // 2}"))
        await b.put(_t(0, "g0"))
        await b.put(_t(4, "g2"))  # finished, never released: still stored at flush
        await b.get_groups(2, timeout=1, step=7)
        b.flush()

    asyncio.run(go())
    store = TrajectoryStore(tmp_path)
    assert sorted(t.id for t in store.read()) == ["e0", "e1", "e2", "e3", "e4"]
    assert sorted(t.id for t in store.read(step=7)) == ["e0", "e1", "e2", "e3"]
