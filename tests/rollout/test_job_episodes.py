"""A job's episodes: the env a JobConfig makes, the start-of-job checks (preflight) and the SFT
warm start's oracle demonstrations, all through the episode loop."""

import time

import gymnasium
import pytest

import k3rl.envs  # noqa: F401
from k3rl.config import JobConfig
from k3rl.envs import ToolEnv
from k3rl.envs.key_lookup import KeyLookupEnv
from k3rl.rollout.episode import EpisodeSpec, make_env, make_template
from k3rl.rollout.job_start import (
    PreflightError,
    collect_demonstration_sets,
    collect_demonstrations,
    preflight,
)


def job(**sections) -> JobConfig:
    data = {"envs": {"train": [{"id": "k3rl/KeyLookup-v0"}], "max_turns": 3}}
    for key, value in sections.items():
        section, _, name = key.partition("__")
        data.setdefault(section, {})
        if name:
            data[section][name] = value
        else:
            data[section] = value
    return JobConfig.from_dict(data)


class NoOracle(KeyLookupEnv):
    oracle = ToolEnv.oracle  # no scripted policy


class Broken(KeyLookupEnv):
    def opening_messages(self, task):
        raise FileNotFoundError("tasks.json")


gymnasium.register("k3rltest/NoOracle-v0", entry_point=NoOracle)
gymnasium.register("k3rltest/Broken-v0", entry_point=Broken)


def test_a_tool_env_gets_the_jobs_settings_and_a_plain_env_only_its_kwargs():
    cfg = job(envs__max_turns=5, envs__episode_time_budget_s=30.0)
    template = make_template(cfg)
    env = make_env(EpisodeSpec("e", "k3rl/KeyLookup-v0", 0, env_kwargs={"num_keys": 2}), cfg, template).unwrapped
    assert (env.max_turns, env.time_budget_s, env.template, env.num_keys) == (5, 30.0, template, 2)
    env = make_env(EpisodeSpec("e", "k3rl/KeyLookup-v0", 0, env_kwargs={"max_turns": 1}), cfg, template).unwrapped
    assert env.max_turns == 1  # the env's own kwargs win
    plain = make_env(EpisodeSpec("e", "CartPole-v1", 0), cfg, template)  # would fail on a template kwarg
    assert plain.unwrapped.spec.id == "CartPole-v1"


def test_preflight_passes_a_job_that_fits():
    preflight(job(learner__sft_steps=2, rollout__sampling={"max_tokens_per_turn": 128}))


def test_preflight_refuses_a_first_prompt_over_the_context():
    cfg = job(envs__train=[{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 26}}], rollout__max_context_tokens=64)
    with pytest.raises(PreflightError, match=r"^k3rl/KeyLookup-v0: the first prompt is (\d+) tokens, over "
                                             r"rollout.max_context_tokens=64; raise it or shorten the env's opening$"):
        preflight(cfg)


def test_preflight_refuses_oracle_messages_over_max_tokens_per_turn():
    cfg = job(learner__sft_steps=2, rollout__sampling={"max_tokens_per_turn": 16})
    with pytest.raises(PreflightError, match=r"k3rl/KeyLookup-v0: an oracle message is \d+ tokens, over "
                                             r"rollout.sampling.max_tokens_per_turn=16; raise it"):
        preflight(cfg)
    # the first message (the tool call, over 100 tokens) is longer than the answer: it is measured too
    with pytest.raises(PreflightError, match=r"an oracle message is 1\d\d tokens, over rollout.sampling.max_tokens_per_turn=40"):
        preflight(job(learner__sft_steps=2, rollout__sampling={"max_tokens_per_turn": 40}))
    preflight(job(learner__sft_steps=0, rollout__sampling={"max_tokens_per_turn": 16}))  # no SFT: no oracle needed


def test_preflight_refuses_sft_without_an_oracle_and_envs_that_cannot_start():
    with pytest.raises(PreflightError, match=r"k3rltest/NoOracle-v0: learner.sft_steps=3 warm-starts on oracle "
                                             r"demonstrations, but the env has no oracle .*set learner.sft_steps=0"):
        preflight(job(learner__sft_steps=3, envs__train=[{"id": "k3rltest/NoOracle-v0"}]))
    preflight(job(envs__train=[{"id": "k3rltest/NoOracle-v0"}]))
    with pytest.raises(PreflightError, match=r"k3rltest/Broken-v0 \(kwargs \{\}\) cannot be made and reset at 3 "
                                             r"seeds \(seed 0: FileNotFoundError: tasks.json; seed \d+: "):
        preflight(job(envs__train=[{"id": "k3rltest/Broken-v0"}]))
    with pytest.raises(PreflightError, match=r"oracle episode for the SFT warm start was truncated by max_turns "
                                             r"\(envs.max_turns=1\); raise envs.max_turns"):
        preflight(job(learner__sft_steps=1, envs__max_turns=1, rollout__sampling={"max_tokens_per_turn": 128}))


def test_preflight_retries_a_flaky_reset_and_refuses_a_hanging_one():
    """A reset that fails at learner.seed (a transient failure) is tried at other seeds, and the job starts
    with a warning; a reset that does not return within envs.episode_time_budget_s refuses the job in that
    time instead of hanging the driver."""
    flaky = {"id": "faulty/FlakyLookup-v0", "kwargs": {"num_keys": 2, "tool_failure": 0.0, "reset_fails": 0.25}}
    cfg = job(envs__train=[flaky], envs__imports=["faulty_envs"], learner__seed=7)  # seed 7 % 1000 < 250: fails
    with pytest.warns(UserWarning, match=r"faulty/FlakyLookup-v0: reset failed at seed 7: RuntimeError: injected: "
                                         r"reset failed for seed 7, then worked at seed \d+: a flaky env"):
        preflight(cfg)
    always = {**flaky, "kwargs": {**flaky["kwargs"], "reset_fails": 1.0}}
    with pytest.raises(PreflightError, match=r"cannot be made and reset at 3 seeds \(seed 7: RuntimeError"):
        preflight(job(envs__train=[always], envs__imports=["faulty_envs"], learner__seed=7))
    hangs = {**flaky, "kwargs": {**flaky["kwargs"], "reset_hangs_s": 30.0}}
    t0 = time.monotonic()
    with pytest.raises(PreflightError, match=r"making and resetting it at seed 7 did not return within "
                                             r"envs.episode_time_budget_s=1s; its reset hangs"):
        preflight(job(envs__train=[hangs], envs__imports=["faulty_envs"], learner__seed=7,
                      envs__episode_time_budget_s=1.0))
    assert time.monotonic() - t0 < 10


def test_demonstrations_are_oracle_episodes_token_exact():
    cfg = job(envs__train=[{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 2}}],
              rollout__sampling={"max_tokens_per_turn": 128})
    demos = collect_demonstrations(cfg, "run", 3)
    template = make_template(cfg)
    assert [d.id for d in demos] == [f"run-demo-g{i:07d}-s0" for i in range(3)]
    assert len({d.seed for d in demos}) == 3
    for d in demos:
        assert d.error is None and d.terminated and d.reward == 1.0 and d.num_turns == 2
        assert d.metadata["env_kwargs"] == {"num_keys": 2}
        said = [t for t in d.turns if t.role == "assistant"]
        trained = [tok for tok, m in zip(d.completion_ids, d.loss_mask, strict=True) if m]
        assert trained == template.assistant_body("", said[0].tool_calls, None) + \
            template.assistant_body(said[1].text, [], None)
    assert [d.completion_ids for d in collect_demonstrations(cfg, "run", 3)] == [d.completion_ids for d in demos]
    with pytest.raises(RuntimeError, match="did not finish .*truncated by max_tokens"):
        collect_demonstrations(job(rollout__sampling={"max_tokens_per_turn": 16}), "run", 1)


def test_preflight_refuses_a_checkpoint_that_is_missing_or_of_another_architecture(tmp_path):
    from k3rl.model import build_model, save_hf

    with pytest.raises(PreflightError, match=r"^model.checkpoint: .*nowhere does not exist; point it at"):
        preflight(job(model={"checkpoint": str(tmp_path / "nowhere")}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match=r"^model.checkpoint: .*empty holds no config.json; point it at"):
        preflight(job(model={"checkpoint": str(tmp_path / "empty")}))
    save_hf(build_model("k3-tiny", seed=0), tmp_path / "tiny")
    preflight(job(model={"checkpoint": str(tmp_path / "tiny")}))  # the architecture it was written for
    with pytest.raises(PreflightError, match=r"was written for another architecture than model.preset='k3-tiny' "
                                             r"with model.overrides: .*hidden_size \(checkpoint 128, model 96\)"):
        preflight(job(model={"checkpoint": str(tmp_path / "tiny"), "overrides": {"hidden_size": 96}}))


def test_sft_phases_demonstrate_the_same_tasks_with_their_env_kwargs_and_preflight_checks_them():
    """learner.sft_phases: each phase's demonstrations are envs.train's tasks (same seeds) with the phase's
    kwargs merged in: here KeyLookup's careless oracle, which looks up the other key in some episodes."""
    phases = [{"from_step": 2, "env_kwargs": {"oracle_wrong_key": 1.0}}]
    cfg = job(envs__train=[{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 2}}],
              learner__sft_steps=4, learner__sft_phases=phases, rollout__sampling={"max_tokens_per_turn": 128})
    careful, careless = collect_demonstration_sets(cfg, "run", 4)
    assert [d.metadata["env_kwargs"] for d in careless] == [{"num_keys": 2, "oracle_wrong_key": 1.0}] * 4
    assert [d.prompt_ids for d in careless] == [d.prompt_ids for d in careful]  # the same tasks
    assert all(d.reward == 1.0 for d in careful) and all(d.reward < 1.0 for d in careless)
    preflight(cfg)
    # a curriculum: a first phase at step 0 on ScreenRead alone replaces the all-envs start (its set is
    # empty); the phase after it demonstrates both envs
    both = [{"id": "k3rl/KeyLookup-v0", "kwargs": {"num_keys": 2}}, {"id": "k3rl/ScreenRead-v0"}]
    phases = [{"from_step": 0, "envs": ["k3rl/ScreenRead-v0"]}, {"from_step": 2, "lr": 1e-3}]
    cfg = job(envs__train=both, learner__sft_steps=4, learner__sft_phases=phases,
              rollout__sampling={"max_tokens_per_turn": 128})
    start, first, later = collect_demonstration_sets(cfg, "run", 4)
    assert start == [] and {d.env_id for d in first} == {"k3rl/ScreenRead-v0"}
    assert {d.env_id for d in later} == {"k3rl/KeyLookup-v0", "k3rl/ScreenRead-v0"}
    assert all(d.reward == 1.0 for d in first + later)
    preflight(cfg)
    bad = job(learner__sft_steps=4, learner__sft_phases=[{"from_step": 1, "env_kwargs": {"no_such_kwarg": 1}}],
              rollout__sampling={"max_tokens_per_turn": 128})
    with pytest.raises(PreflightError, match=r"^learner.sft_phases.0.env_kwargs: k3rl/KeyLookup-v0 with kwargs "
                                             r"\{'no_such_kwarg': 1\} cannot play an oracle episode: .*unexpected keyword "
                                             r"argument 'no_such_kwarg'"):
        preflight(bad)
