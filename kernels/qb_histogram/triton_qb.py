"""Quantile Balancing histogram in Triton: one scatter-add (atomic) per (token, expert) value.

Each program takes a [BM, BN] block of r [m, n], computes the bin
clamp(floor((r - lo) / width), 0, bins - 1) and adds 1 to hist[expert, bin] (int32 atomics,
widened to int64 on return). Counts add, so per-rank histograms sum exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only


@triton.jit(do_not_specialize=["m"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def qb_hist_kernel(
    r,
    mask,
    hist,
    m,
    n,
    lo,
    inv_width,
    BINS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (rows < m)[:, None] & (cols < n)[None, :]
    if HAS_MASK:
        ok = ok & (tl.load(mask + rows, mask=rows < m, other=0) != 0)[:, None]
    x = tl.load(r + rows[:, None] * n + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.floor((x - lo) * inv_width)  # bin = floor((r - lo) / width)
    b = tl.minimum(tl.maximum(b, 0.0), BINS - 1).to(tl.int32)  # clamped to [0, bins - 1]
    tl.atomic_add(hist + cols[None, :] * BINS + b, tl.full([BM, BN], 1, tl.int32), mask=ok)


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def qb_histogram_triton(r, lo, width, bins, token_mask=None):
    m, n = r.shape
    hist = torch.zeros(n, bins, dtype=torch.int32, device=r.device)
    BM, BN = 64, 32
    mask = token_mask.to(torch.int8).contiguous() if token_mask is not None else hist
    qb_hist_kernel[(triton.cdiv(m, BM), triton.cdiv(n, BN))](
        r.contiguous(), mask, hist, m, n, float(lo), 1.0 / float(width),
        BINS=bins, HAS_MASK=token_mask is not None, BM=BM, BN=BN, num_warps=4,
    )  # fmt: skip
    return hist.to(torch.int64)
