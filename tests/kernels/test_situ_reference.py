"""SiTU-GLU values and gradients (docs/model.md §5.4, §10.8, §10.11)."""

import pytest
import torch

from k3rl.kernels.situ import situ_glu, situ_glu_formula

F64 = torch.float64


def f(g, u):
    return situ_glu(torch.tensor([g], dtype=F64), torch.tensor([u], dtype=F64)).item()


def test_spec_values():
    assert f(100, 100) == pytest.approx(99.933, abs=1e-3)
    assert f(30, -1e4) == pytest.approx(-99.99994, abs=1e-5)
    assert f(0.1, 0.1) == pytest.approx(0.005249, abs=1e-6)
    assert f(1, 1) == pytest.approx(0.71582, abs=1e-5)


def test_output_bound():
    g = (torch.rand(10000, dtype=F64) * 2 - 1) * 1e4
    u = (torch.rand(10000, dtype=F64) * 2 - 1) * 1e4
    assert situ_glu(g, u).abs().max() <= 100  # < 100 exactly; tanh rounds to 1 in floating point


def test_gate_minimum():
    g = torch.linspace(-3, 0, 300001, dtype=F64)
    a = situ_glu(g, torch.full_like(g, 25 * torch.atanh(torch.tensor(1 / 25, dtype=F64)).item()))  # u~ = 1
    i = a.argmin()
    assert a[i].item() == pytest.approx(-0.26977, abs=1e-5)
    assert g[i].item() == pytest.approx(-1.2188, abs=1e-3)


def test_analytic_gradients_equal_autograd():
    g = (torch.randn(500, dtype=F64) * 5).requires_grad_()
    u = (torch.randn(500, dtype=F64) * 30).requires_grad_()
    w = torch.randn(500, dtype=F64)
    (situ_glu(g, u) * w).sum().backward()
    g2, u2 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    (situ_glu_formula(g2, u2) * w).sum().backward()
    assert torch.allclose(g.grad, g2.grad, atol=1e-12) and torch.allclose(u.grad, u2.grad, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b: situ_glu(a, b), (g[:20].detach().requires_grad_(), u[:20].detach().requires_grad_())
    )


def test_da_dg_at_zero_is_half():
    g = torch.zeros(1, dtype=F64, requires_grad=True)
    u = torch.full((1,), 25 * torch.atanh(torch.tensor(1 / 25, dtype=F64)).item(), dtype=F64)  # u~(u) = 1
    situ_glu(g, u).backward()
    assert g.grad.item() == pytest.approx(0.5, abs=1e-12)


def test_bf16_io_fp32_island():
    g, u = torch.randn(64, 32) * 4, torch.randn(64, 32) * 4
    out = situ_glu(g.bfloat16(), u.bfloat16())
    assert out.dtype == torch.bfloat16
    ref = situ_glu(g.bfloat16().double(), u.bfloat16().double())
    assert torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_shared_expert_split_equivalence():
    x = torch.randn(5, 16, dtype=F64)
    wg, wu, wd = (
        torch.randn(12, 16, dtype=F64),
        torch.randn(12, 16, dtype=F64),
        torch.randn(16, 12, dtype=F64),
    )
    full = situ_glu(x @ wg.T, x @ wu.T) @ wd.T
    halves = sum(situ_glu(x @ wg[s].T, x @ wu[s].T) @ wd[:, s].T for s in (slice(0, 6), slice(6, 12)))
    assert torch.allclose(full, halves, atol=1e-12)


def test_mismatch_raises():
    with pytest.raises(ValueError, match="must match"):
        situ_glu(torch.zeros(3), torch.zeros(4))
