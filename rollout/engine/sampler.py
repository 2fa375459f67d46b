"""Steps 5 and 6 of the embedded engine's scheduler step (`engine.py` describes the whole step):
the decode step over the state pool, launched ahead of the host's work when overlapping, sampling
of the sequences whose prefill finished, stop checks and the results. `EmbeddedEngine` inherits
these methods; they use its pool, decode runner, queues and stats."""

from __future__ import annotations

import torch

from .contract import FinishReason, GenerationResult
from .sampling import needs_filter, params_tensors, policy_logprobs, sample_tokens
from .seq import Launch, Seq


class DecodeAndSample:
    """The decode-and-sample half of `EmbeddedEngine` (a mixin: no state of its own)."""

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

        decode_append: sequences admitted with a short prompt tail (`_feeders`) take a slot now and get
        a dummy row; the next steps feed their tail (`_launch`), the row of the tail's last token samples
        their first token."""
        launched, self._inflight = self._inflight, None
        feeders, self._feeders = self._feeders, []
        if launched is None and self._decoding:
            launched = self._launch(self._decoding, [len(s.out_ids) for s in self._decoding])
        n = len(launched.seqs) if launched else 0
        want_routing = any(s.params.return_routed_experts for s in (launched.seqs if launched else ()))
        parts = []
        if launched:
            parts.append(launched.out[:n] if want_routing else launched.out[:n, :2])
        ahead = self.overlap and launched is not None and self._decoding == launched.seqs \
            and not any(s.flushing for s in self._decoding)
        if ready:  # after the decode step on the stream: a graph's padding rows may cover these slots
            for s in ready:
                s.slot = len(self._decoding)
                self._pool.load(s.slot, s.cache)
                s.cache = None
                self._decoding.append(s)
            parts.append(self._sample_ready(ready, parts[0].shape[1] if parts else 2))
        if feeders:
            for s in feeders:
                s.slot = len(self._decoding)
                self._pool.load(s.slot, s.cache)
                s.cache = None
                self._decoding.append(s)
            parts.append(torch.zeros(len(feeders), parts[0].shape[1] if parts else 2, dtype=torch.float64,
                                     device=self.device))
        rows_dev = torch.cat(parts)
        if ahead or (self.overlap and launched is None and (ready or feeders)):
            rows_host = rows_dev.to("cpu", non_blocking=True)  # before the next step overwrites the buffers
            done = torch.cuda.Event() if rows_dev.is_cuda else None
            if done is not None:
                done.record()
            # the n-th sampled token is drawn with uniform(seed, n): count the token this step samples
            sampling = {id(s) for s, f in zip(launched.seqs, launched.fed, strict=True) if f < 2} if launched else set()
            sampling |= {id(s) for s in ready}
            self._inflight = self._launch(self._decoding, [len(s.out_ids) + (id(s) in sampling)
                                                           for s in self._decoding], rows_dev[:, 0].long())
            self.stats["launched_ahead"] += 1
            if done is not None:
                done.synchronize()
            rows = rows_host.tolist()
        else:
            rows = rows_dev.tolist()  # the step's only wait for the device
        fed: list[Seq] = []  # flushing sequences whose last token this step fed
        stopped: list[Seq] = []
        k = self.config.num_experts_per_token
        for i, (s, row) in enumerate(zip([*(launched.seqs if launched else ()), *ready, *feeders], rows,
                                         strict=True)):
            if s.future.done():  # finished while its step ran (an abort that needed no flush)
                continue
            if i >= n + len(ready) or (i < n and launched.fed[i] == 2):  # no sample: a prompt token goes in
                continue
            if i < n and s.params.return_routed_experts and not launched.fed[i]:  # a prompt token's are not kept
                experts = [int(e) for e in row[2:]]
                s.out_routed.append([experts[m : m + k] for m in range(0, len(experts), k)])
            if s.flushing:  # its last token is now fed: offer the state covering the whole sequence
                if self._offers_prefix(s):
                    self._remember(s, s.prompt + s.out_ids, self._pool.extract(s.slot), launched.logits[i])
                fed.append(s)
                continue
            s.logits = None
            s.out_ids.append(int(row[0]))
            s.out_logprobs.append(row[1])
            s.out_versions.append(launched.version if i < n else self._version)
            if self._check_stop(s):
                stopped.append(s)
        self._release(fed)
        self._finish_decoding(stopped)

    def _launch(self, seqs: list[Seq], counters: list[int], tokens: torch.Tensor | None = None) -> Launch:
        """Decode the pool's leading len(seqs) slots; `tokens` on the device, or each sequence's last token.
        A sequence with a prompt tail to feed (decode_append) is fed its next tail token instead."""
        feeding = [i for i, s in enumerate(seqs) if s.feed]
        if tokens is None:
            tokens = [s.feed[0] if s.feed else s.out_ids[-1] for s in seqs]
        elif feeding:
            tokens = tokens.clone()
            tokens[torch.tensor(feeding, device=tokens.device)] = torch.tensor([seqs[i].feed[0] for i in feeding],
                                                                                device=tokens.device)
        fed = [(1 if len(s.feed) == 1 else 2) if s.feed else 0 for s in seqs]
        for i in feeding:
            seqs[i].feed.pop(0)
        out, logits = self._runner.step(
            len(seqs), tokens, [s.seed for s in seqs], counters,
            [(s.params.temperature, s.params.top_k, s.params.top_p) for s in seqs],
            needs_filter([s.params for s in seqs if not s.flushing]))
        self.stats["decode_tokens"] += len(seqs)
        return Launch(list(seqs), out, logits, self._version, fed)

    def _sample_ready(self, ready: list[Seq], width: int) -> torch.Tensor:
        """Sample the first token of sequences whose prompt is in the cache; rows of `width` fp64."""
        logits = torch.stack([s.logits for s in ready])
        temperature, top_k, top_p = params_tensors([s.params for s in ready], self.device)
        seeds = torch.tensor([s.seed for s in ready], device=self.device)
        counters = torch.tensor([len(s.out_ids) for s in ready], device=self.device)
        # the media placeholder is input-only: it is never sampled (an image cannot follow it)
        tokens = sample_tokens(logits, temperature, top_k, top_p, seeds, counters,
                               banned=self.config.media_placeholder_token_id,
                               filtered=needs_filter([s.params for s in ready]))
        rows = torch.zeros(len(ready), width, dtype=torch.float64, device=self.device)
        rows[:, 0] = tokens.double()
        rows[:, 1] = policy_logprobs(logits, tokens, temperature).double()
        return rows

    def _finish_decoding(self, seqs: list[Seq]) -> None:
        """Sequences of the pool that are done (finish set): fed once more when the result or the prefix
        cache needs it (`flushing`, finished by the next decode step), finished now otherwise."""
        for s in seqs:
            # one aborted before its first token (fed or not) has nothing to flush
            s.flushing = (self._prefix.size > 0 or s.params.return_routed_experts) and bool(s.out_ids)
        self._release([s for s in seqs if not s.flushing])

    def _release(self, done: list[Seq]) -> None:
        """Finish `done` (all in the pool) and keep the occupied slots leading: the last ones fill the holes."""
        if not done:
            return
        for s in done:
            self._finish(s, s.finish)
            self._pool.free(s.slot)
        gone = {s.slot for s in done}
        keep = len(self._decoding) - len(gone)
        holes = sorted(slot for slot in gone if slot < keep)
        movers = [s for s in self._decoding[keep:] if s.slot not in gone]
        for hole, s in zip(holes, movers, strict=True):
            self._pool.move(s.slot, hole)
            s.slot = hole
        self._decoding = sorted((s for s in self._decoding if s not in done), key=lambda s: s.slot)

    def _check_stop(self, s: Seq) -> bool:
        p, tok = s.params, s.out_ids[-1]
        if tok in p.stop_token_ids:
            s.finish, s.stop_reason = "stop", tok
        elif p.stop_strings and (hit := self._stop_string(s)) is not None:
            s.finish, s.stop_reason = "stop", hit
        elif len(s.out_ids) >= p.max_tokens or len(s.prompt) + len(s.out_ids) >= self.max_model_len:
            s.finish = "length"
        return s.finish is not None

    def _stop_string(self, s: Seq) -> str | None:
        """The stop string completed by the newest token, if any (a string may span several tokens)."""
        longest = max(len(x.encode()) for x in s.params.stop_strings)
        window = s.out_ids[-(longest + 2):]  # every token decodes to >= 1 byte (byte tokenizer) or more
        text, before = self.tokenizer.decode(window), self.tokenizer.decode(window[:-1])
        for x in s.params.stop_strings:
            if x in text and x not in before:  # the occurrence must involve the newest token
                return x
        return None

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
        with self._cv:
            self._live.pop(s.id, None)
        if not s.future.done():
            s.future.set_result(result)
