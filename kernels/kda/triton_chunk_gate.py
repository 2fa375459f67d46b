"""Chunk KDA, stage 1: the gate and its chunk-local cumulative sum, forward and backward.

gate_cumsum_fwd   g = lower_bound * sigmoid(exp(A_log) (z + dt_bias)) (optional), G = chunk-local cumsum
gate_cumsum_bwd   reverse chunk-local cumsum of dG, then the gate derivative (dz, dA_log, d dt_bias)
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_chunk_tiles import BT


@triton.jit
def gate_cumsum_fwd_kernel(
    z, A_log, dt_bias, G, cu, chunk_idx, H, K: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, LB: tl.constexpr,
):  # fmt: skip
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c = tl.load(chunk_idx + 2 * i_t), tl.load(chunk_idx + 2 * i_t + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    rows = bos + i_c * BT + tl.arange(0, BT)
    cols = tl.arange(0, BK)
    m = (rows < eos)[:, None] & (cols < K)[None, :]
    off = rows[:, None] * (H * K) + i_h * K + cols[None, :]
    g = tl.load(z + off, mask=m, other=0.0).to(tl.float32)
    if USE_GATE:
        if HAS_BIAS:
            g += tl.load(dt_bias + i_h * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        g = LB * tl.sigmoid(a * g)  # g = lower_bound * sigmoid(e^A (z + dt_bias))
        g = tl.where(m, g, 0.0)
    tl.store(G + off, tl.cumsum(g, axis=0), mask=m)  # G_r = sum_{s <= r} g_s inside the chunk


@triton.jit
def gate_cumsum_bwd_kernel(
    dG, z, A_log, dt_bias, dz, dA_log, ddt, cu, chunk_idx, H, K: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, LB: tl.constexpr, PARAM_GRADS: tl.constexpr,
):  # fmt: skip
    """dz (in z's dtype); with PARAM_GRADS also dA_log [H] and d dt_bias [H, K] summed by atomic adds
    into fp32 buffers (zero-initialised)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c = tl.load(chunk_idx + 2 * i_t), tl.load(chunk_idx + 2 * i_t + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    rows = bos + i_c * BT + tl.arange(0, BT)
    cols = tl.arange(0, BK)
    m = (rows < eos)[:, None] & (cols < K)[None, :]
    off = rows[:, None] * (H * K) + i_h * K + cols[None, :]
    dg = tl.cumsum(tl.load(dG + off, mask=m, other=0.0), axis=0, reverse=True)  # dg_s = sum_{r >= s} dG_r
    if USE_GATE:
        x = tl.load(z + off, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(dt_bias + i_h * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        s = tl.sigmoid(a * x)
        dg = dg * (LB * a * s * (1.0 - s))  # dg/dz = g_min e^A sigma (1 - sigma)
        if PARAM_GRADS:
            tl.atomic_add(dA_log + i_h, tl.sum(tl.sum(dg * x, axis=1), axis=0))  # dg/dA = dg/dz (z + b)
            if HAS_BIAS:
                tl.atomic_add(ddt + i_h * K + cols, tl.sum(dg, axis=0), mask=cols < K)  # dg/db = dg/dz
    tl.store(dz + off, dg.to(dz.dtype.element_ty), mask=m)
