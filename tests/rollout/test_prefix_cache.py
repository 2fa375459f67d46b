"""The engine's prefix cache on its own: longest match, LRU order, image pads, shared-start anchors."""

import random

import torch

from k3rl.rollout.engine.prefix_cache import PrefixCache

PAD = 7


def _cache(size=3, share=4):
    return PrefixCache(size, share, PAD)


def test_lookup_takes_the_longest_entry_the_prompt_begins_with():
    c = _cache()
    c.remember([1, 2], (), "s12", torch.tensor([0.5]))
    c.remember([1, 2, 3, 4], (), "s1234", torch.tensor([1.5]))
    c.remember([1, 9, 3], (), "s193", torch.tensor([2.5]))
    assert c.lookup([1, 2, 3, 4, 5], ()).cache == "s1234"
    assert c.lookup([1, 2, 3, 9], ()).cache == "s12"
    assert c.lookup([1, 9, 3], ()).cache == "s193"  # the whole prompt cached
    assert c.lookup([2, 1], ()) is None
    assert c.lookup([1, 2, 3, 4], ("img",)).cache == "s1234"  # an entry without images fits any prompt


def test_images_must_match_in_order():
    c = _cache()
    c.remember([1, PAD, PAD, 2], ("a",), "with_a", torch.zeros(1))
    assert c.lookup([1, PAD, PAD, 2, 3], ("a",)).cache == "with_a"
    assert c.lookup([1, PAD, PAD, 2, 3], ("b",)) is None


def test_a_state_never_ends_inside_an_images_pad_run():
    c = _cache()
    c.remember([1, PAD], (), "mid_pads", torch.zeros(1))
    assert c.lookup([1, PAD, PAD, 2], ("a",)) is None
    assert c.lookup([1, PAD, 2], ("a",)).cache == "mid_pads"  # the run ended with the cached state


def test_least_recently_used_entries_leave_first_and_a_hit_refreshes_an_entry():
    c = _cache(size=2)
    c.remember([1], (), "a", torch.zeros(1))
    c.remember([2], (), "b", torch.zeros(1))
    assert c.lookup([1, 5], ()).cache == "a"  # "a" is now the most recent
    c.remember([3], (), "c", torch.zeros(1))
    assert len(c) == 2
    assert c.lookup([2, 5], ()) is None  # "b" was evicted
    assert c.lookup([1, 5], ()).cache == "a"
    c.clear()
    assert len(c) == 0 and c.lookup([1, 5], ()) is None


def test_logits_are_copied_and_size_zero_keeps_nothing():
    c = _cache()
    logits = torch.tensor([1.0, 2.0])
    c.remember([1], (), "a", logits)
    logits.add_(10)  # a CUDA graph's buffer is overwritten by the next step
    assert c.lookup([1], ()).logits.tolist() == [1.0, 2.0]
    off = PrefixCache(0, 4, PAD)
    off.remember([1], (), "a", logits)
    assert len(off) == 0


def test_split_point_finds_a_long_shared_start_with_the_last_prompt_of_the_same_anchor():
    c = _cache(share=8)
    system = list(range(100, 150))  # 50 tokens of system prompt
    first, second = system + [1, 2, 3], system + [4, 5]
    assert c.split_point(first, False, 0) == 0  # nothing earlier began as it does
    assert c.split_point(second, False, 0) == 50  # shares the 50 system tokens with `first`
    assert c.split_point(system + [6], False, 45) == 0  # only 5 beyond what is cached: not worth it
    assert c.split_point(system + [7], True, 0) == 0  # prompts with images never split
    assert c.split_point(list(range(20)), False, 0) == 0  # shorter than the anchor
    assert c.split_point(system, False, 0) == 0  # the shared start is the whole prompt
    assert PrefixCache(3, 0, PAD).split_point(second, False, 0) == 0  # sharing off


def _linear_lookup(entries, prompt, digests, pad):
    """The lookup as a scan of every entry in LRU order (the indexed lookup must pick the same one)."""
    best = None
    for e in entries:
        m = len(e.ids)
        if m > len(prompt) or (best is not None and m <= len(best.ids)):
            continue
        if e.images != digests[: len(e.images)] or tuple(prompt[:m]) != e.ids:
            continue
        if m < len(prompt) and prompt[m] == pad and prompt[m - 1] == pad:
            continue
        best = e
    return best


def test_the_indexed_lookup_picks_what_a_scan_of_every_entry_picks():
    rng = random.Random(0)
    c = _cache(size=12)
    for step in range(600):
        prompt = [rng.choice([1, 2, PAD]) for _ in range(rng.randrange(0, 7))]
        digests = tuple(rng.choice("ab") for _ in range(rng.randrange(0, 3)))
        if rng.random() < 0.5:
            c.remember(prompt, digests[: rng.randrange(0, len(digests) + 1)], step, torch.zeros(1))
        else:
            want = _linear_lookup(list(c.entries.values()), prompt, digests, PAD)
            got = c.lookup(prompt, digests)
            assert got is want, (prompt, digests)
        if step % 150 == 149:
            c.clear()
