"""Batched Newton-Schulz orthogonalisation for (Per-Head) Muon (docs/model.md §8.1-8.2).

For each matrix X of the batch: X <- X / (||X||_F + 1e-7); work on X^T when rows > cols;
5 times  A = X X^T,  X <- a X + (b A + c A^2) X  with (a, b, c) = (3.4445, -4.7750, 2.0315).

There is no Triton kernel: the work is three batched GEMMs per step, which cuBLAS runs at
tensor-core speed in bf16 (``bmm`` / ``baddbmm`` on [N, r, c] batches, the sums b A + c A^2 and
a X + B X in the GEMMs' epilogues), so "triton" and "auto" on CUDA use that batched bf16 path;
"torch" and CPU use the same code in fp32.
"""

from __future__ import annotations

import torch

from .._backend import BACKENDS

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7, backend="auto") -> torch.Tensor:
    """Orthogonalise every matrix of G [..., rows, cols] (batched over leading dims).

    Computes in bf16 on CUDA ("auto"/"triton"), in fp32 for "torch" or on the CPU.
    Returns G's shape and dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"newton_schulz: backend must be one of {BACKENDS}, got {backend!r}")
    if G.dim() < 2:
        raise ValueError(f"newton_schulz: G must be [..., rows, cols], got {tuple(G.shape)}")
    if steps < 0:
        raise ValueError(f"newton_schulz: steps must be >= 0, got {steps}")
    low = G.is_cuda and backend != "torch"
    dt = torch.bfloat16 if low else (torch.float64 if G.dtype == torch.float64 else torch.float32)
    a, b, c = NS_COEFFS
    X = G.reshape(-1, *G.shape[-2:])  # [N, r, c]: the batched GEMMs below take one batch dim
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(X.dtype, torch.float32))  # ||X||_F, fp32 at least
    X = (X / (norm + eps)).to(dt)  # Frobenius-normalise, then narrow (one pass: no widened copy of X)
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.mT  # iterate on the wide orientation: A = X X^T is the small Gram matrix
    for _ in range(steps):
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # B = b A + c A^2, one GEMM with its epilogue
        X = torch.baddbmm(X, B, X, beta=a)  # X <- a X + B X
    if tall:
        X = X.mT
    # contiguous whatever the orientation: a tall block's result is a transposed view, and the optimizer's
    # foreach update falls back to one kernel a tensor when its operands' strides differ from the weights'
    if X.dtype != G.dtype or not X.is_contiguous():
        X = torch.empty(X.shape, dtype=G.dtype, device=X.device).copy_(X)  # cast and transpose in one pass
    return X.reshape(G.shape)


def newton_schulz_loop(G: torch.Tensor, steps: int = 5, eps: float = 1e-7, backend="auto") -> torch.Tensor:
    """The same, one matrix at a time (the baseline the batched form is measured against)."""
    flat = G.reshape(-1, *G.shape[-2:])
    return torch.stack([newton_schulz(m, steps, eps, backend) for m in flat]).reshape(G.shape)


__all__ = ["NS_COEFFS", "newton_schulz", "newton_schulz_loop"]
