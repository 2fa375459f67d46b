"""MoonEP (learner/moon_ep.py): the balanced, static-shape expert parallel layer on gloo process
groups of 2 and 4 ranks (its plan: test_moon_ep_plan.py).

One spawn per group size runs every distributed check (process start dominates the cost): on
skewed routing (60% of the routes to experts 0 and 1), MoonEP's output, input gradient and
home-expert gradients equal plain EP's and one process's, with a plan from the previous step and
with a plan per batch (then every rank computes exactly S k rows, also when every route goes to
one rank's experts); a rank that receives nothing still joins the exchanges; routes beyond the
capacity are counted on the device and are an error on every rank at once at the next check
(`check_drops`), or, when allowed, left out of the output exactly; the experts compute a buffer
of the same number of rows whatever the routing, and a forward's local steps read nothing on the
host (they run on fake tensors; on a Hopper GPU, the whole forward under
`torch.cuda.set_sync_debug_mode("error")`); bad settings are refused; with 2 ranks, k3-tiny with
MoonEP in every MoE layer equals k3-tiny with plain EP, and the Trainer (FSDP + EP) with
`learner.moon_ep`, replanned after each step or planned per batch, takes the same steps as with
plain EP (losses, gradient norms, updated weights), logging the load imbalance and no dropped
routes. The config refuses MoonEP without EP, more slots than a rank can fill, and micro-batches
shorter than an episode.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from learner_helpers import gloo_group, make_trajectories
from torch._subclasses.fake_tensor import FakeTensorMode

import k3rl.learner.moon_ep as moon_ep
from k3rl.cluster import free_port
from k3rl.config import ConfigError, JobConfig, LearnerSection
from k3rl.kernels.moe import GROUP_ALIGN, latent_experts_loop
from k3rl.learner.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from k3rl.learner.moon_ep import (
    MoonEPExperts,
    _position_per_dest,
    apply_moon_ep,
    expert_slots,
    moon_ep_modules,
    plan_redundant_experts,
    rank_loads,
    replan_all,
    route_destinations,
    rows_per_rank,
)
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.moe import RoutedExperts

E, K, N, LAT, F = 8, 2, 32, 16, 24  # experts, routes a token, tokens a rank, latent width, expert width


def _zipf(E: int, s: float = 1.1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (1.0 / torch.arange(1, E + 1).double() ** s)[torch.randperm(E, generator=g)]


def _skewed_routes(rank: int, tokens: int = N) -> torch.Tensor:
    """[tokens, K] distinct experts a token; 60% of all routes go to experts 0 and 1."""
    g = torch.Generator().manual_seed(100 + rank)
    idx = torch.empty(tokens, K, dtype=torch.int64)
    for t in range(tokens):
        hot = torch.rand(K, generator=g) < 0.6
        cold = (2 + torch.randperm(E - 2, generator=g))[:K]
        idx[t] = torch.where(hot, torch.tensor([0, 1]), cold)
    return idx


ONLY_RANK0 = torch.tensor([[0, 1]]).repeat(N, 1)  # experts 0 and 1 live on rank 0 for ep = 2 and 4


def _layer_inputs(rank: int):
    g = torch.Generator().manual_seed(7 + rank)
    z = torch.randn(N, LAT, generator=g)
    p = torch.rand(N, K, generator=g)
    proj = torch.randn(N, LAT, generator=g)
    return z, _skewed_routes(rank), p, proj


def _experts() -> RoutedExperts:
    torch.manual_seed(0)
    cfg = K3Config.preset("k3-tiny")
    cfg = K3Config.model_validate({**cfg.model_dump(), "num_experts": E, "moe_intermediate_size": F,
                                   "routed_expert_hidden_size": LAT})  # fmt: skip
    m = RoutedExperts(cfg)
    for w in (m.w1, m.w3, m.w2):
        torch.nn.init.normal_(w, std=0.3)
    return m


def _run(layer, rank: int, keep=None, idx=None, autocast=False):
    """Forward + backward of this rank's tokens: (u, dz, {w: grad of this layer's weights})."""
    z, routes, p, proj = _layer_inputs(rank)
    idx = routes if idx is None else idx
    if keep is not None:  # leave some routes out: weight 0 (one process) = dropped (MoonEP)
        p = p * keep
    z = z.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        u = layer(z, idx, p)
    (u.float() * proj).sum().backward()
    grads = {w: getattr(layer, w).grad for w in ("w1", "w3", "w2")}
    grads = {w: None if g is None else g.clone() for w, g in grads.items()}
    layer.zero_grad(set_to_none=True)
    return u.detach(), z.grad, grads


def _model(seed: int = 0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.preset("k3-tiny"))


def _model_run(model, rank: int):
    g = torch.Generator().manual_seed(50 + rank)
    ids = torch.randint(0, 256, (1, 24), generator=g)
    w = torch.randn(1, 24, 320, generator=g)
    logits = model(ids)
    (logits * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


TRAINER_STEPS = 3
TRAINER_VARIANTS = {
    "plain": {},
    "moon_ep": {"enabled": True, "slots": 1, "margin": 1.5},
    "per_batch": {"enabled": True, "slots": 4, "plan_per_batch": True, "margin": 1.2},
}


def _trainer_run(moon: dict) -> dict:
    """3 RL steps and an SFT step of the Trainer with FSDP + EP over the 2 ranks."""
    cfg = LearnerSection(micro_batch_tokens=48, steps=10, data_parallel="fsdp", world_size=2, expert_parallel=2,
                         moon_ep=moon)  # fmt: skip
    t = Trainer(_model(), cfg)
    layers = list(moon_ep_modules(t.model).values())
    metrics = [t.train_step(make_trajectories(s, n=8)) for s in range(TRAINER_STEPS)]
    metrics.append(t.sft_step(make_trajectories(5, n=4)))
    kinds = {type(m).__name__ for m in t.model.modules() if isinstance(m, ExpertParallelExperts)}
    return {"metrics": metrics, "state": t.full_state_dict(), "layers": len(layers),
            "planned": [m.planned for m in layers], "kinds": kinds}  # fmt: skip


def _spy_on_expert_rows(seen: list) -> None:
    """Record the rows and the path of every call of the experts' GEMMs (the real function runs)."""
    real = moon_ep.grouped_expert_rows

    def recorded(x, ends, *args):
        seen.append((x.shape[0], args[-1]))
        return real(x, ends, *args)

    moon_ep.grouped_expert_rows = recorded


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world, port):
        group, res, seen = dist.group.WORLD, {"expert_rows": {}}, []
        _spy_on_expert_rows(seen)

        def run(name, layer, **kw):  # _run, and what the experts computed (rows, grouped GEMM), capacity, slots
            seen.clear()
            res[name] = _run(layer, rank, **kw)
            res["expert_rows"][name] = (list(seen), layer.last_capacity, layer.slots)

        res["plain"] = _run(ExpertParallelExperts(_experts(), group), rank)

        moon = MoonEPExperts(_experts(), group, slots=1, tokens_per_rank=N, margin=1.5)
        with torch.no_grad():  # one step's routes make the histogram
            moon(*_layer_inputs(rank)[:3])
        res["plan"] = moon.replan()
        run("moon", moon)
        res["dropped"] = int(moon.dropped_routes)
        run("moon_bf16", moon, autocast=True)  # the copies travel in bf16 too; the grouped GEMM runs

        tight = MoonEPExperts(_experts(), group, slots=1, tokens_per_rank=N, margin=0.6)
        tight.set_plan(res["plan"])
        run("tight_strict", tight)  # a forward does not stop at a drop: the check does
        res["tight_strict_dropped"] = int(tight.dropped_routes)
        try:
            tight.check_drops()
            res["tight_error"] = None
        except RuntimeError as e:
            res["tight_error"] = str(e)
        tight.check_drops()  # the error was reported once: the group's count starts again
        tight.allow_drops = True
        tight.pop_load_stats()
        res["capacity"] = tight.capacity(K)
        run("tight", tight)
        res["tight_dropped"] = int(tight.dropped_routes)
        tight.check_drops()  # allowed: no error

        # before any plan (no copies, worst-case capacity), every route to rank 0's experts:
        # the other ranks receive no row but still join every exchange, forward and backward
        fresh = MoonEPExperts(_experts(), group, slots=1, tokens_per_rank=N)
        run("to_rank0", fresh, idx=ONLY_RANK0)

        # the report's way: a plan from each forward's own routes, E / ep slots
        per_batch = MoonEPExperts(_experts(), group, slots=E // world, tokens_per_rank=N, margin=1.5,
                                  plan_per_batch=True)  # fmt: skip
        for name, idx in (("skewed", None), ("to_rank0", ONLY_RANK0)):
            run(f"per_batch_{name}", per_batch, idx=idx)
            res[f"per_batch_{name}_rows"] = int(per_batch.received_rows)
            res[f"per_batch_{name}_plan"] = per_batch.plan
        res["per_batch_dropped"] = int(per_batch.dropped_routes)

        res["refused"] = []  # bad settings fail on every rank before any exchange
        for make in (lambda: per_batch(*(t.repeat(2, 1) for t in _layer_inputs(rank)[:3])),
                     lambda: apply_moon_ep(_model(), group, slots=E, tokens_per_rank=N),
                     lambda: MoonEPExperts(_experts(), group, slots=1, tokens_per_rank=0)):  # fmt: skip
            try:
                make()
                res["refused"].append(None)
            except ValueError as e:
                res["refused"].append(str(e))

        if world == 2:
            plain = apply_expert_parallel(_model(), group)
            res["model_plain"] = _model_run(plain, rank)
            moon_model = apply_moon_ep(_model(), group, slots=2, tokens_per_rank=24)
            _model_run(moon_model, rank)  # a first step: its routes make the plans
            moon_model.zero_grad(set_to_none=True)
            res["model_plans"] = replan_all(moon_model)
            res["model_moon"] = _model_run(moon_model, rank)
            res["model_names"] = sorted(moon_ep_modules(moon_model))
            res["trainer"] = {name: _trainer_run(moon) for name, moon in TRAINER_VARIANTS.items()}
        torch.save(res, os.path.join(out_dir, f"moon{rank}.pt"))


def _spawn(world: int, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"moon{world}")
    mp.spawn(_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    torch.set_num_threads(1)
    return [torch.load(out / f"moon{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[pytest.param(w, id=f"ep{w}", marks=pytest.mark.slow) for w in (2, 4)])
def ranks(request, tmp_path_factory):
    return _spawn(request.param, tmp_path_factory)


def _one_process(world: int, keep=None, idx=None, autocast=False):
    """All ranks' tokens through one RoutedExperts: per-rank (u, dz) and the summed weight grads."""
    layer = _experts()
    outs, grads = [], {}
    for r in range(world):
        u, dz, g = _run(layer, r, None if keep is None else keep[r], idx, autocast)
        outs.append((u, dz))
        grads = {w: grads.get(w, 0) + g[w] for w in g}
    return outs, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


# -- static shapes, no host reads ---------------------------------------------------------------


def _slots_and_weights(G: int, R: int, dtype=torch.float32):
    """R received slots (a third of them padding, -1) for G local experts, their rows and weights."""
    g = torch.Generator().manual_seed(3)
    slot_expert = torch.randint(0, G, (R,), generator=g).masked_fill(torch.rand(R, generator=g) < 0.3, -1)
    layer = _experts()
    w = [getattr(layer, name).detach()[:G].to(dtype).requires_grad_(True) for name in ("w1", "w3", "w2")]
    x = torch.randn(R, LAT, generator=g).to(dtype).requires_grad_(True)
    return x, slot_expert, w, (layer.beta_gate, layer.beta_up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-loop", "bf16-grouped-gemm"])
def test_expert_slots_compute_each_slot_with_its_expert(dtype):
    """expert_slots: a slot's row is its expert's output (as one process's experts, with weight
    1), a padding slot's is zero and passes no gradient; the weights' gradients are the real
    slots' alone."""
    x, slot_expert, w, betas = _slots_and_weights(G=5, R=70, dtype=dtype)
    h = expert_slots(x, slot_expert, *w, *betas)
    proj = torch.randn(h.shape, generator=torch.Generator().manual_seed(4))
    (h.float() * proj).sum().backward()
    got = [h.detach(), x.grad, *(t.grad for t in w)]
    real = slot_expert >= 0
    for t in (x, *w):
        t.grad = None
    ref = latent_experts_loop(x[real], slot_expert[real, None], torch.ones(int(real.sum()), 1), *w, *betas)
    (ref.float() * proj[real]).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(got[0][real].float(), ref.detach().float()) < tol
    assert not got[0][~real].any() and not got[1][~real].any()
    assert _rel(got[1][real].float(), x.grad[real].float()) < tol
    assert all(_rel(a.float(), t.grad.float()) < tol for a, t in zip(got[2:], w, strict=True))


def test_a_forward_reads_nothing_on_the_host():
    """The local steps of a forward under a plan (the split of the routes among the copies, the
    positions in the dispatch buffer, the experts over every received slot in bf16, the load
    statistics) run on fake tensors, which hold no data: a read on the host (.item(),
    .tolist(), nonzero, bincount sizing its output) raises there. The per-plan tables are made
    once per plan, before."""
    world, rank = 4, 1
    routes = [_skewed_routes(r) for r in range(world)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in routes])
    plan = plan_redundant_experts(counts.sum(0), world, 1)
    R = world * plan.capacity(N, K, 1.25)
    x, slot_expert, w, betas = _slots_and_weights(G=E // world + 1, R=R, dtype=torch.bfloat16)
    want = rows_per_rank(plan, counts.sum(0))  # a real call: the plan's tables are made here
    with FakeTensorMode(allow_non_fake_inputs=True):
        order, token, dest, local = route_destinations(routes[rank], plan, counts, rank)
        pos = _position_per_dest(dest, world)
        h = expert_slots(x, slot_expert, *w, *betas)
        rows = rows_per_rank(plan, counts.sum(0))
    assert pos.shape == dest.shape == order.shape == (N * K,) and h.shape == (R, LAT)
    assert rows.shape == want.shape == (world,)


def _nccl_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        layer = MoonEPExperts(_experts(), dist.group.WORLD, slots=0, tokens_per_rank=N).cuda()
        z, idx, p, _ = (t.cuda() for t in _layer_inputs(0))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(z, idx, p)  # the first forward and plan: NCCL's communicator, the plan's tables
            layer.replan()
            layer(z, idx, p)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                u = layer(z, idx, p)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.save(u.float().cpu(), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the one-kernel grouped GEMM needs a Hopper (sm90) GPU or newer")  # fmt: skip
def test_a_forward_never_waits_for_the_device_on_cuda(tmp_path):
    """A forward under a plan, bf16 autocast, NCCL (one rank): nothing synchronises the host
    with the GPU (torch raises at the first synchronising call), and the output is the experts'."""
    out = str(tmp_path / "u.pt")
    mp.spawn(_nccl_worker, args=(free_port(), out), nprocs=1, join=True)
    layer = _experts()
    z, idx, p, _ = _layer_inputs(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(z, idx, p)
    assert _rel(torch.load(out), want.float()) < 2e-2


# -- the layer on gloo ------------------------------------------------------------------------


def test_moon_ep_equals_plain_ep_and_one_process(ranks):
    world = len(ranks)
    plan = ranks[0]["plan"]
    assert all(r["plan"] == plan for r in ranks)  # one plan everywhere
    assert any(e >= 0 for row in plan.slot_experts for e in row)  # copies exist: replication is tested
    assert max(plan.home_load) * world > 1.2 and max(plan.load) * world < 1 + 1e-6
    outs, full = _one_process(world)
    n = E // world
    for r, res in enumerate(ranks):
        assert res["dropped"] == 0
        for key in ("plain", "moon"):
            u, dz, grads = res[key]
            assert _rel(u, outs[r][0]) < 1e-5 and _rel(dz, outs[r][1]) < 1e-5, (r, key)
            for w, g in grads.items():  # home experts: the sum over every copy and every rank's tokens
                assert g.shape[0] == n and _rel(g, full[w][r * n : (r + 1) * n]) < 1e-5, (r, key, w)
        assert all(_rel(a, b) < 1e-5 for a, b in zip(res["moon"][:2], res["plain"][:2], strict=True))
    outs16, full16 = _one_process(world, autocast=True)  # bf16 autocast: the same ops, other sum orders
    for r, res in enumerate(ranks):
        u, dz, grads = res["moon_bf16"]
        assert _rel(u.float(), outs16[r][0].float()) < 2e-2 and _rel(dz, outs16[r][1]) < 2e-2, r
        assert all(_rel(g, full16[w][r * n : (r + 1) * n]) < 2e-2 for w, g in grads.items()), r


def test_ranks_that_receive_nothing_still_run(ranks):
    world = len(ranks)
    outs, full = _one_process(world, idx=ONLY_RANK0)
    n = E // world
    for r, res in enumerate(ranks):
        u, dz, grads = res["to_rank0"]
        assert _rel(u, outs[r][0]) < 1e-5 and _rel(dz, outs[r][1]) < 1e-5
        for w, g in grads.items():
            if r == 0:
                assert _rel(g, full[w][:n]) < 1e-5
            else:  # no token reached this rank's experts: no gradient (reduce_expert_grads zero-fills it)
                assert g is None or not g.any()


def test_plan_per_batch_gives_every_rank_exactly_s_k_rows(ranks):
    """K3 report, MoonEP: every rank computes exactly S k routed rows, with at most E / ep
    redundant experts a rank, whatever the routing (here: skewed, and all to rank 0's experts)."""
    world = len(ranks)
    for name, idx in (("skewed", None), ("to_rank0", ONLY_RANK0)):
        outs, full = _one_process(world, idx=idx)
        n = E // world
        for r, res in enumerate(ranks):
            assert res[f"per_batch_{name}_rows"] == N * K, (name, r)
            plan = res[f"per_batch_{name}_plan"]
            assert max(plan.load) == pytest.approx(1 / world) and len(plan.slot_experts[r]) == E // world
            u, dz, grads = res[f"per_batch_{name}"]
            assert _rel(u, outs[r][0]) < 1e-5 and _rel(dz, outs[r][1]) < 1e-5, (name, r)
            assert all(_rel(g, full[w][r * n : (r + 1) * n]) < 1e-5 for w, g in grads.items()), (name, r)
    assert all(res["per_batch_dropped"] == 0 for res in ranks)


def test_per_batch_plans_are_exact_for_adversarial_routings():
    """Every rank computes exactly S k rows under a plan made from the step's own routes with
    E / ep slots: random skewed and adversarial routings, uneven token counts per expert."""
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        E_, ep = [(8, 2), (16, 4), (32, 8)][trial % 3]
        S = int(torch.randint(1, 30, (1,), generator=g))
        w = torch.rand(E_, generator=g) ** 6 + 1e-3  # a few experts take nearly everything
        routed = [torch.multinomial(w.expand(S, -1), K, generator=g) for _ in range(ep)]
        if trial % 5 == 0:  # every route to the first rank's experts
            routed = [torch.stack([torch.randperm(E_ // ep, generator=g)[:K] for _ in range(S)]) for _ in range(ep)]
        seen = sum(torch.bincount(i.reshape(-1), minlength=E_) for i in routed)
        plan = plan_redundant_experts(seen, ep, E_ // ep)
        assert rank_loads(routed, plan).tolist() == [S * K] * ep, (trial, plan)
        # the rows each rank computes follow from the histogram alone (what the layer logs)
        stale = plan_redundant_experts(torch.rand(E_, generator=g) ** 4, ep, 1)
        assert rows_per_rank(plan, seen).tolist() == [S * K] * ep, (trial, plan)
        assert rows_per_rank(stale, seen).tolist() == rank_loads(routed, stale).tolist(), (trial, stale)


def test_bad_settings_are_refused_with_their_names(ranks):
    world = len(ranks)
    for res in ranks:
        too_many, slots, tokens = res["refused"]
        assert too_many is not None and f"{2 * N} tokens on this rank, more than tokens_per_rank={N}" in too_many
        most = E - E // world
        assert slots is not None and f"redundant slots per rank must lie in [0, {most}]" in slots and "got 8" in slots
        assert tokens is not None and "tokens_per_rank must be >= 1" in tokens


def test_routes_beyond_the_capacity(ranks):
    """margin 0.6: some pairs overflow. The drops are counted on the device; strict, the next
    check raises on every rank with the group's count (none hangs in a collective); the output
    is one process's without those routes."""
    world = len(ranks)
    plan = ranks[0]["plan"]
    C = ranks[0]["capacity"]
    for res in ranks:
        assert res["tight_error"] is not None and "exceeded the capacity of" in res["tight_error"]
        assert res["tight_error"] == ranks[0]["tight_error"]  # the same group count everywhere
        assert res["tight_strict_dropped"] == res["tight_dropped"]
        assert all(torch.equal(a, b) for a, b in zip(res["tight_strict"][:2], res["tight"][:2], strict=True))
    keep, dropped = [], []
    routes = [_layer_inputs(r)[1] for r in range(world)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in routes])
    for r, idx in enumerate(routes):
        order, _, dest, _ = route_destinations(idx, plan, counts, r)
        pos = torch.zeros_like(dest)
        for d in range(world):  # position among the routes to each destination, route order
            pos[dest == d] = torch.arange(int((dest == d).sum()))
        kept = torch.zeros(N * K)
        kept[order] = (pos < C).float()
        keep.append(kept.view(N, K))
        dropped.append(int((pos >= C).sum()))
    assert sum(dropped) > 0
    assert f"MoonEP: {sum(dropped)} routes exceeded the capacity of {C} rows per rank pair" in ranks[0]["tight_error"]
    outs, full = _one_process(world, keep)
    n = E // world
    for r, res in enumerate(ranks):
        assert res["tight_dropped"] == dropped[r]
        u, dz, grads = res["tight"]
        assert _rel(u, outs[r][0]) < 1e-5 and _rel(dz, outs[r][1]) < 1e-5
        assert all(_rel(g, full[w][r * n : (r + 1) * n]) < 1e-5 for w, g in grads.items())


def test_k3_tiny_with_moon_ep_equals_plain_ep(ranks):
    if len(ranks) != 2:
        pytest.skip("the model check runs with 2 ranks")
    for res in ranks:
        assert len(res["model_names"]) == len(_model().moe_layers()) == len(res["model_plans"])
        (lp, gp), (lm, gm) = res["model_plain"], res["model_moon"]
        assert gp.keys() == gm.keys()
        assert _rel(lm, lp) < 1e-5
        worst = max(_rel(gm[k], gp[k]) for k in gp)
        assert worst < 5e-5, worst


@pytest.mark.parametrize("variant", ["moon_ep", "per_batch"])
def test_moon_ep_trainer_steps_equal_plain_ep(ranks, variant):
    if len(ranks) != 2:
        pytest.skip("the Trainer check runs with 2 ranks")
    n_moe = len(_model().moe_layers())
    for res in ranks:
        plain, moon = res["trainer"]["plain"], res["trainer"][variant]
        assert plain["kinds"] == {"ExpertParallelExperts"} and moon["kinds"] == {"MoonEPExperts"}
        assert moon["layers"] == n_moe and all(moon["planned"])  # replanned after the steps (or per batch)
        for m1, m2 in zip(plain["metrics"], moon["metrics"], strict=True):
            for key in ("loss", "grad_norm", "loss_tokens"):
                assert abs(m1[key] - m2[key]) <= 1e-4 * max(1.0, abs(m1[key])), (variant, key, m1[key], m2[key])
            assert "moe/ep_imbalance" not in m1
            assert m2["moe/dropped_routes"] == 0
            # a plan from the previous step's routes can miss this step's (48-token micro-batches
            # here): only a per-batch plan is sure to beat plain EP on every forward
            assert m2["moe/ep_imbalance"] >= 1.0 and m2["moe/ep_imbalance_plain_ep"] >= 1.0, m2
        # the copies are in use: the loads differ from plain EP's after the first plan
        assert any(abs(m["moe/ep_imbalance"] - m["moe/ep_imbalance_plain_ep"]) > 1e-3 for m in moon["metrics"][1:])
        # as test_learner_ep: Muon/AdamW turn fp32 rounding of near-zero gradients into ~lr * 1e-2
        worst = max((plain["state"][k] - moon["state"][k]).abs().max().item() for k in plain["state"])
        assert worst < 5e-4, (variant, worst)
    if variant == "per_batch":  # E / ep slots: every rank computes exactly the mean, whatever the routing
        metrics = ranks[0]["trainer"][variant]["metrics"]
        assert all(m["moe/ep_imbalance"] == pytest.approx(1.0) for m in metrics)
        assert max(m["moe/ep_imbalance_plain_ep"] for m in metrics) > 1.01


def test_moon_ep_config_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match=r"learner.moon_ep.enabled: MoonEP balances expert parallel, which is off"):
        JobConfig.from_dict({"learner": {"moon_ep": {"enabled": True}}})
    ep = {"expert_parallel": 2, "world_size": 2, "data_parallel": "fsdp"}
    with pytest.raises(ConfigError, match=r"learner.moon_ep.slots: 5 is more than the 4 experts"):
        JobConfig.from_dict({"learner": {**ep, "moon_ep": {"enabled": True, "slots": 5}}})
    with pytest.raises(ConfigError, match=r"learner.moon_ep: .* raise learner.micro_batch_tokens to at least 2048"):
        JobConfig.from_dict({"learner": {**ep, "micro_batch_tokens": 1024, "moon_ep": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"learner.moon_ep.margin"):
        JobConfig.from_dict({"learner": {**ep, "moon_ep": {"enabled": True, "margin": 0}}})
    job = JobConfig.from_dict({"learner": {**ep, "moon_ep": {"enabled": True, "slots": 4}}})
    assert job.learner.moon_ep.slots == 4 and not job.learner.moon_ep.plan_per_batch


def _static_rows(capacity: int, world: int, slots: int) -> int:
    """The rows of the experts' buffer: every received slot, plus each local expert's padding."""
    G = E // world + slots
    return math.ceil((world * capacity + G * (GROUP_ALIGN - 1)) / GROUP_ALIGN) * GROUP_ALIGN


def test_the_experts_compute_a_fixed_number_of_rows_whatever_the_routing(ranks):
    """Every received slot (ep x capacity, padding included) reaches the experts' GEMMs in one
    buffer whose size follows from the capacity and the number of local experts alone: skewed
    routes, every route to rank 0's experts (the other ranks receive only padding), per-batch
    plans, routes beyond the capacity. One call a forward: the grouped GEMM in bf16, the
    reference loop in fp32."""
    world = len(ranks)
    for res in ranks:
        seen = res["expert_rows"]
        assert len(seen) == 7
        for name, (calls, capacity, slots) in seen.items():
            assert calls == [(_static_rows(capacity, world, slots), name == "moon_bf16")], (name, calls)
        assert seen["per_batch_skewed"] == seen["per_batch_to_rank0"]
