"""The decode step's own pieces against the model's: the grouped routed experts, the decode forward."""

from __future__ import annotations

import contextlib

import pytest
import torch

from k3rl.kernels.moe import latent_experts_loop
from k3rl.kernels.moe.triton_decode_experts import decode_experts_reference
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.attnres import query_vector
from k3rl.rollout.engine.decode import _grouped_experts, attnres_queries, decode_forward
from k3rl.rollout.engine.state_pool import StatePool

torch.set_num_threads(1)


def test_grouped_and_gathered_experts_match_the_reference_loop():
    torch.manual_seed(0)
    E, f, lat, N, k = 6, 32, 16, 13, 3
    w1, w3 = torch.randn(E, f, lat) * 0.2, torch.randn(E, f, lat) * 0.2
    w2 = torch.randn(E, lat, f) * 0.2
    z = torch.randn(N, lat)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    idx[:5] = torch.tensor([0, 1, 2])  # one expert gets many routes, others none
    p = torch.rand(N, k)
    ref = latent_experts_loop(z, idx, p, w1, w3, w2)
    got = _grouped_experts(z.bfloat16(), idx, p, w1.bfloat16(), w3.bfloat16(), w2.bfloat16(), 4.0, 25.0)
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(decode_experts_reference(z, idx, p, w1, w3, w2, 4.0, 25.0), ref, rtol=1e-5, atol=1e-5)


def test_decode_forward_over_the_pool_equals_the_model_forward():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    with torch.no_grad():  # distinct Block AttnRes pseudo-queries (zero at init): each aggregation's own
        for name, param in model.named_parameters():
            if "_res_proj" in name or "_res_norm" in name:
                param.copy_(torch.randn_like(param) * 0.5 + ("_res_norm" in name))
    ids = [[5, 9, 33, 2, 71, 8], [12, 4, 4, 100, 3, 17]]
    pool = StatePool(model, num_slots=3, max_len=64, initial_capacity=16)
    with torch.no_grad():
        full, routing = model(torch.tensor(ids), return_routing=True)
        for slot, seq in enumerate(ids):  # prefill all but the last token, one sequence per slot
            cache = model.new_cache(1)
            model(torch.tensor([seq[:-1]]), cache=cache)
            pool.load(slot, cache)
        view = pool.view(2, 16, torch.tensor([5, 5]), [5, 5])
        logits, experts = decode_forward(model, torch.tensor([[s[-1]] for s in ids]), view)
        pool.write_back(view)
    torch.testing.assert_close(logits, full[:, -1], rtol=1e-4, atol=1e-4)
    assert torch.equal(experts, routing[:, -1])


def test_padding_rows_of_a_rung_change_nothing():
    """The batch padded to its rung, as CUDA graphs run it (free slots of length 0, greedy and
    unfiltered rows), gives every request the tokens of the unpadded batch."""
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.types import SamplingParams

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    prompts = [[(7 * i + 3 + n) % 250 + 1 for i in range(n)] for n in (5, 23, 11, 9, 17)]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=1.0, max_tokens=9, seed=11),
              SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_tokens=7, seed=5),
              SamplingParams(temperature=0, max_tokens=4, return_routed_experts=True),
              SamplingParams(temperature=0.7, max_tokens=8, seed=2)]
    results = []
    for pad in (False, True):
        eng = EmbeddedEngine(model, background=False, prefill_chunk=8, max_prefill_tokens=16)
        eng.scheduler.decoder.pad = pad
        futures = [eng.submit(p, s) for p, s in zip(prompts, params, strict=True)]
        while not all(f.done() for f in futures):
            eng.step()
        results.append([f.result() for f in futures])
    for a, b in zip(*results, strict=True):
        assert b.token_ids == a.token_ids and b.routed_experts == a.routed_experts
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4)


def test_the_decode_steps_queries_are_the_models_in_its_order():
    """attnres_queries: gamma * w of every aggregation, bit for bit, in the order the step reads them."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    model.to_param_dtype(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_res_proj" in name or "_res_norm" in name:
                param.copy_(torch.randn_like(param))
    m = model.model
    expected = [query_vector(getattr(layer, f"{which}_res_proj"), getattr(layer, f"{which}_res_norm"))
                for layer in m.layers for which in ("self_attention", "mlp")]
    expected.append(query_vector(m.output_attn_res_proj, m.output_attn_res_norm))
    got = attnres_queries(model)
    assert len(got) == len(expected) == 2 * len(m.layers) + 1
    assert all(g.dtype == torch.float32 and torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_a_failed_graph_capture_decodes_that_shape_eagerly_and_the_engine_goes_on():
    """A capture that fails (on the H200 a job's engine once hit cudaErrorStreamCaptureInvalidated, and
    every later capture then failed too, killing every episode) leaves the step to the eager path:
    the same tokens as an engine that never captures; the shape is not captured again, and after
    MAX_CAPTURE_FAILURES failures the runner stops capturing. The capture is made to fail here (CPU)."""
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.engine import decode as engine_decode
    from k3rl.types import SamplingParams

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    prompts = [[(5 * i + n) % 250 + 1 for i in range(n)] for n in (7, 19, 12)]
    params = [SamplingParams(temperature=0, max_tokens=70), SamplingParams(temperature=0.9, max_tokens=9, seed=3),
              SamplingParams(temperature=0.7, top_k=20, max_tokens=12, seed=8)]

    def run(fail: bool):
        eng = EmbeddedEngine(model, background=False, prefill_chunk=8, max_prefill_tokens=16)
        runner = eng.scheduler.decoder
        attempts = []
        if fail:
            runner.use_graphs = runner.pad = True  # as on CUDA; every capture fails

            def capture(B, S, filtered):
                attempts.append((B, S, filtered))
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            runner._capture = capture
        futures = [eng.submit(p, s) for p, s in zip(prompts, params, strict=True)]
        with pytest.warns(RuntimeWarning, match="capture of decode shape") if fail else contextlib.nullcontext():
            while not all(f.done() for f in futures):
                eng.step()
        return [f.result() for f in futures], runner, attempts

    want, _, _ = run(fail=False)
    got, runner, attempts = run(fail=True)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4)
    assert len(attempts) == len(set(attempts)) == engine_decode.MAX_CAPTURE_FAILURES  # no shape retried
    assert runner.eager_keys == set(attempts) and not runner.use_graphs and not runner.graphs
    assert len(runner.capture_failures) == 3 and "previous error during capture" in runner.capture_failures[0]


def test_the_fp32_island_weights_held_in_fp32_decode_bit_for_bit_the_same():
    """keep_fp32_island_weights: W_r and W_beta widened once (the engine's model) give the decode step
    of the bf16 model exactly, and only those two kinds of weight change dtype."""
    import copy

    from k3rl.model.kda import KimiDeltaAttention
    from k3rl.model.moe import MoEGate
    from k3rl.rollout.engine.decode import keep_fp32_island_weights

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    model.to_param_dtype(torch.bfloat16)
    widened = copy.deepcopy(model)
    keep_fp32_island_weights(widened)
    kept = {id(m.weight) for m in widened.modules() if isinstance(m, MoEGate)}
    kept |= {id(m.b_proj.weight) for m in widened.modules() if isinstance(m, KimiDeltaAttention)}
    assert len(kept) >= 2
    for (name, a), b in zip(model.named_parameters(), widened.parameters(), strict=True):
        assert b.dtype == (torch.float32 if id(b) in kept else a.dtype), name
        assert torch.equal(a.float(), b.float()), name

    def decode(m):
        ids = [[5, 9, 33, 2, 71, 8], [12, 4, 4, 100, 3, 17]]
        pool = StatePool(m, num_slots=2, max_len=64, initial_capacity=16)
        with torch.no_grad():
            for slot, seq in enumerate(ids):
                cache = m.new_cache(1)
                m(torch.tensor([seq[:-1]]), cache=cache)
                pool.load(slot, cache)
            view = pool.view(2, 16, torch.tensor([5, 5]), [5, 5])
            return decode_forward(m, torch.tensor([[s[-1]] for s in ids]), view)

    (a, ea), (b, eb) = decode(model), decode(widened)
    assert torch.equal(a, b) and torch.equal(ea, eb)


def test_decode_forward_of_several_tokens_is_the_models_prefill_forward():
    """T > 1 over a fresh K3Cache (a prefill, as a CUDA graph would capture it): the last position's logits,
    its routed experts and every layer's cache equal the model forward's."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    ids = torch.tensor([[5, 9, 33, 2, 71, 8, 40], [12, 4, 4, 100, 3, 17, 1]])
    with torch.no_grad():
        ref_cache, cache = model.new_cache(2), model.new_cache(2)
        full, routing = model(ids, cache=ref_cache, return_routing=True)
        logits, experts = decode_forward(model, ids, cache)
        cache.advance(ids.shape[1])
    torch.testing.assert_close(logits, full[:, -1], rtol=1e-4, atol=1e-4)
    assert torch.equal(experts, routing[:, -1])
    assert cache.host_lengths == ref_cache.host_lengths == [7, 7] and torch.equal(cache.lengths, ref_cache.lengths)
    for i, e in ref_cache.kda.items():
        torch.testing.assert_close(cache.kda[i].state, e.state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.kda[i].conv, e.conv)
    for i, e in ref_cache.mla.items():
        n = 7
        torch.testing.assert_close(cache.mla[i].latent[:, :n], e.latent[:, :n], rtol=1e-4, atol=1e-5)
