"""The routed tokens' dispatch and combine (kernels/moe/triton_routes.py): under the interpreter
(routes_interpret_cases.py, in a fresh process), compiled for sm_90, and in the grouped experts on a GPU."""

import importlib.util

import pytest
import torch
from interpreter_run import run_interpreted, run_sm90_check

has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@has_triton
@pytest.mark.slow
@pytest.mark.interpreter_cases("routes_interpret_cases.py")
def test_route_kernels_under_the_interpreter():
    run_interpreted("routes_interpret_cases.py")


@has_triton
@pytest.mark.slow
def test_the_route_kernels_compile_for_sm90():
    shared = run_sm90_check("routes_sm90_check.py")
    assert len(shared) == 8 and all(n <= 232448 for n in shared.values()), shared


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_with_the_route_kernels_match_the_loop_forward_and_backward():
    from k3rl.kernels.moe import latent_experts_grouped, latent_experts_loop

    gen = torch.Generator().manual_seed(0)
    N, K, E, L, F = 300, 4, 32, 384, 256
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)]).cuda()
    args = [torch.randn(N, L, generator=gen), torch.rand(N, K, generator=gen),
            torch.randn(E, F, L, generator=gen) * 0.05, torch.randn(E, F, L, generator=gen) * 0.05,
            torch.randn(E, L, F, generator=gen) * 0.05]  # fmt: skip
    du = torch.randn(N, L, generator=gen).cuda().bfloat16()
    grads = []
    for fn in (latent_experts_grouped, latent_experts_loop):
        z, w, w1, w3, w2 = (a.cuda().to(torch.bfloat16 if i != 1 else torch.float32).requires_grad_(True)
                            for i, a in enumerate(args))  # fmt: skip
        u = fn(z, idx, w, w1, w3, w2)
        u.backward(du)
        grads.append([u.float(), z.grad.float(), w.grad, w1.grad.float(), w2.grad.float()])
    for a, b in zip(*grads, strict=True):
        assert (a - b).norm() / b.norm() < 2e-2
