"""q/k L2 normalisation (and the query scale) as one Triton pass forward and one backward.

    y = scale * x * r,  r = 1 / sqrt(sum_c x_c^2 + eps)          (per head row of K channels)
    dx = scale * r * (dy - x r^2 (x . dy))
Only x and r (fp32, one per row) are kept for backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only
from .gate import L2NORM_EPS


@triton.jit(do_not_specialize=["n_rows"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def l2norm_fwd_kernel(
    x, y, rstd, n_rows, scale, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m = (rows < n_rows)[:, None] & (cols < K)[None, :]
    off = rows[:, None].to(tl.int64) * K + cols[None, :]
    b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + EPS)  # r = (sum x^2 + eps)^-1/2
    tl.store(rstd + rows, r, mask=rows < n_rows)
    tl.store(y + off, (b_x * (r * scale)[:, None]).to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def l2norm_bwd_kernel(x, rstd, dy, dx, n_rows, scale, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m = (rows < n_rows)[:, None] & (cols < K)[None, :]
    off = rows[:, None].to(tl.int64) * K + cols[None, :]
    b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
    r = tl.load(rstd + rows, mask=rows < n_rows, other=0.0)
    xdy = tl.sum(b_x * b_dy, axis=1)
    d = scale * r[:, None] * (b_dy - b_x * (r * r * xdy)[:, None])  # s r (dy - x r^2 (x . dy))
    tl.store(dx + off, d.to(dx.dtype.element_ty), mask=m)


class L2NormScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        xc = x.contiguous()
        K = x.shape[-1]
        n = xc.numel() // K
        y = torch.empty_like(xc)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        BK = triton.next_power_of_2(K)
        BR = max(1, 4096 // BK)
        l2norm_fwd_kernel[(triton.cdiv(n, BR),)](
            xc, y, rstd, n, float(scale), K=K, BK=BK, BR=BR, EPS=L2NORM_EPS
        )
        ctx.save_for_backward(xc, rstd)
        ctx.scale = float(scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        return l2norm_scale_bwd(x, rstd, dy, ctx.scale), None


def l2norm_scale_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    """dx of y = scale * x * r from x, r (fp32, one per row) and dy; dx in x's dtype."""
    K = x.shape[-1]
    n = x.numel() // K
    dx = torch.empty_like(x)
    BK = triton.next_power_of_2(K)
    BR = max(1, 4096 // BK)
    l2norm_bwd_kernel[(triton.cdiv(n, BR),)](x, rstd, dy.contiguous(), dx, n, float(scale), K=K, BK=BK, BR=BR)
    return dx


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def l2norm_scale_triton(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * x / sqrt(sum x^2 + 1e-6)`` over the last dim, output in x's dtype."""
    return L2NormScale.apply(x, scale)
