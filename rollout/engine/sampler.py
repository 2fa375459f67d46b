"""The sampler: a sequence's first token, drawn from the logits its prefill ended with (every later token
is drawn inside the decode step, `decode.py`, by the same `sampling.py` functions), and the stop rules
every new token is checked against."""

from __future__ import annotations

import torch

from .sampling import needs_filter, params_tensors, policy_logprobs, sample_tokens
from .seq import Seq


class Sampler:
    """tokenizer      decodes the last tokens for stop strings
    banned         a token id never drawn (the media placeholder: an image cannot follow it)
    device         where the logits lie
    max_model_len  prompt plus completion tokens a sequence may hold"""

    def __init__(self, tokenizer, banned: int | None, device: torch.device, max_model_len: int):
        self.tokenizer, self.banned, self.device, self.max_model_len = tokenizer, banned, device, max_model_len

    def first_tokens(self, seqs: list[Seq], width: int) -> torch.Tensor:
        """Sample the first token of sequences whose prompt is in the cache (`seq.logits`): rows of `width`
        fp64 in the decode step's layout, [token, log-prob, 0...], on the device."""
        logits = torch.stack([s.logits for s in seqs])
        # two host-to-device copies that do not wait for the device (a blocking copy waits for the decode step
        # in flight); pageable sources are staged by the copy itself
        temperature, top_k, top_p = torch.stack(params_tensors([s.params for s in seqs])).to(
            self.device, non_blocking=True).unbind(0)
        seeds, counters = torch.tensor([[s.seed for s in seqs], [len(s.out_ids) for s in seqs]],
                                       dtype=torch.int64).to(self.device, non_blocking=True).unbind(0)
        tokens = sample_tokens(logits, temperature, top_k, top_p, seeds, counters, banned=self.banned,
                               filtered=needs_filter([s.params for s in seqs]))
        rows = torch.zeros(len(seqs), width, dtype=torch.float64, device=self.device)
        rows[:, 0] = tokens.double()
        rows[:, 1] = policy_logprobs(logits, tokens, temperature).double()
        return rows

    def check_stop(self, s: Seq) -> bool:
        """Whether `s`'s newest token ends it; if so `s.finish` (and `s.stop_reason`) say why."""
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
