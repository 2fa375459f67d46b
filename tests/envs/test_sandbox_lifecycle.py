"""The episode's sandbox is released on every exit path: end, truncation, reset, close, exceptions, garbage, pools."""

import asyncio
import gc
import threading

import gymnasium as gym
import pytest

import k3rl.envs  # noqa: F401
from k3rl.chat import ChatTemplate
from k3rl.envs.sandboxed import pooled
from k3rl.rollout.episode import EpisodeSpec, run_episode, run_oracle_episode, scripted_generate
from k3rl.sandboxes import SandboxClosedError, SandboxError, SandboxFileError, SandboxPool, open_sandbox
from k3rl.types import SamplingParams

from .conftest import BACKEND


class Opened:
    """A sandbox factory that opens real sandboxes and remembers them."""

    def __init__(self, **limits):
        self.limits = limits
        self.sandboxes = []

    def __call__(self):
        sb = open_sandbox(backend=BACKEND, **self.limits)
        self.sandboxes.append(sb)
        return sb

    def all_gone(self):
        return all(sb.closed and not sb.is_alive() for sb in self.sandboxes)


def python_env(factory, **kw):
    return gym.make("k3rl/PythonTool-v0", sandbox_factory=factory, **kw).unwrapped


def run_code(env, code="print(6 * 7)"):
    return env.step(env.say(tool_calls=[{"name": "python", "arguments": {"code": code}}]))


def test_released_when_the_episode_terminates_or_truncates(require_sandbox):
    require_sandbox()
    opened = Opened()
    env = python_env(opened, max_turns=2)
    ep = run_oracle_episode(env, seed=0)
    assert ep.reward == 1.0 and len(opened.sandboxes) == 1 and opened.all_gone()
    env.reset(seed=1)
    run_code(env)
    assert env.has_sandbox and opened.sandboxes[-1].is_alive()
    *_, truncated, info = run_code(env)
    assert truncated and info["truncated_by"] == "max_turns"
    assert not env.has_sandbox and len(opened.sandboxes) == 2 and opened.all_gone()


def test_released_on_reset_and_close(require_sandbox):
    require_sandbox()
    opened = Opened()
    env = python_env(opened)
    env.reset(seed=0)
    run_code(env)
    first = opened.sandboxes[0]
    env.reset(seed=1)  # mid-episode reset: the old sandbox goes, the new episode gets a fresh one
    assert first.closed and not first.is_alive() and not env.has_sandbox
    assert run_code(env)[0][0]["content"] == "42"
    env.close()
    env.close()  # idempotent
    assert len(opened.sandboxes) == 2 and opened.all_gone()


def test_released_when_step_raises(require_sandbox):
    require_sandbox()
    opened = Opened()
    env = python_env(opened)
    env.reset(seed=0)
    run_code(env)
    with pytest.raises(TypeError, match="unsupported action"):
        env.step({"not": "an action"})
    assert opened.all_gone() and not env.active
    # an infrastructure failure (the sandbox killed from outside) raises and leaves nothing held
    env.reset(seed=0)
    run_code(env)
    opened.sandboxes[-1].close()
    with pytest.raises(SandboxClosedError):
        run_code(env)
    assert not env.has_sandbox and not env.active


def test_released_when_setup_fails(require_sandbox):
    require_sandbox()
    opened = Opened(max_file_bytes=16)  # too small for the repository files: setup_sandbox raises
    env = gym.make("k3rl/CodeFix-v0", sandbox_factory=opened).unwrapped
    env.reset(seed=0)
    with pytest.raises(SandboxError, match="setup_sandbox failed: SandboxFileError.*over max_file_bytes=16") as e:
        env.step(env.oracle())
    assert isinstance(e.value.__cause__, SandboxFileError)
    assert len(opened.sandboxes) == 1 and opened.all_gone() and not env.has_sandbox


def test_released_when_the_env_is_garbage_collected(require_sandbox):
    require_sandbox()
    opened = Opened()
    env = python_env(opened)
    env.reset(seed=0)
    run_code(env)
    sb = opened.sandboxes[0]
    assert sb.is_alive()
    del env
    gc.collect()
    assert sb.closed and not sb.is_alive()


def test_sandboxes_from_a_pool_go_back_to_it(require_sandbox):
    require_sandbox()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    pool = SandboxPool(backend=BACKEND, max_size=2, min_idle=1)
    try:
        asyncio.run_coroutine_threadsafe(pool.start(), loop).result(timeout=120)
        env = gym.make("k3rl/PythonTool-v0", **pooled(pool, loop)).unwrapped
        for seed in range(2):
            env.reset(seed=seed)
            run_code(env, "open('mark', 'w').write('x'); import os; print(sorted(os.listdir('.')))")
            assert pool.leased == 1
            ep_end = env.step(env.say(tool_calls=[{"name": "python", "arguments": {"code": "print(0)"}}]))
            env.close()
            assert ep_end is not None and pool.leased == 0
        assert pool.live <= 2

        async def close_on_the_loop():  # what the episode loop's `finally: env.close()` does
            env.close()
            await asyncio.sleep(0.5)
            return pool.leased

        env.reset(seed=5)
        run_code(env)
        assert pool.leased == 1
        assert asyncio.run_coroutine_threadsafe(close_on_the_loop(), loop).result(timeout=60) == 0

        async def acquire_on_the_loop():
            env.reset(seed=6)
            return env.sandbox

        with pytest.raises(RuntimeError, match="cannot be acquired on the event loop's thread"):
            asyncio.run_coroutine_threadsafe(acquire_on_the_loop(), loop).result(timeout=60)
    finally:
        asyncio.run_coroutine_threadsafe(pool.close(), loop).result(timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_released_when_reset_fails(require_sandbox):
    require_sandbox()
    from k3rl.envs.python_tool import PythonToolEnv

    class Failing(PythonToolEnv):
        def opening_messages(self, task):
            self.sandbox.exec("true")  # acquires the episode's sandbox, then fails
            raise ValueError("no opening today")

    opened = Opened()
    env = Failing(sandbox_factory=opened)
    with pytest.raises(ValueError, match="no opening today"):
        env.reset(seed=0)
    assert len(opened.sandboxes) == 1 and opened.all_gone() and not env.has_sandbox


def test_a_sandbox_killed_mid_episode_fails_the_episode_and_is_released(require_sandbox):
    """Through the episode loop: the tool's infrastructure failure is a failed episode (not the model's error)."""
    require_sandbox()
    opened, made, template = Opened(), [], ChatTemplate()

    def make():
        made.append(gym.make("k3rl/PythonTool-v0", sandbox_factory=opened, template=template))
        return made[-1]

    def policy():
        env = made[-1].unwrapped
        if env.turn == 1:
            opened.sandboxes[-1].close()  # killed from outside between two tool calls
        return env.say(tool_calls=[{"name": "python", "arguments": {"code": "print(6 * 7)"}}])

    spec = EpisodeSpec(id="killed", env_id="k3rl/PythonTool-v0", seed=0)
    traj = asyncio.run(run_episode(make, spec, scripted_generate(template, policy), template, SamplingParams(),
                                   max_turns=4, max_context_tokens=8192))
    assert traj.metadata["failed_at"] == "step" and traj.error.startswith("SandboxClosedError") and traj.reward == 0
    assert [t.text for t in traj.turns if t.role == "tool"] == ["42"]  # the first call ran
    assert opened.all_gone() and not made[-1].unwrapped.has_sandbox
