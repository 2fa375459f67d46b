"""RL objectives against hand-computed values on small cases."""

from __future__ import annotations

import math

import pytest
import torch

from k3rl.config import LearnerSection
from k3rl.learner.losses import (
    LossConfig,
    aggregation_weights,
    group_advantages,
    importance_weights,
    kl_k3,
    policy_loss,
    sft_loss,
    token_entropy,
    token_logprobs,
)

T = torch.tensor


def test_group_advantages_grpo_no_std_and_rloo():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0]
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    # group a: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; b: all equal; c: a single sample
    s = math.sqrt(1 / 3)
    assert torch.allclose(group_advantages(rewards, groups, "grpo"),
                          T([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0]), atol=1e-5)
    assert torch.allclose(group_advantages(rewards, groups, "grpo_no_std"), T([0.5, -0.5, -0.5, 0.5, 0, 0, 0]))
    # RLOO: r_i - mean of the others, e.g. 1 - (0 + 0 + 1) / 3
    assert torch.allclose(group_advantages(rewards, groups, "rloo"), T([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0]))


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="group ids"):
        group_advantages([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="method"):
        group_advantages([1.0], ["a"], "ppo")


def _one_seq(n):
    return dict(mask=torch.ones(n), seq_index=torch.zeros(n, dtype=torch.long))


def test_ppo_asymmetric_clip_value_gradient_and_clip_fraction():
    r = T([1.5, 0.5, 1.1, 0.5])
    A = T([1.0, -1.0, 2.0, 1.0])
    logp = torch.log(r).requires_grad_()
    prox = torch.zeros(4)
    cfg = LossConfig(algorithm="grpo", clip_low=0.2, clip_high=0.28, tis_level="none")
    b = _one_seq(4)
    a = aggregation_weights(b["mask"], b["seq_index"], "token_mean")
    loss, stats = policy_loss(logp, prox, A, b["mask"], a, b["seq_index"], cfg, prox_logp=prox)
    # per token -min(rA, clip(r, 0.8, 1.28) A): -1.28, +0.8, -2.2, -0.5
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.2 - 0.5) / 4, abs=1e-6)
    assert stats["clipped"].item() == 2  # tokens 1 and 2 sit on the clipped branch
    loss.backward()
    # d/dlogp of -r A / 4 = -r A / 4 on unclipped tokens, 0 on clipped ones
    assert torch.allclose(logp.grad, T([0.0, 0.0, -1.1 * 2 / 4, -0.5 / 4]), atol=1e-6)


def test_cispo_keeps_gradients_of_clipped_tokens_with_a_clipped_weight():
    r = T([1.5, 0.5, 1.1, 0.5])
    A = T([1.0, -1.0, 2.0, 1.0])
    logp = torch.log(r).requires_grad_()
    prox = torch.zeros(4)
    cfg = LossConfig(algorithm="cispo", clip_low=0.2, clip_high=0.28, tis_level="none")
    b = _one_seq(4)
    a = aggregation_weights(b["mask"], b["seq_index"], "token_mean")
    loss, stats = policy_loss(logp, prox, A, b["mask"], a, b["seq_index"], cfg, prox_logp=prox)
    coef = T([1.28, 0.8, 1.1, 0.8])  # sg(clip(r, 0.8, 1.28))
    assert loss.item() == pytest.approx(float((-coef * A * torch.log(r)).mean()), abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, -coef * A / 4, atol=1e-6)
    assert stats["clipped"].item() == 3  # CISPO clips the weight whatever the advantage's sign


def test_ppo_algorithm_takes_the_behaviour_policy_as_old_policy():
    logp = torch.log(T([1.5, 1.0]))
    behaviour = torch.zeros(2)
    b = _one_seq(2)
    a = aggregation_weights(b["mask"], b["seq_index"], "token_mean")
    _, stats = policy_loss(logp, behaviour, T([1.0, 1.0]), b["mask"], a, b["seq_index"], LossConfig(algorithm="ppo"))
    assert stats["clipped"].item() == 1  # r = 1.5 > 1.28 against the behaviour policy
    assert stats["ratio_sum"].item() == 2  # prox = behaviour: rho = 1
    _, stats = policy_loss(logp, behaviour, T([1.0, 1.0]), b["mask"], a, b["seq_index"], LossConfig(algorithm="grpo"))
    assert stats["clipped"].item() == 0  # prox = current policy: r = 1
    assert stats["ratio_sum"].item() == pytest.approx(2.5)  # rho = pi / mu = 1.5 and 1


def test_token_tis_truncates_above_the_cap_and_not_at_it():
    at_cap = float(torch.exp(T(0.5)))  # the float32 value the loss computes for log rho = 0.5
    cfg = LossConfig(tis_level="token", tis_cap=at_cap)
    prox = T([0.0, 0.0, 0.5, 0.75])
    behaviour = T([0.6931472, 0.0, 0.0, 0.0])  # rho = 0.5, 1, exp(0.5) = cap, exp(0.75) > cap
    b = _one_seq(4)
    w, keep, rho, raw = importance_weights(prox, behaviour, b["mask"], b["seq_index"], cfg)
    assert torch.allclose(w, T([0.5, 1.0, at_cap, at_cap]))
    assert w[2].item() == at_cap and raw[2].item() == at_cap
    assert keep.all()
    # the loss weights each token's -r A by w (r = 1 with the default proximal policy)
    logp = prox.clone().requires_grad_()
    a = aggregation_weights(b["mask"], b["seq_index"], "token_mean")
    loss, stats = policy_loss(logp, behaviour, torch.ones(4), b["mask"], a, b["seq_index"], cfg)
    assert loss.item() == pytest.approx(-(0.5 + 1 + 2 * at_cap) / 4, abs=1e-6)
    assert stats["truncated"].item() == 1


def test_ratio_mask_keeps_tokens_at_the_bounds_and_drops_them_outside():
    high = float(torch.exp(T(0.5)))
    cfg = LossConfig(tis_level="token", tis_cap=10.0, ratio_mask_low=1.0, ratio_mask_high=high)
    prox = T([0.0, -0.001, 0.5, 0.501])
    behaviour = torch.zeros(4)  # rho = 1 (= low), just below low, exp(0.5) (= high), just above high
    b = _one_seq(4)
    _, keep, _, _ = importance_weights(prox, behaviour, b["mask"], b["seq_index"], cfg)
    assert keep.tolist() == [True, False, True, False]
    logp = prox.clone().requires_grad_()
    a = aggregation_weights(b["mask"], b["seq_index"], "token_mean")
    loss, stats = policy_loss(logp, behaviour, torch.ones(4), b["mask"], a, b["seq_index"], cfg)
    loss.backward()
    assert logp.grad[1].item() == 0 and logp.grad[3].item() == 0  # masked tokens: no gradient
    assert logp.grad[0].item() != 0 and logp.grad[2].item() != 0
    assert stats["masked"].item() == 2
    assert loss.item() == pytest.approx(-(1.0 + high) / 4, abs=1e-6)  # the denominator stays the loss tokens


def test_sequence_tis_uses_the_product_of_kept_token_ratios():
    cfg = LossConfig(tis_level="sequence", tis_cap=2.0, ratio_mask_high=5.0)
    prox = T([0.1, 0.2, 0.5, 0.5, 0.3, 3.0])
    behaviour = torch.zeros(6)
    seq = T([0, 0, 1, 1, 2, 2])
    mask = T([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    w, keep, _, raw = importance_weights(prox, behaviour, mask, seq, cfg)
    # seq 0: exp(0.3); seq 1: exp(1.0) = 2.718 -> capped at 2; seq 2: token 5 (rho = e^3 > 5) masked, exp(0.3)
    assert torch.allclose(raw, T([math.exp(0.3)] * 2 + [math.e] * 2 + [math.exp(0.3)] * 2), rtol=1e-5)
    assert torch.allclose(w, T([math.exp(0.3)] * 2 + [2.0] * 2 + [math.exp(0.3)] * 2), rtol=1e-5)
    assert keep.tolist() == [True, True, True, True, True, False]


def test_kl_k3_and_entropy_by_hand():
    logp, ref = T([-1.0, -2.0]), T([-1.5, -1.0])
    # d = ref - logp = (-0.5, 1): e^d - d - 1
    expect = T([math.exp(-0.5) + 0.5 - 1, math.e - 2])
    assert torch.allclose(kl_k3(logp, ref), expect)
    assert torch.allclose(kl_k3(logp, logp), torch.zeros(2))
    cfg = LossConfig(kl_coef=0.1, tis_level="none")
    b = _one_seq(2)
    a = aggregation_weights(b["mask"], b["seq_index"], "token_mean")
    loss, stats = policy_loss(logp, logp, torch.zeros(2), b["mask"], a, b["seq_index"], cfg, ref_logp=ref)
    assert loss.item() == pytest.approx(0.1 * float(expect.mean()), abs=1e-6)  # A = 0: only the KL term
    assert stats["kl"].item() == pytest.approx(float(expect.mean()), abs=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, torch.zeros(2), b["mask"], a, b["seq_index"], cfg)

    logits = torch.stack([torch.zeros(8), torch.tensor([0.0, math.log(3.0)] + [-1e9] * 6)])
    ent = token_entropy(logits)
    assert ent[0].item() == pytest.approx(math.log(8), abs=1e-6)
    assert ent[1].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    cfg = LossConfig(entropy_coef=0.5, tis_level="none")
    loss, stats = policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), b["mask"], a, b["seq_index"], cfg,
                              entropy=ent)
    assert loss.item() == pytest.approx(-0.5 * float(ent.mean()), abs=1e-6)
    assert stats["entropy"].item() == pytest.approx(float(ent.mean()), abs=1e-6)


def test_token_logprobs_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g).bfloat16()
    targets = torch.randint(0, 11, (5,), generator=g)
    ref = torch.log_softmax(logits.float(), -1)[torch.arange(5), targets]
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=1e-6)


def test_token_mean_and_sequence_mean_aggregation():
    mask = T([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    seq = T([0, 0, 0, 0, 1, 1, 2])  # sequence 2 has no loss token
    per_token = T([1.0, 2.0, 3.0, 99.0, 10.0, 99.0, 99.0])
    a_tok = aggregation_weights(mask, seq, "token_mean")
    a_seq = aggregation_weights(mask, seq, "seq_mean", num_seqs=3)
    assert (a_tok * per_token).sum().item() == pytest.approx((1 + 2 + 3 + 10) / 4)
    assert (a_seq * per_token).sum().item() == pytest.approx(((1 + 2 + 3) / 3 + 10) / 2)
    assert (a_seq * (1 - mask)).sum().item() == 0


def test_sft_loss_is_the_mean_nll_of_loss_tokens():
    logp = T([-1.0, -2.0, -3.0])
    mask = T([1.0, 0.0, 1.0])
    a = aggregation_weights(mask, torch.zeros(3, dtype=torch.long), "token_mean")
    loss, _ = sft_loss(logp, mask, a)
    assert loss.item() == pytest.approx(2.0)


def test_loss_config_from_learner_section_and_errors():
    cfg = LossConfig.from_section(LearnerSection(algorithm="cispo", clip_high=0.3, tis_level="sequence"))
    assert cfg.algorithm == "cispo" and cfg.clip_high == 0.3 and cfg.tis_level == "sequence"
    with pytest.raises(ValueError, match="ratio_mask_low"):
        LossConfig(ratio_mask_low=2.0, ratio_mask_high=1.0)
    with pytest.raises(ValueError, match="algorithm"):
        LossConfig(algorithm="dpo")
    with pytest.raises(ValueError, match="one shape"):
        b = _one_seq(2)
        policy_loss(torch.zeros(3), torch.zeros(2), torch.zeros(2), b["mask"], torch.zeros(2), b["seq_index"], LossConfig())
