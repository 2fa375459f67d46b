"""Trajectories -> packed micro-batches (one flat token stream + cu_seqlens, no padding).

A trajectory of L = P + C tokens (P prompt, C completion) becomes L - 1 positions: the
input at position i is token x_i and its target is x_{i+1}. Completion token j sits at
absolute position P + j, so it is predicted at position P + j - 1; that position carries
the loss when `loss_mask[j]` is 1, with behaviour log-prob `logprobs[j]`.

Images (vision-in-the-loop episodes) travel with their micro-batch as PNG bytes, in the
order of their `<|media_pad|>` runs in the packed stream (the trajectories' turn order).

Routing replay: `routed_experts[j]` holds the experts completion token j was routed to
when the engine processed it as an input (position P + j). Positions without a record
(the prompt, tokens the engine did not return routes for) are -1.

Segments (context compaction): a trajectory cut into context segments (`segment_starts`) is
one sequence per segment in `cu_seqlens` (a segment's first token is not predicted from the
one before it: the position that would is left out), all packed together in one micro-batch
under the trajectory's index, so the episode's advantage and aggregation cover every segment.

Advantages: one per trajectory ([N]) broadcast to its positions, or one per completion token
([N, C], C at least the longest completion; learner/advantages.py for per-turn credit).

Sequences are packed first-fit-decreasing into micro-batches of at most
`micro_batch_tokens` positions (a longer sequence gets a micro-batch of its own), so the
step sees a few dense micro-batches instead of padded rows.

Shared prefixes (`shared_prefix=True`, learner/prefix_tree.py): the samples of a group that agree on
their leading positions are packed together as one unit that costs its tree's tokens (the shared
positions once, then each sample's rest), and the micro-batch's forward inputs (`input_ids`,
`cu_seqlens`, `targets`, `routed_experts`) are the tree stream's; the loss columns stay per position
of the unshared layout, which `tree.index` maps onto the tree. Trajectories with context segments or
images are packed whole. With data parallelism the
micro-batches are dealt round-robin to the ranks and the short ranks get a zero-weight
copy of a real micro-batch, so every rank runs the same number of forward passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache

import numpy as np
import torch

from k3rl.images import from_png
from k3rl.kernels.varlen import remember_host_copy, remember_host_offsets
from k3rl.types import Trajectory

from .losses import aggregation_weights
from .prefix_tree import Document, PrefixTree, build_tree, shared_positions

__all__ = ["MicroBatch", "pack_lengths", "build_micro_batches", "shard_micro_batches", "sequence_length"]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [1, T] int64
    cu_seqlens: torch.Tensor  # [n + 1] int32
    targets: torch.Tensor  # [T] int64, the next token
    mask: torch.Tensor  # [T] float32, 1 where the target is a trained completion token
    behaviour_logp: torch.Tensor  # [T] float32
    advantages: torch.Tensor  # [T] float32 (the sequence's advantage on every position)
    agg_weights: torch.Tensor  # [T] float32, a_t of the whole step (see losses.aggregation_weights)
    seq_index: torch.Tensor  # [T] int64, index of the trajectory in the step's batch
    versions: torch.Tensor  # [T] int64, policy version of the target token (-1: not sampled)
    routed_experts: torch.Tensor | None  # [1, T, n_moe, k] int64, -1 = no record
    traj_indices: list[int]
    images: list[bytes] = field(default_factory=list)  # PNG bytes, in the order of their pad runs
    # build_micro_batches(defer=True): the LOSS_COLUMNS above are None until `ready()` builds them
    pending: Callable[[], dict[str, torch.Tensor]] | None = None
    # shared prefixes: the forward inputs above are this tree's stream, the loss columns the unshared positions
    tree: PrefixTree | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the forward runs (the tree stream's, with shared prefixes)."""
        return int(self.input_ids.shape[1])

    @property
    def positions(self) -> int:
        """Positions of the unshared packed layout (what the loss columns cover)."""
        return int(self.tree.index.numel()) if self.tree is not None else self.num_tokens

    def media(self, model):
        """Its images, decoded and preprocessed for `model` (`as_media`); None without images."""
        if not self.images:
            return None
        return model.as_media([from_png(b) for b in self.images])

    def ready(self) -> MicroBatch:
        """This micro-batch, its loss columns built (once) and on its tokens' device."""
        if self.pending is not None:
            for k, v in self.pending().items():
                setattr(self, k, _move(v, self.input_ids.device))
            self.pending = None
        return self

    def to(self, device) -> MicroBatch:
        """On a CUDA device, from pinned memory without making the host wait (a copy from pageable
        memory does), and with cu_seqlens' host values handed to the kernels (`host_offsets`)."""
        device = torch.device(device)
        cuda = device.type == "cuda" and torch.cuda.is_available()
        moved = {k: _move(v, device) for k, v in self.__dict__.items()}
        moved["tree"] = self.tree.to(device) if self.tree is not None else None
        if cuda and self.cu_seqlens.device.type == "cpu":
            remember_host_offsets(moved["cu_seqlens"], self.cu_seqlens.tolist())
            remember_host_copy(moved["input_ids"], self.input_ids)  # the model's media check reads it
        return MicroBatch(**moved)

    def zero_weight(self) -> MicroBatch:
        """The same tokens with no loss: a filler that keeps data-parallel ranks in step."""
        self.ready()
        return replace(self, mask=torch.zeros_like(self.mask), agg_weights=torch.zeros_like(self.agg_weights),
                       traj_indices=[])


LOSS_COLUMNS = ("mask", "behaviour_logp", "advantages", "agg_weights", "seq_index", "versions")


def _move(v, device: torch.device):
    """A tensor on `device`; from the CPU to a GPU through pinned memory, without a host wait."""
    if not isinstance(v, torch.Tensor) or v.device == device:
        return v
    if device.type == "cuda" and v.device.type == "cpu" and torch.cuda.is_available():
        return v.pin_memory().to(device, non_blocking=True)
    return v.to(device)


def sequence_length(t: Trajectory) -> int:
    """Positions a trajectory occupies in a packed micro-batch: L - 1 (per segment)."""
    return len(t.prompt_ids) + len(t.completion_ids) - 1 - len(t.segment_starts)


def pack_lengths(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence indices under a token budget.

    Deterministic: ties in length keep index order; bins keep their items in index order.
    """
    if budget < 1:
        raise ValueError(f"pack_lengths: the token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def _check(trajectories: list[Trajectory]) -> None:
    if not trajectories:
        raise ValueError("the step got no trajectories; pass a non-empty list")
    for i, t in enumerate(trajectories):
        if not t.prompt_ids:
            raise ValueError(f"trajectory {i} ({t.id}) has an empty prompt; the first completion token needs a context")
        if not t.completion_ids:
            raise ValueError(f"trajectory {i} ({t.id}) has no completion tokens")


def _tensor(values: list, dtype) -> torch.Tensor:
    """A Python list as a CPU tensor through numpy (`torch.tensor` on a list converts element by
    element: with 4 lists of each trajectory's length a step, host time while the GPU idles)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))


def build_micro_batches(
    trajectories: list[Trajectory],
    micro_batch_tokens: int,
    loss_agg: str,
    advantages: torch.Tensor | None = None,
    num_moe_layers: int = 0,
    top_k: int = 0,
    loss_norm_tokens: int | None = None,
    defer: bool = False,
    shared_prefix: bool = False,
    shared_prefix_min_fraction: float | None = None,
    sharing: dict | None = None,
    media_placeholder: int | None = None,
) -> list[MicroBatch]:
    """Pack the step's trajectories into micro-batches (global aggregation weights included).

    `advantages` [N] gives one advantage per trajectory, [N, C] one per completion token (None
    for SFT: zeros). Routed experts are collected when `num_moe_layers` and `top_k` are given and
    any trajectory has them. With `defer`, the loss columns (`LOSS_COLUMNS`: the trajectories'
    loss masks, log-probs and versions, turned from lists into tensors) are built by each micro-batch's
    `ready()`: the forward needs only the tokens, so the trainer queues it first and converts
    the rest while the GPU runs it (that conversion would otherwise leave the GPU idle). With
    `shared_prefix`, each group's common leading positions run once (the module docstring); with
    `shared_prefix_min_fraction` too, only when the tokens that saves are more than that fraction of all
    positions (else every sequence is packed whole). `sharing`, a dict, receives what sharing gives or would
    give: positions, saved (tokens the tree does not run), shared (positions reading a shared prefix) and
    used (whether the micro-batches are trees).
    """
    _check(trajectories)
    n = len(trajectories)
    adv = torch.zeros(n) if advantages is None else torch.as_tensor(advantages, dtype=torch.float32)
    longest = max(len(t.completion_ids) for t in trajectories)
    if adv.shape != (n,) and not (adv.dim() == 2 and adv.shape[0] == n and adv.shape[1] >= longest):
        raise ValueError(f"build_micro_batches: need one advantage per trajectory ({n}) or one per completion token "
                         f"([{n}, >= {longest}]), got shape {tuple(adv.shape)}")
    want_routes = num_moe_layers > 0 and top_k > 0 and any(t.routed_experts for t in trajectories)

    # what the forward needs, per trajectory: inputs, targets, routes, kept positions, segment lengths
    per = []
    for s, t in enumerate(trajectories):
        P, C = len(t.prompt_ids), len(t.completion_ids)
        tokens = _tensor(t.prompt_ids + t.completion_ids, np.int64)
        L = P + C - 1
        routes = _routes(t, s, P, L, num_moe_layers, top_k) if want_routes else None
        keep = None
        if t.segment_starts:  # each segment is its own sequence: nothing predicts its first token
            keep = torch.ones(L, dtype=torch.bool)
            keep[[b - 1 for b in t.segment_starts]] = False
        cols = tuple(x if x is None or keep is None else x[keep] for x in (tokens[:-1], tokens[1:], routes))
        per.append((*cols, keep, [hi - lo - 1 for lo, hi in t.segment_bounds]))
    units = [[s] for s in range(n)]  # what packing keeps together: one trajectory, or a sharing group
    shares = [0] * n  # the positions each unit's members share
    if shared_prefix:
        together = _sharing_units(trajectories, per, media_placeholder)
        m = [_shared(u, per, media_placeholder) for u in together]
        positions = sum(p[0].numel() for p in per)
        saved = sum((len(u) - 1) * m_u for u, m_u in zip(together, m, strict=True))  # m (G - 1) a group
        if shared_prefix_min_fraction is not None and saved <= shared_prefix_min_fraction * positions:
            shared_prefix = False  # too little to share: every sequence packed whole
        else:
            units, shares = together, m
        if sharing is not None:
            sharing.update(positions=positions, saved=saved, used=shared_prefix,
                           shared=sum(len(u) * m_u for u, m_u in zip(together, m, strict=True)))  # fmt: skip
    costs = [sum(per[s][0].numel() for s in u) - (len(u) - 1) * m_u for u, m_u in zip(units, shares, strict=True)]
    groups = [sorted(s for u in b for s in units[u]) for b in pack_lengths(costs, micro_batch_tokens)]

    @cache
    def loss_columns() -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor, list[int]]:
        """Every trajectory's (mask, behaviour log-p, versions, advantages), the whole step's
        aggregation weights (so micro-batches add up exactly) and each trajectory's offset in them."""
        cols = []
        for s, t in enumerate(trajectories):
            P, C, keep = len(t.prompt_ids), len(t.completion_ids), per[s][3]
            L = P + C - 1
            mask, behav = torch.zeros(L), torch.zeros(L)
            vers = torch.full((L,), -1, dtype=torch.int64)
            advs = torch.zeros(L) if adv.dim() == 2 else adv[s].expand(L).clone()
            mask[P - 1 :] = _tensor(t.loss_mask, np.float32)  # position P+j-1 predicts completion j
            behav[P - 1 :] = _tensor(t.logprobs, np.float64)
            vers[P - 1 :] = _tensor(t.versions, np.int64)
            if adv.dim() == 2:
                advs[P - 1 :] = adv[s, :C]
            cols.append(tuple(x if keep is None else x[keep] for x in (mask, behav, vers, advs)))
        all_mask = torch.cat([c[0] for c in cols])
        all_seq = torch.cat([torch.full((c[0].numel(),), s, dtype=torch.int64) for s, c in enumerate(cols)])
        all_w = aggregation_weights(all_mask, all_seq, loss_agg, num_seqs=n, norm_tokens=loss_norm_tokens)
        offsets = np.cumsum([0] + [c[0].numel() for c in cols]).tolist()
        return cols, all_w, offsets

    def group_columns(group: list[int]) -> dict[str, torch.Tensor]:
        cols, all_w, offsets = loss_columns()
        return dict(
            mask=torch.cat([cols[s][0] for s in group]),
            behaviour_logp=torch.cat([cols[s][1] for s in group]),
            versions=torch.cat([cols[s][2] for s in group]),
            advantages=torch.cat([cols[s][3] for s in group]),
            agg_weights=torch.cat([all_w[offsets[s] : offsets[s + 1]] for s in group]),
            seq_index=torch.cat([torch.full((cols[s][0].numel(),), s, dtype=torch.int64) for s in group]),
        )

    out = []
    for group in groups:
        lens = [n for s in group for n in per[s][4]]
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens), 0)
        ids, targets = torch.cat([per[s][0] for s in group]), torch.cat([per[s][1] for s in group])
        routes = torch.cat([per[s][2] for s in group]) if want_routes else None
        tree = None
        images = [img for s in group for img in trajectories[s].images]
        if shared_prefix:
            docs = [_document(trajectories[s], per[s], media_placeholder) for s in group]
            ids, targets, routes, tree = build_tree([d for doc in docs for d in doc])
            cu = tree.cu_seqlens
            images = _images_in_tree_order(tree, [trajectories[s] for s in group], docs)
        mb = MicroBatch(
            input_ids=ids[None],
            cu_seqlens=cu,
            targets=targets,
            **dict.fromkeys(LOSS_COLUMNS),
            routed_experts=routes[None] if want_routes else None,
            traj_indices=list(group),
            images=images,
            pending=lambda group=group: group_columns(group),
            tree=tree,
        )
        out.append(mb if defer else mb.ready())
    return out


def _shareable(t: Trajectory) -> bool:
    """A trajectory whose leading positions may be shared with its group's. With context segments, its
    first segment may: every later one starts a context of its own (its first tokens predicted by
    nothing), a document the tree keeps whole. Its text before its first image may (the image's
    placeholder ids are equal whatever its pixels), unless it also has segments (packed whole)."""
    return bool(t.group_id) and not (t.images and t.segment_starts)


def _first_image(inputs: torch.Tensor, placeholder: int | None) -> int | None:
    """The first position holding an image placeholder (None: none)."""
    if placeholder is None:
        return None
    at = (inputs == placeholder).nonzero()
    return int(at[0]) if len(at) else None


def _document(t: Trajectory, p: tuple, placeholder: int | None = None) -> list[Document]:
    """A trajectory's documents of the unshared packed layout (one a context segment), its group on the
    first when it may share, shared only before its first image."""
    inputs, targets, routes, _, seg_lens = p
    cuts = np.cumsum([0] + seg_lens).tolist()
    return [Document(inputs[a:b], targets[a:b], None if routes is None else routes[a:b],
                     t.group_id if i == 0 and _shareable(t) else None, _first_image(inputs[a:b], placeholder))
            for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))]


def _images_in_tree_order(tree, trajectories: list[Trajectory], docs: list[list[Document]]) -> list:
    """The micro-batch's images in the order of their placeholders in the tree stream (the model splices
    them in stream order). No image is in a shared prefix (it stops before the first), so each image lies
    in the last piece of its document; a trajectory's images all ride with its first document: its
    documents follow one another in the tree when it has images (shared or not, they are consecutive)."""
    images_of, first = {}, 0
    for t, doc in zip(trajectories, docs, strict=True):
        images_of[first] = t.images
        first += len(doc)
    lengths = [len(d.inputs) for doc in docs for d in doc]
    return [img for d, _, end in tree.pieces if end == lengths[d] for img in images_of.get(d, [])]


def _sharing_units(trajectories: list[Trajectory], per: list[tuple], placeholder: int | None = None) -> list[list[int]]:
    """Packing units: each group whose shareable members agree on at least one leading position, and every
    other trajectory alone (in the order of their first trajectory)."""
    by_group: dict[str, list[int]] = {}
    for s, t in enumerate(trajectories):
        if _shareable(t):
            by_group.setdefault(t.group_id, []).append(s)
    together = {members[0]: members for members in by_group.values()
                if len(members) > 1 and _shared(members, per, placeholder) > 0}  # fmt: skip
    inside = {s for members in together.values() for s in members}
    return [together.get(s, [s]) for s in range(len(trajectories)) if s in together or s not in inside]


def _shared(unit: list[int], per: list[tuple], placeholder: int | None = None) -> int:
    """The positions a unit's members share (0 for one trajectory)."""
    if len(unit) < 2:
        return 0
    first = [per[s][4][0] for s in unit]  # each member's first context segment: what can be shared
    return shared_positions([Document(per[s][0][:n], per[s][1][:n], None if per[s][2] is None else per[s][2][:n],
                                      share_before=_first_image(per[s][0][:n], placeholder))
                             for s, n in zip(unit, first, strict=True)])


def _routes(t: Trajectory, s: int, P: int, L: int, num_moe_layers: int, top_k: int) -> torch.Tensor:
    """[L, n_moe, k] int64: the experts each position's input token was routed to, -1 where unknown."""
    routes = torch.full((L, num_moe_layers, top_k), -1, dtype=torch.int64)
    for j, rec in enumerate(t.routed_experts or []):
        if P + j >= L or not rec:
            continue  # the last token is never an input; empty records stay -1
        r = torch.tensor(rec, dtype=torch.int64)
        if r.shape != (num_moe_layers, top_k):
            raise ValueError(
                f"trajectory {s} ({t.id}): routed_experts[{j}] has shape {tuple(r.shape)}, "
                f"the model needs [{num_moe_layers} MoE layers, k={top_k}]"
            )
        routes[P + j] = r
    return routes


def shard_micro_batches(micro_batches: list[MicroBatch], rank: int, world_size: int) -> list[MicroBatch]:
    """Rank `rank`'s share: micro-batches rank, rank + W, ...; padded with zero-weight fillers
    so that every rank runs ceil(n / W) of them."""
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_micro_batches: rank {rank} is outside [0, {world_size})")
    mine = micro_batches[rank::world_size]
    per_rank = -(-len(micro_batches) // world_size)
    while len(mine) < per_rank:
        mine.append(micro_batches[0].zero_weight())
    return mine
