"""Incremental decoding with K3Cache (docs/model.md §2.7, §3.4, §10.4): token by token == one full
forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from k3_model_helpers import make_tiny
from PIL import Image

from k3rl.model import K3Cache, preprocess_media

TOL = dict(atol=5e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    return make_tiny(seed=1)


def test_token_by_token_equals_full_forward(model):
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2)
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(19)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert cache.lengths.tolist() == [19, 19]


def test_prefill_then_decode_equals_longer_prefill_and_chunked_prefill(model):
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1)
        model(ids[:, :22], cache=cache)
        last = model(ids[:, 22:], cache=cache)
        torch.testing.assert_close(last, full[:, 22:], **TOL)  # prefill(N) + decode(1) == prefill(N+1)
        chunked = model.new_cache(1)
        parts = [model(ids[:, a:b], cache=chunked) for a, b in ((0, 7), (7, 16), (16, 23))]
    torch.testing.assert_close(torch.cat(parts, 1), full, **TOL)


def test_prompt_with_images_then_decode(model):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (30, 44, 3), dtype=np.uint8))
    video = [Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)) for _ in range(3)]
    media = preprocess_media([img, video], model.config.vision_config)
    pad = model.config.media_placeholder_token_id
    n1, n2 = media.tokens_per_item()
    prompt = [5, 6] + [pad] * n1 + [7, 8] + [pad] * n2 + [9]
    ids = torch.tensor([prompt + [10, 11, 12, 13]])
    with torch.no_grad():
        full = model(ids, images=media)
        cache = model.new_cache(1)
        outs = [model(ids[:, : len(prompt)], images=media, cache=cache)]
        outs += [model(ids[:, t : t + 1], cache=cache) for t in range(len(prompt), ids.shape[1])]
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)


def test_sequence_alone_equals_inside_a_padded_batch(model):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 256, (1, 5), generator=g), torch.randint(0, 256, (1, 12), generator=g)
    nxt = torch.randint(0, 256, (2, 4), generator=g)
    with torch.no_grad():
        ca, cb = model.new_cache(1), model.new_cache(1)
        model(a, cache=ca)
        model(b, cache=cb)
        alone_a = [model(nxt[:1, t : t + 1], cache=ca.clone()) for t in range(1)]
        batch = K3Cache.stack([ca, cb])  # lengths 5 and 12: the MLA latent of a is right-padded
        assert batch.lengths.tolist() == [5, 12]
        batched = torch.cat([model(nxt[:, t : t + 1], cache=batch) for t in range(4)], 1)
        ref_a = model(torch.cat([a, nxt[:1]], 1))[:, 5:]
        ref_b = model(torch.cat([b, nxt[1:]], 1))[:, 12:]
        torch.testing.assert_close(alone_a[0], ref_a[:, :1], **TOL)
    torch.testing.assert_close(batched[:1], ref_a, **TOL)
    torch.testing.assert_close(batched[1:], ref_b, **TOL)
    sa, sb = batch.split()
    assert sa.lengths.tolist() == [9] and sb.lengths.tolist() == [16]
    assert all(e.latent.shape[1] == 9 for e in sa.mla.values())


def test_forked_prompt_samples_match_independent_runs(model):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (1, 9), generator=g)
    cont = torch.randint(0, 256, (3, 2), generator=g)
    with torch.no_grad():
        cache = model.new_cache(1)
        model(prompt, cache=cache)
        group = cache.repeat(3)  # one prefill, three samples
        outs = torch.cat([model(cont[:, t : t + 1], cache=group) for t in range(2)], 1)
        for i in range(3):
            ref = model(torch.cat([prompt, cont[i : i + 1]], 1))[:, 9:]
            torch.testing.assert_close(outs[i : i + 1], ref, **TOL)
    assert cache.lengths.tolist() == [9]  # the original is untouched


def test_cache_errors_are_clear(model):
    cache = model.new_cache(2)
    with pytest.raises(ValueError, match="cache holds 2 sequences"):
        model(torch.zeros(3, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="repeat"):
        cache.repeat(2)


def test_cache_host_lengths_given_without_reading_the_device():
    """new_cache, clone, stack and split carry the host mirror of the lengths: nothing reads `lengths`
    (on a GPU each read makes the engine's scheduler wait for the decode steps it queued)."""
    from k3rl.model import K3Cache, K3Config, K3ForCausalLM

    model = K3ForCausalLM(K3Config.preset("k3-tiny"))
    a, b = model.new_cache(1), model.new_cache(1)
    a.lengths, a.host_lengths = torch.tensor([5]), [5]
    for c in (a, b):  # a meta tensor cannot be read: any read of `lengths` from here on raises
        c.lengths = torch.empty(1, dtype=torch.int64, device="meta")
    stacked = K3Cache.stack([a, b])
    assert stacked.host_lengths == [5, 0]
    assert [c.host_lengths for c in stacked.split()] == [[5], [0]]
    assert a.clone().host_lengths == [5]
    assert model.new_cache(3).host_lengths == [0, 0, 0]
