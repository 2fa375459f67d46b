"""The router's top-k and weights in one Triton program per token (formulas in router.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only


@triton.jit
def route_topk_kernel(l_ptr, b_ptr, p_ptr, i_ptr, E, scaling, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    inside = e < E
    logit = tl.load(l_ptr + t * E + e, mask=inside, other=0.0)
    s = 1.0 / (1.0 + tl.exp(-logit))  # s = sigmoid(l)
    biased = tl.where(inside, s + tl.load(b_ptr + e, mask=inside, other=0.0), float("-inf"))
    j = tl.arange(0, BLOCK_K)
    p = tl.zeros([BLOCK_K], dtype=tl.float32)
    idx = tl.zeros([BLOCK_K], dtype=tl.int64)
    for r in tl.static_range(TOP_K):  # the r-th largest biased score: ties to the lower id
        best = tl.max(biased, axis=0)
        pick = tl.min(tl.where(biased == best, e, BLOCK_E), axis=0)
        p = tl.where(j == r, tl.sum(tl.where(e == pick, s, 0.0), axis=0), p)  # p_r = s[pick], no bias
        idx = tl.where(j == r, pick.to(tl.int64), idx)
        biased = tl.where(e == pick, float("-inf"), biased)
    if RENORM:
        p = p / (tl.sum(p, axis=0) + 1e-20)  # p_j / (sum_T s + 1e-20)
    p = p * scaling
    tl.store(p_ptr + t * TOP_K + j, p, mask=j < TOP_K)
    tl.store(i_ptr + t * TOP_K + j, idx, mask=j < TOP_K)


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def route_topk_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    N, E = logits.shape
    logits, bias = logits.contiguous(), bias.float().contiguous()
    p = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        route_topk_kernel[(N,)](logits, bias, p, idx, E, float(scaling), TOP_K=top_k, RENORM=bool(renormalize),
                                BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
                                num_warps=4 if E > 256 else 1)
    return p, idx
