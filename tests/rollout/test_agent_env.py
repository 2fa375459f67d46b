"""`k3rl/Agent-v0`: a user's agent harness (examples/agents/openai_loop.py, the `openai` client) played by
the rollout's episode loop against a real embedded engine (the demo's warm start): the episode is the
tokens its model calls sampled; an agent that raises or returns no number fails the episode with its
traceback; a bad agent or task path is refused naming the field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from k3rl.config import JobConfig
from k3rl.envs.agent import AgentEnv
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.episode import EpisodeSpec, job_sampling, make_env, make_template, run_episode

ROOT = Path(__file__).resolve().parents[2]
LOOP = "k3rl.examples.agents.openai_loop"


def raising_agent(base_url, model, task):
    raise RuntimeError(f"the harness broke on task {task['id']}")


def wordy_agent(base_url, model, task):
    from openai import OpenAI  # the client only where an agent runs

    OpenAI(base_url=base_url, api_key="-").chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return "good"


def silent_agent(base_url, model, task):
    return 1.0


@pytest.fixture(scope="module")
def engine():
    eng = EmbeddedEngine.from_preset("k3-tiny", checkpoint=str(ROOT / "examples" / "keylookup_warm_start"))
    yield eng
    eng.close()


def episodes(engine, agent, seeds, sandboxed=False):
    cfg = JobConfig.load(ROOT / "examples" / "demo.yaml", [
        f"envs.train=[{{id: k3rl/Agent-v0, kwargs: {{agent: '{agent}', tasks: '{LOOP}:task', "
        f"sandboxed: {str(sandboxed).lower()}}}}}]", "envs.eval=[]"])
    template, sampling = make_template(cfg), job_sampling(cfg)

    async def generate(ids, params, images=None, key=None, group_key=None):
        return await engine.agenerate(ids, params, images=images)

    async def play():
        out = []
        for seed in seeds:
            spec = EpisodeSpec(id=f"agent-{seed}", env_id="k3rl/Agent-v0", seed=seed,
                               env_kwargs=dict(cfg.envs.train[0].kwargs))
            out.append(await run_episode(lambda s=spec: make_env(s, cfg, template), spec, generate, template,
                                         sampling, max_turns=4, max_context_tokens=1024))
        return out

    return asyncio.run(play())


def test_the_openai_loop_agent_plays_and_its_episode_is_the_tokens_it_sampled(engine):
    trajs = episodes(engine, f"{LOOP}:solve", range(5))
    assert all(t.error is None and t.terminated and not t.truncated for t in trajs), [t.error for t in trajs]
    for t in trajs:
        # a lookup call, its result, the answer: one context, every sampled token trained once
        assert t.metadata["model_calls"] == 2 and t.segment_starts == [] and t.metadata["divergences"] == 0
        assert t.num_generated == sum(t.loss_mask) > 0 and all(v == 0 for v in t.versions if v >= 0)
        assert t.timings["agent_s"] > 0 and t.timings["generate_s"] > 0
    # the demo's warm start plays KeyLookup's harness form about as well as KeyLookup (0.66 held out)
    assert sum(t.reward for t in trajs) / len(trajs) >= 0.3


@pytest.mark.parametrize("agent, error", [
    ("raising_agent", "RuntimeError: the harness broke on task lookup-3"),
    ("wordy_agent", "TypeError: the agent returned 'good'"),
    ("silent_agent", "without calling the model"),
])
def test_an_agent_that_fails_fails_its_episode_with_its_traceback(engine, agent, error):
    (t,) = episodes(engine, f"test_agent_env:{agent}", [3])
    assert t.error and error in t.error and t.reward == 0.0 and t.metadata["failed_at"] == "agent"
    if agent == "raising_agent":
        assert "raising_agent" in t.metadata["traceback"]


@pytest.mark.parametrize("kwargs, message", [
    ({"agent": "no_colon", "tasks": f"{LOOP}:task"}, "envs.train.kwargs.agent 'no_colon' must be 'module:attribute'"),
    ({"agent": "nowhere_pkg:solve", "tasks": f"{LOOP}:task"}, "cannot import 'nowhere_pkg'"),
    ({"agent": f"{LOOP}:solve", "tasks": f"{LOOP}:TASKS"}, "has no 'TASKS'"),
])
def test_a_bad_agent_or_tasks_path_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AgentEnv(**kwargs)


def test_tasks_are_json_dicts_drawn_from_the_seed():
    env = AgentEnv(agent=f"{LOOP}:solve", tasks=f"{LOOP}:task")
    obs, info = env.reset(seed=5)
    again, _ = env.reset(seed=5)
    assert obs == again and info["task_id"] == "lookup-5" and info["task"]["key"] in info["task"]["table"]
    with pytest.raises(RuntimeError, match="driven by its agent"):
        env.step("anything")


def test_a_harness_that_compacts_its_history_trains_as_segments(engine):
    trajs = episodes(engine, "k3rl.examples.agents.compacting_agent:solve", range(2))
    assert all(t.error is None for t in trajs), [t.error for t in trajs]
    for t in trajs:
        calls = t.metadata["model_calls"]
        # each call after the first saw a rewritten history: a segment of its own, beginning with that prompt
        assert calls >= 2 and len(t.segment_starts) == calls - 1
        assert t.num_generated == sum(t.loss_mask) and t.segments()[-1].loss_mask.count(1) > 0


def test_a_sandboxed_agent_plays_inside_a_sandbox_that_has_no_network(engine):
    """sandboxed: true: the example agent (plain HTTP, its tool a process over a file in the sandbox) plays
    inside the sandbox through the relayed loopback port; a check agent sees only `lo` there."""
    trajs = episodes(engine, "k3rl.examples.agents.sandboxed_agent:solve", range(2), sandboxed=True)
    assert all(t.error is None and t.terminated for t in trajs), [t.error for t in trajs]
    assert all(t.metadata["model_calls"] == 2 and t.num_generated == sum(t.loss_mask) > 0 for t in trajs)
    assert sum(t.reward for t in trajs) >= 1  # the warm start answers from the sandbox's tool output
    (checked,) = episodes(engine, "agents_in_sandbox:lo_only_agent", [0], sandboxed=True)
    assert checked.error is None and checked.reward == 1.0 and checked.metadata["model_calls"] == 1
    (failed,) = episodes(engine, "agents_in_sandbox:raising_agent", [3], sandboxed=True)
    assert failed.metadata["failed_at"] == "agent"
    assert "ValueError: broke inside the sandbox on lookup-3" in failed.error
