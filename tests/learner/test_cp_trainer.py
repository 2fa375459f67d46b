"""The Trainer under context parallelism: two gloo ranks (world_size = context_parallel = 2)
split every packed micro-batch's positions and take the same steps as one process.

Both ranks get the same micro-batches, feed their shard of the positions with the whole
sequence's cu_seqlens, and their loss terms and gradients add up to one process's. An RL step
(two minibatches: the old policy's log-probs are recorded first; a KL term against the
reference policy, itself run context-parallel; Quantile Balancing histograms summed over the
ranks; routing replay with the probe forward for the tokens without a record) in the zigzag
layout and an SFT step in the contiguous one: loss, grad norm and every gradient equal one
process's to fp32 rounding, and so do the updated weights. One spawn runs both.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from learner_helpers import gloo_group, make_trajectories

from k3rl.cluster import free_port
from k3rl.config import LearnerSection
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM

RL = dict(minibatches=2, kl_coef=0.1, qb_frozen=False, context_parallel_zigzag=True)


def _cfg(world: int, **kw) -> LearnerSection:
    cp = dict(data_parallel="fsdp", world_size=world, context_parallel=world) if world > 1 else {}
    return LearnerSection(micro_batch_tokens=64, steps=10, **cp, **kw)


def _model() -> K3ForCausalLM:
    torch.manual_seed(0)
    cfg = K3Config.preset("k3-tiny")
    cfg.kernel_backend = "torch"
    return K3ForCausalLM(cfg)


def _with_routes(trajectories):
    """Recorded experts (routing replay) for the even completion tokens; the odd ones have no record, so
    the trainer's routing probe (a forward of its own, context-parallel too) fills them."""
    gen = torch.Generator().manual_seed(3)
    cfg = K3Config.preset("k3-tiny")
    n_moe, k = len(cfg.moe_layer_ids), cfg.num_experts_per_token
    for t in trajectories:
        t.routed_experts = [torch.randperm(cfg.num_experts, generator=gen)[:k].repeat(n_moe, 1).tolist()
                            if j % 2 == 0 else [] for j in range(len(t.completion_ids))]  # fmt: skip
    return trajectories


def _recording_grads(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Every optimizer update's full gradients (gathered from the FSDP shards: every rank calls it)."""
    grads, step = [], trainer.optimizer.step

    def recorded(*args, **kwargs):
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for n, p in trainer.model.named_parameters() if p.grad is not None})  # fmt: skip
        return step(*args, **kwargs)

    trainer.optimizer.step = recorded
    return grads


def _steps(world: int) -> dict:
    rl = Trainer(_model(), _cfg(world, **RL))
    rl_grads = _recording_grads(rl)
    rl_metrics = rl.train_step(_with_routes(make_trajectories(0, n=8)))
    sft = Trainer(_model(), _cfg(world))
    sft_grads = _recording_grads(sft)
    sft_metrics = sft.sft_step(make_trajectories(5, n=4))
    return {"rl": rl_metrics, "rl_grads": rl_grads, "rl_state": rl.full_state_dict(),
            "sft": sft_metrics, "sft_grads": sft_grads, "sft_state": sft.full_state_dict()}  # fmt: skip


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world, port):
        results = _steps(world)  # collectives: every rank joins
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "cp.pt"))


def _close(a: float, b: float, key: str) -> None:
    assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)


@pytest.mark.slow
def test_context_parallel_trainer_equals_one_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "cp.pt", weights_only=False)
    torch.set_num_threads(1)
    one = _steps(1)

    assert one["rl"]["updates"] == two["rl"]["updates"] == 2
    assert one["rl"]["micro_batches"] == two["rl"]["micro_batches"]  # every rank ran every micro-batch
    assert one["rl"]["qb_layers_updated"] > 0
    for key in ("loss", "pg_loss", "kl", "entropy", "is_ratio_mean", "clip_frac", "approx_kl", "loss_tokens",
                "grad_norm", "grad_norm_max", "qb_layers_updated"):
        _close(one["rl"][key], two["rl"][key], f"rl/{key}")
    for key in ("loss", "nll", "loss_tokens", "grad_norm"):
        _close(one["sft"][key], two["sft"][key], f"sft/{key}")
    for part in ("rl_grads", "sft_grads"):  # every parameter's gradient of every update, to fp32 rounding
        assert len(one[part]) == len(two[part]) > 0
        for g1, g2 in zip(one[part], two[part], strict=True):
            assert g1.keys() == g2.keys()
            scale = max(g.abs().max().item() for g in g1.values())  # the update's largest gradient entry
            worst = max(((g1[k] - g2[k]).abs().max().item(), k) for k in g1)
            assert worst[0] <= 1e-4 * scale, (part, worst, scale)
    # the updated weights: Muon and AdamW normalise the update, which lifts rounding in near-zero gradient
    # entries to a fraction of an update (lr 3e-3), so compare against 5% of the largest change
    start = _model().state_dict()
    for part in ("rl_state", "sft_state"):
        moved = max((one[part][k].float() - start[k].float()).abs().max().item() for k in start)
        worst = max((one[part][k].float() - two[part][k].float()).abs().max().item() for k in one[part])
        assert worst < 0.05 * moved, (part, worst, moved)


@pytest.mark.parametrize("kw, path", [
    (dict(context_parallel=2), "context_parallel"),  # needs FSDP with world_size equal to it
    (dict(context_parallel=2, world_size=4, data_parallel="fsdp"), "context_parallel"),
    (dict(context_parallel=2, world_size=2, data_parallel="fsdp", expert_parallel=2), "context_parallel"),
    (dict(context_parallel=2, world_size=2, data_parallel="fsdp", tis_level="sequence"), "tis_level"),
])  # fmt: skip
def test_context_parallel_refuses_what_it_cannot_do(kw, path):
    with pytest.raises(ValueError, match=f"{path}: "):
        LearnerSection(**kw)
