"""The OpenAI-compatible endpoint (rollout/openai_endpoint.py) driven by the `openai` client over loopback,
against a real embedded engine (k3-tiny, the demo's warm start) and the K3 template: what it records is what
the engine sampled, its answers have OpenAI's shape, bad requests get OpenAI's 400 naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from k3rl.chat import ChatTemplate
from k3rl.config import LearnerSection
from k3rl.learner.trainer import Trainer
from k3rl.messages import Message
from k3rl.model import build_model
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.openai_endpoint import ChatEndpoint, make_app, serve_in_thread, trajectory_from_calls
from k3rl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
WARM = ROOT / "examples" / "keylookup_warm_start"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the value of a key",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}]


@pytest.fixture(scope="module")
def served():
    engine = EmbeddedEngine.from_preset("k3-tiny", checkpoint=str(WARM))
    template = ChatTemplate()
    endpoint = ChatEndpoint(engine.agenerate, template, model="k3-tiny", max_context_tokens=1024, max_calls=50)
    server, url = serve_in_thread(make_app(endpoint))
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    yield engine, template, endpoint, client
    server.should_exit = True
    engine.close()


def test_a_call_is_recorded_token_exact_and_answered_in_openais_shape(served):
    engine, template, endpoint, client = served
    messages = [{"role": "system", "content": "Answer with the value."}, {"role": "user", "content": "key: ab"}]
    r = client.chat.completions.create(model="k3-tiny", messages=messages, max_tokens=24, temperature=0,
                                       logprobs=True)
    call = endpoint.calls[-1]
    prompt = template.render([Message.model_validate(m) for m in messages]).ids
    assert call.prompt_ids == prompt and r.usage.prompt_tokens == len(prompt)
    # greedy: the engine asked directly gives the same ids, which are what the answer counts and scores
    direct = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=24,
                                                    stop_token_ids=[template.stop_token_id]))
    assert call.completion_ids == direct.token_ids and r.usage.completion_tokens == len(direct.token_ids)
    assert [x.logprob for x in r.choices[0].logprobs.content] == pytest.approx(call.logprobs)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if call.parse_error is None:
        assert template.parse_assistant(call.completion_ids).content == r.choices[0].message.content


def test_tool_calls_and_results_render_as_the_template_does(served):
    _, template, endpoint, client = served
    messages = [
        {"role": "user", "content": "what is under ab?"},
        {"role": "assistant", "content": None, "refusal": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "ab"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    client.chat.completions.create(model="k3-tiny", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    want = template.render([Message.model_validate({k: v for k, v in m.items() if k != "refusal"}) for m in messages],
                           TOOLS).ids
    assert endpoint.calls[-1].prompt_ids == want


def test_a_tool_call_the_model_writes_comes_back_as_openais_tool_calls(served):
    # the endpoint's answer path on a completion that spells a call (as a trained policy writes it)
    _, template, endpoint, _ = served
    body = template.assistant_body("", [Message.model_validate({"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": '{"key": "ab"}'}}]}).tool_calls[0]], None)
    req = endpoint.parse({"messages": [{"role": "user", "content": "x"}]})
    parsed, error = endpoint._parse(body, "stop")
    answer = endpoint._response(req, [1, 2], body, [0.0] * len(body), parsed, "stop")
    choice = answer["choices"][0]
    assert error is None and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"key": "ab"}


def test_streaming_gives_the_same_completion_in_chunks(served):
    _, _, _, client = served
    messages = [{"role": "user", "content": "key: cd"}]
    whole = client.chat.completions.create(model="k3-tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="k3-tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("change, param", [
    ({"n": 2}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice"),
    ({"max_tokens": 5000}, "messages"),
])
def test_bad_requests_get_openais_400_naming_the_field(served, change, param):
    _, _, endpoint, client = served
    n = len(endpoint.calls)
    args = {"model": "k3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": TOOLS,
            **change}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.body["param"] == param, e.value.body
    assert len(endpoint.calls) == n  # nothing recorded for a refused call
    if param == "messages":
        assert e.value.body["code"] == "context_length_exceeded" and endpoint.truncated


def test_the_call_budget_ends_with_a_clear_error():
    engine = EmbeddedEngine.from_preset("k3-tiny")
    endpoint = ChatEndpoint(engine.agenerate, ChatTemplate(), max_calls=1)
    server, url = serve_in_thread(make_app(endpoint))
    try:
        client = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="budget of 1 model calls"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}], max_tokens=2)
        assert endpoint.truncated and len(endpoint.calls) == 1
    finally:
        server.should_exit = True
        engine.close()


SYSTEM = {"role": "system", "content": "Find the value of key ab with the lookup tool, then answer it."}


def harness(client, messages, turns=3, rewrite=None):
    """A tool-calling loop as users write it: send, append the answer as returned, answer its tool calls."""
    for turn in range(turns):
        r = client.chat.completions.create(model="k3-tiny", messages=messages, tools=TOOLS, max_tokens=200,
                                           temperature=1.0, seed=turn)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        messages.append(rewrite(msg) if rewrite else msg)
        for call in r.choices[0].message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "value 42"})
        if not r.choices[0].message.tool_calls:
            messages.append({"role": "user", "content": "go on"})
    return messages


def test_a_multi_turn_harness_trains_as_one_trajectory_with_the_engines_logprobs(served):
    engine, _, endpoint, client = served
    n = len(endpoint.calls)
    harness(client, [SYSTEM, {"role": "user", "content": "key: ab"}])
    calls = endpoint.calls[n:]
    assert len(calls) == 3 and all(c.finish_reason == "stop" for c in calls), [c.finish_reason for c in calls]
    traj = trajectory_from_calls(calls, "agent", reward=1.0)
    # each call's prompt goes on from the last one's prompt + answer: one segment, every answer trained once
    assert traj.segment_starts == [] and traj.num_generated == sum(len(c.completion_ids) for c in calls)
    assert traj.token_ids == calls[-1].prompt_ids + calls[-1].completion_ids
    # the learner's log-probs of the recorded tokens (fp32, CPU) are the engine's
    trainer = Trainer(build_model("k3-tiny", checkpoint=str(WARM)), LearnerSection(micro_batch_tokens=4096),
                      temperature=1.0)
    mine = trainer.logprobs([traj])[0]
    at = [i for i, m in enumerate(traj.loss_mask) if m]
    worst = max(abs(mine[i] - traj.logprobs[i]) for i in at)
    assert worst < 1e-4 and min(traj.logprobs[i] for i in at) < -1e-3, worst


def test_the_sampled_ids_win_over_a_rewritten_answer_and_a_new_history_is_a_new_segment(served):
    _, template, endpoint, client = served
    n, d = len(endpoint.calls), endpoint.divergences

    def rewrite(msg):  # a harness that edits the answer it sends back: the prompt still holds what was sampled
        return {**msg, "content": (msg.get("content") or "") + " (edited)"}

    messages = harness(client, [SYSTEM, {"role": "user", "content": "key: cd"}], turns=2, rewrite=rewrite)
    first, second = endpoint.calls[n:n + 2]
    assert endpoint.divergences == d + 1
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == first.prompt_ids + first.completion_ids
    # a harness that compacts its history into a summary: its next call starts a segment of its own
    client.chat.completions.create(model="k3-tiny", max_tokens=200, temperature=1.0, seed=9, tools=TOOLS,
                                   messages=[SYSTEM, {"role": "user", "content": "summary: the value of ab is 42"}])
    traj = trajectory_from_calls(endpoint.calls[n:], "agent")
    assert len(traj.segment_starts) == 1 and len(messages) > 2
    start = traj.segment_starts[0]
    assert traj.token_ids[start:start + len(endpoint.calls[-1].prompt_ids)] == endpoint.calls[-1].prompt_ids
    assert traj.num_generated == sum(len(c.completion_ids) for c in endpoint.calls[n:])


def test_k3rl_serve_answers_the_openai_client():
    from k3rl.cluster import free_port  # the cluster module pulls in Ray: only this test needs a free port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3rl.cli", "serve", str(WARM), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                assert client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "k3rl serve did not start within 120 s"
                time.sleep(0.5)
        r = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "key: ab"}],
                                           max_tokens=8, temperature=0)
        assert r.usage.completion_tokens >= 1 and r.choices[0].message.role == "assistant"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
