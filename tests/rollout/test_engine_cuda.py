"""The embedded engine on CUDA: the CUDA-graph decode against eager decode, weight updates into
captured graphs, and the seed hash on the device (skipped without a GPU).

On the GPU image (no Ray, no install of k3rl) run these through `benchmarks/engine.py --tests`."""

from __future__ import annotations

import statistics

import pytest
import torch

from k3rl.model import K3Config, K3ForCausalLM
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")]


def _model(seed: int = 0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()  # top-2 routing: the expert combine is order-free
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model.to_param_dtype(torch.bfloat16).to("cuda")


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 250 + 1 for i in range(n)]


PARAMS = [SamplingParams(temperature=0.0, max_tokens=40),
          SamplingParams(temperature=1.0, max_tokens=40, seed=11),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=40, seed=5),
          SamplingParams(temperature=0.0, max_tokens=40)]


def _run(eng: EmbeddedEngine, prompts, params):
    futures = [eng.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    while not all(f.done() for f in futures):
        eng.step()
    return [f.result() for f in futures]


def test_graph_decode_equals_eager_decode_token_for_token():
    model = _model()
    prompts = [_prompt(n, n) for n in (5, 23, 11, 40)]  # 4 sequences: a batch rung, so eager runs the same shapes
    eager = _run(EmbeddedEngine(model, background=False, enforce_eager=True), prompts, PARAMS)
    eng = EmbeddedEngine(model, background=False, prefill_graphs=False)  # the decode graphs alone
    graphed = _run(eng, prompts, PARAMS)
    assert eng.scheduler.decoder.graphs, "no decode step was captured"
    for a, b in zip(eager, graphed, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
    # 3 sequences run padded to the rung of 4: the padding row changes nothing for the real ones
    three = _run(EmbeddedEngine(model, background=False, prefill_graphs=False), prompts[:3], PARAMS[:3])
    assert [r.token_ids for r in three] == [r.token_ids for r in graphed[:3]]


def test_weight_update_reaches_the_captured_graphs():
    from k3rl.model.state_dict_adapter import to_hf
    from k3rl.types import WeightUpdate

    model, other = _model(0), _model(1)
    eng = EmbeddedEngine(model, background=False)
    prompts = [_prompt(12, i) for i in range(4)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=16)] * 4
    before = _run(eng, prompts, greedy)
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    eng.update_weights(WeightUpdate.from_state_dict(1, {k: v.detach() for k, v in to_hf(other.state_dict()).items()}))
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params  # copied in place
    after = _run(eng, prompts, greedy)
    expected = _run(EmbeddedEngine(_model(1), background=False, enforce_eager=True), prompts, greedy)
    assert [r.token_ids for r in after] == [r.token_ids for r in expected]
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert all(v == 1 for r in after for v in r.versions)


def test_seed_hash_is_the_same_on_the_gpu():
    from k3rl.rollout.engine.sampling import request_seed, uniform

    seeds = torch.tensor([request_seed(s) for s in (0, 1, 2**63, 2**64 - 1, 987654321)])
    counters = torch.tensor([0, 5, 2**40, 17, 123456])
    assert torch.equal(uniform(seeds, counters), uniform(seeds.cuda(), counters.cuda()).cpu())


def test_overlap_on_the_gpu_gives_the_serial_engines_results():
    """CUDA graphs with the next step launched before this one's tokens reach the host (the default on
    CUDA) against the same engine one step after another: staggered arrivals, stops, routed experts and
    a cached second turn give the same tokens, versions and experts."""
    model = _model()
    prompts = [_prompt(n, n) for n in (5, 23, 11, 40, 17, 9)]
    params = [*PARAMS, SamplingParams(temperature=0.9, max_tokens=30, seed=3, stop_token_ids=[10, 20, 30, 40, 50]),
              SamplingParams(temperature=0.0, max_tokens=12, return_routed_experts=True)]

    def run(overlap: bool):
        eng = EmbeddedEngine(model, background=False, overlap=overlap)
        futures = [eng.submit(p, s) for p, s in zip(prompts[:3], params[:3], strict=True)]
        for _ in range(5):
            eng.step()
        futures += [eng.submit(p, s) for p, s in zip(prompts[3:], params[3:], strict=True)]
        while not all(f.done() for f in futures):
            eng.step()
        turn2 = prompts[5] + futures[5].result().token_ids + _prompt(6, 99)
        futures.append(eng.submit(turn2, SamplingParams(temperature=0.0, max_tokens=10)))
        while not futures[-1].done():
            eng.step()
        return [f.result() for f in futures], eng.stats

    serial, s_stats = run(False)
    ahead, a_stats = run(True)
    assert s_stats["launched_ahead"] == 0 and a_stats["launched_ahead"] > 0
    for a, b in zip(serial, ahead, strict=True):
        assert (b.token_ids, b.versions, b.finish_reason, b.routed_experts, b.cached_prompt_tokens) == \
            (a.token_ids, a.versions, a.finish_reason, a.routed_experts, a.cached_prompt_tokens)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
    assert serial[-1].cached_prompt_tokens > 0


@pytest.mark.parametrize("prefill_graphs", [False, True])
def test_fed_prompt_tails_and_a_shared_start_give_the_prefill_paths_results(prefill_graphs):
    """decode_append and share_prefix, or the prefill graphs (each on by default on CUDA), against an
    engine that prefills every prompt token eagerly: a shared 80-token start, tails of 3-30 tokens, a
    second turn; an fp32 model, so the chunk kernel and the decode kernel agree to float rounding."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model = model.to("cuda")
    system = _prompt(80, 7)
    prompts = [system + _prompt(n, n) for n in (3, 30, 12, 20)]

    def run(eng):
        first = _run(eng, prompts, PARAMS)
        turn2 = [p + r.token_ids + _prompt(40, 60) for p, r in zip(prompts, first, strict=True)]
        return first + _run(eng, turn2, PARAMS), eng.stats

    ref, ref_stats = run(EmbeddedEngine(model, background=False, decode_append=0, share_prefix=0,
                                        prefill_graphs=False))
    eng = EmbeddedEngine(model, background=False, prefill_graphs=prefill_graphs)
    got, stats = run(eng)
    assert stats["fed_prompt_tokens"] > 0
    if prefill_graphs:  # first turns fresh, second turns after their cached first turn: both graphed
        assert eng.scheduler.prefill.graphs.captures >= 2 and eng.scheduler.prefill.graphs.cached_runs >= 1
    else:
        assert stats["prefill_forwards"] < ref_stats["prefill_forwards"]
    for a, b in zip(ref, got, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)



def test_compiled_decode_step_is_as_accurate_as_the_eager_step():
    """compile_decode fuses the layers' small kernels, which reorders bf16 roundings, so its sampled
    tokens can part from the eager engine's at a near tie (it has been seen on an H200). What must hold: fed the
    same tokens, the compiled bf16 step is as close to the fp32 model as the eager bf16 step is."""
    import copy

    from k3rl.model.model import allow_layer_recompiles
    from k3rl.rollout.engine.decode import _layer, decode_forward

    torch.manual_seed(0)
    fp32 = K3ForCausalLM(K3Config.preset("k3-tiny")).eval().to("cuda")
    bf16 = copy.deepcopy(fp32).to_param_dtype(torch.bfloat16)
    allow_layer_recompiles(len(bf16.model.layers))
    compiled = torch.compile(_layer)
    ids = torch.tensor([_prompt(12, s) for s in range(4)], device="cuda")
    runs = [(fp32, _layer), (bf16, _layer), (bf16, compiled)]
    caches = [m.new_cache(4) for m, _ in runs]
    errors = {"eager": [], "compiled": []}
    with torch.no_grad():
        for (m, _), c in zip(runs, caches, strict=True):
            m(ids, cache=c)
        tok = ids[:, -1:]
        for _ in range(12):
            logps = []
            for (m, fn), c in zip(runs, caches, strict=True):
                logits, _ = decode_forward(m, tok, c, fn)
                c.advance(1)
                logps.append(logits.float().log_softmax(-1))
            errors["eager"].append((logps[1] - logps[0]).abs().max().item())
            errors["compiled"].append((logps[2] - logps[0]).abs().max().item())
            tok = logps[0].argmax(-1, keepdim=True)
    eager, comp = max(errors["eager"]), max(errors["compiled"])
    assert 0 < eager < 0.25, errors  # bf16 against fp32: 0.03-0.07 a step on the CPU
    assert comp <= 1.5 * eager + 1e-3, errors


def test_compiled_decode_runs_in_graphs_and_stays_close_to_the_eager_engine():
    """compile_decode in the engine: compiled, then captured in graphs, no capture failing; greedy rows'
    log-probs close to the eager engine's while their tokens agree (a near tie may part them)."""
    model = _model()
    prompts = [_prompt(n, n) for n in (5, 23, 11, 40)]
    eager = _run(EmbeddedEngine(model, background=False, enforce_eager=True), prompts, PARAMS)
    eng = EmbeddedEngine(model, background=False, compile_decode=True, prefill_graphs=False)
    compiled = _run(eng, prompts, PARAMS)
    assert eng.scheduler.decoder.graphs and not eng.scheduler.decoder.capture_failures
    assert eng.scheduler.decoder.layer_fn is not None and hasattr(eng.scheduler.decoder.layer_fn, "_torchdynamo_orig_callable")
    diffs = []
    for a, b, p in zip(eager, compiled, PARAMS, strict=True):
        if p.temperature > 0:
            continue
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), len(a.token_ids))
        assert same >= 8, (a.token_ids, b.token_ids)
        diffs += [abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same], strict=False)]
    # this model's logits are sharpened (lm_head x 40): positions near a tie move by tenths (on an H200 the
    # |d| of 80 positions summed to 1.10 in one run, 57 of 80 under 1e-2 in another), so the typical
    # position is held, not a share: the accuracy itself is the teacher-forced test's above
    assert statistics.median(diffs) < 1e-2, diffs


def test_prefill_graphs_are_captured_and_agree_with_the_eager_prefill():
    """Fresh prompts of 64+ tokens prefill their bucketed first chunk through a captured graph (the rest fed
    by decode steps): captured, no capture failing, replayed again for a second batch of one bucket; the
    sampled tokens are the eager-prefill engine's up to a near tie of bf16 rounding (the tail goes through
    the decode step's recurrent kernel instead of the chunk kernel)."""
    model = _model()
    prompts = [_prompt(n, n) for n in (70, 75, 130, 200)]
    eager = _run(EmbeddedEngine(model, background=False, prefill_graphs=False), prompts, PARAMS)
    eng = EmbeddedEngine(model, background=False, prefill_graphs=True)
    graphed = _run(eng, prompts, PARAMS)
    g = eng.scheduler.prefill.graphs
    assert g is not None and g.captures >= 1 and not g.failed and g.replays >= 1
    again = _run(eng, [_prompt(n, n + 1) for n in (66, 90)], PARAMS[:2])  # bucket 64 again: a replay
    assert all(len(r.token_ids) == 40 for r in again) and g.replays >= 2
    diffs = []
    for a, b in zip(eager, graphed, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                    len(a.token_ids))
        assert same >= 4, (a.token_ids, b.token_ids)
        diffs += [abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same], strict=False)]
    assert statistics.median(diffs) < 5e-2, diffs


def test_a_next_turn_prefills_through_a_captured_cached_graph():
    """Conversations' next turns (prompt + completion + 100+ new tokens) hit the prefix cache and prefill
    their chunk through a captured graph over static state buffers: captured without failing, replayed by
    later turns. Both engines get the same prompts each turn (the eager engine's conversations). bf16
    rounding differs between any two ways of chunking a prompt, so a near tie may part two engines'
    samples early: the graphed engine must agree with the eager one as well as the eager engine with
    64-token chunks does (the same computation cut differently), and its first log-probs to bf16 noise."""
    model = _model()
    kw = dict(background=False, prefix_cache_size=32)
    eager = EmbeddedEngine(model, **kw, prefill_graphs=False)
    eng = EmbeddedEngine(model, **kw, prefill_graphs=True)
    chunked = EmbeddedEngine(model, **kw, prefill_graphs=False, prefill_chunk=64)
    g = eng.scheduler.prefill.graphs

    def agreement(a, b):
        return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                    len(a.token_ids))

    same, baseline, first = [], [], []
    for offset in (0, 1):
        convs = [_prompt(n, n + offset) for n in (70, 90, 130, 75)]
        for turn in range(3):
            ref, got, cut = (_run(e, convs, PARAMS) for e in (eager, eng, chunked))
            same += [agreement(a, b) for a, b in zip(ref, got, strict=True)]
            baseline += [agreement(a, b) for a, b in zip(ref, cut, strict=True)]
            first += [abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(ref, got, strict=True)
                      if a.token_ids[0] == b.token_ids[0]]
            tool = [_prompt(100 + 10 * c, 3 * turn + c) for c in range(4)]
            convs = [p + r.token_ids + t for p, r, t in zip(convs, ref, tool, strict=True)]
        if offset == 0:
            runs, captured = g.runs, g.captures
    print("agreement graphed", same, "chunked", baseline, "first |dlogp|", [round(x, 4) for x in first])
    assert g.cached_runs >= 2 and g.latents and not g.failed
    # every forward of the second set replays a graph; it captures only shapes the first did not reach
    assert g.runs - runs > g.captures - captured and g.replays == g.runs
    assert statistics.median(same) >= statistics.median(baseline) - 4, (same, baseline)
    assert len(first) >= 20 and statistics.median(first) < 5e-2, first


def test_cached_prefill_graph_replays_equal_the_same_forward_run_eagerly():
    """Bit for bit: the captured cached-chunk graph (rows after prefixes of 10, 70 and 33 tokens, a
    padding row) against the same forward run eagerly over the same kind of buffers, the first replay and
    a later one with other states; and both near the model's own forward on each row's cache."""
    from k3rl.rollout.engine.prefill_graphs import PrefillGraphs

    model = _model()
    eager = PrefillGraphs(model, None, max_tokens=512, use_graphs=False)
    graphed = PrefillGraphs(model, None, max_tokens=512, use_graphs=True)
    with torch.no_grad():
        for offset in (0, 5):
            caches = []
            for n in (10, 70, 33):
                caches.append(model.new_cache(1))
                model(torch.tensor([_prompt(n, n + offset)], device="cuda"), cache=caches[-1])
            rows = [_prompt(128, r + offset) for r in range(3)]
            le, ce = eager.run(rows, caches)
            lg, cg = graphed.run(rows, caches)
            assert torch.equal(le, lg)
            for a, b in zip(ce, cg, strict=True):
                assert a.host_lengths == b.host_lengths
                assert all(torch.equal(a.kda[i].state, b.kda[i].state) and torch.equal(a.kda[i].conv, b.kda[i].conv)
                           for i in a.kda)
                assert all(torch.equal(a.mla[i].latent, b.mla[i].latent) for i in a.mla)
            for row, got, cache in zip(rows, lg, caches, strict=True):
                ref = model(torch.tensor([row], device="cuda"), cache=cache.clone())[0, -1]
                assert (got.float() - ref.float()).abs().max() < 0.25 * ref.float().abs().max()
    assert graphed.captures == 1 and graphed.replays == 2 and not graphed.failed
