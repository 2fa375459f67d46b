"""Expert parallelism (EP) for the routed experts, applied *to* the model (torchtitan style).

`apply_expert_parallel(model, group)` replaces every `RoutedExperts` (stacked w1/w3 [E, f, l],
w2 [E, l, f]) by an `ExpertParallelExperts` that keeps only this rank's contiguous slice of
E / ep experts: rank r of the EP group owns experts [r E/ep, (r+1) E/ep). Everything else of
the MoE layer (router, shared experts, down/up projections, latent norm) stays as it is:
replicated, or sharded by FSDP, and computed locally for the rank's own tokens.

One forward of the routed experts on each rank (N tokens, k routes each, ep ranks):

    routes sorted by expert              order [N k]: grouped by expert = grouped by owner rank
    counts exchange (all-to-all)         recv[s, j] = routes rank s sends to my local expert j
    dispatch z rows (all-to-all)         [sum_s recv[s], l], by source rank, then local expert
    local experts                        h = w2_j SiTU-GLU(w1_j z, w3_j z) per received row
    return rows (inverse all-to-all)     back in `order`
    combine                              u_t = sum_e p_e h_e, fp32, exactly as one process does

Both all-to-alls are differentiable (the backward of one is the other with the splits
swapped), so the gradient of w1/w3/w2 on the owner collects the contributions of every
rank's tokens: it is the gradient of the sum of the ranks' losses, with no averaging.

With a world of W ranks and EP size ep (ep divides W), the ranks form a [W / ep, ep] grid:
EP groups are rows (contiguous ranks), and each expert slice is replicated down a column.
`reduce_expert_grads` sums the gradients of the replicas and applies the trainer's scale
(FSDP averages, the trainer multiplies the loss by W: the expert gradients are divided by W).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from k3rl.kernels.moe import combine as combine_routes
from k3rl.kernels.moe import latent_experts, permute_by_expert
from k3rl.model.common import autocast_dtype
from k3rl.model.moe import RoutedExperts

__all__ = [
    "ExpertParallelExperts",
    "apply_expert_parallel",
    "expert_parallel_groups",
    "expert_parallel_latent_experts",
    "expert_parallel_modules",
    "sharded_expert_params",
    "local_expert_params",
    "reduce_expert_grads",
    "clip_grad_norm_with_experts",
]

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `send` go to the ranks of `group`; `recv` rows come back from each.
    Backward: the same exchange with `send` and `recv` swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group
        )
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def expert_parallel_latent_experts(
    z, topk_idx, topk_weight, w1, w3, w2, beta_gate, beta_up, group, backend="auto"
):
    """`latent_experts` with the experts spread over `group`; same arguments, but w1/w3/w2 hold
    only this rank's E / ep experts. Collective: every rank of `group` calls it together."""
    N, k = topk_idx.shape
    ep, n_local = dist.get_world_size(group), w1.shape[0]
    order, token_of_route, counts = permute_by_expert(topk_idx, n_local * ep)  # counts [E]
    send_counts = counts.view(ep, n_local)  # [dest rank, its local expert]
    recv_counts = torch.empty_like(send_counts)  # [source rank, my local expert]
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()

    x = _AllToAll.apply(z[token_of_route], send, recv, group)  # [R_in, l]
    local_ids = torch.arange(n_local, device=z.device).repeat(ep)  # expert of each (source, expert) block
    local_idx = torch.repeat_interleave(local_ids, recv_counts.reshape(-1))  # [R_in]
    # every received row is a "token" with one route of weight 1: the op returns h_e(x) per row
    # (bf16 h -> fp32 * 1 -> bf16 is exact), so the weighted combine happens once, below
    ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    h = latent_experts(x, local_idx.unsqueeze(1), ones, w1, w3, w2, beta_gate, beta_up, backend=backend)
    if x.shape[0] == 0 and torch.is_grad_enabled() and x.requires_grad:
        h = x * 0  # nothing arrived: keep this rank in the graph so its backward all-to-alls still run
    y = _AllToAll.apply(h, recv, send, group)  # [N k, l] in `order`
    return combine_routes(y, order, token_of_route, topk_weight, N, z.dtype)


class ExpertParallelExperts(nn.Module):
    """Drop-in for `RoutedExperts` that holds experts [offset, offset + E / ep) of this rank.

    The parameters keep the names w1/w3/w2 (same state-dict keys), with E / ep rows.
    """

    def __init__(self, experts: RoutedExperts, group, replicate_group=None):
        super().__init__()
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        E = experts.w1.shape[0]
        _check_divides(E, ep)
        self.group, self.replicate_group = group, replicate_group
        self.ep_size, self.ep_rank = ep, rank
        self.num_experts, self.num_local = E, E // ep
        self.offset = rank * self.num_local
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            local = full.detach()[self.offset : self.offset + self.num_local].clone()
            setattr(self, name, nn.Parameter(local, requires_grad=full.requires_grad))
        self.beta_gate, self.beta_up, self.backend = experts.beta_gate, experts.beta_up, experts.backend

    def cast_inputs(self, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(z, w1, w3, w2) in the dtype the experts compute in: the autocast dtype under autocast
        (as RoutedExperts: the op is not an autocast op), else the weights' dtype."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        if (dt := autocast_dtype(z)) is not None:
            return z.to(dt), w1.to(dt), w3.to(dt), w2.to(dt)
        return z.to(w1.dtype), w1, w3, w2

    def forward(self, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        z, w1, w3, w2 = self.cast_inputs(z)
        return expert_parallel_latent_experts(z, idx, p, w1, w3, w2, self.beta_gate, self.beta_up, self.group,
                                              backend=self.backend)  # fmt: skip

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [E, ...] tensor."""
        return full[self.offset : self.offset + self.num_local]

    @torch.no_grad()
    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full [E, ...] tensor from every rank's slice (collective over the EP group)."""
        parts = [torch.empty_like(local) for _ in range(self.ep_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)

    def extra_repr(self) -> str:
        return f"experts [{self.offset}, {self.offset + self.num_local}) of {self.num_experts}, ep={self.ep_size}"


def _check_divides(num_experts: int, ep: int) -> None:
    if num_experts % ep:
        raise ValueError(
            f"learner.expert_parallel={ep} must divide the model's num_experts={num_experts} "
            "(each rank keeps num_experts / expert_parallel routed experts)"
        )


def expert_parallel_groups(ep: int, device_type: str):
    """(EP group, replica group or None) of this rank: ranks form a [W / ep, ep] grid; an EP
    group is a row of ep contiguous ranks, the replicas of an expert slice are a column."""
    W = dist.get_world_size()
    if ep < 1 or W % ep:
        raise ValueError(f"learner.expert_parallel={ep} must divide the world size {W}")
    mesh = init_device_mesh(device_type, (W // ep, ep), mesh_dim_names=("ep_replicate", "ep"))
    replicate = mesh["ep_replicate"].get_group() if W > ep else None
    return mesh["ep"].get_group(), replicate


def apply_expert_parallel(model: nn.Module, group, replicate_group=None) -> nn.Module:
    """Shard the routed experts of every MoE layer over the ranks of `group` (in place).

    Call it on every rank of `group` with the same full weights, before FSDP (FSDP must then
    ignore the expert weights: `sharded_expert_params(model)`)."""
    ep = dist.get_world_size(group)
    targets = routed_experts(model)
    for _, _, m in targets:
        _check_divides(m.w1.shape[0], ep)  # every layer first: fail before changing anything
    for parent, child, m in targets:
        setattr(parent, child, ExpertParallelExperts(m, group, replicate_group))
    return model


def routed_experts(model: nn.Module) -> list[tuple[nn.Module, str, RoutedExperts]]:
    """(parent module, attribute name, module) of every `RoutedExperts` of the model."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, RoutedExperts):
            parent_name, _, child = name.rpartition(".")
            out.append((model.get_submodule(parent_name) if parent_name else model, child, m))
    return out


def expert_parallel_modules(model: nn.Module) -> dict[str, ExpertParallelExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}


def sharded_expert_params(model: nn.Module) -> dict[str, ExpertParallelExperts]:
    """Full parameter name -> the EP module owning it, for every rank-local expert weight."""
    return {f"{name}.{w}": m for name, m in expert_parallel_modules(model).items() for w in EXPERT_WEIGHTS}


def local_expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The rank-local expert weights (FSDP's `ignored_params`)."""
    return [getattr(m, w) for m in expert_parallel_modules(model).values() for w in EXPERT_WEIGHTS]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, scale: float = 1.0) -> None:
    """After the step's backward: sum each expert gradient over its replicas and multiply by
    `scale` (1 / W under the trainer's convention). An expert slice that received no token
    gets a zero gradient, as the slice of one process's full gradient would be."""
    for m in expert_parallel_modules(model).values():
        for name in EXPERT_WEIGHTS:
            p = getattr(m, name)
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if m.replicate_group is not None:
                dist.all_reduce(p.grad, group=m.replicate_group)
            if scale != 1.0:
                p.grad.mul_(scale)


@torch.no_grad()
def clip_grad_norm_with_experts(
    model: nn.Module, params: list[torch.Tensor], max_norm: float
) -> torch.Tensor:
    """`clip_grad_norm_` over FSDP (DTensor) gradients and rank-local expert gradients.

    ||g||^2 = ||g_fsdp||^2 + sum over the EP group of ||g_experts,rank||^2 (replicas hold the
    same slice, so each slice counts once); every gradient is then scaled by
    min(1, max_norm / (||g|| + 1e-6)), as torch.nn.utils.clip_grad_norm_ does. Collective.
    """
    modules = list(expert_parallel_modules(model).values())
    local = {id(p) for p in local_expert_params(model)}
    with_grad = [p for p in params if p.grad is not None]
    dense = [p.grad for p in with_grad if id(p) not in local]
    experts = [p.grad for p in with_grad if id(p) in local]
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if dense:
        norm = torch.nn.utils.get_total_norm(dense)
        sq = sq + (norm.full_tensor() if type(norm).__name__ == "DTensor" else norm).float() ** 2
    if modules:
        e_sq = torch.nn.utils.get_total_norm(experts).float() ** 2 if experts else torch.zeros_like(sq)
        dist.all_reduce(e_sq, group=modules[0].group)  # every EP module of a rank shares one group
        sq = sq + e_sq
    total = sq.sqrt()
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for p in with_grad:
        p.grad.mul_(coef)
    return total
