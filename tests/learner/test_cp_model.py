"""The whole K3 model under context parallelism: gloo groups of 2 and 4 ranks equal one process.

k3-tiny (KDA, Gated MLA, AttnRes, LatentMoE) on one packed sequence of ragged documents: one
spans three ranks (of 4), one is a single token, others cross rank boundaries. Each rank feeds
its shard of the token ids to ``model(..., cu_seqlens=whole, context_parallel=cp)``; its logits
must be its shard of one process's logits, the ranks' losses must add up to one process's loss,
and every parameter's gradient summed over the ranks must equal one process's gradient, to fp32
rounding: with the contiguous layout, and with the zigzag layout under activation checkpointing
(the recompute runs the collectives again). One spawn per world size runs both.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from k3rl.learner.context_parallel_layers import ContextParallel
from k3rl.learner.distributed import free_port
from k3rl.learner.model import K3Config, K3ForCausalLM

T = 120
# world 4 holds [0,30) [30,60) [60,90) [90,120): [9,70) spans three ranks, [70,71) is one token,
# [71,100) crosses 90; world 2 cuts [9,70) at 60
CU = torch.tensor([0, 9, 70, 71, 100, 120])
LAYOUTS = [False, True]  # contiguous; zigzag (with activation checkpointing)


def _model() -> K3ForCausalLM:
    torch.manual_seed(0)
    config = K3Config.preset("k3-tiny")
    config.kernel_backend = "torch"
    return K3ForCausalLM(config)


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, T), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _run(model, ids, targets, **kw):
    """(logits, summed cross-entropy, gradients) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, cu_seqlens=CU, **kw)
    loss = F.cross_entropy(logits[0].float(), targets[0], reduction="sum")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        res = {}
        ids, targets = _inputs()
        model = _model()
        for zigzag in LAYOUTS:
            cp = ContextParallel(zigzag=zigzag)
            model.gradient_checkpointing = zigzag
            res[zigzag] = _run(model, cp.shard(ids), cp.shard(targets), context_parallel=cp)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"cp_model{world}")
    mp.spawn(_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    torch.set_num_threads(1)
    return world, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def one_process():
    torch.set_num_threads(1)
    return _run(_model(), *_inputs())


def _close(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 2e-5) -> None:
    err = (got - want).abs().max().item()
    assert err <= rel * max(1e-3, want.abs().max().item()), (name, err, want.abs().max().item())


@pytest.mark.parametrize("zigzag", LAYOUTS, ids=["contiguous", "zigzag-checkpointed"])
def test_cp_model_forward_and_backward_equal_one_process(ranks, one_process, zigzag):
    world, res = ranks
    logits, loss, grads = one_process
    from k3rl.learner.context_parallel import context_layout, shard

    layout = context_layout(T, world, zigzag)
    for rank in range(world):
        _close(res[rank][zigzag][0], shard(logits, layout[rank]), f"logits rank {rank}")
    _close(sum(res[r][zigzag][1] for r in range(world)), loss, "loss")
    assert all(res[r][zigzag][2].keys() == grads.keys() for r in range(world))
    assert any(".self_attn.A_log" in n for n in grads) and any(".mlp.experts.w1" in n for n in grads)
    for name, want in grads.items():  # replicated weights: each rank's covers its own tokens
        _close(sum(res[r][zigzag][2][name] for r in range(world)), want, f"d{name}", rel=5e-5)


def test_cp_model_refuses_what_it_cannot_split():
    model, cp = _model(), ContextParallel()
    ids, _ = _inputs()
    with pytest.raises(ValueError, match="pass cu_seqlens"):
        model(ids, context_parallel=cp)
    with pytest.raises(ValueError, match="vision tower does not run context-parallel"):
        model(ids, cu_seqlens=CU, images=[], context_parallel=cp)
    with pytest.raises(ValueError, match="no cache"):
        model(ids, cu_seqlens=CU, cache=model.new_cache(1), context_parallel=cp)
