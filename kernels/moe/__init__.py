"""Latent MoE expert block (docs/model.md §5.3 steps 2-3): permute, grouped expert GEMMs, combine, unpermute.

Two paths behind ``latent_experts``:
- ``"torch"``: a loop over the experts that received tokens (any device / dtype; the reference);
- ``"triton"``: ``torch._grouped_mm`` (CUTLASS grouped GEMM on Hopper) for the three expert
  GEMMs of all experts at once plus the SiTU-GLU kernel; no host synchronisation. We call it
  the Triton path because it is the fast GPU path: a hand-written Triton grouped GEMM would
  not beat the library one, so this op uses the library.
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from ..situ import situ_glu

GROUP_ALIGN = 16  # rows per expert group are padded to a multiple of this for _grouped_mm


def _check(z, topk_idx, topk_weight, w1, w3, w2):
    if z.dim() != 2:
        raise ValueError(f"latent_experts: z must be [N, l], got {tuple(z.shape)}")
    N, dim = z.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != N or topk_idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"latent_experts: topk_idx must be integer [N={N}, k], got {tuple(topk_idx.shape)} {topk_idx.dtype}"
        )
    if topk_weight.shape != topk_idx.shape:
        raise ValueError(
            f"latent_experts: topk_weight must have topk_idx's shape {tuple(topk_idx.shape)}, got {tuple(topk_weight.shape)}"
        )
    if w1.dim() != 3 or w1.shape[2] != dim or w3.shape != w1.shape:
        raise ValueError(
            f"latent_experts: w1 and w3 must be [E, f, l={dim}]; got {tuple(w1.shape)} and {tuple(w3.shape)}"
        )
    E, f, _ = w1.shape
    if w2.shape != (E, dim, f):
        raise ValueError(f"latent_experts: w2 must be [E={E}, l={dim}, f={f}], got {tuple(w2.shape)}")
    # the ids' range is read on the host off CUDA only: a read there stops the stream every layer, and
    # CUDA ids come from top-k (in range) or from routing replay (MoEGate checks those itself)
    if topk_idx.numel() and not topk_idx.is_cuda and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= E):
        raise ValueError(f"latent_experts: topk_idx values must lie in [0, {E}); got range "
                         f"[{int(topk_idx.min())}, {int(topk_idx.max())}]")  # fmt: skip


def count_per_expert(values: torch.Tensor, size: int) -> torch.Tensor:
    """torch.bincount(values, minlength=size) for values in [0, size), without reading the largest
    value on the host (bincount does, to size its output: a sync on CUDA). Integer adds: exact in any order."""
    ones = torch.ones(values.shape, dtype=torch.int64, device=values.device)
    return torch.zeros(size, dtype=torch.int64, device=values.device).index_add_(0, values.reshape(-1), ones.reshape(-1))


def permute_by_expert(topk_idx: torch.Tensor, num_experts: int):
    """Sort the N*k (token, slot) routes by expert.

    Returns (order [N*k] flat route ids sorted by expert, token_of_route [N*k], counts [E]).
    """
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # routes grouped by expert, token order kept inside
    token_of_route = order // topk_idx.shape[1]
    counts = count_per_expert(flat, num_experts)
    return order, token_of_route, counts


def combine(y_sorted, order, token_of_route, topk_weight, N, dtype):
    """u_t = sum_e p_e h_e: bf16 expert outputs times fp32 weights, summed in fp32, cast once."""
    w = topk_weight.reshape(-1)[order].to(torch.float32)
    out = torch.zeros(N, y_sorted.shape[-1], dtype=torch.float32, device=y_sorted.device)
    out = out.index_add(0, token_of_route, y_sorted.to(torch.float32) * w.unsqueeze(-1))
    return out.to(dtype)


def route_positions(order: torch.Tensor, pos: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """[N, k] buffer row of each route (n, j), from pos [N k] given in expert-sorted order."""
    return torch.empty_like(pos).scatter_(0, order, pos).view(topk_idx.shape)


def route_dispatch_reference(z: torch.Tensor, pos: torch.Tensor, M: int) -> torch.Tensor:
    """X [M, l]: X[pos[n, j]] = z[n], the other rows zero (kernels/moe/triton_routes.py)."""
    return z.new_zeros(M, z.shape[1]).index_copy(0, pos.reshape(-1), z.repeat_interleave(pos.shape[1], dim=0))


def route_combine_reference(Y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """u [N, l] = sum_j w[n, j] Y[pos[n, j]]: Y's rows times fp32 weights, summed in fp32, cast once."""
    N, K = pos.shape
    rows = Y.index_select(0, pos.reshape(-1)).view(N, K, Y.shape[1]).to(torch.float32)
    return (rows * w.to(torch.float32).unsqueeze(-1)).sum(1).to(dtype)


def route_dispatch(z: torch.Tensor, pos: torch.Tensor, M: int, backend: str = "auto") -> torch.Tensor:
    if resolve_backend(backend, "route_dispatch", z, pos) == "triton":
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_routes import route_dispatch_triton

        return route_dispatch_triton(z, pos, M)
    return route_dispatch_reference(z, pos, M)


def route_combine(Y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
                  backend: str = "auto") -> torch.Tensor:  # fmt: skip
    if resolve_backend(backend, "route_combine", Y, pos, w) == "triton":
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_routes import route_combine_triton

        return route_combine_triton(Y, pos, w, dtype)
    return route_combine_reference(Y, pos, w, dtype)


def latent_experts_loop(z, topk_idx, topk_weight, w1, w3, w2, beta_gate=4.0, beta_up=25.0, act_quant=None):
    """Reference: for every expert with tokens, ``h = w2 @ situ_glu(w1 z, w3 z)``, then combine.
    ``act_quant`` (optional) maps the SiTU-GLU output before the down GEMM (MXFP8 activations, k3rl/model/mx.py)."""
    N = z.shape[0]
    E = w1.shape[0]
    order, token_of_route, counts = permute_by_expert(topk_idx, E)
    x = z[token_of_route]
    ys = []
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        xe = x[start : start + c]
        h = situ_glu(xe @ w1[e].T, xe @ w3[e].T, beta_gate, beta_up, backend="torch")
        ys.append((h if act_quant is None else act_quant(h)) @ w2[e].T)
        start += c
    y = torch.cat(ys) if ys else z.new_zeros(0, z.shape[1])
    return combine(y, order, token_of_route, topk_weight, N, z.dtype)


def latent_experts_grouped(z, topk_idx, topk_weight, w1, w3, w2, beta_gate=4.0, beta_up=25.0):
    """Grouped-GEMM path: every expert's rows padded to GROUP_ALIGN inside one static-size buffer."""
    N, dim = z.shape
    E = w1.shape[0]
    order, _, counts = permute_by_expert(topk_idx, E)
    R = order.numel()
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    # position of each sorted route inside the padded buffer: start of its expert + rank within it
    expert_sorted = topk_idx.reshape(-1)[order]
    rank = torch.arange(R, device=z.device) - (torch.cumsum(counts, 0) - counts)[expert_sorted]
    pos = starts[expert_sorted] + rank
    M = R + E * (GROUP_ALIGN - 1)  # static upper bound: no host sync on the routing
    M = (M + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    route_pos = route_positions(order, pos, topk_idx)  # [N, k] buffer row of each (token, slot)
    x = route_dispatch(z, route_pos, M)  # X[route_pos[n, j]] = z[n]
    offs = ends.to(torch.int32)
    h1 = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)  # [M, f] = x w1_e^T per group
    h3 = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    a = situ_glu(h1, h3, beta_gate, beta_up)
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)  # [M, l]
    return route_combine(y, route_pos, topk_weight, z.dtype)  # u_n = sum_j p_nj y[route_pos[n, j]], fp32 sum


def latent_experts(z, topk_idx, topk_weight, w1, w3, w2, beta_gate=4.0, beta_up=25.0, backend="auto"):
    """Routed latent experts: ``u_t = sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(z_t)``.

    z [N, l]; topk_idx [N, k] int64; topk_weight [N, k] fp32; w1, w3 [E, f, l]; w2 [E, l, f].
    Expert e computes ``w2_e @ situ_glu(w1_e z, w3_e z)`` in z's dtype; the weighted combine
    is fp32; returns [N, l] in z's dtype. "auto" uses the grouped GEMM for bf16 CUDA inputs.
    """
    _check(z, topk_idx, topk_weight, w1, w3, w2)
    grouped_ok = hasattr(torch, "_grouped_mm") and z.dtype == torch.bfloat16
    path = resolve_backend(backend, "latent_experts", z, w1, w3, w2, has_triton=grouped_ok)
    fn = latent_experts_grouped if path == "triton" else latent_experts_loop
    return fn(z, topk_idx, topk_weight, w1, w3, w2, beta_gate, beta_up)


__all__ = ["count_per_expert", "latent_experts", "latent_experts_grouped", "latent_experts_loop", "permute_by_expert",
           "route_combine", "route_dispatch", "route_positions"]
