"""KDA references: chunk form == recurrent form == naive loop (docs/model.md §10.1-10.3, §10.5)."""

import math

import pytest
import torch

from k3rl.kernels.kda import (
    chunk_kda,
    chunk_kda_reference,
    fused_recurrent_kda,
    kda_chunk_transition,
    kda_gate,
    kda_transition,
    naive_recurrent_kda,
)

F64 = torch.float64


def make_inputs(B=2, T=37, H=2, K=8, V=6, dtype=F64, seed=0, gate="bounded"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    z = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    A_log = torch.randn(H, generator=gen, dtype=dtype) * 0.5
    g = kda_gate(z, A_log, None, -5.0 if gate == "bounded" else None)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T", [1, 16, 37, 64, 100])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_naive_fp64(T, chunk_size, with_state):
    q, k, v, g, beta, S0 = make_inputs(T=T, seed=T)
    init = S0 if with_state else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
    o, s = chunk_kda_reference(
        q, k, v, g, beta, initial_state=init, output_final_state=True, chunk_size=chunk_size
    )
    assert (o - o_ref).abs().max() < 1e-10
    assert (s - s_ref).abs().max() < 1e-10


def test_naive_is_eq1_matrix_form():
    """The 4-step loop equals S_t = (I - b k k^T) Diag(alpha) S + b k v^T, o_t = S_t^T q_t."""
    q, k, v, g, beta, S0 = make_inputs(B=1, T=5, H=1)
    o, s = naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=S0, output_final_state=True)
    S = S0[0, 0]
    for t in range(5):
        kt, vt, qt, bt = k[0, t, 0], v[0, t, 0], q[0, t, 0], beta[0, t, 0]
        S = (torch.eye(8, dtype=F64) - bt * torch.outer(kt, kt)) @ torch.diag(
            g[0, t, 0].exp()
        ) @ S + bt * torch.outer(kt, vt)
        assert torch.allclose(o[0, t, 0], S.T @ qt, atol=1e-12)
    assert torch.allclose(s[0, 0], S, atol=1e-12)


def test_dispatchers_on_cpu_use_reference():
    q, k, v, g, beta, S0 = make_inputs()
    o1, s1 = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o2, s2 = fused_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert (o1 - o2).abs().max() < 1e-10 and (s1 - s2).abs().max() < 1e-10
    assert chunk_kda(q, k, v, g, beta)[1] is None


def test_varlen_equals_separate_sequences():
    lens = [5, 64, 1, 30]
    T = sum(lens)
    q, k, v, g, beta, _ = make_inputs(B=1, T=T, seed=3)
    S0 = torch.randn(len(lens), 2, 8, 6, dtype=F64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, s = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        sl = lambda x, a=a, b=b: x[:, a:b]
        o_i, s_i = naive_recurrent_kda(
            sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=S0[i : i + 1], output_final_state=True
        )
        assert (o[:, a:b] - o_i).abs().max() < 1e-10
        assert (s[i] - s_i[0]).abs().max() < 1e-10


def test_forked_state_equals_whole_sequences_with_gradients():
    """A shared prefix run once, its final state handed to every branch as the branch's initial state
    (per document, cu_seqlens), gives each [prefix ; branch] sequence's outputs, and every input's gradient
    (the prefix's summed over its branches, through the final state) equals running the sequences whole.
    fp64, chunk 16: a prefix of 2 chunks plus 5 tokens, branches of 1..20 tokens."""
    P, lens, C = 37, [20, 1, 9], 16
    pre = make_inputs(B=1, T=P, seed=11)[:5]
    br = make_inputs(B=1, T=sum(lens), seed=12)[:5]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    a = [x.clone().requires_grad_() for x in pre + br]
    o_p, S_p = chunk_kda_reference(*a[:5], output_final_state=True, chunk_size=C)
    o_b, _ = chunk_kda_reference(*a[5:], initial_state=S_p.expand(len(lens), -1, -1, -1), cu_seqlens=cu,
                                 chunk_size=C)
    w_p, w_b = torch.randn_like(o_p), torch.randn_like(o_b)
    ((o_p * w_p).sum() + (o_b * w_b).sum()).backward()
    b = [x.clone().requires_grad_() for x in pre + br]
    loss = 0
    for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        whole = [torch.cat([b[i], b[5 + i][:, s0:s1]], 1) for i in range(5)]
        o, _ = naive_recurrent_kda(*whole)
        assert (o[:, P:] - o_b[:, s0:s1]).abs().max() < 1e-10 and (o[:, :P] - o_p).abs().max() < 1e-10
        # the prefix's outputs counted once (as the tree computes them), each branch's own
        loss = loss + (o[:, :P] * w_p).sum() / len(lens) + (o[:, P:] * w_b[:, s0:s1]).sum()
    loss.backward()
    for x, y in zip(a, b, strict=True):
        assert (x.grad - y.grad).abs().max() < 1e-9


def test_gate_and_l2norm_in_kernel_match_explicit():
    B, T, H, K = 1, 20, 2, 8
    q, k, v, _, beta, S0 = make_inputs(B=B, T=T, H=H, K=K)
    z = torch.randn(B, T, H, K, dtype=F64)
    A_log, dt_bias = torch.randn(H, dtype=F64), torch.randn(H * K, dtype=F64)
    kw = dict(
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0
    )
    o, _ = chunk_kda(q * 3, k * 2, v, z, beta, **kw)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6 / 9)  # l2norm(3q) = 3q / sqrt(9|q|^2 + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6 / 4)
    g = -5.0 * torch.sigmoid(A_log.exp()[:, None] * (z + dt_bias.reshape(H, K)))
    o_ref, _ = naive_recurrent_kda(qn, kn, v, g, beta)
    assert (o - o_ref).abs().max() < 1e-10


def test_gate_range_and_reference_point():
    gen = torch.Generator().manual_seed(0)  # |u| stays well inside where fp64 sigmoid is not exactly 0 or 1
    z = torch.randn(4, 50, 3, 16, dtype=F64, generator=gen) * 3
    A_log = torch.randn(3, dtype=F64, generator=gen)
    g = kda_gate(z, A_log, None, -5.0)
    assert (g > -5).all() and (g < 0).all()
    alpha = g.exp()
    assert (alpha > math.exp(-5)).all() and (alpha < 1).all()
    g0 = kda_gate(torch.zeros(1, 1, 1, 1, dtype=F64), torch.zeros(1, dtype=F64), None, -5.0)
    assert g0.item() == pytest.approx(-2.5) and g0.exp().item() == pytest.approx(0.0821, abs=1e-4)
    g_old = kda_gate(z, A_log, None, None)
    assert (g_old < 0).all() and g_old.min() < -5  # unbounded below


def test_gate_gradients_match_analytic():
    H, K = 2, 4
    z = torch.randn(1, 3, H, K, dtype=F64, requires_grad=True)
    A_log = torch.randn(H, dtype=F64, requires_grad=True)
    dt_bias = torch.randn(H * K, dtype=F64, requires_grad=True)
    g = kda_gate(z, A_log, dt_bias, -5.0)
    g.sum().backward()
    u = A_log.detach().exp()[:, None] * (z.detach() + dt_bias.detach().reshape(H, K))
    s = torch.sigmoid(u)
    dg_dz = -5.0 * A_log.detach().exp()[:, None] * s * (1 - s)  # g_min e^A sigma (1 - sigma)
    assert torch.allclose(z.grad, dg_dz, atol=1e-12)
    assert torch.allclose(dt_bias.grad, dg_dz.sum((0, 1)).reshape(-1), atol=1e-12)
    assert torch.allclose(A_log.grad, (-5.0 * s * (1 - s) * u).sum((0, 1, 3)), atol=1e-12)  # g_min s(1-s) u
    # old form: dg/dz = -e^A sigma(z), dg/dA = g
    z.grad = A_log.grad = None
    g_old = kda_gate(z, A_log, None, None)
    g_old.sum().backward()
    assert torch.allclose(z.grad, -A_log.detach().exp()[:, None] * torch.sigmoid(z.detach()), atol=1e-12)
    assert torch.allclose(A_log.grad, g_old.detach().sum((0, 1, 3)), atol=1e-12)


def _max_tile_span(g, tile=16):
    G = g.cumsum(1)  # [B, T, H, K]
    worst = 0.0
    for s in range(g.shape[1] - tile + 1):
        Gw = G[:, s : s + tile]
        worst = max(worst, (Gw[:, :1] - Gw).abs().max().item())  # |G_start - G_j| inside the window
    return worst


def test_tile_bound_holds_for_bounded_gate_only():
    z = torch.randn(2, 64, 4, 32, dtype=F64) * 4 + 2
    A_log = torch.full((4,), 2.0, dtype=F64)
    assert _max_tile_span(kda_gate(z, A_log, None, -5.0)) < 80
    assert _max_tile_span(kda_gate(z, A_log, None, None)) > 80  # the softplus gate breaks the bound


def test_chunk_transition_is_product_of_token_transitions():
    q, k, v, g, beta, S0 = make_inputs(B=1, T=40, H=2, seed=7)
    M = kda_chunk_transition(k, g, beta, chunk_size=16)  # [1, 2, 3, K, K]
    assert M.shape == (1, 2, 3, 8, 8)
    for h in range(2):
        P = torch.eye(8, dtype=F64)
        for t in range(16):
            kt = k[0, t, h]
            P = (
                (torch.eye(8, dtype=F64) - beta[0, t, h] * torch.outer(kt, kt))
                @ torch.diag(g[0, t, h].exp())
                @ P
            )
        assert (M[0, h, 0] - P).abs().max() < 1e-12


def test_segment_composition_for_context_parallelism():
    q, k, v, g, beta, S0 = make_inputs(B=1, T=90, seed=11)
    _, s_full = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    S = S0
    for a, b in [(0, 33), (33, 70), (70, 90)]:  # three "ranks"
        sl = lambda x, a=a, b=b: x[:, a:b]
        M = kda_transition(sl(k), sl(g), sl(beta), chunk_size=16)
        _, s_zero = chunk_kda(sl(q), sl(k), sl(v), sl(g), sl(beta), output_final_state=True, chunk_size=16)
        S = M @ S + s_zero  # S <- M_[j] S + S~_[j]
    assert (S - s_full).abs().max() < 1e-10


def test_fp32_reference_on_bf16_inputs_returns_bf16_and_fp32_state():
    q, k, v, g, beta, S0 = make_inputs(dtype=torch.bfloat16)
    o, s = chunk_kda(q, k, v, g.float(), beta, initial_state=S0.float(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, _ = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=S0.double())
    assert (o.double() - o_ref).abs().max() < 0.05 * o_ref.abs().max()


def test_reference_backward_matches_naive():
    q, k, v, g, beta, S0 = make_inputs(B=1, T=21, seed=5)
    xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
    ys = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
    o1, s1 = chunk_kda_reference(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=16)
    o2, s2 = naive_recurrent_kda(*ys[:5], initial_state=ys[5], output_final_state=True)
    w_o, w_s = torch.randn_like(o1), torch.randn_like(s1)
    ((o1 * w_o).sum() + (s1 * w_s).sum()).backward()
    ((o2 * w_o).sum() + (s2 * w_s).sum()).backward()
    for a, b in zip(xs, ys, strict=True):
        assert (a.grad - b.grad).abs().max() < 1e-10


@pytest.mark.parametrize(
    "bad, msg",
    [
        (dict(beta=torch.rand(1, 8, 3)), "beta must be"),
        (dict(initial_state=torch.zeros(2, 2, 8, 6)), "initial_state must be"),
        (dict(cu_seqlens=torch.tensor([0, 3, 7])), "end at T=8"),
        (dict(backend="cuda"), "backend must be one of"),
    ],
)
def test_bad_inputs_raise_clear_errors(bad, msg):
    q, k, v, g, beta, _ = make_inputs(B=1, T=8)
    args = dict(q=q, k=k, v=v, g=g, beta=beta) | bad
    with pytest.raises(ValueError, match=msg):
        chunk_kda(**args)


def test_inplace_decode_overwrites_the_given_state_with_the_same_numbers():
    q, k, v, g, beta, S0 = make_inputs(B=2, T=3, dtype=torch.float32)
    o1, s1 = fused_recurrent_kda(q, k, v, g, beta, initial_state=S0.clone(), output_final_state=True)
    state = S0.clone()
    o2, s2 = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, inplace_final_state=True)
    assert s2 is state and not torch.equal(state, S0)  # written where it lay
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    with pytest.raises(ValueError, match="needs an initial_state"):
        fused_recurrent_kda(q, k, v, g, beta, inplace_final_state=True)
    with pytest.raises(ValueError, match="contiguous fp32 initial_state; got torch.float64"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=S0.double(), inplace_final_state=True)
    with pytest.raises(ValueError, match="not contiguous"):
        strided = S0.transpose(2, 3).contiguous().transpose(2, 3)
        fused_recurrent_kda(q, k, v, g, beta, initial_state=strided, inplace_final_state=True)


def test_triton_backend_without_cuda_is_refused(monkeypatch):
    from k3rl.kernels._backend import resolve_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("triton", "chunk_kda", x)
    assert resolve_backend("auto", "chunk_kda", x) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "chunk_kda", x) == "triton"
    with pytest.raises(ValueError, match="no Triton kernel"):
        resolve_backend("triton", "op", x, has_triton=False)
