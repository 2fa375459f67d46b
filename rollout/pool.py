"""InferencePool: N inference workers (Ray actors, one engine each) behind one async handle.

Routing, per request:
  * sticky: a request with a `key` (an episode id) goes to the worker that served the last
    request with that key, which holds its prefix in its prefix cache; a new episode with a
    `group_key` (its GRPO group) goes where its group went, so the group's prompt is
    prefilled once and forked;
  * otherwise least-loaded: the worker with the fewest requests in flight from this pool
    (ties broken round-robin).

Failures: a call that fails because its worker died (`ray.exceptions.RayActorError`) starts a
restart of that worker slot and the request is **retried from scratch** on another live
worker (same token ids, same sampling params and seed, so a seeded request gives the same
tokens; tokens the dead worker had produced are discarded, none are returned twice). A
restarted worker is built from the same `EngineSpec` and is replayed the latest weights
before it takes requests. `check_health()` pings every worker and restarts the ones that do
not answer; `start_health_checks(interval)` runs it periodically.

Weights: `update_weights(update)` puts the update into Ray's object store once
(`weight_sync.publish`) and every worker applies it between two scheduler steps; the call
returns when all have switched. The pool remembers the latest full update (and the partial
ones after it) to bring restarted workers up to date. The other transports: an `IpcShare`
(CUDA IPC, colocated) goes to `update_weights` too; for NCCL, `join_collective` once, then
`receive_collective_update()` while the learner calls `CollectiveWeightSync.send(update)`.

One InferencePool object routes for the process that holds it. To share one routing view
between many rollout workers, run it as a Ray actor: `PoolActor.remote(...)` exposes the same
async methods.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from k3rl.types import SamplingParams, WeightUpdate

from .engine import EngineLoad, GenerationResult, InferenceEngine
from .weight_sync import CollectiveWeightSync, IpcShare, PublishedUpdate, publish_here, receive


@dataclass
class EngineSpec:
    """Everything a worker needs to build its engine (picklable, so restarts rebuild the same)."""

    kind: Literal["embedded", "vllm"] = "embedded"
    preset: str = "k3-tiny"
    overrides: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None  # HF-layout directory (required for vLLM)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    torch_threads: int | None = 1  # CPU engines: 1 thread each is fastest for small models
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, name: str = "engine") -> InferenceEngine:
        import torch

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if self.kind == "embedded":
            from .engine import EmbeddedEngine

            return EmbeddedEngine.from_preset(self.preset, device=self.device, dtype=self.dtype, seed=self.seed,
                                              checkpoint=self.checkpoint, overrides=self.overrides or None,
                                              name=name, **self.engine_kwargs)
        if self.kind == "vllm":
            from .vllm_adapter import VLLMEngine

            if not self.checkpoint:
                raise ValueError("a vLLM worker serves an HF-layout checkpoint: set EngineSpec.checkpoint")
            return VLLMEngine(self.checkpoint, dtype=self.dtype, seed=self.seed, name=name, **self.engine_kwargs)
        raise ValueError(f"unknown engine kind {self.kind!r}; use 'embedded' or 'vllm'")


class EngineWorker:
    """The Ray actor around one engine (async: many requests share it)."""

    def __init__(self, spec: EngineSpec, name: str):
        self.name = name
        self.device = spec.device
        self.engine = spec.build(name)
        self.collective = None

    async def generate(self, token_ids, sampling, images, request_id) -> GenerationResult:
        result = await self.engine.agenerate(token_ids, sampling, images, request_id)
        result.worker = self.name
        return result

    async def update_weights(self, update) -> int:
        """Apply a PackedUpdate (object store), an IpcShare (CUDA IPC) or a WeightUpdate."""
        if getattr(update, "version", None) is not None and update.version <= self.engine.version:
            return self.engine.version  # a replay the worker already has
        return await self.engine.aupdate_weights(await asyncio.to_thread(receive, update))

    async def join_collective(self, host: str, port: int, rank: int, world_size: int, backend: str) -> int:
        """Become `rank` of a weight-sync process group whose rank 0 is the learner."""
        device = self.device if backend == "nccl" else "cpu"
        self.collective = await asyncio.to_thread(CollectiveWeightSync, rank, world_size, host, port, backend, device)
        return rank

    async def update_weights_collective(self) -> int:
        """Receive the update the learner broadcasts now (CollectiveWeightSync.send) and switch."""
        if getattr(self, "collective", None) is None:
            raise RuntimeError(f"{self.name} has not joined a weight-sync group (InferencePool.join_collective)")
        update = await asyncio.to_thread(self.collective.recv)
        if update.version <= self.engine.version:
            return self.engine.version
        return await self.engine.aupdate_weights(update)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def ping(self) -> dict:
        load = self.engine.load()
        return {"name": self.name, "pid": os.getpid(), "version": self.engine.version, "running": load.running,
                "waiting": load.waiting}

    def load(self) -> EngineLoad:
        return self.engine.load()


_RemoteWorker = ray.remote(EngineWorker)


class InferencePool:
    def __init__(self, num_workers: int, spec: EngineSpec | None = None, *, max_retries: int = 3,
                 actor_options: dict[str, Any] | None = None, sticky_keys: int = 100_000, name: str | None = None):
        if num_workers < 1:
            raise ValueError(f"an inference pool needs at least one worker, got num_workers={num_workers}")
        if not ray.is_initialized():
            raise RuntimeError("InferencePool needs Ray: call ray.init() (or run inside a Ray job) first")
        self.spec = spec or EngineSpec()
        self.max_retries = max_retries
        self.name = name or f"k3rl-pool-{uuid.uuid4().hex[:6]}"
        default_options = {"num_cpus": 1, "max_concurrency": 1000}
        if self.spec.device.startswith("cuda"):
            default_options["num_gpus"] = 1
        self.actor_options = {**default_options, **(actor_options or {})}
        self._generation = [0] * num_workers
        self._workers = [self._spawn(i) for i in range(num_workers)]
        self._inflight = [0] * num_workers
        self._restarting: dict[int, asyncio.Task] = {}
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._sticky_cap = sticky_keys
        self._where: dict[str, int] = {}
        self._rr = itertools.count()
        self._weights: list = []  # object refs: the latest full update and the partial ones after it
        # engines start at engine_kwargs["version"] (default 0); start them at -1 to push the
        # learner's initial weights as version 0
        self._version = int(self.spec.engine_kwargs.get("version", 0))
        self._slot_version = [self._version] * num_workers  # the weights each slot's worker runs
        self._collective_generation: list[int] | None = None
        self._health_task: asyncio.Task | None = None
        self.restarts = 0
        self.retries = 0

    # ----- workers ---------------------------------------------------------------------------------
    def _spawn(self, slot: int):
        name = f"{self.name}-w{slot}-g{self._generation[slot]}"
        return _RemoteWorker.options(**self.actor_options).remote(self.spec, name)

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def version(self) -> int:
        return self._version

    @property
    def workers(self) -> list:
        return list(self._workers)

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until every worker has built its engine."""
        await asyncio.wait_for(asyncio.gather(*(w.ping.remote() for w in self._workers)), timeout_s)

    def _restart(self, slot: int, dead) -> asyncio.Task:
        task = self._restarting.get(slot)
        if task is None or task.done():
            if self._workers[slot] is not dead:  # somebody already replaced it
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(None)
                return fut
            task = asyncio.create_task(self._do_restart(slot, dead))
            self._restarting[slot] = task
        return task

    async def _do_restart(self, slot: int, dead) -> None:
        try:
            try:
                ray.kill(dead, no_restart=True)  # it may be half-alive (unresponsive): make sure it is gone
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
            self._generation[slot] += 1
            fresh = self._spawn(slot)
            await fresh.ping.remote()
            for ref in self._weights:  # bring it to the pool's version before it takes requests
                await fresh.update_weights.remote(ref)
            self._slot_version[slot] = (await fresh.ping.remote())["version"]
            self._workers[slot] = fresh
            self.restarts += 1
        finally:
            self._restarting.pop(slot, None)

    def _pick(self, keys: tuple[str | None, ...], exclude: set[int]) -> int | None:
        alive = [i for i in range(self.num_workers) if i not in self._restarting and i not in exclude]
        if not alive:
            return None
        current = [i for i in alive if self._slot_version[i] == self._version]
        alive = current or alive  # a worker behind (restarted after an IPC/NCCL update) only as a last resort
        for key in keys:  # the episode's worker, else the worker of its prompt group
            if key is not None and self._sticky.get(key) in alive:
                self._sticky.move_to_end(key)
                return self._sticky[key]
        least = min(self._inflight[i] for i in alive)
        candidates = [i for i in alive if self._inflight[i] == least]
        return candidates[next(self._rr) % len(candidates)]

    # ----- requests ----------------------------------------------------------------------------------
    async def generate(self, token_ids: list[int], sampling: SamplingParams | None = None, images: list | None = None,
                       *, key: str | None = None, group_key: str | None = None,
                       request_id: str | None = None) -> GenerationResult:
        """Generate on one worker. `key` (an episode id) pins later requests of the episode to the
        worker holding its prefix; `group_key` (a GRPO group id) sends the first request of every
        episode of a group to the same worker, so the group's shared prompt is prefilled once."""
        sampling = sampling or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        failures: list[str] = []
        exclude: set[int] = set()
        while True:
            slot = self._pick((key, group_key), exclude)
            if slot is None:  # every worker is restarting or failed this request: wait for a restart
                if self._restarting:
                    await asyncio.wait(list(self._restarting.values()), return_when=asyncio.FIRST_COMPLETED)
                exclude.clear()
                continue
            self._remember_route((key, group_key), slot)  # at routing time: concurrent group members follow
            worker = self._workers[slot]
            self._inflight[slot] += 1
            self._where[request_id] = slot
            try:
                result = await worker.generate.remote(token_ids, sampling, images, request_id)
            except RayActorError as e:
                failures.append(f"worker {slot}: {type(e).__name__}")
                self._restart(slot, worker)
                exclude.add(slot)
                self.retries += 1
                if len(failures) > self.max_retries:
                    raise RuntimeError(f"request {request_id} failed on {len(failures)} workers ({failures}); "
                                       f"raise max_retries or check the workers' logs") from e
                continue
            finally:
                self._inflight[slot] -= 1
                self._where.pop(request_id, None)
            return result

    def _remember_route(self, keys: tuple[str | None, ...], slot: int) -> None:
        for k in keys:
            if k is not None:
                self._sticky[k] = slot
                self._sticky.move_to_end(k)
        while len(self._sticky) > self._sticky_cap:
            self._sticky.popitem(last=False)

    async def abort(self, request_id: str) -> bool:
        slot = self._where.get(request_id)
        if slot is None:
            return False
        try:
            return await self._workers[slot].abort.remote(request_id)
        except RayActorError:
            return False

    # ----- weights -------------------------------------------------------------------------------------
    async def update_weights(self, update: WeightUpdate | PublishedUpdate | IpcShare) -> int:
        """Apply `update` on every worker; returns the version all of them now run.

        A WeightUpdate goes through the object store (published once, replayed to restarted
        workers); a PublishedUpdate is one already there (put by the learner itself, so the
        weights never pass through the driver or this actor). An IpcShare
        (`weight_sync.share_cuda_ipc`, workers on the learner's GPU host) is passed by handle; a
        worker restarted after it stays behind, and out of routing, until the next object-store
        update."""
        if not isinstance(update, (WeightUpdate, PublishedUpdate, IpcShare)):
            raise TypeError(f"update_weights takes a WeightUpdate, PublishedUpdate or IpcShare, got {type(update).__name__}")
        if update.version <= self._version:
            raise ValueError(f"weight update v{update.version} is not newer than the pool's v{self._version}")
        if isinstance(update, WeightUpdate):
            update = publish_here(update)
        if isinstance(update, PublishedUpdate):
            ref = update.ref
            self._weights = [ref] if update.full else [*self._weights, ref]
        else:  # IpcShare: handles, passed as they are
            ref = update
        self._version = update.version
        for task in list(self._restarting.values()):  # a restart in progress replays the new list too
            await asyncio.wait([task])

        async def one(slot: int) -> int | None:
            worker = self._workers[slot]
            try:
                self._slot_version[slot] = await worker.update_weights.remote(ref)
                return self._slot_version[slot]
            except RayActorError:
                await self._restart(slot, worker)  # the restart replays the object-store updates
                return None

        versions = [v for v in await asyncio.gather(*(one(i) for i in range(self.num_workers))) if v is not None]
        if any(v != update.version for v in versions):
            raise RuntimeError(f"workers report versions {versions} after the update to v{update.version}")
        return update.version

    async def join_collective(self, host: str, port: int, backend: str = "nccl") -> None:
        """Make the workers ranks 1..N of a weight-sync group whose rank 0 is the learner.

        The learner constructs `CollectiveWeightSync(0, N + 1, host, port, backend)` while this
        runs (both sides block until every rank has joined)."""
        world = self.num_workers + 1
        await asyncio.gather(*(w.join_collective.remote(host, port, i + 1, world, backend)
                               for i, w in enumerate(self._workers)))
        self._collective_generation = list(self._generation)

    def collective_intact(self) -> bool:
        """Whether a weight-sync group exists and holds every current worker (no restart since)."""
        return self._collective_generation is not None and self._collective_generation == self._generation

    def drop_collective(self) -> None:
        """Forget the weight-sync group (after a failed broadcast): the next one needs a new group."""
        self._collective_generation = None

    async def receive_collective_update(self) -> int:
        """Every worker receives the update the learner broadcasts now (`CollectiveWeightSync.send`)
        and switches; returns the new version. A restarted worker is not in the group: after a
        restart, call `join_collective` again (new port) with a new learner side."""
        if self._collective_generation is None:
            raise RuntimeError("no weight-sync group: call join_collective first")
        if self._collective_generation != self._generation:
            raise RuntimeError("a worker was restarted since join_collective, so the group is incomplete; "
                               "call join_collective again (new port) and rebuild the learner's CollectiveWeightSync")
        versions = await asyncio.gather(*(w.update_weights_collective.remote() for w in self._workers))
        if len(set(versions)) != 1:
            raise RuntimeError(f"workers report different versions after a collective update: {versions}")
        self._slot_version = list(versions)
        self._version = versions[0]
        return self._version

    # ----- health --------------------------------------------------------------------------------------
    async def check_health(self, timeout_s: float = 30.0) -> list[dict]:
        """Ping every worker; restart the dead or unresponsive ones. Returns one status per slot.

        Restarts already in progress are awaited first, so the report is about the workers that
        serve from now on."""
        if self._restarting:
            await asyncio.wait(list(self._restarting.values()))

        async def one(slot: int) -> dict:
            worker = self._workers[slot]
            try:
                info = await asyncio.wait_for(worker.ping.remote(), timeout_s)
                return {"slot": slot, "alive": True, **info}
            except (TimeoutError, RayActorError, GetTimeoutError) as e:
                await self._restart(slot, worker)
                return {"slot": slot, "alive": False, "restarted": True, "error": type(e).__name__}

        return list(await asyncio.gather(*(one(i) for i in range(self.num_workers))))

    def start_health_checks(self, interval_s: float = 10.0) -> asyncio.Task:
        async def loop():
            while True:
                await asyncio.sleep(interval_s)
                await self.check_health()

        self._health_task = asyncio.create_task(loop())
        return self._health_task

    async def loads(self) -> list[EngineLoad]:
        return list(await asyncio.gather(*(w.load.remote() for w in self._workers)))

    def shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for w in self._workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


@ray.remote(num_cpus=0)  # it only routes: it must not take a CPU slot the engines need
class PoolActor:
    """An InferencePool as a Ray actor: one routing view shared by many rollout workers."""

    def __init__(self, num_workers: int, spec: EngineSpec | None = None, **kw):
        self.pool = InferencePool(num_workers, spec, **kw)

    async def generate(self, token_ids, sampling=None, images=None, key=None, group_key=None,
                       request_id=None) -> GenerationResult:
        return await self.pool.generate(token_ids, sampling, images, key=key, group_key=group_key,
                                        request_id=request_id)

    async def update_weights(self, update) -> int:
        return await self.pool.update_weights(update)

    async def join_collective(self, host: str, port: int, backend: str = "nccl") -> None:
        await self.pool.join_collective(host, port, backend)

    async def receive_collective_update(self) -> int:
        return await self.pool.receive_collective_update()

    def collective_intact(self) -> bool:
        return self.pool.collective_intact()

    def drop_collective(self) -> None:
        self.pool.drop_collective()

    def worker_handles(self) -> list:
        return self.pool.workers

    async def abort(self, request_id: str) -> bool:
        return await self.pool.abort(request_id)

    async def check_health(self) -> list[dict]:
        return await self.pool.check_health()

    async def wait_ready(self) -> None:
        await self.pool.wait_ready()

    def version(self) -> int:
        return self.pool.version

    def shutdown(self) -> None:
        self.pool.shutdown()
