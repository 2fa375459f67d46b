"""Chunk KDA, stage 5 (CONFIG["split_output"]): O = (Q Gamma) S_t + A_qk V~ in parallel over chunks, from
the states and V~ that the serial pass stored (by default the serial pass forms O itself)."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_chunk_tiles import BT


@triton.jit
def output_fwd_kernel(
    QG, h, Aqk, VN, o, cu, chunk_idx, chunk_off,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """O = (Q Gamma) S_t + A_qk V~ per (chunk, head, V-block), from the states h and V~ of the serial pass."""
    i_t, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_idx + 2 * i_t), tl.load(chunk_idx + 2 * i_t + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    cid = tl.load(chunk_off + i_n) + i_c
    jj = tl.arange(0, BT)
    rows = bos + i_c * BT + jj
    mr = rows < eos
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    qg = tl.load(
        QG + rows[:, None] * (H * K) + i_h * K + ck[None, :], mask=mr[:, None] & mk[None, :], other=0.0
    )
    base = h + (cid * H + i_h).to(tl.int64) * (K * V)
    S = tl.load(base + ck[:, None] * V + cv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    a = tl.load(Aqk + rows[:, None] * (H * BT) + i_h * BT + jj[None, :], mask=mr[:, None], other=0.0)
    off_v = rows[:, None] * (H * V) + i_h * V + cv[None, :]
    m_v = mr[:, None] & mv[None, :]
    vn = tl.load(VN + off_v, mask=m_v, other=0.0)
    out = tl.dot(qg, S.to(qg.dtype)) + tl.dot(a.to(qg.dtype), vn.to(qg.dtype))
    tl.store(o + off_v, out.to(o.dtype.element_ty), mask=m_v)
