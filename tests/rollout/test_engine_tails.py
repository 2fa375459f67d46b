"""The embedded engine's prefill paths: a turn's tail fed through decode steps, a shared prompt start
prefilled once, prefills gathered while the batch decodes; each gives the tokens the plain prefill gives."""

from __future__ import annotations

import pytest
import torch
from test_engine import _engine, _model, _prompt, overlap  # noqa: F401  (overlap: every test serial and overlapped)

from k3rl.rollout.engine import EmbeddedEngine
from k3rl.types import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return _model()


def _run_all(eng, futures) -> None:
    while not all(f.done() for f in futures):
        eng.step()


def _two_turns(eng: EmbeddedEngine) -> dict:
    """First turns (sampled with seeds, greedy, routed experts), then second turns that extend each
    conversation by a tail of 1-40 tokens (40 is over the append limit: prefilled either way)."""
    first = {
        "a": (_prompt(13, 1), SamplingParams(temperature=0.8, top_k=40, max_tokens=9, seed=1)),
        "b": (_prompt(21, 2), SamplingParams(temperature=0.0, max_tokens=6)),
        "c": (_prompt(8, 3), SamplingParams(temperature=0.0, max_tokens=7, return_routed_experts=True)),
        "d": (_prompt(17, 4), SamplingParams(temperature=1.0, max_tokens=5, seed=4)),
    }
    futures = {k: eng.submit(p, s, request_id=k) for k, (p, s) in first.items()}
    _run_all(eng, futures.values())
    results = {k: f.result() for k, f in futures.items()}
    tails = {"a": 1, "b": 5, "c": 12, "d": 40}
    second = {}
    for k, (p, s) in first.items():
        prompt = p + results[k].token_ids + _prompt(tails[k], 90 + tails[k])
        second[k + "2"] = eng.submit(prompt, s.model_copy(update={"seed": (s.seed or 0) + 100, "max_tokens": 8}),
                                     request_id=k + "2")
        eng.step()  # staggered: tails join a batch that is already decoding
    _run_all(eng, second.values())
    results.update({k: f.result() for k, f in second.items()})
    return results


def test_fed_tails_give_the_prefill_paths_tokens_logprobs_and_routing(model):
    """decode_append: a later turn's short prompt tail fed through decode steps gives what a prefill gives."""
    ref_engine = EmbeddedEngine(model, background=False, overlap=False, decode_append=0)
    ref = _two_turns(ref_engine)
    eng = _engine(model, decode_append=16)
    got = _two_turns(eng)
    # the tails of 1, 5 and 12 tokens are fed; so are the first prompts' last tokens beyond the shortest
    # of them (13, 21, 17 -> 8, cut so that they batch); the 40-token tail is prefilled
    assert eng.stats["fed_prompt_tokens"] == (1 + 5 + 12) + (5 + 13 + 9)
    assert ref_engine.stats["fed_prompt_tokens"] == 0
    assert eng.stats["prefill_tokens"] + eng.stats["fed_prompt_tokens"] == ref_engine.stats["prefill_tokens"]
    for k, a in ref.items():
        b = got[k]
        assert (b.token_ids, b.finish_reason, b.versions, b.cached_prompt_tokens, b.routed_experts) == \
            (a.token_ids, a.finish_reason, a.versions, a.cached_prompt_tokens, a.routed_experts), k
        # a decode step and a chunked prefill add in different orders
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4), k
    assert got["c2"].cached_prompt_tokens > 0 and len(got["c2"].routed_experts) == len(got["c2"].token_ids)
    assert eng.scheduler.pool.lengths == [0] * len(eng.scheduler.pool.lengths)  # every slot freed


def test_abort_while_feeding_frees_the_slot_and_offers_no_half_fed_state(model):
    eng = _engine(model, decode_append=16)
    p = _prompt(15, 7)
    r1 = eng.generate(p, SamplingParams(temperature=0.0, max_tokens=4))
    tail = _prompt(12, 33)
    fut = eng.submit(p + r1.token_ids + tail, SamplingParams(temperature=0.0, max_tokens=4), request_id="x")
    for _ in range(3):
        eng.step()
    assert eng.scheduler.decoding and eng.scheduler.decoding[0].feed  # mid-tail
    cached = set(eng.scheduler.prefix.entries)
    assert eng.abort("x")
    r = fut.result()
    assert r.finish_reason == "abort" and r.token_ids == []
    assert not eng.scheduler.decoding and eng.scheduler.pool.lengths == [0] * len(eng.scheduler.pool.lengths)
    assert set(eng.scheduler.prefix.entries) == cached  # the half-fed state is not offered as a prefix
    # the engine goes on: the same second turn, fed whole, equals a fresh engine's prefill
    again = eng.generate(p + r1.token_ids + tail, SamplingParams(temperature=0.0, max_tokens=6))
    fresh = EmbeddedEngine(model, background=False, decode_append=0).generate(
        p + r1.token_ids + tail, SamplingParams(temperature=0.0, max_tokens=6))
    assert again.token_ids == fresh.token_ids and again.cached_prompt_tokens > 0


def test_decode_append_is_off_on_the_cpu_by_default(model):
    assert EmbeddedEngine(model, background=False).decode_append == 0


def _shared_prefix_workload(eng: EmbeddedEngine) -> dict:
    """Prompts that share a 70-token start (a system prompt) and differ in their last 4-12 tokens: one
    alone, then three together, one of them a group of three, then a late one."""
    system = _prompt(70, 11)
    params = lambda seed: SamplingParams(temperature=0.9, top_k=30, max_tokens=6, seed=seed)  # noqa: E731
    futures = {"first": eng.submit(system + _prompt(9, 1), params(1), request_id="first")}
    _run_all(eng, futures.values())
    futures.update({f"t{i}": eng.submit(system + _prompt(4 + 4 * i, 2 + i), params(2 + i), request_id=f"t{i}")
                    for i in range(2)})
    futures.update({f"g{j}": eng.submit(system + _prompt(7, 9), params(20 + j), request_id=f"g{j}") for j in range(3)})
    eng.step()
    futures["late"] = eng.submit(system + _prompt(5, 40), params(40), request_id="late")
    _run_all(eng, futures.values())
    return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("append", [0, 16], ids=["prefill", "fed"])
def test_a_shared_prompt_start_is_prefilled_once_and_results_do_not_change(model, append):
    ref_engine = _engine(model, share_prefix=0, decode_append=0, overlap=False)
    ref = _shared_prefix_workload(ref_engine)
    eng = _engine(model, share_prefix=32, decode_append=append)
    got = _shared_prefix_workload(eng)
    for k, a in ref.items():
        b = got[k]
        assert (b.token_ids, b.finish_reason, b.versions) == (a.token_ids, a.finish_reason, a.versions), k
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4), k
    # the 70 shared tokens: prefilled by "first" and once more up to the shared point, then reused
    assert eng.stats["prefix_hit_tokens"] >= 3 * 70
    assert eng.stats["prefill_tokens"] + eng.stats["fed_prompt_tokens"] <= ref_engine.stats["prefill_tokens"] - 2 * 70
    assert (eng.stats["fed_prompt_tokens"] > 0) == (append > 0)
    assert all(got[k].cached_prompt_tokens >= 70 for k in ("t1", "g0", "g1", "g2", "late"))


def _staggered(eng: EmbeddedEngine) -> dict:
    """One request decoding, then three prompts of the same length arriving one step apart."""
    futures = {"a": eng.submit(_prompt(20, 1), SamplingParams(temperature=0.0, max_tokens=12), request_id="a")}
    eng.step()
    for k, off in (("b", 2), ("c", 3), ("d", 4)):
        futures[k] = eng.submit(_prompt(17, off), SamplingParams(temperature=1.0, seed=off, max_tokens=6),
                                request_id=k)
        eng.step()
    _run_all(eng, futures.values())
    return {k: f.result() for k, f in futures.items()}


def test_prefill_wait_steps_gathers_staggered_prompts_into_one_forward(model):
    ref_engine = _engine(model)
    ref = _staggered(ref_engine)
    eng = _engine(model, prefill_wait_steps=3)
    got = _staggered(eng)
    # without waiting each of b, c, d starts its own forward; gathered, they share one
    assert ref_engine.stats["prefill_forwards"] == 4 and eng.stats["prefill_forwards"] == 2
    for k, a in ref.items():
        b = got[k]
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), k
        assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4), k
    # with nothing decoding, a prompt never waits: the first request is prefilled in its first step
    idle = _engine(model, prefill_wait_steps=50)
    fut = idle.submit(_prompt(9), SamplingParams(temperature=0.0, max_tokens=2))
    idle.step()
    assert idle.stats["prefill_forwards"] == 1 and idle.scheduler.decoding
    idle.generate(_prompt(9), SamplingParams(temperature=0.0, max_tokens=2))
    assert fut.result().token_ids
    assert EmbeddedEngine(model, background=False).prefill_wait_steps == 0  # off on the CPU by default
    with pytest.raises(ValueError, match="prefill_wait_steps must be >= 0"):
        EmbeddedEngine(model, background=False, prefill_wait_steps=-1)
