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

Weights: `update_weights(message)` hands every worker the same small message of a weight
transport (`rollout/transport/`: a `PublishedUpdate` reference, an `IpcShare`, a `Broadcast`
group address); each worker runs the transport's receive half and switches its engine between
two scheduler steps; the call returns the version each worker then runs. A plain WeightUpdate
is published to the object store first. The pool remembers the latest full object-store update
(and the partial ones after it) and replays them to a restarted worker before it takes requests;
a worker behind the pool's version is routed to only when no up-to-date worker is alive.

One InferencePool object routes for the process that holds it. To share one routing view
between many rollout workers, run it as a Ray actor: `PoolActor.remote(...)` exposes the same
async methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from k3rl.types import SamplingParams, WeightUpdate

from .engine import EmbeddedEngine, EngineLoad, GenerationResult, InferenceEngine
from .transport import TRANSPORTS, PublishedUpdate, publish
from .vllm_adapter import VLLMEngine

# a replacement that dies before it is ready (put on a node that is going away) is tried again, this often,
# RESTART_BACKOFF_S x attempt apart
RESTART_ATTEMPTS = 4
RESTART_BACKOFF_S = 2.0


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
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if self.kind == "embedded":
            return EmbeddedEngine.from_preset(self.preset, device=self.device, dtype=self.dtype, seed=self.seed,
                                              checkpoint=self.checkpoint, overrides=self.overrides or None,
                                              name=name, **self.engine_kwargs)
        if self.kind == "vllm":
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
        self.receivers: dict[str, Any] = {}  # weight transport name -> its receive half (it may hold a group)

    async def generate(self, token_ids, sampling, images, request_id) -> GenerationResult:
        result = await self.engine.agenerate(token_ids, sampling, images, request_id)
        result.worker = self.name
        return result

    async def update_weights(self, message) -> int:
        """Receive a weight transport's message (`rollout/transport/`) and switch to its weights;
        returns the engine's version. An update the engine already has is received (a broadcast
        needs every member) but not applied again. A WeightUpdate is applied as it is."""
        if isinstance(message, WeightUpdate):
            return await self.engine.aupdate_weights(message)
        kind = getattr(message, "transport", None)
        if kind not in TRANSPORTS:
            raise TypeError(f"{self.name}: expected a weight transport message ({sorted(TRANSPORTS)}), "
                            f"got {type(message).__name__}")
        if kind not in self.receivers:
            self.receivers[kind] = TRANSPORTS[kind](device=self.device)
        update = await asyncio.to_thread(self._receive, self.receivers[kind], message)
        if update.version <= self.engine.version:
            return self.engine.version
        return await self.engine.aupdate_weights(update)

    def _receive(self, receiver, message):
        """The transport's receive, never beside a CUDA graph capture: it opens IPC handles, copies and
        synchronises the device, which invalidates a capture in progress (a job's engine lost every later
        capture to that). The engine keeps decoding meanwhile: only the switch, between two steps, pauses it."""
        with getattr(self.engine, "device_lock", None) or contextlib.nullcontext():
            return receiver.receive(message, self.name)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def ping(self) -> dict:
        load = self.engine.load()
        return {"name": self.name, "pid": os.getpid(), "version": self.engine.version, "running": load.running,
                "waiting": load.waiting}

    def load(self) -> EngineLoad:
        return self.engine.load()

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics() if hasattr(self.engine, "metrics") else {}


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
        self._weights: list[PublishedUpdate] = []  # the latest full object-store update and the partial ones after it
        # engines start at engine_kwargs["version"] (default 0); start them at -1 to push the
        # learner's initial weights as version 0
        self._version = int(self.spec.engine_kwargs.get("version", 0))
        self._slot_version = [self._version] * num_workers  # the weights each slot's worker runs
        self._health_task: asyncio.Task | None = None
        self.restarts = 0
        self.retries = 0

    # ----- workers ---------------------------------------------------------------------------------
    def _worker_name(self, slot: int) -> str:
        return f"{self.name}-w{slot}-g{self._generation[slot]}"

    def _spawn(self, slot: int):
        return _RemoteWorker.options(**self.actor_options).remote(self.spec, self._worker_name(slot))

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def version(self) -> int:
        return self._version

    @property
    def workers(self) -> list:
        return list(self._workers)

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every worker has built its engine (None: as long as the caller waits; the job's
        deadline is ray.start_timeout_s)."""
        try:
            await asyncio.wait_for(asyncio.gather(*(w.ping.remote() for w in self._workers)), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the pool's {self.num_workers} engines were not all built within {timeout_s:g}s") from None

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
            for attempt in range(1, RESTART_ATTEMPTS + 1):
                self._generation[slot] += 1
                fresh = self._spawn(slot)
                try:
                    await fresh.ping.remote()
                    for message in self._weights:  # bring it to the pool's version before it takes requests
                        await fresh.update_weights.remote(message)
                    self._slot_version[slot] = (await fresh.ping.remote())["version"]
                except RayActorError as e:
                    # placed on a node that is going away (Ray declares a node dead only after missed health
                    # checks, and schedules onto it until then): kill it, wait a little longer, again
                    with contextlib.suppress(Exception):
                        ray.kill(fresh, no_restart=True)
                    if attempt == RESTART_ATTEMPTS:
                        raise RuntimeError(f"engine slot {slot}: its replacement died {attempt} times before it was "
                                           f"ready (last: {type(e).__name__}); no node that can host an engine "
                                           "stays up (ray.placement.engines, the cluster's nodes)") from e
                    await asyncio.sleep(RESTART_BACKOFF_S * attempt)
                    continue
                self._workers[slot] = fresh
                self.restarts += 1
                return
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
            except asyncio.CancelledError:  # the caller gave up (an episode's time budget): free the engine's slot
                worker.abort.remote(request_id)
                raise
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
    def members(self) -> list[str]:
        """The workers' names in slot order (a restarted worker has a new name)."""
        return [self._worker_name(i) for i in range(self.num_workers)]

    async def update_weights(self, message) -> list[int]:
        """Hand `message` (a weight transport's message, or a WeightUpdate, which is published to
        the object store first) to every worker; returns the version each worker runs after it.

        A worker that died is restarted and replayed the object-store updates, so after an
        update of another transport it may stay behind: the sender sees it in the answer (and
        falls back to the object store). Sending the pool's current version again brings the
        workers behind up to it; an older version is refused."""
        if isinstance(message, WeightUpdate):
            message = publish(message)
        if getattr(message, "transport", None) not in TRANSPORTS:
            raise TypeError(f"update_weights takes a WeightUpdate or a weight transport message "
                            f"({', '.join(sorted(TRANSPORTS))}), got {type(message).__name__}")
        if message.version < self._version:
            raise ValueError(f"weight update v{message.version} is older than the pool's v{self._version}")
        if isinstance(message, PublishedUpdate):  # replayable: restarted workers are brought up to date
            self._weights = [message] if message.full else [*self._weights, message]
        self._version = message.version
        for task in list(self._restarting.values()):  # a restart in progress replays the new list too
            await asyncio.wait([task])

        async def one(slot: int) -> None:
            worker = self._workers[slot]
            try:
                self._slot_version[slot] = await worker.update_weights.remote(message)
            except RayActorError:
                await self._restart(slot, worker)  # the restart replays the object-store updates

        results = await asyncio.gather(*(one(i) for i in range(self.num_workers)), return_exceptions=True)
        errors = [f"worker {i}: {type(r).__name__}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"weight update v{message.version} ({message.transport}) failed: " + "; ".join(errors))
        return list(self._slot_version)

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

    async def engine_metrics(self) -> dict[str, float]:
        """Every live engine's `metrics()` summed, as `engine/<name>` (a worker that fails to answer, e.g.
        one restarting, is left out of the sum), and `engine/restarts`: the pool's restarts of dead workers."""
        got = await asyncio.gather(*(w.metrics.remote() for w in self._workers), return_exceptions=True)
        total: dict[str, float] = {"engine/restarts": float(self.restarts)}
        for m in got:
            for k, v in (m if isinstance(m, dict) else {}).items():
                total[f"engine/{k}"] = total.get(f"engine/{k}", 0.0) + v
        return total

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

    async def update_weights(self, message) -> list[int]:
        return await self.pool.update_weights(message)

    def members(self) -> list[str]:
        return self.pool.members()

    def worker_handles(self) -> list:
        return self.pool.workers

    async def abort(self, request_id: str) -> bool:
        return await self.pool.abort(request_id)

    async def check_health(self) -> list[dict]:
        return await self.pool.check_health()

    async def engine_metrics(self) -> dict[str, float]:
        return await self.pool.engine_metrics()

    async def wait_ready(self) -> None:
        await self.pool.wait_ready()

    def version(self) -> int:
        return self.pool.version

    def shutdown(self) -> None:
        self.pool.shutdown()
