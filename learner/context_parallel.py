"""Context parallelism: one packed sequence split over the ranks of a process group.

- ``context_layout`` / ``shard``      which positions each rank holds (contiguous, or zigzag)
- ``kcp_chunk_kda``                   KDA context parallel, KCP (K3 report, arXiv 2607.24653, §5.1.2)
- ``cp_gated_mla``, ``cp_short_conv`` Gated MLA over the whole sequence's latent, and KDA's short
                                      conv with the previous rank's rows (``context_parallel_layers.py``)

Everything is a collective: every rank of the group calls it together, with its own shard, and
runs its backward too (the gathers' backward all-reduces the gradients). The model does not know
about it; these functions are called *on* its layers' inputs (torchtitan style).

KCP in one paragraph. KDA's state update is ``S_t = M_t S_{t-1} + beta_t k_t v_t^T`` with
``M_t = (I - beta_t k_t k_t^T) Diag(alpha_t)`` (report §2.1.1 Eq. 1; docs/model.md §2.4): the transition depends on the
tokens, so per-rank zero-start states cannot just be summed. A segment of tokens run from an
entering state S_in ends in ``M S_in + S~`` (M = product of its transitions, d_k x d_k per head;
S~ its zero-start final state), and each output is ``o_t = o~_t + P_t^T S_in`` with
``P_t^T = q_t^T M_t ... M_1``. Each rank computes (M, S~) of its segments, one all-gather hands
them to every rank, and each rank scans ``S_in(next) = M S_in(prev) + S~(prev)`` over the
segments before its own; a document boundary cuts the chain (the state entering a document is
its initial state, not what came before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3rl.kernels.kda import chunk_kda

__all__ = [
    "context_layout",
    "shard",
    "all_gather_autograd",
    "local_documents",
    "context_shard_layout",
    "kcp_chunk_kda",
]


def context_layout(total: int, world: int, zigzag: bool = False) -> list[list[tuple[int, int]]]:
    """The [start, end) segments of positions each rank holds, in increasing order.

    Contiguous: rank r holds one slice (sizes differ by at most one). Zigzag: the sequence is cut
    into 2 * world slices and rank r holds slices r and 2 * world - 1 - r, which evens out the
    work of causal attention (rank r's queries see about r / world of the keys under the
    contiguous split: the last rank does 2 * world - 1 times the work of the first).
    """
    pieces = 2 * world if zigzag else world
    if world < 1 or total < pieces:
        raise ValueError(
            f"context_layout: {total} tokens cannot be split into {pieces} non-empty slices over {world} ranks"
            f"{' (zigzag)' if zigzag else ''}; pack more tokens or use fewer context-parallel ranks"
        )
    cuts = [total * i // pieces for i in range(pieces + 1)]
    slices = list(zip(cuts[:-1], cuts[1:], strict=True))
    if not zigzag:
        return [[s] for s in slices]
    return [[slices[r], slices[pieces - 1 - r]] for r in range(world)]


def shard(x: torch.Tensor, segments: list[tuple[int, int]], dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole-sequence tensor: its segments of ``dim``, concatenated."""
    return torch.cat([x.narrow(dim, s, e - s) for s, e in segments], dim=dim)


class _AllGather(torch.autograd.Function):
    """[world, *x.shape]: every rank's ``x``. Backward: the gradients of all ranks are summed
    (all-reduce) and each rank keeps the part of its own ``x``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather_autograd(x: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable all-gather of same-shaped tensors: [world, *x.shape]."""
    return _AllGather.apply(x, group if group is not None else dist.group.WORLD)


@dataclass
class LocalDocuments:
    """How this rank's tokens (its segments concatenated) fall into documents.

    cu_seqlens [n+1]: boundaries of the n local fragments (a document cut by segment ends);
    doc: global document index of each fragment; segment: which of the rank's segments it is in;
    starts_doc: the fragment holds its document's first token (its state starts from the
    document's initial state); carries_in: it continues a document from before its segment
    (its state starts from the chain of earlier ranks).
    """

    cu_seqlens: torch.Tensor
    doc: list[int]
    segment: list[int]
    starts_doc: list[bool]
    carries_in: list[bool]


def local_documents(cu_seqlens: torch.Tensor, segments: list[tuple[int, int]]) -> LocalDocuments:
    """Cut the global documents ``cu_seqlens`` [N+1] at this rank's ``segments``."""
    cs = [int(c) for c in cu_seqlens.tolist()]
    bounds, doc, seg, starts, carries = [0], [], [], [], []
    for j, (s, e) in enumerate(segments):
        for d, (a, b) in enumerate(zip(cs[:-1], cs[1:], strict=True)):
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue  # the document is not in this segment (or is empty)
            bounds.append(bounds[-1] + hi - lo)
            doc.append(d)
            seg.append(j)
            starts.append(lo == a)
            carries.append(lo != a)  # then lo == s: the document began before this segment
    cu = torch.tensor(bounds, dtype=torch.int64, device=cu_seqlens.device)
    return LocalDocuments(cu, doc, seg, starts, carries)


def context_shard_layout(name: str, x: torch.Tensor, cu_seqlens, world: int, zigzag: bool, rank: int):
    """The layout of the ``cu_seqlens`` sequence over ``world`` ranks, after checking that ``x``
    [1, T_r, ...] is this rank's part of it (a clear error otherwise)."""
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.dtype.is_floating_point
    ):
        raise ValueError(
            f"{name}: cu_seqlens must be the 1-D integer document boundaries [N+1] of the whole sequence"
        )
    cs = cu_seqlens.tolist()
    if len(cs) < 2 or cs[0] != 0 or any(b < a for a, b in zip(cs, cs[1:], strict=False)):
        raise ValueError(f"{name}: cu_seqlens must start at 0 and be non-decreasing; got {cs}")
    if x.shape[0] != 1:
        raise ValueError(f"{name}: the sequence must be packed to batch 1, got batch {x.shape[0]}")
    layout = context_layout(cs[-1], world, zigzag)
    want = sum(e - s for s, e in layout[rank])
    if x.shape[1] != want:
        raise ValueError(
            f"{name}: rank {rank} holds {x.shape[1]} tokens, but its segments {layout[rank]} of the "
            f"{cs[-1]}-token sequence have {want}; pass shard(x, context_layout(...)[rank])"
        )
    return layout


def _scan_entering_states(M: torch.Tensor, S: torch.Tensor, layout) -> dict[tuple[int, int], torch.Tensor]:
    """The state entering every segment: S_in(next) = M(prev) S_in(prev) + S~(prev), in position order.

    M [world, n_seg, H, K, K], S [world, n_seg, H, K, V] gathered from every rank. M is zero for
    a segment that holds a document start (its end state does not depend on what came before).
    """
    order = sorted((seg[0], r, j) for r, segs in enumerate(layout) for j, seg in enumerate(segs))
    # zero, but taken from the gathered tensor: every rank's loss then depends on the gather, so
    # every rank joins its backward all-reduce (rank 0 would otherwise skip it and the rest hang)
    state = S[0, 0] * 0
    entering = {}
    for _, r, j in order:
        entering[(r, j)] = state
        state = M[r, j] @ state + S[r, j]
    return entering


def kcp_chunk_kda(
    q, k, v, g, beta, cu_seqlens, group=None, zigzag=False, scale=None, initial_state=None,
    output_final_state=False, chunk_size=64, backend="auto", **gate_kwargs,
):  # fmt: skip
    """``chunk_kda`` of one packed sequence split over the ranks of ``group`` (a collective).

    q, k, g [1, T_r, H, K], v [1, T_r, H, V], beta [1, T_r, H]: this rank's tokens,
    ``shard(x, context_layout(T, world, zigzag)[rank])`` of the whole sequence's tensors;
    cu_seqlens [N+1]: document boundaries of the whole sequence (the same on every rank);
    initial_state [N, H, K, V]: per document, as in ``chunk_kda`` (each rank reads the rows of
    the documents starting in its part; their gradients land on that rank only: sum over ranks).
    Other arguments (gate kwargs included) are ``chunk_kda``'s. Returns o [1, T_r, H, V] (equal to
    this rank's shard of ``chunk_kda`` on the whole sequence) and, with ``output_final_state``,
    the states at the end of this rank's fragments [n, H, K, V] fp32: fragment i belongs to
    document ``local_documents(cu_seqlens, segments).doc[i]``, and is that document's final
    state when the document ends inside this rank's part.

    One ``chunk_kda`` call does all of a rank's work: v is widened to [v | 0] (V + K columns)
    and a fragment that carries a document in starts from [0 | I]. Columns are independent in
    KDA, so the extra K columns run the recurrence with v = 0 from S_0 = I: their state is the
    transition M_t ... M_1 of the fragment so far, and their output is P_t^T = q_t^T M_t ... M_1.
    With S_in the state that really enters the fragment (from the scan over earlier ranks):
        o_t     = o~_t + P_t^T S_in                 (o~, P: the two column blocks of the output)
        S_end   = S~ + M S_in                       (S~, M: the two column blocks of the state)
    A fragment that starts its document gets [S0_doc | 0] instead, so its P and M are zero.
    The extra cost is K more value columns in the one kernel call; no second pass. (P comes out
    in v's dtype, like o~: with bf16 inputs it is rounded as the outputs are.)
    """
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = context_shard_layout("kcp_chunk_kda", q, cu_seqlens, world, zigzag, rank)
    H, K, V = q.shape[-2], q.shape[-1], v.shape[-1]
    n_docs = cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (n_docs, H, K, V):
        raise ValueError(
            f"kcp_chunk_kda: initial_state must be [N={n_docs} documents, H={H}, K={K}, V={V}] for the "
            f"whole sequence (every rank passes the same); got {tuple(initial_state.shape)}"
        )
    docs = local_documents(cu_seqlens, layout[rank])
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    zeros_v = torch.zeros(H, K, V, dtype=state_dtype, device=q.device)
    zeros_k = torch.zeros(H, K, K, dtype=state_dtype, device=q.device)
    eye_k = torch.eye(K, dtype=state_dtype, device=q.device).expand(H, K, K)
    S0 = []
    for d, starts, carries in zip(docs.doc, docs.starts_doc, docs.carries_in, strict=True):
        s_v = initial_state[d].to(state_dtype) if (starts and initial_state is not None) else zeros_v
        S0.append(torch.cat([s_v, eye_k if carries else zeros_k], dim=-1))
    v_wide = torch.cat([v, v.new_zeros(*v.shape[:3], K)], dim=-1)
    o_wide, S_wide = chunk_kda(
        q, k, v_wide, g, beta, scale=scale, initial_state=torch.stack(S0), output_final_state=True,
        cu_seqlens=docs.cu_seqlens, chunk_size=chunk_size, backend=backend, **gate_kwargs,
    )  # fmt: skip
    # (M, S~) of each of this rank's segments: the two blocks of its last fragment's state
    last = [max(i for i, s in enumerate(docs.segment) if s == j) for j in range(len(layout[rank]))]
    ends = S_wide[last]  # [n_seg, H, K, V + K]
    gathered = all_gather_autograd(ends, group)  # [world, n_seg, H, K, V + K]
    entering = _scan_entering_states(gathered[..., V:], gathered[..., :V], layout)
    S_in = [entering[(rank, j)] for j in range(len(layout[rank]))]  # one per segment of this rank
    o_parts = []
    for seg, s_in in zip(o_wide[0].split([e - s for s, e in layout[rank]]), S_in, strict=True):
        o_t, P = seg.split([V, K], dim=-1)  # [t, H, V], [t, H, K]
        o_parts.append(o_t + torch.einsum("thk,hkv->thv", P.to(state_dtype), s_in).to(o_t.dtype))
    o = torch.cat(o_parts).unsqueeze(0)
    if not output_final_state:
        return o, None
    S_in_of_fragment = torch.stack([S_in[j] for j in docs.segment])
    return o, S_wide[..., :V] + S_wide[..., V:] @ S_in_of_fragment  # S_end = S~ + M S_in
