"""KDA token mixer (docs/model.md §2, §10.2, §10.4) against a per-token reference written from it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3rl.kernels.kda import kda_gate
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.kda import KimiDeltaAttention


def make_layer(lower_bound=-5.0, seed=0) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    c = K3Config.preset("k3-tiny")
    c.linear_attn_config.gate_lower_bound = lower_bound
    layer = KimiDeltaAttention(c, 0)
    for p in layer.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, 0.0, 0.2)
    with torch.no_grad():
        layer.A_log.uniform_(-1, 1)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer


def reference_layer(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """docs/model.md §2.2-§2.8 step by step, with the §2.4 per-token recurrence."""
    B, T, _ = x.shape
    H, D = layer.num_heads, layer.head_dim

    def conv(proj, w):  # y_t[c] = SiLU(sum_j w[c, j] x_{t-3+j}[c]), zero left context
        xp = F.pad(proj, (0, 0, 3, 0))
        y = sum(w[:, 0, j] * xp[:, j : j + T] for j in range(4))
        return F.silu(y)

    q = conv(x @ layer.q_proj.weight.T, layer.q_conv1d.weight).reshape(B, T, H, D)
    k = conv(x @ layer.k_proj.weight.T, layer.k_conv1d.weight).reshape(B, T, H, D)
    v = conv(x @ layer.v_proj.weight.T, layer.v_conv1d.weight).reshape(B, T, H, D)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    z = ((x @ layer.f_a_proj.weight.T) @ layer.f_b_proj.weight.T).reshape(B, T, H, D) + layer.dt_bias.reshape(H, D)
    a = layer.A_log.exp()[:, None]
    g = -a * F.softplus(z) if layer.lower_bound is None else layer.lower_bound * torch.sigmoid(a * z)
    S = torch.zeros(B, H, D, D)
    outs = []
    for t in range(T):
        S = g[:, t].exp()[..., None] * S  # S' = Diag(alpha) S
        u = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])  # u = v - S'^T k
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))  # o = S^T q
    o = torch.stack(outs, 1)
    n = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-5) * layer.o_norm.weight
    y = (n * torch.sigmoid((x @ layer.g_proj.weight.T).reshape(B, T, H, D))).reshape(B, T, H * D)
    return y @ layer.o_proj.weight.T


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_layer_equals_per_token_reference(lower_bound):
    layer = make_layer(lower_bound)
    x = torch.randn(2, 37, 128)  # 37: not a multiple of the chunk size (16 in k3-tiny)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference_layer(layer, x), atol=2e-5, rtol=1e-4)


def test_softplus_gate_is_a_different_model():
    x = torch.randn(1, 12, 128)
    with torch.no_grad():
        a, b = make_layer(-5.0)(x), make_layer(None)(x)
    assert (a - b).abs().max() > 1e-3


def test_decay_range_and_gradients():
    """§10.2: g in (-5, 0), alpha in (e^-5, 1); A = 0, z = 0 gives -2.5; the §2.3 gradients."""
    z = torch.randn(2, 64, 3, 8, dtype=torch.float64).mul(3).requires_grad_()  # |u| stays < ~30: no saturation
    A = torch.randn(3, dtype=torch.float64).mul(0.3).requires_grad_()
    dt = torch.randn(24, dtype=torch.float64).requires_grad_()
    g = kda_gate(z, A, dt, lower_bound=-5.0)
    assert bool((g > -5).all() and (g < 0).all())
    alpha = g.exp()
    assert bool((alpha > math.exp(-5)).all() and (alpha < 1).all())
    zero = kda_gate(torch.zeros(1, 1, 1, 4), torch.zeros(1), None, lower_bound=-5.0)
    torch.testing.assert_close(zero, torch.full_like(zero, -2.5))
    g.sum().backward()
    u = A.detach().exp()[:, None] * (z.detach() + dt.detach().reshape(3, 8))
    s = torch.sigmoid(u)
    torch.testing.assert_close(z.grad, -5 * A.detach().exp()[:, None] * s * (1 - s))  # dg/dz
    torch.testing.assert_close(dt.grad, (-5 * A.detach().exp()[:, None] * s * (1 - s)).sum((0, 1)).reshape(-1))
    torch.testing.assert_close(A.grad, (-5 * s * (1 - s) * u).sum((0, 1, 3)))  # dg/dA summed
    old = kda_gate(torch.full((1, 1, 1, 4), 30.0), torch.zeros(1), None, lower_bound=None)
    assert bool((old < -25).all())  # the softplus form is unbounded below


def test_packed_documents_restart_conv_and_state():
    layer = make_layer()
    x = torch.randn(1, 29, 128)
    cu = torch.tensor([0, 11, 12, 29])
    with torch.no_grad():
        packed = layer(x, cu_seqlens=cu)
        parts = [layer(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    torch.testing.assert_close(packed, torch.cat(parts, 1), atol=1e-6, rtol=1e-5)


def test_prefill_then_decode_equals_longer_prefill():
    """§10.4: prefill(N) + decode(1) == prefill(N+1); the conv cache holds the last 3 pre-conv projections."""
    layer = make_layer()
    x = torch.randn(2, 21, 128)
    with torch.no_grad():
        cache = layer.new_cache(2, torch.float32, "cpu")
        layer(x[:, :20], cache=cache)
        step = layer(x[:, 20:], cache=cache)
        full = layer(x)
        cq = cache.conv.split(layer.proj_dim, dim=-1)[0]
        torch.testing.assert_close(cq, layer.q_proj(x[:, 18:21]))
        fresh = layer.new_cache(2, torch.float32, "cpu")
        layer(x, cache=fresh)
    torch.testing.assert_close(step, full[:, 20:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cache.state, fresh.state, atol=1e-6, rtol=1e-5)


def test_fp32_allow_list_survives_bf16_cast():
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).to_param_dtype(torch.bfloat16)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    expected = {
        n for n, _ in model.named_parameters()
        if n.endswith(("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias"))
    }
    assert fp32 == expected and len(expected) > 0
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (1, 9)))
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


def test_blanket_cast_keeps_the_allow_list_bit_exact():
    model = K3ForCausalLM(K3Config.preset("k3-tiny"))
    with torch.no_grad():
        model.model.layers[0].self_attn.A_log.normal_()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("A_log", "dt_bias"))}
    model.to(torch.bfloat16)
    for name, value in before.items():
        p = model.get_parameter(name)
        assert p.dtype == torch.float32 and torch.equal(p, value), name
    assert model.lm_head.weight.dtype == torch.bfloat16
    model.half()
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
