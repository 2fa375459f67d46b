"""Data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`), applied *to* the model.

The model knows nothing about it (torchtitan style): each decoder layer is one FSDP unit
(parameters all-gathered for its forward and backward, gradients reduce-scattered), the
root unit holds the embedding, head, vision tower and the rest. Works with NCCL on GPUs
and with gloo on CPUs (the tests run two CPU processes).

FSDP averages gradients over ranks; the trainer's loss is a partial *sum* with weights of
the whole step, so it multiplies the loss by the world size to get the full-batch gradient.

With expert parallelism (`expert_parallel.py`, applied first) the rank-local expert slices
are FSDP's `ignored_params`: FSDP neither shards nor reduces them, the EP all-to-alls and
`reduce_expert_grads` take care of them, and the state-dict helpers below gather / slice them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from .expert_parallel import sharded_expert_params

__all__ = [
    "is_distributed",
    "rank_and_world",
    "apply_fsdp",
    "all_reduce_sum",
    "all_reduce_max",
    "full_state_dict",
    "load_full_state_dict",
]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def apply_fsdp(
    model: nn.Module, device: torch.device, ignored_params: set[nn.Parameter] | None = None
) -> nn.Module:
    """Shard `model` over all ranks of the default process group (in place; returns it).

    `ignored_params` stay plain rank-local tensors (the expert slices under expert parallelism)."""
    if not is_distributed():
        raise RuntimeError(
            "data_parallel='fsdp' needs an initialised process group: call "
            "torch.distributed.init_process_group (nccl for GPUs, gloo for CPUs) in every rank first"
        )
    # lazy: FSDP takes ~1 s to import; only FSDP runs need it
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None:
        for layer in layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored_params)
    fully_shard(model, mesh=mesh, ignored_params=ignored_params)
    return model


def all_reduce_sum(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum scalar tensors over ranks (one collective for all of them)."""
    if not is_distributed() or not values:
        return values
    keys = sorted(values)
    flat = torch.stack([values[k].detach().double().reshape(()).to(_collective_device()) for k in keys])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return {k: flat[i] for i, k in enumerate(keys)}


def _collective_device() -> torch.device:
    """Where small reduction buffers must live: NCCL only reduces CUDA tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    if not is_distributed():
        return value
    v = value.detach().double().reshape(1).clone().to(_collective_device())
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v[0].to(value.device)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict on the CPU, on every rank (collective)."""
    experts = sharded_expert_params(model)
    state = model.state_dict()
    out = {}
    for name, t in state.items():
        if type(t).__name__ == "DTensor":
            t = t.full_tensor()
        elif name in experts:  # this rank's E / ep experts -> all E
            t = experts[name].gather(t)
        out[name] = t.detach().cpu()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a (possibly sharded) model: each rank keeps its own shard."""
    # lazy: torch.distributed.tensor takes ~1 s to import; only FSDP runs need it
    from torch.distributed.tensor import distribute_tensor

    experts = sharded_expert_params(model)
    keys = set(model.state_dict())
    own = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers()) if n in keys}
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(f"load_full_state_dict: the state lacks {len(missing)} tensors, e.g. {missing[:5]}")
    for name, target in own.items():
        value = state[name]
        if name in experts:
            value = experts[name].local_slice(value)
        value = value.to(device=target.device, dtype=target.dtype)
        if type(target).__name__ == "DTensor":
            value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
        target.copy_(value)
