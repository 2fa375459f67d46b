"""RolloutWorker: a Ray actor that runs many episodes at once (asyncio).

Each episode: make the environment, run the agent loop against the inference pool, push
the trajectory to the TrajectoryBuffer. An episode that fails is recorded with its error
and never takes the worker down. The worker returns a small summary to the driver; the
driver re-submits the specs of a worker that died (the buffer drops duplicates by id).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import gymnasium

from k3rl.chat import ChatTemplate
from k3rl.config import JobConfig
from k3rl.rollout.agent import EpisodeSpec, run_episode
from k3rl.tokenizer import load_tokenizer
from k3rl.types import SamplingParams


def make_template(cfg: JobConfig) -> ChatTemplate:
    """The chat template whose image-token count matches the model's vision tower."""
    from functools import partial

    from k3rl.images import num_image_tokens

    mc = cfg.model.k3_config()
    vc = getattr(mc, "vision", None) or getattr(mc, "vision_config", None)
    kw = {}
    if vc is not None:
        for name, key in (("patch_size", "patch_size"), ("in_patch_limit", "in_patch_limit"),
                          ("side_patch_limit", "patch_limit_on_one_side")):
            if getattr(vc, key, None) is not None:
                kw[name] = getattr(vc, key)
    return ChatTemplate(load_tokenizer(cfg.model.tokenizer), thinking=cfg.model.thinking,
                        image_tokens=partial(num_image_tokens, **kw))


def make_env(spec: EpisodeSpec, cfg: JobConfig, template: ChatTemplate | None = None,
             sandbox_factory=None, sandbox_release=None):
    """The episode's environment, sharing the job's chat template and sandbox settings."""
    import k3rl.envs  # noqa: F401  (registers the k3rl/ namespace and entry points)

    kwargs = dict(spec.env_kwargs)
    kwargs.setdefault("max_turns", cfg.envs.max_turns)
    kwargs.setdefault("time_budget_s", cfg.envs.episode_time_budget_s)
    kwargs.setdefault("max_context_tokens", cfg.rollout.max_context_tokens)
    kwargs.setdefault("template", template or make_template(cfg))
    kwargs.setdefault("sandbox_backend", cfg.sandbox.backend)
    kwargs.setdefault("sandbox_limits", sandbox_limits(cfg))
    if sandbox_factory is not None:
        kwargs.setdefault("sandbox_factory", sandbox_factory)
        kwargs.setdefault("sandbox_release", sandbox_release)
    return gymnasium.make(spec.env_id, **kwargs).unwrapped


def sandbox_limits(cfg: JobConfig) -> dict[str, Any]:
    s = cfg.sandbox
    return {"memory_mb": s.memory_mb, "cpus": s.cpus, "pids": s.pids, "timeout_s": s.exec_timeout_s}


class RolloutWorker:
    def __init__(self, cfg: dict[str, Any], pool: Any, buffer: Any, index: int = 0) -> None:
        import torch

        torch.set_num_threads(1)
        self.cfg = JobConfig.model_validate(cfg)
        self.pool = pool
        self.buffer = buffer
        self.index = index
        self.template = make_template(self.cfg)
        s = self.cfg.rollout.sampling
        self.sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                       max_tokens=s.max_tokens_per_turn)
        self.sandbox_pool = None
        self._executor_set = False
        self.running = 0
        self.finished = 0

    async def _sandbox_hooks(self, spec: EpisodeSpec):
        """Sandboxes come from this worker's warm pool (created on first need)."""
        import k3rl.envs  # noqa: F401

        env_cls = gymnasium.spec(spec.env_id).entry_point
        if isinstance(env_cls, str):
            mod, _, name = env_cls.partition(":")
            import importlib

            env_cls = getattr(importlib.import_module(mod), name)
        if not getattr(env_cls, "uses_sandbox", False):
            return None, None
        if self.sandbox_pool is None:
            from k3rl.sandboxes import SandboxPool

            s = self.cfg.sandbox
            self.sandbox_pool = SandboxPool(backend=s.backend, max_size=s.max_concurrency,
                                            min_idle=min(s.pool_size, s.max_concurrency),
                                            starts_per_s=s.starts_per_second, job=self.cfg.tracking.run_name or self.cfg.name,
                                            **sandbox_limits(self.cfg))
            await self.sandbox_pool.start()
        loop = asyncio.get_running_loop()
        pool = self.sandbox_pool

        def factory():
            return asyncio.run_coroutine_threadsafe(pool.acquire(), loop).result()

        def release(sb):
            asyncio.run_coroutine_threadsafe(pool.release(sb), loop).result()

        return factory, release

    async def _generate(self, token_ids, sampling, images=None, key=None, group_key=None):
        # sticky by episode; the first turn of a GRPO group is routed together so the shared
        # prompt is prefilled once and forked
        return await self.pool.generate.remote(token_ids, sampling, images=images, key=key, group_key=group_key)

    async def run_episode(self, spec: dict[str, Any]) -> dict[str, Any]:
        if not self._executor_set:
            # env.step runs in threads (tool calls overlap decoding): one thread per episode,
            # not asyncio's default of a handful
            import concurrent.futures

            asyncio.get_running_loop().set_default_executor(
                concurrent.futures.ThreadPoolExecutor(max_workers=max(8, 2 * self.cfg.rollout.episodes_per_worker)))
            self._executor_set = True
        spec_obj = EpisodeSpec(**spec)
        self.running += 1
        t0 = time.monotonic()
        try:
            factory, release = await self._sandbox_hooks(spec_obj)
            env = await asyncio.to_thread(make_env, spec_obj, self.cfg, self.template, factory, release)
            traj = await run_episode(
                env, spec_obj, self._generate, self.template, self.sampling,
                max_turns=self.cfg.envs.max_turns,
                max_context_tokens=self.cfg.rollout.max_context_tokens,
                time_budget_s=self.cfg.envs.episode_time_budget_s,
                record_routing=self.cfg.learner.routing_replay,
            )
        except Exception as e:  # env construction failed: still a recorded (failed) episode
            from k3rl.types import Trajectory

            traj = Trajectory(id=spec_obj.id, env_id=spec_obj.env_id, seed=spec_obj.seed, group_id=spec_obj.group_id,
                              prompt_ids=[], error=f"{type(e).__name__}: {e}")
        finally:
            self.running -= 1
        traj.metadata["worker"] = self.index
        accepted = await self.buffer.put.remote(traj.to_json())
        self.finished += 1
        return {"id": traj.id, "reward": traj.reward, "error": traj.error, "accepted": accepted,
                "tokens": len(traj.token_ids), "generated": traj.num_generated, "turns": traj.num_turns,
                "seconds": time.monotonic() - t0, "env_id": traj.env_id}

    def load(self) -> dict[str, int]:
        return {"running": self.running, "finished": self.finished}

    def ping(self) -> bool:
        return True
