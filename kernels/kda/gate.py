"""KDA decay gate and the q/k L2 normalisation (docs/model.md §2.2 steps 4 and 7, §2.3).

Both run in fp32 (fp64 when given fp64) whatever the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # inside the square root: x / sqrt(sum x^2 + eps)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 when any input is fp64 (exactness tests), fp32 otherwise."""
    return (
        torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    )


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Per-head L2 normalisation over the last dim, in fp32: ``x / sqrt(sum x^2 + eps)``."""
    xf = x.to(compute_dtype(x))
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)


def kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = -5.0,
) -> torch.Tensor:
    """Log-decay ``g`` [B, T, H, K] from the raw gate logit ``z`` [B, T, H, K].

    ``A_log`` is [H] (one per head), ``dt_bias`` is [H*K] or [H, K] (one per channel).

    - K3 lower-bounded form (``lower_bound`` = g_min, e.g. -5):
      ``g = g_min * sigmoid(exp(A_log) * (z + dt_bias))``, so g in (g_min, 0).
    - Kimi Linear / Mamba-2 form (``lower_bound=None``):
      ``g = -exp(A_log) * softplus(z + dt_bias)``, unbounded below.
    """
    if z.dim() != 4:
        raise ValueError(f"kda_gate: z must be [B, T, H, K], got shape {tuple(z.shape)}")
    H, K = z.shape[-2], z.shape[-1]
    if A_log is None:
        raise ValueError("kda_gate: A_log [H] is required when the gate is computed in the kernel")
    if A_log.numel() != H:
        raise ValueError(f"kda_gate: A_log must have H={H} elements, got shape {tuple(A_log.shape)}")
    dt = compute_dtype(z, A_log, dt_bias)
    zf = z.to(dt)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(
                f"kda_gate: dt_bias must have H*K={H * K} elements, got shape {tuple(dt_bias.shape)}"
            )
        zf = zf + dt_bias.to(dt).reshape(H, K)  # z = z~ + dt_bias
    a = A_log.to(dt).reshape(H, 1).exp()  # e^{A_h}, broadcast over channels
    if lower_bound is None:
        return -a * F.softplus(zf)  # g = -e^A softplus(z)
    if not lower_bound < 0:
        raise ValueError(f"kda_gate: lower_bound must be negative (the K3 value is -5), got {lower_bound}")
    return lower_bound * torch.sigmoid(a * zf)  # g = g_min * sigmoid(e^A z)
