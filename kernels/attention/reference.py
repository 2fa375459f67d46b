"""Causal softmax attention in fp32 (docs/model.md §3.2 step 4, §3.3): the PyTorch reference.

scores[i, j] = scale * q_i . k_j for allowed (i, j), softmax in fp32 over j, o_i = sum_j p_ij v_j.
Allowed: j <= i + (S - T) (queries are the last T of S positions), same document when
``cu_seqlens`` is given, j < kv_lengths[b] when ``kv_lengths`` is given. A query row with
no allowed key returns zeros.
"""

from __future__ import annotations

import torch

from ..varlen import doc_lengths, pad_documents, unpad_documents


def document_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] document index of each packed position."""
    pos = torch.arange(T, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(pos.dtype), pos, right=True)


def attention_mask(B, T, S, device, cu_seqlens=None, kv_lengths=None) -> torch.Tensor:
    """Boolean [B, 1, T, S] mask of allowed (query, key) pairs."""
    qpos = torch.arange(T, device=device)[:, None] + (S - T)  # absolute position of each query
    kpos = torch.arange(S, device=device)[None, :]
    mask = (kpos <= qpos)[None, None]  # causal
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens.to(device), S)
        mask = mask & (doc[None, :] == doc[S - T :, None])[None, None]  # block-diagonal per document
    if kv_lengths is not None:
        mask = mask & (kpos[None] < kv_lengths.to(device)[:, None, None])[:, None]  # right padding
    return mask.expand(B, 1, T, S)


def causal_attention_reference(q, k, v, scale, cu_seqlens=None, kv_lengths=None):
    """q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv] -> o [B, T, H, Dv] fp32 (fp64 for fp64)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, _ = q.shape
    S = k.shape[1]
    if cu_seqlens is not None and B == 1 and S == T and kv_lengths is None and cu_seqlens.numel() > 2:
        # packed documents: attend within each one as a padded batch, O(sum T_i^2) not O(T^2)
        o = causal_attention_reference(
            *(pad_documents(x, cu_seqlens) for x in (q, k, v)), scale, kv_lengths=doc_lengths(cu_seqlens)
        )
        return unpad_documents(o, cu_seqlens)
    s = torch.einsum("bthd,bshd->bhts", q.to(dt), k.to(dt)) * scale  # fp32 scores
    mask = attention_mask(B, T, S, q.device, cu_seqlens, kv_lengths)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with no key: avoid inf - inf
    p = (s - m).exp()  # masked entries are exp(-inf) = 0
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("bhts,bshd->bthd", p, v.to(dt))
