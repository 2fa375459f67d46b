"""k3rl/LongHorizon-v0 on the real sandbox: the oracle finishes the trail only with context compaction."""

import gymnasium as gym
from rich.console import Console

import k3rl.envs  # noqa: F401
from k3rl.config import ContextSection, JobConfig
from k3rl.envs.long_horizon import START, make_trail
from k3rl.envs_cli import check_env_command
from k3rl.rollout.episode import make_template, run_oracle_episode

from .conftest import BACKEND


def make(**kw):
    return gym.make("k3rl/LongHorizon-v0", sandbox_backend=BACKEND, **kw)


def test_the_trail_is_a_chain_through_decoys():
    import numpy as np

    trail = make_trail(np.random.default_rng(3), hops=24, decoys=12, noise_lines=4)
    assert trail.path[0] == START and len(trail.path) == 24 and len(trail.files) == 36
    for i, p in enumerate(trail.path):  # each file names the next; the last ends the trail
        assert f"next: {trail.path[i + 1] if i + 1 < 24 else 'none'}\n" in trail.files[p]
        assert f"amount: {trail.amounts[i]}\n" in trail.files[p]
    decoys = set(trail.files) - set(trail.path)
    assert all(not any(f"next: {p}\n" in trail.files[d] for p in trail.path) for d in decoys)


def test_oracle_needs_compaction_at_the_default_context(require_sandbox):
    require_sandbox()
    cfg = JobConfig()
    template = make_template(cfg)
    limit = cfg.rollout.max_context_tokens
    without = run_oracle_episode(make(template=template), seed=0, max_context_tokens=limit)
    assert without.error is None and without.reward == 0.0 and without.truncated
    assert without.metadata["truncated_by"] == "context" and without.num_turns < 24

    env = make(template=template)
    with_summaries = run_oracle_episode(env, seed=0, max_context_tokens=limit,
                                        context=ContextSection(strategy="summarize"))
    assert with_summaries.error is None and with_summaries.terminated and with_summaries.reward == 1.0
    assert len(with_summaries.segment_starts) >= 5  # the trail is several contexts long
    for lo, hi in with_summaries.segment_bounds:
        assert hi - lo <= limit  # every context the engine saw fits
    summaries = [t for t in with_summaries.turns if t.compaction == "summary"]
    assert len(summaries) == len(with_summaries.segment_starts)
    assert summaries[0].text.startswith("3 files read, total ")
    assert not env.unwrapped.has_sandbox


def test_progress_reward_is_a_per_step_reward(require_sandbox):
    require_sandbox()
    ep = run_oracle_episode(make(hops=4, progress_reward=0.25), seed=1)
    steps = [t.reward for t in ep.turns if t.role == "assistant"]
    assert steps == [0.25, 0.25, 0.25, 0.25, 1.0]  # each new trail file, then the right sum
    assert ep.reward == sum(steps)


def test_wrong_sum_scores_zero(require_sandbox):
    require_sandbox()
    env = make(hops=2).unwrapped
    env.reset(seed=0)
    assert env.score(f"it is {env.task.total}") == 1.0
    assert env.score(str(env.task.total + 1)) == 0.0 and env.score("no idea") == 0.0
    env.close()


def test_envs_check_passes(require_sandbox):
    require_sandbox()
    console = Console(record=True, width=120)
    assert check_env_command("k3rl/LongHorizon-v0", console=console) == 0
    assert "env checker passed" in console.export_text()
