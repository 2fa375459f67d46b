"""Quantile Balancing histogram estimator (docs/model.md §6.3): histogram scatter-add and quantile read-out.

``qb_histogram`` counts every (token, expert) value r = alpha_i - s_ij into bin
floor((r - lo) / width), clamped to [0, bins - 1]; per-rank histograms add up exactly
(one integer all-reduce). ``qb_quantile`` reads b^_j back from the summed histogram.
"""

from __future__ import annotations

import math

import torch

from .._backend import resolve_backend

HAS_TRITON_QB = True


def _as_float(x, name):
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"qb_histogram: {name} must be finite, got {v}")
    return v


def qb_histogram(r, lo, width, bins, token_mask=None, backend="auto"):
    """int64 [n, bins] counts of ``clamp(floor((r - lo) / width), 0, bins - 1)`` per column of r [m, n].

    ``token_mask`` [m] bool (optional) leaves out tokens where it is False (padding).
    """
    if r.dim() != 2:
        raise ValueError(f"qb_histogram: r must be [m tokens, n experts], got {tuple(r.shape)}")
    lo, width = _as_float(lo, "lo"), _as_float(width, "width")
    if width <= 0 or int(bins) < 1:
        raise ValueError(f"qb_histogram: need width > 0 and bins >= 1, got width={width}, bins={bins}")
    if token_mask is not None and token_mask.shape != (r.shape[0],):
        raise ValueError(f"qb_histogram: token_mask must be [m={r.shape[0]}], got {tuple(token_mask.shape)}")
    bins = int(bins)
    path = resolve_backend(backend, "qb_histogram", r, has_triton=HAS_TRITON_QB)
    if path == "triton":
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_qb import qb_histogram_triton

        return qb_histogram_triton(r, lo, width, bins, token_mask)
    return qb_histogram_reference(r, lo, width, bins, token_mask)


def qb_histogram_reference(r, lo, width, bins, token_mask=None):
    m, n = r.shape
    idx = torch.floor((r.to(torch.float32) - lo) / width).clamp_(0, bins - 1).to(torch.int64)  # bin per value
    flat = idx + torch.arange(n, device=r.device) * bins  # row j of the [n, bins] histogram
    if token_mask is not None:
        flat = flat[token_mask]
    return torch.bincount(flat.reshape(-1), minlength=n * bins).reshape(n, bins)


def qb_quantile(hist, q, lo, width):
    """b^_j from a histogram [n, bins] (docs/model.md §6.3 step 4), fp32 [n].

    beta_j = first bin whose cumulative count (itself included) reaches ceil(q);
    c_j = count before it, h_j = count in it; b^_j = lo + (beta_j + clip((q - c_j) / h_j, 0, 1)) * width.
    """
    if hist.dim() != 2:
        raise ValueError(f"qb_quantile: hist must be [n experts, bins], got {tuple(hist.shape)}")
    q = float(q)
    target = math.ceil(q)
    cum = hist.cumsum(dim=1)
    totals = cum[:, -1]
    if q < 0 or bool((totals < target).any()):
        raise ValueError(
            f"qb_quantile: q={q} must lie in [0, tokens per expert row]; row totals range "
            f"{int(totals.min())}..{int(totals.max())}"
        )
    beta = (cum < target).sum(dim=1)  # index of the first bin with cum >= ceil(q)
    h = hist.gather(1, beta[:, None]).squeeze(1).to(torch.float32)
    c = cum.gather(1, beta[:, None]).squeeze(1).to(torch.float32) - h
    frac = torch.where(h > 0, (q - c) / h.clamp(min=1), torch.zeros_like(h)).clamp(0, 1)
    return lo + (beta.to(torch.float32) + frac) * float(width)


__all__ = ["qb_histogram", "qb_histogram_reference", "qb_quantile"]
