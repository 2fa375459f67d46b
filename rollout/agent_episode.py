"""An episode of `k3rl/Agent-v0`: the user's agent drives the model through a chat endpoint of its own.

The rollout worker's process serves every running agent episode's endpoint (`EpisodeServer`, loopback);
`solve(base_url, model, task)` runs in a thread, and each of its calls goes to the worker's `generate` on
the worker's event loop, so an agent's calls are batched with every other episode's. The job's sampling
holds (temperature, top_p, top_k: the learner trains under them), a request may only ask for fewer tokens,
and each call's seed is the episode's (reproducible). The trajectory is built from the recorded calls
(`trajectory_from_calls`). The episode fails, with the agent's traceback, when `solve` raises or returns no
number; it is truncated when the agent ran past the context or its `max_calls`.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from k3rl.chat import ChatTemplate
from k3rl.types import SamplingParams, Trajectory

from .openai_endpoint import ChatEndpoint, EpisodeServer, trajectory_from_calls


async def run_agent(env: Any, traj: Trajectory, spec: Any, generate: Any, template: ChatTemplate,
                    sampling: SamplingParams, max_context_tokens: int, within: Any, timings: dict[str, float],
                    seed_of: Any) -> None:
    """Play one agent episode into `traj` (raises on the agent's failure; the caller records it)."""
    loop = asyncio.get_running_loop()
    calls = 0

    async def on_worker_loop(ids, params: SamplingParams, images=None):  # called on the endpoint server's loop
        nonlocal calls
        request = params.model_copy(update={
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "max_tokens": min(params.max_tokens, sampling.max_tokens), "seed": seed_of(calls)})
        calls += 1
        g0 = time.monotonic()
        first = calls == 1 and spec.group_id
        out = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            generate(ids, request, images=images, key=spec.id, group_key=spec.group_id if first else None), loop))
        timings["generate_s"] += time.monotonic() - g0
        return out

    endpoint = ChatEndpoint(on_worker_loop, template, model=spec.env_id, max_context_tokens=max_context_tokens,
                            max_calls=env.max_calls, default_max_tokens=sampling.max_tokens)
    server = await asyncio.to_thread(EpisodeServer.get)
    base_url = server.add(spec.id, endpoint)
    a0 = time.monotonic()
    try:
        reward = await within(asyncio.to_thread(env.solve, base_url, spec.env_id, dict(env.task)))
    finally:
        server.remove(spec.id)
        timings["agent_s"] = time.monotonic() - a0
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TypeError(f"the agent returned {reward!r}; solve(base_url, model, task) must return the reward, a "
                        "finite number")
    if not endpoint.calls:
        raise RuntimeError("the agent returned without calling the model: nothing to train on")
    built = trajectory_from_calls(endpoint.calls, spec.env_id)
    for name in ("prompt_ids", "completion_ids", "logprobs", "loss_mask", "versions", "turns", "segment_starts"):
        setattr(traj, name, getattr(built, name))
    traj.routed_experts = None  # the learner routes these positions itself (no recorded experts)
    traj.reward, traj.truncated, traj.terminated = float(reward), endpoint.truncated, not endpoint.truncated
    if endpoint.truncated:
        traj.metadata["truncated_by"] = "agent_endpoint"
    traj.metadata.update(model_calls=len(endpoint.calls), divergences=endpoint.divergences,
                         unparsed_answers=sum(c.parse_error is not None for c in endpoint.calls))
