"""Chunk KDA, stage 3: the triangular solve T~ = (I + A_kk)^-1 and the WY factors W = T~ (beta Gamma K),
U = T~ (beta V), from the blocks ``intra_blocks_fwd`` leaves (block forward substitution)."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_chunk_tiles import BS, BT, _load_blk, _mm, _store_blk


@triton.jit
def _store_u(Tm, v, U, b_c, cols, mc, i_h, H, V: tl.constexpr, BV: tl.constexpr):
    """U = T~ (beta V) for one chunk's rows, by V slices of BV (Tm: T~ in the inputs' dtype)."""
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        off_v = cols[:, None] * (H * V) + i_h * V + cv[None, :]
        m_v = mc[:, None] & (cv < V)[None, :]
        vb = (tl.load(v + off_v, mask=m_v, other=0.0).to(tl.float32) * b_c[:, None]).to(Tm.dtype)
        tl.store(U + off_v, tl.dot(Tm, vb).to(U.dtype.element_ty), mask=m_v)


@triton.jit
def _solve_rows(Ti, Tb, start, eos, i_h, H):
    """T~ = (I + A_kk)^-1 of one chunk from the 16x16 blocks in Ti (beta-scaled A_kk blocks L_rc below the
    diagonal, the inverses X_rr on it), by block forward substitution, row block by row block:
        X_rc = -X_rr sum_{c <= m < r} L_rm X_mc
    (intra_fwd's formulas and order of products, so the same fp32 numbers); writes the whole 64 x 64 T~
    (zeros above the diagonal) into Tb, in Tb's dtype (the inputs'; every reader of T~ rounds it to that)."""
    X00 = _load_blk(Ti, start, eos, 0, 0, H, i_h)
    X11 = _load_blk(Ti, start, eos, 16, 16, H, i_h)
    X22 = _load_blk(Ti, start, eos, 32, 32, H, i_h)
    X33 = _load_blk(Ti, start, eos, 48, 48, H, i_h)
    L10 = _load_blk(Ti, start, eos, 16, 0, H, i_h)
    X10 = -_mm(X11, _mm(L10, X00))
    L20 = _load_blk(Ti, start, eos, 32, 0, H, i_h)
    L21 = _load_blk(Ti, start, eos, 32, 16, H, i_h)
    X21 = -_mm(X22, _mm(L21, X11))
    X20 = -_mm(X22, _mm(L20, X00) + _mm(L21, X10))
    L30 = _load_blk(Ti, start, eos, 48, 0, H, i_h)
    L31 = _load_blk(Ti, start, eos, 48, 16, H, i_h)
    L32 = _load_blk(Ti, start, eos, 48, 32, H, i_h)
    X32 = -_mm(X33, _mm(L32, X22))
    X31 = -_mm(X33, _mm(L31, X11) + _mm(L32, X21))
    X30 = -_mm(X33, _mm(L30, X00) + _mm(L31, X10) + _mm(L32, X20))
    Z = tl.zeros([BS, BS], dtype=Tb.dtype.element_ty)
    _store_blk(Tb, X00.to(Z.dtype), start, eos, 0, 0, H, i_h)
    _store_blk(Tb, Z, start, eos, 0, 16, H, i_h)
    _store_blk(Tb, Z, start, eos, 0, 32, H, i_h)
    _store_blk(Tb, Z, start, eos, 0, 48, H, i_h)
    _store_blk(Tb, X10.to(Z.dtype), start, eos, 16, 0, H, i_h)
    _store_blk(Tb, X11.to(Z.dtype), start, eos, 16, 16, H, i_h)
    _store_blk(Tb, Z, start, eos, 16, 32, H, i_h)
    _store_blk(Tb, Z, start, eos, 16, 48, H, i_h)
    _store_blk(Tb, X20.to(Z.dtype), start, eos, 32, 0, H, i_h)
    _store_blk(Tb, X21.to(Z.dtype), start, eos, 32, 16, H, i_h)
    _store_blk(Tb, X22.to(Z.dtype), start, eos, 32, 32, H, i_h)
    _store_blk(Tb, Z, start, eos, 32, 48, H, i_h)
    _store_blk(Tb, X30.to(Z.dtype), start, eos, 48, 0, H, i_h)
    _store_blk(Tb, X31.to(Z.dtype), start, eos, 48, 16, H, i_h)
    _store_blk(Tb, X32.to(Z.dtype), start, eos, 48, 32, H, i_h)
    _store_blk(Tb, X33.to(Z.dtype), start, eos, 48, 48, H, i_h)


@triton.jit
def intra_solve_fwd_kernel(
    v, beta, Ti, Tb, W, U, cu, chunk_idx,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """T~ = (I + A_kk)^-1 into Tb (the inputs' dtype) from intra_blocks_fwd's blocks in Ti, then, as
    intra_fwd's step 3, U = T~ (beta V) by V blocks of BV and W = T~ B_W by K slices of at most 64
    (B_W = beta Gamma K, as intra_blocks_fwd left it in W)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c = tl.load(chunk_idx + 2 * i_t), tl.load(chunk_idx + 2 * i_t + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    start = bos + i_c * BT
    _solve_rows(Ti, Tb, start, eos, i_h, H)
    tl.debug_barrier()
    dt = W.dtype.element_ty
    jj = tl.arange(0, BT)
    cols = start + jj
    mc = cols < eos
    Tm = tl.load(Tb + cols[:, None] * (H * BT) + i_h * BT + jj[None, :], mask=mc[:, None], other=0.0).to(dt)
    b_c = tl.load(beta + cols * H + i_h, mask=mc, other=0.0).to(tl.float32)
    _store_u(Tm, v, U, b_c, cols, mc, i_h, H, V, BV)
    BKW: tl.constexpr = min(BK, 64)
    for i_k in tl.static_range(BK // BKW):
        cs = i_k * BKW + tl.arange(0, BKW)
        off_s = cols[:, None] * (H * K) + i_h * K + cs[None, :]
        m_s = mc[:, None] & (cs < K)[None, :]
        kb = tl.load(W + off_s, mask=m_s, other=0.0)
        tl.debug_barrier()  # the slice is read by every thread before any overwrites it
        tl.store(W + off_s, tl.dot(Tm, kb).to(W.dtype.element_ty), mask=m_s)
