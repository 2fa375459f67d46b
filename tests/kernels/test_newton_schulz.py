"""Batched Newton-Schulz (docs/model.md §8.1, §10.14)."""

import pytest
import torch

from k3rl.kernels.newton_schulz import newton_schulz, newton_schulz_loop


@pytest.mark.parametrize("shape", [(3, 32, 64), (2, 2, 48, 16), (40, 40)])
def test_singular_values_near_one(shape):
    torch.manual_seed(0)
    G = torch.randn(shape)
    out = newton_schulz(G)
    assert out.shape == G.shape and out.dtype == G.dtype
    sv = torch.linalg.svdvals(out.reshape(-1, *shape[-2:]))
    assert sv.min() > 0.5 and sv.max() < 1.3  # NS5 with these coefficients lands in ~[0.7, 1.2]


def test_batched_equals_per_matrix_and_scale_invariant():
    G = torch.randn(4, 16, 24, dtype=torch.float64)
    G[1] *= 100.0  # per-head scales differ: per-matrix normalisation equalises them
    a, b = newton_schulz(G), newton_schulz_loop(G)
    assert torch.allclose(a, b, atol=1e-10)
    assert torch.allclose(newton_schulz(G[1:2]), newton_schulz(G[1:2] / 100.0), atol=1e-6)
    norms = a.flatten(1).norm(dim=1)
    assert (norms.max() / norms.min()) < 1.2


def test_tall_matrix_uses_transpose():
    G = torch.randn(48, 16, dtype=torch.float64)
    assert torch.allclose(newton_schulz(G), newton_schulz(G.T).T, atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 48, 16), (3, 16, 48)])
def test_result_is_contiguous_in_either_orientation(shape):
    """Muon adds the results to contiguous weights with one foreach kernel a list; a transposed (tall)
    result would send that update down the one-kernel-a-tensor path."""
    out = newton_schulz(torch.randn(shape))
    assert out.is_contiguous() and out.stride() == torch.empty(shape).stride()


def test_bad_input_raises():
    with pytest.raises(ValueError, match="rows, cols"):
        newton_schulz(torch.randn(5))
