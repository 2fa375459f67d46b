"""The routed tokens' dispatch and combine kernels on the CPU under TRITON_INTERPRET=1, against the
PyTorch references, forward and backward. Run by test_route_kernels.py in a fresh process."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.moe import route_combine, route_dispatch  # noqa: E402
from k3rl.kernels.moe import triton_routes as tr  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(tr.gather_sum_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)


def routes(N, K, pad, gen):
    """pos [N, K]: distinct rows of a buffer of N K + pad rows (the padding rows belong to no route)."""
    M = N * K + pad
    return torch.randperm(M, generator=gen)[: N * K].view(N, K), M


@pytest.mark.parametrize("N, K, L, pad", [(0, 4, 16, 5), (1, 1, 8, 0), (7, 4, 384, 13), (5, 16, 100, 3), (9, 2, 64, 31)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_and_combine_match_the_references(N, K, L, pad, dtype):
    gen = torch.Generator().manual_seed(N * 100 + K + L)
    pos, M = routes(N, K, pad, gen)
    z = torch.randn(N, L, generator=gen).to(dtype)
    Y = torch.randn(M, L, generator=gen).to(dtype)
    w = torch.rand(N, K, generator=gen)  # fp32, as the router gives them
    dX, du = torch.randn(M, L, generator=gen).to(dtype), torch.randn(N, L, generator=gen).to(dtype)
    out = {}
    for backend in ("triton", "torch"):
        zz, YY, ww = (t.clone().requires_grad_(True) for t in (z, Y, w))
        X = route_dispatch(zz, pos, M, backend=backend)
        u = route_combine(YY, pos, ww, dtype, backend=backend)
        torch.autograd.backward([X, u], [dX, du])
        out[backend] = (X, u, zz.grad, YY.grad, ww.grad)
    X, u, dz, dY, dw = out["triton"]
    Xr, ur, dzr, dYr, dwr = out["torch"]
    assert X.dtype == u.dtype == dz.dtype == dY.dtype == dtype and dw.dtype == torch.float32
    assert torch.equal(X, Xr)  # rows copied as they are, padding rows zero
    assert torch.equal(dY, dYr) if dtype == torch.float32 else torch.allclose(dY.float(), dYr.float(), rtol=1e-2, atol=1e-2)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(u.float(), ur.float(), **tol)  # fp32 sums, in another order than index_add's
    torch.testing.assert_close(dz.float(), dzr.float(), **tol)
    torch.testing.assert_close(dw, dwr, rtol=1e-4, atol=1e-4 if dtype == torch.float32 else 5e-2)
    untouched = torch.ones(M, dtype=torch.bool)
    untouched[pos.reshape(-1)] = False
    assert not X[untouched].any() and not dY[untouched].any()


def test_the_grouped_experts_path_is_the_loop_with_the_route_kernels():
    """latent_experts_grouped's routing arithmetic with the kernels, its GEMMs replaced by an identity."""
    from k3rl.kernels.moe import permute_by_expert, route_positions

    gen = torch.Generator().manual_seed(3)
    N, K, E, L = 11, 4, 6, 16
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    order, token_of_route, counts = permute_by_expert(idx, E)
    pos = torch.arange(N * K)  # unpadded: the sorted routes in order
    route_pos = route_positions(order, pos, idx)
    z, w = torch.randn(N, L, generator=gen), torch.rand(N, K, generator=gen)
    X = route_dispatch(z, route_pos, N * K, backend="triton")
    assert torch.equal(X, z[token_of_route])  # the sorted routes' rows
    u = route_combine(X, route_pos, w, torch.float32, backend="triton")
    torch.testing.assert_close(u, z * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-6)
