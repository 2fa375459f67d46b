"""The Trainer with MoonEP (`learner.moon_ep`) takes the same steps as with plain EP.

Two gloo ranks, FSDP + EP=2 on k3-tiny: plain EP, MoonEP planned from the previous step's routes
(replanned after each step) and MoonEP planned per batch each take 3 RL steps and an SFT step
from the same weights on the same data. Losses, gradient norms and the updated weights must agree
to fp32 rounding; the MoonEP steps log the load imbalance and no dropped routes, and the plan
made after a step is the one its routes call for. The config refuses MoonEP without EP, more
slots than a rank can fill, and micro-batches shorter than an episode.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from learner_helpers import make_trajectories

from k3rl.config import ConfigError, JobConfig, LearnerSection
from k3rl.learner.distributed import free_port
from k3rl.learner.model import K3Config, K3ForCausalLM
from k3rl.learner.moon_ep import MoonEPExperts, moon_ep_modules
from k3rl.learner.trainer import Trainer

STEPS = 3
EP = 2
VARIANTS = {
    "plain": {},
    "moon_ep": {"enabled": True, "slots": 1, "margin": 1.5},
    "per_batch": {"enabled": True, "slots": 4, "plan_per_batch": True, "margin": 1.2},
}


def _cfg(**moon) -> LearnerSection:
    return LearnerSection(micro_batch_tokens=48, steps=10, data_parallel="fsdp", world_size=EP, expert_parallel=EP,
                          moon_ep=moon)  # fmt: skip


def _model() -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("k3-tiny"))


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res: dict = {}
        for name, moon in VARIANTS.items():
            t = Trainer(_model(), _cfg(**moon))
            layers = list(moon_ep_modules(t.model).values())
            metrics = [t.train_step(make_trajectories(s, n=8)) for s in range(STEPS)]
            metrics.append(t.sft_step(make_trajectories(5, n=4)))
            res[name] = {
                "metrics": metrics,
                "state": t.full_state_dict(),
                "layers": len(layers),
                "planned": [m.planned for m in layers],
                "kinds": {type(m).__name__ for m in t.model.modules() if "Experts" in type(m).__name__},
            }
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("moon_ep_trainer")
    mp.spawn(_worker, args=(EP, free_port(), str(out)), nprocs=EP, join=True)
    torch.set_num_threads(1)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(EP)]


@pytest.mark.parametrize("variant", ["moon_ep", "per_batch"])
def test_moon_ep_trainer_steps_equal_plain_ep(ranks, variant):
    n_moe = len(_model().moe_layers())
    for res in ranks:
        plain, moon = res["plain"], res[variant]
        assert plain["kinds"] == {"ExpertParallelExperts"} and moon["kinds"] == {MoonEPExperts.__name__}
        assert moon["layers"] == n_moe and all(moon["planned"])  # replanned after the steps (or per batch)
        for m1, m2 in zip(plain["metrics"], moon["metrics"], strict=True):
            for key in ("loss", "grad_norm", "loss_tokens"):
                assert abs(m1[key] - m2[key]) <= 1e-4 * max(1.0, abs(m1[key])), (variant, key, m1[key], m2[key])
            assert "moe/ep_imbalance" not in m1
            assert m2["moe/dropped_routes"] == 0
            # a plan from the previous step's routes can miss this step's (48-token micro-batches
            # here): only a per-batch plan is sure to beat plain EP on every forward
            assert m2["moe/ep_imbalance"] >= 1.0 and m2["moe/ep_imbalance_plain_ep"] >= 1.0, m2
        # the copies are in use: the loads differ from plain EP's after the first plan
        assert any(abs(m["moe/ep_imbalance"] - m["moe/ep_imbalance_plain_ep"]) > 1e-3 for m in moon["metrics"][1:])
        # as test_learner_ep: Muon/AdamW turn fp32 rounding of near-zero gradients into ~lr * 1e-2
        worst = max((plain["state"][k] - moon["state"][k]).abs().max().item() for k in plain["state"])
        assert worst < 5e-4, (variant, worst)
    if variant == "per_batch":  # E / ep slots: every rank computes exactly the mean, whatever the routing
        metrics = ranks[0][variant]["metrics"]
        assert all(m["moe/ep_imbalance"] == pytest.approx(1.0) for m in metrics)
        assert max(m["moe/ep_imbalance_plain_ep"] for m in metrics) > 1.01


def test_moon_ep_config_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match=r"learner.moon_ep.enabled: MoonEP balances expert parallel, which is off"):
        JobConfig.from_dict({"learner": {"moon_ep": {"enabled": True}}})
    ep = {"expert_parallel": 2, "world_size": 2, "data_parallel": "fsdp"}
    with pytest.raises(ConfigError, match=r"learner.moon_ep.slots: 5 is more than the 4 experts"):
        JobConfig.from_dict({"learner": {**ep, "moon_ep": {"enabled": True, "slots": 5}}})
    with pytest.raises(ConfigError, match=r"learner.moon_ep: .* raise learner.micro_batch_tokens to at least 2048"):
        JobConfig.from_dict({"learner": {**ep, "micro_batch_tokens": 1024, "moon_ep": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"learner.moon_ep.margin"):
        JobConfig.from_dict({"learner": {**ep, "moon_ep": {"enabled": True, "margin": 0}}})
    job = JobConfig.from_dict({"learner": {**ep, "moon_ep": {"enabled": True, "slots": 4}}})
    assert job.learner.moon_ep.slots == 4 and not job.learner.moon_ep.plan_per_batch
