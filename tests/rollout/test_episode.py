"""The episode loop: token in / token out with real envs, their scripted oracles or the embedded
engine behind `generate`; how episodes end (terminated, truncated, failed) and per-request seeds."""

import asyncio
import time

import gymnasium
import pytest

import k3rl.envs  # noqa: F401
from k3rl.chat import ChatTemplate, Message
from k3rl.envs import ToolEnv, tool
from k3rl.envs.actions import encode_with_specials
from k3rl.rollout.engine import GenerationResult
from k3rl.rollout.episode import EpisodeSpec, request_seed, run_episode, run_oracle_episode, scripted_generate
from k3rl.types import SamplingParams

SPEC = EpisodeSpec(id="run-g0000001-s0", env_id="k3rl/KeyLookup-v0", seed=11, group_id="run-g0000001")


class Made:
    """A make_env that keeps the env it made (the tests look at its task and history)."""

    def __init__(self, env_id="k3rl/KeyLookup-v0", template=None, **kw):
        self.env_id, self.kw, self.template = env_id, kw, template or ChatTemplate()
        self.env = None

    def __call__(self):
        self.env = gymnasium.make(self.env_id, template=self.template, **self.kw)
        return self.env


def oracle_generate(made, version=3, finish="stop", mangle=None, calls=None):
    """The env's oracle as the model: log-prob -0.5 and policy version `version` on every token."""

    async def generate(token_ids, sampling, images=None, key=None, group_key=None):
        if calls is not None:
            calls.append({"ids": list(token_ids), "sampling": sampling, "key": key, "group_key": group_key})
        ids = encode_with_specials(made.template, made.env.unwrapped.oracle())
        ids = mangle(ids) if mangle else ids
        cut = len(ids) > sampling.max_tokens  # as an engine: never more than max_tokens
        ids = ids[:sampling.max_tokens]
        return GenerationResult("r", ids, [-0.5] * len(ids), [version] * len(ids), "length" if cut else finish,
                                len(token_ids))

    return generate


def run(made, generate, spec=SPEC, sampling=None, **limits):
    limits = {"max_turns": 4, "max_context_tokens": 4096, **limits}
    return asyncio.run(run_episode(made, spec, generate, made.template, sampling or SamplingParams(max_tokens=400),
                                   **limits))


def test_oracle_episode_is_token_exact_and_masked():
    made, calls = Made(), []
    traj = run(made, oracle_generate(made, calls=calls))
    env = made.env.unwrapped
    assert traj.error is None and traj.reward == 1.0 and traj.terminated and not traj.truncated
    # what the engine saw each turn is exactly the trajectory's prefix (nothing re-tokenised)
    for c in calls:
        assert traj.token_ids[: len(c["ids"])] == c["ids"]
    # the whole conversation rendered from scratch is the trajectory's token stream
    assert made.template.render(env.history, tools=env.tools or None, add_generation_prompt=False).ids == traj.token_ids
    # generated tokens carry the engine's log-probs and version; everything else is masked out
    gen = [i for i, m in enumerate(traj.loss_mask) if m]
    assert all(traj.logprobs[i] == -0.5 and traj.versions[i] == 3 for i in gen)
    assert all(traj.versions[i] == -1 and traj.logprobs[i] == 0.0 for i, m in enumerate(traj.loss_mask) if not m)
    assistant = [t for t in traj.turns if t.role == "assistant"]
    assert len(assistant) == 2 and assistant[0].tool_calls[0].name == "lookup" and assistant[1].text == env.task.value
    assert [t.role for t in traj.turns] == ["user", "assistant", "tool", "assistant"]
    assert traj.turns[2].text == env.task.value and traj.task_id == env.task.id
    assert traj.turns[2].duration_s > 0  # the tool call's own time (the trace's tool span)
    for t in traj.turns:
        assert 0 <= t.start <= t.end <= len(traj.token_ids)
    assert traj.turns[-1].end == len(traj.token_ids)
    # requests: sticky by episode, the group key on the first turn only, the stop token added
    assert [c["key"] for c in calls] == [SPEC.id] * 2 and [c["group_key"] for c in calls] == [SPEC.group_id, None]
    assert made.template.stop_token_id in calls[0]["sampling"].stop_token_ids
    assert not env.active  # closed by the loop


def test_malformed_output_is_shown_to_the_model_and_counts_as_a_turn():
    made = Made()
    traj = run(made, oracle_generate(made, mangle=lambda ids: ids[3:]), max_turns=2)
    assistant = [t for t in traj.turns if t.role == "assistant"]
    assert len(assistant) == 2 and all("malformed assistant message" in t.error for t in assistant)
    errors = [t for t in traj.turns if t.role == "user" and "could not be parsed" in t.text]
    assert len(errors) == 2 and traj.truncated and traj.reward == 0.0 and traj.error is None
    assert traj.metadata["truncated_by"] == "max_turns" and traj.num_generated > 0
    assert traj.metadata["parse_errors"] == 2  # counted for episodes/format_error_rate
    from k3rl.metrics import episode_stats, step_metrics

    other = Made()
    good = run(other, oracle_generate(other))
    assert "parse_errors" not in good.metadata
    stats = [{**episode_stats(t), "min_version": 0, "max_version": 0} for t in (traj, good)]
    assert step_metrics(stats, step=1)["episodes/format_error_rate"] == 0.5


def test_a_message_cut_by_max_tokens_is_a_truncation_not_an_error():
    made = Made()
    traj = run(made, oracle_generate(made, finish="length", mangle=lambda ids: ids[:10]))
    assert traj.truncated and traj.error is None and traj.reward == 0.0
    assert traj.metadata["truncated_by"] == "max_tokens" and "failed_at" not in traj.metadata
    assert "cut at 400 tokens" in traj.turns[-1].error and traj.num_generated == 10


def test_context_filling_up_mid_episode_is_a_truncation():
    made, calls = Made(), []
    traj = run(made, oracle_generate(made, calls=calls), max_context_tokens=120)
    assert traj.truncated and traj.error is None and traj.metadata["truncated_by"] == "context"
    assert all(len(c["ids"]) + c["sampling"].max_tokens <= 120 for c in calls)
    assert len(traj.token_ids) <= 120
    assert traj.turns[-1].role == "assistant" and "cut at" in traj.turns[-1].error
    # the tool's answer leaves no room for the next generation prefix: the episode ends after it
    full = run(made, oracle_generate(made))
    tool_end = full.turns[2].end
    made = Made()
    traj = run(made, oracle_generate(made), max_context_tokens=tool_end + len(made.template.generation_prefix()))
    assert traj.truncated and traj.metadata["truncated_by"] == "context" and traj.error is None
    assert traj.turns[-1].role == "tool" and len(traj.token_ids) == tool_end


def test_first_prompt_over_the_context_is_a_failure():
    made, calls = Made(), []
    traj = run(made, oracle_generate(made, calls=calls), max_context_tokens=20)
    assert calls == [] and traj.metadata["failed_at"] == "context" and traj.reward == 0.0
    assert traj.error == f"ContextLimitError: the first prompt is {len(traj.prompt_ids)} tokens, over " \
                         "max_context_tokens=20: no room for a reply"
    assert (traj.id, traj.env_id, traj.seed, traj.group_id) == (SPEC.id, SPEC.env_id, SPEC.seed, SPEC.group_id)


class Fragile(ToolEnv):
    """A test env that fails where it is told to."""

    def __init__(self, fail_in="", **kw):
        if fail_in == "init":
            raise OSError("no such dataset")
        self.fail_in = fail_in
        super().__init__(**kw)

    def generate_task(self, rng, options):
        if self.fail_in == "reset":
            raise ValueError("the task source is down")
        return int(rng.integers(100))  # no `id`: str(task) names it

    def opening_messages(self, task):
        return [Message(role="user", content=f"wait, then answer {task}")]

    @tool
    def wait(self, seconds: float) -> str:
        """Sleep."""
        time.sleep(seconds)
        if self.fail_in == "tool":
            from k3rl.sandboxes import SandboxDeadError

            raise SandboxDeadError("sandbox sb-1 died (killed from outside)")
        return "done"

    def score(self, final_text):
        return float(final_text == str(self.task))

    def oracle(self, history=None):
        return self.say(tool_calls=[{"name": "wait", "arguments": {"seconds": 0.05}}]) if self.turn == 0 else \
            self.say(str(self.task))


gymnasium.register("k3rltest/Fragile-v0", entry_point=Fragile)


@pytest.mark.parametrize(("fail_in", "failed_at", "error"), [
    ("init", "make_env", "OSError: no such dataset"),
    ("reset", "reset", "ValueError: the task source is down"),
    ("tool", "step", "SandboxDeadError: sandbox sb-1 died (killed from outside)"),
])
def test_env_failures_are_recorded_not_raised(fail_in, failed_at, error):
    made = Made("k3rltest/Fragile-v0", fail_in=fail_in)
    spec = EpisodeSpec(id="f-1", env_id="k3rltest/Fragile-v0", seed=4, group_id="g")
    traj = asyncio.run(run_episode(made, spec, scripted_generate(made.template, lambda: made.env.unwrapped.oracle()),
                                   made.template, SamplingParams(), max_turns=4, max_context_tokens=4096))
    assert (traj.error, traj.metadata["failed_at"], traj.reward) == (error, failed_at, 0.0)
    assert not traj.terminated and not traj.truncated and "Traceback" in traj.metadata["traceback"]
    assert (traj.id, traj.env_id, traj.seed, traj.group_id) == ("f-1", "k3rltest/Fragile-v0", 4, "g")
    if made.env is not None:
        assert not made.env.unwrapped.active


def test_a_task_without_an_id_is_named_by_its_str():
    traj = run_oracle_episode("k3rltest/Fragile-v0", seed=4)
    assert traj.reward == 1.0 and traj.task_id == traj.turns[0].text.split()[-1]


def test_engine_errors_and_aborts_are_failures():
    made = Made()

    async def dead(token_ids, sampling, **kw):
        raise RuntimeError("request r1 failed on 4 workers")

    async def aborted(token_ids, sampling, **kw):
        return GenerationResult("r", [5, 6], [-1.0, -1.0], [1, 1], "abort", len(token_ids))

    traj = run(made, dead)
    assert (traj.error, traj.metadata["failed_at"]) == ("RuntimeError: request r1 failed on 4 workers", "generate")
    assert traj.prompt_ids and not traj.completion_ids
    traj = run(made, aborted)
    assert traj.metadata["failed_at"] == "generate" and "finish_reason 'abort'" in traj.error


def test_time_budget_bounds_a_slow_tool_and_a_slow_engine():
    made = Made("k3rltest/Fragile-v0")
    spec = EpisodeSpec(id="slow", env_id="k3rltest/Fragile-v0", seed=0)
    slow_tool = scripted_generate(made.template, lambda: made.env.unwrapped.say(
        tool_calls=[{"name": "wait", "arguments": {"seconds": 3}}]))
    traj = asyncio.run(run_episode(made, spec, slow_tool, made.template, SamplingParams(), max_turns=4,
                                   max_context_tokens=4096, time_budget_s=0.5))
    assert traj.timings["episode_s"] < 2  # the loop does not wait for the tool to finish
    assert traj.metadata["failed_at"] == "time_budget" and traj.error.startswith("TimeBudgetError: ")

    async def stuck(token_ids, sampling, **kw):
        await asyncio.sleep(60)

    traj = asyncio.run(run_episode(made, spec, stuck, made.template, SamplingParams(), max_turns=4,
                                   max_context_tokens=4096, time_budget_s=0.3))
    assert traj.metadata["failed_at"] == "time_budget" and traj.timings["episode_s"] < 2


def test_cancellation_propagates_after_closing_the_env():
    made = Made()
    started = asyncio.Event()

    async def forever(token_ids, sampling, **kw):
        started.set()
        await asyncio.sleep(60)

    async def main():
        task = asyncio.create_task(run_episode(made, SPEC, forever, made.template, SamplingParams(),
                                               max_turns=4, max_context_tokens=4096))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not made.env.unwrapped.active


def test_the_envs_own_turn_limit_ends_the_episode():
    made = Made(max_turns=1)
    traj = run(made, oracle_generate(made))
    assert traj.truncated and traj.metadata["truncated_by"] == "max_turns" and traj.num_turns == 1


def test_request_seeds_are_per_episode_and_turn_but_not_per_run():
    other_run = EpisodeSpec(id="other-g0000001-s0", env_id=SPEC.env_id, seed=11, group_id="other-g0000001")
    sibling = EpisodeSpec(id="run-g0000001-s1", env_id=SPEC.env_id, seed=11, group_id="run-g0000001")
    assert request_seed(SPEC, 0) == request_seed(other_run, 0)
    seeds = {request_seed(SPEC, 0), request_seed(SPEC, 1), request_seed(sibling, 0), request_seed(SPEC, 0, base=7)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)


def test_same_episode_samples_the_same_tokens_on_the_embedded_engine():
    """Two runs of a group against fresh engines (same init), under different run names: the same
    tokens (the per-request seeds); the two members of the group sample differently."""
    import torch

    from k3rl.config import JobConfig
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.episode import make_template

    torch.set_num_threads(1)
    template = make_template(JobConfig())

    def group(run_name):
        engine = EmbeddedEngine.from_preset("k3-tiny", seed=0)

        async def generate(token_ids, sampling, images=None, key=None, group_key=None):
            return await engine.agenerate(token_ids, sampling, images)

        async def both():
            specs = [EpisodeSpec(id=f"{run_name}-g0000003-s{k}", env_id="k3rl/KeyLookup-v0", seed=5,
                                 group_id=f"{run_name}-g0000003") for k in range(2)]
            return await asyncio.gather(*(run_episode(Made(template=template), s, generate, template,
                                                      SamplingParams(max_tokens=12), max_turns=2,
                                                      max_context_tokens=512) for s in specs))

        try:
            return asyncio.run(both())
        finally:
            engine.close()

    first, second = group("a"), group("b")
    assert all(t.error is None and t.num_generated > 0 for t in first + second)
    for x, y in zip(first, second, strict=True):
        assert x.completion_ids == y.completion_ids
        # fp32 log-probs of a batch of two may round differently from run to run (batch composition)
        assert x.logprobs == pytest.approx(y.logprobs, rel=1e-5, abs=1e-5)
    assert first[0].completion_ids != first[1].completion_ids
