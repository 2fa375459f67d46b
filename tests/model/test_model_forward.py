"""K3ForCausalLM forward: packing, routing replay, activation checkpointing, bf16 autocast, devices."""

from __future__ import annotations

import pytest
import torch
from k3_model_helpers import make_tiny

from k3rl.model import K3Config, K3ForCausalLM


def test_packed_documents_equal_separate_forwards():
    model = make_tiny()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (1, n), generator=g) for n in (9, 1, 14)]
    cu = torch.tensor([0, 9, 10, 24])
    with torch.no_grad():
        packed = model(torch.cat(docs, 1), cu_seqlens=cu)
        separate = torch.cat([model(d) for d in docs], 1)
    torch.testing.assert_close(packed, separate, atol=1e-4, rtol=1e-3)  # fp32, chunk boundaries differ


def test_return_routing_and_replay():
    model = make_tiny()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, routes = model(ids, return_routing=True)
        assert routes.shape == (2, 10, len(model.moe_layers()), model.config.num_experts_per_token)
        replayed, routes2 = model(ids, routed_experts=routes, return_routing=True)
        assert torch.equal(routes, routes2)
        torch.testing.assert_close(replayed, logits)
        other = (routes + 1) % model.config.num_experts  # a different (valid) routing
        changed = model(ids, routed_experts=other)
    assert (changed - logits).abs().max() > 1e-4
    with pytest.raises(ValueError, match="routed_experts must be"):
        model(ids, routed_experts=routes[:, :5])


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    grads = []
    for ckpt in (False, True):
        model = make_tiny(seed=4)
        model.train()
        model.gradient_checkpointing = ckpt
        loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, 320), ids[:, 1:].reshape(-1))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 50
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4, msg=name)
    # the AttnRes pseudo-queries and the KDA gate parameters are trained
    assert "model.layers.1.self_attention_res_proj.weight" in grads[0]
    assert "model.layers.0.self_attn.A_log" in grads[0] and "model.layers.0.self_attn.dt_bias" in grads[0]


def test_bf16_autocast_keeps_fp32_islands():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()  # the model's own initialisation
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, routes = model(ids, return_routing=True)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, routed_experts=routes)  # same experts: compare the arithmetic only
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.model.layers[0].self_attn.A_log.grad is not None
    err = (out.float() - ref).abs().max() / ref.abs().max()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
    assert err < 0.1 and cos > 0.999, f"bf16 autocast: relative error {err}, cosine {cos}"


def test_mixers_cast_their_shared_input_once_under_autocast(monkeypatch):
    """Each mixer casts the normed residual once for its projections (not once per projection):
    the forward is the same bits as autocast's per-linear casts, the gradients agree to bf16
    rounding (summed in bf16, widened once), and a step writes fewer fp32 -> bf16 copies."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from k3rl.model import common, kda, mla, moe

    class Casts(TorchDispatchMode):  # fp32 -> bf16 copies of activations [1, T, d] / [T, d]
        def __init__(self, d):
            super().__init__()
            self.d, self.n = d, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 \
                    and out.dtype == torch.bfloat16 and args[0].shape[-1] == self.d and args[0].numel() > self.d:
                self.n += 1
            return out

    cfg = K3Config.preset("k3-tiny")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))

    def run():
        torch.manual_seed(0)
        model = K3ForCausalLM(cfg).train()
        counter = Casts(cfg.hidden_size)
        with torch.autocast("cpu", dtype=torch.bfloat16), counter:
            out = model(ids)
            out.float().square().mean().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, counter.n

    once, grads_once, casts_once = run()
    for mod in (common, kda, mla, moe):  # autocast's own per-linear casts, as before the change
        monkeypatch.setattr(mod, "matmul_input", lambda x: x)
    each, grads_each, casts_each = run()
    assert torch.equal(once, each)  # the same bf16 values reach every projection
    assert grads_once.keys() == grads_each.keys()
    for name, g in grads_each.items():  # (zero-initialised AttnRes queries: zero gradients in both)
        err = (grads_once[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 0.05 or g.norm() == grads_once[name].norm() == 0, f"{name}: relative gradient error {err}"
    # k3-tiny: 5 -> 1 in each KDA layer, 3 -> 1 in each MLA layer, 2 -> 1 in each MLP / shared expert
    assert casts_once < casts_each - cfg.num_hidden_layers, (casts_once, casts_each)


def test_input_errors_are_clear():
    model = make_tiny()
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="packed cu_seqlens needs batch 1"):
        model(torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_cuda_and_matches_cpu():
    model = make_tiny()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cpu = model(ids)
        gpu = model.cuda()(ids.cuda())
        cache = model.new_cache(2)
        steps = torch.cat([model(ids[:, t : t + 1].cuda(), cache=cache) for t in range(33)], 1)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(steps, gpu, atol=5e-3, rtol=5e-3)
