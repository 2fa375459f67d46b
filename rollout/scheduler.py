"""The scheduler: which episodes run, where, and which finished groups a training step may take.

Episode specs. Group g of a run is `group_size` episodes of one task: its env, kwargs and seed
depend only on (learner.seed, g), and its episode ids are `<run>-g<g>-s<k>`, so a resumed or
repeated run issues the same episodes under the same ids.

Admission (the lag invariant). Step s trains policy version s (k3rl.metrics), and every token it
trains must come from version s - max_policy_lag or newer. A group issued while the engines
serve version v samples tokens of version >= v, so it must be trained by step v + lag. With the
engines at version v and the next batch to take for step `next_step`, at most

    (v + 1 + lag - next_step) * P      groups may be open (issued, not yet trained or dropped)

that is (1 + lag) P while waiting for step v's batch, lag P between taking it and pushing v + 1.
lag 0 is the synchronous algorithm: a step's episodes start only on that step's weights.
Admission keeps the invariant from biting; `next_batch` enforces it: a finished group with a
token older than s - lag is dropped as stale and a fresh group is issued in its place
(`groups/reissued`).

Stragglers (`rollout.stragglers`). A group issued at version v can train at steps up to v + lag.
Step s's "due" groups are the open ones that may hold a token of version s - lag (a finished
member's oldest, the version a running one started at): after step s they would be stale. They
were issued at v <= s - lag, and admission leaves at most P such: (1 + lag) P opened by the time
the engines served s - lag, lag P of those trained by steps s - lag .. s - 1. With `wait` (the default) step s waits for its
due groups and fills the rest of its P with the lowest-index finished others, so no group goes
stale for being slow: an env whose long episodes finish after its short ones trains on both, as
often as it issues them (dropping them biases the policy against long episodes, which are often
the hard tasks). `groups/waited_for` counts the due groups a step waited for while P others had
finished. With `drop` a step takes the P lowest-index finished groups at once and a due straggler
is dropped as stale when it ends.

Failures. An episode that fails is stored with its error and never trained; a group trains on
its members that did not fail, and a group whose members all failed is replaced by a fresh
group. An episode not delivered by its deadline (`episode_deadline_s`), or whose worker died
`max_attempts` times, is recorded as failed ("lost"). When `2 P` groups in a row fail whole,
the job stops with their errors: the environment, not the learner, is what is broken.

Dynamic sampling (DAPO's; `rollout.dynamic_sampling`). A finished group whose trainable members all
earned the same reward has zero GRPO advantage everywhere: it teaches nothing. `next_batch` drops
it (stored as `zero_variance`, counted in `groups/zero_variance`) and admission issues a fresh
group in its place, under the same lag bound. At most `dynamic_sampling_max_refills * P` groups
are dropped so per step; past that (a policy that earns the same reward everywhere, e.g. 0 before
it has learned anything) the step trains on the groups it has, and
`dynamic_sampling/refills_exhausted` says so.

Held-out evaluation (`envs.eval`, `heldout_groups`). Task t of eval spec `name` has the seed
EVAL_SEED_BASE + randrange(2**31) of random.Random(f"eval:{name}:{t}"): in [2**31, 2**32), while
training's (and the SFT demonstrations') seeds are randrange(2**31) < 2**31, so no eval seed is
ever a training seed, by construction. The set does not depend on the job's seed, so runs are
evaluated on the same tasks. Each task is a group: one greedy episode (temperature 0, a per-episode
sampling override), then n sampled at the job's temperature. Evaluation episodes run apart from
admission (`run_apart`): they never count toward the lag bound, the failure streak or
`episodes/failed`, and are stored as `eval`, never trained.

Supervision. A worker runs at most `rollout.episodes_per_worker` episodes at once; a dead worker
is replaced and its episodes are re-run under the same ids (the buffer keeps the first copy).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from dataclasses import dataclass, field
from typing import Any

import ray

from k3rl.config import EvalSpec, JobConfig
from k3rl.metrics import trainable
from k3rl.rollout.buffer import BufferDiedError

WORKER_START_S, BUFFER_S = 600.0, 300.0  # a rollout worker's start-up; one call to the buffer actor
EVAL_SEED_BASE = 2**31  # eval seeds are EVAL_SEED_BASE + randrange(2**31); training's are randrange(2**31)


class EpisodesFailingError(RuntimeError):
    """Every episode of many groups in a row failed: the message lists their errors."""


def episode_specs(cfg: JobConfig, run_name: str, index: int, version: int, *, apart: bool = False) -> list[dict[str, Any]]:
    """The group_size specs of group `index`. Ids, env and seed depend only on the index. `apart`: a group
    of the starting policy's measurement (learner.eval_before_training), drawn from a stream of its own
    with a seed in the held-out range, so it shares no task seed (and so no sampling seed) with training."""
    rng = random.Random(f"{cfg.learner.seed}:{'start:' if apart else ''}{index}")
    env = cfg.envs.env_of_group(index, rng)
    seed = rng.randrange(2**31) + (EVAL_SEED_BASE if apart else 0)
    gid = f"{run_name}-g{index:07d}"
    return [{"id": f"{gid}-s{k}", "env_id": env.id, "seed": seed, "group_id": gid, "env_kwargs": dict(env.kwargs),
             "issued_version": version} for k in range(cfg.rollout.group_size)]


def eval_seed(name: str, task: int) -> int:
    """The seed of held-out task `task` of the eval spec named `name` (apart from every training seed)."""
    return EVAL_SEED_BASE + random.Random(f"eval:{name}:{task}").randrange(2**31)


def heldout_groups(cfg: JobConfig, run_name: str, step: int, version: int) -> list[tuple[EvalSpec, list[Group]]]:
    """The groups of the held-out evaluation logged at `step`, one per task of each `envs.eval` spec:
    member 0 greedy, then n sampled. Ids `<run>-eval<step>-<name>-t<task>-greedy|-s<j>`."""
    plan = []
    for e in cfg.envs.eval:
        _, n = cfg.envs.eval_sizes(e)
        groups = []
        for t in range(e.num_tasks):
            gid = f"{run_name}-eval{step:06d}-{e.metric_name}-t{t:04d}"
            base = {"env_id": e.id, "seed": eval_seed(e.metric_name, t), "group_id": gid,
                    "env_kwargs": dict(e.kwargs), "issued_version": version}
            specs = [{**base, "id": f"{gid}-greedy", "sampling": {"temperature": 0.0}},
                     *({**base, "id": f"{gid}-s{j}"} for j in range(n))]
            groups.append(Group(t, specs, version))
        plan.append((e, groups))
    return plan


@dataclass
class Group:
    index: int
    specs: list[dict[str, Any]]
    version: int  # what the engines served when it was issued
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # episode id -> stats
    started: dict[str, int] = field(default_factory=dict)  # episode id -> the version served when it last started

    @property
    def id(self) -> str:
        return self.specs[0]["group_id"]

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.specs)

    def min_version(self) -> int | None:
        vs = [s["min_version"] for s in self.results.values() if trainable(s)]
        return min(vs) if vs else None

    def max_version(self) -> int | None:
        vs = [s["max_version"] for s in self.results.values() if trainable(s)]
        return max(vs) if vs else None

    def oldest_possible(self, serving: int) -> int | None:
        """A lower bound on the oldest version of the tokens it will train: a finished member's own, a running
        one's version at its start, `serving` for one not started (None: every member failed)."""
        vs = []
        for spec in self.specs:
            stats = self.results.get(spec["id"])
            if stats is None:
                vs.append(self.started.get(spec["id"], serving))
            elif trainable(stats):
                vs.append(stats["min_version"])
        return min(vs) if vs else None

    def zero_variance(self) -> bool:
        """Every trainable member earned the same reward: no GRPO signal."""
        rewards = [s["reward"] for s in self.results.values() if trainable(s)]
        return bool(rewards) and max(rewards) - min(rewards) <= 1e-9

    def ordered_results(self) -> list[dict[str, Any]]:
        """The members' stats in the order of `specs`."""
        return [self.results[spec["id"]] for spec in self.specs]


class Scheduler:
    """Issues groups under the lag bound, runs their episodes on the rollout workers, and hands
    the driver batches of finished groups that the lag invariant allows."""

    def __init__(self, cfg: JobConfig, run_name: str, make_worker, buffer, *, first_step: int = 1, next_index: int = 0,
                 reopen: list[int] = (), max_attempts: int = 5, episode_deadline_s: float | None = None) -> None:
        r = cfg.rollout
        self.cfg, self.run_name, self.buffer = cfg, run_name, buffer
        self.P, self.lag, self.per_worker = r.prompts_per_step, r.max_policy_lag, r.episodes_per_worker
        self.partial_rollouts, self.wait_for_due = r.partial_rollouts, r.stragglers == "wait"
        self.dynamic_sampling, self.max_refills = r.dynamic_sampling, r.dynamic_sampling_max_refills * r.prompts_per_step
        self.batch_metrics: dict[str, float] = {}  # of the last batch handed out
        self.deadline_s = episode_deadline_s or 1.5 * cfg.envs.episode_time_budget_s + 60.0
        self.max_attempts = max_attempts
        self.make_worker = make_worker
        self.workers = [make_worker(i) for i in range(r.num_rollout_workers)]
        self.running = [0] * len(self.workers)
        self.slot_freed = asyncio.Event()
        self.changed = asyncio.Event()  # set whenever an episode finishes
        self.open: dict[str, Group] = {}  # issued, not yet trained or dropped
        self.next_index = next_index
        self.reopen = collections.deque(reopen)  # groups open at the checkpoint we resumed from
        self.serving = 0  # the version the engines serve
        self.next_step = first_step  # the step whose batch has not been taken yet
        self.tasks: set[asyncio.Task] = set()
        self.pings: dict[Any, asyncio.Future] = {}  # worker -> its first answer
        self.failed_streak: list[str] = []  # errors of the groups failed whole since the last good one
        self.counts = collections.Counter()
        self.fatal: BufferDiedError | None = None  # raised by the waiting driver: the job cannot go on

    # -- admission -----------------------------------------------------------------------------
    def set_serving(self, version: int, admit: bool = True) -> None:
        """The engines serve `version` now; open what admission allows (unless `admit` is False: the
        last step's weights, pushed only for their evaluation)."""
        self.serving = version
        if admit:
            self.issue()

    def issue(self) -> None:
        """Open groups until the lag bound: (serving + 1 + lag - next_step) * P."""
        bound = (self.serving + 1 + self.lag - self.next_step) * self.P
        while len(self.open) < bound:
            index = self.reopen.popleft() if self.reopen else self._new_index()
            group = Group(index, episode_specs(self.cfg, self.run_name, index, self.serving), self.serving)
            self.open[group.id] = group
            self.counts["groups/issued"] += 1
            for spec in group.specs:
                self.counts["episodes/issued"] += 1
                self._spawn(self._run(group, spec))

    def _new_index(self) -> int:
        self.next_index += 1
        return self.next_index - 1

    def put_back(self, batch: list[Group]) -> None:
        """A batch handed out but not trained (a stop came with it): open again, so that the checkpoint
        records its groups and a resume re-issues them (its episodes are stored as unused, then rolled back)."""
        self.open.update((g.id, g) for g in batch)

    def open_indices(self) -> list[int]:
        """What a checkpoint records: re-issued, under the same ids, by a resumed job."""
        return sorted(g.index for g in self.open.values())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- supervision ---------------------------------------------------------------------------
    async def _run(self, group: Group, spec: dict[str, Any], counted: bool = True) -> None:
        try:
            await self._run_episode(group, spec, counted)
        except BufferDiedError as e:  # nothing can be stored: the waiting driver raises it (next_batch, run_apart)
            cause = getattr(e, "cause", e)  # a rollout worker's task error carries the worker's BufferDiedError
            self.fatal = self.fatal or (cause if isinstance(cause, BufferDiedError) else BufferDiedError(str(e)))
            self.changed.set()

    async def _run_episode(self, group: Group, spec: dict[str, Any], counted: bool) -> None:
        errors: list[str] = []
        stats = None
        while stats is None:
            i = await self._acquire_slot()
            try:
                worker = self.workers[i]
                try:
                    await asyncio.shield(self._started(worker))  # a worker's start-up is not the episode's time
                except Exception as e:  # noqa: BLE001 - it died or hung while starting: replace it
                    errors.append(f"worker {i} did not start ({type(e).__name__})")
                    self._replace(i, worker)
                else:
                    group.started[spec["id"]] = self.serving  # its tokens are of this version or newer
                    ref = worker.run_episode.remote(spec)
                    try:
                        stats = await asyncio.wait_for(ref, self.deadline_s)
                    except BufferDiedError:  # the worker is fine; the buffer it put the episode into is not
                        raise
                    except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                        errors.append(f"worker {i} died ({type(e).__name__})")
                        self._replace(i, worker)
                    except TimeoutError:
                        ray.cancel(ref)
                        stats = await self._lost(spec, f"episode lost: no result within its deadline of {self.deadline_s:.0f}s "
                                                       f"(worker {i}; envs.episode_time_budget_s={self.cfg.envs.episode_time_budget_s})")
                    except Exception as e:  # noqa: BLE001 - anything else is this episode's failure, not the job's
                        stats = await self._lost(spec, f"episode lost: {type(e).__name__}: {str(e)[:300]}")
                if stats is None and len(errors) >= self.max_attempts:
                    stats = await self._lost(spec, f"episode lost: {len(errors)} attempts on workers that died ({errors[-1]})")
            finally:
                self._release_slot(i)
        self.counts["episodes/failed"] += counted and bool(stats.get("error"))  # evaluation is not training
        group.results[spec["id"]] = stats
        self.changed.set()

    def _replace(self, i: int, worker) -> None:
        if self.workers[i] is worker:  # the first to notice replaces it, and ends it (with its warm sandboxes)
            self.workers[i] = self.make_worker(i)
            self.counts["workers/restarts"] += 1
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)

    def _started(self, worker) -> asyncio.Future:
        if worker not in self.pings:
            self.pings[worker] = asyncio.ensure_future(asyncio.wait_for(worker.ping.remote(), WORKER_START_S))
        return self.pings[worker]

    async def _lost(self, spec: dict[str, Any], error: str) -> dict[str, Any]:
        self.counts["episodes/lost"] += 1
        try:
            return await asyncio.wait_for(self.buffer.put_lost.remote(spec, error), BUFFER_S)
        except ray.exceptions.RayActorError as e:
            raise BufferDiedError(f"the trajectory buffer died ({type(e).__name__}) while storing a lost episode; "
                                  f"resume the job (k3rl train ... --resume) from its last checkpoint") from None

    async def _acquire_slot(self) -> int:
        while min(self.running) >= self.per_worker:
            self.slot_freed.clear()
            await self.slot_freed.wait()
        i = min(range(len(self.running)), key=self.running.__getitem__)
        self.running[i] += 1
        return i

    def _release_slot(self, i: int) -> None:
        self.running[i] -= 1
        self.slot_freed.set()

    # -- batches -------------------------------------------------------------------------------
    def _fresh(self, group: Group, step: int) -> bool:
        lo, hi = group.min_version(), group.max_version()
        if lo is None:
            return False
        return lo >= step - self.lag and (self.partial_rollouts or lo == hi)

    def _due(self, step: int) -> list[Group]:
        """Under `stragglers: wait`, the open groups step `step` must train: a token of theirs may be of version
        step - lag (after this step: stale), the P lowest-index of them (admission leaves no more than P)."""
        if not self.wait_for_due:
            return []
        due = [g for g in self.open.values() if (v := g.oldest_possible(self.serving)) is not None and v <= step - self.lag]
        return sorted(due, key=lambda g: g.index)[: self.P]

    def _no_signal(self, group: Group, refills: int) -> bool:
        """Dynamic sampling drops this group (zero reward variance) while the step's refills last."""
        return self.dynamic_sampling and refills < self.max_refills and group.zero_variance()

    async def next_batch(self, step: int, stall_timeout_s: float | None = None) -> list[Group]:
        """P finished groups whose every trainable token is at most `lag` versions older than step
        `step`'s policy; stale, failed-whole and (dynamic sampling) zero-variance groups are dropped and
        replaced on the way."""
        stall_timeout_s = stall_timeout_s or self.deadline_s + 60.0
        refills = 0  # groups dropped for zero variance at this step
        waited: set[str] = set()  # due groups this step waited for while P others had finished
        while True:
            if self.fatal:
                raise self.fatal
            dropped: dict[str, list[Group]] = {"stale": [], "zero_variance": []}  # status in the store -> groups
            for g in sorted((g for g in self.open.values() if g.done), key=lambda g: g.index):
                if g.min_version() is None:  # every member failed (each is stored as failed)
                    dropped["stale"].append(g)
                    self.counts["groups/failed"] += 1
                    self.failed_streak.append("; ".join(sorted({s["error"] or "no sampled tokens" for s in g.results.values()})))
                elif not self._fresh(g, step):
                    dropped["stale"].append(g)
                    self.counts["groups/stale"] += 1
                    self.counts["episodes/stale"] += sum(trainable(s) for s in g.results.values())
                elif self._no_signal(g, refills):
                    dropped["zero_variance"].append(g)
                    refills += 1
                    self.counts["groups/zero_variance"] += 1
            for status, groups in dropped.items():
                if groups:
                    await asyncio.wait_for(self.buffer.drop.remote([g.id for g in groups], step, status), BUFFER_S)
                    for g in groups:
                        del self.open[g.id]
                    self.counts["groups/reissued"] += len(groups)
            if any(dropped.values()):
                self.issue()
            if len(self.failed_streak) >= 2 * self.P:
                common = collections.Counter(self.failed_streak).most_common(5)
                raise EpisodesFailingError(
                    f"{len(self.failed_streak)} groups in a row failed in every episode; the errors:\n  "
                    + "\n  ".join(f"{n}x {e}" for e, n in common)
                    + "\nfix the environment (try `k3rl envs check ENV_ID`) or the sandbox (`k3rl sandbox doctor`)")
            # groups that finished while the drop was awaited are judged on the next pass
            ready = sorted((g for g in self.open.values() if g.done and self._fresh(g, step) and not self._no_signal(g, refills)),
                           key=lambda g: g.index)
            due = self._due(step)
            running_due = [g for g in due if not g.done]
            if len(ready) >= self.P and running_due:  # P have finished, but a due straggler has not: wait for it
                waited.update(g.id for g in running_due)
            elif len(ready) >= self.P:
                taken = {g.id for g in due}  # due and finished: trained now, whatever its index
                batch = [g for g in ready if g.id in taken]
                batch += [g for g in ready if g.id not in taken][: self.P - len(batch)]
                self.counts["groups/waited_for"] += len(waited & taken)
                for g in batch:
                    del self.open[g.id]
                if self.dynamic_sampling:
                    kept = sum(g.zero_variance() for g in batch)
                    self.batch_metrics = {"dynamic_sampling/zero_variance_fraction": (refills + kept) / (refills + self.P),
                                          "dynamic_sampling/refills_exhausted": float(kept > 0)}
                self.failed_streak.clear()
                self.next_step = step + 1
                self.issue()
                return batch
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), stall_timeout_s)
            except TimeoutError:
                raise TimeoutError(
                    f"no episode finished in {stall_timeout_s:.0f}s while waiting for {self.P} groups for step {step} "
                    f"({len(ready)} ready, {sum(not g.done for g in self.open.values())} in flight, "
                    f"{sum(self.running)} episodes running on {len(self.workers)} workers)") from None

    async def evaluate(self, num_groups: int, version: int, step: int = 0) -> list[dict[str, Any]]:
        """Run `num_groups` training-like groups apart from admission (ids `<run>-eval-g...`), stored as
        `eval` at `step`; returns their stats (the untrained policy's reward, learner.eval_before_training).
        Their tasks are their own (`apart`): training's first groups would replay the same episodes, and
        the curve's step 0 would repeat step 1's reward."""
        groups = [Group(g, episode_specs(self.cfg, f"{self.run_name}-eval", g, version, apart=True), version)
                  for g in range(num_groups)]
        await self.run_apart(groups, step)
        return [s for g in groups for s in g.results.values()]

    async def run_apart(self, groups: list[Group], step: int, stall_timeout_s: float | None = None) -> None:
        """Run these groups' episodes outside the admission bound, wait for all of them and store them as
        `eval` at `step` (never trained). Their results are in `group.results`. The caller keeps the
        engines' version fixed while this runs (the driver pushes no weights meanwhile)."""
        stall_timeout_s = stall_timeout_s or self.deadline_s + 60.0
        for group in groups:
            for spec in group.specs:
                self._spawn(self._run(group, spec, counted=False))
        while not all(g.done for g in groups):
            if self.fatal:
                raise self.fatal
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), stall_timeout_s)
            except TimeoutError:
                raise TimeoutError(f"no episode finished in {stall_timeout_s:.0f}s while waiting for "
                                   f"{sum(not g.done for g in groups)} evaluation groups") from None
        await asyncio.wait_for(self.buffer.drop.remote([g.id for g in groups], step, "eval"), BUFFER_S)

    # -- the end ---------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The running counts, and the dynamic-sampling figures of the last batch."""
        return {**{k: float(v) for k, v in self.counts.items()}, **self.batch_metrics}

    async def stop(self) -> None:
        """Cancel every episode in flight (their results are not waited for)."""
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
