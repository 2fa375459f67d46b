"""The three envs of the agentic mixture (examples/agent.yaml): what each one needs, by construction.

ScreenRead: the value is only in the screenshot's pixels. PythonTool `mul`: the answer is a product
the program prints in the sandbox. LongHorizon `codes`: the trail overflows the context, and the
first code must survive a compaction. The ablations with a trained policy are in
tests/test_agent_ablations.py; here the envs themselves, with their oracles, on the real sandbox.
"""

import gymnasium as gym
import numpy as np
import pytest

import k3rl.envs  # noqa: F401
from k3rl.config import JobConfig
from k3rl.envs.base import task_split
from k3rl.envs.long_horizon import make_code_trail
from k3rl.envs.screen_read import CELL
from k3rl.images import from_png, png_size
from k3rl.rollout.episode import make_template, run_oracle_episode

from .conftest import BACKEND

AGENT = JobConfig.load("examples/agent_from_scratch.yaml")
KWARGS = {e.id: dict(e.kwargs) for e in AGENT.envs.train}
CONTEXT = AGENT.rollout.context
LIMIT = AGENT.rollout.max_context_tokens


def make(env_id, **kw):
    return gym.make(env_id, sandbox_backend=BACKEND, **{**KWARGS.get(env_id, {}), **kw})


# -- ScreenRead ------------------------------------------------------------------------------
def test_screen_read_value_is_only_in_the_pixels():
    env = make("k3rl/ScreenRead-v0", max_offset=0)
    ep = run_oracle_episode(env, seed=3)
    assert ep.terminated and ep.reward == 1.0
    [tool] = [t for t in ep.turns if t.role == "tool"]
    task = env.unwrapped.task
    # nothing the policy reads as text says the value: not the prompt, not the tool's text
    assert tool.text == "screen:" and len(tool.images) == 1
    assert not any(ch.isdigit() for ch in ep.turns[0].text + tool.text)
    assert png_size(tool.images[0]) == (2 * CELL, CELL)  # the panel's letter and one digit: two image tokens
    # the same screen with another value looks different, with a blank one it is one colour
    u = env.unwrapped
    shown = np.asarray(from_png(u.screenshot(task.panel)))
    u.blank_images = True
    blank = np.asarray(from_png(u.screenshot(task.panel)))
    assert blank.shape == shown.shape and len(np.unique(blank.reshape(-1, 3), axis=0)) == 1
    assert len(np.unique(shown.reshape(-1, 3), axis=0)) == 2
    env.close()


def test_screen_read_partial_credit_per_turn_and_the_careless_oracle():
    careful = run_oracle_episode(make("k3rl/ScreenRead-v0"), seed=5)
    assert [t.reward for t in careful.turns if t.role == "assistant"] == [0.5, 0.5]
    careless = run_oracle_episode(make("k3rl/ScreenRead-v0", oracle_mistakes=1.0), seed=5)
    # it shows the other panel (a valid one: 0.25) and answers that panel's value (0 unless equal)
    rewards = [t.reward for t in careless.turns if t.role == "assistant"]
    assert rewards[0] == 0.25 and careless.reward < 1.0
    env = make("k3rl/ScreenRead-v0").unwrapped
    env.reset(seed=0)
    obs, reward, *_ = env.step(env.say(tool_calls=[{"name": "show", "arguments": {"panel": "z"}}]))
    assert reward == 0.0 and obs[0]["content"].startswith("Error: no panel 'z'")


def test_screen_read_refuses_bad_settings():
    with pytest.raises(ValueError, match="panel_letters must be distinct letters"):
        make("k3rl/ScreenRead-v0", panel_letters="aaz")
    with pytest.raises(ValueError, match="needs num_panels >= 2"):
        make("k3rl/ScreenRead-v0", num_panels=1, oracle_mistakes=0.5)


@pytest.mark.parametrize("env_id", ["k3rl/ScreenRead-v0", "k3rl/KeyLookup-v0"])
def test_held_out_split_never_draws_a_training_task(env_id):
    seen = {}
    for split in ("train", "test"):
        env = gym.make(env_id, split=split).unwrapped
        seen[split] = set()
        for seed in range(300):
            env.reset(seed=seed)
            assert task_split(env.task_id, env.test_fraction) == split
            seen[split].add(env.task_id)
    assert not seen["train"] & seen["test"] and len(seen["test"]) > 50
    with pytest.raises(ValueError, match="split must be one of"):
        gym.make(env_id, split="validation")


# -- PythonTool mul --------------------------------------------------------------------------
def test_python_mul_runs_the_product_in_the_sandbox(require_sandbox):
    require_sandbox()
    env = make("k3rl/PythonTool-v0")
    ep = run_oracle_episode(env, seed=2)
    task = env.unwrapped.task
    assert ep.reward == 1.0 and [t.reward for t in ep.turns if t.role == "assistant"] == [0.5, 0.5]
    assert ep.turns[0].role == "user" and ep.turns[0].text == task.question  # "37*58": the prompt is the task
    assert next(t for t in ep.turns if t.role == "tool").text == str(task.answer)  # printed in the sandbox
    careless_env = make("k3rl/PythonTool-v0", oracle_mistakes=1.0)
    careless = run_oracle_episode(careless_env, seed=2)
    a, b = careless_env.unwrapped.task.question.split("*")
    # the careless oracle adds the task's own numbers: a wrong choice of one token, no miscopied digit
    calls = [c for t in careless.turns if t.role == "assistant" for c in t.tool_calls]
    assert [c.arguments["code"] for c in calls] == [f"print({a}+{b})"]
    assert next(t for t in careless.turns if t.role == "tool").text == str(int(a) + int(b))
    assert careless.reward == 0.0 and careless.turns[-1].text == str(int(a) + int(b))
    guess = run_oracle_episode(make("k3rl/PythonTool-v0", families=["product"], oracle_mistakes=1.0), seed=2)
    assert guess.reward == 0.0 and [t.text for t in guess.turns if t.role == "assistant"] == ["?"]


def test_python_mul_without_the_tool_cannot_succeed(require_sandbox):
    require_sandbox()
    env = make("k3rl/PythonTool-v0", tool_available=False, max_turns=3)
    ep = run_oracle_episode(env, seed=2)
    tools = [t for t in ep.turns if t.role == "tool"]
    assert ep.reward == 0.0 and tools and all("python is not available" in t.text for t in tools)


# -- LongHorizon codes -----------------------------------------------------------------------
def test_code_trail_holds_the_codes_at_its_ends():
    trail = make_code_trail(np.random.default_rng(1), hops=4, decoys=2)
    assert trail.path[0] == "start.txt" and len(trail.path) == 4 and len(trail.files) == 6
    first, last = trail.amounts
    assert trail.files["start.txt"].startswith(f"code: {first}\n")
    assert trail.files[trail.path[-1]] == f"code: {last}\nnext: none\n"
    assert all("code:" not in trail.files[p] for p in trail.path[1:-1])


def test_code_trail_short_names_are_one_letter():
    trail = make_code_trail(np.random.default_rng(1), hops=4, decoys=2, short_names=True)
    assert [len(p) for p in trail.files] == [9] + [5] * 5  # start.txt, then q.txt ...
    assert trail.files["start.txt"].endswith(f"next: {trail.path[1]}\n")
    with pytest.raises(ValueError, match="too few"):
        make_code_trail(np.random.default_rng(1), hops=20, decoys=10, short_names=True)
    with pytest.raises(ValueError, match="belong to goal 'codes'"):
        gym.make("k3rl/LongHorizon-v0", short_names=True)


def test_code_trail_is_solved_only_through_the_policys_summary(require_sandbox):
    require_sandbox()
    template = make_template(AGENT)
    without = run_oracle_episode(make("k3rl/LongHorizon-v0", template=template), seed=4, max_context_tokens=LIMIT)
    assert without.truncated and without.metadata["truncated_by"] == "context" and without.reward == 0.0

    env = make("k3rl/LongHorizon-v0", template=template)
    ep = run_oracle_episode(env, seed=4, max_context_tokens=LIMIT, context=CONTEXT)
    first, _ = env.unwrapped.task.amounts
    summaries = [t for t in ep.turns if t.compaction == "summary"]
    assert ep.reward == 1.0 and len(ep.segment_starts) == 1 and [s.text for s in summaries] == [f"code {first}"]
    # after the start file, every call carries a note of the first code (copied from the last message)
    calls = [t for t in ep.turns if t.role == "assistant" and t.tool_calls and t.compaction is None]
    assert calls[0].text == "" and {t.text for t in calls[1:]} == {f"code {first}"}
    for lo, hi in ep.segment_bounds:
        assert hi - lo <= LIMIT
    # the start file, which holds the first code, is not in the context that gives the answer
    last_segment = ep.token_ids[ep.segment_starts[-1]:]
    assert "code: " + str(first) not in template.tok.decode(last_segment).replace(f"code {first}", "")

    careless_env = make("k3rl/LongHorizon-v0", template=template, oracle_mistakes=1.0)
    careless = run_oracle_episode(careless_env, seed=4, max_context_tokens=LIMIT, context=CONTEXT)
    assert [t.text for t in careless.turns if t.compaction == "summary"] == ["reading"]
    assert all(t.text == "" for t in careless.turns if t.role == "assistant" and t.tool_calls)  # no notes
    # "?" for the first code: no made-up digit and no credit for it; the last code still earns its half
    assert [t.text for t in careless.turns if t.role == "assistant"][-1] == f"?{careless_env.unwrapped.task.amounts[1]}"
    assert careless.reward == 0.5
    parts = careless_env.unwrapped.reward_parts
    assert parts("?") == {"first_code": 0.0, "last_code": 0.0} and parts(f"{first}?")["first_code"] == 0.5


def test_code_trail_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="goal must be 'sum'"):
        make("k3rl/LongHorizon-v0", goal="product")
    with pytest.raises(ValueError, match="belong to goal 'codes'"):
        gym.make("k3rl/LongHorizon-v0", oracle_mistakes=0.5)
