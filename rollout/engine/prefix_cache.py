"""The embedded engine's prefix cache: decoding states of prompts already computed, offered to later
prompts that extend them (a conversation's next turn, a GRPO group's shared prompt), and the anchors
by which a prompt that shares a long start with an earlier one (a system prompt) is found.

An entry's `cache` covers `ids` (with the images of `images` in order) and `logits` follow its last
id. Entries are kept least-recently-used first; a hit moves an entry to the end. The scheduler decides
which states may be offered (only those computed entirely by the current weights) and empties the
cache at every weight update.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PrefixEntry:
    """A cached decoding state: `cache` covers `ids` (with `images` in order), `logits` follow them."""

    ids: tuple[int, ...]
    images: tuple[str, ...]
    cache: Any  # K3Cache, batch 1
    logits: torch.Tensor  # [V], the logits after the last id


class PrefixCache:
    ANCHOR = 32  # prompts are compared for a shared prefix when their first ANCHOR tokens agree

    def __init__(self, size: int, share_prefix: int, pad_token_id: int):
        self.size = size  # entries kept (0: none)
        self.share_prefix = share_prefix  # shortest shared start worth a prefill of its own (0: off)
        self.pad_token_id = pad_token_id  # an image's placeholder token: a state never ends inside its run
        self.entries: OrderedDict[tuple, PrefixEntry] = OrderedDict()
        # the entries indexed by length, then last id (so a lookup visits only lengths the prompt can hold and,
        # for each, the entries ending in the prompt's token there), and each entry's last use (its LRU rank)
        self._by_len: dict[int, dict[int | None, list[tuple]]] = {}
        self._lengths: list[int] = []  # the keys of _by_len, ascending
        self._used: dict[tuple, int] = {}
        self._clock = 0
        self._anchors: OrderedDict[tuple, list[int]] = OrderedDict()  # first ANCHOR tokens -> the last such prompt

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self._by_len.clear()
        self._lengths.clear()
        self._used.clear()

    def _use(self, key: tuple) -> None:
        self.entries.move_to_end(key)
        self._clock += 1
        self._used[key] = self._clock

    def lookup(self, prompt: list[int], digests: tuple[str, ...]) -> PrefixEntry | None:
        """The longest entry that `prompt` (with the images of `digests`) begins with, or None; of several
        as long, the least recently used. Visits the entry lengths <= len(prompt) from the longest, and at each
        only the entries whose last id is the prompt's there."""
        n = len(prompt)
        pad = self.pad_token_id
        lengths = self._lengths
        for j in range(bisect.bisect_right(lengths, n) - 1, -1, -1):
            m = lengths[j]
            keys = self._by_len[m].get(prompt[m - 1] if m else None)
            if not keys:
                continue
            head = None
            best = None
            for key in keys:
                e = self.entries[key]
                if e.images != digests[: len(e.images)]:
                    continue
                if head is None:
                    head = tuple(prompt[:m])
                if head != e.ids:
                    continue
                if m < n and prompt[m] == pad and prompt[m - 1] == pad:
                    continue  # the cached state would end inside an image's pad run
                if best is None or self._used[key] < self._used[best]:
                    best = key
            if best is not None:
                self._use(best)
                return self.entries[best]
        return None

    def remember(self, ids: list[int], digests: tuple[str, ...], cache, logits: torch.Tensor) -> None:
        """Keep the state `cache` of `ids`. It must never be written again (a hit clones it before
        extending it); the logits are copied (they may be a CUDA graph's output buffer)."""
        if self.size <= 0:
            return
        key = (tuple(ids), tuple(digests))
        if key not in self.entries:
            m = len(key[0])
            if m not in self._by_len:
                bisect.insort(self._lengths, m)
            self._by_len.setdefault(m, {}).setdefault(key[0][-1] if m else None, []).append(key)
        self.entries[key] = PrefixEntry(key[0], key[1], cache, logits.clone())
        self._use(key)
        while len(self.entries) > self.size:
            self._forget(self.entries.popitem(last=False)[0])

    def _forget(self, key: tuple) -> None:
        """Take an evicted entry out of the index."""
        m = len(key[0])
        by_last = self._by_len[m]
        last = key[0][-1] if m else None
        by_last[last].remove(key)
        if not by_last[last]:
            del by_last[last]
        if not by_last:
            del self._by_len[m]
            del self._lengths[bisect.bisect_left(self._lengths, m)]
        del self._used[key]

    def split_point(self, prompt: list[int], has_images: bool, cached: int) -> int:
        """The length of the start `prompt` shares with the last prompt that began as it does, when that
        is at least `share_prefix` tokens beyond what is cached and short of the whole prompt; else 0.
        Records `prompt` as the last prompt of its anchor."""
        if not self.share_prefix or has_images or len(prompt) <= self.ANCHOR:
            return 0
        key = tuple(prompt[: self.ANCHOR])
        other = self._anchors.pop(key, None)
        self._anchors[key] = prompt
        if len(self._anchors) > 4 * max(self.size, 1):
            self._anchors.popitem(last=False)
        if other is None:
            return 0
        shared = next(
            (i for i, (a, b) in enumerate(zip(other, prompt, strict=False)) if a != b), min(len(other), len(prompt))
        )
        return shared if shared - cached >= self.share_prefix and shared < len(prompt) else 0
