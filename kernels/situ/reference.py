"""SiTU-GLU reference (docs/model.md §5.4).

    f(g, u) = [b1 tanh(g / b1) sigmoid(g)] * [b2 tanh(u / b2)],   b1 = 4 (gate), b2 = 25 (up)

computed as an fp32 island, stored in the input dtype. |f| < b1 * b2.
Gradients, with a(g) = b1 tanh(g/b1) sigmoid(g) and u~(u) = b2 tanh(u/b2):
    df/dg = u~ * [(1 - tanh^2(g/b1)) sigmoid(g) + b1 tanh(g/b1) sigmoid(g) (1 - sigmoid(g))]
    df/du = a(g) * (1 - tanh^2(u/b2))
"""

from __future__ import annotations

import torch


def _island_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def situ_glu_formula(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0):
    """The formula in plain differentiable ops (autograd gives its gradient)."""
    dt = _island_dtype(gate)
    g, u = gate.to(dt), up.to(dt)
    a = beta_gate * torch.tanh(g / beta_gate) * torch.sigmoid(g)  # a(g) = b1 tanh(g/b1) sigma(g)
    return (a * (beta_up * torch.tanh(u / beta_up))).to(gate.dtype)  # a(g) * b2 tanh(u/b2)


def situ_glu_grads(gate, up, grad_out, beta_gate, beta_up):
    """Analytic (d gate, d up) for upstream ``grad_out``, recomputing the fp32 chain."""
    dt = _island_dtype(gate)
    g, u, go = gate.to(dt), up.to(dt), grad_out.to(dt)
    tg = torch.tanh(g / beta_gate)
    sg = torch.sigmoid(g)
    tu = torch.tanh(u / beta_up)
    a = beta_gate * tg * sg
    da_dg = (1 - tg * tg) * sg + beta_gate * tg * sg * (
        1 - sg
    )  # (1 - tanh^2) sigma + b1 tanh sigma (1 - sigma)
    dgate = go * beta_up * tu * da_dg  # u~ * da/dg
    dup = go * a * (1 - tu * tu)  # a(g) (1 - tanh^2(u/b2))
    return dgate.to(gate.dtype), dup.to(up.dtype)


class SiTUGLUTorch(torch.autograd.Function):
    """Saves only the (bf16) inputs and recomputes the fp32 chain in backward (§5.4 memory trick)."""

    @staticmethod
    def forward(ctx, gate, up, beta_gate, beta_up):
        ctx.save_for_backward(gate, up)
        ctx.betas = (beta_gate, beta_up)
        return situ_glu_formula(gate, up, beta_gate, beta_up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        dgate, dup = situ_glu_grads(gate, up, grad_out, *ctx.betas)
        return dgate, dup, None, None
