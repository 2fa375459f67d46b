"""Chunked token log-probs / entropies from hidden states: equal to the full-logits path, forward
and backward, and no [T, V] tensor is ever created."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from k3rl.learner.losses import token_entropy, token_logprobs
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.logprobs import chunked_token_logprobs


def _inputs(T=37, d=16, V=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, d, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, d, generator=g, dtype=dtype) * 0.5).requires_grad_(True)
    y = torch.randint(0, V, (T,), generator=g)
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
def test_forward_and_backward_equal_the_full_logits_path(chunk):
    h, w, y = _inputs()
    logp, ent = chunked_token_logprobs(h, w, y, chunk)
    z = F.linear(h, w)
    ref_logp, ref_ent = token_logprobs(z, y), token_entropy(z)
    torch.testing.assert_close(logp.double(), ref_logp.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent.double(), rtol=0, atol=1e-5)  # both fp32

    g1, g2 = torch.randn(2, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((logp * g1).sum() + (ent * g2).sum(), (h, w))
    ref = torch.autograd.grad((ref_logp * g1).sum() + (ref_ent * g2).sum(), (h, w))
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)  # fp32 logits on both sides


@pytest.mark.parametrize("tau", [0.7, 1.3])
def test_a_temperature_is_the_policy_softmax_of_logits_over_tau(tau):
    # the policy an engine sampling at temperature tau draws from: log softmax(z / tau), its entropy and
    # both gradients (through z / tau) equal the full-logits path on the divided logits
    h, w, y = _inputs(seed=2)
    logp, ent = chunked_token_logprobs(h, w, y, 6, temperature=tau)
    z = F.linear(h, w) / tau
    ref_logp, ref_ent = token_logprobs(z, y), token_entropy(z)
    torch.testing.assert_close(logp.double(), ref_logp.double(), rtol=0, atol=1e-5)  # z / tau in fp32 vs fp64
    torch.testing.assert_close(ent.double(), ref_ent.double(), rtol=0, atol=1e-5)
    g1, g2 = torch.randn(2, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((logp * g1).sum() + (ent * g2).sum(), (h, w))
    ref = torch.autograd.grad((ref_logp * g1).sum() + (ref_ent * g2).sum(), (h, w))
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
    assert (logp - chunked_token_logprobs(h, w, y, 6)[0]).abs().max() > 1e-2  # not the temperature-1 numbers
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_token_logprobs(h, w, y, 6, temperature=0.0)


def test_gradient_of_one_output_alone():
    h, w, y = _inputs(seed=1)
    logp, _ = chunked_token_logprobs(h, w, y, 5)
    ref = torch.autograd.grad(token_logprobs(F.linear(h, w), y).sum(), (h, w))
    for a, b in zip(torch.autograd.grad(logp.sum(), (h, w)), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    _, ent = chunked_token_logprobs(h, w, y, 5)
    ref = torch.autograd.grad(token_entropy(F.linear(h, w)).sum(), (h, w))
    for a, b in zip(torch.autograd.grad(ent.sum(), (h, w)), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_matches_the_autocast_linear_path():
    h, w, y = _inputs(T=64, d=32, V=80, dtype=torch.float32, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = chunked_token_logprobs(h, w, y, 16)
        z = F.linear(h, w)  # bf16 logits, as nn.Linear gives under autocast
    assert z.dtype == torch.bfloat16 and logp.dtype == torch.float32
    torch.testing.assert_close(logp, token_logprobs(z, y), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, token_entropy(z), rtol=0, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_tokens_times_vocabulary_is_created():
    T, d, V, chunk = 512, 8, 1000, 32
    h, w, y = _inputs(T, d, V, dtype=torch.float32, seed=3)
    with _LargestTensor() as mode:
        logp, ent = chunked_token_logprobs(h, w, y, chunk)
        (logp.sum() + ent.sum()).backward()
    assert mode.largest <= chunk * V  # one chunk's logits; the full path needs T x V = 16x that
    with _LargestTensor() as full:
        token_logprobs(F.linear(h, w), y).sum().backward()
    assert full.largest >= T * V


def test_model_returns_the_same_logprobs_and_gradients_with_targets():
    torch.manual_seed(0)
    cfg = K3Config.preset("k3-tiny")
    model = K3ForCausalLM(cfg)
    ids = torch.randint(0, 256, (1, 40))  # byte tokens: no media placeholders
    targets = torch.randint(0, cfg.vocab_size, (1, 40))
    cu = torch.tensor([0, 17, 40])

    logits = model(ids, cu_seqlens=cu)
    ref_logp, ref_ent = token_logprobs(logits[0], targets[0]), token_entropy(logits[0])
    (ref_logp.sum() + 0.3 * ref_ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    logp, ent = model(ids, cu_seqlens=cu, targets=targets, logprob_chunk_tokens=8)
    torch.testing.assert_close(logp[0], ref_logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent[0], ref_ent, rtol=0, atol=2e-5)
    (logp.sum() + 0.3 * ent.sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)
    with pytest.raises(ValueError, match=r"targets must be \[B, T\]"):
        model(ids, targets=targets[:, :5])
