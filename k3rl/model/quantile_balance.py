"""Quantile Balancing of the MoE routing bias (docs/model.md §6).

Exact form (the K3 report, arXiv 2607.24653, Eq. 14), one step for one layer, scores s [m, n],
bias b [n], k routes per token:
    alpha_i  = (k+1)-th largest of s_i + b                   the token's cutoff under the old bias
    b^_j     = -( (q+1)-th largest of s_{:,j} - alpha ),  q = m k / n
    b_new    = b^ - mean(b^)                                 a common shift changes no Top-k

Histogram form (what K3 runs, §6.3): the required biases r_ij = alpha_i - s_ij all lie in
[lo, hi] = [b_min - 1, b_max + 1]; count them into B = 1000 bins of width w = (hi - lo)/B per
expert (integer counts that add across micro-batches and ranks), then read the quantile:
    beta_j = first bin whose cumulative count reaches ceil(q)
    b^_j   = lo + (beta_j + clip((q - c_j) / h_j, 0, 1)) w    c_j before the bin, h_j inside it
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3rl.kernels.qb_histogram import qb_histogram, qb_quantile


def _check(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[int, int]:
    if scores.dim() != 2:
        raise ValueError(f"quantile_balance: scores must be [m tokens, n experts], got shape {tuple(scores.shape)}")
    m, n = scores.shape
    if bias.shape != (n,):
        raise ValueError(f"quantile_balance: bias must be [n={n}], got shape {tuple(bias.shape)}")
    if not 0 < k < n:
        raise ValueError(f"quantile_balance: need 0 < k < n (the (k+1)-th score is the cutoff), got k={k}, n={n}")
    return m, n


def routing_cutoffs(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k expert indices [m, k], cutoff alpha [m] = the (k+1)-th largest biased score)."""
    top = torch.topk(scores + bias, k + 1, dim=-1)
    return top.indices[:, :k], top.values[:, k]


def target_load(m: int, n: int, k: int) -> float:
    """q = m k / n tokens per expert."""
    return m * k / n


def quantile_balance(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """New (mean-centred) bias from one batch's router scores by Eq. 14, exactly.

    -b^_j is the (q+1)-th largest margin s_ij - alpha_i, so exactly q margins strictly
    exceed it (q = floor(m k / n) when m k / n is not an integer).
    """
    m, n = _check(scores, bias, k)
    q = math.floor(target_load(m, n, k))
    if q + 1 > m:
        raise ValueError(f"quantile_balance: need more tokens than the target load (m={m}, q={q})")
    _, alpha = routing_cutoffs(scores, bias, k)
    margins = (scores - alpha[:, None]).t().contiguous()  # [n, m]: raw score minus biased cutoff
    b_hat = -torch.kthvalue(margins, m - q, dim=1).values  # (q+1)-th largest = (m-q)-th smallest, negated
    return b_hat - b_hat.mean()


def histogram_range(bias: torch.Tensor, bins: int) -> tuple[float, float]:
    """(lo, width) of the §6.3 histogram for the current bias: [b_min - 1, b_max + 1] in `bins` bins."""
    b_min, b_max = float(bias.min()), float(bias.max())
    return b_min - 1.0, (b_max - b_min + 2.0) / bins


def required_bias_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, bins: int = 1000):
    """Integer counts [n, bins] of r_ij = alpha_i - s_ij for one micro-batch, plus (lo, width)."""
    _check(scores, bias, k)
    lo, width = histogram_range(bias, bins)
    _, alpha = routing_cutoffs(scores.float(), bias.float(), k)
    r = (alpha[:, None] - scores.float()).contiguous()
    return qb_histogram(r, lo, width, bins), lo, width


def bias_from_histogram(counts: torch.Tensor, num_tokens: int, k: int, lo: float, width: float) -> torch.Tensor:
    """Raw b^ [n] (not centred) read from summed histogram counts [n, B] of m = num_tokens tokens
    (the kernels' `qb_quantile`: first bin reaching ceil(q), linear interpolation inside it)."""
    n = counts.shape[0]
    return qb_quantile(counts, target_load(num_tokens, n, k), lo, width)


class QuantileBalancer(nn.Module):
    """Per-layer QB state: histogram counts accumulated over the step's forward passes.

    `accumulate` runs after each MoE forward (outside activation checkpointing, so a
    recompute never counts twice); `counts` / `num_tokens` are integer tensors a trainer can
    all-reduce (sum) across ranks; `new_bias` reads the quantile, centres it, and the caller
    applies it for the next step. Nothing is accumulated while frozen (the RL default).
    """

    def __init__(self, num_experts: int, k: int, bins: int):
        super().__init__()
        self.k, self.bins = k, bins
        self.register_buffer("counts", torch.zeros(num_experts, bins, dtype=torch.int64), persistent=False)
        self.register_buffer("num_tokens", torch.zeros((), dtype=torch.int64), persistent=False)

    @torch.no_grad()
    def accumulate(self, scores: torch.Tensor, cutoff: torch.Tensor, bias: torch.Tensor,
                   token_mask: torch.Tensor | None = None) -> None:
        """Add one micro-batch: scores [N, n] fp32, cutoffs alpha [N] (biased (k+1)-th score);
        `token_mask` [N] bool leaves padding tokens out of the statistics."""
        lo, width = histogram_range(bias, self.bins)
        r = (cutoff.float()[:, None] - scores.float()).contiguous()
        self.counts += qb_histogram(r, lo, width, self.bins, token_mask=token_mask).to(self.counts.device)
        self.num_tokens += scores.shape[0] if token_mask is None else token_mask.sum()

    @torch.no_grad()
    def new_bias(self, bias: torch.Tensor) -> torch.Tensor | None:
        """Centred bias from the accumulated counts (None when nothing was accumulated); resets the counts."""
        m = int(self.num_tokens)
        if m == 0:
            return None
        lo, width = histogram_range(bias, self.bins)
        b_hat = bias_from_histogram(self.counts, m, self.k, lo, width).to(bias.device)
        self.counts.zero_()
        self.num_tokens.zero_()
        return b_hat - b_hat.mean()
