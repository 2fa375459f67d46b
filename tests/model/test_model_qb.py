"""Quantile Balancing (docs/model.md §6, §10.10): report Eq. 14 exactly, the histogram estimator, the
per-layer state."""

from __future__ import annotations

import pytest
import torch
from k3_model_helpers import make_tiny

from k3rl.model import bias_from_histogram, required_bias_histogram
from k3rl.model.quantile_balance import histogram_range, quantile_balance, routing_cutoffs

# §6.4: rows t1..t8, columns E1..E4, b = 0, k = 1, q = 2
EXAMPLE = torch.tensor(
    [
        [0.32, 0.12, 0.05, 0.04],
        [0.16, 0.31, 0.07, 0.08],
        [0.14, 0.21, 0.05, 0.20],
        [0.32, 0.14, 0.07, 0.06],
        [0.21, 0.12, 0.05, 0.20],
        [0.18, 0.31, 0.13, 0.04],
        [0.22, 0.10, 0.21, 0.02],
        [0.16, 0.08, 0.21, 0.12],
    ],
    dtype=torch.float64,
)


def loads(scores, bias, k):
    idx = torch.topk(scores + bias, k, dim=-1).indices
    return torch.bincount(idx.reshape(-1), minlength=scores.shape[1])


def test_report_example():
    bias = torch.zeros(4, dtype=torch.float64)
    assert loads(EXAMPLE, bias, 1).tolist() == [4, 3, 1, 0]
    _, alpha = routing_cutoffs(EXAMPLE, bias, 1)
    torch.testing.assert_close(alpha, torch.tensor([0.12, 0.16, 0.20, 0.14, 0.20, 0.18, 0.21, 0.16], dtype=torch.float64))
    new = quantile_balance(EXAMPLE, bias, 1)
    torch.testing.assert_close(new, torch.tensor([-0.0275, -0.0275, 0.0325, 0.0225], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    assert loads(EXAMPLE, new, 1).tolist() == [2, 2, 2, 2]
    routes = torch.topk(EXAMPLE + new, 1, dim=-1).indices[:, 0].tolist()
    assert routes == [0, 1, 3, 0, 3, 1, 2, 2]  # E1<-{t1,t4}, E2<-{t2,t6}, E3<-{t7,t8}, E4<-{t3,t5}


def skewed_scores(m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    popularity = torch.linspace(-2.0, 2.0, n)[torch.randperm(n, generator=g)]  # some experts far more popular
    return torch.sigmoid(torch.randn(m, n, generator=g) + popularity)


def test_repeated_steps_balance_896_experts_top16():
    """Exact Eq. 14 steps on one skewed batch (n = 896, k = 16, q = 64).

    Measured (see benchmarks/results/model.md): max violation 730% -> 31% after one step and
    ~10% after six, mean |load - q| 1.5% of q. At this small q the residual of a few sqrt(q)
    tokens is ~10% of q; "every expert within 1%" holds from q ~ 16k (next test, benchmarks/qb.py).
    """
    m, n, k = 3584, 896, 16
    q = m * k / n
    scores = skewed_scores(m, n)
    bias = torch.zeros(n)
    start = loads(scores, bias, k).float()
    assert (start - q).abs().max() > 3 * q  # badly unbalanced before QB
    for _ in range(6):
        bias = quantile_balance(scores, bias, k)
    final = loads(scores, bias, k).float()
    assert final.sum() == m * k
    assert float((final - q).abs().max()) <= 0.125 * q, f"loads {final.min()}..{final.max()} vs q={q}"
    assert float((final - q).abs().mean()) <= 0.02 * q
    assert abs(float(bias.mean())) < 1e-6  # mean-centred


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_repeated_steps_residual_shrinks_as_the_target_load_grows():
    """On a fixed batch the iteration's residual is a few sqrt(q) tokens, so it shrinks relative to q
    as the batch grows (benchmarks/qb.py: 10 steps give 10.9% at q = 64, 3.9% at 256, 2.4% at 1024,
    1.4% at 4096, and 0.79% at q = 16384 (under 1% from step 9): K3's regime, where the global batch
    gives q >> 10^4 per expert; that run takes 6 CPU minutes, so it is a benchmark, not a test)."""
    n, k = 896, 16
    worst = {}
    for q in (64, 256):
        m = q * n // k
        scores = skewed_scores(m, n)
        bias = torch.zeros(n)
        for _ in range(10):
            bias = quantile_balance(scores, bias, k)
        worst[q] = float((loads(scores, bias, k).float() - q).abs().max()) / q
    assert worst[256] < 0.6 * worst[64], worst
    assert worst[256] <= 0.05, worst


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_histogram_estimate_within_one_bin_of_exact(seed):
    """Dense case (the quantile sits where order statistics are closer than a bin): |b^ - exact| <= w."""
    torch.manual_seed(seed)
    m, n, k = 16384, 16, 4
    scores = skewed_scores(m, n, seed=seed)
    bias = torch.randn(n) * 0.05
    counts, lo, width = required_bias_histogram(scores, bias, k, bins=1000)
    assert counts.dtype == torch.int64 and counts.shape == (n, 1000)
    assert bool((counts.sum(1) == m).all())  # every token counted once per expert
    estimate = bias_from_histogram(counts, m, k, lo, width)
    _, alpha = routing_cutoffs(scores, bias, k)
    q = m * k // n
    exact = torch.sort(alpha[:, None] - scores, dim=0).values[q]  # (q+1)-th smallest required bias
    assert float((estimate - exact).abs().max()) <= width
    centred_exact = quantile_balance(scores, bias, k)
    assert float((estimate - estimate.mean() - centred_exact).abs().max()) <= 2 * width


def test_histogram_estimate_in_a_sparse_tail_stays_between_the_order_statistics():
    """Sparse case: every b in (r_(q), r_(q+1)] balances exactly; the estimate lies in that gap +- w."""
    torch.manual_seed(0)
    m, n, k = 2048, 64, 4
    scores = skewed_scores(m, n, seed=1)
    bias = torch.randn(n) * 0.05
    counts, lo, width = required_bias_histogram(scores, bias, k)
    estimate = bias_from_histogram(counts, m, k, lo, width)
    _, alpha = routing_cutoffs(scores, bias, k)
    q = m * k // n
    ordered = torch.sort(alpha[:, None] - scores, dim=0).values
    assert bool((estimate >= ordered[q - 1] - width).all() and (estimate <= ordered[q] + width).all())


def test_per_shard_histograms_add_up_to_the_global_one():
    m, n, k = 999, 32, 3
    scores = skewed_scores(m, n, seed=2)
    bias = torch.randn(n) * 0.1
    whole, lo, width = required_bias_histogram(scores, bias, k)
    for cuts in ([0, 1, 500, 999], [0, 333, 334, 700, 999]):
        parts = [required_bias_histogram(scores[a:b], bias, k) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        assert all((p[1], p[2]) == (lo, width) for p in parts)  # the range depends on the bias only
        assert torch.equal(sum(p[0] for p in parts), whole)


def test_histogram_range_covers_every_required_bias():
    bias = torch.tensor([-0.3, 0.1, 0.25])
    lo, width = histogram_range(bias, 1000)
    assert lo == pytest.approx(-1.3) and lo + 1000 * width == pytest.approx(1.25)


def test_model_qb_state_accumulates_and_applies_next_step():
    model = make_tiny()
    model.train()
    model.set_qb_frozen(False)
    moe = model.moe_layers()[0]
    before = moe.gate.e_score_correction_bias.clone()
    ids = torch.randint(0, 256, (2, 24))
    model.gradient_checkpointing = True
    logits = model(ids)
    logits.float().square().mean().backward()  # the recompute must not count twice
    assert int(moe.qb.num_tokens) == 48 and int(moe.qb.counts.sum()) == 48 * moe.gate.e_score_correction_bias.numel()
    assert torch.equal(moe.gate.e_score_correction_bias, before)  # never applied to the batch itself
    counts = moe.qb.counts.clone()
    assert model.qb_step() == len(model.moe_layers())
    lo, width = histogram_range(before, moe.qb.bins)
    expected = bias_from_histogram(counts, 48, moe.qb.k, lo, width)
    torch.testing.assert_close(moe.gate.e_score_correction_bias, expected - expected.mean())
    assert int(moe.qb.num_tokens) == 0 and int(moe.qb.counts.sum()) == 0


def test_padding_is_left_out_of_qb_statistics():
    model = make_tiny()
    model.train()
    model.set_qb_frozen(False)
    ids = torch.randint(0, 256, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False  # right padding
    with torch.no_grad():
        model(ids, token_mask=mask)
    moe = model.moe_layers()[0]
    assert int(moe.qb.num_tokens) == 16 and int(moe.qb.counts.sum(1)[0]) == 16


def test_frozen_qb_changes_nothing():
    model = make_tiny()
    model.train()
    assert model.qb_frozen  # the RL default
    before = [m.gate.e_score_correction_bias.clone() for m in model.moe_layers()]
    model(torch.randint(0, 256, (1, 16)))
    assert model.qb_step() == 0
    assert all(int(m.qb.num_tokens) == 0 for m in model.moe_layers())
    assert all(torch.equal(m.gate.e_score_correction_bias, b) for m, b in zip(model.moe_layers(), before, strict=True))


def test_quantile_balance_rejects_bad_shapes():
    with pytest.raises(ValueError, match="bias must be"):
        quantile_balance(torch.rand(8, 4), torch.zeros(3), 1)
    with pytest.raises(ValueError, match="0 < k < n"):
        quantile_balance(torch.rand(8, 4), torch.zeros(4), 4)
