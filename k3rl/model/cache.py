"""K3Cache: per-sequence decoding state of the whole model (docs/model.md §2.7, §3.4).

For each KDA layer: the fp32 recurrent state [B, H, K, V] and the last W-1 pre-conv
projections of q, k, v. For each MLA layer: the normalised latent c and the shared key slice
kx of every past token, [B, capacity, r + dr], valid up to `lengths[b]` (padding beyond is
masked). AttnRes needs no state across time: its sources are the same token's earlier
sublayer outputs, recomputed in every forward.

An engine batches sequences of different lengths with `K3Cache.stack([...])`, takes them
apart with `split()`, and forks a prefilled prompt for a group of samples with `repeat(n)` /
`clone()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kda import KDACacheEntry
from .mla import DecodeStep, MLACacheEntry


class K3Cache:
    def __init__(self, kda: dict[int, KDACacheEntry], mla: dict[int, MLACacheEntry], lengths: torch.Tensor,
                 host_lengths: list[int] | None = None):
        self.kda = kda
        self.mla = mla
        self.lengths = lengths  # [B] int64 tokens already processed per sequence
        # host mirror: no syncs per layer. Given by whoever knows it (new, cloned, stacked, split caches):
        # reading a CUDA `lengths` makes the host wait for every kernel queued before it (an engine's
        # scheduler thread, behind the decode steps it queued)
        self.host_lengths: list[int] = list(host_lengths) if host_lengths is not None \
            else [int(v) for v in lengths.tolist()]

    def decode_step(self, num_new: int) -> DecodeStep:
        """Bookkeeping for a forward that appends `num_new` tokens to every sequence."""
        return DecodeStep(self.lengths, fresh=max(self.host_lengths) == 0, max_total=max(self.host_lengths) + num_new)

    def advance(self, num_new: int) -> None:
        self.lengths = self.lengths + num_new
        self.host_lengths = [n + num_new for n in self.host_lengths]

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def layer(self, idx: int) -> KDACacheEntry | MLACacheEntry:
        return self.kda[idx] if idx in self.kda else self.mla[idx]

    def clone(self) -> K3Cache:
        return K3Cache(
            {i: KDACacheEntry(e.state.clone(), e.conv.clone()) for i, e in self.kda.items()},
            {i: MLACacheEntry(e.latent.clone()) for i, e in self.mla.items()},
            self.lengths.clone(),
            self.host_lengths,
        )

    def split(self) -> list[K3Cache]:
        """One cache per sequence, each MLA buffer trimmed to that sequence's length."""
        out = []
        for b in range(self.batch_size):
            n = self.host_lengths[b]
            out.append(
                K3Cache(
                    {i: KDACacheEntry(e.state[b : b + 1].clone(), e.conv[b : b + 1].clone()) for i, e in self.kda.items()},
                    {i: MLACacheEntry(e.latent[b : b + 1, :n].clone()) for i, e in self.mla.items()},
                    self.lengths[b : b + 1].clone(),
                    [n],
                )
            )
        return out

    def repeat(self, n: int) -> K3Cache:
        """A batch of `n` copies of this (single-sequence) cache: fork a prompt for a group of samples."""
        if self.batch_size != 1:
            raise ValueError(f"repeat() forks a single-sequence cache; this one holds {self.batch_size}")
        return K3Cache.stack([self] * n)

    @staticmethod
    def stack(caches: list[K3Cache]) -> K3Cache:
        """Concatenate caches along the batch (sequences may have different lengths)."""
        if not caches:
            raise ValueError("K3Cache.stack: no caches given")
        first = caches[0]
        for c in caches[1:]:
            if c.kda.keys() != first.kda.keys() or c.mla.keys() != first.mla.keys():
                raise ValueError("K3Cache.stack: caches come from models with different layer layouts")
        kda = {
            i: KDACacheEntry(
                torch.cat([c.kda[i].state for c in caches]), torch.cat([c.kda[i].conv for c in caches])
            )
            for i in first.kda
        }
        mla = {}
        for i in first.mla:
            lats = [c.mla[i].latent for c in caches]
            cap = max(t.shape[1] for t in lats)
            dtype = next((t.dtype for t in lats if t.shape[1]), lats[0].dtype)
            mla[i] = MLACacheEntry(torch.cat([F.pad(t.to(dtype), (0, 0, 0, cap - t.shape[1])) for t in lats]))
        return K3Cache(kda, mla, torch.cat([c.lengths for c in caches]), [n for c in caches for n in c.host_lengths])
