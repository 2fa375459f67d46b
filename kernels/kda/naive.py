"""Naive per-token KDA recurrence (docs/model.md §2.4): the ground truth for every other form.

Per head, with state S [K, V], alpha_t = exp(g_t):
    S' = Diag(alpha_t) S                 (scale row i by alpha_{t,i})
    u  = v_t - S'^T k_t                  (prediction error against the decayed state)
    S  = S' + beta_t k_t u^T
    o_t = S^T q_t
which is S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T.
"""

from __future__ import annotations

import torch

from .inputs import run_reference


def naive_recurrent_core(q, k, v, g, beta, S0):
    """Head-first core: q, k, g [B, H, T, K] (q scaled), v [B, H, T, V], beta [B, H, T], S0 [B, H, K, V]."""
    S = S0
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp().unsqueeze(-1)  # S' = Diag(alpha_t) S
        u = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])  # u = v_t - S'^T k_t
        S = S + beta[:, :, t, None, None] * k[:, :, t].unsqueeze(-1) * u.unsqueeze(-2)  # S' + beta k u^T
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))  # o_t = S^T q_t
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


def naive_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=-5.0,
):
    """Token-by-token KDA (the reference of references). Same arguments and returns as ``chunk_kda``."""
    return run_reference(
        naive_recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, op="naive_recurrent_kda",
    )  # fmt: skip
