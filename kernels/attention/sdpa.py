"""GPU path of ``causal_attention``: PyTorch's fused SDPA kernels on fp32 inputs (a documented choice).

We do not ship a Triton flash-attention kernel. On CUDA, ``causal_attention`` upcasts q, k, v to
fp32 and calls ``torch.nn.functional.scaled_dot_product_attention``, whose memory-efficient kernel
accepts fp32: scores, softmax and the output tile are fp32 (docs/model.md §3.3) and memory is O(T),
not the O(T^2) score matrix of the reference. The price is fp32 arithmetic instead of bf16
tensor cores; a bf16-input kernel with an fp32 output tile would be faster and is not written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..varlen import doc_lengths, pad_documents, unpad_documents
from .reference import attention_mask


def causal_attention_sdpa(q, k, v, scale, cu_seqlens=None, kv_lengths=None):
    """Same contract as ``causal_attention``; returns fp32 [B, T, H, Dv]."""
    if cu_seqlens is not None:
        # packed documents -> a right-padded batch with per-document key lengths
        o = causal_attention_sdpa(
            *(pad_documents(x, cu_seqlens) for x in (q, k, v)), scale, kv_lengths=doc_lengths(cu_seqlens)
        )
        return unpad_documents(o, cu_seqlens)
    B, T, H, _ = q.shape
    S = k.shape[1]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, H, T|S, D] fp32
    if kv_lengths is None:
        if S == T:
            o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
        else:  # queries are the last T positions: causal mask aligned bottom-right
            o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=causal_lower_right(T, S), scale=scale)
        return o.transpose(1, 2)
    mask = attention_mask(B, T, S, q.device, None, kv_lengths)  # [B, 1, T, S]
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    o = torch.where(mask.any(-1, keepdim=True), o, torch.zeros_like(o))  # rows with no key: 0, not NaN
    return o.transpose(1, 2)
