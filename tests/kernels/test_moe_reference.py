"""Latent experts: permutation + grouped GEMM + combine against a per-token loop."""

import pytest
import torch

from k3rl.kernels.moe import latent_experts, latent_experts_grouped, latent_experts_loop
from k3rl.kernels.situ import situ_glu


def make(N=24, dim=16, f=8, E=6, k=3, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, dim, generator=gen, dtype=dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    idx[:, 0] = torch.where(torch.arange(N) % 2 == 0, 0, idx[:, 0])  # skewed: expert 0 popular ...
    idx = torch.where(idx == E - 1, 0, idx)  # ... and expert E-1 gets nothing
    idx = torch.stack(
        [torch.unique(r) if len(torch.unique(r)) == k else torch.randperm(E - 1)[:k] for r in idx]
    )
    w = torch.rand(N, k, generator=gen, dtype=torch.float32)
    ws = [torch.randn(E, *s, generator=gen, dtype=dtype) * 0.3 for s in ((f, dim), (f, dim), (dim, f))]
    return z, idx, w, *ws


def per_token(z, idx, w, w1, w3, w2):
    out = torch.zeros(z.shape, dtype=torch.float64)
    for t in range(z.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = w2[e] @ situ_glu(w1[e] @ z[t], w3[e] @ z[t])
            out[t] += w[t, j].double() * h.double()
    return out


def test_loop_matches_per_token():
    z, idx, w, w1, w3, w2 = make()
    assert (idx[:, None] == torch.arange(6)[None, :, None]).any(-1).sum(0)[5] == 0  # an idle expert
    out = latent_experts(z, idx, w, w1, w3, w2)
    assert torch.allclose(out, per_token(z, idx, w, w1, w3, w2), atol=1e-5)  # fp32 combine


def test_grouped_path_matches_loop_forward():
    z, idx, w, w1, w3, w2 = make(dtype=torch.float32)
    a = latent_experts_loop(z, idx, w, w1, w3, w2)
    b = latent_experts_grouped(z, idx, w, w1, w3, w2)
    assert torch.allclose(a, b, atol=1e-5)


def test_gradients_match_per_token():
    z, idx, w, w1, w3, w2 = make(N=8, E=4, k=2)
    ps = [x.clone().requires_grad_() for x in (z, w1, w3, w2)]
    wq = w.double().requires_grad_()
    latent_experts(ps[0], idx, wq, *ps[1:]).square().sum().backward()
    qs = [x.clone().requires_grad_() for x in (z, w1, w3, w2)]
    wr = w.double().requires_grad_()
    per_token_autograd = torch.zeros_like(z)
    for t in range(z.shape[0]):
        acc = 0
        for j in range(2):
            e = idx[t, j]
            acc = acc + wr[t, j] * (qs[3][e] @ situ_glu(qs[1][e] @ qs[0][t], qs[2][e] @ qs[0][t]))
        per_token_autograd = per_token_autograd.index_put((torch.tensor([t]),), acc[None])
    per_token_autograd.square().sum().backward()
    for a, b in zip(ps, qs, strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)
    assert torch.allclose(wq.grad, wr.grad, atol=1e-5)


def test_bad_index_raises():
    z, idx, w, w1, w3, w2 = make()
    with pytest.raises(ValueError, match="must lie in"):
        latent_experts(z, idx + 6, w, w1, w3, w2)
    with pytest.raises(ValueError, match="w2 must be"):
        latent_experts(z, idx, w, w1, w3, w2.transpose(1, 2))


def test_the_grouped_path_reads_nothing_on_the_host():
    """Counting, permuting and the grouped GEMMs run on fake tensors, which hold no data: a read on the
    host (bincount sizing its output, .item(), .tolist()) raises there. And the count is bincount's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3rl.kernels.moe import count_per_expert, latent_experts_grouped

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    gen = torch.Generator().manual_seed(0)
    E, k, N, dim, f = 6, 2, 11, 16, 32
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    assert torch.equal(count_per_expert(idx, E), torch.bincount(idx.reshape(-1), minlength=E))
    z = torch.randn(N, dim, generator=gen).bfloat16()
    w1, w3 = (torch.randn(E, f, dim, generator=gen).bfloat16() for _ in range(2))
    w2 = torch.randn(E, dim, f, generator=gen).bfloat16()
    p = torch.rand(N, k, generator=gen)
    with FakeTensorMode(allow_non_fake_inputs=True):
        u = latent_experts_grouped(z, idx, p, w1, w3, w2)
    assert u.shape == (N, dim) and u.dtype == torch.bfloat16
