"""Train-inference agreement: the engine's log-probs of its own sampled tokens against the learner's
(benchmarks/mismatch.py; its GPU numbers are in BENCHMARKS.md, "Train-inference mismatch")."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from k3rl.model import build_model
from k3rl.types import Trajectory

spec = importlib.util.spec_from_file_location(
    "mismatch_benchmark", Path(__file__).resolve().parents[2] / "benchmarks" / "mismatch.py")
mismatch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mismatch)


def test_stats_on_hand_made_log_probs():
    learner = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.1)])
    engine = torch.tensor([math.log(0.25), math.log(0.25), math.log(0.2)])
    d = [math.log(2), 0.0, math.log(0.5)]  # log pi - log mu
    r = mismatch.mismatch_stats(learner, engine)
    assert r["tokens"] == 3
    assert r["mean_abs"] == pytest.approx(2 * math.log(2) / 3)
    assert r["max_abs"] == pytest.approx(math.log(2))
    assert r["k1"] == pytest.approx(-sum(d) / 3)  # E_mu[log mu - log pi]: 0 here, as the ratios cancel
    assert r["k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert r["k3"] == pytest.approx(((1 - math.log(2)) + (-0.5 + math.log(2))) / 3)
    same = mismatch.mismatch_stats(engine, engine)
    assert same["mean_abs"] == same["max_abs"] == same["k1"] == same["k3"] == 0.0
    assert math.isnan(mismatch.mismatch_stats(torch.zeros(0), torch.zeros(0))["k3"])
    with pytest.raises(ValueError, match="pair up"):
        mismatch.mismatch_stats(torch.zeros(3), torch.zeros(2))


def test_positions_split_at_the_first_env_message():
    t = Trajectory(id="t", env_id="e", prompt_ids=[1, 2])
    t.append([5, 6, 7], generated=True, logprobs=[-0.1, -0.2, -0.3])
    t.append([8, 9], generated=False)  # a tool output
    t.append([10, 11], generated=True, logprobs=[-0.4, -0.5])
    assert mismatch.split_positions(t) == {"all": [0, 1, 2, 5, 6], "turn 1": [0, 1, 2], "later": [5, 6]}
    lp = torch.tensor([-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.6])
    r = mismatch.report([t], [lp])
    assert r["turn 1"]["max_abs"] == 0 and r["later"]["max_abs"] == pytest.approx(0.1)
    assert r["all"]["tokens"] == 5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("k3-tiny", None, seed=0)


def two_turn_requests(model, mode: str) -> list[Trajectory]:
    """Two-turn requests (reply, a 'tool output', reply: the second turn continues the prefix cache)."""
    with mismatch.make_engine(model, mode, max_num_seqs=4) as engine:
        return mismatch.long_requests(engine, length=48, n=3, reply=24, tool=16, seed=1)


def test_fp32_engine_agrees_with_the_learner(model):
    """Measured on k3-tiny fp32 (CPU): max |d| 2.4e-6 over 3,226 tokens of warm-started KeyLookup
    episodes, mean 1.2e-8; here a bound 10x above that, in both turns."""
    trajs = two_turn_requests(model, "fp32")
    lp = mismatch.learner_logprobs(model, trajs, bf16=False)
    r = mismatch.report(trajs, lp)
    assert r["turn 1"]["tokens"] == r["later"]["tokens"] == 3 * 24
    for split in ("turn 1", "later"):
        assert r[split]["max_abs"] < 2e-5, (split, r[split])
        assert abs(r[split]["k3"]) < 1e-9


def test_autocast_engine_is_closer_to_the_bf16_learner_than_bf16_weights(model):
    """A bf16 learner (fp32 weights, bf16 autocast) scores the engine's tokens closer when the engine
    computes the same way (`autocast_dtype`) than when it holds bf16 weights (the GPU job's setting)."""
    k3 = {}
    for mode in ("bf16", "autocast"):
        trajs = two_turn_requests(model, mode)
        k3[mode] = mismatch.report(trajs, mismatch.learner_logprobs(model, trajs, bf16=True))["all"]["k3"]
    assert 0 < k3["autocast"] < k3["bf16"], k3


def test_autocast_dtype_is_checked(model):
    from k3rl.rollout.engine import EmbeddedEngine

    with pytest.raises(ValueError, match="autocast_dtype must be torch.bfloat16"):
        EmbeddedEngine(model, autocast_dtype=torch.float32, background=False)
