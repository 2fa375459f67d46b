"""Each agentic env of examples/agent.yaml needs what it claims to need, shown with a real policy: the careful
phase of the warm start's SFT (examples/agent_careful, k3-tiny: every env solved, where the stored warm start
ends careless so that RL has choices to learn) plays held-out tasks greedily through the episode loop and the
embedded engine; it solves them with the modality and fails without it.

* ScreenRead (vision in the loop): the value is only in the screenshot. With the pixels blanked the policy
  still calls `show` and answers, but the 2-digit value it must read is a guess.
* PythonTool, family mul (code in the sandbox): a 2-digit product. Without the tool (`tool_available=False`:
  the call returns nothing) no answer is exact.
* LongHorizon, goal codes (long horizon): the trail is longer than the context. With compaction the
  episodes reach the trail's last file; without it (`rollout.context.strategy: none`) every episode
  overflows the context and earns nothing.

What each env's numbers are with that policy: `python experiments/agent_greedy.py examples/agent_careful
--ablate` (experiments/results/agent/README.md has them: ScreenRead 1.00 / blanked 0.12, PythonTool 0.94 / no
tool 0.00, LongHorizon 0.50 (reward 0.75) / no compaction 0.00).
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from k3rl.config import JobConfig
from k3rl.examples import path as example_path
from k3rl.model import load_hf
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.episode import EpisodeSpec, job_limits, job_sampling, make_env, make_template, run_episode
from k3rl.rollout.scheduler import EVAL_SEED_BASE

pytestmark = pytest.mark.slow
TASKS = 16  # held-out tasks per env and setting


def play_all() -> dict:
    """Every setting's episodes (about 2 minutes of one core): a background job (tests/background.py), run
    beside the suite while it goes on; the tests assert on what it returns."""
    return {"seen": play(0), "blank": play(0, blank_images=True),
            "ran": play(1), "without": play(1, tool_available=False),
            "summarized": play(2), "overflowed": play(2, ["rollout.context.strategy=none"])}


BACKGROUND_JOBS = {"ablations": lambda out: play_all}


@functools.cache
def engine() -> EmbeddedEngine:
    torch.manual_seed(0)
    return EmbeddedEngine(load_hf(example_path("agent_careful"), dtype=torch.float32), max_num_seqs=TASKS)


def play(env_index: int, overrides: list[str] = (), **env_kwargs) -> list:
    """`TASKS` greedy episodes of examples/agent.yaml's eval env `env_index` (held-out tasks), all at once."""
    cfg = JobConfig.load(example_path("agent.yaml"), ["sandbox.backend=auto", *overrides])
    env_cfg = cfg.envs.eval[env_index]
    template = make_template(cfg)
    eng = engine()

    async def generate(ids, sampling, images=None, key=None, group_key=None):
        return await eng.agenerate(ids, sampling, images=images)

    async def one(i: int):
        spec = EpisodeSpec(id=f"ablation-{env_index}-{i}", env_id=env_cfg.id, seed=EVAL_SEED_BASE + 7919 * i,
                           group_id=f"ablation-{i}", env_kwargs={**env_cfg.kwargs, **env_kwargs},
                           sampling={"temperature": 0.0})
        sampling = job_sampling(cfg).model_copy(update={"temperature": 0.0})
        return await run_episode(lambda: make_env(spec, cfg, template), spec, generate, template, sampling,
                                 **job_limits(cfg))

    async def all_():
        return await asyncio.gather(*(one(i) for i in range(TASKS)))

    return asyncio.run(all_())


def success(episodes) -> float:
    return sum(t.reward >= 0.999 and not t.error for t in episodes) / len(episodes)


def read_rate(episodes) -> float:
    """Of the ScreenRead episodes that showed the requested panel (reward parts 0.25 valid + 0.25 requested),
    the share that answered its value (+ 0.5): how often the policy reads the digits it was shown."""
    looked = [t for t in episodes if t.reward >= 0.5 - 1e-6 and not t.error]
    return sum(t.reward >= 1 - 1e-6 for t in looked) / max(len(looked), 1)


@pytest.mark.background("ablations")
def test_screen_read_needs_the_screenshot(require_sandbox, background_job):
    require_sandbox()
    seen, blank = background_job[0]["seen"], background_job[0]["blank"]
    assert all(not t.error for t in seen + blank), [t.error for t in seen + blank if t.error]
    # it opens the requested panel and reads the value it shows
    assert sum(t.reward >= 0.5 - 1e-6 for t in seen) >= 12 and read_rate(seen) >= 0.6, [t.reward for t in seen]
    # blanked: it still opens the requested panel, but the 2-digit value is a guess (chance 1 in 90; the
    # policy's favourite guesses matched 2 of 16)
    assert sum(t.reward >= 0.5 - 1e-6 for t in blank) >= 12, [t.reward for t in blank]
    assert success(blank) <= 3 / TASKS and success(seen) - success(blank) >= 0.5, \
        ([t.reward for t in seen], [t.reward for t in blank])


@pytest.mark.background("ablations")
def test_python_mul_needs_the_sandboxed_tool(require_sandbox, background_job):
    require_sandbox()
    ran, without = background_job[0]["ran"], background_job[0]["without"]
    assert success(ran) >= 0.5, [t.reward for t in ran]
    assert success(without) == 0.0, [t.reward for t in without]


@pytest.mark.background("ablations")
def test_long_horizon_needs_compaction(require_sandbox, background_job):
    require_sandbox()
    summarized, overflowed = background_job[0]["summarized"], background_job[0]["overflowed"]
    # compaction carries the trails to their end: most episodes answer after a summary, and the last code,
    # which only the trail's last file holds, earns its half (the first code, carried through the policy's
    # notes and summaries, earns the other: half of the episodes have both)
    compacted = [t for t in summarized if any(turn.compaction == "summary" for turn in t.turns)]
    answered = [t for t in compacted if not t.truncated]
    assert len(answered) >= TASKS // 2 and sum(t.reward for t in summarized) / TASKS >= 0.2, \
        [(t.truncated, t.metadata.get("truncated_by"), t.reward) for t in summarized]
    # without compaction the trail overflows the context (a policy may answer one or two early instead,
    # with one digit of its two right)
    assert sum(t.truncated and t.metadata.get("truncated_by") == "context" for t in overflowed) >= TASKS - 2, \
        [(t.truncated, t.metadata.get("truncated_by"), t.reward) for t in overflowed]
    assert success(overflowed) == 0.0 and sum(t.reward for t in overflowed) / TASKS < 0.1, \
        [t.reward for t in overflowed]
