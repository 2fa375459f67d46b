"""The router's selection and weights for inference (docs/model.md §6): reference, fused Triton kernel, dispatcher.

From the fp32 router logits l = x W_r^T of N tokens over E experts:

    s   = sigmoid(l)                                   fp32 scores
    T   = the k largest of s + b                       b: e_score_correction_bias (dispatch only)
    p_j = s_j / (sum_{r in T} s_r + 1e-20) * scale     the weights, without the bias (renormalised when asked)

`MoEGate.forward` computes the same (and the cutoff, scores and routing replay the learner needs);
eager PyTorch spends about ten kernels on it per layer (sigmoid, add, top-k's sort and gather,
gather, sum, add, divide, multiply), 150 of a k3-small decode step. The kernel is one program per
token: the row's scores in registers, k passes of an argmax. Order of the k experts: by biased
score, highest first (torch.topk's order); ties go to the lower expert id.
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend

MAX_TRITON_EXPERTS = 4096


def route_topk_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(p [N, k] fp32, idx [N, k] int64) from fp32 logits [N, E] by PyTorch ops (MoEGate's math)."""
    scores = torch.sigmoid(logits.float())
    idx = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    p = scores.gather(-1, idx)
    if renormalize:
        p = p / (p.sum(-1, keepdim=True) + 1e-20)
    return p * scaling, idx


def route_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk_reference`'s result, by the Triton kernel on CUDA for fp32 logits of at most 4,096
    experts (``backend`` as in ``kernels/_backend.py``); the reference otherwise. No host sync."""
    if logits.dim() != 2 or bias.shape != logits.shape[-1:]:
        raise ValueError(f"route_topk: logits must be [N, E] and bias [E]; got {tuple(logits.shape)} and "
                         f"{tuple(bias.shape)}")
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"route_topk: top_k must lie in [1, E = {logits.shape[-1]}], got {top_k}")
    path = resolve_backend(backend, "route_topk", logits, bias)
    if path == "triton" and logits.dtype == torch.float32 and logits.shape[-1] <= MAX_TRITON_EXPERTS:
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_router import route_topk_triton

        return route_topk_triton(logits, bias, top_k, renormalize, scaling)
    return route_topk_reference(logits, bias, top_k, renormalize, scaling)


__all__ = ["route_topk", "route_topk_reference"]
