"""Preallocated decode state of the embedded engine: one slot per decoding sequence.

For `num_slots` sequences (the engine's `max_num_seqs`) the pool holds, per KDA layer, the
fp32 recurrent state [N, H, K, V] and the short-convolution window [N, W-1, 3P]; per MLA layer
the latent cache [N, capacity, r + dr] (docs/model.md §2.7, §3.4). Sequences join by copying
their prefilled batch-1 `K3Cache` into a free slot and leave by freeing it; the scheduler keeps
the decoding sequences in slots 0..n-1, so a decode step works on the leading rows of every
buffer (`view`), whose addresses never change: no re-stacking per step, and the same tensors
can be captured in a CUDA graph. Token counts per slot live on the host (`lengths`).

The latent capacity grows by doubling up to `max_len` when a sequence needs it; `generation`
counts reallocations, so a captured graph knows when the buffers it reads have moved.
"""

from __future__ import annotations

import torch

from k3rl.model import K3Cache
from k3rl.model.kda import KDACacheEntry
from k3rl.model.mla import MLACacheEntry


def cache_over(kda: dict, mla: dict, lengths: torch.Tensor, host_lengths: list[int]) -> K3Cache:
    """A K3Cache over existing tensors, with its host mirror of the lengths given (no device sync)."""
    return K3Cache(kda, mla, lengths, host_lengths)


class StatePool:
    def __init__(self, model, num_slots: int, max_len: int, initial_capacity: int = 256,
                 dtype: torch.dtype | None = None):
        template = model.new_cache(1, dtype)  # conv windows and latents in `dtype` (default: the model's)
        self.num_slots = num_slots
        self.max_len = max_len
        self.capacity = min(max_len, initial_capacity)
        self.generation = 0
        self.device = template.lengths.device
        self.lengths = [0] * num_slots  # tokens in the state of each slot (0 = free)
        self.kda = {i: KDACacheEntry(e.state.new_zeros(num_slots, *e.state.shape[1:]),
                                     e.conv.new_zeros(num_slots, *e.conv.shape[1:]))
                    for i, e in template.kda.items()}
        self.mla = {i: e.latent.new_zeros(num_slots, self.capacity, e.latent.shape[-1]) for i, e in template.mla.items()}

    def ensure_capacity(self, need: int) -> None:
        """Make every latent buffer hold at least `need` tokens (doubling, at most max_len)."""
        if need <= self.capacity:
            return
        if need > self.max_len:
            raise ValueError(f"a sequence needs {need} cached tokens; the engine holds at most {self.max_len} "
                             "(max_model_len)")
        cap = self.capacity
        while cap < need:
            cap *= 2
        cap = min(cap, self.max_len)
        for i, lat in self.mla.items():
            grown = lat.new_zeros(lat.shape[0], cap, lat.shape[-1])
            grown[:, : self.capacity] = lat
            self.mla[i] = grown
        self.capacity = cap
        self.generation += 1

    def load(self, slot: int, cache: K3Cache) -> None:
        """Copy a prefilled batch-1 cache into `slot`."""
        n = cache.host_lengths[0]
        self.ensure_capacity(n + 1)
        for i, e in cache.kda.items():
            self.kda[i].state[slot].copy_(e.state[0])
            self.kda[i].conv[slot].copy_(e.conv[0])
        for i, e in cache.mla.items():
            self.mla[i][slot, :n].copy_(e.latent[0, :n])
        self.lengths[slot] = n

    def extract(self, slot: int) -> K3Cache:
        """A batch-1 copy of the state in `slot` (for the prefix cache)."""
        n = self.lengths[slot]
        kda = {i: KDACacheEntry(e.state[slot : slot + 1].clone(), e.conv[slot : slot + 1].clone())
               for i, e in self.kda.items()}
        mla = {i: MLACacheEntry(lat[slot : slot + 1, :n].clone()) for i, lat in self.mla.items()}
        return cache_over(kda, mla, torch.full((1,), n, dtype=torch.int64, device=self.device), [n])

    def move(self, src: int, dst: int) -> None:
        """Move the state of slot `src` into slot `dst` (to keep the occupied slots leading); frees `src`."""
        n = self.lengths[src]
        for e in self.kda.values():
            e.state[dst].copy_(e.state[src])
            e.conv[dst].copy_(e.conv[src])
        for lat in self.mla.values():
            lat[dst, :n].copy_(lat[src, :n])
        self.lengths[dst], self.lengths[src] = n, 0

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def view(self, batch: int, context: int, lengths: torch.Tensor, host_lengths: list[int]) -> K3Cache:
        """A K3Cache over slots [0, batch) and latent positions [0, context): views, written in place
        by a decode forward (KDA state, MLA latents); `write_back` stores what the forward replaced."""
        kda = {i: KDACacheEntry(e.state[:batch], e.conv[:batch]) for i, e in self.kda.items()}
        mla = {i: MLACacheEntry(lat[:batch, :context]) for i, lat in self.mla.items()}
        return cache_over(kda, mla, lengths, host_lengths)

    def write_back(self, cache: K3Cache) -> None:
        """After a decode forward over `view(...)`: copy the new conv windows (and any state the forward
        did not update where it lies) into the slots."""
        B = cache.batch_size
        for i, e in cache.kda.items():
            slot = self.kda[i]
            if e.state.data_ptr() != slot.state.data_ptr():
                slot.state[:B].copy_(e.state)
            slot.conv[:B].copy_(e.conv)
        for i, e in cache.mla.items():
            if e.latent.data_ptr() != self.mla[i].data_ptr():
                raise RuntimeError(f"MLA layer {i}: the decode forward reallocated the latent cache; the context "
                                   "view must cover max(lengths) + 1 positions")
