"""The scheduler and the buffer under adversarial completion orders: the lag invariant holds for every
trained token, every issued episode gets exactly one fate in the store, lost and failing episodes
never stall or crash the loop. Real Ray actors; the rollout worker plays scripted episodes (its
contract: run_episode(spec) puts the trajectory into the buffer and returns its stats)."""

import asyncio
import os
import random

import pytest
import ray

from k3rl.config import JobConfig
from k3rl.metrics import episode_stats
from k3rl.rollout.buffer import BufferDiedError, TrajectoryBuffer, put_trajectory
from k3rl.rollout.scheduler import EpisodesFailingError, Scheduler
from k3rl.store import TrajectoryStore
from k3rl.types import Trajectory


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    yield


@ray.remote
class Engines:
    """The version the engines serve, as the scripted episodes see it while they run."""

    def __init__(self):
        self.version = 0

    def set(self, v):
        self.version = v

    def get(self):
        return self.version


@ray.remote(max_restarts=0)
class ScriptedWorker:
    """Episodes whose duration and failure are drawn from (seed, episode id): a few stragglers
    take 20x longer; `fail` of them raise in the env; `hang` never return; `die` kill the worker; in
    `const` of the groups every member earns reward 0.5 (zero variance)."""

    def __init__(self, buffer, engines, seed, fail=0.0, hang=(), die=(), const=0.0, long_every=0):
        self.buffer, self.engines, self.seed = buffer, engines, seed
        self.fail, self.hang, self.die, self.const = fail, set(hang), set(die), const
        self.long_every = long_every  # every long_every-th group's episodes take 0.25 s (many turns)

    async def run_episode(self, spec):
        rng = random.Random(f"{self.seed}:{spec['id']}")
        if spec["id"] in self.die:
            os._exit(1)
        if spec["id"] in self.hang:
            await asyncio.sleep(3600)
        v0 = await self.engines.get.remote()
        if self.long_every:
            await asyncio.sleep(0.25 if int(spec["group_id"].rsplit("-g", 1)[1]) % self.long_every == 1 else 0.005)
        else:
            await asyncio.sleep(rng.choice([0.001, 0.005, 0.02]) * (20 if rng.random() < 0.1 else 1))
        v1 = await self.engines.get.remote()
        error = "RuntimeError: tool backend down" if rng.random() < self.fail else None
        const = random.Random(f"{self.seed}:{spec['group_id']}").random() < self.const
        traj = Trajectory(id=spec["id"], env_id=spec["env_id"], group_id=spec["group_id"], seed=spec["seed"],
                          prompt_ids=[1, 2], completion_ids=[] if error else [3, 4], logprobs=[] if error else [0.0, 0.0],
                          loss_mask=[] if error else [1, 1], versions=[] if error else [v0, v1],
                          reward=0.0 if error else 0.5 if const else rng.random(), error=error)
        await put_trajectory(self.buffer, traj)  # as the rollout worker does
        return episode_stats(traj)

    async def close(self):
        return True

    def ping(self):
        return True


def _cfg(lag, P=2, G=2, per_worker=3, partial=True, *extra):
    return JobConfig.load(None, [f"rollout.max_policy_lag={lag}", f"rollout.prompts_per_step={P}",
                                 f"rollout.group_size={G}", f"rollout.episodes_per_worker={per_worker}",
                                 "rollout.num_rollout_workers=2", f"rollout.partial_rollouts={partial}", *extra])


async def _drive(cfg, store_dir, steps, seed, **worker_kw):
    """The driver's loop without a model: batch, 'train', push the next version, repeat."""
    buffer = ray.remote(TrajectoryBuffer).remote(cfg.rollout.group_size, store_dir=str(store_dir))
    engines = Engines.remote()
    sched = Scheduler(cfg, "run", lambda i: ScriptedWorker.remote(buffer, engines, seed, **worker_kw), buffer,
                      episode_deadline_s=worker_kw.pop("deadline", None) or 30.0)
    trained, per_step = [], []
    sched.set_serving(1)
    await engines.set.remote(1)
    for step in range(1, steps + 1):
        batch = await sched.next_batch(step, stall_timeout_s=60)
        trajs = ray.get((await buffer.take_ref.remote([g.id for g in batch], step))[0])
        trained.append((step, trajs))
        per_step.append(sched.metrics())
        await asyncio.sleep(random.Random(step).choice([0.0, 0.01, 0.03]))  # training
        await engines.set.remote(step + 1)
        sched.set_serving(step + 1)
    await sched.stop()
    await buffer.flush_unused.remote(steps + 1)
    stats = {**await buffer.get_stats.remote(), "per_step": per_step}  # per_step: the scheduler's metrics after each batch
    ray.kill(buffer)
    return sched, trained, stats


@pytest.mark.parametrize("lag", [0, pytest.param(1, marks=pytest.mark.slow), 2])  # the edit loop: lags 0 and 2
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # the edit loop runs seed 0
def test_no_trained_token_is_older_than_the_lag_and_each_episode_has_one_fate(tmp_path, lag, seed):
    cfg = _cfg(lag)
    sched, trained, stats = asyncio.run(_drive(cfg, tmp_path, steps=8, seed=seed, fail=0.15))
    for step, trajs in trained:
        assert trajs, f"step {step} trained nothing"
        for t in trajs:
            assert t.error is None and t.completion_ids  # failures never enter the loss
            assert all(step - lag <= v <= step for v in t.versions), (step, lag, t.versions)
            if lag == 0:
                assert set(t.versions) == {step}  # exactly on-policy
    store = TrajectoryStore(tmp_path, readonly=True)
    rows = store.summary()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    by_status = {s: sum(r["status"] == s for r in rows) for s in ("trained", "failed", "stale", "unused")}
    assert by_status["trained"] == sum(len(t) for _, t in trained)
    c = sched.metrics()
    cancelled = c["episodes/issued"] - len(rows)  # in flight when the loop stopped: not stored, re-issued on resume
    assert 0 <= cancelled <= (1 + lag) * cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert by_status["failed"] == stats["failed"] and by_status["stale"] == stats["stale"]
    if lag == 0:
        assert by_status["stale"] == 0  # admission alone keeps lag 0 exact
    for r in rows:  # every trained episode is tagged with the step that trained it
        if r["status"] == "trained":
            assert 1 <= r["step"] <= 8 and r["step"] - lag <= r["policy_version"] <= r["step"]


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_long_episodes_train_as_often_as_short_ones_unless_stragglers_are_dropped(tmp_path):
    """Every other group's episodes take 50x longer (an env whose tasks need many turns), lag 1. With
    `stragglers: wait` (the default) a step waits for the groups it must train: none goes stale, and the
    long groups are half of what trains, as they are half of what is issued. With `drop` the steps take
    the short groups that finished first and long ones end stale, dropped: the policy trains mostly on
    short episodes."""
    share = {}
    for mode in ("wait", "drop"):
        cfg = _cfg(1, 2, 2, 4, True, f"rollout.stragglers={mode}")
        sched, trained, _ = asyncio.run(_drive(cfg, tmp_path / mode, steps=8, seed=0, long_every=2))
        groups = [int(t.group_id.rsplit("-g", 1)[1]) for _, trajs in trained for t in trajs[::2]]
        assert all(len(trajs) == 4 for _, trajs in trained)  # P groups of 2 each step
        share[mode] = sum(g % 2 == 1 for g in groups) / len(groups)
        c = sched.metrics()
        if mode == "wait":
            assert c.get("groups/stale", 0) == 0 and c["groups/waited_for"] >= 1, c
            assert share[mode] >= 0.4, share
        else:
            assert c["groups/stale"] >= 1 and c.get("groups/waited_for", 0) == 0, c
    assert share["drop"] < share["wait"], share


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_stragglers_are_dropped_as_stale_and_replaced(tmp_path):
    """partial_rollouts=false: a group whose tokens span two versions is stale too; with lag 1 and
    slow episodes some are, and each is replaced by a fresh group (the step still gets P groups)."""
    cfg = _cfg(1, partial=False)
    sched, trained, _ = asyncio.run(_drive(cfg, tmp_path, steps=6, seed=3))
    for _, trajs in trained:
        assert len({t.group_id for t in trajs}) == cfg.rollout.prompts_per_step
        assert all(len(set(t.versions)) == 1 for t in trajs)
    c = sched.metrics()
    assert c.get("groups/stale", 0) >= 1 and c["groups/reissued"] >= c["groups/stale"]


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_a_lost_episode_is_recorded_as_failed_and_the_loop_goes_on(tmp_path):
    cfg = _cfg(0)
    sched, trained, stats = asyncio.run(_drive(cfg, tmp_path, steps=2, seed=0, hang=["run-g0000000-s1"], deadline=5.0))
    lost = TrajectoryStore(tmp_path, readonly=True).read(episode="run-g0000000-s1")
    assert len(lost) == 1 and lost[0].metadata["status"] == "failed"
    assert "no result within its deadline" in lost[0].error
    # its group trained on the member that did not fail
    assert [t.id for t in trained[0][1] if t.group_id == "run-g0000000"] == ["run-g0000000-s0"]


@pytest.mark.slow
def test_a_worker_that_keeps_dying_loses_only_that_episode(tmp_path):
    cfg = _cfg(0)
    sched, trained, _ = asyncio.run(_drive(cfg, tmp_path, steps=2, seed=0, die=["run-g0000001-s0"]))
    assert sched.metrics()["workers/restarts"] >= 5
    lost = TrajectoryStore(tmp_path, readonly=True).read(episode="run-g0000001-s0")
    assert "5 attempts on workers that died" in lost[0].error


@pytest.mark.slow  # seconds: make test runs it, make test-fast leaves it out
def test_a_dead_buffer_stops_the_job_naming_it_and_replaces_no_worker(tmp_path):
    """The buffer actor dies after step 1: the next batch raises BufferDiedError at once (not a stall, not
    a worker's death: healthy workers are neither replaced nor re-run their episodes)."""
    cfg = _cfg(1)

    async def main():
        buffer = ray.remote(TrajectoryBuffer).remote(cfg.rollout.group_size, store_dir=str(tmp_path))
        engines = Engines.remote()
        sched = Scheduler(cfg, "run", lambda i: ScriptedWorker.remote(buffer, engines, 0), buffer, episode_deadline_s=30.0)
        sched.set_serving(1)
        await engines.set.remote(1)
        batch = await sched.next_batch(1, stall_timeout_s=60)
        await buffer.take_ref.remote([g.id for g in batch], 1)
        ray.kill(buffer)
        try:
            with pytest.raises(BufferDiedError, match=r"the trajectory buffer died \(\w+\): finished episodes have "
                                                      r"nowhere to go; resume the job"):
                for step in range(2, 6):  # groups that finished before the kill may still make a batch or two
                    await engines.set.remote(step)
                    sched.set_serving(step)
                    await asyncio.wait_for(sched.next_batch(step, stall_timeout_s=60), 30)
            return sched.metrics()
        finally:
            await sched.stop()

    counts = asyncio.run(main())
    assert counts.get("workers/restarts", 0) == 0, counts


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_a_job_whose_episodes_all_fail_stops_with_their_errors(tmp_path):
    with pytest.raises(EpisodesFailingError, match="4x RuntimeError: tool backend down"):
        asyncio.run(_drive(_cfg(0), tmp_path, steps=2, seed=0, fail=1.0))


def _variance(trajs):
    by_group = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t.reward)
    return {g: max(rs) - min(rs) for g, rs in by_group.items()}


@pytest.mark.parametrize("lag", [0, pytest.param(2, marks=pytest.mark.slow)])  # the edit loop runs lag 0
def test_dynamic_sampling_drops_zero_variance_groups_and_refills_them(tmp_path, lag):
    """Half the groups earn the same reward in every member: each is dropped (stored once as
    zero_variance), a fresh group takes its place under the lag bound, and no step trains one."""
    cfg = _cfg(lag, 2, 2, 3, True, "rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_refills=8")
    sched, trained, stats = asyncio.run(_drive(cfg, tmp_path, steps=6, seed=0, const=0.5))
    for step, trajs in trained:
        assert len({t.group_id for t in trajs}) == 2 and all(v > 0 for v in _variance(trajs).values()), step
        assert all(step - lag <= v <= step for t in trajs for v in t.versions)
    rows = TrajectoryStore(tmp_path, readonly=True).summary()
    assert len({r["id"] for r in rows}) == len(rows)  # each episode stored once
    dropped = [r for r in rows if r["status"] == "zero_variance"]
    c = sched.metrics()
    assert c["groups/zero_variance"] >= 2 and len(dropped) == 2 * c["groups/zero_variance"] == stats["zero_variance"]
    assert all(r["reward"] == 0.5 for r in dropped)
    assert c["groups/issued"] >= 6 * 2 + c["groups/zero_variance"]  # each one refilled
    assert {m["dynamic_sampling/refills_exhausted"] for m in stats["per_step"]} == {0.0}
    assert any(m["dynamic_sampling/zero_variance_fraction"] > 0 for m in stats["per_step"])


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_dynamic_sampling_bounds_the_refills_when_no_group_has_signal(tmp_path):
    """Every group earns the same reward (an untrained policy that always gets 0): each step drops
    max_refills x P groups, then trains on what it has and says so; it never loops forever."""
    cfg = _cfg(1, 2, 2, 3, True, "rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_refills=1")
    sched, trained, _ = asyncio.run(_drive(cfg, tmp_path, steps=3, seed=0, const=1.0))
    assert [len({t.group_id for t in trajs}) for _, trajs in trained] == [2, 2, 2]
    c = sched.metrics()
    assert c["groups/zero_variance"] == 3 * 2  # max_refills x P per step
    assert c["dynamic_sampling/refills_exhausted"] == 1.0 and c["dynamic_sampling/zero_variance_fraction"] == 1.0
    rows = TrajectoryStore(tmp_path, readonly=True).summary()
    assert sum(r["status"] == "zero_variance" for r in rows) == 3 * 2 * 2


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_without_dynamic_sampling_zero_variance_groups_are_trained(tmp_path):
    sched, trained, _ = asyncio.run(_drive(_cfg(1), tmp_path, steps=2, seed=0, const=1.0))
    assert all(v == 0 for _, trajs in trained for v in _variance(trajs).values())
    assert "groups/zero_variance" not in sched.metrics()
