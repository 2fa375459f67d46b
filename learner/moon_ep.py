"""MoonEP: expert parallelism with balanced load and static shapes (K3 report, arXiv 2607.24653,
§5.2.1), on top of plain EP (`expert_parallel.py`: rank r of the EP group is the home of experts
[r n, (r+1) n), n = E / ep, and holds their weights, the ones the optimizer steps).

Two things plain EP lacks:

1. Redundant experts. Every rank has `slots` extra expert slots. From a routing histogram
   (routes per expert, counted over every rank) the hottest experts get copies in those
   slots, each copy serving a share of its expert's routes, so that every rank computes about
   the same number of rows (`plan_redundant_experts`; `route_destinations` splits the routes).
   A copy's weights are fetched from the home rank at each forward; in the backward the
   copies' gradients travel back and are summed onto the home weights, so the optimizer sees
   one weight per expert.
2. Static-shape dispatch. Each (source rank, destination rank) pair exchanges exactly
   `capacity` rows, padded with zero rows (which carry no gradient), so the split sizes of the
   all-to-alls are constants known before the step: no counts are read on the host to size
   buffers (plain EP does that once per layer). With a balanced plan a rank's receive buffer
   is ep * capacity ~ margin * S k rows (S tokens a rank, k routes a token), where a dispatch
   sized for the worst case needs ep * S k. The experts then take all ep * capacity received
   row slots in one buffer whose size depends on the capacity and the number of local experts
   only (`expert_slots`): each expert's rows padded to a multiple of 16, padding slots in no
   expert's group, read back as zero rows.

With a plan from `replan` (the routes of recent steps, e.g. once a step), a forward reads
nothing on the host: the counts, the split, the dispatch layout, the expert groups, the drop
count and the load statistics stay on the device, and what depends on the plan alone (its
tables, which weights to fetch) is copied to the device once per plan. The expert GEMMs are
torch's grouped GEMM (`torch._grouped_mm`: one kernel per GEMM over every group, in bf16,
the training dtype under autocast) or, for fp32 / `backend="torch"`, a loop over the local
experts that reads the group sizes on the host (the reference). With `plan_per_batch=True`
the plan comes, as in the report, from the current micro-batch's own routes: then every rank
computes exactly S k rows with at most E / ep copies a rank, whatever the routing (the
report's bound), but our planner runs in Python, so such a forward reads the [ep, E] counts on
the host (the report's planner is a GPU kernel). Every rank learns every rank's per-expert
counts through one fixed-size all-gather ([ep, E] integers) per layer; the plan and the split
follow from them identically on every rank. The report's fused permutes and remote-write
buffers are not here: torch's all-to-all needs its split sizes on the host, so ours are fixed
per rank pair: capacity = ceil(margin * max_r load_r * S k), load_r the plan's share of rank r.
A route beyond its pair's capacity is dropped (its expert output counts as zero) and counted
(`MoonEPExperts.dropped_routes`); see `MoonEPExperts` for when that is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn

from k3rl.kernels.moe import GROUP_ALIGN, count_per_expert
from k3rl.kernels.moe import combine as combine_routes
from k3rl.kernels.situ import situ_glu
from k3rl.model.moe import RoutedExperts

from .expert_parallel import ExpertParallelExperts, _check_divides, routed_experts

__all__ = [
    "MoonEPExperts",
    "MoonEPPlan",
    "apply_moon_ep",
    "expert_slots",
    "moon_ep_modules",
    "plan_redundant_experts",
    "rank_loads",
    "replan_all",
    "route_destinations",
    "rows_per_rank",
]


@dataclass(frozen=True)
class MoonEPPlan:
    """Where the copies of every expert live and which share of its routes each one serves.

    Rank r's local expert stack is its n home experts followed by its `slots` redundant slots:
    local index j < n is expert r n + j, local index n + s is `slot_experts[r][s]` (-1: empty).
    `shares[e]` are the fractions of expert e's routes its copies serve (they sum to 1), in the
    order of `holders(e)`. `load[r]` is rank r's expected share of all routes under this plan
    (the loads sum to 1); `home_load[r]` the same under plain EP.
    """

    num_experts: int
    ep: int
    slots: int
    slot_experts: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[float, ...], ...]
    load: tuple[float, ...]
    home_load: tuple[float, ...]

    @property
    def num_home(self) -> int:
        return self.num_experts // self.ep

    def holders(self, expert: int) -> list[tuple[int, int]]:
        """(rank, local index) of every copy of `expert`: the home copy first, then by rank."""
        return self._holders[expert]

    @cached_property
    def _holders(self) -> list[list[tuple[int, int]]]:
        n = self.num_home
        out = [[(e // n, e % n)] for e in range(self.num_experts)]
        for r, row in enumerate(self.slot_experts):
            for s, e in enumerate(row):
                if e >= 0:
                    out[e].append((r, n + s))
        return out

    @cached_property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(copy_rank [E, ep], copy_local [E, ep], bounds [E, ep]): copy j of expert e lives on
        rank copy_rank[e, j] at local index copy_local[e, j] and serves the fraction
        [bounds[e, j-1], bounds[e, j]) of its routes (bounds[e, -1] = 0; 2 past the last copy)."""
        E, ep = self.num_experts, self.ep
        rows = []  # (expert, copy, rank, local index, where its share ends)
        for e, where in enumerate(self._holders):
            end = 0.0
            for j, ((r, local), share) in enumerate(zip(where, self.shares[e], strict=True)):
                end += share
                rows.append((e, j, r, local, end if j < len(where) - 1 else 2.0))
        expert, copy, on_rank, at, ends = zip(*rows, strict=True)
        rank, local = torch.zeros((E, ep), dtype=torch.int64), torch.zeros((E, ep), dtype=torch.int64)
        bounds = torch.full((E, ep), 2.0, dtype=torch.float64)
        rank[expert, copy], local[expert, copy] = torch.tensor(on_rank), torch.tensor(at)
        bounds[expert, copy] = torch.tensor(ends, dtype=torch.float64)
        return rank, local, bounds

    def tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`tables` on `device`, copied there once per plan (a forward then copies nothing)."""
        return self.cached_on(("tables", device), lambda: tuple(t.to(device) for t in self.tables))

    def cached_on(self, key, make):
        """What `make()` returns, made once per plan and key (per-plan tensors on a device)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @cached_property
    def _cache(self) -> dict:
        return {}

    def capacity(self, tokens_per_rank: int, top_k: int, margin: float) -> int:
        """Rows a pair of ranks exchanges: ceil(margin * max_r load_r * S k)."""
        return max(1, math.ceil(margin * max(self.load) * tokens_per_rank * top_k))


def _check_histogram(histogram) -> list[float]:
    h = torch.as_tensor(histogram).detach().double().cpu()
    if h.dim() != 1:
        raise ValueError(f"MoonEP: the routing histogram must have shape [num_experts] (routes per expert), "
                         f"got {tuple(h.shape)}")  # fmt: skip
    if not bool(torch.isfinite(h).all()) or bool((h < 0).any()):
        raise ValueError("MoonEP: the routing histogram must hold finite counts >= 0 (routes per expert)")
    return h.tolist()


def _check_slots(slots: int, num_experts: int, ep: int) -> None:
    most = num_experts - num_experts // ep  # a rank can hold a copy of every expert it is not home to
    if not 0 <= slots <= most:
        raise ValueError(
            f"MoonEP: redundant slots per rank must lie in [0, {most}] (num_experts={num_experts}, ep={ep}), "
            f"got {slots}; the K3 report shows E / ep = {num_experts // ep} slots are enough for any routing"
        )


def plan_redundant_experts(histogram, ep: int, slots: int) -> MoonEPPlan:
    """Choose and place the redundant copies from a routing histogram [E] (routes per expert).

    L_e = routes to expert e, load_r = routes rank r computes (home copies first:
    load_r = sum_{home(e) = r} L_e), target T = sum_e L_e / ep, h_e = the routes e's home copy
    still serves (L_e at first). Greedy filling, one receiving rank at a time:
        donor    d = argmax_r load_r, while load_d > T
        receiver r = argmin_{r != d, load_r < T, r has a free slot} load_r
        fill r up to T from d's home experts, heaviest first: a = min(T - load_r, h_e) moves
        from the home copy of e to a copy of e on r (one slot): h_e -= a, load_d -= a, load_r += a.
    A receiver is filled from a single donor (it needs at most E / ep slots, the K3 report's
    bound), possibly taking more than the donor's excess: the donor then drops below T and is
    filled by a later donor. It stops when every load is within 1e-9 T of T, or when no receiver
    has a free slot left. Ties go to the lower rank / expert id: every rank computes the same plan.
    With integer counts and T an integer (every rank routes S k), every move is a whole number
    of routes and a plan with enough slots gives every rank exactly T = S k.
    """
    if ep < 1:
        raise ValueError(f"MoonEP: the EP size must be >= 1, got {ep}")
    counts = _check_histogram(histogram)
    E = len(counts)
    _check_divides(E, ep)
    _check_slots(slots, E, ep)
    share = counts if sum(counts) > 0 else [1.0] * E  # no data yet: uniform
    n, total = E // ep, sum(share)
    T, tol = total / ep, 1e-9 * total / ep
    home = list(share)  # what each home copy serves
    copies: dict[tuple[int, int], float] = {}  # (rank, expert) -> what that redundant copy serves
    used = [0] * ep
    load = [sum(share[r * n : (r + 1) * n]) for r in range(ep)]
    home_load = tuple(load)

    for _ in range(2 * ep + E):  # each round fills a receiver or uses up its slots
        d = min(range(ep), key=lambda r: (-load[r], r))
        receivers = [r for r in range(ep) if r != d and load[r] < T - tol and used[r] < slots]
        if load[d] - T <= tol or not receivers:
            break
        r = min(receivers, key=lambda r: (load[r], r))
        for e in sorted(range(d * n, (d + 1) * n), key=lambda e: (-home[e], e)):
            a = min(T - load[r], home[e])
            if a <= tol or used[r] == slots:
                break
            used[r] += 1
            copies[(r, e)] = a
            home[e] -= a
            load[d] -= a
            load[r] += a

    rows = tuple(tuple(sorted(e for r2, e in copies if r2 == r) + [-1] * (slots - used[r])) for r in range(ep))
    shares = []
    for e in range(E):
        parts = [home[e]] + [copies[(r, e)] for r in range(ep) if (r, e) in copies]
        s = sum(parts)
        shares.append(tuple(x / s for x in parts) if s > 0 else (1.0,) + (0.0,) * (len(parts) - 1))
    return MoonEPPlan(E, ep, slots, rows, tuple(shares), tuple(x / total for x in load),
                      tuple(x / total for x in home_load))  # fmt: skip


def route_destinations(topk_idx: torch.Tensor, plan: MoonEPPlan, counts: torch.Tensor | None = None, source: int = 0):
    """Where each of a source rank's N k routes goes, in expert-sorted order.

    Returns (order [N k] flat route ids sorted by expert (token order inside), token_of_route,
    dest rank, local index on it). Expert e's routes are split among its copies by their shares,
    deterministically. With `counts` [ep, E] (the routes every rank sends to every expert this
    step), all ranks' L_e routes to e are put in one order: the p-th of source s's n_se routes
    has the key ((p + 1/2) / n_se, s), which interleaves the sources evenly; the route of rank g
    in that order goes to copy j when round(F_j L_e) <= g < round(F_{j+1} L_e), F_j = the shares
    of copies 0..j-1 summed. So copy j gets exactly round(F_{j+1} L_e) - round(F_j L_e) routes,
    and each source sends it about its share of that source's routes. g needs no exchange: the
    routes of source s' with a smaller key number #{p' : (2 p' + 1) n_se < (2 p + 1) n_s'e}
    (<= for s' < s). Without `counts`, this rank's routes alone are ordered (g = p).
    """
    copy_rank, copy_local, bounds = plan.tables_on(topk_idx.device)
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_route = order // topk_idx.shape[1]
    expert = flat[order]
    local = count_per_expert(flat, plan.num_experts)
    if counts is None:
        counts, source = local[None], 0
    p = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(local, 0) - local)[expert]
    n = counts.to(flat.device).t()[expert]  # [N k, ep]: n_s'e of every source for the route's expert
    n_me = n[:, source : source + 1]
    q = (2 * p + 1)[:, None] * n - n_me  # (2p' + 1) n_se < (2p + 1) n_s'e  <=>  2 n_se p' < q
    up_to = torch.div(q, 2 * n_me, rounding_mode="floor") + 1  # p' with 2 n_se p' <= q
    below = -torch.div(-q, 2 * n_me, rounding_mode="floor")  # p' with 2 n_se p' < q
    ranks = torch.arange(n.shape[1], device=flat.device)
    before = torch.where(ranks < source, up_to, below).clamp(min=0).minimum(n)
    g = before.sum(1) - before[:, source] + p
    starts = torch.round(bounds[expert] * n.sum(1, keepdim=True))  # [N k, ep]: where copies 1.. begin
    j = (starts <= g[:, None]).sum(1)
    return order, token_of_route, copy_rank[expert, j], copy_local[expert, j]


def rank_loads(topk_idx_per_rank: list[torch.Tensor], plan: MoonEPPlan) -> torch.Tensor:
    """Routed rows each rank computes [ep] when rank s routes `topk_idx_per_rank[s]` (the split
    the layer makes, from every rank's counts)."""
    counts = torch.stack([torch.bincount(i.reshape(-1).cpu(), minlength=plan.num_experts) for i in topk_idx_per_rank])
    rows = torch.zeros(plan.ep, dtype=torch.int64)
    for s, idx in enumerate(topk_idx_per_rank):
        rows += torch.bincount(route_destinations(idx.cpu(), plan, counts, s)[2], minlength=plan.ep)
    return rows


def rows_per_rank(plan: MoonEPPlan, histogram: torch.Tensor) -> torch.Tensor:
    """Routed rows each rank computes [ep] (fp64, on the histogram's device) when the routes of
    all ranks to each expert are `histogram` [E]: copy j of expert e serves
    round(F_{j+1} L_e) - round(F_j L_e) of its L_e routes (the split `route_destinations`
    makes), on its rank. Dropped routes are not subtracted."""
    L = torch.as_tensor(histogram).detach().double()
    copy_rank, _, bounds = plan.tables_on(L.device)
    ends = torch.round(bounds.clamp(max=1.0) * L[:, None])  # [E, ep]; copies past the last serve 0
    served = ends - torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
    rows = torch.zeros(plan.ep, dtype=torch.float64, device=L.device)
    return rows.index_add_(0, copy_rank.reshape(-1), served.reshape(-1))


def _position_per_dest(dest: torch.Tensor, ep: int) -> torch.Tensor:
    """Position of each route among the routes to its destination rank (route order kept)."""
    by_dest = torch.argsort(dest, stable=True)
    counts = count_per_expert(dest, ep)
    pos = torch.empty_like(dest)
    pos[by_dest] = torch.arange(dest.numel(), device=dest.device) - (torch.cumsum(counts, 0) - counts)[dest[by_dest]]
    return pos


class _Exchange(torch.autograd.Function):
    """All-to-alls of several tensors in one autograd node: `splits[i]` = (send, recv) rows of
    tensor i per rank. Backward: the same exchanges with send and recv swapped, in the same
    order on every rank (separate nodes could run their backwards in a rank-dependent order)."""

    @staticmethod
    def forward(ctx, group, splits, *tensors):
        ctx.group, ctx.splits = group, splits
        outs = []
        for x, (send, recv) in zip(tensors, splits, strict=True):
            out = x.new_empty(sum(recv), *x.shape[1:])
            dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_Exchange.apply(ctx.group, [(r, s) for s, r in ctx.splits], *grads))


@dataclass(frozen=True)
class _Fetch:
    """How this rank's redundant slots get their weights (constant for a plan): `send` home
    expert indices, grouped by destination rank, `send_splits` / `recv_splits` per rank, and
    `recv_slot` the slot each received row fills. Made once per plan, rank and device."""

    send: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_slot: torch.Tensor

    @classmethod
    def of(cls, plan: MoonEPPlan, rank: int, device: torch.device) -> _Fetch:
        return plan.cached_on(("fetch", rank, device), lambda: cls._make(plan, rank, device))

    @classmethod
    def _make(cls, plan: MoonEPPlan, rank: int, device: torch.device) -> _Fetch:
        n = plan.num_home
        send, send_splits = [], []
        for row in plan.slot_experts:  # sender: each destination's slots in slot order
            mine = [e - rank * n for e in row if e >= 0 and e // n == rank]
            send += mine
            send_splits.append(len(mine))
        recv_splits, recv_slot = [], []
        for src in range(plan.ep):  # receiver: the same order, grouped by the home rank
            slots = [s for s, e in enumerate(plan.slot_experts[rank]) if e >= 0 and e // n == src]
            recv_slot += slots
            recv_splits.append(len(slots))
        as_tensor = lambda ids: torch.tensor(ids, dtype=torch.int64, device=device)
        return cls(as_tensor(send), send_splits, recv_splits, as_tensor(recv_slot))


def _use_grouped_gemm(backend: str, x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether the experts run as torch's grouped GEMM: bf16 with 16-byte aligned rows (the
    latent and expert widths multiples of 8), unless the reference is asked for."""
    fits = hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and w1.shape[1] % 8 == 0 and w1.shape[2] % 8 == 0
    return backend != "torch" and fits


def grouped_expert_rows(x, ends, w1, w3, w2, beta_gate, beta_up, grouped: bool) -> torch.Tensor:
    """h = w2_g SiTU-GLU(w1_g x, w3_g x) for the rows [ends[g-1], ends[g]) of x [M, l] (group g
    computed by expert g; rows past ends[-1] are left undefined and must not be read).

    grouped: torch's grouped GEMM, one kernel per GEMM whatever the group sizes, nothing read on
    the host. Else a loop over the experts, reading `ends` on the host (the reference); it also
    runs the experts with no rows, so that the output always depends on x and the weights.
    """
    if grouped:
        offs = ends.to(torch.int32)
        a = situ_glu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
                     torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs), beta_gate, beta_up)  # fmt: skip
        return torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    parts, start = [], 0
    for g, end in enumerate(ends.tolist()):
        xg = x[start:end]
        parts.append(situ_glu(xg @ w1[g].T, xg @ w3[g].T, beta_gate, beta_up, backend="torch") @ w2[g].T)
        start = end
    return torch.cat([*parts, x.new_zeros(x.shape[0] - start, w2.shape[1])])


def expert_slots(x, slot_expert, w1, w3, w2, beta_gate, beta_up, backend: str = "auto") -> torch.Tensor:
    """h [R, l] for R row slots x [R, l]: slot i computed by expert slot_expert[i] of w1/w3/w2
    [G, ...]; slot_expert -1 marks a padding slot (h = 0, and no gradient reaches its row).

    The slots are laid out by expert in one buffer of M = ceil((R + G (A - 1)) / A) A rows
    (A = GROUP_ALIGN), each expert's group padded to a multiple of A:
        key_i  = slot_expert[i], or G for a padding slot; sorted stably
        first_g = #{i : key_i < g}   (searchsorted on the sorted keys), n_g = first_{g+1} - first_g
        padded_g = ceil(n_g / A) A, end_g = sum_{g' <= g} padded_g'
        the j-th slot of group g (slot order) -> buffer row end_g - padded_g + j;  padding -> row M (zero)
    M depends on R and G alone: the expert GEMMs have the same shapes whatever the routing, and
    nothing here is read on the host (except by the fp32 reference loop, see grouped_expert_rows).
    """
    R, G, A = x.shape[0], w1.shape[0], GROUP_ALIGN
    key = torch.where(slot_expert >= 0, slot_expert, G)
    perm = torch.argsort(key, stable=True)
    sorted_key = key[perm]
    first = torch.searchsorted(sorted_key, torch.arange(G + 1, device=x.device))
    padded = (first[1:] - first[:-1] + A - 1) // A * A
    ends = torch.cumsum(padded, 0)
    M = -(-(R + G * (A - 1)) // A) * A
    j = torch.arange(R, device=x.device) - first[sorted_key]
    row_sorted = torch.where(sorted_key < G, (ends - padded)[sorted_key.clamp(max=G - 1)] + j, M)
    row = torch.empty_like(perm).index_copy_(0, perm, row_sorted)
    buf = x.new_zeros(M + 1, x.shape[1]).index_copy(0, row, x)[:M]
    h = grouped_expert_rows(buf, ends, w1, w3, w2, beta_gate, beta_up, _use_grouped_gemm(backend, x, w1))
    return torch.cat([h, h.new_zeros(1, h.shape[1])])[row]


def moon_ep_latent_experts(z, topk_idx, topk_weight, w1, w3, w2, beta_gate, beta_up, group, plan: MoonEPPlan,
                           capacity: int, counts: torch.Tensor, backend: str = "auto"):  # fmt: skip
    """`latent_experts` under MoonEP: w1/w3/w2 hold this rank's home experts only; `counts`
    [ep, E] the routes every rank sends to every expert this step. Collective; reads nothing
    on the host except in the fp32 reference loop (`grouped_expert_rows`).

    Returns (u [N, l], routes this rank dropped, routes every rank of the group dropped (the
    same on every rank), slots that carried a route here): the counts are 0-d int64 tensors on
    z's device, left there.

        fetch       the slots' weights from their home ranks      (splits from the plan)
        dispatch    [ep * capacity, l] rows + their local expert   (splits: capacity per rank)
        experts     h = w2_j SiTU-GLU(w1_j x, w3_j x) on every received slot (`expert_slots`);
                    padding slots give zero rows
        return      [ep * capacity, l] back, in the same rows      (splits: capacity per rank)
        combine     u_t = sum_e p_e h_e in fp32, a dropped route's h_e = 0
    """
    N, ep, rank = z.shape[0], plan.ep, dist.get_rank(group)
    n, C, lat = w1.shape[0], capacity, z.shape[1]
    order, token_of_route, dest, local = route_destinations(topk_idx, plan, counts, rank)
    pos = _position_per_dest(dest, ep)
    kept = pos < C
    row = torch.where(kept, dest * C + pos, ep * C)  # a route's row in the dispatch buffer; ep * C: dropped
    dropped = (~kept).sum()

    # the local expert of every row sent, -1 for padding; one extra column per pair: my drops
    meta = torch.full((ep * C + 1,), -1, dtype=torch.int64, device=z.device).index_copy(0, row, local)
    meta = torch.cat([meta[: ep * C].view(ep, C), dropped.expand(ep, 1)], 1)
    meta_in = torch.empty_like(meta)
    dist.all_to_all_single(meta_in, meta, group=group)
    expert_in = meta_in[:, :C].reshape(-1)

    fetch = _Fetch.of(plan, rank, z.device)
    flat = [w.reshape(n, -1) for w in (w1, w3, w2)]
    rows = z.new_zeros(ep * C + 1, lat).index_copy(0, row, z[token_of_route])[: ep * C]
    x, fetched = _Exchange.apply(
        group, [([C] * ep, [C] * ep), (fetch.send_splits, fetch.recv_splits)], rows, torch.cat(flat, 1)[fetch.send]
    )
    held = fetched.new_zeros(plan.slots, fetched.shape[1]).index_copy(0, fetch.recv_slot, fetched)
    w1s, w3s, w2s = held.split([f.shape[1] for f in flat], 1)
    w1, w3, w2 = (torch.cat([w, s.view(-1, *w.shape[1:])]) for w, s in zip((w1, w3, w2), (w1s, w3s, w2s), strict=True))

    # every received row is a "token" with one route of weight 1, as in plain EP
    h = expert_slots(x, expert_in, w1, w3, w2, beta_gate, beta_up, backend)
    (y,) = _Exchange.apply(group, [([C] * ep, [C] * ep)], h)
    y = torch.cat([y, y.new_zeros(1, lat)])[row]  # [N k] in `order`; dropped routes read zeros
    u = combine_routes(y, order, token_of_route, topk_weight, N, z.dtype)
    return u, dropped, meta_in[:, C].sum(), (expert_in >= 0).sum()


class MoonEPExperts(ExpertParallelExperts):
    """Drop-in for `RoutedExperts` under MoonEP: the parameters are plain EP's (w1/w3/w2 with this
    rank's E / ep home experts: same names, same gradient reduction and clipping), plus a plan,
    the routes of every rank counted since the last `replan`, and a capacity for
    `tokens_per_rank` tokens.

    The plan comes from `replan` (the routes of recent steps), or with `plan_per_batch` from each
    forward's own routes, as the K3 report does: then every rank computes exactly the mean load
    (S k rows when every rank routes S tokens) whenever the slots suffice (E / ep always do).
    Every rank of `group` must call forward, `replan` and `check_drops` together.

    Host reads: with a plan from `replan`, a forward reads nothing on the host (bf16 grouped
    GEMM; the fp32 reference loop reads its group sizes); `replan`, `check_drops` and
    `pop_load_stats` do, once a step. Dropped routes (beyond a pair's capacity) are counted on
    the device, per rank (`dropped_routes`) and over the whole group (every rank receives every
    rank's count with the dispatch). When `allow_drops` is off they are an error, raised by
    `check_drops` on every rank of the group at once; `replan` and `pop_load_stats` call it,
    i.e. once a step in the Trainer, after the step. A forward does not stop at a drop (that
    would read the count on the host once per layer): call `check_drops()` after a forward to
    stop right there, e.g. while sizing the margin.
    """

    def __init__(self, experts: RoutedExperts, group, slots: int, tokens_per_rank: int, margin: float = 1.25,
                 allow_drops: bool = False, plan_per_batch: bool = False, replicate_group=None):  # fmt: skip
        super().__init__(experts, group, replicate_group)
        _check_slots(slots, self.num_experts, self.ep_size)
        if tokens_per_rank < 1 or not margin > 0:
            raise ValueError(f"MoonEP: tokens_per_rank must be >= 1 and margin > 0, got {tokens_per_rank} and {margin}")
        self.slots, self.tokens_per_rank, self.margin, self.allow_drops = slots, tokens_per_rank, margin, allow_drops
        self.plan_per_batch = plan_per_batch
        counter = lambda: torch.zeros((), dtype=torch.int64)
        self.register_buffer("routes_seen", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_routes", counter(), persistent=False)  # this rank's, since pop_load_stats
        self.register_buffer("group_dropped_routes", counter(), persistent=False)  # every rank's, since check_drops
        self.register_buffer("received_rows", counter(), persistent=False)  # last forward
        # since `pop_load_stats`: sums over forwards of max / mean rows per rank under this plan and
        # under plain EP, and the number of forwards (those that routed anything)
        self.register_buffer("load_sums", torch.zeros(3, dtype=torch.float64), persistent=False)
        self.last_capacity = 0
        # no routes seen yet: plain EP's layout, and a capacity for the worst case (S k a pair)
        self.plan, self.planned = plan_redundant_experts(torch.zeros(self.num_experts), self.ep_size, slots), False

    def set_plan(self, plan: MoonEPPlan) -> None:
        if (plan.num_experts, plan.ep, plan.slots) != (self.num_experts, self.ep_size, self.slots):
            raise ValueError(f"MoonEP: a plan for E={plan.num_experts}, ep={plan.ep}, slots={plan.slots} does not fit "
                             f"this layer (E={self.num_experts}, ep={self.ep_size}, slots={self.slots})")  # fmt: skip
        self.plan, self.planned = plan, True

    @torch.no_grad()
    def replan(self) -> MoonEPPlan:
        """A new plan from every rank's routes counted since the last replan (the same counts on
        every rank, so the same plan); the counts start again from zero. Checks the drops first."""
        self.check_drops()
        self.set_plan(plan_redundant_experts(self.routes_seen, self.ep_size, self.slots))
        self.routes_seen.zero_()
        return self.plan

    def capacity(self, top_k: int) -> int:
        """Rows per rank pair: the plan's (`MoonEPPlan.capacity`), or S k before the first plan."""
        if not self.planned:
            return self.tokens_per_rank * top_k
        return self.plan.capacity(self.tokens_per_rank, top_k, self.margin)

    def forward(self, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if z.shape[0] > self.tokens_per_rank:
            raise ValueError(f"MoonEP: {z.shape[0]} tokens on this rank, more than tokens_per_rank="
                             f"{self.tokens_per_rank} that the capacity is sized for")  # fmt: skip
        with torch.no_grad():  # the routes every rank sends to every expert [ep, E]: a fixed-size exchange
            mine = count_per_expert(idx.reshape(-1), self.num_experts)
            every = [torch.empty_like(mine) for _ in range(self.ep_size)]
            dist.all_gather(every, mine, group=self.group)
            counts = torch.stack(every)
            self.routes_seen += counts.sum(0).to(self.routes_seen.device)
            if self.plan_per_batch:  # planned in Python: reads the counts on the host
                self.set_plan(plan_redundant_experts(counts.sum(0), self.ep_size, self.slots))
            self._count_load(counts.sum(0))
        self.last_capacity = self.capacity(idx.shape[1])
        z, w1, w3, w2 = self.cast_inputs(z)
        u, dropped, group_dropped, received = moon_ep_latent_experts(
            z, idx, p, w1, w3, w2, self.beta_gate, self.beta_up, self.group, self.plan,
            self.last_capacity, counts, self.backend,
        )  # fmt: skip
        self.dropped_routes += dropped
        self.group_dropped_routes += group_dropped
        self.received_rows.copy_(received)
        return u

    def _count_load(self, histogram: torch.Tensor) -> None:
        """Add this forward's max / mean rows per rank, MoonEP's and plain EP's (home copies
        only), on the device; a forward that routed nothing adds nothing."""
        moon = rows_per_rank(self.plan, histogram)
        plain = histogram.double().view(self.ep_size, -1).sum(1)
        ratios = torch.stack([moon.max() / moon.mean(), plain.max() / plain.mean(), torch.ones_like(moon[0])])
        self.load_sums += torch.where(plain.sum() > 0, ratios, 0.0).to(self.load_sums.device)

    def check_drops(self) -> None:
        """Unless `allow_drops`: raise if any rank of the group dropped a route since the last
        check. Every rank reads the same group count, so all raise together (none is left
        waiting in a collective). One read on the host."""
        dropped = 0 if self.allow_drops else int(self.group_dropped_routes)
        self.group_dropped_routes.zero_()
        if dropped:
            raise RuntimeError(
                f"MoonEP: {dropped} routes exceeded the capacity of {self.last_capacity} rows per rank pair "
                "(all ranks of the EP group, since the last check); raise the margin, plan per batch or replan "
                "more often (a stale plan), or allow dropped routes"
            )

    def pop_load_stats(self) -> tuple[float, float, int]:
        """(mean max / mean rows per rank under MoonEP, the same under plain EP, routes this rank
        dropped) over the forwards since the last call; the counters start again from zero. The
        imbalances are the same on every rank of the EP group (they come from the shared counts).
        Checks the drops first (`check_drops`)."""
        self.check_drops()
        moon, plain, forwards = self.load_sums.tolist()
        out = (moon / max(1.0, forwards), plain / max(1.0, forwards), int(self.dropped_routes))
        self.load_sums.zero_()
        self.dropped_routes.zero_()
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slots={self.slots}, tokens_per_rank={self.tokens_per_rank}"


def apply_moon_ep(model: nn.Module, group, slots: int, tokens_per_rank: int, margin: float = 1.25,
                  allow_drops: bool = False, plan_per_batch: bool = False, replicate_group=None) -> nn.Module:  # fmt: skip
    """Shard the routed experts of every MoE layer over `group` with MoonEP (in place); as
    `apply_expert_parallel`, on every rank with the same full weights, before FSDP."""
    targets = routed_experts(model)
    for _, _, m in targets:  # every layer first: fail before changing anything
        _check_divides(m.w1.shape[0], dist.get_world_size(group))
        _check_slots(slots, m.w1.shape[0], dist.get_world_size(group))
    for parent, child, m in targets:
        setattr(parent, child, MoonEPExperts(m, group, slots, tokens_per_rank, margin, allow_drops,
                                                 plan_per_batch, replicate_group))  # fmt: skip
    return model


def moon_ep_modules(model: nn.Module) -> dict[str, MoonEPExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoonEPExperts)}


def replan_all(model: nn.Module) -> list[MoonEPPlan]:
    """`replan` every MoonEP layer (on every rank, e.g. after each step)."""
    return [m.replan() for m in moon_ep_modules(model).values()]
