"""Exact parameter counts from a config (docs/model.md §1.6).

`count_parameters(config) -> (total, active)` counts the text model: total is every text
parameter (the QB bias included, the vision tower and projector excluded); active replaces
the routed experts E by the k used per token and leaves out the input embedding (a table
lookup). `count_vision_parameters(config) -> (tower, projector)` counts MoonViT-V2 and the
patchmergerv2 projector. For the "k3" preset: 2,779,484,476,000 / 104,189,612,640 and
401,214,464 / 46,144,512.
"""

from __future__ import annotations

from .config import K3Config


def kda_layer_parameters(c: K3Config) -> int:
    """5dP (q, k, v, g, o) + 3PW (convs) + dD + DP (forget gate) + dH (beta) + H (A_log) + P (dt_bias) + D (o_norm)."""
    la = c.linear_attn_config
    d, H, D, W = c.hidden_size, la.num_heads, la.head_dim, la.short_conv_kernel_size
    P = H * D
    return 5 * d * P + 3 * P * W + d * D + D * P + d * H + H + P + D


def mla_layer_parameters(c: K3Config) -> int:
    """d q_r + q_r + q_r H (dn+dr) + d (kv_r+dr) + kv_r + kv_r H (dn+dv) + d H dv (g) + H dv d (o)."""
    d, H = c.hidden_size, c.num_attention_heads
    q_r, kv_r = c.q_lora_rank, c.kv_lora_rank
    dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    return d * q_r + q_r + q_r * H * (dn + dr) + d * (kv_r + dr) + kv_r + kv_r * H * (dn + dv) + d * H * dv + H * dv * d


def moe_non_expert_parameters(c: K3Config) -> int:
    """E d (router) + E (bias) + 2 l d (latent down and up) + l (latent norm) + 3 d (N_s f) (shared)."""
    d, E, lat, f = c.hidden_size, c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size
    norm = lat if c.latent_moe_use_norm else 0
    return E * d + E + 2 * lat * d + norm + 3 * d * (c.num_shared_experts * f)


def expert_parameters(c: K3Config) -> int:
    """One routed expert: w1, w3 [f, l] and w2 [l, f] = 3 l f."""
    return 3 * c.routed_expert_hidden_size * c.moe_intermediate_size


def _text_parameters(c: K3Config, experts_per_layer: int) -> int:
    d, V, L = c.hidden_size, c.vocab_size, c.num_hidden_layers
    n_mla = len(c.linear_attn_config.full_attn_layers)
    n_kda = L - n_mla
    n_moe = len(c.moe_layer_ids)
    embed_and_head = V * d if c.tie_word_embeddings else 2 * V * d
    globals_ = embed_and_head + 3 * d  # + final norm, output AttnRes norm and projection
    per_layer_norms = L * 6 * d  # input/post norms, two AttnRes norms, two AttnRes projections
    dense = (L - n_moe) * 3 * d * c.intermediate_size
    moe = n_moe * (moe_non_expert_parameters(c) + experts_per_layer * expert_parameters(c))
    return globals_ + n_kda * kda_layer_parameters(c) + n_mla * mla_layer_parameters(c) + per_layer_norms + dense + moe


def count_parameters(config: K3Config) -> tuple[int, int]:
    """(total, active) parameters of the text model; active excludes the input embedding."""
    total = _text_parameters(config, config.num_experts)
    active = _text_parameters(config, config.num_experts_per_token) - config.vocab_size * config.hidden_size
    return total, active


def count_vision_parameters(config: K3Config) -> tuple[int, int]:
    """(MoonViT-V2 tower, patchmergerv2 projector) parameters."""
    v = config.vision_config
    w, qkv, inter, p = v.vt_hidden_size, v.qkv_hidden_size, v.vt_intermediate_size, v.patch_size
    block = w * 3 * qkv + qkv * w + 2 * w * inter + 2 * w  # wqkv, wo, fc0+fc1, two norms
    tower = v.vt_num_hidden_layers * block + 3 * p * p * w + v.init_pos_emb_height * v.init_pos_emb_width * w + w
    merged = v.mm_hidden_size * v.merge_kernel_size[0] * v.merge_kernel_size[1]
    projector = merged * merged + merged * config.hidden_size + config.hidden_size
    return tower, projector
