"""GPU path of ``causal_attention``: PyTorch's fused SDPA kernels (a documented choice).

The default GPU path (``model.overrides.attention_kernel: sdpa``; ``triton_flash.py`` is the opt-in Triton
kernel for packed documents: slower than SDPA on packed documents on an H100, 4x faster on a shared prefix). Without autocast, ``causal_attention`` upcasts q, k,
v to fp32 and SDPA's memory-efficient kernel computes scores, softmax and the output tile in fp32
(docs/model.md §3.3), in O(T) memory. Under the learner's bf16 autocast, autocast hands SDPA bf16
inputs and it runs the flash (cuDNN) kernels: bf16 tensor cores, softmax in fp32 inside, a bf16
output that the model widens at the gate. Packed documents run as a right-padded batch under the
plain causal mask (no per-document key mask: see ``causal_attention_sdpa``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import document_index, pad_documents, unpad_documents
from .reference import attention_mask


def causal_attention_sdpa(q, k, v, scale, cu_seqlens=None, kv_lengths=None):
    """Same contract as ``causal_attention``; returns fp32 [B, T, H, Dv] (under autocast, its dtype)."""
    if cu_seqlens is not None:
        # Packed documents -> a right-padded batch [N, T_max]. The causal mask alone is exact for every
        # real row: query i < len(doc) sees keys j <= i, all real; a padding row sees padding keys (zeros,
        # finite scores) and is dropped by the unpad, so its gradient is zero. No key-length mask: with
        # `is_causal` the fused kernel skips the blocks above the diagonal (half the work) and reads no
        # [N, 1, T_max, T_max] mask.
        idx = document_index(cu_seqlens)
        qp, kp, vp = (_fp32(pad_documents(x, cu_seqlens, idx)).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
        return unpad_documents(o.transpose(1, 2), cu_seqlens, idx)
    B, T, H, _ = q.shape
    S = k.shape[1]
    qf, kf, vf = (_fp32(x).transpose(1, 2) for x in (q, k, v))  # [B, H, T|S, D] fp32
    if kv_lengths is None:
        if S == T:
            o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
        else:  # queries are the last T positions: causal mask aligned bottom-right
            # deferred: torch.nn.attention.bias imports torch._dynamo (about 1 s in every process that imports the model)
            from torch.nn.attention.bias import causal_lower_right

            o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=causal_lower_right(T, S), scale=scale)
        return o.transpose(1, 2)
    mask = attention_mask(B, T, S, q.device, None, kv_lengths)  # [B, 1, T, S]
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    o = torch.where(mask.any(-1, keepdim=True), o, torch.zeros_like(o))  # rows with no key: 0, not NaN
    return o.transpose(1, 2)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 for the fp32 kernel; under autocast as it is: autocast casts SDPA's inputs to its own
    dtype anyway, so a widened copy would be cast straight back (the same bits, two copies more)."""
    return x if torch.is_autocast_enabled(x.device.type) else x.float()
