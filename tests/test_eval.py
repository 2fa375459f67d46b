"""Held-out evaluation (envs.eval): the pass@k estimator, seeds apart from training's, and a real
asynchronous job (k3-tiny, lag 2) whose every eval episode samples from one known policy version."""

import itertools
from pathlib import Path

import pytest

from k3rl.config import JobConfig
from k3rl.metrics import eval_metrics, pass_at_k
from k3rl.rollout.job_start import demonstration_spec
from k3rl.rollout.scheduler import EVAL_SEED_BASE, episode_specs, eval_seed, heldout_groups

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo_from_scratch.yaml"


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_success():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 succeeded
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    for bad in ((4, 5, 2), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def test_eval_metrics_greedy_success_reward_and_pass_at_k():
    def ep(reward, error=None):
        return {"reward": reward, "error": error}

    tasks = [[ep(1.0), ep(0.0), ep(1.0), ep(0.0), ep(0.0)],      # greedy solves it; 1 of 4 samples
             [ep(0.5), ep(0.0), ep(0.0), ep(0.0, "boom"), ep(0.0)],  # greedy half credit; no sample
             [ep(0.0, "x"), ep(1.0), ep(1.0), ep(1.0), ep(1.0)]]    # greedy failed; every sample
    m = eval_metrics("KeyLookup-v0", 2, tasks, version=7)
    assert m["eval/KeyLookup-v0/success"] == pytest.approx(1 / 3)
    assert m["eval/KeyLookup-v0/reward"] == pytest.approx(1.5 / 3)
    assert m["eval/KeyLookup-v0/pass_at_2"] == pytest.approx((pass_at_k(4, 1, 2) + 0 + 1) / 3)
    assert m["eval/KeyLookup-v0/pass_at_1"] == pytest.approx((1 / 4 + 0 + 1) / 3)  # the samples' success rate
    assert m["eval/KeyLookup-v0/failed"] == 2 and m["eval/policy_version"] == 7


def test_eval_seeds_are_apart_from_every_training_and_demonstration_seed():
    cfg = JobConfig.load(DEMO, ["envs.eval.0.id=k3rl/KeyLookup-v0", "envs.eval.0.num_tasks=200",
                                "envs.eval.1.id=k3rl/KeyLookup-v0", "envs.eval.1.name=lookup-hard",
                                "envs.eval.1.kwargs.num_keys=4"])
    train = {episode_specs(cfg, "run", i, 1)[0]["seed"] for i in range(20_000)}
    train |= {demonstration_spec(cfg, "run", i).seed for i in range(cfg.learner.sft_episodes)}
    plan = heldout_groups(cfg, "run", step=3, version=4)
    used = [g.specs[0]["seed"] for _, groups in plan for g in groups]
    assert len(used) == 216
    # by construction: training draws randrange(2**31), eval EVAL_SEED_BASE + randrange(2**31)
    assert max(train) < EVAL_SEED_BASE <= min(used) and max(used) < 2 * EVAL_SEED_BASE
    assert not train & set(used)
    assert len(set(used[:200])) == 200  # the tasks of one spec are distinct
    # the held-out set is the same at every step and for every job seed: runs are compared on the same tasks
    other = JobConfig.load(DEMO, ["learner.seed=5", "envs.eval.0.id=k3rl/KeyLookup-v0", "envs.eval.0.num_tasks=200"])
    assert [g.specs[0]["seed"] for g in heldout_groups(other, "x", 9, 10)[0][1]] == used[:200]
    assert eval_seed("KeyLookup-v0", 0) == used[0]


def test_the_starting_policys_groups_are_apart_from_trainings():
    """learner.eval_before_training measures the starting policy on episodes of its own: the curve's step 0 once
    replayed training's first groups (same task seeds, so the same sampling seeds) and repeated step 1's reward."""
    from k3rl.rollout.episode import EpisodeSpec, request_seed

    cfg = JobConfig.load(DEMO)
    train = [episode_specs(cfg, "run", i, 1) for i in range(5000)]
    start = [episode_specs(cfg, "run-eval", i, 0, apart=True) for i in range(cfg.rollout.prompts_per_step)]
    train_seeds = {g[0]["seed"] for g in train}
    assert all(EVAL_SEED_BASE <= g[0]["seed"] < 2 * EVAL_SEED_BASE for g in start)
    assert not train_seeds & {g[0]["seed"] for g in start}
    sampled = {request_seed(EpisodeSpec(**{k: s[k] for k in ("id", "env_id", "seed", "group_id")}), 0)
               for g in train[:cfg.rollout.prompts_per_step] for s in g}
    assert not sampled & {request_seed(EpisodeSpec(**{k: s[k] for k in ("id", "env_id", "seed", "group_id")}), 0)
                          for g in start for s in g}
    # the same job measures the same starting episodes every time (apart from the run's name)
    assert [s["seed"] for s in episode_specs(cfg, "other-eval", 3, 0, apart=True)] == [s["seed"] for s in start[3]]


def test_heldout_groups_run_each_task_greedily_once_and_n_times_sampled():
    cfg = JobConfig.load(None, ["envs.eval_pass_k=2", "envs.eval.0.id=k3rl/KeyLookup-v0", "envs.eval.0.num_tasks=3",
                                "envs.eval.0.kwargs.num_keys=2", "envs.eval.1.id=k3rl/KeyLookup-v0",
                                "envs.eval.1.name=kl4", "envs.eval.1.pass_k=4", "envs.eval.1.num_tasks=1",
                                "envs.eval.1.samples=6"])
    (first, groups), (second, more) = heldout_groups(cfg, "run", step=10, version=11)
    assert first.metric_name == "KeyLookup-v0" and second.metric_name == "kl4"
    assert [len(g.specs) for g in groups] == [3, 3, 3] and [len(g.specs) for g in more] == [7]
    g = groups[1]
    assert g.id == "run-eval000010-KeyLookup-v0-t0001" and g.version == 11
    assert [s["id"].removeprefix(g.id) for s in g.specs] == ["-greedy", "-s0", "-s1"]
    assert g.specs[0]["sampling"] == {"temperature": 0.0} and all("sampling" not in s for s in g.specs[1:])
    assert {s["seed"] for s in g.specs} == {eval_seed("KeyLookup-v0", 1)} and g.specs[0]["env_kwargs"] == {"num_keys": 2}
    assert all(s["issued_version"] == 11 for s in g.specs)


def test_an_episode_specs_sampling_override_makes_it_greedy_with_the_real_engine():
    """The job samples at temperature 1; the spec's {"temperature": 0.0} makes its episode greedy: every
    token the argmax of the model's own forward, whatever the request seeds (the member ids) are."""
    import asyncio

    import torch

    from k3rl.model import K3Config, K3ForCausalLM
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.episode import EpisodeSpec, job_sampling, make_env, make_template, run_episode

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    engine = EmbeddedEngine(model, background=False)
    cfg = JobConfig.load(None, ["envs.max_turns=1", "rollout.sampling.max_tokens_per_turn=8"])
    template = make_template(cfg)
    assert job_sampling(cfg).temperature == 1.0

    async def generate(ids, sampling, images=None, key=None, group_key=None):
        return engine.generate(ids, sampling, images=images)

    def episode(member, **override):
        spec = EpisodeSpec(id=f"g-{member}", env_id="k3rl/KeyLookup-v0", seed=2**31 + 5, group_id="g", **override)
        return asyncio.run(run_episode(lambda: make_env(spec, cfg, template), spec, generate, template,
                                       job_sampling(cfg), max_turns=1, max_context_tokens=512))

    greedy = [episode(m, sampling={"temperature": 0.0}) for m in ("greedy", "s0")]
    sampled = [episode(m) for m in ("s0", "s1")]
    assert greedy[0].completion_ids == greedy[1].completion_ids and greedy[0].metadata["sampling"] == {"temperature": 0.0}
    assert sampled[0].completion_ids != sampled[1].completion_ids and "sampling" not in sampled[0].metadata
    t = greedy[0]
    with torch.no_grad():
        logits = model(torch.tensor([t.token_ids]))[0]
    P, n = len(t.prompt_ids), sum(t.loss_mask)  # the sampled tokens come first (one turn)
    assert n and t.completion_ids[:n] == [int(logits[P - 1 + i].argmax()) for i in range(n)]


def _async_eval_job(out: Path) -> JobConfig:
    return JobConfig.load(None, [
        "name=ev", "model.preset=k3-tiny", "rollout.group_size=2", "rollout.prompts_per_step=2",
        "rollout.max_policy_lag=2", "rollout.episodes_per_worker=8", "rollout.sampling.max_tokens_per_turn=16",
        "rollout.max_context_tokens=512", "rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_refills=1",
        "envs.max_turns=2", "learner.sft_steps=0", "learner.steps=3", "learner.checkpoint_every=0",
        "learner.micro_batch_tokens=2048", "learner.eval_before_training=true",
        "envs.eval.0.id=k3rl/KeyLookup-v0", "envs.eval.0.num_tasks=2", "envs.eval.0.pass_k=2",
        "tracking.eval_every=2", "tracking.sample_episodes=0", f"tracking.runs_dir={out}/runs",
        f"tracking.uri=sqlite:///{out}/runs/mlflow.db", "ray.num_cpus=4"])


# the job runs beside the suite (tests/background.py); the test asserts on what it returned and left
BACKGROUND_JOBS = {"async_eval": _async_eval_job}


@pytest.mark.slow
@pytest.mark.background("async_eval")
def test_async_job_evaluates_at_a_known_version_and_dynamic_sampling_bounds_its_refills(background_job):
    """lag 2: training episodes keep running across weight pushes, yet every token of the eval logged at
    step s comes from version s + 1, and eval episodes are stored as eval, never trained. The
    untrained policy earns 0 everywhere, so dynamic sampling drops at most max_refills x P groups a
    step and then trains on what it has."""
    from mlflow.tracking import MlflowClient

    from k3rl.store import TrajectoryStore

    summary, tmp_path = background_job
    cfg = _async_eval_job(tmp_path)
    assert summary["completed"] and sorted(summary["eval"]) == [0, 2, 3]  # before RL, every 2 steps, the last
    for step, m in summary["eval"].items():
        assert m["eval/policy_version"] == step + 1
        assert {"eval/KeyLookup-v0/success", "eval/KeyLookup-v0/reward", "eval/KeyLookup-v0/pass_at_2"} <= set(m)

    store = TrajectoryStore(tmp_path / "runs" / "ev", readonly=True)
    evals = store.read(status="eval")
    heldout = [t for t in evals if "-eval0000" in t.id]
    assert len(heldout) == 3 * 2 * 3  # 3 evals x 2 tasks x (1 greedy + 2 sampled)
    for t in heldout:
        step = t.metadata["step"]
        assert t.id.startswith(f"ev-eval{step:06d}-KeyLookup-v0-t")
        sampled = [v for v, mask in zip(t.versions, t.loss_mask, strict=True) if mask]
        assert sampled and set(sampled) == {step + 1}, (t.id, set(sampled))  # one known version per eval
        assert (t.metadata.get("sampling") == {"temperature": 0.0}) == t.id.endswith("-greedy")
        assert t.seed >= 2**31
    untrained = [t for t in evals if "-eval-g" in t.id]  # learner.eval_before_training, as before
    assert untrained and all(t.metadata["step"] == 0 and set(t.versions) <= {0, -1} for t in untrained)
    # step 0's reward is the mean of those episodes of its own, none of which training replays
    trained_seeds = {t.seed for t in store.read(status="trained")}
    assert all(t.seed >= 2**31 and t.seed not in trained_seeds for t in untrained)
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    step0 = [m.value for m in client.get_metric_history(summary["mlflow_run_id"], "reward/mean") if m.step == 0]
    assert step0 == [pytest.approx(sum(t.reward for t in untrained) / len(untrained))]

    rows = store.summary()
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(r["status"] == "eval" for r in rows if "-eval" in r["id"])
    trained = [r for r in rows if r["status"] == "trained"]
    assert trained and all(r["step"] - 2 <= r["policy_version"] <= r["step"] for r in trained)
    acc = summary["accounting"]
    assert 1 <= acc["groups/zero_variance"] <= 3 * 2  # at most max_refills x P a step
    assert sum(r["status"] == "zero_variance" for r in rows) == 2 * acc["groups/zero_variance"]
    assert all("dynamic_sampling/zero_variance_fraction" in m for m in summary["history"])

    steps = [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "eval/KeyLookup-v0/success")]
    assert sorted(steps) == [0, 2, 3]
    assert [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "reward/mean")][0] == 0
