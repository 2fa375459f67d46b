"""MoonEP's plan (learner/moon_ep.py) from a routing histogram: balanced within the slots,
deterministic on every rank, routes split by the shares, bad input refused."""

from __future__ import annotations

import pytest
import torch
from test_moon_ep import E, K, _skewed_routes, _zipf

from k3rl.learner.moon_ep import plan_redundant_experts, rank_loads, route_destinations

# -- the plan ---------------------------------------------------------------------------------


def test_plan_balances_a_zipf_histogram_within_the_slots():
    hist = _zipf(64)
    for ep, slots in [(4, 1), (8, 2), (8, 8)]:
        plan = plan_redundant_experts(hist, ep, slots)
        assert max(plan.home_load) * ep > 1.4  # plain EP: the hottest rank has 40% more than the mean
        assert max(plan.load) <= 1 / ep + 1e-9 and abs(sum(plan.load) - 1) < 1e-9
        assert plan == plan_redundant_experts(hist, ep, slots)  # deterministic: every rank agrees
        for r, row in enumerate(plan.slot_experts):
            held = [e for e in row if e >= 0]
            assert len(row) == slots and len(set(held)) == len(held)
            assert all(e // (64 // ep) != r for e in held)  # never a copy of a home expert
        for e in range(64):
            assert len(plan.holders(e)) == len(plan.shares[e]) and abs(sum(plan.shares[e]) - 1) < 1e-9
        # the expected loads are the shares the copies serve
        share = (hist / hist.sum()).tolist()
        load = [0.0] * ep
        for e in range(64):
            for (r, _), s in zip(plan.holders(e), plan.shares[e], strict=True):
                load[r] += share[e] * s
        assert max(abs(a - b) for a, b in zip(load, plan.load, strict=True)) < 1e-9


def test_plan_without_slots_or_data():
    hist = _zipf(16)
    plain = plan_redundant_experts(hist, 4, 0)
    assert plain.load == plain.home_load and plain.slot_experts == ((),) * 4
    assert all(s == (1.0,) for s in plain.shares)
    uniform = plan_redundant_experts(torch.zeros(16), 4, 2)  # nothing seen yet: uniform, no copies
    assert uniform.slot_experts == ((-1, -1),) * 4 and max(uniform.load) == pytest.approx(0.25)
    # 60% of the routes to two experts of one rank (ep = 2, one slot each): balanced with one copy
    hist = torch.tensor([30, 30, 8, 8, 8, 8, 4, 4.0])
    plan = plan_redundant_experts(hist, 2, 1)
    assert plan.home_load[0] == pytest.approx(0.76) and max(plan.load) == pytest.approx(0.5)
    assert plan.slot_experts == ((-1,), (0,)) and plan.holders(0) == [(0, 0), (1, 4)]


def test_route_split_follows_the_shares_deterministically():
    hist = torch.tensor([30, 30, 8, 8, 8, 8, 4, 4.0])
    plan = plan_redundant_experts(hist, 4, 1)
    idx = _skewed_routes(0, tokens=200)
    order, token, dest, local = route_destinations(idx, plan)
    again = route_destinations(idx, plan)
    assert all(torch.equal(a, b) for a, b in zip((order, token, dest, local), again, strict=True))
    flat = idx.reshape(-1)
    assert torch.equal(flat[order], flat[order].sort().values) and torch.equal(token, order // K)
    for e in (0, 1):
        mine = flat[order] == e
        n_e = int(mine.sum())
        got = [int(((dest[mine] == r) & (local[mine] == j)).sum()) for r, j in plan.holders(e)]
        cum = torch.tensor((0.0, *plan.shares[e])).cumsum(0)
        want = (torch.round(cum[1:] * n_e) - torch.round(cum[:-1] * n_e)).long().tolist()
        assert got == want and sum(got) == n_e and len(got) > 1
        # the first routes (token order) go to the home copy
        assert int(dest[mine][0]) == e // 2 and int(local[mine][0]) == e % 2
    routed = [_skewed_routes(r, tokens=200) for r in range(4)]
    seen = sum(torch.bincount(i.reshape(-1), minlength=E) for i in routed)  # the plan from these routes
    before = rank_loads(routed, plan_redundant_experts(seen, 4, 0)).float()
    after = rank_loads(routed, plan_redundant_experts(seen, 4, 1)).float()
    assert after.sum() == before.sum() == 4 * 200 * K
    assert (before.max() / before.mean()).item() > 2 and (after.max() / after.mean()).item() < 1.15


def test_plan_refuses_bad_input():
    with pytest.raises(ValueError, match=r"histogram must have shape"):
        plan_redundant_experts(torch.ones(4, 2), 2, 1)
    with pytest.raises(ValueError, match=r"finite counts >= 0"):
        plan_redundant_experts(torch.tensor([1.0, -1, 2, 3]), 2, 1)
    with pytest.raises(ValueError, match=r"redundant slots per rank must lie in \[0, 6\].*got 7"):
        plan_redundant_experts(torch.ones(8), 4, 7)
    with pytest.raises(ValueError, match=r"must divide the model's num_experts=6"):
        plan_redundant_experts(torch.ones(6), 4, 1)
