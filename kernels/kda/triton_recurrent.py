"""Fused recurrent KDA in Triton for decoding (docs/model.md §2.4, §2.7): state in, state out, forward only.

One program per (sequence, head, V-block) keeps its [K, BV] slice of the fp32 state in registers
and runs the tokens in order, with the q/k L2 norm and the gate fused in:
    S' = Diag(exp(g_t)) S;  u = v_t - S'^T k_t;  S = S' + beta_t k_t u^T;  o_t = S^T q_t
Decode is memory-bound (the state is read and written once per call), so the kernel is a plain
streaming pass over the state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only
from .gate import L2NORM_EPS
from .inputs import check_kda_inputs

# launch configuration (value-block width, warps, streaming cache hints on the state); benchmarks/kernels.py
# sweeps these on the GPU. BV 32 / 2 warps / no hints: the best of that sweep, near the copy bandwidth of the
# state's bytes (streaming hints made it slower)
CONFIG = {"BV": 32, "num_warps": 2, "stream": False}


@triton.jit
def recurrent_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu, T, scale,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BOUNDED: tl.constexpr, LB: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, EPS: tl.constexpr, VARLEN: tl.constexpr,
    STREAM: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if VARLEN:
        bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    else:  # B sequences of T tokens: no offsets table (and no extra launch to build one)
        bos = i_n * T
        eos = bos + T
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    off_s = ck[:, None] * V + cv[None, :]
    m_s = mk[:, None] & mv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        # STREAM: the state is read once and written once, so it need not stay in L2
        S = tl.load(
            h0 + i_nh * K * V + off_s, mask=m_s, other=0.0, eviction_policy="evict_first" if STREAM else ""
        ).to(tl.float32)
    if USE_GATE:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.zeros([BK], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(dt_bias + i_h * K + ck, mask=mk, other=0.0).to(tl.float32)
    t = bos
    while t < eos:
        b_q = tl.load(q + (t * H + i_h) * K + ck, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + ck, mask=mk, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + cv, mask=mv, other=0.0).to(tl.float32)
        b_g = tl.load(g + (t * H + i_h) * K + ck, mask=mk, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * H + i_h).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + EPS)  # x / sqrt(sum x^2 + eps)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + EPS)
        if USE_GATE:
            x = a * (b_g + bias)
            if BOUNDED:
                b_g = LB * tl.sigmoid(x)  # g = g_min sigmoid(e^A (z + b))
            else:
                sp = tl.where(
                    b_g + bias > 20.0, b_g + bias, tl.log(1.0 + tl.exp(tl.minimum(b_g + bias, 20.0)))
                )
                b_g = -a * sp  # g = -e^A softplus(z + b)
        S = S * tl.exp(b_g)[:, None]  # S' = Diag(alpha) S
        u = b_v - tl.sum(S * b_k[:, None], axis=0)  # u = v - S'^T k
        S += (b_beta * b_k)[:, None] * u[None, :]  # S = S' + beta k u^T
        b_o = tl.sum(S * (b_q * scale)[:, None], axis=0)  # o = S^T q
        tl.store(o + (t * H + i_h) * V + cv, b_o.to(o.dtype.element_ty), mask=mv)
        t += 1
    if STORE_HT:
        tl.store(ht + i_nh * K * V + off_s, S, mask=m_s, cache_modifier=".cs" if STREAM else "")


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def fused_recurrent_kda_triton(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0,
    inplace_final_state=False,
):  # fmt: skip
    """Triton recurrent KDA (inference only); same contract as ``fused_recurrent_kda``. In place, each
    program reads its whole [K, BV] slice of the state before it writes it, and no other program
    touches that slice, so the final state can go over the initial one."""
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, "fused_recurrent_kda")
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias)
    ):
        raise ValueError(
            "fused_recurrent_kda (triton) is inference-only (decode); for gradients use chunk_kda "
            "or backend='torch', or run under torch.no_grad()"
        )
    if use_gate_in_kernel and A_log is None:
        raise ValueError("fused_recurrent_kda: use_gate_in_kernel=True needs A_log [H]")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"fused_recurrent_kda: lower_bound must be negative or None, got {lower_bound}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    varlen = cu_seqlens is not None
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32) if varlen else None
    N = cu.numel() - 1 if varlen else B
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(CONFIG["BV"], triton.next_power_of_2(V)))
    c = lambda x: x.contiguous()
    o = torch.empty_like(v)
    h0 = c(initial_state.float()) if initial_state is not None else o
    if inplace_final_state:  # the dispatcher checked initial_state (fp32, contiguous: h0 is that tensor)
        ht = h0
    else:
        ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else o
    recurrent_fwd_kernel[(triton.cdiv(V, BV), N * H)](
        c(q), c(k), c(v), c(g), c(beta), c(A_log.float()) if use_gate_in_kernel else o,
        c(dt_bias.float()) if (use_gate_in_kernel and dt_bias is not None) else o, o, h0, ht, cu if varlen else o, T,
        float(K**-0.5 if scale is None else scale),
        H=H, K=K, V=V, BK=BK, BV=BV, L2NORM=bool(use_qk_l2norm_in_kernel), USE_GATE=bool(use_gate_in_kernel),
        HAS_BIAS=dt_bias is not None, BOUNDED=lower_bound is not None, LB=float(lower_bound or 0.0),
        HAS_H0=initial_state is not None, STORE_HT=bool(output_final_state or inplace_final_state), EPS=L2NORM_EPS,
        VARLEN=varlen, STREAM=bool(CONFIG["stream"]), num_warps=CONFIG["num_warps"],
    )  # fmt: skip
    return o, (ht if output_final_state else None)
