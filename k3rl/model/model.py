"""K3ForCausalLM: the decoder stack with Block AttnRes, the vision path and the LM head.

Per decoder layer l (docs/model.md §4.3), with a bank Bk of completed blocks and a partial sum Pt:
    a  = Agg(Bk + [Pt]; attn query)   (a = Pt = embedding at l = 0)
    if l % block_size == 0: Bk.append(Pt); Pt = None
    Pt = Pt + Mixer_l(RMSNorm_in(a))                  KDA or Gated MLA
    m  = Agg(Bk + [Pt]; mlp query)
    Pt = Pt + FFN_l(RMSNorm_post(m))                  dense SiTU-GLU (l < first_k_dense_replace) or LatentMoE
After the last layer: logits = lm_head(RMSNorm(Agg(Bk + [Pt]; output query))).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3rl.kernels._backend import before_compile
from k3rl.kernels.varlen import host_copy

from .attnres import aggregate, make_query_params, query_vector
from .cache import K3Cache
from .common import RMSNorm, SiTUGLUMLP
from .config import K3Config
from .kda import KDA_FP32_PARAMS, KimiDeltaAttention
from .logprobs import chunked_reverse_kl, chunked_token_logprobs
from .mla import GatedMLA, MLACacheEntry
from .moe import Routing, StableLatentMoE
from .vision import MoonViT, PatchMergerV2, check_grid, merge_media_embeddings, merge_sd2_tpool
from .vision_preprocess import MediaBatch, preprocess_media

# Parameter-name suffixes kept in fp32 whatever the model dtype (§1.5: an allow-list, never a blanket cast).
FP32_PARAM_SUFFIXES = KDA_FP32_PARAMS + ("gate.e_score_correction_bias",)


def allow_layer_recompiles(num_layers: int) -> None:
    """Before torch.compile of layers: make the Triton kernels' host wrappers graph breaks
    (kernels.eager_only), and raise dynamo's recompile limits so that a compiled per-layer function holds
    a guard set for each layer variant (mixer, FFN, AttnRes bank length, shapes) instead of falling back
    to eager at 8."""
    before_compile()
    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, 4 * num_layers)  # alias of recompile_limit
    dynamo.accumulated_cache_size_limit = max(dynamo.accumulated_cache_size_limit, 16 * num_layers)


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.eps = eps
        self.backend = config.kernel_backend  # the Block AttnRes aggregation's kernel (kernels/attnres)
        self.is_block_start = layer_idx % config.attn_res_block_size == 0
        self.is_mla = config.is_mla_layer(layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.self_attention_res_proj, self.self_attention_res_norm = make_query_params(d, eps)
        self.mlp_res_proj, self.mlp_res_norm = make_query_params(d, eps)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attn = GatedMLA(config, layer_idx) if self.is_mla else KimiDeltaAttention(config, layer_idx)
        if self.is_moe:
            self.mlp = StableLatentMoE(config)
        else:
            self.mlp = SiTUGLUMLP(d, config.intermediate_size, config.activation_situ_beta,
                                  config.activation_situ_linear_beta)
        self.source_counts = (0, 0)  # (attention, mlp) sources at the last forward (§4.4 check)

    def forward(self, bank: list[torch.Tensor], partial: torch.Tensor, cu_seqlens=None, cache_entry=None,
                step=None, replay_idx=None, context_parallel=None):
        # 1. attention input: aggregate completed blocks and the partial sum (identity at layer 0)
        attn_sources = bank + [partial]
        a = aggregate(attn_sources, query_vector(self.self_attention_res_proj, self.self_attention_res_norm), self.eps,
                      self.backend)
        # 2. block boundary: the partial (the embedding at l = 0) becomes a completed source
        if self.is_block_start:
            bank = bank + [partial]
            partial = None
        # 3-4. token mixer, accumulated into the partial sum
        x = self.input_layernorm(a)
        if self.is_mla:
            t = self.self_attn(x, cu_seqlens=cu_seqlens, cache=cache_entry, step=step,
                               context_parallel=context_parallel)
        else:
            t = self.self_attn(x, cu_seqlens=cu_seqlens, cache=cache_entry, context_parallel=context_parallel)
        partial = t if partial is None else partial + t
        # 5-7. channel mixer on the aggregate of completed blocks and the updated partial
        mlp_sources = bank + [partial]
        m = aggregate(mlp_sources, query_vector(self.mlp_res_proj, self.mlp_res_norm), self.eps, self.backend)
        y = self.post_attention_layernorm(m)
        routing = None
        if self.is_moe:
            f, routing = self.mlp(y, replay_idx)
        else:
            f = self.mlp(y)
        self.source_counts = (len(attn_sources), len(mlp_sources))
        return bank, partial + f, routing


class K3Model(nn.Module):
    """`model.*`: embeddings, decoder layers, output AttnRes aggregator and final norm."""

    def __init__(self, config: K3Config):
        super().__init__()
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.output_attn_res_proj, self.output_attn_res_norm = make_query_params(d, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.vision_tower = MoonViT(config.vision_config)
        self.mm_projector = PatchMergerV2(config)
        self.gradient_checkpointing = config.gradient_checkpointing
        self.qb_frozen = config.qb_frozen
        self.reset_parameters()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.moe_layer_ids = config.moe_layer_ids
        self.final_source_count = 0
        for module in self.modules():  # every norm runs the model's kernel backend (kernels/rmsnorm)
            if isinstance(module, RMSNorm):
                module.backend = config.kernel_backend

    # ----- initialisation and dtypes ----------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, initializer_range) for projections, embeddings and experts (§11 choice); norms 1;
        AttnRes pseudo-queries 0; KDA A_log 0, dt_bias Mamba-2 init, convs PyTorch default;
        projector truncated normal with std sqrt(2 / fan_in) (§7.3)."""
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not name.endswith("_res_proj"):
                nn.init.normal_(module.weight, 0.0, std)
        for layer in self.model.layers:
            if layer.is_moe:
                nn.init.normal_(layer.mlp.gate.weight, 0.0, std)
                for w in (layer.mlp.experts.w1, layer.mlp.experts.w2, layer.mlp.experts.w3):
                    nn.init.normal_(w, 0.0, std)
        nn.init.normal_(self.vision_tower.patch_embed.pos_emb.weight, 0.0, std)
        for lin in (self.mm_projector.proj[0], self.mm_projector.proj[2]):  # reference: trunc normal sqrt(2/fan_in)
            s = (2.0 / lin.in_features) ** 0.5
            nn.init.trunc_normal_(lin.weight, 0.0, s, -2 * s, 2 * s)

    def _apply(self, fn, recurse=True):
        """Keep the fp32 allow-list fp32 through `.to(dtype)`, `.bfloat16()`, `.half()` (§1.5).

        A blanket cast would round A_log, dt_bias, the conv weights and the QB bias to bf16
        and silently corrupt the KDA gate; the original fp32 values are moved to the new
        device instead.
        """
        keep = {n: (p, p.data) for n, p in self.named_parameters() if n.endswith(FP32_PARAM_SUFFIXES)}
        super()._apply(fn, recurse)
        for p, original in keep.values():
            if p.dtype != torch.float32 and p.is_floating_point():
                p.data = original.to(device=p.device, dtype=torch.float32)
        return self

    def to_param_dtype(self, dtype: torch.dtype) -> K3ForCausalLM:
        """Cast every floating parameter to `dtype` except the fp32 allow-list (§1.5)."""
        for name, p in self.named_parameters():
            if p.is_floating_point():
                keep = name.endswith(FP32_PARAM_SUFFIXES)
                p.data = p.data.to(torch.float32 if keep else dtype)
        return self

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ----- caches and Quantile Balancing --------------------------------------------------------
    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None) -> K3Cache:
        device = self.model.embed_tokens.weight.device
        dtype = dtype or self.activation_dtype
        kda, mla = {}, {}
        for layer in self.model.layers:
            attn = layer.self_attn
            if layer.is_mla:
                width = attn.kv_rank + attn.rope_dim
                mla[layer.layer_idx] = MLACacheEntry(torch.zeros(batch_size, 0, width, dtype=dtype, device=device))
            else:
                kda[layer.layer_idx] = attn.new_cache(batch_size, dtype, device)
        return K3Cache(kda, mla, torch.zeros(batch_size, dtype=torch.int64, device=device), [0] * batch_size)

    def compile_layers(self, **options) -> K3ForCausalLM:
        """Regional `torch.compile`: each decoder layer compiled in place (`nn.Module.compile`, so
        parameter names and state dicts are unchanged), fusing the many small elementwise kernels
        between the layer's matmuls and Triton kernels. Layers of one shape (mixer, FFN, AttnRes
        bank length) share a compiled graph; the recompile limit is raised to hold every variant.
        The first forward of each variant compiles (minutes on a CPU, less on a GPU)."""
        allow_layer_recompiles(len(self.model.layers))
        for layer in self.model.layers:
            layer.compile(**options)
        return self

    def moe_layers(self) -> list[StableLatentMoE]:
        return [layer.mlp for layer in self.model.layers if layer.is_moe]

    def set_qb_frozen(self, frozen: bool) -> None:
        self.qb_frozen = frozen

    def qb_counts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per MoE layer (histogram counts [E, B], token count): integer tensors to all-reduce (sum)."""
        return [(moe.qb.counts, moe.qb.num_tokens) for moe in self.moe_layers()]

    def qb_step(self) -> int:
        """Apply the QB biases accumulated during this step's forwards; returns the layers updated."""
        if self.qb_frozen:
            return 0
        return sum(moe.qb_apply() for moe in self.moe_layers())

    # ----- vision --------------------------------------------------------------------------------
    def encode_media(self, media: MediaBatch) -> torch.Tensor:
        """Media items -> projected rows [sum gh*gw/4, d], in item order."""
        check_grid(media.grid_thw)
        w = self.vision_tower.patch_embed.proj.weight
        feats = self.vision_tower(media.pixel_values.to(device=w.device, dtype=w.dtype), media.grid_thw)
        return self.mm_projector(merge_sd2_tpool(feats, media.grid_thw))

    def as_media(self, images) -> MediaBatch:
        if isinstance(images, MediaBatch):
            return images
        if isinstance(images, Sequence):
            return preprocess_media(images, self.config.vision_config)
        raise TypeError(f"images must be a MediaBatch or a list of PIL images / videos, got {type(images).__name__}")

    # ----- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        images=None,
        cu_seqlens: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        routed_experts: torch.Tensor | None = None,
        return_routing: bool = False,
        token_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        logprob_chunk_tokens: int | None = None,
        context_parallel=None,
        temperature: float = 1.0,
        distill_from=(),
        return_hidden: bool = False,
        prefix_tree=None,
    ):
        """Logits [B, T, V]; with `return_routing`, also the experts used [B, T, n_moe_layers, k].

        - `targets` [B, T]: instead of the logits, (log p(target) [B, T], entropy [B, T]) in fp32,
          formed chunk by chunk from the last hidden states (`logprobs.py`): the [B, T, V]
          logits never exist, in the forward or the backward. `temperature`: of softmax(logits / T),
          the distribution an engine sampling at temperature T draws from.
        - `distill_from`, with `targets`: teachers' (last hidden states [B, T, d'], lm_head weight [V, d']):
          a third output, the exact reverse KL(pi || teacher) at every position [n_teachers, B, T]
          (`logprobs.chunked_reverse_kl`).
        - `return_hidden`: the last hidden states [B, T, d] (after the final norm) instead of the logits:
          what a teacher hands to `distill_from`.

        - `images`: a MediaBatch (or raw images / videos) whose rows replace the
          `media_placeholder_token_id` tokens in order; the counts must match exactly.
        - `cu_seqlens` [N+1]: B = 1 packed documents; KDA state and conv restart and MLA
          masks are block-diagonal per document.
        - `cache`: a K3Cache from `new_cache(B)`; the T tokens of every row are appended.
        - `routed_experts` [B, T, n_moe_layers, k]: routing replay (recorded expert ids).
        - `token_mask` [B, T] bool: False marks padding, left out of Quantile Balancing's
          statistics (attention is causal, so right padding never reaches real tokens).
        - `context_parallel`: a `learner.context_parallel_layers.ContextParallel` (a collective):
          `input_ids` (and `routed_experts`, `token_mask`, `targets`) are this rank's shard of one
          packed sequence, `cu_seqlens` the whole sequence's documents; the outputs are this rank's
          shard of the whole sequence's. KDA and MLA exchange what they need; the rest works per
          position. No images or cache.
        - `prefix_tree`: a `learner.prefix_tree.PrefixTree` (shared-prefix training): `input_ids` is its
          tree stream (each group's shared prefix once, then every sample's branch) and `cu_seqlens` its
          documents; KDA and MLA layers hand the prefix's state, conv window and keys to the branches
          through it (the same hooks as `context_parallel`). Images in the tree stream's order (none in
          a shared prefix: learner/data.py stops sharing before one); no cache or context parallelism.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"packed cu_seqlens needs batch 1 (one flat token stream), got batch {B}")
        if context_parallel is not None and (cu_seqlens is None or cache is not None or images is not None):
            raise ValueError(
                "context_parallel splits one packed sequence for training: pass cu_seqlens (the whole sequence's "
                "document boundaries), and no cache or images (the vision tower does not run context-parallel; "
                "train image episodes without it)"
            )
        if prefix_tree is not None and (context_parallel is not None or cache is not None
                                        or cu_seqlens is None or T != prefix_tree.num_tokens):
            raise ValueError("prefix_tree runs a packed tree stream for training: pass its cu_seqlens and tokens, and "
                             "no cache or context_parallel (images: in the tree stream's order)")
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"the cache holds {cache.batch_size} sequences but input_ids has batch {B}")
        n_moe, k = len(self.moe_layer_ids), self.config.num_experts_per_token
        if routed_experts is not None and tuple(routed_experts.shape) != (B, T, n_moe, k):
            raise ValueError(
                f"routed_experts must be [B, T, n_moe_layers, k] = {(B, T, n_moe, k)}, got {tuple(routed_experts.shape)}"
            )

        if token_mask is not None and tuple(token_mask.shape) != (B, T):
            raise ValueError(f"token_mask must be [B, T] = {(B, T)}, got {tuple(token_mask.shape)}")
        qb_mask = token_mask.reshape(-1).bool() if token_mask is not None else None
        h = self.model.embed_tokens(input_ids)
        placeholder = self.config.media_placeholder_token_id
        if images is not None:
            media = self.as_media(images)
            h = merge_media_embeddings(h, input_ids, self.encode_media(media), media, placeholder)
        elif bool((host_copy(input_ids) == placeholder).any()):  # no wait for ids copied from the host
            raise ValueError(
                f"input_ids contain media placeholder tokens (id {placeholder}) but no images were given"
            )

        use_ckpt = self.gradient_checkpointing and torch.is_grad_enabled() and cache is None
        accumulate_qb = not self.qb_frozen and self.training
        step = cache.decode_step(T) if cache is not None else None
        bank, partial = [], h
        routes: list[torch.Tensor] = []
        mixing = context_parallel if context_parallel is not None else prefix_tree  # what KDA and MLA layers call
        for layer in self.model.layers:
            entry = cache.layer(layer.layer_idx) if cache is not None else None
            replay = None
            if routed_experts is not None and layer.is_moe:
                replay = routed_experts[:, :, len(routes)].reshape(B * T, k)
            if use_ckpt:
                bank, partial, routing = checkpoint(layer, bank, partial, cu_seqlens, None, None, replay,
                                                    mixing, use_reentrant=False)
            else:
                bank, partial, routing = layer(bank, partial, cu_seqlens, entry, step, replay, mixing)
            if routing is not None:
                routes.append(routing.topk_idx)
                if accumulate_qb:  # outside checkpointing: a recompute never counts twice
                    layer.mlp.qb_accumulate(routing, qb_mask)

        out_sources = bank + [partial]
        self.final_source_count = len(out_sources)
        out_query = query_vector(self.model.output_attn_res_proj, self.model.output_attn_res_norm)
        hidden = aggregate(out_sources, out_query, self.config.rms_norm_eps, self.config.kernel_backend)
        hidden = self.model.norm(hidden)
        if targets is not None:
            if tuple(targets.shape) != (B, T):
                raise ValueError(f"targets must be [B, T] = {(B, T)}, got {tuple(targets.shape)}")
            logp, entropy = chunked_token_logprobs(hidden.reshape(B * T, -1), self.lm_head.weight,
                                                   targets.reshape(-1), logprob_chunk_tokens, temperature)
            out = (logp.view(B, T), entropy.view(B, T))
            if distill_from:
                out += (torch.stack([chunked_reverse_kl(hidden.reshape(B * T, -1), self.lm_head.weight,
                                                        t_hidden.reshape(B * T, -1), t_weight,
                                                        logprob_chunk_tokens, temperature)
                                     for t_hidden, t_weight in distill_from]).view(-1, B, T),)
        elif return_hidden:
            out = hidden
        else:
            out = self.lm_head(hidden)
        if cache is not None:
            cache.advance(T)
        if return_routing:
            routing_ids = torch.stack(routes, dim=1).reshape(B, T, len(routes), k) if routes else None
            return out, routing_ids
        return out


__all__ = ["K3ForCausalLM", "K3DecoderLayer", "K3Model", "FP32_PARAM_SUFFIXES", "Routing"]
