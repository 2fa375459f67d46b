"""Gated MLA with NoPE (docs/model.md §3, §10.6): naive == absorbed, eps placement, packing, decode
cache."""

from __future__ import annotations

import pytest
import torch

from k3rl.model import K3Config
from k3rl.model.mla import DecodeStep, GatedMLA, MLACacheEntry


def make_mla(seed=0, eps=1e-6, std=0.2) -> GatedMLA:
    torch.manual_seed(seed)
    c = K3Config.preset("k3-tiny").model_copy(update={"mla_layernorm_eps": eps})
    layer = GatedMLA(c, 3)
    for p in layer.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, 0.0, std)
        else:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return layer


def reference_mla(layer: GatedMLA, x: torch.Tensor, eps: float) -> torch.Tensor:
    """§3.2 written out: per-head 192-d q, k (nope + shared 64-d slice, no rotation), causal softmax, gate."""
    B, T, _ = x.shape
    H, dn, dr, dv, r = layer.num_heads, layer.nope_dim, layer.rope_dim, layer.v_dim, layer.kv_rank

    def rms(t, w):
        return w * t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps)

    q = (rms(x @ layer.q_a_proj.weight.T, layer.q_a_layernorm.weight) @ layer.q_b_proj.weight.T).reshape(B, T, H, dn + dr)
    ckv = x @ layer.kv_a_proj_with_mqa.weight.T
    c, kx = rms(ckv[..., :r], layer.kv_a_layernorm.weight), ckv[..., r:]
    kv = (c @ layer.kv_b_proj.weight.T).reshape(B, T, H, dn + dv)
    k = torch.cat([kv[..., :dn], kx[:, :, None].expand(B, T, H, dr)], -1)
    v = kv[..., dn:]
    s = torch.einsum("bthd,bshd->bhts", q, k) * (dn + dr) ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, H * dv)
    return (torch.sigmoid(x @ layer.g_proj.weight.T) * o) @ layer.o_proj.weight.T


def test_forward_matches_spec_reference_and_eps_matters():
    layer = make_mla(std=0.02)  # small activations: the norm eps is visible
    x = torch.randn(2, 13, 128) * 0.1
    with torch.no_grad():
        out = layer(x)
        torch.testing.assert_close(out, reference_mla(layer, x, 1e-6), atol=1e-6, rtol=1e-5)
        assert (out - reference_mla(layer, x, 1e-5)).abs().max() > 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_absorbed_equals_naive(dtype, tol):
    layer = make_mla().to(dtype)
    x = torch.randn(2, 17, 128).to(dtype)
    with torch.no_grad():
        q, lat = layer.queries(x), layer.latent(x)
        naive = layer.naive_attention(q, lat)
        causal = torch.ones(17, 17, dtype=torch.bool).tril().expand(2, 17, 17)
        absorbed = layer.absorbed_attention(q, lat, causal)
    assert naive.dtype == torch.float32 and absorbed.dtype == torch.float32  # fp32 attention output
    torch.testing.assert_close(absorbed, naive, atol=tol, rtol=tol)


def test_decode_with_latent_cache_equals_full_forward():
    layer = make_mla()
    x = torch.randn(2, 11, 128)
    cache = MLACacheEntry(torch.zeros(2, 0, layer.kv_rank + layer.rope_dim))
    with torch.no_grad():
        outs = [layer(x[:, :6], cache=cache, step=DecodeStep(torch.zeros(2, dtype=torch.int64), True, 6))]
        for t in range(6, 11):
            step = DecodeStep(torch.full((2,), t, dtype=torch.int64), False, t + 1)
            outs.append(layer(x[:, t : t + 1], cache=cache, step=step))
        full = layer(x)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)
    # the cache holds exactly [c | kx] per token: kv_lora_rank + qk_rope_head_dim values
    assert cache.latent.shape[-1] == layer.kv_rank + layer.rope_dim
    torch.testing.assert_close(cache.latent[:, :11], layer.latent(x))


def test_packed_documents_use_block_diagonal_masks():
    layer = make_mla()
    x = torch.randn(1, 20, 128)
    cu = torch.tensor([0, 7, 20])
    with torch.no_grad():
        packed = layer(x, cu_seqlens=cu)
        sep = torch.cat([layer(x[:, :7]), layer(x[:, 7:])], 1)
    torch.testing.assert_close(packed, sep, atol=1e-6, rtol=1e-5)
