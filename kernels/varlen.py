"""Packed <-> padded layouts for the PyTorch references.

A packed batch is one stream [1, T, ...] with document boundaries `cu_seqlens` [N+1].
The references run faster on a padded batch [N, T_max, ...] (one batched op instead of a
Python loop over documents); zero padding at the end of a document is inert for KDA
(k = v = q = 0, g = 0, beta = 0 leave the state unchanged) and masked for attention.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

# The layers of one forward share one cu_seqlens tensor: its values are read to the host once (or
# handed over by whoever built it on the host: `remember_host_offsets`) and kept while that tensor
# lives and is not modified in place. A read of a CUDA tensor makes the host wait for the GPU, which
# then idles while the host launches the next kernels: once per layer was ~50 waits a k3-small step.
_HOST = WeakTensorKeyDictionary()


def host_offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """`cu_seqlens.tolist()`, read from the device at most once per tensor."""
    hit = _HOST.get(cu_seqlens)
    if hit is not None and hit[0] == cu_seqlens._version:
        return hit[1]
    offsets = cu_seqlens.tolist()
    _HOST[cu_seqlens] = (cu_seqlens._version, offsets)
    return offsets


def remember_host_offsets(cu_seqlens: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """Record the host values of a cu_seqlens tensor copied from the host (no device read later)."""
    _HOST[cu_seqlens] = (cu_seqlens._version, list(offsets))
    return cu_seqlens


_COPIES = WeakTensorKeyDictionary()


def remember_host_copy(t: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """Record the host tensor a device tensor was copied from (read on the host later, no wait). A CPU
    tensor is its own host copy: nothing is recorded (an entry holding its own key would never be freed)."""
    if t.device.type != "cpu":
        _COPIES[t] = (t._version, host)
    return t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host: itself on the CPU, the copy handed over by `remember_host_copy` while `t` is
    not modified in place, else read from the device (the host waits)."""
    if t.device.type == "cpu":
        return t
    hit = _COPIES.get(t)
    if hit is not None and hit[0] == t._version:
        return hit[1]
    return t.cpu()


def doc_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)


def pad_documents(x: torch.Tensor, cu_seqlens: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """[1, T, *rest] packed -> [N, T_max, *rest] right-padded with zeros. `idx`: `document_index`'s
    result, when the caller pads several tensors of the same documents."""
    n, t_max = _padded_shape(cu_seqlens)
    idx = _scatter_index(cu_seqlens, t_max) if idx is None else idx
    return _Pad.apply(x[0], idx, n * t_max).view(n, t_max, *x.shape[2:])


def unpad_documents(y: torch.Tensor, cu_seqlens: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """[N, T_max, *rest] -> [1, T, *rest] packed (inverse of `pad_documents`)."""
    n, t_max = y.shape[:2]
    idx = _scatter_index(cu_seqlens, t_max) if idx is None else idx
    return _Pad.apply(y.reshape(n * t_max, *y.shape[2:]), idx, None).unsqueeze(0)


def document_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The flat padded index of every packed position (what `pad_documents` scatters by)."""
    return _scatter_index(cu_seqlens, _padded_shape(cu_seqlens)[1])


def _padded_shape(cu_seqlens: torch.Tensor) -> tuple[int, int]:
    """(documents, longest document) of a packed batch, from cu_seqlens' host values."""
    cs = host_offsets(cu_seqlens)
    return len(cs) - 1, max((b - a for a, b in zip(cs[:-1], cs[1:], strict=True)), default=0)


class _Pad(torch.autograd.Function):
    """rows = n_rows given: zeros[n_rows] with out[idx] = x (pad); None: x[idx] (unpad). The indices are
    distinct, so each direction's gradient is the other direction: a gather or a plain scatter, never
    the sorting accumulate that autograd gives an index's backward."""

    @staticmethod
    def forward(ctx, x, idx, rows):
        ctx.save_for_backward(idx)
        ctx.unpad, ctx.rows = rows is None, x.shape[0]
        if rows is None:
            return x[idx]
        out = x.new_zeros((rows, *x.shape[1:]))
        out[idx] = x
        return out

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        if not ctx.unpad:
            return g[idx], None, None  # gradient of a pad: gather the real rows
        out = g.new_zeros((ctx.rows, *g.shape[1:]))  # gradient of an unpad: scatter back to padded rows
        out[idx] = g
        return out, None, None


def _scatter_index(cu_seqlens: torch.Tensor, t_max: int) -> torch.Tensor:
    """Flat padded index of every packed position: doc * t_max + (pos - start of doc)."""
    cu = cu_seqlens.to(torch.long)
    T = host_offsets(cu_seqlens)[-1]
    pos = torch.arange(T, device=cu.device)
    doc = torch.searchsorted(cu[1:], pos, right=True)
    return doc * t_max + (pos - cu[doc])
