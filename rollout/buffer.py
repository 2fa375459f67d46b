"""TrajectoryBuffer: finished episodes wait here, by group, until the scheduler decides their fate.

* Exactly once: episodes are keyed by id; a second copy of an id (a retried episode whose
  first attempt did arrive, or a late one already recorded as lost) is dropped (`put` returns
  False). An id is held while its group waits here, then by the store it was written to (whose
  index is compact and survives a resume), so the buffer's memory does not grow with the job's
  length; without a store (tests) the settled ids are kept in a set.
* The scheduler sees only the small stats the rollout workers return; it names the groups a
  step trains (`take`), drops (`drop`: stale, every member failed, zero reward variance under
  dynamic sampling, or evaluation) or leaves unused at the end (`flush_unused`). Each episode is
  then written to the TrajectoryStore with that fate in `metadata["status"]` (trained, failed,
  stale, zero_variance, unused, eval, rolled_back: a batch the collapse guard refused to train)
  and the step it was decided at.
* By reference: `take_ref` puts the trainable episodes of a batch into Ray's object store
  itself and returns only the reference, so the tokens go from here to the learner ranks
  without passing through the driver.
* Failed episodes (error set, or no sampled token) are stored but never handed to training:
  a group trains on its members that did not fail.

Used in-process by tests and as a Ray actor by the job.
"""

from __future__ import annotations

from typing import Any

import ray

from k3rl.metrics import episode_stats, trainable
from k3rl.store import TrajectoryStore
from k3rl.types import Trajectory


class BufferDiedError(RuntimeError):
    """The TrajectoryBuffer actor died: finished episodes have nowhere to go, so the job stops (the store
    keeps what was written; `--resume` continues from the last checkpoint and re-issues the rest)."""


async def put_trajectory(buffer, traj: Trajectory) -> bool:
    """`buffer.put(traj)` on the buffer actor; its death raises BufferDiedError (a rollout worker's own
    failure would be taken for the worker's death, and healthy workers replaced)."""
    try:
        return await buffer.put.remote(traj)
    except ray.exceptions.RayActorError as e:
        raise BufferDiedError(f"the trajectory buffer died ({type(e).__name__}): finished episodes have nowhere to "
                              f"go; resume the job (k3rl train ... --resume) from its last checkpoint") from None


class TrajectoryBuffer:
    def __init__(self, group_size: int, store_dir: str | None = None) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.group_size = group_size
        self._groups: dict[str, dict[str, Trajectory]] = {}
        self._waiting: set[str] = set()  # ids in self._groups
        self._settled: set[str] = set()  # ids settled here, only when there is no store to ask
        self.stats = {"received": 0, "duplicates": 0, "trained": 0, "failed": 0, "stale": 0, "zero_variance": 0, "rolled_back": 0,
                      "unused": 0, "eval": 0}
        self._store = None
        if store_dir:
            self._store = TrajectoryStore(store_dir)

    async def put(self, traj: Trajectory | str | dict) -> bool:
        """Accept one finished episode; False for an id already received."""
        if isinstance(traj, str):
            traj = Trajectory.from_json(traj)
        elif isinstance(traj, dict):
            traj = Trajectory.model_validate(traj)
        if self._held(traj.id):
            self.stats["duplicates"] += 1
            return False
        self._waiting.add(traj.id)
        self.stats["received"] += 1
        self._groups.setdefault(traj.group_id or traj.id, {})[traj.id] = traj
        return True

    def _held(self, episode_id: str) -> bool:
        if episode_id in self._waiting:
            return True
        return self._store.contains(episode_id) if self._store is not None else episode_id in self._settled

    async def put_lost(self, spec: dict[str, Any], error: str) -> dict[str, Any]:
        """Record an episode whose worker never delivered it (deadline, dead workers) as failed;
        returns its stats. A copy arriving later is a duplicate."""
        traj = Trajectory(id=spec["id"], env_id=spec["env_id"], seed=spec.get("seed"), group_id=spec.get("group_id", ""),
                          prompt_ids=[], error=error, metadata={"failed_at": "lost", "env_kwargs": spec.get("env_kwargs", {})})
        await self.put(traj)
        return episode_stats(self._groups[traj.group_id or traj.id].get(traj.id, traj))

    def _settle(self, group_id: str, step: int, status: str) -> list[Trajectory]:
        """Remove a group, write each member with its fate; returns the members `status` applies to."""
        members = list(self._groups.pop(group_id, {}).values())
        kept = []
        for t in members:
            s = episode_stats(t)
            fate = status if (status in ("unused", "eval") or trainable(s)) else "failed"
            t.metadata.update(step=step, status=fate, policy_version=s["min_version"])
            self.stats[fate] += 1
            self._waiting.discard(t.id)
            if self._store is not None:
                self._store.append(t)
            else:
                self._settled.add(t.id)
            if fate == status:
                kept.append(t)
        return kept

    def take(self, group_ids: list[str], step: int) -> list[Trajectory]:
        """The trainable members of these groups, for training step `step`; all members are stored."""
        missing = [g for g in group_ids if len(self._groups.get(g, {})) < self.group_size]
        if missing:
            raise KeyError(f"groups not complete in the buffer: {missing[:5]}")
        out = [t for g in group_ids for t in self._settle(g, step, "trained")]
        self._flush()
        return out

    def take_ref(self, group_ids: list[str], step: int) -> list:
        """`take`, returned as [ObjectRef] (put here, so only the learner ranks fetch the tokens)."""
        return [ray.put(self.take(group_ids, step))]

    def drop(self, group_ids: list[str], step: int, status: str = "stale") -> None:
        """Groups that will not be trained (too stale, every member failed, zero variance, evaluation, a batch
        the collapse guard rolled back): stored
        with `status` (failed members of a group that is not evaluated or unused: as failed), then gone."""
        for g in group_ids:
            self._settle(g, step, status)
        self._flush()

    def flush_unused(self, step: int) -> int:
        """At the end of a job: store every episode still here (finished, never trained) as unused,
        tagged `step` (after the last trained step: a resume rolls them back and re-issues them)."""
        n = sum(len(self._settle(g, step, "unused")) for g in list(self._groups))
        self._flush()
        return n

    def _flush(self) -> None:
        if self._store is not None:
            self._store.flush()

    def holds(self, group_id: str) -> int:
        return len(self._groups.get(group_id, {}))

    def get_stats(self) -> dict[str, Any]:
        return {**self.stats, "waiting_episodes": sum(len(g) for g in self._groups.values())}
