"""Packed <-> padded layouts for the PyTorch references.

A packed batch is one stream [1, T, ...] with document boundaries `cu_seqlens` [N+1].
The references run faster on a padded batch [N, T_max, ...] (one batched op instead of a
Python loop over documents); zero padding at the end of a document is inert for KDA
(k = v = q = 0, g = 0, beta = 0 leave the state unchanged) and masked for attention.
"""

from __future__ import annotations

import torch


def doc_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)


def pad_documents(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1, T, *rest] packed -> [N, T_max, *rest] right-padded with zeros."""
    lengths = doc_lengths(cu_seqlens)
    n, t_max = lengths.numel(), int(lengths.max()) if lengths.numel() else 0
    out = x.new_zeros((n, t_max, *x.shape[2:]))
    idx = _scatter_index(cu_seqlens, t_max)
    out.view(n * t_max, *x.shape[2:])[idx] = x[0]
    return out


def unpad_documents(y: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N, T_max, *rest] -> [1, T, *rest] packed (inverse of `pad_documents`)."""
    n, t_max = y.shape[:2]
    idx = _scatter_index(cu_seqlens, t_max)
    return y.reshape(n * t_max, *y.shape[2:])[idx].unsqueeze(0)


def _scatter_index(cu_seqlens: torch.Tensor, t_max: int) -> torch.Tensor:
    """Flat padded index of every packed position: doc * t_max + (pos - start of doc)."""
    cu = cu_seqlens.to(torch.long)
    T = int(cu[-1])
    pos = torch.arange(T, device=cu.device)
    doc = torch.searchsorted(cu[1:], pos, right=True)
    return doc * t_max + (pos - cu[doc])
