"""Context-parallel pieces of K3's layers, on top of ``context_parallel.py``.

- ``cp_gated_mla``    a Gated MLA layer whose queries attend to the latent of the whole sequence
- ``cp_short_conv``   KDA's causal short convolution, with the last W - 1 pre-conv rows of the
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

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .context_parallel import all_gather_autograd, context_shard_layout, local_documents
from .model.common import fp32_island
from .model.kda import short_conv
from .model.mla import GatedMLA

__all__ = ["cp_gated_mla", "cp_short_conv"]


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


def cp_gated_mla(
    layer: GatedMLA, x: torch.Tensor, cu_seqlens: torch.Tensor, group=None, zigzag: bool = False
) -> torch.Tensor:
    """``layer(x_whole, cu_seqlens)`` for a sequence split over the ranks of ``group`` (a collective).

    x [1, T_r, d]: this rank's tokens, ``shard(x_whole, context_layout(T, world, zigzag)[rank])``;
    cu_seqlens [N+1]: the whole sequence's document boundaries (the same on every rank). Returns
    this rank's part of the layer's output [1, T_r, d]. The layer's weights are replicated: their
    gradients on each rank cover its own tokens only (sum them over ranks, as data parallelism
    does).
    """
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = context_shard_layout("cp_gated_mla", x, cu_seqlens, world, zigzag, rank)
    q = layer.queries(x)
    latent = _gather_sequence(layer.latent(x), layout, group)  # [1, T, r + dr]
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    pos = torch.cat([torch.arange(s, e, device=x.device) for s, e in layout[rank]])  # query positions
    doc_of = lambda p: torch.searchsorted(cu[1:], p, right=True)  # noqa: E731
    first_key = int(cu[doc_of(pos[:1])])  # keys before the first query's document are never seen
    keys = torch.arange(first_key, int(pos[-1]) + 1, device=x.device)
    key_valid = (keys[None, :] <= pos[:, None]) & (doc_of(keys)[None, :] == doc_of(pos)[:, None])
    o = layer.absorbed_attention(q, latent[:, first_key : int(pos[-1]) + 1], key_valid.unsqueeze(0))
    # the rest is GatedMLA.forward's output gate and projection
    gate_logit = layer.g_proj(x)
    with fp32_island(x):
        y = torch.sigmoid(gate_logit.float()) * o.reshape(*x.shape[:2], -1).float()
    return layer.o_proj(y.to(layer.o_proj.weight.dtype))


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
