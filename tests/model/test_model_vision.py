"""MoonViT-V2 preprocessing, tower, merge and the multimodal token stream (docs/model.md §7, §10.13)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from k3_model_helpers import make_tiny
from PIL import Image

from k3rl.images import num_image_tokens
from k3rl.model import K3Config, MediaBatch, preprocess_media
from k3rl.model.vision import MoonViT, merge_sd2_tpool, rope_2d_angles, temporal_sincos

TINY = K3Config.preset("k3-tiny")


def rand_image(w, h, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


def test_largest_image_gives_16384_tokens():
    vc = K3Config.preset("k3").vision_config
    batch = preprocess_media([Image.new("RGB", (3584, 3584), (10, 20, 30))], vc)
    assert batch.grid_thw.tolist() == [[1, 256, 256]]
    assert batch.pixel_values.shape == (65536, 3, 14, 14)
    assert batch.tokens_per_item() == [16384] == [num_image_tokens(3584, 3584)]


def test_odd_image_pads_to_multiples_of_28():
    vc = K3Config.preset("k3").vision_config
    batch = preprocess_media([Image.new("RGB", (303, 181), (255, 255, 255))], vc)
    assert batch.grid_thw.tolist() == [[1, 14, 22]]  # 196 x 308 pixels
    assert batch.num_tokens == 77
    px = batch.pixel_values.reshape(14, 22, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(196, 308, 3)
    assert bool((px[:181, :303] == 1.0).all())  # white -> (1 - 0.5) / 0.5
    assert bool((px[181:] == -1.0).all() and (px[:, 303:] == -1.0).all())  # black padding -> -1


def test_resize_never_upscales_and_respects_the_patch_limit():
    vc = TINY.vision_config  # in_patch_limit 256, 32 patches per side
    small = preprocess_media([rand_image(20, 30)], vc)
    assert small.grid_thw.tolist() == [[1, 4, 2]]  # 30 x 20 kept, padded to 56 x 28
    big = preprocess_media([rand_image(700, 350)], vc)
    t, gh, gw = big.grid_thw[0].tolist()
    assert gh * gw <= 4 * 256 and gw <= 34 and gw > gh


def test_alpha_is_composited_over_a_chessboard():
    img = Image.new("RGBA", (28, 28), (0, 0, 0, 0))  # fully transparent
    px = preprocess_media([img], TINY.vision_config).pixel_values  # 4 patches of 14x14
    first = px[0]  # top-left patch, channel-first
    norm = lambda v: (v / 255 - 0.5) / 0.5
    assert first[0, 0, 0].item() == pytest.approx(norm(255))  # white at the top-left
    assert first[0, 0, 8].item() == pytest.approx(norm(180))  # next 8-px cell
    assert first[0, 8, 8].item() == pytest.approx(norm(255))


def test_videos_split_into_chunks_of_four_frames():
    frames = [rand_image(56, 42, seed=i) for i in range(6)]
    batch = preprocess_media([frames, rand_image(30, 30)], TINY.vision_config)
    assert batch.grid_thw.tolist() == [[4, 4, 4], [2, 4, 4], [1, 4, 4]]
    assert batch.pixel_values.shape[0] == 4 * 16 + 2 * 16 + 16
    assert batch.tokens_per_item() == [4, 4, 4]


def test_tower_output_dtype_equals_input_dtype():
    torch.manual_seed(0)
    tower = MoonViT(TINY.vision_config)
    batch = preprocess_media([rand_image(40, 30)], TINY.vision_config)
    with torch.no_grad():
        assert tower(batch.pixel_values, batch.grid_thw).dtype == torch.float32
        out = tower.to(torch.bfloat16)(batch.pixel_values.bfloat16(), batch.grid_thw)
    assert out.dtype == torch.bfloat16


def test_media_items_attend_only_within_themselves():
    torch.manual_seed(0)
    tower = MoonViT(TINY.vision_config)
    a = preprocess_media([rand_image(40, 30, seed=1)], TINY.vision_config)
    b = preprocess_media([[rand_image(28, 56, seed=i) for i in range(3)]], TINY.vision_config)
    both = MediaBatch.cat([a, b])
    with torch.no_grad():
        alone = tower(a.pixel_values, a.grid_thw)
        joint = tower(both.pixel_values, both.grid_thw)
    torch.testing.assert_close(joint[: alone.shape[0]], alone, atol=1e-6, rtol=1e-5)


def test_positions_rope_and_temporal_table():
    angles = rope_2d_angles(2, 2, 3, 16, 10000.0, "cpu")  # 2 frames of 2 x 3 patches, head dim 16
    theta0 = 1.0
    # patch (row 1, col 2) = index 5: pair 0 turns by col * theta_0, pair 1 by row * theta_0
    assert angles[5, 0].item() == pytest.approx(2 * theta0) and angles[5, 1].item() == pytest.approx(1 * theta0)
    torch.testing.assert_close(angles[:6], angles[6:])  # repeated per frame, no temporal RoPE
    table = temporal_sincos(4, 8)
    assert table[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # [sin | cos]: row 0 is not zero
    torch.manual_seed(0)
    tower = MoonViT(TINY.vision_config)
    pe = tower.patch_embed
    torch.testing.assert_close(pe.positions(1, 8, 8, torch.float32), pe.pos_emb.weight.reshape(64, -1))
    video = pe.positions(2, 8, 8, torch.float32)
    grid, time = pe.pos_emb.weight.reshape(64, -1), temporal_sincos(4, 64)
    torch.testing.assert_close(video, torch.cat([grid + time[0], grid + time[1]]))
    assert pe.positions(1, 6, 10, torch.float32).shape == (60, 64)  # bilinear resample


def test_sd2_tpool_merge_order():
    feats = torch.arange(2 * 4 * 4, dtype=torch.float32)[:, None].repeat(1, 2)  # t=2, 4x4 grid, width 2
    merged = merge_sd2_tpool(feats, torch.tensor([[2, 4, 4]]))
    assert merged.shape == (4, 8)
    # token 0 = mean over frames of patches (0,0), (0,1), (1,0), (1,1): indices 0, 1, 4, 5 (+16 in frame 2)
    assert merged[0, ::2].tolist() == [8.0, 9.0, 12.0, 13.0]


def test_placeholders_are_replaced_and_counts_checked():
    model = make_tiny()
    pad = model.config.media_placeholder_token_id
    media = preprocess_media([rand_image(40, 30), [rand_image(28, 28, seed=i) for i in range(2)]], TINY.vision_config)
    n1, n2 = media.tokens_per_item()
    ids = torch.tensor([[1, 2] + [pad] * n1 + [3] + [pad] * n2 + [4]])
    seen = {}
    model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        logits = model(ids, images=media)
        rows = model.encode_media(media)
    assert logits.shape == (1, ids.shape[1], 320)
    torch.testing.assert_close(seen["x"][0][ids[0] == pad], rows)
    with pytest.raises(ValueError, match=rf"hold {n1 + n2 - 1} <\|media_pad\|>.*give {n1 + n2} rows"):
        model(ids[:, :-2], images=media)
    with pytest.raises(ValueError, match="no images were given"):
        model(ids)


def _block_and_video(layout):
    vc = TINY.vision_config.model_copy(update={"vt_attention": layout})
    torch.manual_seed(0)
    tower = MoonViT(vc)
    video = preprocess_media([[rand_image(56, 28, seed=i) for i in range(3)]], vc)  # 3 frames of 2 x 4 patches
    return tower, video


def test_factorized_attention_equals_joint_for_images_and_differs_for_video():
    joint, video = _block_and_video("joint")
    fact, _ = _block_and_video("factorized")
    fact.load_state_dict(joint.state_dict())  # same weights: the layout adds none
    image = preprocess_media([rand_image(40, 30, seed=3)], TINY.vision_config)
    with torch.no_grad():
        torch.testing.assert_close(fact(image.pixel_values, image.grid_thw),
                                   joint(image.pixel_values, image.grid_thw), atol=0, rtol=0)
        a, b = fact(video.pixel_values, video.grid_thw), joint(video.pixel_values, video.grid_thw)
    assert float((a - b).abs().max()) > 1e-3


def test_factorized_passes_attend_within_a_frame_then_across_frames_of_one_position():
    tower, video = _block_and_video("factorized")
    block = tower.encoder.blocks[0]
    grid = [tuple(int(v) for v in video.grid_thw[0].tolist())]
    t, gh, gw = grid[0]
    s = gh * gw
    angles = [rope_2d_angles(t, gh, gw, block.head_dim, 10000.0, "cpu")]
    x = torch.randn(t * s, TINY.vision_config.vt_hidden_size)
    y = x.clone()
    y[s + 2] += 1.0  # frame 1, position 2
    with torch.no_grad():
        for mode, changed in (
            ("spatial", [s + i for i in range(s)]),  # every patch of frame 1, nothing else
            ("temporal", [f * s + 2 for f in range(t)]),  # position 2 in every frame, nothing else
        ):
            diff = (block.attention(y, grid, angles, mode) - block.attention(x, grid, angles, mode)).abs().amax(1)
            assert sorted(torch.nonzero(diff > 1e-7).flatten().tolist()) == changed, mode


def test_standalone_tower_is_fully_initialised():
    """A MoonViT built on its own holds no uninitialised memory (a torch.empty parameter gave NaN
    outputs once): two builds from the same seed are equal parameter by parameter, and finite."""
    towers = []
    for _ in range(2):
        torch.manual_seed(0)
        towers.append(MoonViT(TINY.vision_config))
        torch.empty(1 << 20).normal_()  # leave non-zero garbage in freed memory between the builds
    for (name, p), q in zip(towers[0].named_parameters(), towers[1].parameters(), strict=True):
        assert torch.isfinite(p).all() and torch.equal(p, q), name
