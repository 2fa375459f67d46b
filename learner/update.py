"""One optimizer update of the Trainer and what follows it: the learning rate of a step
(`lr_at`), gradient clipping and the step (`clip_and_step`), QK-Clip of the MLA heads
(`apply_qk_clip`), Quantile Balancing's bias update (`qb_update`) and MoonEP's load metrics
and new plan (`moon_ep_step`). Under FSDP / expert parallel each is called on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .distributed import all_reduce_sum
from .expert_parallel import clip_grad_norm_with_experts, reduce_expert_grads
from .moon_ep import moon_ep_modules, replan_all
from .qk_clip import MaxLogitTracker, QKClip


def lr_at(step: int, total_steps: int, peak: float, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Cosine decay with linear warmup (docs/model.md §8.4), for 0-based `step`.

    warmup W = ceil(warmup_ratio * total):   lr = peak (step + 1) / W             for step < W
    then progress p = (step - W) / max(1, total - W), clamped to [0, 1]:
        lr = min + (peak - min) (1 + cos(pi p)) / 2,   min = peak * min_lr_ratio
    """
    total = max(1, total_steps)
    warmup = math.ceil(warmup_ratio * total)
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    lo = peak * min_lr_ratio
    return lo + (peak - lo) * 0.5 * (1.0 + math.cos(math.pi * p))


def sft_lr_at(step: int, learner) -> float:
    """The SFT warm start's rate at 0-based `step` (learner: the LearnerSection): one cosine (lr_at) of
    sft_lr over sft_steps, restarted at each of sft_phases that sets `lr`, from that peak over the steps
    up to the next restart (or sft_steps)."""
    restarts = [(0, learner.sft_lr)] + [(p.from_step, p.lr) for p in learner.sft_phases if p.lr is not None]
    if len(restarts) > 1 and restarts[1][0] == 0:  # a first phase at step 0 sets the first peak
        restarts = restarts[1:]
    i = max(k for k, (start, _) in enumerate(restarts) if start <= step)
    (start, peak), end = restarts[i], restarts[i + 1][0] if i + 1 < len(restarts) else max(1, learner.sft_steps)
    return lr_at(step - start, end - start, peak, learner.sft_warmup_ratio, learner.min_lr_ratio)


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, trainable: list[nn.Parameter], lr: float,
                  grad_clip: float, expert_parallel: int, world_size: int) -> float:
    """Clip the gradient norm to `grad_clip`, step the optimizer at `lr` and zero the gradients;
    returns the norm before clipping."""
    if expert_parallel > 1:
        # expert grads hold W x their share (loss x W, summed by the all-to-all backward): / W
        reduce_expert_grads(model, 1.0 / world_size)
        norm = clip_grad_norm_with_experts(model, trainable, grad_clip)
    else:
        grads = [p for p in trainable if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, grad_clip) if grads else torch.zeros(())
    if type(norm).__name__ == "DTensor":
        norm = norm.full_tensor()
    for moon in moon_ep_modules(model).values():  # strict MoonEP: a step with dropped routes
        moon.check_drops()  # stops before the optimizer applies it (raised on every rank at once)
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


@torch.no_grad()
def apply_qk_clip(qk_clip: QKClip | None, max_logits: MaxLogitTracker | None, world_size: int) -> dict[str, float]:
    """Rescale the MLA heads whose max logit of this step exceeded tau (after the update)."""
    if qk_clip is None:
        return {}
    maxima = max_logits.pop()
    clipped, top = 0, float("-inf")
    for name in sorted(maxima):
        S = maxima[name]
        if world_size > 1:
            dist.all_reduce(S, op=dist.ReduceOp.MAX)
        mla = max_logits.modules[name]
        gamma = qk_clip.apply(mla.q_b_proj.weight, mla.kv_b_proj.weight, S)
        clipped += int((gamma < 1).sum())
        top = max(top, float(S.max()))
    return {"qk_clip_heads": float(clipped), "mla_max_logit": top}


@torch.no_grad()
def qb_update(model: nn.Module, frozen: bool, world_size: int) -> int:
    """Sum the step's QB histograms over ranks (integer all-reduce) and set the next biases;
    returns the number of layers whose bias changed."""
    if not hasattr(model, "qb_step") or frozen:
        return 0
    if world_size == 1:
        return model.qb_step()
    # lazy: torch.distributed.tensor takes ~1 s to import; only FSDP runs need it
    from torch.distributed.tensor import distribute_tensor

    updated = 0
    for moe in model.moe_layers():
        dist.all_reduce(moe.qb.counts)
        dist.all_reduce(moe.qb.num_tokens)
        bias = moe.gate.e_score_correction_bias  # a sharded DTensor under FSDP
        sharded = type(bias).__name__ == "DTensor"
        new = moe.qb.new_bias(bias.full_tensor() if sharded else bias)
        if new is None:
            continue
        if sharded:
            new = distribute_tensor(new, bias.device_mesh, bias.placements, src_data_rank=None)
        bias.copy_(new)
        updated += 1
    return updated


def moon_ep_step(model: nn.Module, replan: bool) -> dict[str, float]:
    """After a step under MoonEP: the load metrics of its forwards (mean over layers and forwards
    of max / mean rows per rank, MoonEP's and plain EP's; routes dropped on all ranks), then, when
    `replan` (not every forward plans its own), a new plan from the step's routes. Collective;
    {} without MoonEP."""
    layers = list(moon_ep_modules(model).values())
    if not layers:
        return {}
    stats = [m.pop_load_stats() for m in layers]
    dropped = all_reduce_sum({"dropped": torch.tensor(float(sum(s[2] for s in stats)))})["dropped"]
    if replan:
        replan_all(model)
    return {
        "moe/ep_imbalance": sum(s[0] for s in stats) / len(stats),
        "moe/ep_imbalance_plain_ep": sum(s[1] for s in stats) / len(stats),
        "moe/dropped_routes": float(dropped),
    }
