"""The fused router kernel on the CPU under TRITON_INTERPRET=1, against the PyTorch reference and the
learner's MoEGate. Run by test_router_kernel.py in a fresh process (TRITON_INTERPRET=1 must be set
before triton is imported)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.moe import triton_router  # noqa: E402
from k3rl.kernels.moe.router import route_topk, route_topk_reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(triton_router.route_topk_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)


@pytest.mark.parametrize("N, E, k", [(1, 32, 4), (5, 32, 4), (3, 37, 5), (2, 896, 16), (4, 8, 1), (2, 6, 6)])
@pytest.mark.parametrize("renormalize, scaling", [(True, 1.0), (False, 2.5)])
def test_route_topk_kernel_matches_the_reference(N, E, k, renormalize, scaling):
    gen = torch.Generator().manual_seed(N * 1000 + E + k)
    logits = torch.randn(N, E, generator=gen) * 3
    bias = torch.randn(E, generator=gen) * 0.1
    p, idx = route_topk(logits, bias, k, renormalize, scaling, backend="triton")
    p_ref, idx_ref = route_topk_reference(logits, bias, k, renormalize, scaling)
    assert idx.dtype == torch.int64 and p.dtype == torch.float32
    assert torch.equal(idx, idx_ref)  # same experts in the same order (highest biased score first)
    torch.testing.assert_close(p, p_ref, rtol=2e-6, atol=1e-7)


def test_the_bias_picks_the_experts_and_never_enters_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 wins the selection on its bias alone
    p, idx = route_topk(logits, bias, 2, False, 1.0, backend="triton")
    assert idx.tolist() == [[3, 0]]
    torch.testing.assert_close(p, torch.sigmoid(logits[:, [3, 0]]))


def test_ties_go_to_the_lower_expert_id():
    p, idx = route_topk(torch.zeros(1, 8), torch.zeros(8), 3, True, 1.0, backend="triton")
    assert idx.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(p, torch.full((1, 3), 1 / 3))


def test_the_decode_step_through_its_kernels_is_the_torch_decode_step():
    """k3-tiny's decode step (batch 1: the routed experts by the decode kernels) with every op on its Triton
    kernel (the router's top-k, the experts, RMSNorm, AttnRes, the KDA islands and recurrence) equals
    the same step by PyTorch ops: the wiring of rollout/engine/decode.py, not only each kernel alone."""
    from k3rl.model import K3Config, K3ForCausalLM
    from k3rl.rollout.engine.decode import decode_forward
    from k3rl.rollout.engine.state_pool import StatePool

    def step(backend):
        torch.manual_seed(0)
        model = K3ForCausalLM(K3Config.preset("k3-tiny").model_copy(update={"kernel_backend": "torch"})).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():  # distinct AttnRes queries (zero at init)
                if "_res_proj" in name or "_res_norm" in name:
                    param.copy_(torch.randn_like(param) * 0.5 + ("_res_norm" in name))
        seq = [5, 9, 33, 2, 71, 8]
        pool = StatePool(model, num_slots=1, max_len=64, initial_capacity=16)
        with torch.no_grad():
            cache = model.new_cache(1)
            model(torch.tensor([seq[:-1]]), cache=cache)  # the prefill by PyTorch ops (k3-tiny's chunk is 16)
            pool.load(0, cache)
            model.config.kernel_backend = backend  # then the decode step by `backend`
            for m in model.modules():
                if hasattr(m, "backend"):
                    m.backend = backend
            view = pool.view(1, 16, torch.tensor([5]), [5])
            return decode_forward(model, torch.tensor([[seq[-1]]]), view)

    (lt, et), (lr, er) = step("triton"), step("torch")
    assert torch.equal(et, er)
    torch.testing.assert_close(lt, lr, rtol=1e-4, atol=1e-4)
