"""Chunkwise-parallel KDA in plain PyTorch (docs/model.md §2.5), and the chunk transition matrix.

Per chunk of C tokens (per head; Q already scaled):
  1. G = cumsum(g) inside the chunk; Gamma = exp(G); Gamma_C its last row.
  2. A_kk[i,j] = beta_i sum_c K_ic K_jc exp(G_ic - G_jc), j < i   (strictly lower)
  3. UT transform: T~ = (I + A_kk)^{-1} Diag(beta), by forward substitution
  4. W = T~ (Gamma * K), U = T~ V
  5. A_qk[i,j] = sum_c Q_ic K_jc exp(G_ic - G_jc), j <= i          (diagonal included)
  6. serial over chunks, S the state entering the chunk:
       V~ = U - W S;  O = (Q * Gamma) S + A_qk V~
       S <- Diag(Gamma_C) S + ((Gamma_C / Gamma) * K)^T V~
  7. M_chunk = Diag(Gamma_C) - ((Gamma_C / Gamma) * K)^T W   (S_next = M_chunk S when V = 0)
Exponentials are only ever taken of differences G_a - G_b with a after b, so every factor is <= 1.
Tokens past the end are padded with k = v = q = 0, g = 0, beta = 0, which changes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .inputs import check_kda_inputs, prepare_qkgb, run_reference


def _pad_to_chunks(x, C):
    """Pad the time dim (dim 2 of [B, H, T, ...]) with zeros to a multiple of C."""
    pad = (-x.shape[2]) % C
    if pad == 0:
        return x
    spec = [0, 0] * (x.dim() - 3) + [0, pad]
    return F.pad(x, spec)


def chunk_factors(q, k, g, beta):
    """Steps 1-5 for a batch of chunks [..., C, K]; returns (G, A_qk, W, T~ as a solver of V)."""
    C = k.shape[-2]
    G = g.cumsum(-2)  # step 1
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., i, j, K] = G_i - G_j
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()  # j <= i
    decay = torch.where(
        incl[..., None], diff, torch.full_like(diff, float("-inf"))
    ).exp()  # exp(G_i - G_j), 0 above
    kdec = decay * k.unsqueeze(-3)  # K_jc exp(G_ic - G_jc)
    A_kk = torch.einsum("...ijc,...ic->...ij", kdec, k).tril(-1) * beta.unsqueeze(-1)  # step 2
    A_qk = torch.einsum("...ijc,...ic->...ij", kdec, q) if q is not None else None  # step 5
    L = A_kk + torch.eye(C, dtype=k.dtype, device=k.device)  # unit lower triangular I + A_kk
    # step 3-4: T~ X = (I + A_kk)^{-1} (beta * X), solved by forward substitution
    ut = lambda X: torch.linalg.solve_triangular(L, beta.unsqueeze(-1) * X, upper=False, unitriangular=True)
    W = ut(G.exp() * k)  # W = T~ (Gamma * K)
    return G, A_qk, W, ut


def chunk_kda_core(q, k, v, g, beta, S0, chunk_size=64):
    """Head-first core: q, k, g [B, H, T, K] (q scaled), v [B, H, T, V], beta [B, H, T], S0 [B, H, K, V]."""
    T = q.shape[2]
    C = chunk_size
    q, k, v, g, beta = (_pad_to_chunks(x, C) for x in (q, k, v, g, beta))
    S = S0
    outs = []
    for s in range(0, q.shape[2], C):
        qc, kc, vc, gc, bc = (x[:, :, s : s + C] for x in (q, k, v, g, beta))
        G, A_qk, W, ut = chunk_factors(qc, kc, gc, bc)
        U = ut(vc)  # U = T~ V
        GC = G[..., -1:, :]  # log Gamma_C, [B, H, 1, K]
        v_new = U - W @ S  # V~ = U - W S
        outs.append((qc * G.exp()) @ S + A_qk @ v_new)  # O = (Q*Gamma) S + A_qk V~
        k_to_end = (GC - G).exp() * kc  # (Gamma_C / Gamma) * K
        S = GC.squeeze(-2).exp().unsqueeze(-1) * S + k_to_end.transpose(-1, -2) @ v_new
    o = torch.cat(outs, dim=2)[:, :, :T] if outs else v[:, :, :T]
    return o, S


def chunk_kda_reference(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=64,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=-5.0,
):
    """Chunkwise KDA in PyTorch, intermediates and state in fp32 (fp64 for fp64 inputs).

    Same arguments and returns as ``chunk_kda``; differentiable by PyTorch autograd.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_kda_reference: chunk_size must be positive, got {chunk_size}")
    core = lambda *a: chunk_kda_core(*a, chunk_size=chunk_size)
    return run_reference(
        core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, op="chunk_kda_reference",
    )  # fmt: skip


def kda_chunk_transition(
    k,
    g,
    beta,
    chunk_size=64,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=-5.0,
):
    """Per-chunk transition matrices M_chunk [B, H, N_chunks, K, K] (docs/model.md §2.5 step 7).

    k, g [B, T, H, K], beta [B, T, H]. With V = 0 the chunk maps its entering state S [K, V]
    to ``M_chunk @ S``. The last chunk is padded with identity steps when T is not a multiple
    of ``chunk_size``. Computed in fp32 (fp64 for fp64 inputs).
    """
    B, T, H, K = k.shape
    v0 = k.new_zeros(B, T, H, 1)
    check_kda_inputs(k, k, v0, g, beta, None, None, "kda_chunk_transition")
    _, ks, gs, bs = prepare_qkgb(
        k, k, g, beta, 1.0, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound
    )
    C = chunk_size
    ks, gs = (_pad_to_chunks(x.transpose(1, 2), C) for x in (ks, gs))
    bs = _pad_to_chunks(bs.transpose(1, 2), C)
    N = ks.shape[2] // C
    ks, gs = (x.reshape(B, H, N, C, K) for x in (ks, gs))
    bs = bs.reshape(B, H, N, C)
    G, _, W, _ = chunk_factors(None, ks, gs, bs)
    GC = G[..., -1:, :]
    k_to_end = (GC - G).exp() * ks  # (Gamma_C / Gamma) * K
    eye = torch.eye(K, dtype=ks.dtype, device=ks.device)
    return (
        GC.squeeze(-2).exp().unsqueeze(-1) * eye - k_to_end.transpose(-1, -2) @ W
    )  # Diag(Gamma_C) - (...)^T W


def kda_transition(k, g, beta, chunk_size=64, **gate_kwargs):
    """Transition of a whole segment, M = M_N ... M_1 [B, H, K, K], for context parallelism (§9.3).

    A segment run from state S0 ends in ``M @ S0 + S~`` where S~ is its zero-start final state.
    """
    M = kda_chunk_transition(k, g, beta, chunk_size=chunk_size, **gate_kwargs)
    out = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device).expand(M.shape[0], M.shape[1], -1, -1)
    for n in range(M.shape[2]):
        out = M[:, :, n] @ out
    return out
