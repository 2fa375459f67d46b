"""The fused router (top-k and weights): under the interpreter (router_interpret_cases.py, in a fresh
process), the reference against the learner's MoEGate, the dispatcher's errors, and the kernel on a GPU."""

import importlib.util

import pytest
import torch
from interpreter_run import run_interpreted, run_sm90_check

from k3rl.kernels.moe.router import route_topk, route_topk_reference
from k3rl.model import K3Config
from k3rl.model.moe import MoEGate

has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@has_triton
@pytest.mark.slow
@pytest.mark.interpreter_cases("router_interpret_cases.py")
def test_route_topk_kernel_under_the_interpreter():
    run_interpreted("router_interpret_cases.py")


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
@has_triton
def test_the_decode_kernels_compile_for_sm90():
    """The router and the decode experts' kernels build for Hopper at k3-small's and K3's sizes."""
    shared = run_sm90_check("decode_sm90_check.py")
    assert sorted(shared) == sorted(f"{k}_{p}" for k in ("route_topk", "gate_up", "down_combine")
                                    for p in ("k3-small", "k3"))
    assert all(nbytes <= 232448 for nbytes in shared.values())  # the shared memory one block may use on sm_90


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_reference_is_the_learners_router(renormalize):
    config = K3Config.preset("k3-tiny").model_copy(update={"moe_renormalize": renormalize,
                                                           "routed_scaling_factor": 1.5})
    gate = MoEGate(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen))
        gate.e_score_correction_bias.copy_(torch.randn(gate.weight.shape[0], generator=gen) * 0.1)
    x = torch.randn(7, config.hidden_size, generator=gen)
    p, routing = gate(x)
    logits = torch.nn.functional.linear(x, gate.weight)
    p_ref, idx_ref = route_topk_reference(logits, gate.e_score_correction_bias, gate.top_k, renormalize, 1.5)
    assert torch.equal(routing.topk_idx, idx_ref)
    assert torch.equal(p, p_ref)
    # the dispatcher on the CPU is the reference
    p2, idx2 = route_topk(logits, gate.e_score_correction_bias, gate.top_k, renormalize, 1.5)
    assert torch.equal(p2, p_ref) and torch.equal(idx2, idx_ref)


def test_route_topk_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"logits must be \[N, E\] and bias \[E\]; got \(2, 8\) and \(4,\)"):
        route_topk(torch.zeros(2, 8), torch.zeros(4), 2, True, 1.0)
    with pytest.raises(ValueError, match=r"top_k must lie in \[1, E = 8\], got 9"):
        route_topk(torch.zeros(2, 8), torch.zeros(8), 9, True, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N, E, k", [(1, 32, 4), (256, 32, 4), (64, 896, 16)])
def test_route_topk_kernel_on_the_gpu(N, E, k):
    gen = torch.Generator().manual_seed(E)
    logits = (torch.randn(N, E, generator=gen) * 3).cuda()
    bias = (torch.randn(E, generator=gen) * 0.1).cuda()
    p, idx = route_topk(logits, bias, k, True, 1.0)
    p_ref, idx_ref = route_topk_reference(logits, bias, k, True, 1.0)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(p, p_ref, rtol=2e-6, atol=1e-7)
