"""K3Config presets, the official config.json, and exact parameter counts (docs/model.md §1, §10.12)."""

from __future__ import annotations

import json

import pytest
import torch

from k3rl.model import K3Config, K3ForCausalLM, count_parameters, count_vision_parameters
from k3rl.model.params import kda_layer_parameters, mla_layer_parameters


def test_k3_counts_are_the_spec_integers():
    c = K3Config.preset("k3")
    assert count_parameters(c) == (2_779_484_476_000, 104_189_612_640)
    assert kda_layer_parameters(c) == 443_740_384
    assert mla_layer_parameters(c) == 232_196_096
    assert count_vision_parameters(c) == (401_214_464, 46_144_512)


def test_k3_layer_schedule_from_config_lists():
    c = K3Config.preset("k3")
    assert c.mla_layer_ids == list(range(3, 92, 4)) + [92]
    assert len(c.linear_attn_config.kda_layers) == 69 and len(c.mla_layer_ids) == 24
    assert c.linear_attn_config.full_attn_layers[-2:] == [92, 93]  # 1-based
    assert c.moe_layer_ids == list(range(1, 93))


def test_k3_builds_on_meta_and_matches_the_count():
    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.preset("k3"))
    assert all(p.is_meta for p in model.parameters())
    total, _ = count_parameters(model.config)
    tower, projector = count_vision_parameters(model.config)
    text = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("vision_tower.", "mm_projector.")))
    assert text == total
    assert sum(p.numel() for p in model.vision_tower.parameters()) == tower
    assert sum(p.numel() for p in model.mm_projector.parameters()) == projector


@pytest.mark.parametrize("name,lo,hi", [("k3-small", 100e6, 300e6), ("k3-tiny", 1e6, 9e6)])
def test_small_presets_keep_every_component(name, lo, hi):
    c = K3Config.preset(name)
    total, active = count_parameters(c)
    tower, projector = count_vision_parameters(c)
    assert lo <= total + tower + projector <= hi
    assert active < total
    assert c.vocab_size == 320 and c.media_placeholder_token_id == 277  # the byte tokenizer
    L = c.num_hidden_layers
    assert c.is_mla_layer(L - 1) and len(c.mla_layer_ids) * 4 == L  # 3:1, ending in MLA
    assert -(-L // c.attn_res_block_size) >= 3  # several AttnRes blocks
    assert c.first_k_dense_replace == 1 and c.num_shared_experts == 2
    assert c.num_experts >= 8 and 2 <= c.num_experts_per_token <= 4
    with torch.device("meta"):
        model = K3ForCausalLM(c)
    assert sum(p.numel() for p in model.parameters()) == total + tower + projector


def test_tiny_model_parameter_sum_matches_on_cpu():
    c = K3Config.preset("k3-tiny")
    model = K3ForCausalLM(c)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(c)[0] + sum(count_vision_parameters(c))


def test_official_config_json_round_trip(tmp_path):
    c = K3Config.preset("k3")
    c.to_hf(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    text, vision = raw["text_config"], raw["vision_config"]
    assert raw["media_placeholder_token_id"] == 163605
    assert text["hidden_size"] == 7168 and text["num_experts"] == 896 and text["routed_expert_hidden_size"] == 3584
    assert text["linear_attn_config"]["full_attn_layers"][:3] == [4, 8, 12]
    assert text["linear_attn_config"]["gate_lower_bound"] == -5.0
    assert vision["vt_hidden_size"] == 1024 and vision["merge_type"] == "sd2_tpool"
    assert K3Config.from_hf(tmp_path) == c


def test_from_hf_ignores_unknown_keys_and_reads_official_ones(tmp_path):
    raw = K3Config.preset("k3-tiny").to_hf_dict()
    raw["text_config"]["some_future_key"] = 1
    raw["text_config"].pop("qb_num_bins")  # our own switches are optional in an official file
    raw["media_placeholder_token_id"] = 5
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = K3Config.from_hf(tmp_path)
    assert c.media_placeholder_token_id == 5 and c.qb_num_bins == 1000 and c.hidden_size == 128


def test_bad_configs_raise_clear_errors():
    base = K3Config.preset("k3-tiny").model_dump()
    bad = dict(base)
    bad["linear_attn_config"] = dict(base["linear_attn_config"], full_attn_layers=[4])
    with pytest.raises(ValueError, match="partition"):
        K3Config.model_validate(bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        K3Config.model_validate(dict(base, media_placeholder_token_id=999))
    with pytest.raises(ValueError, match="unknown K3 preset"):
        K3Config.preset("k4")


def test_small_presets_agree_with_the_byte_tokenizer():
    from k3rl.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    for name in ("k3-small", "k3-tiny"):
        c = K3Config.preset(name)
        assert c.vocab_size == tok.vocab_size
        assert c.media_placeholder_token_id == tok.special("<|media_pad|>")
    assert K3Config.preset("k3").media_placeholder_token_id == 163605
