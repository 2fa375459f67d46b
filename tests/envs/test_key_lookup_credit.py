"""KeyLookup's optional partial credit (the demo's shaped reward)."""

import gymnasium
import pytest

import k3rl.envs  # noqa: F401


@pytest.mark.parametrize("partial", [False, True])
def test_partial_credit_components(partial):
    env = gymnasium.make("k3rl/KeyLookup-v0", partial_credit=partial).unwrapped
    env.reset(seed=5)
    task = env.task
    other = next(k for k in task.keys if k != task.key)
    # looks up a wrong but existing key, then answers its value: valid key only
    env.step(env.say(tool_calls=[{"name": "lookup", "arguments": {"key": other}}]))
    _, reward, terminated, _, _ = env.step(env.say(task.values[task.keys.index(other)]))
    assert terminated and reward == (0.25 if partial else 0.0)
    # the oracle: every component
    env.reset(seed=5)
    env.step(env.oracle())
    _, reward, terminated, _, _ = env.step(env.oracle())
    assert terminated and reward == 1.0
    # a new episode forgets the previous lookups
    env.reset(seed=5)
    _, reward, _, _, _ = env.step(env.say("nothing"))
    assert reward == 0.0


def test_small_key_alphabet():
    env = gymnasium.make("k3rl/KeyLookup-v0", num_keys=2, value_digits=1, key_letters="abcd", key_digit=False).unwrapped
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        assert set(env.task.keys) <= set("abcd") and len(env.task.keys) == 2
        assert all(len(v) == 1 for v in env.task.values)
    with pytest.raises(ValueError, match="num_keys must be in 1..4"):
        gymnasium.make("k3rl/KeyLookup-v0", num_keys=5, key_letters="abcd")
    with pytest.raises(ValueError, match="distinct letters"):
        gymnasium.make("k3rl/KeyLookup-v0", key_letters="aab")
