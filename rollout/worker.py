"""RolloutWorker: a Ray actor that runs many episodes at once (asyncio).

Each episode runs the episode loop (`k3rl.rollout.episode`) against the inference pool and
goes to the TrajectoryBuffer by `buffer.put`; the driver gets its small stats back
(`k3rl.metrics.episode_stats`), never the tokens. An episode
that fails (env construction, reset, a tool, the sandbox, the engine, the context, the time
budget) is recorded with its error and never takes the worker down. Sandboxes come from the
worker's warm `SandboxPool`, started at the first episode that needs one and closed by `close()`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import time
import uuid
from typing import Any

from k3rl.config import JobConfig
from k3rl.envs.registration import import_env_modules
from k3rl.envs.sandboxed import on_loop_thread
from k3rl.metrics import episode_stats
from k3rl.rollout.buffer import put_trajectory
from k3rl.rollout.episode import (
    EpisodeSpec,
    job_limits,
    job_sampling,
    make_env,
    make_template,
    run_episode,
    sandbox_limits,
)
from k3rl.sandboxes import SandboxPool

__all__ = ["RolloutWorker", "make_env", "make_template", "sandbox_limits"]


class RolloutWorker:
    def __init__(self, cfg: dict[str, Any], pool: Any, buffer: Any, index: int = 0) -> None:
        # one thread for whatever torch an env uses (the worker itself needs none: it imports no torch)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
        else:
            os.environ["OMP_NUM_THREADS"] = "1"
        self.cfg = JobConfig.model_validate(cfg)
        import_env_modules(self.cfg.envs.imports)  # a user's envs register themselves in this process too
        self.pool = pool
        self.buffer = buffer
        self.index = index
        self.template = make_template(self.cfg)
        self.sampling = job_sampling(self.cfg)
        s = self.cfg.sandbox
        self.sandbox_pool = SandboxPool(backend=s.backend, max_size=s.max_concurrency,
                                        min_idle=min(s.pool_size, s.max_concurrency), starts_per_s=s.starts_per_second,
                                        job=self.cfg.tracking.run_name or self.cfg.name, **sandbox_limits(self.cfg))
        self._sandbox_pool_start = asyncio.Lock()
        self._executor_set = False
        self.running = 0
        self.finished = 0

    async def _acquire_sandbox(self) -> Any:
        async with self._sandbox_pool_start:  # one start, however many episodes ask at once
            await self.sandbox_pool.start()
        return await self.sandbox_pool.acquire()

    def _make_env(self, spec: EpisodeSpec, loop: asyncio.AbstractEventLoop) -> Any:
        """The episode's env (called by the episode loop in a worker thread), with sandboxes from the pool."""

        def factory():
            return asyncio.run_coroutine_threadsafe(self._acquire_sandbox(), loop).result()

        def release(sb):
            if on_loop_thread(loop):  # e.g. the env garbage-collected on the loop: never wait for ourselves
                loop.create_task(self.sandbox_pool.release(sb))
            else:
                asyncio.run_coroutine_threadsafe(self.sandbox_pool.release(sb), loop).result()

        return make_env(spec, self.cfg, self.template, factory, release)

    async def _generate(self, token_ids, sampling, images=None, key=None, group_key=None):
        # sticky by episode; the first turn of a GRPO group is routed together so the shared
        # prompt is prefilled once and forked
        request_id = uuid.uuid4().hex
        try:
            return await self.pool.generate.remote(token_ids, sampling, images=images, key=key, group_key=group_key,
                                                   request_id=request_id)
        except asyncio.CancelledError:  # the episode ran out of time or was cancelled: the engine stops decoding it
            self.pool.abort.remote(request_id)
            raise

    async def run_episode(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Run one episode, put its Trajectory into the buffer, return a summary of it."""
        loop = asyncio.get_running_loop()
        if not self._executor_set:
            # env.step runs in threads (tool calls overlap decoding): one thread per episode,
            # not asyncio's default of a handful
            loop.set_default_executor(
                concurrent.futures.ThreadPoolExecutor(max_workers=max(8, 2 * self.cfg.rollout.episodes_per_worker)))
            self._executor_set = True
        episode = EpisodeSpec(**spec)
        self.running += 1
        t0 = time.monotonic()
        try:
            traj = await run_episode(lambda: self._make_env(episode, loop), episode, self._generate, self.template,
                                     self.sampling, record_routing=self.cfg.learner.routing_replay,
                                     **job_limits(self.cfg))
        finally:
            self.running -= 1
        traj.metadata["worker"] = self.index
        accepted = await put_trajectory(self.buffer, traj)
        self.finished += 1
        return {**episode_stats(traj), "accepted": accepted, "seconds": time.monotonic() - t0}

    async def close(self) -> None:
        """Close the worker's sandboxes (warm and leased); idempotent."""
        await self.sandbox_pool.close()

    def load(self) -> dict[str, int]:
        return {"running": self.running, "finished": self.finished}

    def ping(self) -> bool:
        return True
