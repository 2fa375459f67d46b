"""The KL reference policy follows an SFT warm start when asked to."""

import torch
from learner_helpers import make_trajectories

from k3rl.config import LearnerSection
from k3rl.learner.model import K3Config, K3ForCausalLM
from k3rl.learner.trainer import Trainer


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
