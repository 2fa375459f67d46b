"""Shared-prefix training: a GRPO group's common prefix computed once, its state forked to every sample.

The samples of a group share their prompt (and, in multi-turn episodes, earlier turns). Position i of a
packed sequence reads input token x_i and predicts x_{i+1}; while the samples agree on both (and on the
recorded experts, under routing replay), everything the model computes there is the same for all of
them, because every layer is causal. So a group of G sequences with m such positions becomes a tree:

    root    the m shared positions, run once                       (a document of the tree stream)
    branch  each sample's positions m .. L-1, from the root's state (one document a sample)

and the micro-batch's forward runs the tree stream [roots ; branches] (every root first, then the
branches, grouped by their root) instead of the G whole sequences. What crosses the fork, per layer:

    KDA     the root's final recurrent state S [H, K, V] is each branch's initial state (chunk_kda's
            initial_state per document), and the root's last W-1 pre-conv rows of q, k, v are each
            branch's short-conv window (short_conv's left per document);
    MLA     each branch's queries read the root's keys and values (from its latent, computed once) before
            their own, causally (shared_prefix_attention); K3's MLA is NoPE (K3 report arXiv 2607.24653
            §2.1.2), so no position enters the keys and a branch's keys need no offset;
    rest    Block AttnRes, the norms, the MoE and the LM head work per position: the root's positions
            are simply there once.

The gradients of all branches flow back into the root through those hand-overs and sum there, as in the
unshared computation. The loss stays the unshared one: `index` maps every position of the unshared
packed layout to its tree position, so log p(target) of a shared position is gathered once per sample
it belongs to (with that sample's advantage, mask and weight) and its gradient is the sum over them.
The model takes a tree as `model(ids, cu_seqlens=tree.cu_seqlens, prefix_tree=tree)`: its KDA and MLA
layers call the tree's `short_conv`, `chunk_kda` and `latent_attention` (the hooks context parallelism
uses) instead of their packed ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from k3rl.kernels.attention import causal_attention, shared_prefix_attention
from k3rl.kernels.kda import chunk_kda, document_windows, short_conv
from k3rl.kernels.varlen import remember_host_offsets

__all__ = ["Document", "PrefixTree", "build_tree", "shared_positions"]


@dataclass
class Document:
    """One document of the unshared packed layout: inputs x_0..x_{L-1}, targets x_1..x_L, the recorded
    experts [L, n_moe, k] (None: not replayed), its group (None: never shared) and the first position it may
    not share (its first image placeholder: equal ids there say nothing of equal pixels; None: none)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    routes: torch.Tensor | None
    group: object = None
    share_before: int | None = None


def shared_positions(members: list[Document]) -> int:
    """m: the leading positions where every member has the same input, target and recorded experts,
    capped at the shortest member's length - 1 (every branch keeps at least one position) and before any
    member's first image."""
    m = min([len(s.inputs) - 1 for s in members] + [s.share_before for s in members if s.share_before is not None])
    first = members[0]
    for s in members[1:]:
        same = (s.inputs[:m] == first.inputs[:m]) & (s.targets[:m] == first.targets[:m])
        if first.routes is not None:
            same &= (s.routes[:m] == first.routes[:m]).flatten(1).all(1)
        differ = (~same).nonzero()
        if len(differ):
            m = int(differ[0])
    return max(m, 0)


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass
class PrefixTree:
    """The tree stream's layout (see the module docstring). Documents 0 .. roots-1 are roots (a shared
    prefix, or a sequence shared with nobody), the rest branches, grouped by root.

    cu_seqlens [N+1]   the tree stream's documents
    parent     [N - roots] int64: the root each branch forks from
    index      [positions] int64: the tree position of each position of the unshared packed layout
    forks      (root, first branch, end) document ranges: each shared prefix and its branches
    """

    cu_seqlens: torch.Tensor
    roots: int
    parent: torch.Tensor
    index: torch.Tensor
    forks: list[tuple[int, int, int]]
    offsets: list[int]  # cu_seqlens' host values
    shared: int = 0  # unshared positions that read a shared prefix (each prefix position once per branch)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (document, start, end) of each, in order

    @property
    def root_tokens(self) -> int:
        return self.offsets[self.roots]

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def _cu(self, first: int, end: int) -> torch.Tensor:
        """cu_seqlens of documents first .. end-1, from 0 (on this tree's device; its host values known)."""
        part = [o - self.offsets[first] for o in self.offsets[first : end + 1]]
        cu = torch.tensor(part, dtype=self.cu_seqlens.dtype).to(self.cu_seqlens.device)
        return remember_host_offsets(cu, part)

    def to(self, device) -> PrefixTree:
        cu = self.cu_seqlens.to(device)
        return replace(self, cu_seqlens=remember_host_offsets(cu, self.offsets), parent=self.parent.to(device),
                       index=self.index.to(device))

    def unshare(self, x: torch.Tensor) -> torch.Tensor:
        """A per-position tensor [..., T_tree] in the unshared layout [..., positions] (a gather: the
        gradient of a shared position sums over the samples that read it)."""
        return x[..., self.index]

    # ----- the three hooks KDA and MLA call (as they do a ContextParallel's) -----------------------
    def short_conv(self, x: torch.Tensor, weight: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """KDA's short convolution over the tree stream x [1, T, C]: a root starts from zeros, a branch
        from the last W-1 rows of its root (short_conv's window a document; its gradient reaches them)."""
        W = weight.shape[-1]
        if W == 1 or self.roots == len(self.offsets) - 1:
            return short_conv(x, weight, None, self.cu_seqlens)[0]
        roots = document_windows(x[:, : self.root_tokens], None, self._cu(0, self.roots), W)  # [R, W-1, C]
        left = torch.cat([roots.new_zeros(roots.shape), roots[self.parent]])  # roots: zeros; branches: the root's
        return short_conv(x, weight, left, self.cu_seqlens)[0]

    def chunk_kda(self, q, k, v, g, beta, cu_seqlens=None, initial_state=None, output_final_state=False, **kw):
        """Chunk KDA over the tree stream: the roots from zero, then the branches from their root's final
        state S [H, K, V] (chunk_kda's initial state a document; its gradient flows back into the root)."""
        if initial_state is not None or output_final_state:
            raise ValueError("PrefixTree.chunk_kda trains from zero states; it takes no initial or final state")
        R = self.root_tokens
        roots = lambda x: x[:, :R]  # noqa: E731
        if self.roots == len(self.offsets) - 1:
            return chunk_kda(q, k, v, g, beta, cu_seqlens=self.cu_seqlens, **kw)
        o_r, S_r = chunk_kda(*map(roots, (q, k, v, g, beta)), cu_seqlens=self._cu(0, self.roots),
                             output_final_state=True, **kw)  # fmt: skip
        branches = lambda x: x[:, R:]  # noqa: E731
        o_b, _ = chunk_kda(*map(branches, (q, k, v, g, beta)), cu_seqlens=self._cu(self.roots, len(self.offsets) - 1),
                           initial_state=S_r[self.parent], **kw)  # fmt: skip
        return torch.cat([o_r, o_b], dim=1), None

    def latent_attention(self, layer, q: torch.Tensor, latent: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """Gated MLA's attention over the tree stream (fp32 [1, T, H, dv]): per-head keys and values from
        the latent once for every token; the roots attend causally within themselves, each fork's branches
        read their root's keys before their own (shared_prefix_attention)."""
        k, v = layer.keys_values(latent)
        k, v = k.to(q.dtype), v.to(q.dtype)
        R = self.root_tokens
        outs = [causal_attention(q[:, :R], k[:, :R], v[:, :R], layer.scale, cu_seqlens=self._cu(0, self.roots),
                                 backend=layer.backend, kernel=layer.kernel)]  # fmt: skip
        for root, first, end in self.forks:
            p0, p1 = self.offsets[root], self.offsets[root + 1]
            b0, b1 = self.offsets[first], self.offsets[end]
            outs.append(shared_prefix_attention(q[:, b0:b1], k[:, b0:b1], v[:, b0:b1], k[:, p0:p1], v[:, p0:p1],
                                                layer.scale, self._cu(first, end), backend=layer.backend,
                                                kernel=layer.kernel))
        return torch.cat(outs, dim=1)


def build_tree(sequences: list[Document]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, PrefixTree]:
    """The tree stream of a micro-batch's documents (in their unshared packed order): (input ids [T_tree],
    targets [T_tree], recorded experts [T_tree, n_moe, k] or None, the tree). Documents of one group
    (two or more, `group` not None) that agree on at least one leading position share them; the rest
    are roots of their own."""
    members: dict[object, list[int]] = {}
    for d, s in enumerate(sequences):
        if s.group is not None:
            members.setdefault(s.group, []).append(d)
    shared = {}  # group -> m
    for key, docs in members.items():
        m = shared_positions([sequences[d] for d in docs]) if len(docs) > 1 else 0
        if m > 0:
            shared[key] = m
    roots, branches, parent, forks = [], [], [], []  # pieces: (doc, start, end)
    root_of: dict[object, int] = {}
    for d, s in enumerate(sequences):
        m = shared.get(s.group, 0) if s.group is not None else 0
        if m == 0:
            roots.append((d, 0, len(s.inputs)))
        elif s.group not in root_of:
            root_of[s.group] = len(roots)
            roots.append((d, 0, m))
    for key, r in root_of.items():  # branches grouped by root, in root order
        first = len(roots) + len(branches)
        for d in members[key]:
            branches.append((d, shared[key], len(sequences[d].inputs)))
            parent.append(r)
        forks.append((r, first, len(roots) + len(branches)))
    pieces = roots + branches
    offsets = _offsets([e - s for _, s, e in pieces])
    # the tree position of each unshared position: a shared one in its root, the rest in its own piece
    start_of = {}  # (doc, piece start) -> tree offset of the piece
    for (d, s, _), off in zip(pieces, offsets[:-1], strict=True):
        start_of[(d, s)] = off
    index = []
    for d, s in enumerate(sequences):
        L, m = len(s.inputs), shared.get(s.group, 0) if s.group is not None else 0
        if m == 0:
            index.append(torch.arange(L) + start_of[(d, 0)])
        else:
            root_doc = pieces[root_of[s.group]][0]
            index += [torch.arange(m) + start_of[(root_doc, 0)], torch.arange(L - m) + start_of[(d, m)]]
    take = lambda name: torch.cat([getattr(sequences[d], name)[s:e] for d, s, e in pieces])  # noqa: E731
    routes = take("routes") if sequences and sequences[0].routes is not None else None
    tree = PrefixTree(
        cu_seqlens=remember_host_offsets(torch.tensor(offsets, dtype=torch.int32), offsets), roots=len(roots),
        parent=torch.tensor(parent, dtype=torch.long), index=torch.cat(index) if index else torch.zeros(0, dtype=torch.long),
        forks=forks, offsets=offsets, shared=sum(m * len(members[key]) for key, m in shared.items()), pieces=pieces,
    )  # fmt: skip
    return take("inputs"), take("targets"), routes, tree
