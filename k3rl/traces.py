"""Episodes as MLflow traces: the trace view of `k3rl ui` shows a sampled episode turn by turn.

One trace per episode, linked to its run (`run_id`) and tagged with its step:

    episode <env id>                 AGENT     inputs: the opening messages; outputs: final answer, reward
      turn 1                         CHAT_MODEL  outputs: text, thinking, tool calls;
                                               attributes: tokens, finish_reason, policy versions, error
        tool read_file #1            TOOL      inputs: arguments; outputs: result (images as [image WxH]);
                                               attributes: ok, error, duration_s
      turn 2 ...
      reward                         EVALUATOR outputs: reward, terminated, truncated, error

Tags: `k3rl.step`, `k3rl.env_id`, `k3rl.episode_id`, `k3rl.task_id`, `k3rl.reward`, so
`MlflowClient().search_traces(locations=[experiment_id], run_id=..., filter_string="tag.`k3rl.step` = '3'")`
finds a step's episodes. The store keeps each turn's duration, not its clock time, so the
spans are laid end to end from those durations, ending when the trace is logged.
"""

from __future__ import annotations

import time
from typing import Any

import mlflow
from mlflow.entities import SpanType
from mlflow.tracking._tracking_service.utils import _use_tracking_uri

from k3rl.images import png_size
from k3rl.types import Trajectory, Turn

TEXT_LIMIT = 4000  # characters of a message kept in a span (the episode's HTML artifact has them all)


def _text(text: str | None) -> str:
    text = text or ""
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + f"...[{len(text) - TEXT_LIMIT} more chars]"


def _shown(turn: Turn) -> str:
    images = "".join("[image {}x{}] ".format(*png_size(p)) for p in turn.images)
    return images + _text(turn.text)


def finish_reason(turn: Turn) -> str:
    """How the engine ended an assistant turn: "length" when cut at the token limit, else "stop"."""
    return "length" if turn.error and turn.error.startswith("cut at") else "stop"


def log_episode_trace(client: Any, experiment_id: str, run_id: str, traj: Trajectory, step: int) -> str:
    """Log `traj` as one MLflow trace of `run_id` at `step` through `client`; returns the trace id."""
    opening = traj.turns[: _first_assistant(traj)]
    assistant = [t for t in traj.turns if t.role == "assistant"]
    final = next((t.text for t in reversed(assistant) if not t.tool_calls), None)
    now = time.time_ns()
    clock = now - int(max(traj.timings.get("episode_s", 0.0), sum(t.duration_s for t in traj.turns)) * 1e9)
    tags = {"k3rl.step": str(step), "k3rl.env_id": traj.env_id, "k3rl.episode_id": traj.id,
            "k3rl.task_id": traj.task_id[:250], "k3rl.reward": f"{traj.reward:g}"}
    # MLflow's tracer exports to the global tracking URI: point it at this client's store while we log
    with _use_tracking_uri(client.tracking_uri):
        root = client.start_trace(
            name=f"episode {traj.env_id}", span_type=SpanType.AGENT, experiment_id=experiment_id, run_id=run_id,
            inputs={"messages": [{"role": t.role, "content": _shown(t)} for t in opening]},
            attributes={"seed": traj.seed, "task_id": traj.task_id, "group_id": traj.group_id},
            tags=tags, start_time_ns=clock)
        trace_id = root.trace_id
        number = 0
        for i, turn in enumerate(traj.turns):
            if turn.role != "assistant":
                continue
            number += 1
            end = clock + int(turn.duration_s * 1e9)
            span = client.start_span(
                f"turn {number}", trace_id=trace_id, parent_id=root.span_id, span_type=SpanType.CHAT_MODEL,
                start_time_ns=clock,
                attributes={"tokens": turn.end - turn.start, "finish_reason": finish_reason(turn),
                            "policy_versions": _versions(traj, turn), "compaction": turn.compaction})
            replies = _tool_turns_after(traj.turns, i)
            tool_clock = end
            for call in turn.tool_calls:
                reply = replies.get(call.index)
                took = reply.duration_s if reply is not None else 0.0
                tool = client.start_span(f"tool {call.name} #{call.index}", trace_id=trace_id, parent_id=span.span_id,
                                         span_type=SpanType.TOOL, inputs=dict(call.arguments),
                                         start_time_ns=tool_clock)
                tool_end = tool_clock + int(took * 1e9)
                client.end_span(trace_id, tool.span_id, end_time_ns=tool_end,
                                outputs={"result": _shown(reply) if reply is not None else None},
                                attributes={"ok": reply is not None and not reply.error,
                                            "error": reply.error if reply is not None else "no result",
                                            "duration_s": took},
                                status="ERROR" if reply is None or reply.error else "OK")
                tool_clock = tool_end
            client.end_span(trace_id, span.span_id, end_time_ns=max(end, tool_clock),
                            outputs={"text": _text(turn.text), "thinking": _text(turn.thinking),
                                     "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls]},
                            attributes={"error": turn.error}, status="ERROR" if turn.error else "OK")
            clock = max(end, tool_clock)
        reward = client.start_span("reward", trace_id=trace_id, parent_id=root.span_id, span_type=SpanType.EVALUATOR,
                                   start_time_ns=clock)
        outcome = {"reward": traj.reward, "terminated": traj.terminated, "truncated": traj.truncated,
                   "error": traj.error}
        client.end_span(trace_id, reward.span_id, outputs=outcome, end_time_ns=max(clock, now))
        client.end_trace(trace_id, outputs={"final_answer": _text(final), **outcome},
                         attributes={"turns": traj.num_turns, "generated_tokens": traj.num_generated},
                         status="ERROR" if traj.error else "OK", end_time_ns=max(clock, now))
        mlflow.flush_trace_async_logging()
    return trace_id


def _versions(traj: Trajectory, turn: Turn) -> list[int]:
    """The policy versions that sampled the turn's tokens."""
    offset = len(traj.prompt_ids)
    return sorted({v for v in traj.versions[max(0, turn.start - offset): max(0, turn.end - offset)] if v >= 0})


def _first_assistant(traj: Trajectory) -> int:
    return next((i for i, t in enumerate(traj.turns) if t.role == "assistant"), len(traj.turns))


def _tool_turns_after(turns: list[Turn], i: int) -> dict[int, Turn]:
    """The tool messages that answer the assistant turn `turns[i]`, by call index."""
    out: dict[int, Turn] = {}
    for t in turns[i + 1:]:
        if t.role == "assistant":
            break
        if t.role == "tool" and t.tool_index is not None:
            out[t.tool_index] = t
    return out
