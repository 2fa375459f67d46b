"""RMSNorm as the model computes it (docs/model.md §0): reference, fused Triton kernel, dispatcher.

    r = 1 / sqrt(mean_d(x^2) + eps)        fp32 statistic
    n = (x r) in x's dtype                 the normalised row, cast down first
    y = w n   in x's dtype                 gamma multiplies after the downcast (w cast to x's dtype)

Eager PyTorch spends about eight kernels on one norm (widen, square, mean, add, rsqrt, multiply,
narrow, scale): 88 of them per decode step of k3-small. The kernel is one pass forward and one
backward (the fp32 r of each row kept for it).
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TRITON_D = 16384


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w (x / sqrt(mean(x^2) + eps)) by PyTorch ops, outside autocast (the statistic stays fp32)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight.to(x.dtype) * normed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """``rms_norm_reference``'s result, by the Triton kernel on CUDA (``backend`` as in
    ``kernels/_backend.py``) for fp32 / bf16 / fp16 rows of at most 16,384; the reference otherwise."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight must be [d] = [{x.shape[-1]}] (x's last dim); got {tuple(weight.shape)}"
        )
    path = resolve_backend(backend, "rms_norm", x, weight)
    if path == "triton" and x.dtype in TRITON_DTYPES and 0 < x.shape[-1] <= MAX_TRITON_D and x.numel() > 0:
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_rmsnorm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


__all__ = ["rms_norm", "rms_norm_reference"]
