"""The demo's job learns, in two parts.

1. The warm start (one seed): examples/demo_from_scratch.yaml (the demo's task and RL recipe with its SFT in
   front) with a shorter warm start (its first, careful phase at 60 steps). The untrained k3-tiny policy (the
   job's step 0) emits no well-formed message and earns 0 on KeyLookup; after the warm start and a few RL
   steps it calls the tool and answers.
2. RL's own gain (two seeds): examples/demo.yaml, the demo's RL from its stored warm start
   (`examples/keylookup_warm_start`: demo_from_scratch.yaml seed 3's policy after its SFT warm start, the
   job's KL reference saved with checkpoints/step-000010, stored in bf16; held-out greedy success 0.69 on the
   test's 32 tasks), 8 RL steps of 8 prompts x 8: the held-out success rises, greedy and sampled, on each
   seed. (The demo's whole 30 steps on three seeds: BENCHMARKS.md, "The demo".) After a change of k3-tiny's
   architecture the job's preflight refuses the stored checkpoint by name; rebuild it from a run of
   `k3rl train examples/demo_from_scratch.yaml --set model.seed=3 --set learner.seed=3` (its
   checkpoints/step-000010/reference, cast to bf16).

The three jobs (about 9 minutes one after another on 2 cores) run beside the rest of the suite from collection on
(`@pytest.mark.background`, tests/background.py); each test waits for its job and asserts on what it returned.
"""

from pathlib import Path

import pytest

from k3rl.config import JobConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _tracking(out: Path, name: str) -> list[str]:
    return ["tracking.sample_episodes=0", f"tracking.runs_dir={out}/runs", f"tracking.uri={_uri(out)}",
            f"name={name}", "tracking.run_name=null"]


def _uri(out: Path) -> str:
    return f"sqlite:///{out}/runs/mlflow.db"


def _short_job(seed: int):
    def build(out: Path) -> JobConfig:
        return JobConfig.load(EXAMPLES / "demo_from_scratch.yaml", [
            # the demo's warm start without its careless phase and at the RL batch's 16 demonstrations a
            # step (60 SFT steps; the demo's 130 x 32 would cost this test ~10 minutes a seed; 20 steps on
            # 128 oracle episodes left the policy weak enough that RL drifted to reward 0 on one CI run)
            "learner.sft_steps=60", "learner.sft_phases=[]", "learner.sft_batch=null",
            f"model.seed={seed}", f"learner.seed={seed}",
            "learner.steps=4", "learner.checkpoint_every=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
            # the held-out eval of the warm start only (step 0), greedy (16 tasks) and one sample each
            "tracking.eval_every=0", "envs.eval.0.num_tasks=16", "envs.eval.0.pass_k=1", "envs.eval.0.samples=1",
            *_tracking(out, f"learn{seed}"),
        ])
    return build


def _rl_gain(seed: int):
    def build(out: Path) -> JobConfig:
        return JobConfig.load(EXAMPLES / "demo.yaml", [
            "learner.eval_before_training=false", f"learner.seed={seed}", "learner.steps=8",
            "learner.checkpoint_every=0", "rollout.prompts_per_step=8", "rollout.group_size=8",
            # held-out eval before the first RL step and after the last: 32 tasks, greedy and one sample each
            "tracking.eval_every=8", "envs.eval.0.num_tasks=32", "envs.eval.0.pass_k=1", "envs.eval.0.samples=1",
            *_tracking(out, f"gain{seed}"),
        ])
    return build


# the jobs tests/background.py runs for this module's tests, by the name of their `background` mark
BACKGROUND_JOBS = {"learn0": _short_job(0), "gain0": _rl_gain(0), "gain1": _rl_gain(1)}


@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.background("learn0"))])
def test_short_job_learns_keylookup(seed, background_job):
    from mlflow.tracking import MlflowClient

    summary, out = background_job
    client = MlflowClient(tracking_uri=_uri(out))
    sft = [m.value for m in sorted(client.get_metric_history(summary["mlflow_run_id"], "sft/loss"), key=lambda m: m.step)]
    assert sft[-1] < sft[0] / 10  # the warm start learned the message format
    rewards = [m["reward/mean"] for m in summary["history"]]
    assert len(rewards) == 4
    curve = {m.step: m.value for m in client.get_metric_history(summary["mlflow_run_id"], "reward/mean")}
    # step 0 is the untrained policy (evaluated before training): no well-formed tool use, reward 0
    assert curve[0] == 0.0
    # after the warm start and RL the policy earns credit on every seed ...
    assert sum(rewards) / len(rewards) > 0.05, rewards
    # ... and RL keeps it: no collapse of the format over the RL steps
    assert rewards[-1] > 0.0, rewards
    assert all(m["episodes/failed_rate"] < 0.5 for m in summary["history"])
    # the warm start writes well-formed tool calls on held-out tasks (reward > 0 needs one) and, on seed 0,
    # copies the requested key and its value (SFT at 3e-3 over 60 steps; the former 1e-2 over 30 learned the
    # message format only: greedy success 0.03). The step-0 eval shares the engine with training episodes,
    # whose batch timing can flip a greedy near-tie (on seed 1 a CI run saw 0.0625 where earlier ones saw 0.25)
    assert summary["eval"][0]["eval/KeyLookup-v0/reward"] > 0.1, summary["eval"][0]
    assert summary["eval"][0]["eval/KeyLookup-v0/success"] >= 0.25, summary["eval"][0]


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.background(f"gain{s}")) for s in (0, 1)])
def test_rl_raises_held_out_success_from_a_stored_warm_start(seed, background_job):
    summary, _ = background_job
    assert summary["completed"] and sorted(summary["eval"]) == [0, 8], summary["eval"]
    before, after = summary["eval"][0], summary["eval"][8]
    greedy = [e["eval/KeyLookup-v0/success"] for e in (before, after)]
    sampled = [e["eval/KeyLookup-v0/pass_at_1"] for e in (before, after)]
    # measured on the 2-core machine (2026-12-03): seeds 1 / 2 greedy 0.69 -> 1.00 / 0.78, one sample 0.56 ->
    # 0.81 / 0.78; at 4 prompts a step, seeds 0 / 1 / 2: 0.69 -> 0.91 / 0.81 / 0.78 and 0.56 -> 0.84 / 0.69 / 0.81
    assert greedy[1] >= greedy[0] and sampled[1] >= sampled[0], (greedy, sampled)
    assert (greedy[1] - greedy[0]) + (sampled[1] - sampled[0]) >= 0.2, (greedy, sampled)
    assert all(m["episodes/failed_rate"] < 0.5 for m in summary["history"])
