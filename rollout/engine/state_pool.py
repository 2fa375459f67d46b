"""Preallocated decode state of the embedded engine: one slot per decoding sequence.

For `num_slots` sequences (the engine's `max_num_seqs`) the pool holds, per KDA layer, the
fp32 recurrent state [N, H, K, V] and the short-convolution window [N, W-1, 3P]; per MLA layer
the latent cache [N, capacity, r + dr] (docs/model.md §2.7, §3.4). The KDA layers' buffers are views of
stacked tensors [L, N, ...] (one per shape), so a slot is copied, moved or extracted for all of them by
one op; the copies that remain per layer go through `torch._foreach_copy_` (`copy_all`): the host issues
a few ops per join, move or extract instead of a few per layer. Sequences join by copying
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


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[j].copy_(src[j]) for every j, in one `torch._foreach_copy_` per pair of dtypes (on CUDA a few
    multi-tensor kernels instead of one launch and one Python call per tensor; the same values)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dst, src, strict=True):
        g = groups.setdefault((d.dtype, s.dtype), ([], []))
        g[0].append(d)
        g[1].append(s)
    for d, s in groups.values():
        torch._foreach_copy_(d, s)


def stacked(templates: dict[int, torch.Tensor], num_slots: int) -> tuple[dict, list[tuple[torch.Tensor, list[int]]]]:
    """Zeroed buffers [num_slots, ...] shaped like each layer's batch-1 template: the layers of one shape and
    dtype share one stacked tensor [L, num_slots, ...], so one op moves or copies a slot in all of them. Returns
    each layer's buffer (a view of its stack, laid out as a buffer of its own would be) and the stacks with
    their layers."""
    groups: dict[tuple, list[int]] = {}
    for i, t in templates.items():
        groups.setdefault((tuple(t.shape[1:]), t.dtype), []).append(i)
    views, stacks = {}, []
    for ids in groups.values():
        t = templates[ids[0]]
        st = t.new_zeros(len(ids), num_slots, *t.shape[1:])
        stacks.append((st, ids))
        views.update(zip(ids, st.unbind(0), strict=True))
    return {i: views[i] for i in templates}, stacks


def clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A contiguous copy of each tensor: views of one `torch.stack` when they share a shape and dtype (one
    allocation and one copy), else one clone each."""
    if len(tensors) > 1 and all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype for t in tensors):
        return list(torch.stack(tensors).unbind(0))
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors]


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
        states, self._states = stacked({i: e.state for i, e in template.kda.items()}, num_slots)
        convs, self._convs = stacked({i: e.conv for i, e in template.kda.items()}, num_slots)
        self.kda = {i: KDACacheEntry(states[i], convs[i]) for i in template.kda}
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
        dst, src = [], []
        for stacks, field in ((self._states, "state"), (self._convs, "conv")):
            for st, ids in stacks:
                dst += st[:, slot : slot + 1].unbind(0)
                src += [getattr(cache.kda[i], field) for i in ids]
        for i, e in cache.mla.items():
            dst.append(self.mla[i][slot : slot + 1, :n])
            src.append(e.latent[:, :n])
        copy_all(dst, src)
        self.lengths[slot] = n

    def extract(self, slot: int) -> K3Cache:
        """A batch-1 copy of the state in `slot` (for the prefix cache): one copy per stacked buffer, each
        layer's tensor a contiguous view of it."""
        n = self.lengths[slot]
        states, convs = ({i: t for st, ids in stacks
                          for i, t in zip(ids, st[:, slot : slot + 1].clone(memory_format=torch.contiguous_format)
                                          .unbind(0), strict=True)}
                         for stacks in (self._states, self._convs))
        lats = clone_all([lat[slot : slot + 1, :n] for lat in self.mla.values()])
        return cache_over({i: KDACacheEntry(states[i], convs[i]) for i in self.kda},
                          {i: MLACacheEntry(lat) for i, lat in zip(self.mla, lats, strict=True)},
                          torch.full((1,), n, dtype=torch.int64, device=self.device), [n])

    def move(self, src: int, dst: int) -> None:
        """Move the state of slot `src` into slot `dst` (to keep the occupied slots leading); frees `src`."""
        n = self.lengths[src]
        for st, _ in (*self._states, *self._convs):
            st[:, dst].copy_(st[:, src])
        copy_all([lat[dst, :n] for lat in self.mla.values()], [lat[src, :n] for lat in self.mla.values()])
        self.lengths[dst], self.lengths[src] = n, 0

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def view(self, batch: int, context: int, lengths: torch.Tensor, host_lengths: list[int]) -> K3Cache:
        """A K3Cache over slots [0, batch) and latent positions [0, context): views, written in place
        by a decode forward (KDA state, MLA latents); `write_back` stores what the forward replaced."""
        states, convs = ({i: t for st, ids in stacks for i, t in zip(ids, st[:, :batch].unbind(0), strict=True)}
                         for stacks in (self._states, self._convs))
        kda = {i: KDACacheEntry(states[i], convs[i]) for i in self.kda}
        mla = {i: MLACacheEntry(lat[:batch, :context]) for i, lat in self.mla.items()}
        return cache_over(kda, mla, lengths, host_lengths)

    def write_back(self, cache: K3Cache) -> None:
        """After a decode forward over `view(...)`: copy the new conv windows (and any state the forward
        did not update where it lies) into the slots."""
        B = cache.batch_size
        dst, src = [], []
        for st, ids in self._states:  # updated where it lies by the decode forward (else copied back)
            for i, t in zip(ids, st[:, :B].unbind(0), strict=True):
                if cache.kda[i].state.data_ptr() != t.data_ptr():
                    dst.append(t)
                    src.append(cache.kda[i].state)
        for st, ids in self._convs:
            dst += st[:, :B].unbind(0)
            src += [cache.kda[i].conv for i in ids]
        copy_all(dst, src)
        for i, e in cache.mla.items():
            if e.latent.data_ptr() != self.mla[i].data_ptr():
                raise RuntimeError(f"MLA layer {i}: the decode forward reallocated the latent cache; the context "
                                   "view must cover max(lengths) + 1 positions")
