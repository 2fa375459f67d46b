"""The embedded engine's scheduler: it owns the sequences, from admission to their results, and calls
the parts that compute (the prefill runner, the decode runner, the sampler) and keep state (the state
pool, the prefix cache).

One engine step, always in this order (1 and 2 taken by `EmbeddedEngine.step` from its inbox, 3-6
`Scheduler.step`):
  1. apply a pending weight update (only here, between steps: the switch is atomic),
  2. finish aborted requests (their tokens so far, finish_reason "abort"),
  3. admit waiting requests: reuse the longest cached prefix, or join a prefill of the same
     prompt already in progress (a GRPO group prefills once and forks the state), or start
     a prefill,
  4. prefill: the prefill runner's chunks of the prefilling sequences (`prefill.py`),
  5. decode: one forward of the last sampled token of every decoding sequence over the
     preallocated state pool (`state_pool.py`: one slot per sequence, the decoding ones in the
     leading slots), sampling and log-probs on the device, all in one CUDA graph on CUDA
     (`decode.py`); sequences that finished prefill take a free slot,
  6. sample one token for every sequence whose prefill finished in 4 (`sampler.py`), bring the
     step's tokens to the host at once (one `.tolist()`), check stop tokens / stop strings / max
     tokens; a finished sequence keeps its slot for one more decode step (its last token is fed
     once, see below), then it is finished and its slot is refilled from the last occupied one.

On CUDA an eager forward costs its kernel launches whatever its tokens, and a decode step is one
graph: so there (by default) a prompt that extends a cached prefix by a short tail joins the decoding
batch at once and is fed its tail one token per step (`decode_append`), prefill chunks within that
many tokens of each other are cut to the shortest so they batch (the rest of each is fed), and a
prompt that shares a long start with an earlier one (a system prompt) is prefilled up to the shared
part, cached, and the prompts that share it wait for it (`share_prefix`). Results are the prefill
path's, to float rounding.

Overlap (on CUDA by default): step 5 of the next iteration is launched before step 6 reads this
one's tokens, which it takes on the device, so the host's work of 1-4 and 6 runs while the GPU
decodes; results are the same as without it (`_decode_and_sample` says why). A step in flight when
a weight update arrives finishes with the weights it started with, and its tokens say so.

Because logits are computed and sampled within the same step, every token is produced by exactly one
weight version, reported per token in `GenerationResult.versions`. The states of tokens processed
before an update are kept (as in partial rollouts); the prefix cache is emptied at every update, so a
new request never starts from a state of an older version.

Routed experts (on request): `routed_experts[i][m]` are the k experts that MoE layer m chose for
completion token i *as an input*, i.e. at token i's position in a training forward of prompt +
completion. The last token is fed through the model once more, in the decode step after the one that
sampled it, before the result is returned (this also leaves a state covering the whole sequence,
offered to the prefix cache for the next turn).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from .contract import FinishReason, GenerationResult
from .decode import DecodeRunner
from .prefill import PrefillRunner
from .prefix_cache import PrefixCache
from .sampler import Sampler
from .sampling import needs_filter
from .seq import Launch, Seq
from .state_pool import StatePool
from .weights import VersionedWeights


class Scheduler:
    """The sequences of the engine and the steps that advance them. Single-threaded: only the engine's
    step calls it (requests reach it through `add`, between steps).

    prefill_wait_steps  while a decoding batch runs, a request that needs a prefill forward waits until the
                        oldest such request has waited this many steps, then they all prefill together
    overlap             launch the next decode step before this one's tokens reach the host
    name                the engine's name, each result's `worker`
    forget              called with a request's id just before its result is set (the engine's registry of
                        requests in flight)"""

    def __init__(self, *, weights: VersionedWeights, pool: StatePool, prefix: PrefixCache, prefill: PrefillRunner,
                 decoder: DecodeRunner, sampler: Sampler, prefill_wait_steps: int, overlap: bool, name: str,
                 forget: Callable[[str], None]):
        self.weights, self.pool, self.prefix = weights, pool, prefix
        self.prefill, self.decoder, self.sampler = prefill, decoder, sampler
        self.max_num_seqs = pool.num_slots
        self.prefill_wait_steps, self.overlap, self.name, self.forget = prefill_wait_steps, overlap, name, forget
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []  # each leads its group: the sequences of the same prompt (followers)
        self.ready: list[Seq] = []  # admitted with the whole prompt cached: sample this step
        self.feeders: list[Seq] = []  # admitted to decode_append: join the pool this step
        self.decoding: list[Seq] = []  # in the state pool, seq i in slot i; each has a token to feed
        self.inflight: Launch | None = None  # a decode step launched ahead, its rows not yet read
        # host seconds per phase of `step` (a CUDA phase's time is its launches plus what it waits for)
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "prefix_hit_tokens": 0,
                      "launched_ahead": 0, "fed_prompt_tokens": 0, "prefill_forwards": 0, "prefill_s": 0.0,
                      "decode_s": 0.0, "admit_s": 0.0, "prefix_hit_images": 0}

    @property
    def version(self) -> int:
        return self.weights.version

    def add(self, seqs: Iterable[Seq]) -> None:
        """New requests: they wait for admission."""
        self.waiting.extend(seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self.feeders)

    def weights_changed(self) -> None:
        """After a weight update: the prefix cache is emptied (states of the old version must not seed new
        requests)."""
        self.prefix.clear()

    def step(self) -> None:
        """Steps 3-6 (the module docstring): admit, prefill, decode and sample."""
        t0 = time.perf_counter()
        self._admit()
        t1 = time.perf_counter()
        ready = self._prefill()
        t2 = time.perf_counter()
        if ready or self.decoding or self.inflight or self.feeders:
            self._decode_and_sample(ready)
        st = self.stats
        st["steps"] += 1
        st["admit_s"] += t1 - t0
        st["prefill_s"] += t2 - t1
        st["decode_s"] += time.perf_counter() - t2

    def fail_all(self, error: BaseException) -> None:
        """A step failed: every request fails with `error`, the pool's slots are freed."""
        followers = [f for p in self.prefilling for f in p.followers]
        for seq in [*self.waiting, *self.prefilling, *followers, *self.decoding, *self.ready, *self.feeders]:
            if not seq.future.done():
                seq.future.set_exception(error)
        self.waiting.clear()
        self.prefilling.clear()
        self.ready.clear()
        self.feeders.clear()
        self.inflight = None
        for s in self.decoding:
            self.pool.free(s.slot)
        self.decoding.clear()

    # 2. aborts
    def abort(self, ids: set[str]) -> None:
        for queue in (self.waiting, self.feeders):
            for s in [s for s in queue if s.id in ids]:
                queue.remove(s)
                self._finish(s, "abort")
        for leader in list(self.prefilling):
            for f in [f for f in leader.followers if f.id in ids]:
                leader.followers.remove(f)
                self._finish(f, "abort")
            if leader.id in ids:
                if leader.followers:  # the first follower takes over the prefill of the group
                    heir, rest = leader.followers[0], leader.followers[1:]
                    heir.leader, heir.followers, heir.cache, heir.computed = None, rest, leader.cache, leader.computed
                    heir.image_cursor, heir.cached_prompt_tokens = leader.image_cursor, leader.cached_prompt_tokens
                    heir.state_version = leader.state_version
                    for f in rest:
                        f.leader = heir
                    self.prefilling[self.prefilling.index(leader)] = heir
                else:
                    self.prefilling.remove(leader)
                leader.followers = []
                self._finish(leader, "abort")
        aborted = [s for s in self.decoding if s.id in ids and not s.flushing]
        for s in aborted:
            s.finish = "abort"
        self._finish_decoding(aborted)  # their last sampled token is fed once, as for any finished sequence

    # 3. admission
    def _release_prefills(self) -> bool:
        """Whether requests that need a prefill forward may start one this step. With
        `prefill_wait_steps` N > 0 they gather while the decoding batch runs, and all go once the
        oldest has waited N steps, so prompts arriving over several steps share one batched forward
        (an eager forward costs its launches whatever its rows). With nothing decoding they go at once."""
        if not self.prefill_wait_steps or not (self.decoding or self.feeders or self.inflight):
            return True
        return any(s.waited >= self.prefill_wait_steps for s in self.waiting)

    def _admit(self) -> None:
        active = len(self.prefilling) + len(self.decoding) + len(self.feeders) \
            + sum(len(s.followers) for s in self.prefilling)
        for s in self.waiting:
            s.waited += 1
        release = self._release_prefills()
        deferred: list[Seq] = []  # sharing a prefix another prompt is prefilling: admitted once it is cached
        held: list[Seq] = []  # would start a prefill forward: gathering others first (prefill_wait_steps)
        version, prefix, prefill = self.version, self.prefix, self.prefill
        while self.waiting and active < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.state_version = version
            active += 1
            leader = next((p for p in self.prefilling if p.state_version == version and p.key == seq.key), None)
            if leader is not None:  # same prompt being prefilled: wait for it and fork its state
                seq.leader = leader
                leader.followers.append(seq)
                continue
            entry = prefix.lookup(seq.prompt, seq.digests)
            seq.cache = None
            if entry is not None:
                seq.computed = seq.cached_prompt_tokens = len(entry.ids)
                seq.image_cursor = len(entry.images)
                self.stats["prefix_hit_tokens"] += len(entry.ids)
                self.stats["prefix_hit_images"] += len(entry.images)
                rest = len(seq.prompt) - seq.computed
                if rest == 0:  # the pool copies the cache
                    seq.cache, seq.logits = entry.cache, entry.logits.clone()
                    self.ready.append(seq)
                    continue
                if rest <= prefill.feed_max and seq.image_cursor == len(seq.images):
                    self._feed(seq, entry.cache, seq.prompt[seq.computed:])  # the pool copies the cache
                    continue
            if not release:
                self.stats["prefix_hit_tokens"] -= seq.computed  # counted when it is admitted
                self.stats["prefix_hit_images"] -= seq.image_cursor
                seq.computed, seq.cached_prompt_tokens, seq.image_cursor = 0, 0, 0
                held.append(seq)
                active -= 1
                continue
            if entry is not None:
                seq.cache = entry.cache.clone()
            if prefix.share_prefix and not prefill.graph_tokens(seq) and any(
                    p.split_at > p.computed and p.state_version == version
                    and p.split_at - seq.computed >= prefix.share_prefix
                    and seq.prompt[:p.split_at] == p.prompt[:p.split_at] for p in self.prefilling):
                self.stats["prefix_hit_tokens"] -= seq.computed  # counted when it is admitted
                self.stats["prefix_hit_images"] -= seq.image_cursor
                seq.cache, seq.computed, seq.cached_prompt_tokens, seq.image_cursor = None, 0, 0, 0
                deferred.append(seq)
                active -= 1
                continue
            # a prompt that a prefill graph takes is prefilled whole: a captured forward costs its
            # kernels, so sharing a prefix (an eager forward for it, another for the rest) saves nothing
            seq.split_at = 0 if prefill.graph_tokens(seq) else \
                prefix.split_point(seq.prompt, bool(seq.images), seq.computed)
            if seq.cache is None:
                seq.cache = prefill.new_cache()
            self.prefilling.append(seq)
        self.waiting.extendleft(reversed(deferred + held))

    def _offers_prefix(self, seq: Seq) -> bool:
        """Only states computed entirely by the current weights are offered for reuse."""
        return self.prefix.size > 0 and seq.state_version == self.version

    def _remember(self, seq: Seq, ids: list[int], cache, logits: torch.Tensor) -> None:
        # `cache` is never written again (a prefilled cache is only copied into slots; a pool state is
        # extracted as a copy)
        if self._offers_prefix(seq):
            self.prefix.remember(ids, seq.digests[: seq.image_cursor], cache, logits)

    # 4. chunked prefill
    def _prefill(self) -> list[Seq]:
        """Run this step's prefill chunks; the sequences (and groups) whose prompt is now in their cache,
        with those admitted fully cached, are ready to sample."""
        ready, self.ready = self.ready, []
        for kind, chunks in self.prefill.plan(self.prefilling):
            self.stats["prefill_forwards"] += 1
            for (seq, start, end, n_img), logits in self.prefill.run(chunks, kind):
                if isinstance(logits, Exception):
                    self._fail_group(seq, logits)
                    continue
                seq.computed, seq.image_cursor = end, seq.image_cursor + n_img
                self.prefill.images_encoded += n_img
                self.stats["prefill_tokens"] += end - start
                if end == len(seq.prompt):
                    ready += self._prefill_done(seq, logits)
                    continue
                if end == seq.split_at:  # the shared prefix: cached for the prompts that wait for it
                    self._remember(seq, seq.prompt[:end], seq.cache.clone(), logits)
                if len(seq.prompt) - end <= self.prefill.feed_max and seq.image_cursor == len(seq.images):
                    self._feed_rest(seq)
        return ready

    def _fail_group(self, seq: Seq, error: Exception) -> None:
        """A prefill forward of `seq`'s own failed: it fails, with the group waiting on it, nobody else."""
        self.prefilling.remove(seq)
        for s in [seq, *seq.followers]:
            self.forget(s.id)
            s.future.set_exception(error)

    def _feed_rest(self, seq: Seq) -> None:
        """decode_append for a prefilling sequence (and the group waiting on it): the rest of the prompt
        is fed by decode steps, each member from its own copy of the state."""
        self.prefilling.remove(seq)
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
        self.feeders.append(seq)

    def _prefill_done(self, seq: Seq, logits: torch.Tensor) -> list[Seq]:
        """The prompt is in the cache: the sequence and the group waiting on it are ready to sample."""
        seq.logits = logits
        self.prefilling.remove(seq)
        self._remember(seq, seq.prompt, seq.cache, seq.logits)
        ready = [seq]
        for f in seq.followers:  # the group fork: one prefill, n states (each copied into its own slot)
            f.cache, f.logits = seq.cache, seq.logits
            f.computed = f.cached_prompt_tokens = len(f.prompt)
            f.image_cursor, f.leader = seq.image_cursor, None
            ready.append(f)
        seq.followers = []
        return ready

    # 5-6. decode and sampling
    def _decode_and_sample(self, ready: list[Seq]) -> None:
        """Decode the pool's sequences and sample the ready ones; one transfer of the step's results.

        Overlap: the decode step of the next iteration is launched before this one's rows are read,
        with this step's sampled tokens fed on the device (`_launch(..., tokens)`): the GPU decodes while
        the host checks stops and schedules. A sequence that stops in this step is then fed its last token
        by the step launched ahead, which is exactly its flush step (below), or, if it needs no flush,
        an extra step whose row is ignored (its slot is freed). No step is launched ahead while any
        sequence is flushing or the pool's order differs from the step in flight, so every token,
        log-prob, routed expert and cached state is the one the engine without overlap gives.

        decode_append: sequences admitted with a short prompt tail (`feeders`) take a slot now and get
        a dummy row; the next steps feed their tail (`_launch`), the row of the tail's last token samples
        their first token."""
        launched, self.inflight = self.inflight, None
        feeders, self.feeders = self.feeders, []
        if launched is None and self.decoding:
            launched = self._launch(self.decoding, [len(s.out_ids) for s in self.decoding])
        n = len(launched.seqs) if launched else 0
        want_routing = any(s.params.return_routed_experts for s in (launched.seqs if launched else ()))
        parts = []
        if launched:
            parts.append(launched.out[:n] if want_routing else launched.out[:n, :2])
        ahead = self.overlap and launched is not None and self.decoding == launched.seqs \
            and not any(s.flushing for s in self.decoding)
        if ready:  # after the decode step on the stream: a graph's padding rows may cover these slots
            self._join_pool(ready)
            parts.append(self.sampler.first_tokens(ready, parts[0].shape[1] if parts else 2))
        if feeders:
            self._join_pool(feeders)
            parts.append(torch.zeros(len(feeders), parts[0].shape[1] if parts else 2, dtype=torch.float64,
                                     device=self.pool.device))
        rows_dev = torch.cat(parts)
        if ahead or (self.overlap and launched is None and (ready or feeders)):
            rows_host = rows_dev.to("cpu", non_blocking=True)  # before the next step overwrites the buffers
            done = torch.cuda.Event() if rows_dev.is_cuda else None
            if done is not None:
                done.record()
            # the n-th sampled token is drawn with uniform(seed, n): count the token this step samples
            sampling = {id(s) for s, f in zip(launched.seqs, launched.fed, strict=True) if f < 2} if launched else set()
            sampling |= {id(s) for s in ready}
            self.inflight = self._launch(self.decoding, [len(s.out_ids) + (id(s) in sampling)
                                                         for s in self.decoding], rows_dev[:, 0].long())
            self.stats["launched_ahead"] += 1
            if done is not None:
                done.synchronize()
            rows = rows_host.tolist()
        else:
            rows = rows_dev.tolist()  # the step's only wait for the device
        fed: list[Seq] = []  # flushing sequences whose last token this step fed
        stopped: list[Seq] = []
        for i, (s, row) in enumerate(zip([*(launched.seqs if launched else ()), *ready, *feeders], rows,
                                         strict=True)):
            if s.future.done():  # finished while its step ran (an abort that needed no flush)
                continue
            if i >= n + len(ready) or (i < n and launched.fed[i] == 2):  # no sample: a prompt token goes in
                continue
            if i < n and s.params.return_routed_experts and not launched.fed[i]:  # a prompt token's are not kept
                s.out_routed.append(self.decoder.routed_experts(row))
            if s.flushing:  # its last token is now fed: offer the state covering the whole sequence
                if self._offers_prefix(s):
                    self._remember(s, s.prompt + s.out_ids, self.pool.extract(s.slot), launched.logits[i])
                fed.append(s)
                continue
            s.logits = None
            s.out_ids.append(int(row[0]))
            s.out_logprobs.append(row[1])
            s.out_versions.append(launched.version if i < n else self.version)
            if self.sampler.check_stop(s):
                stopped.append(s)
        self._release(fed)
        self._finish_decoding(stopped)

    def _join_pool(self, seqs: list[Seq]) -> None:
        """`seqs` take the next free slots, their prefilled states copied in."""
        for s in seqs:
            s.slot = len(self.decoding)
            self.pool.load(s.slot, s.cache)
            s.cache = None
            self.decoding.append(s)

    def _launch(self, seqs: list[Seq], counters: list[int], tokens: torch.Tensor | None = None) -> Launch:
        """Decode the pool's leading len(seqs) slots; `tokens` on the device, or each sequence's last token.
        A sequence with a prompt tail to feed (decode_append) is fed its next tail token instead."""
        feed = {i: s.feed[0] for i, s in enumerate(seqs) if s.feed}  # rows fed a prompt token: on the host
        if tokens is None:
            tokens = [s.feed[0] if s.feed else s.out_ids[-1] for s in seqs]
        fed = [(1 if len(s.feed) == 1 else 2) if s.feed else 0 for s in seqs]
        for i in feed:
            seqs[i].feed.pop(0)
        out, logits = self.decoder.step(
            len(seqs), tokens, [s.seed for s in seqs], counters,
            [(s.params.temperature, s.params.top_k, s.params.top_p) for s in seqs],
            needs_filter([s.params for s in seqs if not s.flushing]), feed)
        self.stats["decode_tokens"] += len(seqs)
        return Launch(list(seqs), out, logits, self.version, fed)

    def _finish_decoding(self, seqs: list[Seq]) -> None:
        """Sequences of the pool that are done (finish set): fed once more when the result or the prefix
        cache needs it (`flushing`, finished by the next decode step), finished now otherwise."""
        for s in seqs:
            # one aborted before its first token (fed or not) has nothing to flush
            s.flushing = (self.prefix.size > 0 or s.params.return_routed_experts) and bool(s.out_ids)
        self._release([s for s in seqs if not s.flushing])

    def _release(self, done: list[Seq]) -> None:
        """Finish `done` (all in the pool) and keep the occupied slots leading: the last ones fill the holes."""
        if not done:
            return
        for s in done:
            self._finish(s, s.finish)
            self.pool.free(s.slot)
        gone = {s.slot for s in done}
        keep = len(self.decoding) - len(gone)
        holes = sorted(slot for slot in gone if slot < keep)
        movers = [s for s in self.decoding[keep:] if s.slot not in gone]
        for hole, s in zip(holes, movers, strict=True):
            self.pool.move(s.slot, hole)
            s.slot = hole
        self.decoding = sorted((s for s in self.decoding if s not in done), key=lambda s: s.slot)

    def _finish(self, s: Seq, reason: FinishReason) -> None:
        s.finish = reason
        result = GenerationResult(
            request_id=s.id,
            token_ids=list(s.out_ids),
            logprobs=list(s.out_logprobs),
            versions=list(s.out_versions),
            finish_reason=reason,
            prompt_tokens=len(s.prompt),
            routed_experts=(list(s.out_routed[: len(s.out_ids)]) if s.params.return_routed_experts else None),
            stop_reason=s.stop_reason,
            cached_prompt_tokens=s.cached_prompt_tokens,
            worker=self.name,
        )
        s.cache = None
        self.forget(s.id)
        if not s.future.done():
            s.future.set_result(result)
