"""Moving routed tokens into and out of the experts' grouped buffer, without index_add or atomics.

Every token n has K routes (n, j) and each route one row pos[n, j] of the padded buffer [M, l] the
grouped expert GEMMs read and write (rows of one expert together; pos is a permutation into it):

    dispatch:  X[pos[n, j]] = z[n]                          backward: dz[n] = sum_j dX[pos[n, j]]
    combine:   u[n] = sum_j w[n, j] Y[pos[n, j]]            backward: dY[pos[n, j]] = w[n, j] du[n]
                 (fp32 sum, stored in u's dtype)                       dw[n, j]     = du[n] . Y[pos[n, j]]

Both directions of both ops are one gather-and-sum (`gather_sum_kernel`) or one scatter of
distinct rows (`scatter_rows_kernel`): a program takes BN tokens, and their K rows are read or
written once. As PyTorch indexing the same work was a gather whose backward is a sorting
index_put, and an fp32 index_add over the widened [N K, l] outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only

BN = 4  # tokens a program


@triton.jit(do_not_specialize=["N"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def gather_sum_kernel(Y, pos, w, out, N, L, K: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr,
                      HAS_W: tl.constexpr):  # fmt: skip
    """out[n] = sum_j w[n, j] Y[pos[n, j]] (w = 1 without HAS_W), summed in fp32."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    c = tl.arange(0, BL)
    mn, mc = n < N, c < L
    acc = tl.zeros([BN, BL], dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos + n * K + j, mask=mn, other=0).to(tl.int64)
        y = tl.load(Y + (p * L)[:, None] + c[None, :], mask=mn[:, None] & mc[None, :], other=0.0).to(tl.float32)
        if HAS_W:
            y *= tl.load(w + n * K + j, mask=mn, other=0.0).to(tl.float32)[:, None]
        acc += y
    ptr = out + (n.to(tl.int64) * L)[:, None] + c[None, :]
    tl.store(ptr, acc.to(out.dtype.element_ty), mask=mn[:, None] & mc[None, :])


@triton.jit(do_not_specialize=["N"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def scatter_rows_kernel(src, pos, w, X, Y, dw, N, L, K: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr,
                        HAS_W: tl.constexpr):  # fmt: skip
    """X[pos[n, j]] = w[n, j] src[n] (src[n] without HAS_W); with HAS_W also dw[n, j] = src[n] . Y[pos[n, j]]."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    c = tl.arange(0, BL)
    mn, mc = n < N, c < L
    m = mn[:, None] & mc[None, :]
    s = tl.load(src + (n.to(tl.int64) * L)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos + n * K + j, mask=mn, other=0).to(tl.int64)
        rows = (p * L)[:, None] + c[None, :]
        if HAS_W:
            tl.store(X + rows, (s * tl.load(w + n * K + j, mask=mn, other=0.0)[:, None]).to(X.dtype.element_ty), mask=m)
            y = tl.load(Y + rows, mask=m, other=0.0).to(tl.float32)
            tl.store(dw + n * K + j, tl.sum(s * y, axis=1), mask=mn)
        else:
            tl.store(X + rows, s.to(X.dtype.element_ty), mask=m)


def _launch(N, L):
    return (triton.cdiv(N, BN),), triton.next_power_of_2(L)


def gather_sum(Y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    N, K = pos.shape
    L = Y.shape[1]
    out = torch.empty(N, L, dtype=dtype, device=Y.device)
    if N == 0:
        return out
    grid, BL = _launch(N, L)
    gather_sum_kernel[grid](Y, pos, w if w is not None else pos, out, N, L, K=K, BN=BN, BL=BL, HAS_W=w is not None)
    return out


def scatter_rows(src: torch.Tensor, pos: torch.Tensor, M: int, dtype: torch.dtype, w: torch.Tensor | None = None,
                 Y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """X [M, L] zero but for the routes' rows; with w (and Y) also dw [N, K] fp32."""
    N, K = pos.shape
    L = src.shape[1]
    X = torch.zeros(M, L, dtype=dtype, device=src.device)
    dw = torch.empty(N, K, dtype=torch.float32, device=src.device) if w is not None else None
    if N == 0:
        return X, dw
    grid, BL = _launch(N, L)
    scatter_rows_kernel[grid](src, pos, w if w is not None else pos, X, Y if Y is not None else X,
                              dw if dw is not None else X, N, L, K=K, BN=BN, BL=BL, HAS_W=w is not None)  # fmt: skip
    return X, dw


class RouteDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, pos, M):
        ctx.save_for_backward(pos)
        return scatter_rows(z.contiguous(), pos, M, z.dtype)[0]

    @staticmethod
    def backward(ctx, dX):
        (pos,) = ctx.saved_tensors
        return gather_sum(dX.contiguous(), pos, None, dX.dtype), None, None


class RouteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Y, pos, w, dtype):
        ctx.w_dtype = w.dtype
        Y, w = Y.contiguous(), w.contiguous().to(torch.float32)
        ctx.save_for_backward(Y, pos, w)
        return gather_sum(Y, pos, w, dtype)

    @staticmethod
    def backward(ctx, du):
        Y, pos, w = ctx.saved_tensors
        dY, dw = scatter_rows(du.contiguous(), pos, Y.shape[0], Y.dtype, w=w, Y=Y)
        return dY, None, dw.to(ctx.w_dtype), None


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def route_dispatch_triton(z: torch.Tensor, pos: torch.Tensor, M: int) -> torch.Tensor:
    return RouteDispatch.apply(z, pos, M)


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def route_combine_triton(Y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return RouteCombine.apply(Y, pos, w, dtype)
