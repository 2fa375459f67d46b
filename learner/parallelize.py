"""The learner's parallelism applied to a built model, in place, as its `learner:` config asks:
the routed experts sharded over groups of `expert_parallel` ranks (plain EP, expert_parallel.py,
or MoonEP, moon_ep.py), context parallelism (context_parallel_layers.py) and FSDP2 over the rest
(distributed.py). The model knows nothing of it (docs/parallel.md)."""

from __future__ import annotations

import torch
from torch import nn

from .context_parallel_layers import ContextParallel
from .distributed import apply_fsdp
from .expert_parallel import apply_expert_parallel, expert_parallel_groups, local_expert_params
from .moon_ep import apply_moon_ep


def parallelize(model: nn.Module, config, device: torch.device, world_size: int):
    """Shard `model` over the process group as `config` (a `k3rl.config.LearnerSection`) asks;
    returns the `ContextParallel` every forward takes, or None without context parallelism."""
    expert_parallel = getattr(config, "expert_parallel", 1)
    if expert_parallel > 1:
        ep_group, replicate_group = expert_parallel_groups(expert_parallel, device.type)
        moon = getattr(config, "moon_ep", None)
        if moon is not None and moon.enabled:  # tokens a rank: a micro-batch's
            apply_moon_ep(model, ep_group, moon.slots, config.micro_batch_tokens, moon.margin, moon.allow_drops,
                          moon.plan_per_batch, replicate_group)  # fmt: skip
        else:
            apply_expert_parallel(model, ep_group, replicate_group)
    # context parallelism: every rank gets the same micro-batches and trains on its part of their positions
    context_parallel = None
    if getattr(config, "context_parallel", 1) > 1:
        if config.context_parallel != world_size:
            raise ValueError(f"learner.context_parallel={config.context_parallel} must equal the world size "
                             f"{world_size} (data parallelism beyond it is not supported yet)")
        context_parallel = ContextParallel(zigzag=config.context_parallel_zigzag)
    if config.data_parallel == "fsdp":
        # FSDP shards everything but the expert slices (EP shards those)
        apply_fsdp(model, device, ignored_params=set(local_expert_params(model)))
    return context_parallel
