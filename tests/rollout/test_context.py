"""Context compaction (rollout.context) in the episode loop, on real envs and their real sandboxes:
every segment is token-exact (what the engine was given, and what rendering the segment's messages
from scratch gives), summaries are sampled and trained, old tool outputs and images are dropped by
the stated rule."""

import asyncio
import functools
import os

import gymnasium as gym
import pytest

import k3rl.envs  # noqa: F401
from k3rl.chat import Message
from k3rl.config import ContextSection, JobConfig
from k3rl.envs.chart_match import chart_task
from k3rl.rollout.context import DROPPED_OUTPUT, SUMMARY_INTRO, SUMMARY_REQUEST, asks_for_summary
from k3rl.rollout.episode import EpisodeSpec, make_template, run_episode, scripted_generate
from k3rl.types import SamplingParams, Trajectory

BACKEND = os.environ.get("K3RL_TEST_SANDBOX_BACKEND", "auto")
LIMIT = JobConfig().rollout.max_context_tokens


@functools.cache
def sandbox_can(module: str) -> bool:
    from k3rl.sandboxes import open_sandbox

    with open_sandbox(backend=BACKEND) as sb:
        return sb.exec(["python3", "-c", f"import {module}"], timeout=60).exit_code == 0


@pytest.fixture
def require_sandbox():
    def require(module: str = "json") -> None:
        if not sandbox_can(module):
            pytest.skip(f"the {BACKEND} sandbox lacks {module}: run `k3rl sandbox build`")
    return require


def play(env_id, policy, context, max_context_tokens=LIMIT, summary=None, **env_kwargs):
    """An episode of `env_id` played by `policy(env)` (and `summary(env)` when asked for one); returns
    the trajectory, the token ids of every generate request and the template."""
    template = make_template(JobConfig())
    made, requests = [], []

    def make():
        made.append(gym.make(env_id, template=template, sandbox_backend=BACKEND, **env_kwargs))
        return made[-1]

    act = scripted_generate(template, lambda: policy(made[-1].unwrapped))
    summarise = scripted_generate(template, lambda: summary(made[-1].unwrapped))

    async def generate(ids, sampling, **kw):
        requests.append(list(ids))
        return await (summarise if asks_for_summary(template, ids) else act)(ids, sampling, **kw)

    spec = EpisodeSpec(id="ep", env_id=env_id, seed=0, group_id="g")
    traj = asyncio.run(run_episode(make, spec, generate, template, SamplingParams(max_tokens=1 << 30), max_turns=64,
                                   max_context_tokens=max_context_tokens, context=context))
    return traj, requests, template, made[-1].unwrapped


def rerender(template, tools, turns) -> list[int]:
    """A segment rendered from scratch from its turns' messages."""
    session = template.session(tools=tools or None)
    for t in turns:
        session.add(Message(role=t.role, content=t.text, images=t.images, thinking=t.thinking,
                            tool_calls=t.tool_calls, tool_name=t.tool_name, tool_index=t.tool_index))
    return list(session.rendered.ids)


def assert_token_exact(traj: Trajectory, requests: list[list[int]], template, tools) -> None:
    bounds = traj.segment_bounds
    tokens = traj.token_ids
    P = len(traj.prompt_ids)
    # every request is a prefix of one segment, and what follows it there is what was sampled
    seg = 0
    for ids in requests:
        while tokens[bounds[seg][0]:bounds[seg][0] + len(ids)] != ids:
            seg += 1
            assert seg < len(bounds), "a request is no segment's prefix"
        assert traj.loss_mask[bounds[seg][0] + len(ids) - P] == 1  # the next token was sampled
    for k, part in enumerate(traj.segments()):
        lo, hi = bounds[k]
        assert part.token_ids == tokens[lo:hi] and part.metadata["segment"] == k
        assert part.metadata["episode_id"] == traj.id and part.group_id == traj.group_id
        assert rerender(template, tools, part.turns) == part.token_ids  # from scratch, images included
        if k:  # the rebuilt context is never trained
            assert not any(traj.loss_mask[lo - P:lo - P + len(part.prompt_ids)])
    # the record survives the store's Arrow round trip
    back = Trajectory.from_arrow(Trajectory.to_arrow([traj]))[0]
    assert back == traj


def trail_policy(env):
    return env.oracle()


def trail_summary(env):
    return env.oracle_summary()


def test_summarize_segments_are_token_exact_and_the_summary_is_trained(require_sandbox):
    require_sandbox()
    traj, requests, template, env = play("k3rl/LongHorizon-v0", trail_policy, ContextSection(strategy="summarize"),
                                         summary=trail_summary, hops=10)
    assert traj.error is None and traj.reward == 1.0 and len(traj.segment_starts) >= 2
    assert_token_exact(traj, requests, template, env.tools)
    P = len(traj.prompt_ids)
    asked = [i for i, t in enumerate(traj.turns) if t.compaction == "summary_request"]
    for i in asked:
        request, summary, seg_opening = traj.turns[i], traj.turns[i + 1], traj.turns[i + 2]
        assert request.text == SUMMARY_REQUEST and request.role == "user"
        assert summary.role == "assistant" and summary.compaction == "summary" and summary.segment == request.segment
        assert all(traj.loss_mask[summary.end - P - 1 - j] for j in range(5))  # sampled: trained
        # the next segment: the task again, the summary, the last turn
        nxt = [t for t in traj.turns if t.segment == summary.segment + 1]
        assert seg_opening.segment == summary.segment + 1 and nxt[0].text == traj.turns[0].text
        assert nxt[1].role == "user" and nxt[1].text == SUMMARY_INTRO + summary.text
        assert [t.compaction for t in nxt[:4]] == ["carried"] * 4 and nxt[2].role == "assistant"
    assert len(asked) == len(traj.segment_starts)


def test_drop_tool_outputs_keeps_the_assistant_messages(require_sandbox):
    require_sandbox()
    context = ContextSection(strategy="drop_tool_outputs", keep_last_turns=0)
    without, *_ = play("k3rl/LongHorizon-v0", trail_policy, None, hops=4, noise_lines=12)
    assert without.reward == 0.0 and without.metadata["truncated_by"] == "context"
    traj, requests, template, env = play("k3rl/LongHorizon-v0", trail_policy, context, hops=4, noise_lines=12)
    assert traj.error is None and traj.reward == 1.0 and len(traj.segment_starts) >= 1
    assert_token_exact(traj, requests, template, env.tools)
    last = [t for t in traj.turns if t.segment == len(traj.segment_starts)]
    dropped = [t for t in last if t.compaction == "dropped"]
    assert dropped and all(t.role == "tool" and t.text == DROPPED_OUTPUT for t in dropped)
    said = [t.text for t in traj.turns if t.role == "assistant" and t.compaction is None]
    carried = [t.text for t in last if t.role == "assistant" and t.compaction == "carried"]
    assert carried == said[:len(carried)]  # every earlier assistant message, as it was


def test_no_compaction_when_it_cannot_make_room(require_sandbox):
    require_sandbox()
    # keeping 3 whole turns, a new segment would be as full as the old one: the episode runs as without
    traj, *_ = play("k3rl/LongHorizon-v0", trail_policy, ContextSection(strategy="drop_tool_outputs", keep_last_turns=3),
                    hops=6)
    assert traj.segment_starts == [] and traj.metadata["truncated_by"] == "context"


def chart_policy(renders):
    """Render the target `renders` times (wrong colour first), then stop."""
    def policy(env):
        done = sum(1 for m in env.history if m.role == "tool")
        if done == renders:
            return env.say("Done.")
        code = env.task.code if done == renders - 1 else env.task.code.replace("color=", "alpha=0.5, color=")
        return env.say(f"Attempt {done + 1}.", [{"name": "render", "arguments": {"code": code}}])
    return policy


@pytest.mark.parametrize("strategy", ["drop_tool_outputs", "summarize"])
def test_chart_images_outside_the_last_turns_are_replaced(require_sandbox, strategy):
    require_sandbox("matplotlib")
    context = ContextSection(strategy=strategy, keep_last_turns=1, compact_at=0.7)
    traj, requests, template, env = play(
        "k3rl/ChartMatch-v0", chart_policy(5), context, max_context_tokens=3200,
        summary=lambda env: env.say("The chart is a " + chart_task(0).kind + " chart; keep refining."),
        max_turns=8)
    assert traj.error is None and traj.terminated and traj.reward > 0.9 and traj.segment_starts
    assert_token_exact(traj, requests, template, env.tools)
    target = traj.turns[0].images
    assert len(target) == 1
    for k in range(1, len(traj.segment_starts) + 1):
        seg = [t for t in traj.turns if t.segment == k]
        assert seg[0].images == target  # the task's picture is always kept
        *old, newest = [t for t in seg if t.role == "tool" and t.compaction]  # the context the segment began with
        assert len(newest.images) == 1 and newest.compaction == "carried"  # the last turn keeps its screenshot
        for t in old:  # (drop_tool_outputs) older screenshots are gone with their output, a placeholder instead
            assert not t.images and t.compaction == "dropped" and t.text == DROPPED_OUTPUT
    # the images the learner gets are those of the media runs, segment by segment
    assert traj.images == [img for part in traj.segments() for img in part.images]


def test_replay_shows_the_segments_and_re_executes_a_compacted_episode(require_sandbox, tmp_path):
    """A summarised episode in a real store: `k3rl replay` prints and writes it segment by segment,
    and re-executing it (the run's config compacts at the same points, the recorded summaries are
    played back) matches the recording."""
    from rich.console import Console

    from k3rl.reexecute import re_execute_episode, recorded_actions
    from k3rl.replay import replay_command
    from k3rl.store import TrajectoryStore

    require_sandbox()
    traj, *_ = play("k3rl/LongHorizon-v0", trail_policy, ContextSection(strategy="summarize"), summary=trail_summary,
                    hops=10)
    assert len(recorded_actions(traj)) == traj.num_turns == 10 + 1 + len(traj.segment_starts)  # reads, answer, summaries
    with TrajectoryStore(tmp_path / "run") as store:
        store.append(traj.model_copy(update={"metadata": {**traj.metadata, "step": 1}}))
    console = Console(record=True, width=160)
    html = tmp_path / "ep.html"
    assert replay_command(str(tmp_path / "run"), html=html, console=console) == 0
    shown = console.export_text()
    assert f"segments  {len(traj.segment_bounds)} contexts (compacted)" in shown
    assert "segment 1: a new context" in shown and "assistant · summary " in shown and "user · summary request" in shown and "· carried" in shown
    page = html.read_text()
    assert 'id="segment-1"' in page and "<em>summary</em>" in page

    cfg = JobConfig.model_validate({"rollout": {"context": {"strategy": "summarize"}}, "envs": {"max_turns": 64},
                                    "sandbox": {"backend": BACKEND}})
    result = re_execute_episode(traj, {"hops": 10}, cfg)
    assert result.identical, result.divergences
    assert result.steps == traj.num_turns
