"""TrajectoryBuffer: finished episodes in, complete prompt groups out.

* Groups: GRPO-style advantages need every sample of a prompt, so a group is released
  only when all `group_size` episodes of it have arrived (failed ones included: they
  carry reward 0 and their error).
* Exactly once: episodes are keyed by their id; a retried episode whose first attempt
  did arrive is dropped (`put` returns False), so nothing is counted twice.
* Bounded: `capacity` groups at most wait; `put` beyond that blocks the producer
  (back-pressure, not data loss).
* Every accepted episode is appended to the TrajectoryStore (Parquet + PNG) when one
  is given: at release, tagged with the training step that consumed it, and at `flush()`
  for those never released.

Used in-process by tests and as a Ray actor (`BufferActor`) by the job.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from typing import Any

from k3rl.types import Trajectory


class TrajectoryBuffer:
    def __init__(self, group_size: int, capacity_groups: int = 1024, store_dir: str | None = None) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.group_size = group_size
        self.capacity = capacity_groups
        self._pending: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self._ready: deque[list[Trajectory]] = deque()
        self._seen: set[str] = set()
        self._cond = asyncio.Condition()
        self.stats = {"received": 0, "duplicates": 0, "failed": 0, "groups_released": 0, "episodes_released": 0}
        self._store = None
        if store_dir:
            from k3rl.store import TrajectoryStore

            self._store = TrajectoryStore(store_dir)

    def _put_now(self, traj: Trajectory) -> bool:
        if traj.id in self._seen:
            self.stats["duplicates"] += 1
            return False
        self._seen.add(traj.id)
        self.stats["received"] += 1
        if traj.error:
            self.stats["failed"] += 1
        group = self._pending.setdefault(traj.group_id or traj.id, [])
        group.append(traj)
        if len(group) >= self.group_size:
            self._ready.append(self._pending.pop(traj.group_id or traj.id))
        return True

    async def put(self, traj: Trajectory | str | dict) -> bool:
        if isinstance(traj, str):
            traj = Trajectory.from_json(traj)
        elif isinstance(traj, dict):
            traj = Trajectory.model_validate(traj)
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._ready) < self.capacity or traj.id in self._seen)
            accepted = self._put_now(traj)
            self._cond.notify_all()
            return accepted

    async def get_groups(self, num_groups: int, timeout: float | None = None,
                         step: int | None = None) -> list[list[Trajectory]]:
        """Wait for `num_groups` complete groups (oldest first) and take them.

        `step` (the training step that consumes them) is recorded in each episode's metadata
        before it is written to the store, so `k3rl replay --step N` finds it."""
        async with self._cond:
            await asyncio.wait_for(self._cond.wait_for(lambda: len(self._ready) >= num_groups), timeout)
            out = [self._ready.popleft() for _ in range(num_groups)]
            self.stats["groups_released"] += len(out)
            self.stats["episodes_released"] += sum(len(g) for g in out)
            self._cond.notify_all()
        for group in out:
            for t in group:
                if step is not None:
                    t.metadata["step"] = step
                if self._store is not None:
                    self._store.append(t)
        if self._store is not None:
            self._store.flush()
        return out

    def ready_groups(self) -> int:
        return len(self._ready)

    def pending_episodes(self) -> int:
        return sum(len(g) for g in self._pending.values())

    def seen(self, episode_id: str) -> bool:
        return episode_id in self._seen

    def get_stats(self) -> dict[str, Any]:
        return {**self.stats, "ready_groups": len(self._ready), "pending_episodes": self.pending_episodes()}

    def flush(self) -> None:
        """Write every episode not yet released (finished but never trained on) to the store too."""
        if self._store is not None:
            for group in [*self._ready, *self._pending.values()]:
                for t in group:
                    self._store.append(t)  # the store drops ids it already holds
            self._store.flush()


def buffer_actor(**ray_options):
    """The buffer as an async Ray actor class (one event loop, so no locks beyond the Condition)."""
    import ray

    return ray.remote(**({"num_cpus": 0, "max_concurrency": 1000} | ray_options))(TrajectoryBuffer)
