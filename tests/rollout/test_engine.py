"""The embedded engine against the model itself: exactness, batching, sampling, stops, groups."""

from __future__ import annotations

import asyncio

import pytest
import torch

from k3rl.model import K3Config, K3ForCausalLM
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.tokenizer import ByteTokenizer
from k3rl.types import SamplingParams

torch.set_num_threads(1)  # tiny matrices: one thread is many times faster on a shared 2-core machine


def _model(seed: int = 0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    with torch.no_grad():  # a sharper head than the N(0, 0.02) init, so greedy choices are clear
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.fixture(scope="module")
def model():
    return _model()


OVERLAP = [False]


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def overlap(request):
    """Every engine test runs twice: steps one after another, and the next step launched before the
    last one's tokens are read (the CUDA default, forced here on the CPU)."""
    OVERLAP[0] = request.param
    yield request.param
    OVERLAP[0] = False


def _engine(model, **kw) -> EmbeddedEngine:
    kw.setdefault("background", False)
    kw.setdefault("overlap", OVERLAP[0])
    return EmbeddedEngine(model, **kw)


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 250 + 1 for i in range(n)]


def _full_logits(model, ids: list[int], images=None) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), images=images)[0].float()


GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_greedy_equals_argmax_of_full_forward_and_logprobs_match(model):
    eng = _engine(model, prefill_chunk=7)  # a 30-token prompt is prefilled in 5 chunks
    prompt = _prompt(30)
    r = eng.generate(prompt, GREEDY)
    assert r.finish_reason == "length" and len(r.token_ids) == 12 and r.prompt_tokens == 30
    logits = _full_logits(model, prompt + r.token_ids)
    P = len(prompt)
    assert r.token_ids == [int(logits[P - 1 + i].argmax()) for i in range(12)]
    ref = torch.log_softmax(logits, -1)
    for i, tok in enumerate(r.token_ids):
        assert r.logprobs[i] == pytest.approx(float(ref[P - 1 + i, tok]), rel=1e-4, abs=1e-4)


def test_sampled_logprobs_are_the_unfiltered_policy_at_the_request_temperature(model):
    eng = _engine(model)
    prompt = _prompt(20, 5)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=10, seed=3)
    r = eng.generate(prompt, params)
    # log softmax(logits / 0.7): the policy the learner trains at the job's temperature; neither
    # the temperature-1 distribution nor the top-k / top-p filtered one
    ref = torch.log_softmax(_full_logits(model, prompt + r.token_ids) / 0.7, -1)
    P = len(prompt)
    for i, tok in enumerate(r.token_ids):
        assert r.logprobs[i] == pytest.approx(float(ref[P - 1 + i, tok]), rel=1e-4, abs=1e-4)
    # every sampled token lies inside the top-k of its step
    logits = _full_logits(model, prompt + r.token_ids)
    for i, tok in enumerate(r.token_ids):
        assert tok in logits[P - 1 + i].topk(20).indices.tolist()


def test_same_tokens_alone_and_inside_a_batch(model):
    prompts = [_prompt(n, n) for n in (5, 23, 11, 40)]
    params = [GREEDY, SamplingParams(temperature=1.0, max_tokens=9, seed=11),
              SamplingParams(temperature=0.8, top_p=0.8, max_tokens=15, seed=5), GREEDY]
    alone = [_engine(model).generate(p, s) for p, s in zip(prompts, params, strict=True)]
    eng = _engine(model, prefill_chunk=8, max_prefill_tokens=16)  # prefills overlap decoding
    futures = [eng.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    while not all(f.done() for f in futures):
        eng.step()
    for a, f in zip(alone, futures, strict=True):
        b = f.result()
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4)


def test_late_joiners_and_leavers_do_not_disturb_others(model):
    eng = _engine(model)
    long_req = eng.submit(_prompt(12), SamplingParams(temperature=0, max_tokens=20))
    for _ in range(3):
        eng.step()
    short = eng.submit(_prompt(9, 2), SamplingParams(temperature=0, max_tokens=3))  # joins at step 4, leaves at 6
    while not long_req.done():
        eng.step()
    assert long_req.result().token_ids == _engine(model).generate(_prompt(12), SamplingParams(temperature=0, max_tokens=20)).token_ids
    assert short.result().token_ids == _engine(model).generate(_prompt(9, 2), SamplingParams(temperature=0, max_tokens=3)).token_ids


def test_seeds_reproduce_and_differ(model):
    eng = _engine(model)
    p = _prompt(10)
    a = eng.generate(p, SamplingParams(temperature=1.0, max_tokens=16, seed=1))
    b = eng.generate(p, SamplingParams(temperature=1.0, max_tokens=16, seed=1))
    c = eng.generate(p, SamplingParams(temperature=1.0, max_tokens=16, seed=2))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_token_stop_string_and_max_tokens(model):
    eng = _engine(model)
    p = _prompt(15)
    free = eng.generate(p, SamplingParams(temperature=0, max_tokens=12)).token_ids
    stop_tok = free[4]
    first = free.index(stop_tok)
    r = eng.generate(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))
    assert r.finish_reason == "stop" and r.stop_reason == stop_tok and r.token_ids == free[: first + 1]
    # a stop string made of generated ASCII bytes (two tokens when possible), kept in the output
    tok = ByteTokenizer()
    free = eng.generate(p, SamplingParams(temperature=0, max_tokens=40)).token_ids
    text, end = None, None
    for j in range(len(free)):
        if 32 <= free[j] < 127:
            cand = tok.decode(free[j - 1 : j + 1]) if j and 32 <= free[j - 1] < 127 else chr(free[j])
            if cand not in tok.decode(free[:j]):
                text, end = cand, j + 1
                break
    assert text is not None, "no ASCII token in 40 greedy tokens"
    r = eng.generate(p, SamplingParams(temperature=0, max_tokens=40, stop_strings=[text, "\x00never"]))
    assert r.finish_reason == "stop" and r.stop_reason == text
    assert r.token_ids == free[:end] and tok.decode(r.token_ids).endswith(text)
    r = eng.generate(p, SamplingParams(temperature=0, max_tokens=1))
    assert r.finish_reason == "length" and r.token_ids == free[:1]


def test_bad_requests_fail_clearly(model):
    eng = _engine(model)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([5, 100000], GREEDY)
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.generate([5], SamplingParams(stop_token_ids=[-1]))
    with pytest.raises(ValueError, match="media_pad"):
        eng.generate([5, model.config.media_placeholder_token_id], GREEDY)


def test_abort_returns_partial_tokens(model):
    eng = _engine(model)
    fut = eng.submit(_prompt(10), SamplingParams(temperature=0, max_tokens=50), request_id="r1")
    other = eng.submit(_prompt(8), SamplingParams(temperature=0, max_tokens=6))
    for _ in range(4):
        eng.step()
    assert eng.abort("r1")
    r = fut.result(timeout=5)
    assert r.finish_reason == "abort" and len(r.token_ids) == 4 and len(r.logprobs) == 4
    assert not eng.abort("r1") and not eng.abort("never-submitted")
    while not other.done():
        eng.step()
    assert other.result().finish_reason == "length"
    waiting = eng.submit(_prompt(8), GREEDY, request_id="w")
    eng.abort("w")
    assert waiting.result(timeout=5).token_ids == [] and waiting.result().finish_reason == "abort"


def test_group_prefills_once_and_equals_independent_prefill(model):
    prompt = _prompt(33)
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=s) for s in range(4)]
    eng = _engine(model, prefill_chunk=10)
    futures = [eng.submit(prompt, p) for p in params]
    while not all(f.done() for f in futures):
        eng.step()
    assert eng.stats["prefill_tokens"] == len(prompt)  # one prefill for the group
    assert [f.result().cached_prompt_tokens for f in futures] == [0, 33, 33, 33]
    for p, f in zip(params, futures, strict=True):
        ref = _engine(model, prefix_cache_size=0).generate(prompt, p)
        assert f.result().token_ids == ref.token_ids
        assert f.result().logprobs == pytest.approx(ref.logprobs, rel=1e-4, abs=1e-4)


def test_next_turn_reuses_the_cached_conversation(model):
    eng = _engine(model, prefill_chunk=6)
    prompt = _prompt(20)
    first = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=5))
    turn2 = prompt + first.token_ids + _prompt(7, 9)  # the tool result appended as tokens
    before = eng.stats["prefill_tokens"]
    second = eng.generate(turn2, SamplingParams(temperature=0, max_tokens=6))
    assert second.cached_prompt_tokens == 25 and eng.stats["prefill_tokens"] - before == 7
    logits = _full_logits(model, turn2 + second.token_ids)
    assert second.token_ids == [int(logits[len(turn2) - 1 + i].argmax()) for i in range(6)]


def test_routed_experts_match_the_full_forward(model):
    eng = _engine(model)
    params = SamplingParams(temperature=0, max_tokens=6, return_routed_experts=True)
    prompts = [_prompt(14), _prompt(9, 40)]  # decoded together in one batch
    futures = [eng.submit(p, params) for p in prompts]
    while not all(f.done() for f in futures):
        eng.step()
    n_moe, k = len(model.config.moe_layer_ids), model.config.num_experts_per_token
    for prompt, fut in zip(prompts, futures, strict=True):
        r = fut.result()
        assert len(r.routed_experts) == 6
        assert all(len(t) == n_moe and all(len(e) == k for e in t) for t in r.routed_experts)
        with torch.no_grad():
            _, routing = model(torch.tensor([prompt + r.token_ids]), return_routing=True)
        P = len(prompt)
        for i in range(6):  # token i as an input sits at position P + i
            assert [sorted(e) for e in r.routed_experts[i]] == [sorted(e) for e in routing[0, P + i].tolist()]
    assert eng.generate(prompts[0], GREEDY).routed_experts is None  # only on request


def test_images_in_the_prompt(model):
    from PIL import Image

    from k3rl.chat import ChatTemplate, Message
    from k3rl.images import to_png

    img = Image.new("RGB", (40, 30))
    for x in range(40):
        for y in range(30):
            img.putpixel((x, y), (x * 6, y * 8, (x * y) % 255))
    png = to_png(img)
    chat = ChatTemplate()
    ids = chat.render([Message(role="user", content="what is this?", images=[png])]).ids
    eng = _engine(model, prefill_chunk=5)  # the pad run is never split across chunks
    r = eng.generate(ids, SamplingParams(temperature=0, max_tokens=6), images=[png])
    logits = _full_logits(model, ids + r.token_ids, images=[img])
    assert r.token_ids == [int(logits[len(ids) - 1 + i].argmax()) for i in range(6)]
    with pytest.raises(ValueError, match="media_pad"):
        eng.generate(ids, GREEDY)  # pads without their image


def test_second_turn_with_a_new_image_reuses_the_first_turn(model):
    from PIL import Image

    from k3rl.chat import ChatTemplate, Message
    from k3rl.images import to_png

    imgs = [Image.new("RGB", (30 + 10 * i, 28), color=(40 * i, 90, 200 - 30 * i)) for i in range(2)]
    pngs = [to_png(im) for im in imgs]
    chat = ChatTemplate()
    session = chat.session()
    session.add(Message(role="user", content="first", images=[pngs[0]]))
    session.add_generation_prompt()
    eng = _engine(model, prefill_chunk=9)
    turn1 = list(session.rendered.ids)
    first = eng.generate(turn1, SamplingParams(temperature=0, max_tokens=3), images=pngs[:1])
    session.add_generated(first.token_ids)
    session.add(Message(role="user", content="and this?", images=[pngs[1]]))
    session.add_generation_prompt()
    ids = session.rendered.ids
    second = eng.generate(ids, SamplingParams(temperature=0, max_tokens=5), images=pngs)
    assert second.cached_prompt_tokens == len(turn1) + 3  # turn 1 and its image were not recomputed
    logits = _full_logits(model, ids + second.token_ids, images=imgs)
    assert second.token_ids == [int(logits[len(ids) - 1 + i].argmax()) for i in range(5)]


def test_many_coroutines_share_one_background_engine(model):
    eng = EmbeddedEngine(model, overlap=OVERLAP[0])  # scheduler thread
    try:
        prompts = [_prompt(8 + i, i) for i in range(6)]

        async def main():
            return await asyncio.gather(*(eng.agenerate(p, SamplingParams(temperature=0, max_tokens=5)) for p in prompts))

        results = asyncio.run(main())
    finally:
        eng.close()
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == _engine(model).generate(p, SamplingParams(temperature=0, max_tokens=5)).token_ids


def test_sampling_distribution_filters_exactly():
    from k3rl.rollout.engine.sampling import filtered_probs, sample_tokens

    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    one = torch.ones(1)
    q = filtered_probs(logits, one, torch.tensor([2]), one)  # top-k 2: renormalised 0.5 : 0.2
    assert torch.allclose(q, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]], dtype=torch.float64))
    q = filtered_probs(logits, one, torch.tensor([0]), torch.tensor([0.8]))  # top-p 0.8: 0.5+0.2 < 0.8 -> keep 3
    assert torch.allclose(q, torch.tensor([[0.5, 0.2, 0.15, 0, 0]], dtype=torch.float64) / 0.85)
    q = filtered_probs(logits, torch.tensor([0.5]), torch.tensor([0]), one)  # T = 0.5 squares the odds
    p2 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64) ** 2
    assert torch.allclose(q[0], p2 / p2.sum())
    # the unfiltered shortcut gives the same q
    assert torch.equal(filtered_probs(logits, one, torch.tensor([0]), one, filtered=False),
                       filtered_probs(logits, one, torch.tensor([0]), one))
    # empirical frequencies of the inverse-CDF draw follow q: the 4000 draws of one seed, in one batch
    n = 4000
    rows = logits.expand(n, 5)
    full = torch.ones(n, dtype=torch.float64)
    draws = sample_tokens(rows, full, torch.full((n,), 3.0, dtype=torch.float64), full,
                          torch.full((n,), 7), torch.arange(n))
    counts = torch.bincount(draws, minlength=5).float()
    expect = torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85 * n
    assert counts[3:].sum() == 0
    assert ((counts - expect).abs() <= 5 * (expect * (1 - expect / n)).sqrt() + 1).all()
    # the banned id is never drawn, even when it is the argmax (greedy and sampled rows)
    zero = torch.zeros(2, dtype=torch.int64)
    toks = sample_tokens(logits.expand(2, 5), torch.tensor([0.0, 1.0], dtype=torch.float64),
                         torch.tensor([0.0, 1.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64),
                         zero, zero, banned=0)
    assert toks.tolist() == [1, 1]


def test_seed_hash_is_splitmix64_modulo_2_64():
    """The per-token uniform is integer arithmetic (the same on every device): check it against Python ints."""
    from k3rl.rollout.engine.sampling import request_seed, uniform

    M = (1 << 64) - 1

    def splitmix(seed: int, n: int) -> float:
        z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & M
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        z ^= z >> 31
        return (z >> 11) * 2.0**-53

    seeds = [0, 1, 12345, 2**63 - 1, 2**63, 2**64 - 1]
    for seed in seeds:
        counters = torch.tensor([0, 1, 2, 1000, 2**40])
        u = uniform(torch.full((5,), request_seed(seed)), counters)
        assert u.tolist() == [splitmix(seed % (1 << 64), int(c)) for c in counters]


def test_max_num_seqs_queues_and_max_model_len_truncates(model):
    eng = _engine(model, max_num_seqs=2)
    prompts = [_prompt(6 + i, 3 * i) for i in range(5)]
    futures = [eng.submit(p, SamplingParams(temperature=0, max_tokens=4)) for p in prompts]
    eng.step()
    assert eng.load().running == 2 and eng.load().waiting == 3  # the rest wait their turn
    while not all(f.done() for f in futures):
        assert eng.load().running <= 2
        eng.step()
    for p, f in zip(prompts, futures, strict=True):
        assert f.result().token_ids == _engine(model).generate(p, SamplingParams(temperature=0, max_tokens=4)).token_ids
    short = _engine(model, max_model_len=20)
    r = short.generate(_prompt(15), SamplingParams(temperature=0, max_tokens=50))
    assert r.finish_reason == "length" and len(r.token_ids) == 5
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate(_prompt(20), GREEDY)


def test_engine_serves_an_hf_checkpoint(model, tmp_path):
    from k3rl.model import save_hf

    save_hf(model, tmp_path / "ckpt")
    eng = EmbeddedEngine.from_preset(checkpoint=str(tmp_path / "ckpt"), background=False)
    p = _prompt(12, 4)
    assert eng.generate(p, GREEDY).token_ids == _engine(model).generate(p, GREEDY).token_ids


def test_state_pool_growth_and_slot_moves_keep_every_sequence_exact(model):
    """Sequences leave from the middle of the pool (the last one moves into the hole) while a long
    prompt grows the latent capacity past its initial 256 tokens; each still decodes as if alone."""
    eng = _engine(model, max_num_seqs=3, prefill_chunk=128)
    prompts = [_prompt(10), _prompt(300, 1), _prompt(14, 2), _prompt(7, 3), _prompt(30, 4)]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (2, 9, 5, 8, 3)]
    params[2] = SamplingParams(temperature=0.9, top_k=40, max_tokens=5, seed=8)
    futures = [eng.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    while not all(f.done() for f in futures):
        eng.step()
        assert [s.slot for s in eng.scheduler.decoding] == list(range(len(eng.scheduler.decoding)))  # occupied slots lead
    assert eng.scheduler.pool.capacity >= 512 and eng.scheduler.pool.generation >= 1
    assert eng.scheduler.pool.lengths == [0, 0, 0]  # every slot freed
    for p, s, f in zip(prompts, params, futures, strict=True):
        alone = _engine(model).generate(p, s)
        assert f.result().token_ids == alone.token_ids
        assert f.result().logprobs == pytest.approx(alone.logprobs, rel=1e-4, abs=1e-4)


def _mixed_workload(eng, model) -> tuple[dict, dict]:
    """Requests that join, stop (token, string, length), abort, fork a group, return routed experts and
    reuse the prefix cache, over staggered steps: their results by id, and the engine's counters."""
    sampled = [SamplingParams(temperature=0.8, top_k=50, max_tokens=n, seed=s) for s, n in ((1, 9), (2, 14), (3, 5))]
    futures = {f"s{i}": eng.submit(_prompt(11 + 3 * i, i), p, request_id=f"s{i}") for i, p in enumerate(sampled)}
    futures["routed"] = eng.submit(_prompt(9, 30), SamplingParams(temperature=0, max_tokens=7, return_routed_experts=True),
                                   request_id="routed")
    for _ in range(3):
        eng.step()
    group = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=[101, 102, 103])
    for g in range(3):
        futures[f"g{g}"] = eng.submit(_prompt(17, 50), group.model_copy(update={"seed": 10 + g}), request_id=f"g{g}")
    futures["stop"] = eng.submit(_prompt(6, 70), SamplingParams(temperature=0.9, max_tokens=30, seed=5,
                                                                stop_strings=["e", "a", "o"]), request_id="stop")
    futures["long"] = eng.submit(_prompt(12, 90), SamplingParams(temperature=0, max_tokens=40), request_id="long")
    for _ in range(4):
        eng.step()
    eng.abort("long")
    while not futures["s0"].done():
        eng.step()
    first = futures["s0"].result()
    turn2 = _prompt(11) + first.token_ids + _prompt(5, 7)  # the next turn of s0: its conversation is cached
    futures["turn2"] = eng.submit(turn2, SamplingParams(temperature=0, max_tokens=5), request_id="turn2")
    while not all(f.done() for f in futures.values()):
        eng.step()
    return {k: f.result() for k, f in futures.items()}, dict(eng.stats)


def test_overlap_gives_what_steps_one_after_another_give(model):
    """The next decode step launched before this one's tokens are read (tokens fed on the device) gives
    every request the same tokens, versions, finish, routed experts and prefix-cache hits as the
    serial engine; log-probs to float rounding (a finished sequence's extra row changes a batch's shape)."""
    serial, s_stats = _mixed_workload(_engine(model, overlap=False), model)
    ahead, a_stats = _mixed_workload(_engine(model, overlap=True), model)
    assert serial.keys() == ahead.keys()
    for k in serial:
        a, b = serial[k], ahead[k]
        assert (b.token_ids, b.versions, b.finish_reason, b.stop_reason, b.cached_prompt_tokens, b.routed_experts) == \
            (a.token_ids, a.versions, a.finish_reason, a.stop_reason, a.cached_prompt_tokens, a.routed_experts), k
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-5, abs=1e-5), k
    assert serial["long"].finish_reason == "abort" and serial["turn2"].cached_prompt_tokens > 0
    assert {r.finish_reason for r in serial.values()} >= {"stop", "length", "abort"}
    assert a_stats["prefill_tokens"] == s_stats["prefill_tokens"]
    assert a_stats["prefix_hit_tokens"] == s_stats["prefix_hit_tokens"]
    assert a_stats["steps"] <= s_stats["steps"]
    assert s_stats["launched_ahead"] == 0 and a_stats["launched_ahead"] >= a_stats["steps"] // 2


def test_a_step_in_flight_during_a_weight_update_keeps_its_version():
    """With overlap a step launched before an update arrives finishes on the old weights: its tokens
    are labelled with the old version (one per sequence), every later token with the new one."""
    from k3rl.model.state_dict_adapter import to_hf
    from k3rl.types import WeightUpdate

    model, other = _model(0), _model(1)
    eng = _engine(model, overlap=True)
    futures = [eng.submit(_prompt(10, i), SamplingParams(temperature=0, max_tokens=12)) for i in range(3)]
    for _ in range(5):
        eng.step()
    assert eng.scheduler.inflight is not None
    eng.update_weights(WeightUpdate.from_state_dict(1, {k: v.detach() for k, v in to_hf(other.state_dict()).items()}))
    while not all(f.done() for f in futures):
        eng.step()
    for f in futures:
        v = f.result().versions
        assert v == sorted(v) and v[-1] == 1
        # step 1 samples the first token from the prefill, steps 2-5 read 4 decode steps, and a 6th was in
        # flight when the update came: made by version 0, and labelled so
        assert v.count(0) == 6
