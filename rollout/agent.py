"""The agent loop: one episode, token in / token out.

    reset -> render opening messages -> [generation prefix -> engine samples ->
    parse tool calls -> env.step -> render tool results]* -> reward

The loop never re-tokenises history: the sampled ids are appended exactly as the engine
returned them (with their behaviour log-probs and policy versions), and everything the
environment says is rendered once by the chat template and appended with loss mask 0.
Any failure (sandbox crash, timeout, env error, context overflow) ends the episode with
`error` set; it never escapes to the caller.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from k3rl.chat import ChatTemplate, Message, ToolCallParseError
from k3rl.types import SamplingParams, Trajectory, Turn

Generate = Callable[..., Awaitable[Any]]


@dataclass
class EpisodeSpec:
    """What a rollout worker is asked to run. `id` is stable across retries (dedup key)."""

    id: str
    env_id: str
    seed: int
    group_id: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    issued_version: int = 0


def as_message(m: Any) -> Message:
    if isinstance(m, Message):
        return m
    if isinstance(m, dict):
        return Message.model_validate(m)
    raise TypeError(f"an environment returned a {type(m).__name__} where a chat message (dict or Message) was expected")


def _observation_messages(obs: Any) -> list[Message]:
    if isinstance(obs, dict) and "messages" in obs:
        obs = obs["messages"]
    if isinstance(obs, (dict, Message)):
        obs = [obs]
    return [as_message(m) for m in obs]


async def run_episode(
    env: Any,
    spec: EpisodeSpec,
    generate: Generate,
    template: ChatTemplate,
    sampling: SamplingParams,
    *,
    max_turns: int,
    max_context_tokens: int,
    time_budget_s: float = float("inf"),
    record_routing: bool = False,
) -> Trajectory:
    """Run one episode of `env` against `generate(token_ids, sampling, images=, key=)`."""
    t0 = time.monotonic()
    traj = Trajectory(id=spec.id, env_id=spec.env_id, seed=spec.seed, group_id=spec.group_id, prompt_ids=[],
                      routed_experts=[] if record_routing else None,
                      metadata={"issued_version": spec.issued_version, "env_kwargs": dict(spec.env_kwargs)})
    images: list[bytes] = []
    timings = {"generate_s": 0.0, "env_s": 0.0}
    try:
        obs, info = await asyncio.to_thread(env.reset, seed=spec.seed)
        traj.task_id = str((info or {}).get("task_id", ""))
        session = template.session(tools=getattr(env, "tools", None) or None)
        for m in _observation_messages(obs):
            piece = session.add(m)
            images.extend(m.images)
            traj.turns.append(Turn(role=m.role, text=m.content, images=m.images, start=len(session.rendered) - len(piece),
                                   end=len(session.rendered)))
        session.add_generation_prompt()
        traj.prompt_ids = list(session.rendered.ids)
        sampling = sampling.model_copy(update={
            "stop_token_ids": sorted({*sampling.stop_token_ids, template.stop_token_id}),
            "return_routed_experts": record_routing,
        })
        for _turn in range(max_turns):
            room = max_context_tokens - len(traj.token_ids)
            if room <= 0:
                traj.truncated = True
                traj.error = traj.error or f"context of {max_context_tokens} tokens is full"
                break
            if time.monotonic() - t0 > time_budget_s:
                traj.truncated = True
                traj.error = f"episode time budget of {time_budget_s:.0f}s used up"
                break
            g0 = time.monotonic()
            kw = {"group_key": spec.group_id} if (_turn == 0 and spec.group_id) else {}
            out = await generate(traj.token_ids, sampling.model_copy(update={"max_tokens": min(sampling.max_tokens, room)}),
                                 images=images or None, key=spec.id, **kw)
            timings["generate_s"] += time.monotonic() - g0
            ids = list(out.token_ids)
            versions = list(out.versions) if getattr(out, "versions", None) else [getattr(out, "version", 0)] * len(ids)
            start = len(traj.token_ids) - len(template.generation_prefix())
            session.add_generated(ids)
            traj.completion_ids.extend(ids)
            traj.logprobs.extend(float(x) for x in out.logprobs)
            traj.loss_mask.extend([1] * len(ids))
            traj.versions.extend(int(v) for v in versions)
            if record_routing:
                routed = getattr(out, "routed_experts", None) or [[] for _ in ids]
                traj.routed_experts.extend([[list(map(int, layer)) for layer in tok] for tok in routed])
            try:
                parsed = template.parse_assistant(ids)
                turn = Turn(role="assistant", text=parsed.content, thinking=parsed.thinking, tool_calls=parsed.tool_calls,
                            start=start, end=len(traj.token_ids))
            except ToolCallParseError as e:
                turn = Turn(role="assistant", text=template.tok.decode(ids), start=start, end=len(traj.token_ids), error=str(e))
            turn.duration_s = time.monotonic() - g0
            traj.turns.append(turn)
            if getattr(out, "finish_reason", "stop") != "stop":
                # the model ran out of tokens mid-message: nothing well-formed to continue from
                traj.truncated = True
                traj.error = f"generation stopped by {out.finish_reason} before <|end_of_msg|>"
                break
            e0 = time.monotonic()
            # the exact sampled ids are the action; tools run off the event loop so other
            # episodes keep decoding while this one waits for its sandbox
            obs, reward, terminated, truncated, info = await asyncio.to_thread(env.step, ids)
            timings["env_s"] += time.monotonic() - e0
            traj.reward += float(reward)
            turn.reward = float(reward)
            new_messages = _observation_messages(obs) if obs else []
            for m in new_messages:
                piece = session.add(m)
                images.extend(m.images)
                s, e = traj.append(piece.ids, generated=False)
                traj.turns.append(Turn(role=m.role, text=m.content, images=m.images, tool_name=m.tool_name,
                                       tool_index=m.tool_index, start=s, end=e,
                                       error="; ".join((info or {}).get("errors") or []) or None))
            if terminated or truncated:
                traj.terminated, traj.truncated = bool(terminated), bool(truncated)
                break
            traj.append(session.add_generation_prompt().ids, generated=False)
        else:
            traj.truncated = True
    except Exception as e:  # an episode failure is data, never a crash of the worker
        traj.error = f"{type(e).__name__}: {e}"
        traj.metadata["traceback"] = traceback.format_exc(limit=8)
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            try:  # off the event loop: releasing a pooled sandbox schedules work on this loop
                await asyncio.to_thread(close)
            except Exception as e:  # noqa: BLE001
                traj.metadata["close_error"] = repr(e)
    traj.timings.update(timings, episode_s=time.monotonic() - t0)
    return traj
