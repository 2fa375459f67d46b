"""The KL reference policy follows an SFT warm start when asked to."""

import pytest
import torch
from learner_helpers import gloo_group, make_trajectories

from k3rl.config import LearnerSection
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM


def test_reset_reference_makes_kl_zero_at_the_warm_started_policy():
    torch.manual_seed(0)
    t = Trainer(K3ForCausalLM(K3Config.preset("k3-tiny")), LearnerSection(kl_coef=0.1, micro_batch_tokens=256))
    batch = make_trajectories(0, n=4)
    t.sft_step(batch)
    t.sft_step(batch)
    drifted = t.train_step(make_trajectories(1, n=4))["kl"]
    assert drifted > 0  # the reference is still the pre-SFT init
    t.reset_reference()
    for (name, p), (_, r) in zip(t.model.named_parameters(), t.reference.named_parameters(), strict=True):
        assert torch.equal(p, r), name
        assert not r.requires_grad
    # the step right after the reset starts at the reference: its KL term is zero
    assert abs(t.train_step(make_trajectories(2, n=4))["kl"]) < 1e-6


def _fsdp_rank(rank: int, world: int, port: int, out: str) -> None:
    import os

    with gloo_group(rank, world, port):
        torch.manual_seed(0)
        cfg = LearnerSection(kl_coef=0.1, micro_batch_tokens=64, data_parallel="fsdp", world_size=world)
        t = Trainer(K3ForCausalLM(K3Config.preset("k3-tiny")), cfg)
        batch = make_trajectories(0, n=4)
        t.sft_step(batch)
        t.sft_step(batch)
        t.reset_reference()  # collective: every rank gathers the warm-started weights into its reference
        state = t.full_state_dict()
        same = all(torch.equal(state[k], v.cpu()) for k, v in t.reference.state_dict().items())
        kl = t.train_step(make_trajectories(2, n=4))["kl"]
        if rank == 0:
            torch.save({"same": same, "kl": kl, "frozen": not any(p.requires_grad for p in t.reference.parameters())},
                       os.path.join(out, "ref.pt"))


@pytest.mark.slow
def test_reset_reference_under_fsdp(tmp_path):
    """FSDP + kl_coef > 0 + an SFT warm start: the reference becomes the warm-started policy on
    every rank (it raised before)."""
    import torch.multiprocessing as mp

    from k3rl.cluster import free_port

    mp.spawn(_fsdp_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "ref.pt")
    assert got["same"] and got["frozen"]
    assert abs(got["kl"]) < 1e-6
