"""Causal attention with fp32 output for Gated MLA (docs/model.md §3.2-3.3): reference, fused GPU paths
(SDPA, and for packed documents the Triton flash kernel of triton_flash.py), dispatcher."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from ..varlen import document_index, host_offsets, pad_documents, unpad_documents
from .reference import attention_mask, causal_attention_reference
from .sdpa import causal_attention_sdpa

HAS_TRITON_ATTENTION = True  # the GPU path: PyTorch SDPA (sdpa.py), or the Triton flash kernel (kernel='flash')


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


KERNELS = ("sdpa", "flash")


def _flash(q, k, v, scale, cu_seqlens, k_prefix=None, v_prefix=None):
    """The Triton flash kernel on packed [1, T, ...] inputs (under autocast in its dtype, as SDPA takes them)."""
    # deferred: the Triton kernels compile on first use; a process that never asks for them skips the import
    from .triton_flash import flash_attention

    dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
    q, k, v = (x[0].to(dtype) for x in (q, k, v))
    if k_prefix is not None:
        k_prefix, v_prefix = k_prefix[0].to(dtype), v_prefix[0].to(dtype)
    return flash_attention(q, k, v, scale, cu_seqlens, host_offsets(cu_seqlens), k_prefix, v_prefix)[None]


def _kernel_check(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS} (model.overrides.attention_kernel), got {kernel!r}")


def causal_attention(q, k, v, scale, cu_seqlens=None, kv_lengths=None, backend="auto", kernel="sdpa"):
    """Causal softmax attention, output in fp32.

    q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv] (S >= T: the queries are the last T
    positions, as in chunked prefill or decode against a cache). ``cu_seqlens`` [N+1] makes
    the mask block-diagonal per document (B = 1, S = T); ``kv_lengths`` [B] masks keys at
    positions >= kv_lengths[b] (right-padded batches). Scores and softmax are fp32; returns
    o [B, T, H, Dv] in fp32 (docs/model.md §3.3: cast to bf16 only at the o_proj input).
    ``backend="triton"`` (the CUDA default) is PyTorch's fused SDPA (``sdpa.py``), unless ``kernel="flash"``
    picks the Triton flash kernel (``triton_flash.py``) for packed documents; "torch" is the explicit reference.
    """
    _check(q, k, v, cu_seqlens, kv_lengths)
    _kernel_check(kernel)
    path = resolve_backend(backend, "causal_attention", q, k, v, has_triton=HAS_TRITON_ATTENTION)
    if path == "triton" and kernel == "flash" and cu_seqlens is not None:
        return _flash(q, k, v, scale, cu_seqlens)
    if path == "triton":
        return causal_attention_sdpa(q, k, v, scale, cu_seqlens, kv_lengths)
    return causal_attention_reference(q, k, v, scale, cu_seqlens, kv_lengths)


def shared_prefix_attention(q, k, v, k_prefix, v_prefix, scale, cu_seqlens, backend="auto", kernel="sdpa"):
    """Causal attention of N packed branches that share one prefix (a GRPO group's prompt, its keys and
    values computed once): every query of a branch sees every prefix key and its own branch's keys up to
    its position, as in the whole sequence [prefix ; branch].

    q, k, v [1, T, H, D|Dv]: the branches' tokens, documents `cu_seqlens` [N+1]; k_prefix, v_prefix
    [1, P, H, D|Dv] read by all of them. Runs as one right-padded batch [N, P + T_max] of keys under the
    bottom-right causal mask (query i of a branch sees key j <= P + i; a branch's padding keys lie past
    every real query's reach). The prefix rows are copied once per branch for the call (what the fused
    kernels take); their gradient sums over the branches. ``kernel="flash"`` (on the Triton path) reads the
    prefix in place instead, never copied. Returns o [1, T, H, Dv] fp32, as causal_attention.
    """
    if k_prefix.dim() != 4 or k_prefix.shape[0] != 1 or k_prefix.shape[2:] != k.shape[2:] \
            or v_prefix.shape[:3] != k_prefix.shape[:3] or v_prefix.shape[3] != v.shape[3]:
        raise ValueError(
            f"shared_prefix_attention: k_prefix [1, P, H, D] and v_prefix [1, P, H, Dv] of k {tuple(k.shape)} and "
            f"v {tuple(v.shape)}; got {tuple(k_prefix.shape)}, {tuple(v_prefix.shape)}"
        )
    _check(q, k, v, cu_seqlens, None)
    _kernel_check(kernel)
    if kernel == "flash" and resolve_backend(backend, "shared_prefix_attention", q, k, v, k_prefix) == "triton":
        return _flash(q, k, v, scale, cu_seqlens, k_prefix, v_prefix)
    idx = document_index(cu_seqlens)
    qp, kp, vp = (pad_documents(x, cu_seqlens, idx) for x in (q, k, v))  # [N, T_max, H, *]
    N = qp.shape[0]
    keys = torch.cat([k_prefix.expand(N, -1, -1, -1).to(kp.dtype), kp], dim=1)  # [N, P + T_max, H, D]
    values = torch.cat([v_prefix.expand(N, -1, -1, -1).to(vp.dtype), vp], dim=1)
    o = causal_attention(qp, keys, values, scale, backend=backend)  # queries: the last T_max positions
    return unpad_documents(o, cu_seqlens, idx)


__all__ = ["KERNELS", "attention_mask", "causal_attention", "causal_attention_reference", "shared_prefix_attention"]
