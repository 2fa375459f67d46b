"""Which bytes of a checkpoint each learner rank reads, before anything is read (docs/model.md §12).

The learner's W ranks form a [W / ep, ep] grid (learner/expert_parallel.py): rank r owns the routed
experts [(r mod ep) E/ep, (r mod ep + 1) E/ep) of every MoE layer, and FSDP shards every other
tensor over all W ranks along its first dimension (rank r holds rows [r c, (r+1) c), c = ceil(R / W)).
So a rank reads

    its experts' tensors whole        weight_packed + weight_scale (MXFP4) or .weight, every MoE layer
    its rows of every other tensor    safetensors are read by byte range, so a slice costs its own bytes

and opens only the shards those bytes are in. `plan_loading` works from the index and the shard
headers (`checkpoint.stored_tensors`) or, for a checkpoint that does not exist, from the names and
shapes `state_dict_adapter.hf_layout` lists on the `meta` device.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .checkpoint import StoredTensor, assign_shards, match_checkpoint
from .model import FP32_PARAM_SUFFIXES


@dataclass
class RankPlan:
    rank: int
    experts: range  # the routed experts this rank loads, in every MoE layer
    shards: list[str]  # the files it opens
    read_bytes: int  # bytes it reads from them
    expert_read_bytes: int  # of which routed experts
    held_bytes: int  # what it holds once loaded, in the plan's dtype (experts dequantised, fp32 allow-list in fp32)


def expert_parallel_size(num_experts: int, world_size: int) -> int:
    """The largest EP size that divides both the experts and the ranks (896 experts on 256 ranks: 128)."""
    return max(ep for ep in range(1, world_size + 1) if world_size % ep == 0 and num_experts % ep == 0)


def _rows(total: int, world_size: int, rank: int) -> int:
    chunk = -(-total // world_size)
    return max(0, min(total, (rank + 1) * chunk) - rank * chunk)


def plan_loading(stored: dict[str, StoredTensor], expected: dict[str, torch.Tensor], world_size: int,
                 expert_parallel: int, dtype: torch.dtype = torch.bfloat16) -> list[RankPlan]:
    """One RankPlan per rank. `expected` is our state dict (`meta` tensors are enough); every stored
    name is resolved against it first (CheckpointMismatchError names what does not fit)."""
    targets = match_checkpoint(stored, expected)
    num_experts = {t.key: expected[t.key].shape[0] for t in targets.values() if t.expert is not None}
    E = next(iter(num_experts.values()), 0)
    if world_size % expert_parallel or (E and E % expert_parallel):
        raise ValueError(f"expert_parallel={expert_parallel} must divide the world size {world_size} "
                         f"and the {E} routed experts")
    # experts: bytes by (expert, file), summed over layers and parts; what one expert row holds
    expert_reads: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, t in targets.items():
        if t.expert is not None:
            expert_reads[t.expert][stored[name].file] += stored[name].nbytes
    expert_held = sum(expected[k][0].numel() for k in num_experts) * dtype.itemsize
    dense = [(name, t) for name, t in targets.items() if t.expert is None]
    plans = []
    for rank in range(world_size):
        per_file: dict[str, int] = defaultdict(int)
        held = 0
        for name, t in dense:
            s, value = stored[name], expected[t.key]
            stored_rows, rows = (s.shape or (1,))[0], (value.shape or (1,))[0]
            read = _rows(stored_rows, world_size, rank)
            if read:
                per_file[s.file] += s.nbytes * read // stored_rows
            itemsize = 4 if t.key.endswith(FP32_PARAM_SUFFIXES) else dtype.itemsize
            held += _rows(rows, world_size, rank) * (value.numel() // max(1, rows)) * itemsize
        dense_bytes = sum(per_file.values())
        n_local = E // expert_parallel if E else 0
        first = (rank % expert_parallel) * n_local
        experts = range(first, first + n_local)
        for e in experts:
            for f, b in expert_reads[e].items():
                per_file[f] += b
        total = sum(per_file.values())
        plans.append(RankPlan(rank, experts, sorted(f for f, b in per_file.items() if b), total, total - dense_bytes,
                              held + n_local * expert_held))
    return plans


def synthetic_index(layout: dict[str, tuple[tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> dict[str, StoredTensor]:
    """The StoredTensors a checkpoint of `layout` (`hf_layout`) would have if `save_hf` wrote it with
    shards of at most `max_shard_bytes`: an index to plan from without writing (or having) the weights."""
    files = assign_shards(layout, max_shard_bytes)
    out = {}
    for name, (shape, dtype) in layout.items():
        n = 1
        for s in shape:
            n *= s
        out[name] = StoredTensor(files[name], dtype, tuple(shape), n * dtype.itemsize)
    return out
