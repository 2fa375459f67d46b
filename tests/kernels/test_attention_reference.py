"""Causal attention reference against an explicit per-query softmax loop."""

import math

import pytest
import torch

from k3rl.kernels.attention import causal_attention, shared_prefix_attention


def loop_attention(q, k, v, scale, allowed):
    B, T, H, _ = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                js = [j for j in range(k.shape[1]) if allowed(b, i, j)]
                if not js:
                    continue
                s = torch.stack([q[b, i, h].double() @ k[b, j, h].double() * scale for j in js])
                p = torch.softmax(s, 0)
                o[b, i, h] = sum(p[n] * v[b, j, h].double() for n, j in enumerate(js))
    return o


@pytest.mark.parametrize("S", [7, 11])
def test_causal_with_prefix(S):
    B, T, H = 2, 7, 2
    q, k, v = torch.randn(B, T, H, 12), torch.randn(B, S, H, 12), torch.randn(B, S, H, 5)
    o = causal_attention(q, k, v, 12**-0.5)
    assert o.dtype == torch.float32
    ref = loop_attention(q, k, v, 12**-0.5, lambda b, i, j: j <= i + S - T)
    assert torch.allclose(o.double(), ref, atol=1e-5)


def test_packed_documents_block_diagonal():
    T, H = 10, 2
    q, k, v = torch.randn(1, T, H, 8), torch.randn(1, T, H, 8), torch.randn(1, T, H, 4)
    cu = torch.tensor([0, 3, 4, 10])
    doc = lambda i: int((torch.tensor(i) >= cu[1:]).sum())
    o = causal_attention(q, k, v, 0.3, cu_seqlens=cu)
    ref = loop_attention(q, k, v, 0.3, lambda b, i, j: j <= i and doc(i) == doc(j))
    assert torch.allclose(o.double(), ref, atol=1e-5)


def test_kv_lengths_padding_and_bf16_inputs():
    B, T, H = 2, 6, 1
    q, k, v = (torch.randn(B, T, H, 8).bfloat16() for _ in range(3))
    lens = torch.tensor([6, 3])
    o = causal_attention(q, k, v, 0.5, kv_lengths=lens)
    assert o.dtype == torch.float32
    ref = loop_attention(q, k, v, 0.5, lambda b, i, j: j <= i and j < lens[b])
    assert torch.allclose(o.double(), ref, atol=1e-5)


def test_gradients_flow():
    q, k, v = (torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b, c: causal_attention(a, b, c, math.sqrt(0.25)), (q, k, v))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="S >= T"):
        causal_attention(torch.randn(1, 5, 1, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), 1.0)


@pytest.mark.parametrize("case", ["causal", "prefix", "packed", "kv_lengths"])
def test_sdpa_path_matches_reference(case):
    from k3rl.kernels.attention.reference import causal_attention_reference
    from k3rl.kernels.attention.sdpa import causal_attention_sdpa

    torch.manual_seed(0)
    B, T, S, H = (1, 9, 9, 2) if case == "packed" else (2, 6, 9 if case == "prefix" else 6, 2)
    q, k, v = torch.randn(B, T, H, 12), torch.randn(B, S, H, 12), torch.randn(B, S, H, 5)
    kw = {}
    if case == "packed":
        kw["cu_seqlens"] = torch.tensor([0, 4, 5, 9])
    if case == "kv_lengths":
        kw["kv_lengths"] = torch.tensor([6, 0])  # the second sequence has no key at all
    o = causal_attention_sdpa(q, k, v, 0.3, **kw)
    ref = causal_attention_reference(q, k, v, 0.3, **kw)
    assert o.dtype == torch.float32 and torch.allclose(o, ref, atol=1e-5)


def test_sdpa_packed_gradients_match_reference():
    """Ragged packed documents through the causal-only fused path: the padding rows it computes and
    drops leave no trace in q, k, v's gradients."""
    from k3rl.kernels.attention.reference import causal_attention_reference
    from k3rl.kernels.attention.sdpa import causal_attention_sdpa

    torch.manual_seed(1)
    cu = torch.tensor([0, 7, 8, 11, 20])
    leaves = [torch.randn(1, 20, 2, n, requires_grad=True) for n in (12, 12, 5)]
    w = torch.randn(1, 20, 2, 5)
    grads = []
    for fn in (causal_attention_sdpa, causal_attention_reference):
        (fn(*leaves, 0.3, cu_seqlens=cu) * w).sum().backward()
        grads.append([x.grad.clone() for x in leaves])
        for x in leaves:
            x.grad = None
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sdpa_packed_bf16_autocast_on_cuda_near_fp32_reference():
    """The learner's case: ragged packed documents, bf16 autocast, MLA's head sizes (q/k 96, v 128).
    Output and gradients as close to the fp32 reference as bf16 inputs allow."""
    from k3rl.kernels.attention.reference import causal_attention_reference
    from k3rl.kernels.attention.sdpa import causal_attention_sdpa

    torch.manual_seed(2)
    cu = torch.tensor([0, 700, 701, 1500, 3000], device="cuda")
    leaves = [torch.randn(1, 3000, 6, n, device="cuda", requires_grad=True) for n in (96, 96, 128)]
    w = torch.randn(1, 3000, 6, 128, device="cuda")
    outs, grads = [], []
    for fn, amp in ((causal_attention_sdpa, True), (causal_attention_reference, False)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            o = fn(*leaves, 96 ** -0.5, cu_seqlens=cu)
        (o.float() * w).sum().backward()
        outs.append(o.detach().float())
        grads.append([x.grad.clone() for x in leaves])
        for x in leaves:
            x.grad = None
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(*outs) < 1e-2
    for a, b in zip(*grads, strict=True):
        assert rel(a, b) < 2e-2


@pytest.mark.parametrize("P", [0, 5])
def test_shared_prefix_attention_equals_whole_sequences_with_gradients(P):
    """Branches reading one shared prefix's keys and values: each branch's outputs and every gradient
    (the prefix's summed over the branches) equal attention over the whole [prefix ; branch] sequences."""
    H, D, Dv = 2, 8, 4
    cu = torch.tensor([0, 3, 4, 10])  # branches of 3, 1 and 6 tokens
    gen = torch.Generator().manual_seed(P)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, kp, vp = r(1, 10, H, D), r(1, 10, H, D), r(1, 10, H, Dv), r(1, P, H, D), r(1, P, H, Dv)
    a = [x.clone().requires_grad_() for x in (q, k, v, kp, vp)]
    o = shared_prefix_attention(*a[:3], a[3], a[4], D**-0.5, cu)
    w = r(*o.shape)
    (o * w).sum().backward()
    b = [x.clone().requires_grad_() for x in (q, k, v, kp, vp)]
    for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        k_all, v_all = torch.cat([b[3], b[1][:, s0:s1]], 1), torch.cat([b[4], b[2][:, s0:s1]], 1)
        o_n = causal_attention(b[0][:, s0:s1], k_all, v_all, D**-0.5)
        assert torch.allclose(o[:, s0:s1], o_n, atol=1e-12)
        (o_n * w[:, s0:s1]).sum().backward()
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x.grad, y.grad, atol=1e-12)
