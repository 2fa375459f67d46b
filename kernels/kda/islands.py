"""The fp32 islands around the KDA recurrence (docs/model.md §2): the short convolution and the
output norm + gate, each as a PyTorch reference, a fused Triton kernel and a dispatcher.

K3 report §2 (the precision contract): the convolution is computed in fp32 with the fp32 weights
and stored in the activation dtype; the output RMSNorm and sigmoid gate are computed in fp32 and
cast. The references widen whole tensors to fp32; the kernels read the activation dtype, compute
in fp32 registers and store the result, with no fp32 tensor in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._backend import resolve_backend

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def short_conv_reference(x, weight, left=None, cu_seqlens=None):
    """Causal depthwise conv + SiLU, in fp32 with fp32 weights, result in x's dtype.

    y_t[c] = SiLU( sum_{j=0..W-1} w[c, j] * x_{t-W+1+j}[c] ), the W-1 rows before each sequence's
    first token taken from `left` (zeros without it). x [B, T, C], weight [C, 1, W].
    `left`: [B, W-1, C] one window a row (decoding: the cached previous projections), or with
    `cu_seqlens` [N, W-1, C] one a document (a branch forked from a shared prefix: the prefix's last
    W-1 rows); differentiable. Returns (y [B, T, C], the new left context: the last W-1 rows of each
    row's [left ; x], [B, W-1, C], or of each document's, [N, W-1, C], with cu_seqlens).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    with torch.autocast(device_type=x.device.type, enabled=False):  # really fp32 under autocast
        w = weight.float()
        if cu_seqlens is None:
            before = x.new_zeros(B, W - 1, C) if left is None else left.to(x.dtype)
            xx = torch.cat([before, x], dim=1)  # [B, W-1+T, C]
            y = F.conv1d(xx.float().transpose(1, 2), w, groups=C).transpose(1, 2)
            tail = xx[:, xx.shape[1] - (W - 1) :]
        else:  # packed documents: each starts from its own left window (zeros without one)
            pieces, tails = [], []
            bounds = cu_seqlens.tolist()
            for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                before = x.new_zeros(B, W - 1, C) if left is None else left[n : n + 1].to(x.dtype)
                doc = torch.cat([before, x[:, bos:eos]], dim=1)  # [1, W-1+L, C]
                pieces.append(F.conv1d(doc.float().transpose(1, 2), w, groups=C).transpose(1, 2))
                tails.append(doc[:, doc.shape[1] - (W - 1) :])
            y = torch.cat(pieces, dim=1)
            tail = torch.cat(tails) if tails else x.new_zeros(0, W - 1, C)
        y = F.silu(y).to(x.dtype)
    return y, tail


def document_windows(x, left, cu_seqlens, W):
    """[N, W-1, C]: the last W-1 rows of each document's [left_n ; x_doc] (left None: zeros), by one
    gather on the device (no host read of cu_seqlens). x [1, T, C], left [N, W-1, C] or None."""
    C = x.shape[-1]
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    N = cu.numel() - 1
    left = x.new_zeros(N, W - 1, C) if left is None else left.to(x.dtype)
    rows = torch.cat([left.reshape(N * (W - 1), C), x[0]])  # the windows' rows, then the tokens'
    j = cu[1:, None] - (W - 1) + torch.arange(W - 1, device=x.device)  # [N, W-1] token index of each row
    from_left = torch.arange(N, device=x.device)[:, None] * (W - 1) + (W - 1) + (j - cu[:-1, None])
    return rows[torch.where(j >= cu[:-1, None], N * (W - 1) + j, from_left)]


def short_conv(x, weight, left=None, cu_seqlens=None, backend="auto"):
    """``short_conv_reference``'s result, by the Triton kernel (``triton_short_conv.py``) on CUDA.

    The kernel covers fp32 / bf16 / fp16 activations, packed documents and a ``left`` window per row or
    per document, with its gradient; anything else runs the reference on every backend.
    Returns (y [B, T, C] in x's dtype, the last W - 1 rows of each row's (or document's) [left ; x]).
    """
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[0] != x.shape[-1] or weight.shape[1] != 1:
        raise ValueError(
            f"short_conv: x must be [B, T, C] and weight [C, 1, W]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if cu_seqlens is not None and cu_seqlens.dim() != 1:
        raise ValueError(f"short_conv: cu_seqlens must be 1-D [N+1]; got shape {tuple(cu_seqlens.shape)}")
    W = weight.shape[-1]
    rows = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if left is not None and left.shape != (rows, W - 1, x.shape[2]):
        what = "[B, W-1, C]" if cu_seqlens is None else "[N, W-1, C] (one window a document of cu_seqlens)"
        raise ValueError(f"short_conv: left must be {what} = {(rows, W - 1, x.shape[2])}; got {tuple(left.shape)}")
    path = resolve_backend(backend, "short_conv", x, weight, left, cu_seqlens)
    if x.dtype not in TRITON_DTYPES:
        path = "torch"
    if path == "torch":
        return short_conv_reference(x, weight, left, cu_seqlens)
    # lazy: triton (Linux only) loads on the first GPU call
    from .triton_short_conv import short_conv_decode, short_conv_triton

    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, left))
    if left is not None and cu_seqlens is None and x.shape[1] == 1 and W >= 2 and not grads:
        return short_conv_decode(x, weight, left)  # a decode step: y and the next left context in one kernel
    if cu_seqlens is not None:
        tail = document_windows(x, left, cu_seqlens, W)
    else:
        before = x.new_zeros(x.shape[0], W - 1, x.shape[2]) if left is None else left.to(x.dtype)
        tail = torch.cat([before[:, min(x.shape[1], W - 1) :], x[:, max(0, x.shape[1] - (W - 1)) :]], dim=1)
    return short_conv_triton(x, weight, cu_seqlens, left), tail


def output_norm_gate_reference(o, g, weight, eps, out_dtype=None):
    """RMSNorm over o's last dim (fp32 statistic, fp32 weight [D]) times sigmoid(g), computed in
    fp32 and returned in ``out_dtype`` (default o's dtype). o, g [..., D] of one shape."""
    with torch.autocast(device_type=o.device.type, enabled=False):
        of = o.float()
        normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (normed * torch.sigmoid(g.float())).to(out_dtype or o.dtype)


def output_norm_gate(o, g, weight, eps, out_dtype=None, backend="auto"):
    """``output_norm_gate_reference``'s result, by the Triton kernel (``triton_output_gate.py``) on CUDA."""
    if o.shape != g.shape or weight.shape != o.shape[-1:]:
        raise ValueError(
            f"output_norm_gate: o and g must have one shape [..., D] and weight [D]; got o {tuple(o.shape)}, "
            f"g {tuple(g.shape)}, weight {tuple(weight.shape)}"
        )
    out_dtype = out_dtype or o.dtype
    path = resolve_backend(backend, "output_norm_gate", o, g, weight)
    if path == "triton" and {o.dtype, g.dtype, out_dtype} <= set(TRITON_DTYPES):
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_output_gate import output_norm_gate_triton

        return output_norm_gate_triton(o, g, weight, eps, out_dtype)
    return output_norm_gate_reference(o, g, weight, eps, out_dtype)
