"""ToolEnv behaviour on the pure-Python KeyLookup env and small test envs: actions, errors, limits, seeds."""

import time

import gymnasium as gym
import numpy as np
import pytest

import k3rl.envs  # noqa: F401
from k3rl.chat import ChatTemplate, Message
from k3rl.envs import EpisodeNotActiveError, NoOracleError, ToolEnv, ToolResult, tool
from k3rl.envs.actions import action_to_ids, parse_action
from k3rl.rollout.episode import run_oracle_episode
from k3rl.types import ToolCall


def make(**kw):
    return gym.make("k3rl/KeyLookup-v0", **kw).unwrapped


def call(env, name, **arguments):
    return env.say(tool_calls=[{"name": name, "arguments": arguments}])


def test_reset_observation_and_info():
    env = make(num_keys=4)
    obs, info = env.reset(seed=5)
    assert obs in env.observation_space
    assert obs == [{"role": "user", "content": f"keys {' '.join(env.task.keys)}; lookup {env.task.key}", "images": []}]
    assert len(env.task.keys) == 4 and env.task.key in env.task.keys
    timings = info.pop("timings")
    assert info == {"task_id": env.task.id, "tools": [], "max_turns": 4}
    assert list(timings) == ["reset"] and timings["reset"] >= 0  # KeyLookup's reset needs no sandbox


def test_same_seed_same_task_and_different_seeds_differ():
    a, b = make(), make()
    tasks = [a.reset(seed=s)[1]["task_id"] for s in range(20)]
    assert tasks == [b.reset(seed=s)[1]["task_id"] for s in range(20)]
    assert len(set(tasks)) == 20
    # seed then unseeded resets continue one deterministic stream
    a.reset(seed=7)
    b.reset(seed=7)
    assert [a.reset()[1]["task_id"] for _ in range(3)] == [b.reset()[1]["task_id"] for _ in range(3)]


def test_every_action_form_gives_the_same_step():
    env = make()
    env.reset(seed=1)
    text = env.oracle()
    ids = action_to_ids(env.template, text)
    parsed = env.template.parse_assistant(ids)
    forms = [text, ids, np.array(ids, dtype=np.int64), parsed, parsed.to_message(),
             text.removesuffix("<|end_of_msg|>")]  # engines may drop the stop token
    outs = []
    for form in forms:
        env.reset(seed=1)
        obs, reward, term, trunc, info = env.step(form)
        outs.append((obs, reward, term, trunc, info["tool_calls"], env.history[-2:]))
    assert all(o == outs[0] for o in outs)
    assert outs[0][0][0]["content"] == env.task.value


def test_text_without_markup_is_a_final_answer():
    env = make()
    env.reset(seed=2)
    obs, reward, term, trunc, info = env.step(env.task.value)
    assert (obs, reward, term, trunc) == ([], 1.0, True, False)
    env.reset(seed=2)
    assert env.step("no idea")[1:3] == (0.0, True)


def test_malformed_output_is_an_error_message_and_a_turn():
    env = make(max_turns=2)
    env.reset(seed=0)
    bad = '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="lookup"<|sep|>oops<|close|>tools<|sep|>'
    obs, reward, term, trunc, info = env.step(bad)
    assert info["parse_error"] and info["parse_error"] in obs[0]["content"]
    assert obs[0]["role"] == "user" and obs[0]["content"].startswith("Error: your message could not be parsed")
    assert (reward, term, trunc, env.turn) == (0.0, False, False, 1)
    assert info["errors"] == [info["parse_error"]]
    # the malformed message still counts toward max_turns
    obs, reward, term, trunc, info = env.step(bad)
    assert (term, trunc, info["truncated_by"]) == (False, True, "max_turns")


def test_unknown_tool_and_bad_arguments_come_back_as_errors():
    env = make()
    env.reset(seed=0)
    obs, _, term, trunc, info = env.step(call(env, "search", q="x"))
    assert obs == [{"role": "tool", "content": "Error: unknown tool 'search'. Available tools: lookup.",
                    "images": [], "tool_name": "search", "tool_index": 1}]
    assert info["tool_calls"][0]["ok"] is False and not term and not trunc
    obs, _, _, _, info = env.step(call(env, "lookup", key=3))
    assert obs[0]["content"].startswith("Error: bad arguments for lookup: key: Input should be a valid string")
    obs, _, _, _, info = env.step(call(env, "lookup", key="zz"))  # ToolError raised by the tool
    assert obs[0]["content"] == f"Error: no key 'zz'; keys: {' '.join(env.task.keys)}"
    assert env.turn == 3 and len(info["errors"]) == 1


def test_parallel_calls_answer_in_order_with_indices():
    env = make(num_keys=3)
    env.reset(seed=4)
    keys = env.task.keys
    action = env.say(tool_calls=[{"name": "lookup", "arguments": {"key": k}} for k in keys])
    obs, *_ , info = env.step(action)
    assert [m["tool_index"] for m in obs] == [1, 2, 3]
    assert [m["content"] for m in obs] == list(env.task.values)
    assert [c["id"] for c in info["tool_calls"]] == ["t1c1", "t1c2", "t1c3"]
    assert set(info["timings"]) == {"parse", "tool:1:lookup", "tool:2:lookup", "tool:3:lookup", "step"}


def test_step_before_reset_and_after_the_end_raise():
    env = make()
    with pytest.raises(EpisodeNotActiveError, match="call reset"):
        env.step("hi")
    env.reset(seed=0)
    env.step("hi")
    with pytest.raises(EpisodeNotActiveError):
        env.step("again")
    with pytest.raises(TypeError, match="unsupported action of type float"):
        env.reset(seed=0) and env.step(1.5)


class Slow(ToolEnv):
    """A test env whose tool sleeps and returns long output."""

    def generate_task(self, rng, options):
        return type("T", (), {"id": str(int(rng.integers(100)))})()

    def opening_messages(self, task):
        return [Message(role="user", content="go")]

    @tool
    def wait(self, seconds: float) -> str:
        """Sleep, then print a lot."""
        time.sleep(seconds)
        return "x" * 10_000

    @tool
    def finish(self, value: int) -> ToolResult:
        """End the episode with a reward."""
        return ToolResult("bye", done=True, reward=value / 10)

    @tool
    def crash(self) -> str:
        """Raise an unexpected exception."""
        raise KeyError("boom")

    def score(self, final_text):
        return 0.5


def test_time_left_for_tools_and_output_cap():
    env = Slow(time_budget_s=0.2, max_tool_output_chars=100)
    env.reset(seed=0)
    obs, _, term, trunc, info = env.step(call(env, "wait", seconds=0.3))
    # the time budget caps what tools may still take (remaining_s); the episode loop enforces it
    assert (term, trunc, info["truncated_by"]) == (False, False, None) and env.remaining_s() == 0.0
    assert obs[0]["content"].endswith("[output truncated: 100 of 10000 characters shown]")
    assert info["timings"]["tool:1:wait"] >= 0.3


def test_done_tool_and_unexpected_exception():
    env = Slow()
    env.reset(seed=0)
    obs, _, term, _, info = env.step(call(env, "crash"))
    assert obs[0]["content"] == "Error: crash failed: KeyError: 'boom'" and not term
    obs, reward, term, trunc, _ = env.step(call(env, "finish", value=7))
    assert (obs[0]["content"], reward, term, trunc) == ("bye", 0.7, True, False)
    with pytest.raises(NoOracleError, match="defines no scripted oracle"):
        env.oracle()


def test_thinking_template_round_trip():
    env = make(thinking=True)
    env.reset(seed=3)
    action = env.oracle()
    assert action.startswith("<|close|>think<|sep|><|open|>response<|sep|>")
    ep = run_oracle_episode(gym.make("k3rl/KeyLookup-v0", thinking=True), seed=3)
    assert ep.reward == 1.0 and [t.thinking for t in ep.turns if t.role == "assistant"] == ["", ""]


def test_parse_action_reports_ids_of_malformed_output():
    t = ChatTemplate()
    with pytest.raises(Exception) as e:
        parse_action(t, "<|open|>tools<|sep|>")
    assert e.value.ids[-1] == t.stop_token_id
    ids, parsed = parse_action(t, parsed_msg := Message(role="assistant", content="hi",
                                                       tool_calls=[ToolCall(name="a", arguments={"k": 1})]))
    assert parsed.tool_calls[0].arguments == {"k": 1} and ids == t.message(parsed_msg).ids[len(t.generation_prefix()):]


def test_spaces_accept_what_envs_send_and_reject_the_rest():
    from PIL import Image

    from k3rl.envs.spaces import AssistantAction, ChatMessages
    from k3rl.images import to_png

    space = ChatMessages(seed=0)
    for _ in range(20):
        assert space.sample() in space
    png = to_png(Image.new("RGB", (4, 4)))
    assert [{"role": "user", "content": "x", "images": [png]}] in space
    assert [] in space  # the step that ends an episode may say nothing
    assert [{"role": "user", "content": "x", "images": [b"GIF89a"]}] not in space
    assert [{"role": "assistant", "content": "x", "images": []}] not in space
    assert [{"role": "tool", "content": "x", "images": []}] not in space  # a tool result needs name and index
    assert [{"role": "user", "content": "x", "extra": 1}] not in space
    assert "text" not in space
    action = AssistantAction(seed=0)
    assert action.sample() in action and "ünïcode <|open|>" in action and [1, 2, 3] in action
    assert np.array([1, 2], dtype=np.int32) in action and 1.5 not in action and [True] not in action


def test_arguments_that_are_not_json_come_back_as_an_error_and_run_nothing():
    from k3rl.chat import RawToolCall

    env = make()
    env.reset(seed=0)
    raw = RawToolCall(name="lookup", raw_arguments="{key: " + env.task.key + "}")
    ids = env.template.assistant_body("", [raw], None)  # what the model wrote, as the template renders it
    parsed = env.template.parse_assistant(ids)
    assert parsed.tool_calls[0].raw_arguments == raw.raw_arguments
    obs, _, term, _, info = env.step(Message(role="assistant", content="", tool_calls=parsed.tool_calls))
    assert obs[0]["content"].startswith("Error: the arguments of lookup are not valid JSON: '{key: ")
    assert info["tool_calls"][0]["ok"] is False and not term and env._looked_up == []
