"""Block AttnRes aggregation (K3 report, Block AttnRes; docs/model.md §4): reference, Triton kernel, dispatcher.

Per token, in fp32, over S sources v_i of one shape [..., d] and a query q [d] (gamma * w):
    kappa_i = v_i / sqrt(mean_d(v_i^2) + eps);  l_i = kappa_i . q;  a = softmax_i(l);  h = sum_i a_i v_i
h sums the *unnormalised* sources and is returned in their dtype. The reference widens every source to
fp32 and stacks them ([S, ..., d] fp32, kept by autograd with its normalised copy); the kernel
(``triton_aggregate.py``) reads the sources in their dtype and keeps only S logits and S rms factors
per token.
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TRITON_SOURCES = 16  # one compiled kernel per source count; K3 (93 layers, blocks of 12) has at most 9


def attnres_aggregate_reference(sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """h = sum_i softmax_i(RMSNorm(v_i) . query) v_i in fp32 by PyTorch ops, cast to the sources' dtype."""
    with torch.autocast(device_type=sources[0].device.type, enabled=False):  # really fp32 under autocast
        v = torch.stack([s.float() for s in sources], dim=0)  # [S, ..., d]
        kappa = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        a = torch.softmax((kappa * query.float()).sum(-1), dim=0)  # [S, ...]
        return (a.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


def attnres_aggregate(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float, backend="auto"
) -> torch.Tensor:
    """``attnres_aggregate_reference``'s result, by the Triton kernel on CUDA (``backend`` as in
    ``kernels/_backend.py``). One source is returned as it is (a one-source softmax is the identity).

    The kernel covers 2..16 sources in fp32 / bf16 / fp16 with d <= 16384; other cases run the
    reference on every backend. Sources of different dtypes (under autocast the embeddings' block
    is fp32 and the layers' outputs bf16) go to the kernel as they are: it widens each to fp32 as it
    reads it (as the reference does), the result is in the first source's dtype and each source's
    gradient in its own, as the reference's are.
    """
    sources = list(sources)
    if not sources:
        raise ValueError("attnres_aggregate: needs at least one source tensor")
    first = sources[0]
    if any(s.shape != first.shape or s.device != first.device for s in sources):
        got = ", ".join(f"{tuple(s.shape)} {s.dtype} {s.device}" for s in sources)
        raise ValueError(f"attnres_aggregate: the sources must share one shape and device; got {got}")
    if query.shape != first.shape[-1:]:
        raise ValueError(
            f"attnres_aggregate: query must be [d] = [{first.shape[-1]}] (the sources' last dim); "
            f"got {tuple(query.shape)}"
        )
    path = resolve_backend(backend, "attnres_aggregate", *sources, query)
    if len(sources) == 1:
        return first
    if path == "triton" and all(s.dtype in TRITON_DTYPES for s in sources) and len(sources) <= MAX_TRITON_SOURCES:
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_aggregate import MAX_D, aggregate_triton

        if first.shape[-1] <= MAX_D and first.numel() > 0:
            # mixed dtypes (autocast) too: the kernel reads each source in its own dtype into fp32 registers
            # (an fp32 copy of the bf16 ones was a large share of a k3-small train step's dtype copies)
            return aggregate_triton(sources, query.float(), eps)
    return attnres_aggregate_reference(sources, query, eps)


__all__ = ["attnres_aggregate", "attnres_aggregate_reference"]
