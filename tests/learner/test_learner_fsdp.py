"""FSDP2 data parallelism on CPU: two gloo processes equal one process on the same data.

Each rank gets the same full batch and trains on its share of the micro-batches; FSDP
all-gathers the parameters and reduce-scatters the gradients. The loss, the gradient norm
and the parameters after two steps must match a single process; a checkpoint saved by the
two ranks must resume to the same next step.
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

STEPS = 2


def _cfg(world: int, **kw) -> LearnerSection:
    return LearnerSection(micro_batch_tokens=48, steps=10, data_parallel="fsdp" if world > 1 else "none",
                          world_size=world, **kw)


def _qb_biases(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in t.full_state_dict().items() if k.endswith("e_score_correction_bias")}


def _model(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.preset("k3-tiny"))


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world, port):
        t = Trainer(_model(0), _cfg(world))
        metrics = [t.train_step(make_trajectories(s, n=8)) for s in range(STEPS)]
        state = t.full_state_dict()
        ckpt = os.path.join(out_dir, "ckpt")
        t.save_checkpoint(ckpt)
        after = t.train_step(make_trajectories(9, n=8))
        resumed = Trainer(_model(7), _cfg(world))
        resumed.load_checkpoint(ckpt)
        again = resumed.train_step(make_trajectories(9, n=8))
        qb = Trainer(_model(0), _cfg(world, qb_frozen=False))
        qb_metrics = qb.train_step(make_trajectories(0, n=8))
        results = {"metrics": metrics, "state": state, "after": after, "again": again,
                   "after_state": t.full_state_dict(), "again_state": resumed.full_state_dict(),
                   "qb_metrics": qb_metrics, "qb_bias": _qb_biases(qb)}  # collectives: every rank joins
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "fsdp.pt"))


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "fsdp.pt", weights_only=False)

    torch.set_num_threads(1)
    one = Trainer(_model(0), _cfg(1))
    metrics = [one.train_step(make_trajectories(s, n=8)) for s in range(STEPS)]
    state = one.full_state_dict()

    assert two["metrics"][0]["micro_batches"] < metrics[0]["micro_batches"]  # each rank did only its share
    for m1, m2 in zip(metrics, two["metrics"], strict=True):
        for key in ("loss", "pg_loss", "entropy", "is_ratio_mean", "clip_frac", "loss_tokens"):
            assert abs(m1[key] - m2[key]) <= 1e-5 * max(1.0, abs(m1[key])), (key, m1[key], m2[key])
        assert abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-5 * m1["grad_norm"]
    worst = max((state[k].float() - two["state"][k].float()).abs().max().item() for k in state)
    assert worst < 1e-5, worst
    # Quantile Balancing: the histograms of both ranks add up to the single-process histogram
    qb = Trainer(_model(0), _cfg(1, qb_frozen=False))
    qb_metrics = qb.train_step(make_trajectories(0, n=8))
    assert qb_metrics["qb_layers_updated"] == two["qb_metrics"]["qb_layers_updated"] == len(qb.model.moe_layer_ids)
    for name, bias in _qb_biases(qb).items():
        assert bias.abs().max() > 0, name
        assert torch.allclose(bias, two["qb_bias"][name], atol=1e-4), name
    # the sharded checkpoint (HF model + per-rank optimizer shards) resumes exactly
    assert two["after"]["loss"] == two["again"]["loss"]
    assert all(torch.equal(two["after_state"][k], two["again_state"][k]) for k in two["after_state"])
