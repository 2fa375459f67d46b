"""The prefill graphs' path on the CPU (rollout/engine/prefill_graphs.py): bucketed chunks (fresh and after a
cached prefix), padding rows, the rest fed by decode steps, run eagerly over the same static buffers the
CUDA graphs capture. Every request's tokens equal the plain engine's, its log-probs to float rounding."""

from __future__ import annotations

import pytest
import torch

from k3rl.model import K3Config, K3ForCausalLM
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.engine.prefill_graphs import ALIGN, PrefillGraphs, bucket
from k3rl.types import SamplingParams

torch.set_num_threads(1)


def _model():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # sharp logits: no near ties between the two paths' roundings
    return model


def _run(eng, prompts, params):
    futures = [eng.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    while not all(f.done() for f in futures):
        eng.step()
    return [f.result() for f in futures]


def test_bucket_is_the_largest_multiple_of_align_in_the_chunk():
    assert [bucket(n, 512) for n in (15, 63, 64, 100, 128, 511, 700)] == [0, 48, 64, 96, 128, 496, 512]


def test_graphed_prefill_gives_the_plain_engines_tokens():
    model = _model()
    lengths = (70, 75, 130, 64, 200, 40, 600, 128)  # 600: past the chunk
    prompts = [[(7 * i + 3 + n) % 250 + 1 for i in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=1.0, max_tokens=7, seed=11),
              SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_tokens=5, seed=5),
              SamplingParams(temperature=0, max_tokens=4, return_routed_experts=True),
              SamplingParams(temperature=0.7, max_tokens=8, seed=2), SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=1.0, max_tokens=6, seed=3)]
    plain = _run(EmbeddedEngine(model, background=False, max_model_len=1024), prompts, params)
    eng = EmbeddedEngine(model, background=False, max_model_len=1024, prefill_graphs=True)  # decode_append: 64
    graphed = _run(eng, prompts, params)
    for a, b in zip(plain, graphed, strict=True):
        assert b.token_ids == a.token_ids and b.routed_experts == a.routed_experts
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4)
    g = eng.scheduler.prefill.graphs
    assert eng.decode_append == 64 and g.runs >= 1 and eng.metrics()["prefill_graph_runs"] == g.runs and g.captures == 0  # no graphs on the CPU: the same path eagerly
    # buckets of 16: the prompts' tails (70 - 64, 75 - 64, 130 - 128, 200 - 192, 40 - 32) were fed by decode
    # steps; 600 went as a fresh chunk of 512 and a cached one of 80, its last 8 fed
    assert ALIGN == 16 and eng.stats["fed_prompt_tokens"] == 6 + 11 + 2 + 8 + 8 + 8
    assert eng.stats["prefill_tokens"] == 64 + 64 + 128 + 64 + 192 + 32 + 512 + 80 + 128
    assert g.cached_runs == 1


def test_padding_rows_and_one_forward_per_bucket():
    """Three prompts of one bucket: one forward of a row rung of 4 (a padding row of token 0, dropped),
    each row's logits and cache equal its own forward's."""
    model = _model()
    g = PrefillGraphs(model, None, max_tokens=512, use_graphs=True)  # the CPU: eager, same buffers
    rows = [[(5 * i + r) % 250 + 1 for i in range(ALIGN)] for r in range(3)]
    with torch.no_grad():
        logits, caches = g.run(rows)
        for row, got, cache in zip(rows, logits, caches, strict=True):
            ref_cache = model.new_cache(1)
            ref = model(torch.tensor([row]), cache=ref_cache)[0, -1]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            assert cache.host_lengths == [ALIGN]
            for i, e in ref_cache.kda.items():
                torch.testing.assert_close(cache.kda[i].state, e.state, rtol=1e-4, atol=1e-5)
    assert g.runs == 1 and logits.shape[0] == 3
    with pytest.raises(ValueError, match="multiple of 16"):
        g.run([[1] * 65])


def test_prefill_graphs_need_decode_append_for_the_tails():
    with pytest.raises(ValueError, match="decode_append >= 15"):
        EmbeddedEngine(_model(), background=False, prefill_graphs=True, decode_append=8)


def test_cached_chunks_equal_the_model_forward_after_each_rows_prefix():
    """Three rows after cached prefixes of different lengths (one graph: the latent buffers span the longest,
    a padding row, lengths masked per row): each row's logits and new state equal the model's forward of
    the chunk on its own cache, and the caches handed in are not written."""
    model = _model()
    g = PrefillGraphs(model, None, max_tokens=512, use_graphs=True)
    prefixes = [[(3 * i + r) % 250 + 1 for i in range(n)] for r, n in enumerate((10, 70, 33))]
    rows = [[(11 * i + r) % 250 + 1 for i in range(128)] for r in range(3)]
    with torch.no_grad():
        caches = []
        for p in prefixes:
            caches.append(model.new_cache(1))
            model(torch.tensor([p]), cache=caches[-1])
        before = [c.clone() for c in caches]
        logits, out = g.run(rows, caches)
        for row, got, new, old, kept in zip(rows, logits, out, caches, before, strict=True):
            ref_cache = old.clone()
            ref = model(torch.tensor([row]), cache=ref_cache)[0, -1]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            assert new.host_lengths == ref_cache.host_lengths == [old.host_lengths[0] + 128]
            assert new.lengths.tolist() == new.host_lengths
            for i, e in ref_cache.kda.items():
                torch.testing.assert_close(new.kda[i].state, e.state, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(new.kda[i].conv, e.conv, rtol=1e-4, atol=1e-5)
                assert torch.equal(old.kda[i].state, kept.kda[i].state)
            for i, e in ref_cache.mla.items():
                n = new.host_lengths[0]
                torch.testing.assert_close(new.mla[i].latent, e.latent[:, :n], rtol=1e-4, atol=1e-5)
                assert torch.equal(old.mla[i].latent, kept.mla[i].latent)
    # rows 3 -> rung 4 of the 32-row KDA buffers; 70 + 128 -> one latent buffer of 256 positions, 32 rows
    assert list(g.latents) == [256] and all(t.shape[:2] == (32, 256) for t in g.latents[256].values())
    # a fresh chunk over the same buffers starts from zero states, not from what the cached rows left
    fresh = [[(13 * i + r) % 250 + 1 for i in range(256)] for r in range(3)]
    with torch.no_grad():
        logits, out = g.run(fresh)
        for row, got, new in zip(fresh, logits, out, strict=True):
            ref_cache = model.new_cache(1)
            torch.testing.assert_close(got, model(torch.tensor([row]), cache=ref_cache)[0, -1], rtol=1e-4, atol=1e-4)
            for i, e in ref_cache.kda.items():
                torch.testing.assert_close(new.kda[i].state, e.state, rtol=1e-4, atol=1e-5)
    assert list(g.latents) == [256]
    with pytest.raises(ValueError, match="one cache per row"):
        g.run(rows, caches[:2])


def test_a_group_larger_than_one_context_buffer_runs_in_parts(monkeypatch):
    """Latent buffers hold at most ROW_POSITIONS rows x positions: three rows at 256 positions with room for
    512 run as parts of 2 and 1 (each row still its own forward's result); a chunk past it is not taken."""
    from k3rl.rollout.engine import prefill_graphs as engine_prefill_graphs

    monkeypatch.setattr(engine_prefill_graphs, "ROW_POSITIONS", 512)
    model = _model()
    g = PrefillGraphs(model, None, max_tokens=512, use_graphs=True)
    assert g.rows_at(256) == 2 and g.rows_at(512) == 1 and g.takes(256, 200) and not g.takes(256, 300)
    rows = [[(11 * i + r) % 250 + 1 for i in range(128)] for r in range(3)]
    with torch.no_grad():
        caches = []
        for n in (10, 70, 33):
            caches.append(model.new_cache(1))
            model(torch.tensor([[(3 * i + n) % 250 + 1 for i in range(n)]]), cache=caches[-1])
        logits, out = g.run(rows, caches)
        for row, got, new, old in zip(rows, logits, out, caches, strict=True):
            ref_cache = old.clone()
            torch.testing.assert_close(got, model(torch.tensor([row]), cache=ref_cache)[0, -1], rtol=1e-4, atol=1e-4)
            assert new.host_lengths == ref_cache.host_lengths
    assert g.runs == 2 and logits.shape[0] == 3 and all(t.shape[0] == 2 for t in g.latents[256].values())


def test_a_conversations_next_turn_prefills_through_a_cached_graph():
    """Multi-turn: each next turn's prompt extends the last one (prompt + completion + a tool's output of
    100+ tokens), so the engine's prefix cache hands its state to a cached chunk. The tokens equal the
    plain engine's turn for turn."""
    model = _model()
    kw = dict(background=False, max_model_len=1024, prefix_cache_size=16)
    plain, graphed = EmbeddedEngine(model, **kw), EmbeddedEngine(model, **kw, prefill_graphs=True)
    convs = [[(5 * i + c) % 250 + 1 for i in range(40 + 30 * c)] for c in range(3)]
    outs = {id(plain): [list(c) for c in convs], id(graphed): [list(c) for c in convs]}
    for turn in range(3):
        params = [SamplingParams(temperature=0.9, max_tokens=5, seed=turn * 10 + c) for c in range(3)]
        results = {}
        for eng in (plain, graphed):
            results[id(eng)] = _run(eng, outs[id(eng)], params)
        for a, b in zip(results[id(plain)], results[id(graphed)], strict=True):
            assert b.token_ids == a.token_ids
            assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4)
        tool = [[(7 * i + turn + c) % 250 + 1 for i in range(100 + 20 * c)] for c in range(3)]
        for eng in (plain, graphed):
            outs[id(eng)] = [p + r.token_ids + t for p, r, t in zip(outs[id(eng)], results[id(eng)], tool, strict=True)]
    g = graphed.scheduler.prefill.graphs
    # turns 2 and 3 of each conversation: a prefix hit, then a cached chunk (tool outputs of 100-140 tokens
    # plus the completion: one bucket of 16s each, the rest fed)
    assert graphed.stats["prefix_hit_tokens"] > 0 and g.latents and g.cached_runs >= 2
    assert graphed.metrics()["prefill_graph_cached_runs"] == g.cached_runs
