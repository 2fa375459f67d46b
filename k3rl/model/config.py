"""K3Config: every hyperparameter of docs/model.md §1, presets, and the official config.json.

Field names follow the released `config.json` keys ([C] in the spec) so that `from_hf` /
`to_hf` are plain renames: the text model's keys live in `text_config`, the KDA keys in
`text_config.linear_attn_config` (with 1-based `kda_layers` / `full_attn_layers` lists) and
the MoonViT-V2 + projector keys in `vision_config`.

Presets:
- ``"k3"``       the released 2.78T model (§1.2, §1.4).
- ``"k3-small"`` ~220M parameters for one GPU, vocab 320 (the project's byte tokenizer).
- ``"k3-tiny"``  ~2M parameters for CPU tests, vocab 320.
All three keep the 3:1 KDA:MLA pattern ending in MLA, several AttnRes blocks, a latent MoE
with two shared experts, a dense first layer and a vision tower.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

BYTE_TOKENIZER_VOCAB = 320  # k3rl.tokenizer.ByteTokenizer.vocab_size
BYTE_TOKENIZER_MEDIA_PAD = 277  # ByteTokenizer().special("<|media_pad|>")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)


class LinearAttnConfig(_Strict):
    """KDA (`linear_attn_config` in the official text_config)."""

    num_heads: int = 96
    head_dim: int = 128  # d_k = d_v; also the rank of the forget-gate projection f_a
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # None selects the Kimi-Linear softplus gate
    use_full_rank_gate: bool = True
    kda_layers: list[int] = Field(default_factory=list)  # 1-based
    full_attn_layers: list[int] = Field(default_factory=list)  # 1-based (MLA)
    chunk_size: int = 64


class VisionConfig(_Strict):
    """MoonViT-V2 and the patchmergerv2 projector (`vision_config`, §1.4, §7)."""

    patch_size: int = 14
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    qkv_hidden_size: int = 1536
    vt_num_attention_heads: int = 12
    vt_intermediate_size: int = 4096
    vt_hidden_act: str = "gelu_pytorch_tanh"
    norm_type: str = "rmsnorm"
    vt_norm_eps: float = 2.0**-7
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    pos_emb_type: str = "divided_fixed"
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_interpolation: str = "bilinear"
    rope_theta: float = 10000.0
    merge_kernel_size: list[int] = Field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    video_in_patch_limit: int = 4096  # per frame (K2.5's value; unknown for K3, §7.1)
    # k3rl switch (§7.2 discrepancy): "joint" attention over all patches of a media item, as the
    # public reference code (checkpoint-compatible default), or the report's "factorized" intra-frame
    # spatial pass then inter-frame temporal pass with the same weights (identical for images)
    vt_attention: Literal["joint", "factorized"] = "joint"

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        head_dim = self.qkv_hidden_size // max(1, self.vt_num_attention_heads)
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            raise ValueError("vision_config: qkv_hidden_size must be divisible by vt_num_attention_heads")
        if head_dim % 4:
            raise ValueError(f"vision_config: the 2D RoPE needs a head dim divisible by 4, got {head_dim}")
        if self.vt_hidden_size % 2:
            raise ValueError("vision_config: vt_hidden_size must be even (temporal sincos table)")
        if self.merge_kernel_size != [2, 2] or self.merge_type != "sd2_tpool":
            raise ValueError("vision_config: only merge_type 'sd2_tpool' with merge_kernel_size [2, 2] is implemented")
        if self.mm_projector_type != "patchmergerv2":
            raise ValueError("vision_config: only mm_projector_type 'patchmergerv2' is implemented")
        if self.mm_hidden_size != self.vt_hidden_size:
            raise ValueError("vision_config: mm_hidden_size must equal vt_hidden_size (the merged width is 4x it)")
        return self


class K3Config(_Strict):
    """The text model's hyperparameters (§1.2) plus `vision_config` and the project's switches."""

    # backbone
    num_hidden_layers: int = 93
    hidden_size: int = 7168
    vocab_size: int = 163840
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    mla_layernorm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (§1.2)
    hidden_act: Literal["situ"] = "situ"
    activation_situ_beta: float = 4.0  # beta_1, gate branch
    activation_situ_linear_beta: float = 25.0  # beta_2, up branch
    initializer_range: float = 0.02
    # KDA
    linear_attn_config: LinearAttnConfig = Field(default_factory=LinearAttnConfig)
    # Gated MLA (NoPE)
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # Stable LatentMoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584  # latent width l
    latent_moe_use_norm: bool = True
    moe_router_activation_func: Literal["sigmoid"] = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792
    moe_layer_freq: int = 1
    # Block AttnRes
    attn_res_block_size: int = 12
    # MTP (not in the release)
    num_nextn_predict_layers: int = 0
    # multimodal
    media_placeholder_token_id: int = 163605
    vision_config: VisionConfig = Field(default_factory=VisionConfig)
    # project switches (not official keys; written under text_config too so round trips are exact)
    qb_num_bins: int = 1000
    qb_frozen: bool = True  # Quantile Balancing frozen: the RL default (§6.1)
    gradient_checkpointing: bool = False
    kernel_backend: Literal["auto", "torch", "triton"] = "auto"
    # Gated MLA's attention over packed documents on the GPU: PyTorch's SDPA (measured), or "flash": the
    # Triton flash kernel (kernels/attention/triton_flash.py; a shared prefix read in place, never copied)
    attention_kernel: Literal["sdpa", "flash"] = "sdpa"
    # the routed experts' GEMMs: "bf16" as the weights are, or "mxfp4": K3's precision recipe (§9.8),
    # MXFP4 weights with MXFP8 activations, both blocks of 32 along the contraction (model/mx.py)
    expert_precision: Literal["bf16", "mxfp4"] = "bf16"

    @model_validator(mode="after")
    def _check(self) -> K3Config:
        la = self.linear_attn_config
        L = self.num_hidden_layers
        if not la.kda_layers and not la.full_attn_layers:
            raise ValueError("linear_attn_config: give kda_layers and full_attn_layers (1-based layer numbers)")
        both = sorted(la.kda_layers + la.full_attn_layers)
        if both != list(range(1, L + 1)):
            raise ValueError(
                f"linear_attn_config: kda_layers and full_attn_layers must partition 1..{L} (1-based), "
                f"got kda_layers={la.kda_layers} full_attn_layers={la.full_attn_layers}"
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("MLA: num_key_value_heads must equal num_attention_heads")
        if not self.mla_use_nope:
            raise ValueError("MLA: only mla_use_nope=True (no rotary embedding) is part of K3")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ValueError("MoE: group-limited routing is inactive in K3; keep num_expert_group = topk_group = 1")
        if self.moe_layer_freq != 1:
            raise ValueError("MoE: moe_layer_freq must be 1 (every layer after the dense ones is MoE)")
        if not 0 < self.num_experts_per_token < self.num_experts:
            raise ValueError("MoE: need 0 < num_experts_per_token < num_experts (QB uses the (k+1)-th score)")
        if self.expert_precision == "mxfp4" and (self.routed_expert_hidden_size % 32 or self.moe_intermediate_size % 32):
            raise ValueError("expert_precision 'mxfp4' quantises in blocks of 32: routed_expert_hidden_size "
                             f"({self.routed_expert_hidden_size}) and moe_intermediate_size "
                             f"({self.moe_intermediate_size}) must be multiples of 32")
        if not 0 <= self.first_k_dense_replace <= L:
            raise ValueError("first_k_dense_replace must lie in [0, num_hidden_layers]")
        if self.attn_res_block_size < 1:
            raise ValueError("attn_res_block_size must be >= 1")
        if not 0 <= self.media_placeholder_token_id < self.vocab_size:
            raise ValueError(
                f"media_placeholder_token_id {self.media_placeholder_token_id} is outside the vocabulary "
                f"(vocab_size {self.vocab_size})"
            )
        return self

    # ----- derived views -------------------------------------------------------------
    @property
    def mla_layer_ids(self) -> list[int]:
        """0-based indices of the Gated MLA layers (built from the config list, not a modulus)."""
        return sorted(i - 1 for i in self.linear_attn_config.full_attn_layers)

    def is_mla_layer(self, layer_idx: int) -> bool:
        return (layer_idx + 1) in self.linear_attn_config.full_attn_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # ----- presets ---------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> K3Config:
        if name not in _PRESETS:
            raise ValueError(f"unknown K3 preset {name!r}; choose one of {sorted(_PRESETS)}")
        return _PRESETS[name]()

    # ----- official config.json ------------------------------------------------------
    def to_hf_dict(self, quantization_config: dict | None = None) -> dict:
        """The official config.json: the text model nested under `text_config` (with the checkpoint's
        `quantization_config`, when given, as the release has it), the tower under `vision_config`."""
        text = self.model_dump(exclude={"vision_config", "media_placeholder_token_id"})
        if quantization_config is not None:
            text["quantization_config"] = quantization_config
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "media_placeholder_token_id": self.media_placeholder_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": {"model_type": "kimi_k3_text", **text},
            "vision_config": {"model_type": "moonvit_v2", **self.vision_config.model_dump()},
        }

    def to_hf(self, directory: str | Path, quantization_config: dict | None = None) -> Path:
        """Write `config.json` (official layout) into `directory`; returns its path."""
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_hf_dict(quantization_config), indent=2, sort_keys=False) + "\n")
        return path

    @classmethod
    def from_hf_dict(cls, raw: dict) -> K3Config:
        if "text_config" not in raw:
            raise ValueError("config.json: expected a 'text_config' section (Kimi-K3 multimodal layout)")
        text = {k: v for k, v in raw["text_config"].items() if k in cls.model_fields}
        vision_raw = raw.get("vision_config") or {}
        vision = {k: v for k, v in vision_raw.items() if k in VisionConfig.model_fields}
        if "media_placeholder_token_id" in raw:
            text["media_placeholder_token_id"] = raw["media_placeholder_token_id"]
        if "linear_attn_config" in text:
            la = {k: v for k, v in text["linear_attn_config"].items() if k in LinearAttnConfig.model_fields}
            text["linear_attn_config"] = LinearAttnConfig(**la)
        return cls(**text, vision_config=VisionConfig(**vision))

    @classmethod
    def from_hf(cls, directory: str | Path) -> K3Config:
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        path = Path(directory)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_hf_dict(json.loads(path.read_text()))


def _pattern(num_layers: int) -> tuple[list[int], list[int]]:
    """1-based (kda_layers, full_attn_layers) for the K3 pattern: every 4th layer is MLA
    (K K K M repeated) and the last layer is always MLA."""
    mla = [i for i in range(1, num_layers + 1) if i % 4 == 0]
    if num_layers not in mla:
        mla.append(num_layers)
    kda = [i for i in range(1, num_layers + 1) if i not in mla]
    return kda, mla


def _k3() -> K3Config:
    kda, mla = _pattern(93)
    return K3Config(linear_attn_config=LinearAttnConfig(kda_layers=kda, full_attn_layers=mla))


def _k3_small() -> K3Config:
    kda, mla = _pattern(16)
    return K3Config(
        num_hidden_layers=16,
        hidden_size=768,
        vocab_size=BYTE_TOKENIZER_VOCAB,
        max_position_embeddings=131072,
        linear_attn_config=LinearAttnConfig(num_heads=6, head_dim=128, kda_layers=kda, full_attn_layers=mla),
        num_attention_heads=6,
        num_key_value_heads=6,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=128,
        num_experts=32,
        num_experts_per_token=4,
        num_shared_experts=2,
        moe_intermediate_size=256,
        routed_expert_hidden_size=384,
        intermediate_size=2048,
        attn_res_block_size=4,
        media_placeholder_token_id=BYTE_TOKENIZER_MEDIA_PAD,
        vision_config=VisionConfig(
            vt_num_hidden_layers=4,
            vt_hidden_size=256,
            qkv_hidden_size=256,
            vt_num_attention_heads=4,
            vt_intermediate_size=1024,
            init_pos_emb_height=32,
            init_pos_emb_width=32,
            mm_hidden_size=256,
            in_patch_limit=4096,
            patch_limit_on_one_side=128,
            video_in_patch_limit=1024,
        ),
    )


def _k3_tiny() -> K3Config:
    kda, mla = _pattern(8)
    return K3Config(
        num_hidden_layers=8,
        hidden_size=128,
        vocab_size=BYTE_TOKENIZER_VOCAB,
        max_position_embeddings=65536,
        linear_attn_config=LinearAttnConfig(num_heads=2, head_dim=32, kda_layers=kda, full_attn_layers=mla,
                                            chunk_size=16),
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        kv_lora_rank=48,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=64,
        routed_expert_hidden_size=64,
        intermediate_size=256,
        attn_res_block_size=3,
        media_placeholder_token_id=BYTE_TOKENIZER_MEDIA_PAD,
        vision_config=VisionConfig(
            vt_num_hidden_layers=2,
            vt_hidden_size=64,
            qkv_hidden_size=64,
            vt_num_attention_heads=2,
            vt_intermediate_size=128,
            init_pos_emb_height=8,
            init_pos_emb_width=8,
            mm_hidden_size=64,
            in_patch_limit=256,
            patch_limit_on_one_side=32,
            video_in_patch_limit=64,
        ),
    )


_PRESETS = {"k3": _k3, "k3-small": _k3_small, "k3-tiny": _k3_tiny}


def model_config(preset_or_config: str | K3Config, overrides: dict[str, Any] | None = None) -> K3Config:
    """The K3Config of a preset name (or a config) with `overrides` replacing its fields, validated."""
    config = K3Config.preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    if not isinstance(config, K3Config):
        raise TypeError(f"build a model from a preset name or a K3Config, got {type(preset_or_config).__name__}")
    if overrides:
        unknown = sorted(set(overrides) - set(K3Config.model_fields))
        if unknown:
            raise ValueError(f"model overrides {unknown} are not K3Config fields; see K3Config for the names")
        config = K3Config.model_validate({**config.model_dump(), **overrides})
    return config
