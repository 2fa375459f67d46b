"""Token sampling for the embedded engine: temperature, top-k, top-p, per-request seeds.

Two distributions are involved, and they are kept apart on purpose:

* the **policy distribution** pi(. | context) = softmax(logits) at temperature 1 with no
  filtering. The engine returns log pi(sampled token) computed in fp32:
      logprob = logits_fp32[tok] - logsumexp(logits_fp32)
  which is exactly what the learner computes as `log_softmax(logits.float())` and compares
  against (the behaviour log-probs of truncated importance sampling). These are what the
  engine reports, whatever temperature / top-k / top-p the request used.
* the **sampling distribution** q, that tokens are actually drawn from:
      z = logits / T                      (T > 0; T = 0 is greedy: tok = argmax logits)
      keep the k largest z                (top_k > 0)
      keep the smallest set of tokens, by descending q, whose mass reaches top_p
      q = softmax(z) over the kept tokens
  The draw is inverse-CDF sampling: u ~ U[0, 1) from the request's own `torch.Generator`
  (on the CPU), tok = min { i : sum_{j<=i} q_j > u }. One uniform per token, drawn from a
  generator owned by the request, makes a seeded request give the same tokens alone, in
  any batch, and on any device.
"""

from __future__ import annotations

import random

import torch

from k3rl.types import SamplingParams


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request; an unseeded request draws its seed from the OS."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**63))
    return g


def policy_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log pi(tok) under softmax(logits) at temperature 1, unfiltered, in fp32.

    logits [B, V], tokens [B] -> [B] fp32.
    """
    lf = logits.float()
    return lf.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(lf, dim=-1)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """The sampling distribution q [B, V] (fp64) for rows with temperature > 0.

    temperature [B] (> 0), top_k [B] (0 = off), top_p [B] in (0, 1].
    """
    z = logits.double() / temperature.double()[:, None]
    B, V = z.shape
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    rank = torch.arange(V, device=z.device)[None, :].expand(B, V)
    # top-k: keep ranks < k (k = 0 keeps everything)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).to(z.device)
    keep = rank < k[:, None]
    sorted_z = sorted_z.masked_fill(~keep, float("-inf"))
    # top-p over the top-k survivors: keep token i if the mass strictly before it is < p
    # (so the token that crosses p is kept, and the first token always is)
    sorted_q = torch.softmax(sorted_z, dim=-1)
    mass_before = torch.cumsum(sorted_q, dim=-1) - sorted_q
    keep &= mass_before < top_p.double().to(z.device)[:, None]
    sorted_z = sorted_z.masked_fill(~keep, float("-inf"))
    q_sorted = torch.softmax(sorted_z, dim=-1)
    return torch.zeros_like(q_sorted).scatter_(-1, order, q_sorted)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           banned: int | None = None) -> torch.Tensor:
    """One token per row of `logits` [B, V], each row with its own params and generator. Returns [B] int64.

    `banned`: a token id never drawn (the media placeholder, which only the prompt may hold);
    it is removed from the sampling distribution q, not from the reported policy log-probs.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} needs one SamplingParams and one generator per row, "
            f"got {len(params)} params and {len(generators)} generators"
        )
    device = logits.device
    if banned is not None:
        logits = logits.clone()
        logits[:, banned] = float("-inf")
    greedy = torch.tensor([p.greedy for p in params], device=device)
    out = logits.argmax(dim=-1)  # T = 0 rows: greedy; ties go to the lowest id
    if bool(greedy.all()):
        return out
    idx = (~greedy).nonzero().squeeze(-1)
    rows = [params[i] for i in idx.tolist()]
    temperature = torch.tensor([p.temperature for p in rows], device=device)
    top_k = torch.tensor([p.top_k for p in rows], device=device)
    top_p = torch.tensor([p.top_p for p in rows], device=device)
    q = filtered_probs(logits[idx], temperature, top_k, top_p)
    # one uniform per sampled row, from the row's own generator (CPU), then inverse CDF
    u = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64) for i in idx.tolist()]).to(device)
    cdf = torch.cumsum(q, dim=-1)
    x = u * cdf[:, -1]  # u * total mass (1 up to rounding), so x < total and never picks the zero-mass tail
    drawn = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1).clamp_(max=q.shape[-1] - 1)
    out[idx] = drawn
    return out


def validate(params: SamplingParams, vocab_size: int) -> None:
    """Reject sampling params the engine cannot honour, saying what to change."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size}); pass ids of this model")
    if any(s == "" for s in params.stop_strings):
        raise ValueError("stop_strings must not contain the empty string (it would stop before the first token)")
