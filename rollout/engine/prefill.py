"""Steps 3 and 4 of the embedded engine's scheduler step (`engine.py` describes the whole step):
admission of waiting requests (prefix-cache reuse, joining a prefill of the same prompt, waiting for
a shared system prompt) and chunked prefill (equal-length chunks batched, the tail of a prompt fed by
decode steps with `decode_append`). `EmbeddedEngine` inherits these methods; they use its queues,
prefix cache, model and stats."""

from __future__ import annotations

import torch

from k3rl.kernels.varlen import remember_host_copy

from .prefill_graphs import bucket
from .seq import Seq


class AdmitAndPrefill:
    """The admission and chunked-prefill half of `EmbeddedEngine` (a mixin: no state of its own)."""

    # 3. admission
    def _release_prefills(self) -> bool:
        """Whether requests that need a prefill forward may start one this step. With
        `prefill_wait_steps` N > 0 they gather while the decoding batch runs, and all go once the
        oldest has waited N steps, so prompts arriving over several steps share one batched forward
        (an eager forward costs its launches whatever its rows). With nothing decoding they go at once."""
        if not self.prefill_wait_steps or not (self._decoding or self._feeders or self._inflight):
            return True
        return any(s.waited >= self.prefill_wait_steps for s in self._waiting)

    def _admit(self) -> None:
        active = len(self._prefilling) + len(self._decoding) + len(self._feeders) \
            + sum(len(s.followers) for s in self._prefilling)
        for s in self._waiting:
            s.waited += 1
        release = self._release_prefills()
        deferred: list[Seq] = []  # sharing a prefix another prompt is prefilling: admitted once it is cached
        held: list[Seq] = []  # would start a prefill forward: gathering others first (prefill_wait_steps)
        while self._waiting and active < self.max_num_seqs:
            seq = self._waiting.popleft()
            seq.state_version = self._version
            active += 1
            leader = next((p for p in self._prefilling
                           if p.state_version == self._version and p.key == seq.key), None)
            if leader is not None:  # same prompt being prefilled: wait for it and fork its state
                seq.leader = leader
                leader.followers.append(seq)
                continue
            entry = self._prefix.lookup(seq.prompt, seq.digests)
            seq.cache = None
            if entry is not None:
                seq.computed = seq.cached_prompt_tokens = len(entry.ids)
                seq.image_cursor = len(entry.images)
                self.stats["prefix_hit_tokens"] += len(entry.ids)
                rest = len(seq.prompt) - seq.computed
                if rest == 0:  # the pool copies the cache
                    seq.cache, seq.logits = entry.cache, entry.logits.clone()
                    self._pending_ready.append(seq)
                    continue
                if rest <= self._feed_max and seq.image_cursor == len(seq.images):
                    self._feed(seq, entry.cache, seq.prompt[seq.computed:])  # the pool copies the cache
                    continue
            if not release:
                self.stats["prefix_hit_tokens"] -= seq.computed  # counted when it is admitted
                seq.computed, seq.cached_prompt_tokens, seq.image_cursor = 0, 0, 0
                held.append(seq)
                active -= 1
                continue
            if entry is not None:
                seq.cache = entry.cache.clone()
            if self._prefix.share_prefix and not self._graph_chunk(seq) and any(p.split_at > p.computed and p.state_version == self._version
                                                 and p.split_at - seq.computed >= self._prefix.share_prefix
                                                 and seq.prompt[:p.split_at] == p.prompt[:p.split_at] for p in self._prefilling):
                self.stats["prefix_hit_tokens"] -= seq.computed  # counted when it is admitted
                seq.cache, seq.computed, seq.cached_prompt_tokens, seq.image_cursor = None, 0, 0, 0
                deferred.append(seq)
                active -= 1
                continue
            # a prompt that a prefill graph takes is prefilled whole: a captured forward costs its
            # kernels, so sharing a prefix (an eager forward for it, another for the rest) saves nothing
            seq.split_at = 0 if self._graph_chunk(seq) else \
                self._prefix.split_point(seq.prompt, bool(seq.images), seq.computed)
            if seq.cache is None:
                seq.cache = self.model.new_cache(1, self.autocast_dtype)  # under autocast, activations are in its dtype
            self._prefilling.append(seq)
        self._waiting.extendleft(reversed(deferred + held))

    def _offers_prefix(self, seq: Seq) -> bool:
        """Only states computed entirely by the current weights are offered for reuse."""
        return self._prefix.size > 0 and seq.state_version == self._version

    def _remember(self, seq: Seq, ids: list[int], cache, logits: torch.Tensor) -> None:
        # `cache` is never written again (a prefilled cache is only copied into slots; a pool state is
        # extracted as a copy)
        if self._offers_prefix(seq):
            self._prefix.remember(ids, seq.digests[: seq.image_cursor], cache, logits)

    # 4. chunked prefill
    def _chunk_end(self, seq: Seq, start: int, budget: int) -> tuple[int, int]:
        """End of the next prefill chunk and the images it consumes (never splitting an image's pads)."""
        end = min(len(seq.prompt), start + budget)
        pad = self.config.media_placeholder_token_id
        pads_before = sum(1 for t in seq.prompt[:start] if t == pad)
        pads_in = sum(1 for t in seq.prompt[start:end] if t == pad)
        # images whose pads are (partly) inside this chunk must be complete: extend the chunk
        last_image, cum = seq.image_cursor, 0
        for i, c in enumerate(seq.pads_per_image):
            cum += c
            if cum > pads_before and cum - c < pads_before + pads_in:
                last_image = i + 1
        need = sum(seq.pads_per_image[:last_image]) - pads_before
        while pads_in < need:
            if seq.prompt[end] == pad:
                pads_in += 1
            end += 1
        return end, last_image - seq.image_cursor

    def _prefill(self) -> list[Seq]:
        """Run this step's prefill chunks. Chunks of the same length (and without images) run as
        one batched forward on stacked caches; the others run alone. With decode_append, chunks
        within decode_append tokens of each other are cut to the shortest, so they batch, and what
        is left of each prompt is fed by decode steps."""
        ready: list[Seq] = self._pending_ready
        self._pending_ready = []
        budget = self.max_prefill_tokens
        plan: list[tuple[Seq, int, int, int]] = []  # (seq, start, end, images in the chunk)
        limits = {}
        for seq in self._prefilling:
            room = seq.split_at - seq.computed if seq.split_at > seq.computed else self.prefill_chunk
            limits[seq.id] = min(self.prefill_chunk, room, len(seq.prompt) - seq.computed)
        # cut to a graph's bucket; a prompt's last < ALIGN tokens are fed by decode steps
        graphed = {s.id: T for s in self._prefilling if (T := self._graph_chunk(s))}
        limits.update(graphed)
        if self.decode_append:
            plain = sorted((s for s in self._prefilling if s.image_cursor == len(s.images) and s.id not in graphed),
                           key=lambda s: limits[s.id])
            shortest = None
            for seq in plain:  # ascending: a chunk within decode_append of the group's shortest joins it
                if shortest is None or limits[seq.id] - shortest > self.decode_append:
                    shortest = limits[seq.id]
                limits[seq.id] = shortest
        for seq in self._prefilling:
            if budget <= 0:
                break
            end, n_img = self._chunk_end(seq, seq.computed, min(limits[seq.id], budget))
            plan.append((seq, seq.computed, end, n_img))
            budget -= end - seq.computed
        groups: dict[tuple[int, bool], list[tuple[Seq, int, int, int]]] = {}
        for item in plan:
            seq, start, end, n_img = item
            # a graph's rows: all fresh or all after a cached prefix, each of its bucket
            kind = ("cached" if start else "fresh") if graphed.get(seq.id) == end - start else ""
            key = (-1 - len(groups), "") if n_img else (end - start, kind)
            groups.setdefault(key, []).append(item)
        for (_, kind), items in groups.items():
            self.stats["prefill_forwards"] += 1
            for (seq, start, end, n_img), logits in self._prefill_forward(items, kind):
                seq.computed, seq.image_cursor = end, seq.image_cursor + n_img
                self.stats["prefill_tokens"] += end - start
                if end == len(seq.prompt):
                    ready += self._prefill_done(seq, logits)
                    continue
                if end == seq.split_at:  # the shared prefix: cached for the prompts that wait for it
                    self._remember(seq, seq.prompt[:end], seq.cache.clone(), logits)
                if len(seq.prompt) - end <= self._feed_max and seq.image_cursor == len(seq.images):
                    self._feed_rest(seq)
        return ready

    def _graph_chunk(self, seq: Seq) -> int:
        """The tokens of `seq`'s next chunk if prefill_graphs takes it, else 0: no images left to prefill,
        the state so far in `seq.cache` (none or a cached prefix, nothing being shared), and a bucket that
        leaves fewer than ALIGN tokens (fed by decode steps) or fills a whole chunk (another follows)."""
        g = self._prefill_graphs
        if g is None or seq.image_cursor < len(seq.images) or seq.split_at > seq.computed:
            return 0
        if (seq.cache.host_lengths if seq.cache is not None else [0]) != [seq.computed]:
            return 0
        rest = len(seq.prompt) - seq.computed
        T = bucket(rest, self.prefill_chunk)
        whole = T == bucket(self.prefill_chunk, self.prefill_chunk)
        return T if g.takes(T, seq.computed) and (rest - T <= self._feed_max or whole) else 0

    def _feed_rest(self, seq: Seq) -> None:
        """decode_append for a prefilling sequence (and the group waiting on it): the rest of the prompt
        is fed by decode steps, each member from its own copy of the state."""
        self._prefilling.remove(seq)
        rest = seq.prompt[seq.computed :]
        for s in [seq, *seq.followers]:
            s.image_cursor = seq.image_cursor
            s.cached_prompt_tokens = seq.cached_prompt_tokens if s is seq else len(s.prompt) - len(rest)
            self._feed(s, seq.cache, rest)
        seq.followers = []

    def _feed(self, seq: Seq, cache, tail: list[int]) -> None:
        """`seq` joins the decoding batch from `cache` (copied into its slot) and is fed `tail` first."""
        seq.cache, seq.feed, seq.leader, seq.computed = cache, list(tail), None, len(seq.prompt)
        self.stats["fed_prompt_tokens"] += len(tail)
        self._feeders.append(seq)

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        """Token ids on the engine's device, their host copy handed over (the model's media check reads it
        without waiting for the GPU)."""
        host = torch.tensor(rows)
        return remember_host_copy(host.to(self.device), host)

    def _prefill_forward(self, items, kind: str = ""):
        """Forward the chunks in `items` (batched when there are several); yields (item, last logits).
        `kind`: "fresh" or "cached" for the rows of a prefill graph (`_graph_chunk`), else "".

        A chunk whose forward fails fails its own request (and the group waiting on it) only."""
        graphs = self._prefill_graphs
        if kind:
            done = []
            try:
                for i in range(0, len(items), graphs.max_rows):
                    part = items[i : i + graphs.max_rows]
                    logits, caches = graphs.run([seq.prompt[start:end] for seq, start, end, _ in part],
                                                [seq.cache for seq, *_ in part] if kind == "cached" else None)
                    done += list(zip(part, caches, logits, strict=True))
            except Exception:  # noqa: BLE001 - the eager path below finds the request at fault, if any
                done = None
            if done is not None:
                for (seq, *rest), cache, row in done:
                    seq.cache = cache
                    yield (seq, *rest), row
                return
        if len(items) > 1:
            from k3rl.model import K3Cache

            try:
                cache = K3Cache.stack([seq.cache for seq, *_ in items])
                ids = self._ids([seq.prompt[start:end] for seq, start, end, _ in items])
                logits = self.model(ids, cache=cache)[:, -1]
            except Exception:  # noqa: BLE001 - retry one by one to find the request at fault
                logits = None
            if logits is not None:
                for (seq, *_), c, row in zip(items, cache.split(), logits, strict=True):
                    seq.cache = c
                    yield (seq, *_), row
                return
        for seq, start, end, n_img in items:
            images = seq.images[seq.image_cursor : seq.image_cursor + n_img] if n_img else None
            ids = self._ids([seq.prompt[start:end]])
            try:
                logits = self.model(ids, images=images, cache=seq.cache)
            except Exception as e:  # noqa: BLE001 - a bad prompt fails its own group, nobody else
                self._prefilling.remove(seq)
                for s in [seq, *seq.followers]:
                    with self._cv:
                        self._live.pop(s.id, None)
                    s.future.set_exception(e)
                continue
            yield (seq, start, end, n_img), logits[0, -1]

    def _prefill_done(self, seq: Seq, logits: torch.Tensor) -> list[Seq]:
        """The prompt is in the cache: the sequence and the group waiting on it are ready to sample."""
        seq.logits = logits
        self._prefilling.remove(seq)
        self._remember(seq, seq.prompt, seq.cache, seq.logits)
        ready = [seq]
        for f in seq.followers:  # the group fork: one prefill, n states (each copied into its own slot)
            f.cache, f.logits = seq.cache, seq.logits
            f.computed = f.cached_prompt_tokens = len(f.prompt)
            f.image_cursor, f.leader = seq.image_cursor, None
            ready.append(f)
        seq.followers = []
        return ready
