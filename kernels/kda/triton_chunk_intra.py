"""Chunk KDA, stage 2: the intra-chunk blocks A_qk, A_kk and the gated operands of the serial passes.

intra_blocks_fwd  per (chunk and 16-row block, head): A_qk, A_kk by 16x16 blocks (dense dot products
                  thanks to the bounded gate), the diagonal blocks' inverses, QG = Q Gamma,
                  KD = K e^{G_C - G} and beta Gamma K; the triangular solve follows in
                  ``triton_chunk_solve.py``
intra_fwd         the same numbers and the solve in one kernel, 16-row tiles (CONFIG["split_intra"] =
                  False; slower: 255 registers, one program per SM)
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_chunk_solve import _store_u
from .triton_chunk_tiles import BS, BT, _load_blk, _mm, _store_blk, _tri_inverse16


@triton.jit
def _intra_a_tiles(q, k, G, beta, Aqk, Ti, start, eos, i_h, H, K: tl.constexpr, BK: tl.constexpr):
    """A_qk (into Aqk) and beta-scaled A_kk (into Ti) of one chunk by 16-row tiles against all 64 columns."""
    dt = k.dtype.element_ty
    ck = tl.arange(0, BK)
    mk = ck < K
    jj = tl.arange(0, BT)
    cols = start + jj
    mc = cols < eos
    off_c = cols[:, None] * (H * K) + i_h * K + ck[None, :]
    k_c = tl.load(k + off_c, mask=mc[:, None] & mk[None, :], other=0.0).to(tl.float32)
    G_c = tl.load(G + off_c, mask=mc[:, None] & mk[None, :], other=0.0)
    for r in tl.static_range(BT // BS):
        ii = r * BS + tl.arange(0, BS)
        rows = start + ii
        mr = rows < eos
        n = tl.minimum(start + r * BS, eos - 1)
        Gn = tl.load(G + n * (H * K) + i_h * K + ck, mask=mk, other=0.0)
        off_r = rows[:, None] * (H * K) + i_h * K + ck[None, :]
        m_r = mr[:, None] & mk[None, :]
        e_r = tl.exp(tl.load(G + off_r, mask=m_r, other=0.0) - Gn[None, :])
        kr = (tl.load(k + off_r, mask=m_r, other=0.0).to(tl.float32) * e_r).to(dt)
        qr = (tl.load(q + off_r, mask=m_r, other=0.0).to(tl.float32) * e_r).to(dt)
        in_reach = mc & (jj < r * BS + BS)
        kinv = (k_c * tl.exp(tl.where(in_reach[:, None], Gn[None, :] - G_c, float("-inf")))).to(dt)
        akk = tl.dot(kr, tl.trans(kinv))  # [16, 64]
        aqk = tl.dot(qr, tl.trans(kinv))
        b_r = tl.load(beta + rows * H + i_h, mask=mr, other=0.0).to(tl.float32)
        akk = tl.where(
            jj[None, :] < ii[:, None], akk * b_r[:, None], 0.0
        )  # strictly lower, row-scaled by beta
        aqk = tl.where(jj[None, :] <= ii[:, None], aqk, 0.0)  # diagonal included
        off_a = rows[:, None] * (H * BT) + i_h * BT + jj[None, :]
        tl.store(Aqk + off_a, aqk.to(Aqk.dtype.element_ty), mask=mr[:, None])
        tl.store(Ti + off_a, akk, mask=mr[:, None])  # scratch: A_kk, replaced by T~ below


@triton.jit
def intra_fwd_kernel(
    q, k, v, G, beta, Aqk, Ti, W, U, QG, KD, cu, chunk_idx,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c = tl.load(chunk_idx + 2 * i_t), tl.load(chunk_idx + 2 * i_t + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    start = bos + i_c * BT
    dt = k.dtype.element_ty
    jj = tl.arange(0, BT)  # column (key) index inside the chunk
    cols = start + jj
    mc = cols < eos
    # 1) A_kk and A_qk, one 16-row tile at a time, reference point n = first row of the tile:
    #    A[i, j] = sum_c (X_ic e^{G_ic - G_nc}) (K_jc e^{G_nc - G_jc}); row factors <= 1, column factors
    #    <= 1 before the tile and < e^80 inside it (bounded gate).
    #    (by 16x16 blocks below the diagonal instead: the same numbers, slower)
    _intra_a_tiles(q, k, G, beta, Aqk, Ti, start, eos, i_h, H, K, BK)
    tl.debug_barrier()
    # 2) (I + A_kk)^-1 by 16x16 blocks: diagonal blocks by forward substitution, then
    #    X_rc = -X_rr sum_{c <= m < r} L_rm X_mc
    L10 = _load_blk(Ti, start, eos, 16, 0, H, i_h)
    L20 = _load_blk(Ti, start, eos, 32, 0, H, i_h)
    L21 = _load_blk(Ti, start, eos, 32, 16, H, i_h)
    L30 = _load_blk(Ti, start, eos, 48, 0, H, i_h)
    L31 = _load_blk(Ti, start, eos, 48, 16, H, i_h)
    L32 = _load_blk(Ti, start, eos, 48, 32, H, i_h)
    X00 = _tri_inverse16(_load_blk(Ti, start, eos, 0, 0, H, i_h), BS)
    X11 = _tri_inverse16(_load_blk(Ti, start, eos, 16, 16, H, i_h), BS)
    X22 = _tri_inverse16(_load_blk(Ti, start, eos, 32, 32, H, i_h), BS)
    X33 = _tri_inverse16(_load_blk(Ti, start, eos, 48, 48, H, i_h), BS)
    X10 = -_mm(X11, _mm(L10, X00))
    X21 = -_mm(X22, _mm(L21, X11))
    X32 = -_mm(X33, _mm(L32, X22))
    X20 = -_mm(X22, _mm(L20, X00) + _mm(L21, X10))
    X31 = -_mm(X33, _mm(L31, X11) + _mm(L32, X21))
    X30 = -_mm(X33, _mm(L30, X00) + _mm(L31, X10) + _mm(L32, X20))
    tl.debug_barrier()
    Z = tl.zeros([BS, BS], dtype=tl.float32)
    _store_blk(Ti, X00, start, eos, 0, 0, H, i_h)
    _store_blk(Ti, Z, start, eos, 0, 16, H, i_h)
    _store_blk(Ti, Z, start, eos, 0, 32, H, i_h)
    _store_blk(Ti, Z, start, eos, 0, 48, H, i_h)
    _store_blk(Ti, X10, start, eos, 16, 0, H, i_h)
    _store_blk(Ti, X11, start, eos, 16, 16, H, i_h)
    _store_blk(Ti, Z, start, eos, 16, 32, H, i_h)
    _store_blk(Ti, Z, start, eos, 16, 48, H, i_h)
    _store_blk(Ti, X20, start, eos, 32, 0, H, i_h)
    _store_blk(Ti, X21, start, eos, 32, 16, H, i_h)
    _store_blk(Ti, X22, start, eos, 32, 32, H, i_h)
    _store_blk(Ti, Z, start, eos, 32, 48, H, i_h)
    _store_blk(Ti, X30, start, eos, 48, 0, H, i_h)
    _store_blk(Ti, X31, start, eos, 48, 16, H, i_h)
    _store_blk(Ti, X32, start, eos, 48, 32, H, i_h)
    _store_blk(Ti, X33, start, eos, 48, 48, H, i_h)
    tl.debug_barrier()
    # 3) U = T~ (beta V); W = T~ (beta Gamma K) and 4) the gated operands of the serial passes, so that
    #    they run no exponentials: QG = Q Gamma, KD = K e^{G_C - G} (G_C = the chunk's last row);
    #    3) and 4) by K slices of at most 64 (fewer live registers)
    off_t = cols[:, None] * (H * BT) + i_h * BT + jj[None, :]
    Tm = tl.load(Ti + off_t, mask=mc[:, None], other=0.0).to(dt)
    b_c = tl.load(beta + cols * H + i_h, mask=mc, other=0.0).to(tl.float32)
    _store_u(Tm, v, U, b_c, cols, mc, i_h, H, V, BV)
    BKW: tl.constexpr = min(BK, 64)
    last = tl.minimum(start + BT, eos) - 1
    for i_k in tl.static_range(BK // BKW):
        cs = i_k * BKW + tl.arange(0, BKW)
        off_s = cols[:, None] * (H * K) + i_h * K + cs[None, :]
        m_s = mc[:, None] & (cs < K)[None, :]
        k_s = tl.load(k + off_s, mask=m_s, other=0.0).to(tl.float32)
        G_s = tl.load(G + off_s, mask=m_s, other=0.0)
        kb = (k_s * tl.exp(G_s) * b_c[:, None]).to(dt)
        tl.store(W + off_s, tl.dot(Tm, kb).to(W.dtype.element_ty), mask=m_s)
        q_s = tl.load(q + off_s, mask=m_s, other=0.0).to(tl.float32)
        tl.store(QG + off_s, (q_s * tl.exp(G_s)).to(dt), mask=m_s)
        Gl = tl.load(G + last * (H * K) + i_h * K + cs, mask=cs < K, other=0.0)
        tl.store(KD + off_s, (k_s * tl.exp(Gl[None, :] - G_s)).to(dt), mask=m_s)


# Split intra path (CONFIG["split_intra"]): the same numbers as intra_fwd in two kernels with fewer live
# tiles each, so that several programs share an SM (intra_fwd holds 255 registers, one program per SM):
#   intra_blocks_fwd  per (chunk and 16-row block r, head): blocks (r, c <= r) of A_qk and A_kk, the
#                     inverse X_rr of the diagonal block of I + A_kk, and the rows' QG, KD, beta Gamma K;
#   intra_solve_fwd   per (chunk, head): T~ from those blocks (block forward substitution), W and U.
# Registers (sm_90a, K = V = 128): 128 at 4 warps and 128 at 8 warps, no spills (intra_fwd: 255 + 48 B).
@triton.jit
def intra_blocks_fwd_kernel(
    q, k, G, beta, Aqk, Ti, QG, KD, W, qn, kn, rq, rk, scale, cu, chunk_idx, H, K: tl.constexpr,
    BK: tl.constexpr, L2NORM: tl.constexpr = False, STORE_QK: tl.constexpr = False, EPS: tl.constexpr = 1e-6,
):  # fmt: skip
    """Rows of block r: A[i, j] = sum_c (X_ic e^{G_ic - G_nc}) (K_jc e^{G_nc - G_jc}), n = first row of
    block r (the same reference point as intra_fwd's 16-row tiles, so the same numbers); row factors <= 1,
    column factors <= 1 left of block r and < e^80 inside it (bounded gate): dense 16x16 products.
    Writes A_qk's row blocks (zeros right of the diagonal), into Ti the beta-scaled A_kk blocks left
    of the diagonal and X_rr = (I + A_kk,rr)^-1 on it (intra_solve_fwd replaces them by T~), QG, KD, and
    B_W = beta Gamma K into W.
    With L2NORM, q and k are the raw inputs and the kernel normalises every row it reads as
    triton_l2norm does (scale q / |q|, k / |k|, rounded to the inputs' dtype, so the same numbers as the
    separate pass); with STORE_QK it also writes its rows' normalised q, k (qn, kn) and the reciprocal
    norms (rq, rk) that the backward needs."""
    i_tr, i_h = tl.program_id(0), tl.program_id(1)
    i_t, r = i_tr // (BT // BS), i_tr % (BT // BS)
    i_n, i_c = tl.load(chunk_idx + 2 * i_t), tl.load(chunk_idx + 2 * i_t + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    start = bos + i_c * BT
    n = start + r * BS  # reference point: first row of block r
    if n < eos:  # blocks past the end of a short last chunk have nothing to do
        dt = k.dtype.element_ty
        ck = tl.arange(0, BK)
        mk = ck < K
        ii = tl.arange(0, BS)
        rows = n + ii
        mr = rows < eos
        off_r = rows[:, None] * (H * K) + i_h * K + ck[None, :]
        m_r = mr[:, None] & mk[None, :]
        G_r = tl.load(G + off_r, mask=m_r, other=0.0)
        k_r = tl.load(k + off_r, mask=m_r, other=0.0).to(tl.float32)
        q_r = tl.load(q + off_r, mask=m_r, other=0.0).to(tl.float32)
        if L2NORM:  # y = s x r, r = (sum x^2 + eps)^-1/2, rounded as the separate pass stores it
            r_q = 1.0 / tl.sqrt(tl.sum(q_r * q_r, axis=1) + EPS)
            r_k = 1.0 / tl.sqrt(tl.sum(k_r * k_r, axis=1) + EPS)
            q_r = (q_r * (r_q * scale)[:, None]).to(dt).to(tl.float32)
            k_r = (k_r * r_k[:, None]).to(dt).to(tl.float32)
            if STORE_QK:
                tl.store(qn + off_r, q_r.to(dt), mask=m_r)
                tl.store(kn + off_r, k_r.to(dt), mask=m_r)
                tl.store(rq + rows * H + i_h, r_q, mask=mr)
                tl.store(rk + rows * H + i_h, r_k, mask=mr)
        # the gated operands of the serial passes: QG = Q Gamma, KD = K e^{G_C - G} (G_C: chunk's last row)
        last = tl.minimum(start + BT, eos) - 1
        Gl = tl.load(G + last * (H * K) + i_h * K + ck, mask=mk, other=0.0)
        gam = tl.exp(G_r)
        tl.store(QG + off_r, (q_r * gam).to(dt), mask=m_r)
        tl.store(KD + off_r, (k_r * tl.exp(Gl[None, :] - G_r)).to(dt), mask=m_r)
        b_r = tl.load(beta + rows * H + i_h, mask=mr, other=0.0).to(tl.float32)
        # B_W = beta Gamma K into W (intra_solve_fwd reads it and writes W = T~ B_W over it)
        tl.store(W + off_r, (k_r * gam * b_r[:, None]).to(dt), mask=m_r)
        Gn = tl.load(G + n * (H * K) + i_h * K + ck, mask=mk, other=0.0)
        e_r = tl.exp(tl.where(m_r, G_r - Gn[None, :], float("-inf")))  # e^{G_i - G_n} <= 1; padded rows 0
        kr = (k_r * e_r).to(dt)
        qr = (q_r * e_r).to(dt)
        # diagonal block (r, r): its columns are the rows of block r; e^{G_n - G_j} < e^80 (bounded gate)
        kinv = (k_r * tl.exp(tl.where(m_r, Gn[None, :] - G_r, float("-inf")))).to(dt)
        akk = tl.dot(kr, tl.trans(kinv)) * b_r[:, None]
        akk = tl.where(ii[None, :] < ii[:, None], akk, 0.0)  # strictly lower, row-scaled by beta
        aqk = tl.where(ii[None, :] <= ii[:, None], tl.dot(qr, tl.trans(kinv)), 0.0)  # diagonal included
        off_a = rows[:, None] * (H * BT) + i_h * BT + r * BS + ii[None, :]
        tl.store(Aqk + off_a, aqk.to(Aqk.dtype.element_ty), mask=mr[:, None])
        tl.store(Ti + off_a, _tri_inverse16(akk, BS), mask=mr[:, None])  # X_rr = (I + A_kk,rr)^-1
        for c in tl.static_range(BT // BS):
            off_a = rows[:, None] * (H * BT) + i_h * BT + c * BS + ii[None, :]
            if c < r:  # left of the diagonal: every column before row n, e^{G_n - G_j} <= 1
                rc = start + c * BS + ii
                off_c = rc[:, None] * (H * K) + i_h * K + ck[None, :]
                m_c = (rc < eos)[:, None] & mk[None, :]
                k_c = tl.load(k + off_c, mask=m_c, other=0.0).to(tl.float32)
                if L2NORM:
                    r_c = 1.0 / tl.sqrt(tl.sum(k_c * k_c, axis=1) + EPS)
                    k_c = (k_c * r_c[:, None]).to(dt).to(tl.float32)
                kinv = (k_c * tl.exp(Gn[None, :] - tl.load(G + off_c, mask=m_c, other=0.0))).to(dt)
                akk = tl.dot(kr, tl.trans(kinv)) * b_r[:, None]  # beta_i A_kk[i, j]
                aqk = tl.dot(qr, tl.trans(kinv))
                tl.store(Aqk + off_a, aqk.to(Aqk.dtype.element_ty), mask=mr[:, None])
                tl.store(Ti + off_a, akk, mask=mr[:, None])
            elif c > r:  # right of the diagonal: A_qk is stored as full 64-wide rows
                tl.store(Aqk + off_a, tl.zeros([BS, BS], dtype=Aqk.dtype.element_ty), mask=mr[:, None])
