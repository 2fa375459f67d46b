"""Context-parallel pieces of K3's layers, on top of ``context_parallel.py``.

- ``ContextParallel``      what a K3 model runs under context parallelism: pass it as
                           ``model(ids_shard, cu_seqlens=whole, context_parallel=cp)``
- ``cp_latent_attention``  Gated MLA's attention: this rank's queries over the whole sequence's latent
- ``cp_short_conv``        KDA's causal short convolution, with the last W - 1 pre-conv rows of the
                           previous rank as the left context of a document that crosses into this one

MLA keeps one latent per token, [c | kx] (kv_lora_rank + qk_rope_head_dim values, shared by all
heads; K3 report arXiv 2607.24653 §2.1.2), so the cheap thing to move between ranks is the
latent, not per-head keys and values: every rank computes the latent of its own tokens, one
all-gather gives every rank the whole sequence's latent, and each rank runs the layer's own
absorbed attention (``GatedMLA.absorbed_attention``) for its queries over the keys up to its last
position, with a mask that is causal and stays inside each query's document.

Load balance: under the contiguous split, rank r's queries see about (r + 1/2) / world of the
keys, so the last rank does about 2 * world - 1 times the attention work of the first. The zigzag
layout (``context_layout(..., zigzag=True)``: rank r holds slices r and 2 * world - 1 - r of
2 * world) gives every rank the same work; ``kcp_chunk_kda`` accepts the same layout, so KDA and
MLA layers of one model can share it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3rl.model.kda import short_conv
from k3rl.model.mla import GatedMLA

from .context_parallel import (
    all_gather_autograd,
    context_layout,
    context_shard_layout,
    kcp_chunk_kda,
    local_documents,
    shard,
)
from .data import MicroBatch

__all__ = ["ContextParallel", "cp_latent_attention", "cp_short_conv"]


def _gather_sequence(x: torch.Tensor, layout, group) -> torch.Tensor:
    """Every rank's [1, T_r, C] part -> the whole sequence [1, T, C] in position order (differentiable)."""
    rank = dist.get_rank(group)
    sizes = [[e - s for s, e in segs] for segs in layout]
    longest = max(max(row) for row in sizes)
    mine = torch.stack([F.pad(part, (0, 0, 0, longest - part.shape[0]))
                        for part in x[0].split(sizes[rank])])  # [n_seg, longest, C]  # fmt: skip
    gathered = all_gather_autograd(mine, group)  # [world, n_seg, longest, C]
    order = sorted((seg[0], r, j) for r, segs in enumerate(layout) for j, seg in enumerate(segs))
    return torch.cat([gathered[r, j, : sizes[r][j]] for _, r, j in order]).unsqueeze(0)


def cp_latent_attention(
    layer: GatedMLA, q: torch.Tensor, latent: torch.Tensor, cu_seqlens: torch.Tensor, group=None, zigzag: bool = False
) -> torch.Tensor:
    """Gated MLA's attention for a sequence split over the ranks of ``group`` (a collective).

    q [1, T_r, H, dn + dr] and latent [1, T_r, r + dr]: this rank's queries and latent
    (``layer.queries``, ``layer.latent`` of its shard); cu_seqlens [N+1]: the whole sequence's
    document boundaries. One all-gather gives every rank the whole latent; the layer's absorbed
    attention then runs this rank's queries over the keys from the start of its first query's
    document to its last position, causal and per document. Returns o [1, T_r, H, dv] fp32, the
    rank's part of ``layer.naive_attention`` on the whole sequence.
    """
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = context_shard_layout("cp_latent_attention", q, cu_seqlens, world, zigzag, rank)
    latent = _gather_sequence(latent, layout, group)  # [1, T, r + dr]
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    pos = torch.cat([torch.arange(s, e, device=q.device) for s, e in layout[rank]])  # query positions
    doc_of = lambda p: torch.searchsorted(cu[1:], p, right=True)  # noqa: E731
    first_key = int(cu[doc_of(pos[:1])])  # keys before the first query's document are never seen
    keys = torch.arange(first_key, int(pos[-1]) + 1, device=q.device)
    key_valid = (keys[None, :] <= pos[:, None]) & (doc_of(keys)[None, :] == doc_of(pos)[:, None])
    return layer.absorbed_attention(q, latent[:, first_key : int(pos[-1]) + 1], key_valid.unsqueeze(0))


def cp_short_conv(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, group=None, zigzag: bool = False
) -> torch.Tensor:
    """``short_conv(x_whole, weight, None, cu_seqlens)[0]`` for a sequence split over ``group``.

    x [1, T_r, C]: this rank's pre-conv projections (its shard); weight [C, 1, W]. A W-tap causal
    conv needs the W - 1 rows before each segment (docs/model.md §9.3): every rank shares the last
    W - 1 rows of its segments (one all-gather), and a document that crosses into a segment gets
    them, zeroed where they belong to an earlier document, as extra rows in front of its fragment;
    their own outputs are dropped.
    """
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = context_shard_layout("cp_short_conv", x, cu_seqlens, world, zigzag, rank)
    halo = weight.shape[-1] - 1
    segments = layout[rank]
    if halo == 0:  # a 1-tap conv needs no left context
        return short_conv(x, weight, None, local_documents(cu_seqlens, segments).cu_seqlens)[0]
    parts = x[0].split([e - s for s, e in segments])
    tails = torch.stack([F.pad(p[-halo:], (0, 0, halo - min(halo, p.shape[0]), 0)) for p in parts])
    gathered = all_gather_autograd(tails, group)  # [world, n_seg, halo, C]: rows end - halo .. end - 1
    row_at = {e - halo + i: gathered[r, j, i] for r, segs in enumerate(layout)
              for j, (s, e) in enumerate(segs) for i in range(halo) if e - halo + i >= s}  # fmt: skip
    # a zero row taken from the gathered tensor: added to the output below, it keeps every rank in
    # the gather's backward all-reduce, also a rank whose documents all start inside its part
    zero = gathered[0, 0, 0] * 0
    cu = [int(c) for c in cu_seqlens.tolist()]
    docs = local_documents(cu_seqlens, segments)
    rows, bounds, keep = [], [0], []
    for i, (lo, hi) in enumerate(
        zip(docs.cu_seqlens[:-1].tolist(), docs.cu_seqlens[1:].tolist(), strict=True)
    ):
        frag = x[0, lo:hi]
        if docs.carries_in[i]:
            start = segments[docs.segment[i]][0]  # the fragment begins its segment
            left = [row_at[p] if p >= cu[docs.doc[i]] else zero for p in range(start - halo, start)]
            frag = torch.cat([torch.stack(left).to(x.dtype), frag])
            keep.append(torch.arange(bounds[-1] + halo, bounds[-1] + frag.shape[0]))
        else:
            keep.append(torch.arange(bounds[-1], bounds[-1] + frag.shape[0]))
        rows.append(frag)
        bounds.append(bounds[-1] + frag.shape[0])
    y, _ = short_conv(torch.cat(rows).unsqueeze(0), weight, None, torch.tensor(bounds))
    return y[:, torch.cat(keep)] + zero.sum().to(y.dtype)


@dataclass(frozen=True)
class ContextParallel:
    """One packed sequence split over the ranks of ``group`` (None: the default group), in the
    contiguous or the zigzag layout (``context_layout``). K3's layers take it as their
    ``context_parallel`` argument and then call its three collectives instead of their local ops,
    with ``cu_seqlens`` the whole sequence's document boundaries (the same on every rank):

        short_conv        -> cp_short_conv        (KDA: q | k | v short convolutions in one call)
        chunk_kda         -> kcp_chunk_kda        (KDA: KCP, K3 report arXiv 2607.24653 §5.1.2)
        latent_attention  -> cp_latent_attention  (Gated MLA over the gathered latent)

    Everything else of the model works per position (projections, AttnRes, norms, MoE, the LM
    head), so a rank that feeds ``cp.shard(input_ids)`` gets ``cp.shard`` of the logits. The
    replicated weights' gradients cover each rank's own tokens: sum them over the ranks, as data
    parallelism does.
    """

    group: object = None
    zigzag: bool = False

    def segments(self, total: int) -> list[tuple[int, int]]:
        """This rank's [start, end) slices of a ``total``-token sequence."""
        group = self.group if self.group is not None else dist.group.WORLD
        return context_layout(total, dist.get_world_size(group), self.zigzag)[dist.get_rank(group)]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor (positions along ``dim``)."""
        return shard(x, self.segments(x.shape[dim]), dim)

    def shard_micro_batch(self, mb: MicroBatch) -> MicroBatch:
        """This rank's positions of a packed micro-batch (``learner/data.py``): every per-position
        tensor sharded, ``cu_seqlens`` (the whole sequence's) and the trajectory indices kept."""
        if mb.images:
            raise ValueError("context parallelism cannot split a micro-batch with images (the vision tower does "
                             "not run context-parallel); set learner.context_parallel: 1 for image episodes")
        segments = self.segments(mb.num_tokens)
        per_position = ("targets", "mask", "behaviour_logp", "advantages", "agg_weights", "seq_index", "versions")
        return replace(mb, input_ids=shard(mb.input_ids, segments, 1),
                       routed_experts=None if mb.routed_experts is None else shard(mb.routed_experts, segments, 1),
                       **{name: shard(getattr(mb, name), segments, 0) for name in per_position})  # fmt: skip

    def short_conv(self, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return cp_short_conv(x, weight, cu_seqlens, self.group, self.zigzag)

    def chunk_kda(self, q, k, v, g, beta, cu_seqlens, **kwargs):
        return kcp_chunk_kda(q, k, v, g, beta, cu_seqlens, self.group, self.zigzag, **kwargs)

    def latent_attention(self, layer: GatedMLA, q, latent, cu_seqlens) -> torch.Tensor:
        return cp_latent_attention(layer, q, latent, cu_seqlens, self.group, self.zigzag)
