"""Run one episode of a ToolEnv with a text policy (the scripted oracle by default).

Used by `k3rl envs check`, the tests, and the SFT warm start (oracle demonstrations):

    ep = run_oracle_episode(gym.make("k3rl/KeyLookup-v0"), seed=3)
    ep.messages   # the whole conversation as k3rl.chat.Message (assistant turns included)
    ep.reward     # terminal reward
    r = ep.rendered(env.unwrapped.template)   # r.ids, r.mask (1 on assistant-generated tokens)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3rl.chat import ChatTemplate, Message, Rendered


@dataclass
class Episode:
    env_id: str | None
    seed: int | None
    task_id: str
    tools: list[dict[str, Any]]
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    truncated_by: str | None = None
    turns: int = 0
    context_tokens: int = 0
    seconds: float = 0.0
    infos: list[dict[str, Any]] = field(default_factory=list)

    def rendered(self, template: ChatTemplate | None = None) -> Rendered:
        """Token ids of the whole episode and the loss mask over the assistant's tokens (SFT demonstrations).

        With the env's own template these are exactly the tokens the env counted while it ran
        (except after a malformed assistant message, whose raw tokens only the agent loop keeps).
        """
        template = template or ChatTemplate()
        return template.render(self.messages, tools=self.tools or None, add_generation_prompt=False)


def run_episode(env: Any, policy: Callable[[list[Message]], Any], seed: int | None = None,
                options: dict[str, Any] | None = None, max_steps: int = 1000) -> Episode:
    """reset(seed) then step(policy(history)) until the episode ends; `env` may be wrapped."""
    base = env.unwrapped
    t = time.perf_counter()
    _, info = env.reset(seed=seed, options=options)
    spec = getattr(env, "spec", None)
    ep = Episode(spec.id if spec else None, seed, info["task_id"], info["tools"])
    for _ in range(max_steps):
        _, reward, terminated, truncated, info = env.step(policy(list(base.history)))
        ep.infos.append(info)
        ep.reward += float(reward)
        if terminated or truncated:
            ep.terminated, ep.truncated, ep.truncated_by = terminated, truncated, info.get("truncated_by")
            break
    ep.messages = list(base.history)
    ep.turns = base.turn
    ep.context_tokens = base.context_tokens
    ep.seconds = time.perf_counter() - t
    return ep


def oracle_policy(env: Any) -> Callable[[list[Message]], str]:
    """The scripted oracle of `env` (wrapped or not) as a policy: history -> assistant action text."""
    return env.unwrapped.oracle


def run_oracle_episode(env: Any, seed: int | None = None, options: dict[str, Any] | None = None) -> Episode:
    """One episode played by the environment's scripted oracle."""
    return run_episode(env, env.unwrapped.oracle, seed=seed, options=options)
