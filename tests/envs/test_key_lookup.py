"""KeyLookup-v0: the oracle always wins, difficulty knob, and the episode's token budget with the byte tokenizer."""

import gymnasium as gym
import pytest

import k3rl.envs  # noqa: F401
from k3rl.rollout.episode import run_oracle_episode


@pytest.mark.parametrize("num_keys", [1, 3, 8])
def test_oracle_reaches_full_reward(num_keys):
    env = gym.make("k3rl/KeyLookup-v0", num_keys=num_keys)
    for seed in range(10):
        ep = run_oracle_episode(env, seed=seed)
        assert (ep.reward, ep.terminated, ep.num_turns) == (1.0, True, 2)
        assert ep.turns[-1].text == env.unwrapped.task.value


def test_wrong_key_gives_a_wrong_value_and_reward_zero():
    env = gym.make("k3rl/KeyLookup-v0", num_keys=5).unwrapped
    env.reset(seed=11)
    other = next(k for k in env.task.keys if k != env.task.key)
    obs, *_ = env.step(env.say(tool_calls=[{"name": "lookup", "arguments": {"key": other}}]))
    assert obs[0]["content"] == env.task.values[env.task.keys.index(other)] != env.task.value
    assert env.step(env.oracle())[1] == 0.0  # the oracle repeats the value it saw: wrong key, wrong value


def test_token_budget_of_an_episode():
    """Measured: ~320 byte tokens per oracle episode (no declaration), ~+300 with the JSON tool declaration
    (its header has the official encoder's second line, "Here are the available tools, ...")."""
    lengths = {}
    for declare in (False, True):
        env = gym.make("k3rl/KeyLookup-v0", declare_tools=declare)
        tokens = [len(run_oracle_episode(env, seed=s).token_ids) for s in range(20)]
        lengths[declare] = tokens
        # the episode loop's tokens are the finished conversation rendered from scratch
        base = env.unwrapped
        assert tokens[-1] == len(base.template.render(base.history, tools=base.tools, add_generation_prompt=False))
    assert all(280 <= n <= 340 for n in lengths[False]), lengths[False]
    assert all(560 <= n <= 660 for n in lengths[True]), lengths[True]
    # the generated (trained) part: call turn + answer turn
    ep = run_oracle_episode(gym.make("k3rl/KeyLookup-v0"), seed=0)
    assert 100 <= ep.num_generated <= 160, ep.num_generated


def test_bad_difficulty_is_refused():
    with pytest.raises(ValueError, match="num_keys must be in 1..26"):
        gym.make("k3rl/KeyLookup-v0", num_keys=0)


def test_oracle_demonstration_tokens_are_the_rendered_conversation():
    env = gym.make("k3rl/KeyLookup-v0", declare_tools=True)
    ep = run_oracle_episode(env, seed=9)
    base = env.unwrapped
    r = base.template.render(base.history, tools=base.tools, add_generation_prompt=False)
    assert r.ids == ep.token_ids  # token in, token out: no re-tokenisation drift
    assert r.mask == [0] * len(ep.prompt_ids) + ep.loss_mask
    trained = [i for i, m in zip(r.ids, r.mask, strict=True) if m]
    body = base.template.assistant_body
    calls = ep.turns[1].tool_calls
    assert trained == body("", calls, None) + body(base.task.value, [], None)


def test_a_careless_oracle_looks_up_another_key_at_its_rate_and_answers_consistently():
    """oracle_wrong_key = q: about q of the demonstrations look up another key (a seeded draw, the same
    for the same seed), then answer that key's value; with partial credit they earn the valid key's 0.25."""
    env = gym.make("k3rl/KeyLookup-v0", num_keys=2, value_digits=1, key_letters="abcd", key_digit=False,
                   partial_credit=True, oracle_wrong_key=0.5)
    wrong, n = 0, 200
    for seed in range(n):
        ep = run_oracle_episode(env, seed=seed)
        task = env.unwrapped.task
        looked_up = env.unwrapped._looked_up
        assert len(looked_up) == 1 and looked_up[0] in task.keys and ep.terminated
        answer = task.values[task.keys.index(looked_up[0])]
        assert ep.turns[-1].text == answer  # consistent: the value that came back
        if looked_up[0] != task.key:
            wrong += 1
            assert ep.reward == (0.25 if answer != task.value else 0.75)
        else:
            assert ep.reward == 1.0
        again = run_oracle_episode(env, seed=seed)  # the draw is the episode seed's
        assert env.unwrapped._looked_up == looked_up and again.reward == ep.reward
    assert 0.4 * n <= wrong <= 0.6 * n, wrong
    careful = gym.make("k3rl/KeyLookup-v0", num_keys=2, oracle_wrong_key=0.0)
    assert all(run_oracle_episode(careful, seed=s).reward == 1.0 for s in range(20))
    with pytest.raises(ValueError, match=r"oracle_wrong_key is a probability in \[0, 1\], got 1.5"):
        gym.make("k3rl/KeyLookup-v0", oracle_wrong_key=1.5)
    with pytest.raises(ValueError, match="oracle_wrong_key needs num_keys >= 2"):
        gym.make("k3rl/KeyLookup-v0", num_keys=1, oracle_wrong_key=0.5)
