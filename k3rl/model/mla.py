"""Gated Multi-head Latent Attention with NoPE (docs/model.md §3).

    c_q   = RMSNorm_1e-6(x Wqa^T);       q = c_q Wqb^T -> [T, H, dn | dr]
    ckv   = x Wkva^T -> c = RMSNorm_1e-6(ckv[:, :r]) [T, r],  kx = ckv[:, r:] [T, dr] (shared, no rotation)
    kv    = c Wkvb^T -> [T, H, dn | dv];  k_h = [k_n,h ; kx],  v_h
    o_h   = softmax(q_h k_h^T / sqrt(dn + dr), causal) v_h       fp32 output
    y     = Wo [ sigmoid(x Wg^T) * o ]                            gate in fp32, cast at o_proj

Training and the first prefill use the naive form through `k3rl.kernels.attention`. With a
decode cache only the normalised latent c and kx are kept per token (§3.4) and attention
runs in absorbed form: q^_h = W_UK,h^T q_n,h, score = (q^_h . c_s + q_x,h . kx_s) * scale,
o_h = W_UV,h sum_s p_s c_s. The two are algebraically identical (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3rl.kernels.attention import causal_attention

from .common import RMSNorm, fp32_island, matmul_input
from .config import K3Config


@dataclass
class DecodeStep:
    """Per-forward decode bookkeeping shared by every MLA layer (computed once, no per-layer syncs).

    lengths [B] tokens cached before this forward (device tensor); fresh: every row is empty;
    max_total: max(lengths) + T, the buffer length this forward needs.
    """

    lengths: torch.Tensor
    fresh: bool
    max_total: int


@dataclass
class MLACacheEntry:
    """Per-layer latent cache: [B, capacity, kv_lora_rank + qk_rope_head_dim] = [c | kx] per token.

    Row b holds `lengths[b]` valid tokens (the lengths live in K3Cache); the rest is padding.
    """

    latent: torch.Tensor


class GatedMLA(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = H = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        self.backend, self.kernel = config.kernel_backend, config.attention_kernel
        self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_layernorm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.mla_layernorm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    # ----- pieces ------------------------------------------------------------------------
    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, dn + dr]: per head 'nope' rows then the 64 extra ('rope') rows, no rotation."""
        B, T, _ = x.shape
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(B, T, self.num_heads, -1)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """[c | kx] [B, T, r + dr]: the normalised latent and the shared key slice (what the cache keeps)."""
        ckv = self.kv_a_proj_with_mqa(x)
        c, kx = ckv.split([self.kv_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        return torch.cat([c, kx.to(c.dtype)], dim=-1)

    def keys_values(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys k_h = [k_n,h ; kx] [B, S, H, dn + dr] and values [B, S, H, dv] from the latent."""
        B, S, _ = lat.shape
        H = self.num_heads
        c, kx = lat.split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c).reshape(B, S, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat([k_nope, kx.unsqueeze(2).expand(B, S, H, self.rope_dim).to(k_nope.dtype)], dim=-1), v

    def naive_attention(self, q: torch.Tensor, lat: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """Materialise k_n, v per head from the latent and call the causal attention op; fp32 [B, T, H, dv]."""
        k, v = self.keys_values(lat)
        return causal_attention(q, k.to(q.dtype), v.to(q.dtype), self.scale, cu_seqlens=cu_seqlens, backend=self.backend,
                                kernel=self.kernel)

    def absorbed_attention(self, q: torch.Tensor, lat: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """Attention on the latent cache with W_UK / W_UV absorbed; fp32 [B, T, H, dv].

        q [B, T, H, dn+dr], lat [B, S, r+dr], key_valid [B, T, S] bool (causal + padding mask).
        """
        H, dn, dv, r = self.num_heads, self.nope_dim, self.v_dim, self.kv_rank
        with fp32_island(q):
            w = self.kv_b_proj.weight.float().reshape(H, dn + dv, r)
            w_uk, w_uv = w[:, :dn], w[:, dn:]  # [H, dn, r], [H, dv, r]
            q_nope, q_x = q.float().split([dn, self.rope_dim], dim=-1)
            c, kx = lat.float().split([r, self.rope_dim], dim=-1)
            q_hat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)  # q^_h = W_UK,h^T q_n,h
            scores = torch.einsum("bthr,bsr->bhts", q_hat, c) + torch.einsum("bthe,bse->bhts", q_x, kx)
            scores = (scores * self.scale).masked_fill(~key_valid[:, None], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            o_hat = torch.einsum("bhts,bsr->bthr", p, c)  # sum_s p_s c_s in latent space
            return torch.einsum("bthr,hvr->bthv", o_hat, w_uv)  # o_h = W_UV,h o^_h

    # ----- forward -------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache: MLACacheEntry | None = None,
        step: DecodeStep | None = None,
        context_parallel=None,
    ) -> torch.Tensor:
        """`context_parallel`: a `learner.context_parallel_layers.ContextParallel`; x is then this
        rank's shard of one packed sequence and `cu_seqlens` the whole sequence's documents: its
        queries attend over the whole sequence's latent (gathered from every rank). A
        `learner.prefix_tree.PrefixTree` comes the same way (x: its tree stream): branches read their
        shared prefix's keys."""
        B, T, _ = x.shape
        x = matmul_input(x)  # three projections read x: cast once under autocast
        q = self.queries(x)
        lat = self.latent(x)
        if context_parallel is not None:
            o = context_parallel.latent_attention(self, q, lat, cu_seqlens)
        elif cache is None:
            o = self.naive_attention(q, lat, cu_seqlens)
        else:
            if cu_seqlens is not None:
                raise ValueError("MLA: packed cu_seqlens and a decode cache cannot be combined")
            if step is None:
                raise ValueError("MLA: decoding with a cache needs the DecodeStep (lengths) of the batch")
            lengths = step.lengths
            write_latent(cache, lat, lengths, step.max_total)
            if step.fresh:  # first prefill: nothing cached before, the naive form is exact and cheaper
                o = self.naive_attention(q, lat)
            else:
                S = cache.latent.shape[1]
                pos = lengths[:, None] + torch.arange(T, device=x.device)  # absolute query positions [B, T]
                key_valid = torch.arange(S, device=x.device)[None, None, :] <= pos[:, :, None]  # [B, T, S]
                o = self.absorbed_attention(q, cache.latent, key_valid)
        gate_logit = self.g_proj(x)
        with fp32_island(x):
            y = torch.sigmoid(gate_logit.float()) * o.reshape(B, T, -1).float()  # gate in fp32 on the fp32 output
        return self.o_proj(y.to(self.o_proj.weight.dtype))


def write_latent(cache: MLACacheEntry, lat: torch.Tensor, lengths: torch.Tensor, need: int) -> None:
    """Write `lat` [B, T, C] at positions lengths[b] .. lengths[b]+T-1 of each row, growing the
    buffer (capacity doubles) so that it holds at least `need` = max(lengths) + T tokens."""
    B, T, C = lat.shape
    cap = cache.latent.shape[1]
    if cache.latent.dtype != lat.dtype or cache.latent.shape[0] != B:
        if cap and cache.latent.shape[0] != B:
            raise ValueError(f"MLA cache holds {cache.latent.shape[0]} sequences, the batch has {B}")
        cache.latent = cache.latent.to(lat.dtype)
    if need > cap:
        new_cap = max(need, 2 * cap, 16)
        grown = lat.new_zeros(B, new_cap, C)
        grown[:, :cap] = cache.latent
        cache.latent = grown
    pos = lengths[:, None] + torch.arange(T, device=lat.device)
    rows = torch.arange(B, device=lat.device)[:, None].expand(B, T)
    cache.latent[rows, pos] = lat.detach()  # the cache is inference state: no autograd history
