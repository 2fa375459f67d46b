"""Block AttnRes invariants (docs/model.md §4, §10.7)."""

from __future__ import annotations

import math

import torch

from k3rl.model import K3Config, K3ForCausalLM, LinearAttnConfig, VisionConfig
from k3rl.model.attnres import aggregate, expected_source_counts, phase1, phase2
from k3rl.model.config import _pattern


def k3_layout_narrow() -> K3Config:
    """The released 93-layer schedule (block size 12, MLA list, dense layer 0) at toy widths."""
    kda, mla = _pattern(93)
    return K3Config(
        hidden_size=16, vocab_size=64, media_placeholder_token_id=63, intermediate_size=16,
        linear_attn_config=LinearAttnConfig(num_heads=1, head_dim=8, kda_layers=kda, full_attn_layers=mla, chunk_size=8),
        num_attention_heads=1, num_key_value_heads=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=4, num_experts=4, num_experts_per_token=2, moe_intermediate_size=8,
        routed_expert_hidden_size=8,
        vision_config=VisionConfig(vt_num_hidden_layers=1, vt_hidden_size=8, qkv_hidden_size=8, vt_num_attention_heads=2,
                                   vt_intermediate_size=8, init_pos_emb_height=4, init_pos_emb_width=4, mm_hidden_size=8),
    )


def test_source_counts_of_the_k3_schedule():
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_layout_narrow()).eval()
    with torch.no_grad():
        model(torch.randint(0, 60, (1, 3)))
    attn = [layer.source_counts[0] for layer in model.model.layers]
    mlp = [layer.source_counts[1] for layer in model.model.layers]
    # §4.4 concrete values: attention 1 at l=0, 2 for 1..12, 3 for 13..24, ..., 9 for 85..92
    assert attn == [1] + [2 + (i - 1) // 12 for i in range(1, 93)]
    # MLP: 2 for 0..11, ..., 9 for 84..92; the final aggregation sees 9 sources
    assert mlp == [2 + i // 12 for i in range(93)]
    assert model.final_source_count == 9
    # bank size after layer l = ceil((l+1)/12) = MLP sources - 1
    assert [m - 1 for m in mlp] == [math.ceil((i + 1) / 12) for i in range(93)]
    assert (attn, mlp, 9) == tuple(expected_source_counts(93, 12))


def test_layer0_attention_input_is_the_embedding_bit_exactly():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_()
    seen = {}
    model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda m, args: seen.setdefault("a", args[0]))
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        model(ids)
        assert torch.equal(seen["a"], model.model.embed_tokens(ids))


def test_zero_pseudo_query_gives_uniform_average():
    sources = [torch.randn(3, 5, 32) * s for s in (1.0, 10.0, 0.1, 3.0)]
    out = aggregate(sources, torch.zeros(32), 1e-5)
    torch.testing.assert_close(out, torch.stack(sources).mean(0))


def test_scores_use_rms_normalised_keys_and_unnormalised_values():
    torch.manual_seed(1)
    sources = [torch.randn(4, 16) * s for s in (1.0, 50.0, 0.01)]
    w = torch.randn(16)
    keys = [s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-5) for s in sources]
    a = torch.stack([(k * w).sum(-1) for k in keys]).softmax(0)
    expected = sum(a[i, :, None] * sources[i] for i in range(3))
    torch.testing.assert_close(aggregate(sources, w, 1e-5), expected)
    bf = [s.bfloat16() for s in sources]  # bf16 sources: scores and softmax still fp32
    torch.testing.assert_close(aggregate(bf, w, 1e-5), aggregate([s.float() for s in bf], w, 1e-5).bfloat16())


def test_two_phase_online_softmax_equals_direct_aggregation():
    torch.manual_seed(2)
    completed = [torch.randn(6, 64) * s for s in (1.0, 4.0, 0.5, 2.0, 8.0)]
    query = torch.randn(64) * 3
    stats = phase1(completed, query, 1e-5)  # once per block
    for _ in range(3):  # several sublayers fold in their own partial sums
        partial = torch.randn(6, 64) * 5
        direct = aggregate(completed + [partial], query, 1e-5)
        assert (phase2(stats, partial, query, 1e-5) - direct).abs().max() < 1e-6 * max(1.0, direct.abs().max())
