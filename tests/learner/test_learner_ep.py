"""Expert parallelism on CPU: two gloo processes, each holding half of k3-tiny's routed experts,
equal one process holding all of them.

One spawn runs every distributed check (the process start dominates the cost):
- the model with EP=2 alone: each rank runs its own sequence; logits, the MoE layer's
  output and input gradient, and the gradients equal one process on both sequences;
  each rank's expert gradients are the slice of the full gradient for its experts; a
  routing that sends nothing to one rank still runs (and its experts get no gradient);
- the Trainer with FSDP + EP=2: parameter shapes (E/2 experts a rank), full state dict and
  weight export gathered back bit for bit, loss / gradient norm / weights after a few
  steps equal to one process, a checkpoint that resumes to the same next step;
- a model whose expert count the EP size does not divide is refused with the field's name.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from learner_helpers import gloo_group, make_trajectories

from k3rl.cluster import free_port
from k3rl.config import ConfigError, JobConfig, LearnerSection
from k3rl.learner.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
    local_expert_params,
    reduce_expert_grads,
)
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM

STEPS = 3
EP = 2
T = 24  # tokens of each rank's sequence


def _cfg(world: int, ep: int = 1, **kw) -> LearnerSection:
    return LearnerSection(
        micro_batch_tokens=48,
        steps=10,
        data_parallel="fsdp" if world > 1 else "none",
        world_size=world,
        expert_parallel=ep,
        **kw,
    )


def _model(seed: int, **overrides) -> K3ForCausalLM:
    torch.manual_seed(seed)
    config = K3Config.preset("k3-tiny")
    if overrides:
        config = K3Config.model_validate({**config.model_dump(), **overrides})
    return K3ForCausalLM(config)


def _inputs():
    """Per rank: token ids [1, T], logit weights [1, T, V], MoE-layer input x [T, d]."""
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, 256, (EP, 1, T), generator=g)
    w = torch.randn(EP, 1, T, 320, generator=g)
    x = torch.randn(EP, T, 128, generator=g)
    return ids, w, x


def _first_moe(model):
    return model.moe_layers()[0]


def _model_run(model, ids, w):
    """Forward and backward of one rank's sequence; returns the logits."""
    logits = model(ids)
    (logits * w).sum().backward()
    return logits.detach()


def _layer_run(model, x, replay=None, autocast=False):
    """The first MoE layer alone: (output, input gradient)."""
    moe = _first_moe(model)
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, _ = moe(x, replay)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach().float(), x.grad


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world, port):
        res: dict = {}
        # -- the model with EP alone ------------------------------------------------------
        ids, w, x = _inputs()
        model = apply_expert_parallel(_model(0), dist.group.WORLD)
        res["logits"] = _model_run(model, ids[rank], w[rank])
        res["grads"] = _grads(model)  # experts: this rank's slice; the rest: this rank's data only
        res["y"], res["x_grad"] = _layer_run(model, x[rank])
        res["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
        res["ep_modules"] = sum(isinstance(m, ExpertParallelExperts) for m in model.modules())
        # bf16 autocast, and a routing that sends every token to rank 0's experts
        model.zero_grad(set_to_none=True)
        res["y_bf16"], res["x_grad_bf16"] = _layer_run(model, x[rank], autocast=True)
        model.zero_grad(set_to_none=True)
        replay = torch.tensor([[0, 1], [2, 3]]).repeat(T // 2, 1)  # experts 0..3 live on rank 0
        res["y_rank0"], res["x_grad_rank0"] = _layer_run(model, x[rank], replay)
        res["expert_grad_rank0"] = _first_moe(model).experts.w1.grad
        reduce_expert_grads(model)
        res["expert_grad_rank0_reduced"] = _first_moe(model).experts.w1.grad.clone()

        # -- the Trainer with FSDP + EP ------------------------------------------------------
        t = Trainer(_model(0), _cfg(world, EP))
        local = {id(p) for p in local_expert_params(t.model)}
        res["trainer_params"] = {
            n: (tuple(p.shape), type(p).__name__, id(p) in local) for n, p in t.model.named_parameters()
        }
        res["state0"] = t.full_state_dict()
        res["export0"] = t.export_weights(0).state_dict()
        res["metrics"] = [t.train_step(make_trajectories(s, n=8)) for s in range(STEPS)]
        res["sft"] = t.sft_step(make_trajectories(5, n=4))
        res["state"] = t.full_state_dict()
        ckpt = os.path.join(out_dir, "ckpt")
        t.save_checkpoint(ckpt)
        res["after"] = t.train_step(make_trajectories(9, n=8))
        resumed = Trainer(_model(7), _cfg(world, EP))
        resumed.load_checkpoint(ckpt)
        res["again"] = resumed.train_step(make_trajectories(9, n=8))
        res["after_state"], res["again_state"] = t.full_state_dict(), resumed.full_state_dict()

        # -- a model whose 3 experts do not split over 2 ranks ---------------------------------
        try:
            Trainer(_model(0, num_experts=3), _cfg(world, EP))
            res["bad"] = None
        except ValueError as e:
            res["bad"] = str(e)
        torch.save(res, os.path.join(out_dir, f"ep{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    mp.spawn(_worker, args=(EP, free_port(), str(out)), nprocs=EP, join=True)
    torch.set_num_threads(1)
    return [torch.load(out / f"ep{r}.pt", weights_only=False) for r in range(EP)], out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: fp32 rounding of sums in another order stays near 1e-6."""
    return _max_diff(a, b) / max(b.float().abs().max().item(), 1e-12)


def _one_process(**layer_kw):
    """Both ranks' data through one full model: per-rank logits, the summed gradients of
    the sequences, per-rank MoE-layer (output, input grad), the layer run's expert gradients."""
    ids, w, x = _inputs()
    model = _model(0)
    logits = [_model_run(model, ids[r], w[r]) for r in range(EP)]
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    layer = [_layer_run(model, x[r], **layer_kw) for r in range(EP)]
    return logits, grads, layer, _grads(model)


def _expert_slice(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    n = full.shape[0] // EP
    return full[rank * n : (rank + 1) * n]


def _is_expert(name: str) -> bool:
    return ".experts.w" in name


@pytest.mark.slow
def test_ep_forward_and_input_gradients_equal_one_process(ranks):
    two, _ = ranks
    logits, _, layer, _ = _one_process()
    for r in range(EP):
        diffs = [
            _max_diff(logits[r], two[r]["logits"]),
            _max_diff(layer[r][0], two[r]["y"]),
            _max_diff(layer[r][1], two[r]["x_grad"]),
        ]
        assert max(diffs) < 1e-5, (r, diffs)
    _, _, layer16, _ = _one_process(autocast=True)  # bf16 autocast: the same ops in the same order
    for r in range(EP):
        diffs = [_max_diff(layer16[r][0], two[r]["y_bf16"]), _max_diff(layer16[r][1], two[r]["x_grad_bf16"])]
        assert max(diffs) < 1e-2, (r, diffs)


@pytest.mark.slow
def test_ep_gradients_equal_one_process(ranks):
    two, _ = ranks
    _, full, _, _ = _one_process()
    names = [n for n in full if _is_expert(n)]
    assert len(names) == 3 * len(_model(0).moe_layers())
    worst_expert = worst_other = 0.0
    for name, g in full.items():
        if _is_expert(name):  # each rank: the slice of its experts, all tokens' contributions
            for r in range(EP):
                worst_expert = max(worst_expert, _rel_diff(two[r]["grads"][name], _expert_slice(name, g, r)))
        else:  # replicated weights: each rank saw its own data; the sum is the full gradient
            worst_other = max(worst_other, _rel_diff(sum(two[r]["grads"][name] for r in range(EP)), g))
    assert worst_expert < 5e-5 and worst_other < 5e-5, (worst_expert, worst_other)


@pytest.mark.slow
def test_ep_routing_to_one_rank_only(ranks):
    """Every route lands on rank 0's experts: rank 1 receives no rows but joins the exchanges."""
    two, _ = ranks
    replay = torch.tensor([[0, 1], [2, 3]]).repeat(T // 2, 1)
    _, _, layer, full = _one_process(replay=replay)
    for r in range(EP):
        assert _max_diff(layer[r][0], two[r]["y_rank0"]) < 1e-5
        assert _max_diff(layer[r][1], two[r]["x_grad_rank0"]) < 1e-5
    moe = "model.layers.1.mlp.experts.w1"
    assert moe in full
    assert two[1]["expert_grad_rank0"] is None  # no token reached rank 1's experts
    assert torch.equal(
        two[1]["expert_grad_rank0_reduced"], torch.zeros(4, 64, 64)
    )  # zero-filled, like one process
    assert _max_diff(two[0]["expert_grad_rank0"], _expert_slice(moe, full[moe], 0)) < 1e-5


@pytest.mark.slow
def test_each_rank_holds_half_of_the_experts(ranks):
    two, _ = ranks
    one = {n: tuple(p.shape) for n, p in _model(0).named_parameters()}
    n_moe = len(_model(0).moe_layers())
    for r in range(EP):
        assert two[r]["ep_modules"] == n_moe
        assert two[r]["shapes"].keys() == one.keys()
        for name, shape in one.items():
            if _is_expert(name):
                assert two[r]["shapes"][name] == (shape[0] // EP, *shape[1:]), name
            else:
                assert two[r]["shapes"][name] == shape, name
        # under FSDP: expert slices are plain local tensors, everything else is an FSDP DTensor
        params = two[r]["trainer_params"]
        experts = {n for n in params if _is_expert(n)}
        assert {n for n, (_, _, loc) in params.items() if loc} == experts
        for name, (shape, kind, _) in params.items():
            if name in experts:
                assert kind != "DTensor" and shape == (one[name][0] // EP, *one[name][1:]), name
            else:
                assert kind == "DTensor", name
        local = sum(torch.Size(params[n][0]).numel() for n in experts)
        assert local * EP == sum(torch.Size(one[n]).numel() for n in experts)


@pytest.mark.slow
def test_ep_trainer_state_and_export_are_full_and_exact(ranks):
    two, _ = ranks
    one = Trainer(_model(0), _cfg(1))
    state, export = one.full_state_dict(), one.export_weights(0).state_dict()
    for r in range(EP):
        assert two[r]["state0"].keys() == state.keys()
        assert all(torch.equal(state[k], two[r]["state0"][k]) for k in state)  # bit-exact, all E experts
        assert two[r]["export0"].keys() == export.keys()
        assert all(torch.equal(export[k], two[r]["export0"][k]) for k in export)


@pytest.mark.slow
def test_ep_trainer_steps_equal_one_process(ranks):
    two, _ = ranks
    one = Trainer(_model(0), _cfg(1))
    metrics = [one.train_step(make_trajectories(s, n=8)) for s in range(STEPS)]
    sft = one.sft_step(make_trajectories(5, n=4))
    state = one.full_state_dict()
    for m1, m2 in zip(metrics + [sft], two[0]["metrics"] + [two[0]["sft"]], strict=True):
        for key in ("loss", "grad_norm", "loss_tokens"):
            # the norm of the SFT step after 4 RL steps: the two layouts' fp32 rounding has grown to ~5e-5
            tol = 1e-4 if key == "grad_norm" else 1e-5
            assert abs(m1[key] - m2[key]) <= tol * max(1.0, abs(m1[key])), (key, m1[key], m2[key])
    start = _model(0).state_dict()
    moved = max(_max_diff(state[k], start[k]) for k in state if _is_expert(k))
    assert moved > 1e-3  # the experts did train
    for r in range(EP):
        # expert weights (Muon, per expert): within fp32 rounding of one process (Newton-Schulz
        # amplifies the layouts' rounding in small singular directions: 2.6e-6 measured after these
        # 4 RL + 1 SFT steps, 10x below one update's size, lr * 0.2 = 6e-4)
        worst_expert = max(_max_diff(state[k], two[r]["state"][k]) for k in state if _is_expert(k))
        assert worst_expert < 1e-5, (r, worst_expert)
        # all weights: AdamW turns the rounding of near-zero gradients (embedding rows, lm_head)
        # into differences of ~lr * 1e-2; FSDP alone gives 2.5e-5 on lm_head in these 4 steps
        # (1.9e-4 since norms and embeddings take no weight decay: still 1/16 of one AdamW step, lr = 3e-3)
        worst = max(_max_diff(state[k], two[r]["state"][k]) for k in state)
        assert worst < 5e-4, (r, worst)
    # the checkpoint (HF model with all experts + per-rank optimizer shards) resumes exactly
    for r in range(EP):
        assert two[r]["after"]["loss"] == two[r]["again"]["loss"]
        assert all(
            torch.equal(two[r]["after_state"][k], two[r]["again_state"][k]) for k in two[r]["after_state"]
        )


@pytest.mark.slow
def test_ep_that_does_not_divide_the_experts_is_refused(ranks):
    two, _ = ranks
    for r in range(EP):
        assert two[r]["bad"] is not None and "learner.expert_parallel=2" in two[r]["bad"], two[r]["bad"]
        assert "num_experts=3" in two[r]["bad"]
    with pytest.raises(ConfigError, match=r"learner.expert_parallel=3 must divide the model's num_experts=8"):
        JobConfig.from_dict({"learner": {"expert_parallel": 3, "world_size": 3, "data_parallel": "fsdp"}})
    with pytest.raises(ConfigError, match="expert_parallel=2 must divide world_size=3"):
        JobConfig.from_dict({"learner": {"expert_parallel": 2, "world_size": 3, "data_parallel": "fsdp"}})
    with pytest.raises(ConfigError, match="expert_parallel=2 needs data_parallel='fsdp'"):
        JobConfig.from_dict({"learner": {"expert_parallel": 2, "world_size": 2}})
