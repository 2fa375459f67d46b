"""The agent loop: token in / token out with a real env and the env's scripted oracle as the policy."""

import asyncio
from types import SimpleNamespace

import gymnasium

import k3rl.envs  # noqa: F401
from k3rl.chat import ChatTemplate
from k3rl.envs.actions import encode_with_specials
from k3rl.rollout.agent import EpisodeSpec, run_episode
from k3rl.types import SamplingParams


def _env(template, **kw):
    return gymnasium.make("k3rl/KeyLookup-v0", template=template, **kw).unwrapped


def _oracle_generate(env, template, version=3, finish="stop", mangle=None):
    calls = []

    async def generate(token_ids, sampling, images=None, key=None, **kw):
        calls.append(list(token_ids))
        ids = encode_with_specials(template, env.oracle())
        if mangle:
            ids = mangle(ids)
        return SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[version] * len(ids),
                               finish_reason=finish)

    return generate, calls


def _run(env, template, generate, **kw):
    spec = EpisodeSpec(id="ep1", env_id="k3rl/KeyLookup-v0", seed=11, group_id="g")
    return asyncio.run(run_episode(env, spec, generate, template, SamplingParams(max_tokens=400),
                                   max_turns=kw.pop("max_turns", 4), max_context_tokens=kw.pop("ctx", 4096), **kw))


def test_oracle_episode_is_token_exact_and_masked():
    template = ChatTemplate()
    env = _env(template)
    generate, calls = _oracle_generate(env, template)
    traj = _run(env, template, generate)
    assert traj.error is None and traj.reward == 1.0 and traj.terminated
    # what the engine saw each turn is exactly the trajectory's prefix (no re-tokenisation)
    for c in calls:
        assert traj.token_ids[: len(c)] == c
    # the env's own rendering of the conversation equals the trajectory's tokens
    assert env._session.rendered.ids == traj.token_ids
    # generated tokens carry the engine's log-probs and version; everything else is masked out
    gen = [i for i, m in enumerate(traj.loss_mask) if m]
    assert all(traj.logprobs[i] == -0.5 and traj.versions[i] == 3 for i in gen)
    assert all(traj.versions[i] == -1 and traj.logprobs[i] == 0.0 for i, m in enumerate(traj.loss_mask) if not m)
    assistant = [t for t in traj.turns if t.role == "assistant"]
    assert len(assistant) == 2 and assistant[0].tool_calls[0].name == "lookup"
    for t in traj.turns:
        assert 0 <= t.start <= t.end <= len(traj.token_ids)
    assert traj.turns[-1].role == "assistant" and traj.turns[-1].end == len(traj.token_ids)


def test_malformed_output_is_shown_to_the_model_and_counts_as_a_turn():
    template = ChatTemplate()
    env = _env(template)
    generate, _ = _oracle_generate(env, template, mangle=lambda ids: ids[3:])
    traj = _run(env, template, generate, max_turns=2)
    assistant = [t for t in traj.turns if t.role == "assistant"]
    assert all(t.error and "malformed assistant message" in t.error for t in assistant)
    errors = [t for t in traj.turns if t.role == "user" and "could not be parsed" in t.text]
    assert errors and traj.truncated and traj.reward == 0.0


def test_generation_cut_by_max_tokens_ends_the_episode_with_a_clear_error():
    template = ChatTemplate()
    env = _env(template)
    generate, _ = _oracle_generate(env, template, finish="length", mangle=lambda ids: ids[:10])
    traj = _run(env, template, generate)
    assert traj.truncated and "stopped by length" in traj.error


def test_context_limit_truncates_instead_of_overflowing():
    template = ChatTemplate()
    env = _env(template)
    generate, calls = _oracle_generate(env, template)
    traj = _run(env, template, generate, ctx=120)
    assert traj.truncated and "context" in traj.error
    assert all(len(c) <= 120 for c in calls)


def test_env_failure_is_recorded_not_raised():
    template = ChatTemplate()
    env = _env(template)

    def boom(action):
        raise RuntimeError("sandbox crashed")

    env.step = boom
    generate, _ = _oracle_generate(env, template)
    traj = _run(env, template, generate)
    assert traj.error == "RuntimeError: sandbox crashed" and "traceback" in traj.metadata
