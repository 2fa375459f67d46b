"""Sample episodes as MLflow traces, read back with the MLflow client from a SQLite store."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import gymnasium as gym
import mlflow
import pytest
from mlflow.entities import SpanType
from mlflow.tracking import MlflowClient

import k3rl.envs  # noqa: F401
from k3rl.config import JobConfig
from k3rl.rollout.episode import EpisodeSpec, make_template, run_episode, scripted_generate
from k3rl.store import TrajectoryStore
from k3rl.tracking import Tracker
from k3rl.types import SamplingParams


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('traces')}/mlflow.db"


def keylookup_episode(version: int = 3):
    """A real KeyLookup episode, scripted: a lookup of a key that does not exist (a tool error), the
    right lookup, then the answer."""
    template = make_template(JobConfig())
    made = []

    def make():
        made.append(gym.make("k3rl/KeyLookup-v0", template=template))
        return made[-1]

    def policy():
        env = made[-1].unwrapped
        tool_turns = sum(1 for m in env.history if m.role == "tool")
        if tool_turns == 0:
            return env.say("Looking.", [{"name": "lookup", "arguments": {"key": "zz9"}}])
        return env.oracle()

    spec = EpisodeSpec(id="ep-trace", env_id="k3rl/KeyLookup-v0", seed=4, group_id="g1")
    traj = asyncio.run(run_episode(make, spec, scripted_generate(template, policy, version=version), template,
                                   SamplingParams(max_tokens=512), max_turns=6, max_context_tokens=8192))
    assert traj.error is None and traj.reward == 1.0, traj.error
    return traj


def spans_by_name(trace):
    return {s.name: s for s in trace.data.spans}


def test_an_episode_becomes_a_trace_of_its_run_with_a_span_per_turn_and_tool_call(uri):
    traj = keylookup_episode()
    tracker = Tracker(uri=uri, experiment="traces", run_name="run-a")
    trace_id = tracker.log_episode_trace(traj, step=3)

    client = MlflowClient(uri)
    found = client.search_traces(locations=[tracker.experiment_id], run_id=tracker.run_id,
                                 filter_string="tag.`k3rl.step` = '3'")
    assert [t.info.trace_id for t in found] == [trace_id]
    trace = found[0]
    assert trace.info.tags["k3rl.episode_id"] == "ep-trace" and trace.info.tags["k3rl.reward"] == "1"
    assert trace.info.trace_metadata["mlflow.sourceRun"] == tracker.run_id

    assert [s.name for s in trace.data.spans] == ["episode k3rl/KeyLookup-v0", "turn 1", "tool lookup #1", "turn 2",
                                                  "tool lookup #1", "turn 3", "reward"]
    root = trace.data.spans[0]
    assert root.span_type == SpanType.AGENT and root.parent_id is None
    assert root.inputs["messages"][-1]["content"].startswith("keys ")
    assert root.outputs["reward"] == 1.0 and root.outputs["final_answer"] == traj.turns[-1].text

    turns = [s for s in trace.data.spans if s.name.startswith("turn ")]
    assert [s.name for s in turns] == ["turn 1", "turn 2", "turn 3"]
    assert all(s.span_type == SpanType.CHAT_MODEL and s.parent_id == root.span_id for s in turns)
    assistant = [t for t in traj.turns if t.role == "assistant"]
    assert [s.attributes["tokens"] for s in turns] == [t.end - t.start for t in assistant]
    assert {s.attributes["finish_reason"] for s in turns} == {"stop"}
    assert turns[0].attributes["policy_versions"] == [3]
    assert turns[0].outputs["tool_calls"] == [{"name": "lookup", "arguments": {"key": "zz9"}}]

    tools = [s for s in trace.data.spans if s.span_type == SpanType.TOOL]
    assert [s.parent_id for s in tools] == [turns[0].span_id, turns[1].span_id]
    failed, ok = tools
    assert failed.inputs == {"key": "zz9"} and failed.status.status_code == "ERROR"
    assert failed.attributes["ok"] is False and "zz9" in failed.attributes["error"]
    key = assistant[1].tool_calls[0].arguments["key"]
    assert ok.inputs == {"key": key} and ok.status.status_code == "OK" and ok.outputs["result"] == traj.turns[-1].text
    assert "duration_s" in ok.attributes

    reward = spans_by_name(trace)["reward"]
    assert reward.span_type == SpanType.EVALUATOR and reward.outputs["reward"] == 1.0
    assert all(s.start_time_ns <= s.end_time_ns for s in trace.data.spans)


def test_logging_a_trace_leaves_the_global_tracking_uri_alone(uri, tmp_path):
    before = mlflow.get_tracking_uri()
    tracker = Tracker(uri=uri, experiment="traces", run_name="run-b")
    tracker.log_episode_trace(keylookup_episode(), step=0)
    assert mlflow.get_tracking_uri() == before


def test_log_samples_logs_the_steps_best_episodes_as_traces(uri, tmp_path):
    from k3rl.job import _log_samples

    best, other = keylookup_episode(), keylookup_episode()
    best.id, other.id, other.reward = "ep-best", "ep-other", 0.0
    for t in (best, other):
        t.metadata["step"] = 2
    with TrajectoryStore(tmp_path / "run") as store:
        store.extend([best, other])
    cfg = JobConfig.model_validate({"tracking": {"sample_episodes": 1}})
    tracker = Tracker(uri=uri, experiment="traces", run_name="run-c")
    stats = [{"id": t.id, "reward": t.reward, "generated": t.num_generated} for t in (best, other)]
    _log_samples(SimpleNamespace(cfg=cfg, run_dir=tmp_path / "run", tracker=tracker), stats, step=2)

    traces = MlflowClient(uri).search_traces(locations=[tracker.experiment_id], run_id=tracker.run_id)
    assert [t.info.tags["k3rl.episode_id"] for t in traces] == ["ep-best"]
    assert tracker.list_artifacts("episodes") == ["episodes/step_000002/ep-best.html"]
