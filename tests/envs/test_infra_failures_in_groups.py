"""Sandbox failures inside a GRPO group are data. A tool call that fails on the policy's input is what the
policy sees next (the episode goes on and is trained); a sandbox that dies under an episode fails that
episode, which the buffer stores as failed and keeps out of the group, so the group's baseline is the
mean of the episodes that ran, never dragged down by a 0 the policy did not earn."""

from __future__ import annotations

import asyncio

import gymnasium as gym
import pytest

import k3rl.envs  # noqa: F401
from k3rl.chat import ChatTemplate
from k3rl.learner.advantages import step_advantages
from k3rl.rollout.buffer import TrajectoryBuffer
from k3rl.rollout.episode import EpisodeSpec, run_episode, scripted_generate
from k3rl.sandboxes import open_sandbox
from k3rl.store import TrajectoryStore
from k3rl.types import SamplingParams

MUL = {"families": ["mul"], "system_prompt": None, "declare_tools": False}


def member(k: int, template, kill: bool = False, bad_code: bool = False):
    """Episode k of a group of PythonTool `mul` (seed 7): the oracle, careless on odd members (a guess: 0).
    `kill`: the episode's Docker container is killed before its first tool call (an infrastructure
    failure); `bad_code`: the first program raises (the policy's error), then the oracle's runs."""
    made = []

    def sandbox():
        sb = open_sandbox(backend="auto")
        if kill and sb.backend == "docker":
            sb.api.kill(sb.id)  # the daemon kills the container: the next call finds it dead
        elif kill:
            sb.close()
        return sb

    def make():
        made.append(gym.make("k3rl/PythonTool-v0", template=template, sandbox_factory=sandbox,
                             oracle_mistakes=float(k % 2), **MUL))
        return made[-1]

    def policy():
        env = made[-1].unwrapped
        if bad_code and env.turn == 0:
            return env.say(tool_calls=[{"name": "python", "arguments": {"code": "print(1 / 0)"}}])
        return env.oracle()

    spec = EpisodeSpec(id=f"g-s{k}", env_id="k3rl/PythonTool-v0", seed=7, group_id="g")
    return asyncio.run(run_episode(make, spec, scripted_generate(template, policy), template,
                                   SamplingParams(max_tokens=200), max_turns=4, max_context_tokens=2048))


def test_a_dead_sandbox_fails_its_episode_and_leaves_the_group_baseline_alone(tmp_path, require_sandbox):
    require_sandbox()
    template = ChatTemplate()
    group = [member(0, template, kill=True), member(1, template), member(2, template, bad_code=True),
             member(3, template), member(4, template)]
    dead, careless, erred = group[0], group[1], group[2]
    # the infrastructure failure: failed at the tool's step, with the sandbox's error, no reward to train on
    assert dead.error and dead.metadata["failed_at"] == "step" and "sandbox" in dead.error.lower()
    # the policy's own error: a tool message it reads, then it goes on and earns its reward
    tool_texts = [t.text for t in erred.turns if t.role == "tool"]
    assert erred.error is None and "ZeroDivisionError" in tool_texts[0] and erred.reward == 1.0
    assert careless.error is None and careless.reward == 0.0

    buffer = TrajectoryBuffer(group_size=5, store_dir=str(tmp_path))
    for t in group:
        assert asyncio.run(buffer.put(t))
    trained = buffer.take(["g"], step=1)
    assert [t.id for t in trained] == ["g-s1", "g-s2", "g-s3", "g-s4"]  # the failed one is not trained
    stored = {t.id: t.metadata["status"] for t in TrajectoryStore(tmp_path).read()}
    assert stored == {"g-s0": "failed", "g-s1": "trained", "g-s2": "trained", "g-s3": "trained", "g-s4": "trained"}

    rewards = [t.reward for t in trained]  # [0, 1, 0, 1]: careless members earn 0, the others 1
    adv = step_advantages(trained, rewards, "grpo_no_std")
    baseline = sum(rewards) / len(rewards)
    assert adv.tolist() == pytest.approx([r - baseline for r in rewards])
    # what a 0 for the dead episode would have done: a lower baseline, every advantage pushed up
    biased = sum(rewards) / (len(rewards) + 1)
    assert baseline != pytest.approx(biased) and all(a < r - biased for a, r in zip(adv.tolist(), rewards, strict=True))
