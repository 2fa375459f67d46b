import asyncio

import pytest

from k3rl.rollout.buffer import TrajectoryBuffer
from k3rl.store import TrajectoryStore
from k3rl.types import Trajectory


def _t(i, g, reward=0.0, error=None, version=1):
    tokens = [] if error else [5, 6]
    return Trajectory(id=f"e{i}", env_id="x", group_id=g, prompt_ids=[1], reward=reward, error=error,
                      completion_ids=tokens, logprobs=[0.0] * len(tokens), loss_mask=[1] * len(tokens),
                      versions=[version] * len(tokens))


def test_duplicates_are_dropped_exactly_once():
    async def go():
        b = TrajectoryBuffer(group_size=1)
        assert await b.put(_t(0, "a", reward=1.0))
        assert not await b.put(_t(0, "a", reward=0.5))  # a retried episode that had arrived
        assert not await b.put(_t(0, "a").to_json())
        assert [t.reward for t in b.take(["a"], step=1)] == [1.0]
        assert b.get_stats()["duplicates"] == 2 and b.get_stats()["received"] == 1

    asyncio.run(go())


def test_take_trains_the_members_that_did_not_fail_and_stores_every_member_with_its_fate(tmp_path):
    async def go():
        b = TrajectoryBuffer(group_size=2, store_dir=str(tmp_path))
        for i in range(4):
            await b.put(_t(i, f"g{i // 2}", error="SandboxError: container died" if i == 3 else None))
        await b.put_lost({"id": "e5", "env_id": "x", "group_id": "g2", "seed": 1}, "episode lost: deadline")
        await b.put(_t(4, "g2"))
        await b.put(_t(5, "g2"))  # arrives after it was recorded as lost: a duplicate
        await b.put(_t(6, "g3"))  # finished, never trained: stored as unused at the end
        with pytest.raises(KeyError, match="not complete"):
            b.take(["g3"], step=1)
        trained = b.take(["g0", "g1"], step=1)
        assert [t.id for t in trained] == ["e0", "e1", "e2"]
        b.drop(["g2"], step=2)
        assert b.flush_unused(step=3) == 1

    asyncio.run(go())
    fate = {r["id"]: (r["status"], r["step"]) for r in TrajectoryStore(tmp_path, readonly=True).summary()}
    assert fate == {"e0": ("trained", 1), "e1": ("trained", 1), "e2": ("trained", 1), "e3": ("failed", 1),
                    "e4": ("stale", 2), "e5": ("failed", 2), "e6": ("unused", 3)}
    lost = TrajectoryStore(tmp_path, readonly=True).read(episode="e5")[0]
    assert lost.error == "episode lost: deadline" and lost.metadata["failed_at"] == "lost"


def test_dropped_groups_are_stored_with_their_status_and_failed_members_as_failed(tmp_path):
    async def go():
        b = TrajectoryBuffer(group_size=2, store_dir=str(tmp_path))
        await b.put(_t(0, "zv", reward=0.5))
        await b.put(_t(1, "zv", error="SandboxError: container died"))
        await b.put(_t(2, "ev", reward=1.0))
        await b.put(_t(3, "ev", error="RuntimeError: engine"))
        b.drop(["zv"], step=3, status="zero_variance")  # dynamic sampling: no reward variance
        b.drop(["ev"], step=3, status="eval")  # evaluation keeps every member as eval, failed or not
        return b.get_stats()

    stats = asyncio.run(go())
    fate = {r["id"]: r["status"] for r in TrajectoryStore(tmp_path, readonly=True).summary()}
    assert fate == {"e0": "zero_variance", "e1": "failed", "e2": "eval", "e3": "eval"}
    assert (stats["zero_variance"], stats["failed"], stats["eval"]) == (1, 1, 2)


def test_settled_ids_are_held_by_the_store_not_the_buffer_and_survive_a_restart(tmp_path):
    """Once a group is settled its ids live in the store (compact, on disk), not in the buffer: a
    late copy is still a duplicate, also for a buffer restarted over the same store (a resume), and
    the buffer keeps no id of a settled group."""
    async def go():
        b = TrajectoryBuffer(group_size=2, store_dir=str(tmp_path))
        for i in range(200):
            await b.put(_t(i, f"g{i // 2}"))
        b.take([f"g{g}" for g in range(100)], step=1)
        assert not await b.put(_t(7, "g3"))  # a late copy of a stored episode
        assert not vars(b).get("_seen") and not b._waiting and not b._settled
        again = TrajectoryBuffer(group_size=2, store_dir=str(tmp_path))
        assert not await again.put(_t(9, "g4"))
        assert await again.put(_t(200, "g100"))
        assert again.get_stats()["duplicates"] == 1

    asyncio.run(go())
    assert TrajectoryStore(tmp_path, readonly=True).count() == 200
