"""Token sampling for the embedded engine: temperature, top-k, top-p, per-request seeds.

Everything here is batched tensor work on the logits' device, with no host synchronisation,
so that it can run inside a captured CUDA graph of the decode step.

Two distributions are involved, and they are kept apart on purpose:

* the **policy distribution** pi(. | context) = softmax(logits / tau) at the request's temperature
  tau (1 for a greedy request) with no filtering. The engine returns log pi(sampled token)
  computed in fp32:
      logprob = z[tok] - logsumexp(z),   z = logits_fp32 / tau
  which is exactly what the learner computes at the job's sampling temperature
  (`Trainer(temperature=...)`) and compares against (the behaviour log-probs of truncated
  importance sampling). Top-k / top-p never enter them: what they cut is the gap between q and pi
  that importance sampling corrects.
* the **sampling distribution** q, that tokens are actually drawn from:
      z = logits / T                      (T > 0; T = 0 is greedy: tok = argmax logits)
      keep the k largest z                (top_k > 0)
      keep the smallest set of tokens, by descending q, whose mass reaches top_p
      q = softmax(z) over the kept tokens (fp64, in vocabulary order)
  Tokens tied with the last kept one are kept too (the cut is a threshold on z).
  The draw is inverse-CDF sampling with one uniform per token,
      u = uniform(seed, n)   n = how many tokens the request has sampled so far,
      tok = min { i : sum_{j<=i} q_j > u * sum_j q_j },
  where `uniform` is a counter-based hash (SplitMix64 of seed and n): integer arithmetic,
  identical on every device, so a seeded request gives the same tokens alone, in any
  batch, and on any device, and no generator state has to be carried between steps.
"""

from __future__ import annotations

import random

import torch

from k3rl.types import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _int64(c: int) -> int:
    """A 64-bit constant as the signed int64 torch stores (two's complement)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def request_seed(seed: int | None) -> int:
    """The int64 seed of one request; an unseeded request draws its seed from the OS."""
    s = seed if seed is not None else random.SystemRandom().randrange(2**64)
    return _int64(s % (1 << 64))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) fp64 from SplitMix64(seed + (counter + 1) * golden); seed, counter int64 [B].

    int64 products wrap modulo 2^64 (two's complement), as the hash needs.
    """
    z = seed + (counter + 1) * _int64(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _int64(_MIX1)
    z = (z ^ _shr(z, 27)) * _int64(_MIX2)
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * 2.0**-53


def policy_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """log pi(tok) under softmax(logits / tau), unfiltered, in fp32; tau = the row's temperature (1 where
    it is 0, greedy, or when `temperature` is None).

    logits [B, V], tokens [B], temperature [B] -> [B] fp32.
    """
    lf = logits.float()
    if temperature is not None:
        lf = lf / torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()[:, None]
    return lf.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(lf, dim=-1)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   filtered: bool = True) -> torch.Tensor:
    """The sampling distribution q [B, V] (fp64, vocabulary order).

    temperature [B] (rows with 0 are treated as 1: their token is the argmax anyway),
    top_k [B] (0 = off), top_p [B] in (0, 1]. `filtered=False` skips the sort when no row
    filters (every top_k 0 and top_p 1): the same q, cheaper.
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).double()
    z = logits.double() / t[:, None]
    if filtered:
        B, V = z.shape
        sorted_z = torch.sort(z, dim=-1, descending=True).values
        rank = torch.arange(V, device=z.device)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).long()
        in_top_k = rank < k[:, None]
        # top-p over the top-k survivors: keep token i if the mass strictly before it is < p
        # (so the token that crosses p is kept, and the first token always is)
        sorted_q = torch.softmax(sorted_z.masked_fill(~in_top_k, float("-inf")), dim=-1)
        mass_before = torch.cumsum(sorted_q, dim=-1) - sorted_q
        p = top_p.double()[:, None]
        # top_p = 1 keeps every top-k token (a cumulative sum may round to 1 before the tail)
        kept = (in_top_k & ((mass_before < p) | (p >= 1.0))).sum(-1, keepdim=True).clamp_(min=1)
        threshold = sorted_z.gather(-1, kept - 1)  # the smallest kept z of each row
        z = z.masked_fill(z < threshold, float("-inf"))
    return torch.softmax(z, dim=-1)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seed: torch.Tensor, counter: torch.Tensor, banned: int | None = None,
                  filtered: bool = True) -> torch.Tensor:
    """One token per row of `logits` [B, V] with per-row params as tensors [B]; returns [B] int64.

    temperature 0 is greedy (ties go to the lowest id). `banned`: a token id never drawn (the
    media placeholder, which only the prompt may hold); it is removed from q, not from the
    reported policy log-probs. No host synchronisation (graph-capturable).
    """
    if banned is not None:
        logits = logits.clone()
        logits[:, banned] = float("-inf")
    greedy = logits.argmax(dim=-1)
    q = filtered_probs(logits, temperature, top_k, top_p, filtered)
    cdf = torch.cumsum(q, dim=-1)
    x = uniform(seed, counter) * cdf[:, -1]  # u * total mass (1 up to rounding): never the zero-mass tail
    drawn = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1).clamp_(max=q.shape[-1] - 1)
    return torch.where(temperature > 0, drawn, greedy)


def params_tensors(params: list[SamplingParams], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p) [B] of a list of requests."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.float64, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device))


def needs_filter(params: list[SamplingParams]) -> bool:
    """Whether any sampled row filters (top-k or top-p): only then is the vocabulary sorted."""
    return any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in params)


def validate(params: SamplingParams, vocab_size: int) -> None:
    """Reject sampling params the engine cannot honour, saying what to change."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size}); pass ids of this model")
    if any(s == "" for s in params.stop_strings):
        raise ValueError("stop_strings must not contain the empty string (it would stop before the first token)")
