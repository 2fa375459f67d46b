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


def _play(env, seed, actions):
    """Step rewards of an episode played from `actions` (callables of the env -> assistant message)."""
    env.reset(seed=seed)
    rewards = []
    for act in actions:
        _, r, terminated, truncated, _ = env.step(act(env))
        rewards.append(r)
        if terminated or truncated:
            break
    return rewards


def _lookup(which):
    def act(env):
        t = env.task
        key = {"right": t.key, "other": next(k for k in t.keys if k != t.key), "missing": "zz"}[which]
        return env.say(tool_calls=[{"name": "lookup", "arguments": {"key": key}}])
    act.which = which
    return act


def _answer(right):
    def act(env):
        return env.say(env.task.value if right else str((int(env.task.value) + 1) % 10))
    act.which = "answer"
    return act


@pytest.mark.parametrize("actions", [
    [_lookup("right"), _answer(True)], [_lookup("right"), _answer(False)], [_lookup("other"), _answer(False)],
    [_lookup("missing"), _answer(False)], [_lookup("other"), _lookup("right"), _answer(True)],
    [_lookup("right"), _lookup("right"), _lookup("right")], [_answer(True)],
])
def test_turn_rewards_pay_the_same_credit_in_the_turn_that_earned_it(actions):
    kw = dict(num_keys=2, value_digits=1, key_letters="abcd", key_digit=False, partial_credit=True, max_turns=3)
    terminal = gymnasium.make("k3rl/KeyLookup-v0", **kw).unwrapped
    per_turn = gymnasium.make("k3rl/KeyLookup-v0", turn_rewards=True, **kw).unwrapped
    for seed in range(4):
        a, b = _play(terminal, seed, actions), _play(per_turn, seed, actions)
        if actions[-1].which == "answer":
            assert sum(b) == pytest.approx(sum(a)), (a, b)  # the episode's total is unchanged
        else:  # cut by max_turns before an answer: terminal credit is 0, the lookup turn keeps what it earned
            assert sum(a) == 0.0 and sum(b) == 0.5, (a, b)
        assert all(r == 0.0 for r in a[:-1])  # terminal: everything at the end ...
        if actions[0].which != "answer":
            # ... per turn: the key's credit in the first lookup that earned it, never paid twice
            assert b[0] == {"right": 0.5, "other": 0.25, "missing": 0.0}[actions[0].which]
            assert b[-1] in (0.0, 0.5, 0.25)


def test_turn_rewards_need_partial_credit():
    with pytest.raises(ValueError, match="partial_credit=True"):
        gymnasium.make("k3rl/KeyLookup-v0", turn_rewards=True)


def test_per_turn_credit_stops_reinforcing_a_wrong_value():
    """Why the demo trains per turn: in a group where the key was mostly found and the value mostly
    missed, an episode-level advantage is positive for 'right key, wrong value' (0.5 is above the
    group's mean), so its wrong value token is pushed up; per turn, its answer turn is compared with
    the other answer turns and gets a negative advantage, while its lookup turn keeps a positive one."""
    from k3rl.learner.advantages import turn_advantages
    from k3rl.learner.losses import group_advantages

    # step rewards: (lookup turn, answer turn) of a group of four
    group = [[0.5, 0.5], [0.5, 0.0], [0.25, 0.0], [0.0, 0.0]]
    episode = group_advantages([sum(r) for r in group], ["g"] * 4, method="grpo_no_std").tolist()
    per_turn = turn_advantages(group, ["g"] * 4, normalise=False)
    right_key_wrong_value = 1
    assert episode[right_key_wrong_value] > 0  # the whole episode, wrong value included, pushed up
    assert per_turn[right_key_wrong_value][1] < 0  # per turn: the wrong answer pushed down
    assert per_turn[right_key_wrong_value][0] > 0  # and the right lookup still pushed up
    assert per_turn[0][1] > 0  # the right answer pushed up


@pytest.mark.parametrize("turn_rewards", [False, True])
def test_reward_parts_say_what_each_step_paid(turn_rewards):
    """info["reward_parts"] sums to the step's reward and names each component; the episode loop keeps them
    per turn on the trajectory (metadata["reward_parts"]), which `k3rl replay` shows."""
    import asyncio

    from k3rl.rollout.episode import EpisodeSpec, run_episode, scripted_generate

    env = gymnasium.make("k3rl/KeyLookup-v0", num_keys=2, partial_credit=True, turn_rewards=turn_rewards).unwrapped
    env.reset(seed=5)
    task = env.task
    other = next(k for k in task.keys if k != task.key)
    _, r1, _, _, info1 = env.step(env.say(tool_calls=[{"name": "lookup", "arguments": {"key": other}}]))
    _, r2, _, _, info2 = env.step(env.say(task.values[task.keys.index(other)]))  # the wrong key's value
    if turn_rewards:  # the key's credit in the lookup turn, the value's in the answer's
        assert info1["reward_parts"] == {"valid_key": 0.25, "requested_key": 0.0} and r1 == 0.25
        assert info2["reward_parts"] == {"exact_value": 0.0} and r2 == 0.0
    else:
        assert "reward_parts" not in info1 and r1 == 0.0
        assert info2["reward_parts"] == {"valid_key": 0.25, "requested_key": 0.0, "exact_value": 0.0} and r2 == 0.25
    plain = gymnasium.make("k3rl/KeyLookup-v0").unwrapped
    plain.reset(seed=1)
    assert plain.step(plain.say(plain.task.value))[4]["reward_parts"] == {"exact_value": 1.0}

    # through the episode loop, played by the oracle: the parts per turn (index into traj.turns)
    template = env.template
    traj = asyncio.run(run_episode(lambda: env, EpisodeSpec(id="e", env_id="k3rl/KeyLookup-v0", seed=5),
                                   scripted_generate(template, env.oracle), template, _sampling(),
                                   max_turns=4, max_context_tokens=8192))
    parts = traj.metadata["reward_parts"]
    assert [traj.turns[p["turn"]].role for p in parts] == ["assistant"] * len(parts)
    assert sum(v for p in parts for v in p["parts"].values()) == traj.reward == 1.0
    for p in parts:  # each turn's parts sum to the reward it was paid
        assert sum(p["parts"].values()) == traj.turns[p["turn"]].reward
    assert len(parts) == (2 if turn_rewards else 1)


def _sampling():
    from k3rl.types import SamplingParams

    return SamplingParams(max_tokens=1 << 20)
