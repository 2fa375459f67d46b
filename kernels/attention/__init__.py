"""Causal attention with fp32 output for Gated MLA (docs/model.md §3.2-3.3): reference, fused GPU path
(SDPA), dispatcher."""

from __future__ import annotations

from .._backend import resolve_backend
from ..varlen import host_offsets
from .reference import attention_mask, causal_attention_reference
from .sdpa import causal_attention_sdpa

HAS_TRITON_ATTENTION = True  # the fast GPU path is PyTorch SDPA in fp32 (see sdpa.py)


def _check(q, k, v, cu_seqlens, kv_lengths):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"causal_attention: q, k, v must be [B, T|S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, T, H, D = q.shape
    S = k.shape[1]
    if k.shape != (B, S, H, D) or v.shape[:3] != (B, S, H):
        raise ValueError(
            f"causal_attention: expected k [B={B}, S, H={H}, D={D}] and v [B, S, H, Dv]; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if S < T:
        raise ValueError(
            f"causal_attention: need at least as many keys as queries (S >= T), got S={S}, T={T}"
        )
    if cu_seqlens is not None:
        if B != 1 or S != T:
            raise ValueError(
                f"causal_attention: cu_seqlens needs a packed batch (B=1) with S == T; got B={B}, T={T}, S={S}"
            )
        cs = host_offsets(cu_seqlens)  # read from the device once per tensor, not once per layer
        if cs[0] != 0 or cs[-1] != T:
            raise ValueError(f"causal_attention: cu_seqlens must start at 0 and end at T={T}; got {cs}")
    if kv_lengths is not None and kv_lengths.shape != (B,):
        raise ValueError(f"causal_attention: kv_lengths must be [B={B}], got {tuple(kv_lengths.shape)}")


def causal_attention(q, k, v, scale, cu_seqlens=None, kv_lengths=None, backend="auto"):
    """Causal softmax attention, output in fp32.

    q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv] (S >= T: the queries are the last T
    positions, as in chunked prefill or decode against a cache). ``cu_seqlens`` [N+1] makes
    the mask block-diagonal per document (B = 1, S = T); ``kv_lengths`` [B] masks keys at
    positions >= kv_lengths[b] (right-padded batches). Scores and softmax are fp32; returns
    o [B, T, H, Dv] in fp32 (docs/model.md §3.3: cast to bf16 only at the o_proj input).
    ``backend="triton"`` (the CUDA default) is not a Triton kernel: it is PyTorch's fused SDPA on
    fp32 inputs (``sdpa.py`` says why); "torch" is the explicit reference.
    """
    _check(q, k, v, cu_seqlens, kv_lengths)
    path = resolve_backend(backend, "causal_attention", q, k, v, has_triton=HAS_TRITON_ATTENTION)
    if path == "triton":
        return causal_attention_sdpa(q, k, v, scale, cu_seqlens, kv_lengths)
    return causal_attention_reference(q, k, v, scale, cu_seqlens, kv_lengths)


__all__ = ["attention_mask", "causal_attention", "causal_attention_reference"]
