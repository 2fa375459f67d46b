"""Block Attention Residuals (docs/model.md §4): the aggregation operator and its two-phase form.

Agg(v_0..v_{S-1}; w, gamma), per token, in fp32:
    kappa_i = v_i / sqrt(mean_d(v_i^2) + eps)          RMS normalisation without affine weight
    l_i     = sum_d kappa_{i,d} gamma_d w_d             query gamma*w; no 1/sqrt(d), no temperature
    a       = softmax_i(l)
    h       = sum_i a_i v_i                              the *unnormalised* sources; cast back

The per-layer state machine (bank of completed blocks + partial sum) lives in
`K3DecoderLayer`; this module holds the operator, its online-softmax two-phase form (§4.5)
and the source-count rule of §4.4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3rl.kernels.attnres import attnres_aggregate

from .common import RMSNorm, fp32_island, rms_normalize


def make_query_params(dim: int, eps: float) -> tuple[nn.Linear, RMSNorm]:
    """One aggregator's parameters: the pseudo-query `*_res_proj` [1, d] (zero init, so the
    first steps average uniformly) and `*_res_norm` gamma [d] (ones)."""
    proj = nn.Linear(dim, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return proj, RMSNorm(dim, eps)


def query_vector(proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """The effective query gamma * w in fp32 [d]."""
    return norm.weight.float() * proj.weight.float()[0]


def aggregate(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float, backend: str = "auto"
) -> torch.Tensor:
    """h = sum_i softmax_i(RMSNorm(v_i) . query) v_i, in fp32, cast to the sources' dtype.

    One source is returned as it is (a single-source softmax is the identity, and keeps layer 0
    bit-exact). Otherwise the fused Triton kernel on CUDA (``kernels/attnres``: reads the sources in
    their dtype, no fp32 stack), the PyTorch reference elsewhere; ``backend`` is the model's
    ``kernel_backend``.
    """
    return attnres_aggregate(sources, query, eps, backend=backend)


@dataclass
class OnlineSoftmaxState:
    """Phase-1 statistics of one query over the completed sources: max mu, normaliser Z, numerator N."""

    mu: torch.Tensor  # [...]
    z: torch.Tensor  # [...]
    n: torch.Tensor  # [..., d]


def phase1(completed: list[torch.Tensor], query: torch.Tensor, eps: float) -> OnlineSoftmaxState:
    """Online-softmax statistics of `query` over the completed block sources (once per block)."""
    with fp32_island(completed[0]):
        v = torch.stack([s.float() for s in completed], dim=0)
        logits = (rms_normalize(v, eps) * query).sum(-1)
        mu = logits.max(dim=0).values
        e = torch.exp(logits - mu)  # e^{l - mu}
        return OnlineSoftmaxState(mu=mu, z=e.sum(0), n=(e.unsqueeze(-1) * v).sum(0))


def phase2(state: OnlineSoftmaxState, partial: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """Fold the partial-sum source into phase-1 statistics and return N'/Z' (cast to `partial`'s dtype).

    mu' = max(mu, l_p);  Z' = Z e^{mu-mu'} + e^{l_p-mu'};  N' = N e^{mu-mu'} + e^{l_p-mu'} v
    """
    with fp32_island(partial):
        v = partial.float()
        lp = (rms_normalize(v, eps) * query).sum(-1)
        mu2 = torch.maximum(state.mu, lp)
        old, new = torch.exp(state.mu - mu2), torch.exp(lp - mu2)
        z2 = state.z * old + new
        n2 = state.n * old.unsqueeze(-1) + new.unsqueeze(-1) * v
        return (n2 / z2.unsqueeze(-1)).to(partial.dtype)


def expected_source_counts(num_layers: int, block_size: int) -> tuple[list[int], list[int], int]:
    """(attention counts per layer, MLP counts per layer, final count) by the rule of §4.4."""
    attn, mlp = [], []
    for layer in range(num_layers):
        n = layer // block_size
        if layer == 0:
            attn.append(1)
        elif layer % block_size == 0:
            attn.append(n + 1)
        else:
            attn.append(n + 2)
        mlp.append(n + 2)
    blocks = -(-num_layers // block_size)  # ceil
    return attn, mlp, blocks + 1
