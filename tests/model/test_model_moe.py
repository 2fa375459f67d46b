"""Stable LatentMoE, router and SiTU-GLU invariants (docs/model.md §5, §10.8, §10.9, §10.11)."""

from __future__ import annotations

import pytest
import torch

from k3rl.kernels.situ import situ_glu
from k3rl.model import K3Config
from k3rl.model.common import SiTUGLUMLP
from k3rl.model.moe import StableLatentMoE


def make_moe(seed=0) -> StableLatentMoE:
    torch.manual_seed(seed)
    moe = StableLatentMoE(K3Config.preset("k3-tiny"))
    with torch.no_grad():
        for p in moe.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.1)
        moe.routed_expert_norm.weight.uniform_(0.5, 1.5)
    return moe


def situ(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


def reference_moe(moe: StableLatentMoE, x: torch.Tensor) -> torch.Tensor:
    """§5.2-§5.3 token by token."""
    out = []
    b = moe.gate.e_score_correction_bias
    for xt in x:
        s = torch.sigmoid(moe.gate.weight @ xt)
        idx = torch.topk(s + b, moe.gate.top_k).indices
        p = s[idx] / (s[idx].sum() + 1e-20)
        z = moe.routed_expert_down_proj.weight @ xt
        u = sum(p[j] * (moe.experts.w2[e] @ situ(moe.experts.w1[e] @ z, moe.experts.w3[e] @ z)) for j, e in enumerate(idx))
        un = moe.routed_expert_norm.weight * u / torch.sqrt((u * u).mean() + 1e-5)
        sh = moe.shared_experts
        shared = sh.down_proj.weight @ situ(sh.gate_proj.weight @ xt, sh.up_proj.weight @ xt)
        out.append(shared + moe.routed_expert_up_proj.weight @ un)
    return torch.stack(out)


def test_moe_equals_per_token_reference():
    moe = make_moe()
    x = torch.randn(9, 128)
    with torch.no_grad():
        y, routing = moe(x)
        torch.testing.assert_close(y, reference_moe(moe, x), atol=1e-5, rtol=1e-4)
    assert routing.topk_idx.shape == (9, 2) and routing.scores.dtype == torch.float32


def test_router_invariants():
    """§10.9: weights sum to 1; a constant bias shift changes nothing; the bias changes only indices."""
    gate = make_moe().gate
    x = torch.randn(64, 128)
    with torch.no_grad():
        p, r = gate(x)
        torch.testing.assert_close(p.sum(-1), torch.ones(64))
        gate.e_score_correction_bias += 3.0
        p2, r2 = gate(x)
        assert torch.equal(r.topk_idx, r2.topk_idx)
        torch.testing.assert_close(p, p2)
        gate.e_score_correction_bias.copy_(torch.randn(8))
        p3, r3 = gate(x)
        assert not torch.equal(r.topk_idx, r3.topk_idx)
        p4, _ = gate(x, replay_idx=r3.topk_idx)  # same selected set under any bias: same weights
        gate.e_score_correction_bias.zero_()
        p5, _ = gate(x, replay_idx=r3.topk_idx)
        torch.testing.assert_close(p4, p5)
        torch.testing.assert_close(p3, p4)


def test_router_runs_in_fp32_under_bf16():
    moe = make_moe()
    x = torch.randn(16, 128)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        p, routing = moe.gate(x)
    assert p.dtype == torch.float32 and routing.scores.dtype == torch.float32
    with torch.no_grad():
        expected = torch.sigmoid(x @ moe.gate.weight.T)
    torch.testing.assert_close(routing.scores, expected, atol=1e-6, rtol=1e-6)


def test_router_gradient_flows_through_weights_only():
    moe = make_moe()
    x = torch.randn(12, 128)
    y, _ = moe(x)
    y.square().sum().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert moe.gate.e_score_correction_bias.grad is None


def test_routing_replay_uses_recorded_experts():
    moe = make_moe()
    x = torch.randn(10, 128)
    with torch.no_grad():
        y, routing = moe(x)
        y_replay, r2 = moe(x, replay_idx=routing.topk_idx)
        torch.testing.assert_close(y_replay, y)
        forced = torch.tensor([[0, 1]] * 10)
        _, r3 = moe(x, replay_idx=forced)
        assert torch.equal(r3.topk_idx, forced)
        with pytest.raises(ValueError, match="expert ids must lie"):
            moe(x, replay_idx=torch.full((10, 2), 99))


def test_shared_experts_fused_equals_two_experts():
    """§10.11: one 2f-wide SiTU-GLU == the sum of two f-wide experts built from its row halves."""
    torch.manual_seed(3)
    fused = SiTUGLUMLP(32, 16, 4.0, 25.0)
    halves = [SiTUGLUMLP(32, 8, 4.0, 25.0) for _ in range(2)]
    with torch.no_grad():
        for i, h in enumerate(halves):
            rows = slice(8 * i, 8 * (i + 1))
            h.gate_proj.weight.copy_(fused.gate_proj.weight[rows])
            h.up_proj.weight.copy_(fused.up_proj.weight[rows])
            h.down_proj.weight.copy_(fused.down_proj.weight[:, rows])
        x = torch.randn(5, 32)
        torch.testing.assert_close(fused(x), halves[0](x) + halves[1](x))


def test_situ_glu_values_through_the_kernels_op():
    """§10.8 reference values and the bound |f| < 100."""
    def f(g, u):
        return situ_glu(torch.tensor([g], dtype=torch.float64), torch.tensor([u], dtype=torch.float64)).item()

    assert f(100, 100) == pytest.approx(99.933, abs=1e-3)
    assert f(30, -1e4) == pytest.approx(-99.99994, abs=1e-5)
    assert f(0.1, 0.1) == pytest.approx(0.005249, abs=1e-6)
    assert f(1, 1) == pytest.approx(0.71582, abs=1e-5)
    g = torch.linspace(-3, 0, 30001, dtype=torch.float64)
    a = situ_glu(g, torch.full_like(g, 1e-9)) / (25 * torch.tanh(torch.tensor(1e-9 / 25, dtype=torch.float64)))
    assert a.min().item() == pytest.approx(-0.26977, abs=1e-5)
    assert g[a.argmin()].item() == pytest.approx(-1.2188, abs=1e-3)
    big = torch.empty(10000).uniform_(-1e4, 1e4)
    assert situ_glu(big, big.flip(0)).abs().max() <= 100.0  # < 100 exactly; fp32 rounds the cap to 100


def test_situ_glu_gradients_match_the_analytic_formulas():
    """§5.4: df/dg, df/du in closed form; da/dg(0) = 0.5."""
    g = torch.tensor([0.0, -1.3, 0.7, 5.0, -20.0], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([1.0, 3.0, -40.0, 0.2, 7.0], dtype=torch.float64, requires_grad=True)
    situ_glu(g, u).sum().backward()
    gd, ud = g.detach(), u.detach()
    t1, s, t2 = torch.tanh(gd / 4), torch.sigmoid(gd), torch.tanh(ud / 25)
    dfdg = 25 * t2 * ((1 - t1**2) * s + 4 * t1 * s * (1 - s))
    dfdu = 4 * t1 * s * (1 - t2**2)
    torch.testing.assert_close(g.grad, dfdg)
    torch.testing.assert_close(u.grad, dfdu)
    assert (g.grad[0] / (25 * torch.tanh(torch.tensor(1 / 25, dtype=torch.float64)))).item() == pytest.approx(0.5)
