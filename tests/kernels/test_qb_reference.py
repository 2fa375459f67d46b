"""Quantile Balancing histogram and quantile read-out (docs/model.md §6.3, §10.10)."""

import math

import pytest
import torch

from k3rl.kernels.qb_histogram import qb_histogram, qb_quantile


def test_histogram_counts_and_clamping():
    r = torch.tensor([[-10.0, 0.05], [0.0, 0.95], [0.5, 99.0]])
    h = qb_histogram(r, lo=0.0, width=0.1, bins=10)
    assert h.dtype == torch.int64 and h.shape == (2, 10)
    assert h[0].tolist() == [2, 0, 0, 0, 0, 1, 0, 0, 0, 0]  # -10 clamps into bin 0
    assert h[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 2]  # 99 clamps into the last bin
    assert (h.sum(1) == 3).all()


def test_sharded_histograms_add_up():
    r = torch.randn(300, 7)
    full = qb_histogram(r, -4.0, 0.008, 1000)
    parts = sum(qb_histogram(r[a : a + 100], -4.0, 0.008, 1000) for a in (0, 100, 200))
    assert torch.equal(full, parts)


def test_token_mask_excludes_padding():
    r = torch.randn(50, 3)
    mask = torch.arange(50) < 30
    assert torch.equal(
        qb_histogram(r, -4.0, 0.01, 800, token_mask=mask), qb_histogram(r[:30], -4.0, 0.01, 800)
    )


def test_quantile_within_one_bin_of_order_statistic():
    torch.manual_seed(0)
    m, n, k = 4000, 16, 2
    b = torch.randn(n) * 0.1
    s = torch.rand(m, n)
    alpha = (s + b).topk(k + 1, dim=1).values[:, -1:]  # (k+1)-th biased score per token
    r = alpha - s  # required bias r_ij = alpha_i - s_ij
    lo, hi = b.min().item() - 1, b.max().item() + 1
    bins = 1000
    w = (hi - lo) / bins
    q = m * k / n
    est = qb_quantile(qb_histogram(r, lo, w, bins), q, lo, w)
    exact = r.sort(dim=0).values[math.floor(q)]  # (q+1)-th smallest
    assert (est - exact).abs().max() <= w + 1e-6


def test_interpolation_inside_a_bin():
    hist = torch.tensor([[2, 4, 4]])  # q = 4: first bin reaching 4 is bin 1, c = 2, h = 4
    assert qb_quantile(hist, 4, lo=1.0, width=0.5).item() == pytest.approx(1.0 + (1 + 0.5) * 0.5)


def test_bad_q_raises():
    with pytest.raises(ValueError, match="q="):
        qb_quantile(torch.tensor([[1, 1]]), 5, 0.0, 1.0)
    with pytest.raises(ValueError, match="width > 0"):
        qb_histogram(torch.zeros(2, 2), 0.0, 0.0, 10)
