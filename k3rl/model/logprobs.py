"""Token log-probabilities and entropies straight from the last hidden states, in token chunks.

The learner needs, per token t with target y_t, only two numbers of the output distribution:

    z_t   = W h_t                                  (logits, [V])
    logp_t = z_t[y_t] - logsumexp(z_t)
    H_t    = logsumexp(z_t) - sum_v p_tv z_tv,      p_t = softmax(z_t)

Materialising z for a whole micro-batch costs T x V fp32 (16K tokens x 160K vocabulary =
10 GB, plus its gradient). Here the logits of one chunk of tokens exist at a time, in the
forward and again (recomputed) in the backward, so the peak is chunk x V whatever T is:

    d z_t = g_t (onehot(y_t) - p_t)  -  gH_t p_t (z_t - E_p[z_t]),   E_p[z_t] = logsumexp(z_t) - H_t
    d h_t = d z_t W,   d W = sum_t d z_t^T h_t

The logits are formed in the dtype of h and W (bf16 under autocast, as `lm_head` would) and
read in fp32, so the numbers equal `token_logprobs(lm_head(h), y)`.

At a policy temperature tau (the distribution the engine samples from, softmax(z / tau)), z above
is the fp32 logits divided by tau, and the chain rule adds d(logits) = d z / tau.
"""

from __future__ import annotations

import torch

from .common import autocast_dtype


def default_chunk_tokens(vocab_size: int, chunk_bytes: int = 256 << 20) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about `chunk_bytes`."""
    return max(64, chunk_bytes // (4 * vocab_size))


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden and weight in the dtype `lm_head` would multiply them in: the autocast dtype under
    autocast, else the weight's."""
    if (dtype := autocast_dtype(hidden)) is not None:
        return hidden.to(dtype), weight.to(dtype)
    return hidden.to(weight.dtype), weight


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, temperature: float):
        T = hidden.shape[0]
        logp = torch.empty(T, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, T, chunk):
            z = (hidden[s : s + chunk] @ weight.t()).float() / temperature  # [c, V]
            lse_c = torch.logsumexp(z, dim=-1)
            p = torch.exp(z - lse_c[:, None])
            lse[s : s + chunk] = lse_c
            logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lse_c
            entropy[s : s + chunk] = lse_c - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.chunk, ctx.temperature = chunk, temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        chunk = ctx.chunk
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = (h @ weight.t()).float() / ctx.temperature
            p = torch.exp(z - lse[s : s + chunk, None])
            dz = torch.zeros_like(z)
            if g_logp is not None:
                g = g_logp[s : s + chunk].float()
                dz -= g[:, None] * p
                dz.scatter_add_(-1, targets[s : s + chunk, None], g[:, None])
            if g_entropy is not None:
                mean_z = (lse - entropy)[s : s + chunk]  # E_p[z] = logsumexp(z) - H
                dz -= g_entropy[s : s + chunk].float()[:, None] * p * (z - mean_z[:, None])
            dz = (dz / ctx.temperature).to(hidden.dtype)  # d logits = d z / tau
            if d_hidden is not None:
                d_hidden[s : s + chunk] = dz @ weight
            if d_weight is not None:
                d_weight += (dz.t() @ h).float()
        return d_hidden, (d_weight.to(weight.dtype) if d_weight is not None else None), None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           chunk_tokens: int | None = None, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(y_t), entropy H_t), both fp32 [T], for hidden [T, d], lm_head weight [V, d], targets [T],
    under softmax(logits / temperature).

    Under autocast the product runs in the autocast dtype, as `nn.Linear` would."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [T, d] and targets [T]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    hidden, weight = _matmul_dtype(hidden, weight)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLogprobs.apply(hidden, weight, targets.long(), chunk, float(temperature))


class _ChunkedReverseKL(torch.autograd.Function):
    """KL(p_t || q_t) per token, p = softmax(W h_t / tau) the student's, q = softmax(W' h'_t / tau)
    a teacher's (its last hidden states h' and lm_head W', no gradient), chunk by chunk:

        KL_t = sum_v p_tv (log p_tv - log q_tv)
        d KL_t / d z_tv = p_tv (log p_tv - log q_tv - KL_t)          (z = the student's logits / tau)
    """

    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, chunk: int, temperature: float):
        kl = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            log_p = torch.log_softmax((hidden[s : s + chunk] @ weight.t()).float() / temperature, -1)
            log_q = torch.log_softmax((t_hidden[s : s + chunk] @ t_weight.t()).float() / temperature, -1)
            kl[s : s + chunk] = (log_p.exp() * (log_p - log_q)).sum(-1)
        ctx.save_for_backward(hidden, weight, t_hidden, t_weight, kl)
        ctx.chunk, ctx.temperature = chunk, temperature
        return kl

    @staticmethod
    def backward(ctx, g_kl):
        hidden, weight, t_hidden, t_weight, kl = ctx.saved_tensors
        chunk, tau = ctx.chunk, ctx.temperature
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            log_p = torch.log_softmax((h @ weight.t()).float() / tau, -1)
            log_q = torch.log_softmax((t_hidden[s : s + chunk] @ t_weight.t()).float() / tau, -1)
            dz = log_p.exp() * (log_p - log_q - kl[s : s + chunk, None]) * g_kl[s : s + chunk, None].float()
            dz = (dz / tau).to(hidden.dtype)  # d logits = d z / tau
            if d_hidden is not None:
                d_hidden[s : s + chunk] = dz @ weight
            if d_weight is not None:
                d_weight += (dz.t() @ h).float()
        return d_hidden, (d_weight.to(weight.dtype) if d_weight is not None else None), None, None, None, None


def chunked_reverse_kl(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                       teacher_weight: torch.Tensor, chunk_tokens: int | None = None,
                       temperature: float = 1.0) -> torch.Tensor:
    """KL(student || teacher) at every position, fp32 [T]: the student's hidden [T, d] and lm_head
    weight [V, d] against a teacher's [T, d'] and [V, d'] (the same vocabulary), both under
    softmax(logits / temperature); differentiable in the student's, the teacher's taken as fixed.
    The exact per-token reverse KL over the vocabulary, where log T(y_t) - log mu(y_t) of the sampled
    token is its one-sample estimate (learner/distill.py)."""
    if teacher_hidden.shape[0] != hidden.shape[0] or teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"the teacher must cover the same positions and vocabulary: hidden {tuple(hidden.shape)}, "
                         f"lm_head {tuple(weight.shape)} against the teacher's {tuple(teacher_hidden.shape)}, "
                         f"{tuple(teacher_weight.shape)}")
    hidden, weight = _matmul_dtype(hidden, weight)
    t_hidden = teacher_hidden.detach().to(teacher_weight.dtype)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedReverseKL.apply(hidden, weight, t_hidden, teacher_weight.detach(), chunk, float(temperature))
