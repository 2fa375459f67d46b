"""Chunkwise KDA in Triton: forward and backward (docs/model.md §2.5-2.6), chunk C = 64, 16-token sub-tiles.

Kernels (one program per (chunk, head) unless said otherwise):
  gate_cumsum_fwd   g = lower_bound * sigmoid(exp(A_log) (z + dt_bias)) (optional), G = chunk-local cumsum
  intra_blocks_fwd  per (chunk and 16-row block, head): A_qk, A_kk by 16x16 blocks (dense dot products
                    thanks to the bounded gate), the diagonal blocks' inverses, QG = Q Gamma,
                    KD = K e^{G_C - G} and beta Gamma K
  intra_solve_fwd   T~ = (I + A_kk)^-1 by block forward substitution, W = T~ (beta Gamma K), U = T~ (beta V)
                    (CONFIG["split_intra"] = False: the same numbers by one kernel, intra_fwd, 16-row tiles;
                    1.4x slower on the H200: 255 registers, one program per SM)
  state_fwd         one program per (document, head, V-block), serial over chunks:
                    V~ = U - W S; O = (Q Gamma) S + A_qk V~; S <- Diag(Gamma_C) S + ((Gamma_C/Gamma) K)^T V~
  state_bwd         serial in reverse: dV~ = A_qk^T dO + Kd dS';  dS = (Q Gamma)^T dO + Gamma_C dS' - W^T dV~
  grads_chunk       gradients through O, the state update and the WY factors (dB = T~^T dX,
                    dL = -dB X^T), over the states h, dh and the V~ that state_fwd stored; K slices in a loop
  grads_subtiles    per (chunk and 16-row block, head, K slice): gradients through A_qk / A_kk by
                    16x16 blocks on and below the diagonal
  gate_cumsum_bwd   reverse chunk-local cumsum of dG, then the gate derivative

Tensors are flattened to one token axis (a batch of B sequences is B documents of length T), so
one code path serves padded batches and ``cu_seqlens``. The bounded gate (g >= lower_bound >= -5
per token) keeps every exponential inside a 16-token tile below e^80 (fp32 and bf16 safe).
The q/k L2 normalisation (with the query scale folded in) runs inside intra_blocks_fwd as it reads the
rows (CONFIG["fuse_l2norm"]; otherwise one Triton pass of its own, ``triton_l2norm.py``, before the chunk
kernels); the gate is fused into ``gate_cumsum``.
Offsets into [T, H, K] tensors are int32: T * H * max(K, V) must stay below 2^31
(e.g. T <= 174k tokens at H = 96, K = 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakTensorKeyDictionary

from .._backend import interpreter_on
from .gate import L2NORM_EPS
from .inputs import check_kda_inputs
from .triton_l2norm import l2norm_scale_bwd, l2norm_scale_triton

CHUNK = 64  # chunk size (host side)
BT = tl.constexpr(CHUNK)  # the same, visible inside kernels
BS = tl.constexpr(16)  # sub-tile size


# ----------------------------------------------------------------------------- gate + cumsum
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


# ----------------------------------------------------------------------------- intra-chunk forward
@triton.jit
def _tri_inverse16(Ablk, BLK: tl.constexpr):
    """(I + A)^-1 of a 16x16 strictly-lower A: A is nilpotent (A^16 = 0), so the Neumann series is
    finite and factors as  sum_{i<16} (-A)^i = (I - A)(I + A^2)(I + A^4)(I + A^8)  (6 small products
    instead of 15 serial substitution steps)."""
    r = tl.arange(0, BLK)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    X = eye - Ablk
    P = _mm(Ablk, Ablk)  # A^2
    X += _mm(X, P)
    P = _mm(P, P)  # A^4
    X += _mm(X, P)
    P = _mm(P, P)  # A^8
    X += _mm(X, P)
    return X


@triton.jit
def _load_blk(ptr, start, eos, r0, c0, H, i_h):
    """16x16 block (rows r0.., cols c0..) of a per-chunk [64 x 64] matrix stored as [T, H, 64]."""
    r = tl.arange(0, BS)
    rows = start + r0 + r
    return tl.load(
        ptr + rows[:, None] * (H * BT) + i_h * BT + c0 + r[None, :], mask=(rows < eos)[:, None], other=0.0
    )


@triton.jit
def _store_blk(ptr, X, start, eos, r0, c0, H, i_h):
    r = tl.arange(0, BS)
    rows = start + r0 + r
    tl.store(ptr + rows[:, None] * (H * BT) + i_h * BT + c0 + r[None, :], X, mask=(rows < eos)[:, None])


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
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


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
    #    (by 16x16 blocks below the diagonal instead: same numbers, 1.1 ms slower at 1 x 4096 x 96 on the H200)
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
# H200, 1 x 4096 x 96: 0.43 + 0.27 ms against intra_fwd's 1.19 ms (forward 1.33 against 1.84 ms).
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


# ----------------------------------------------------------------------------- serial state pass
# The state slice [K, BV] is held as two halves over K (rows ck1 and ck2), so every tile the loop
# touches is [64, K/2]: few registers per program, several programs resident per SM, and the
# serial chains of different (head, V-block) programs overlap.
@triton.jit
def _state_fwd_step(
    t, S1, S2, QG, KD, G, W, U, Aqk, o, VNo, h, bos, eos, c0, i_h, ck1, ck2, cv, jj,
    H, K: tl.constexpr, V: tl.constexpr, STORE_H: tl.constexpr, SPLIT_O: tl.constexpr, STORE_VN: tl.constexpr,
):  # fmt: skip
    """One chunk: V~ = U - W S; O = (Q Gamma) S + A_qk V~; S <- Gamma_C S + Kd^T V~.
    With STORE_VN the pass writes V~ into `VNo` (for the backward and for the split output); with
    SPLIT_O it forms no O (`output_fwd_kernel` does, in parallel over chunks)."""
    dt = KD.dtype.element_ty
    rows = bos + t * BT + jj
    mr = rows < eos
    mv = cv < V
    if STORE_H:
        base = h + ((c0 + t) * H + i_h).to(tl.int64) * (K * V)
        tl.store(
            base + ck1[:, None] * V + cv[None, :],
            S1.to(h.dtype.element_ty),
            mask=(ck1 < K)[:, None] & mv[None, :],
        )
        tl.store(
            base + ck2[:, None] * V + cv[None, :],
            S2.to(h.dtype.element_ty),
            mask=(ck2 < K)[:, None] & mv[None, :],
        )
    off1 = rows[:, None] * (H * K) + i_h * K + ck1[None, :]
    off2 = rows[:, None] * (H * K) + i_h * K + ck2[None, :]
    m1 = mr[:, None] & (ck1 < K)[None, :]
    m2 = mr[:, None] & (ck2 < K)[None, :]
    off_v = rows[:, None] * (H * V) + i_h * V + cv[None, :]
    m_v = mr[:, None] & mv[None, :]
    S1d, S2d = S1.to(dt), S2.to(dt)
    vn = tl.load(U + off_v, mask=m_v, other=0.0).to(tl.float32)
    vn -= tl.dot(tl.load(W + off1, mask=m1, other=0.0), S1d)  # V~ = U - W S
    vn -= tl.dot(tl.load(W + off2, mask=m2, other=0.0), S2d)
    vnd = vn.to(dt)
    if STORE_VN:
        tl.store(VNo + off_v, vnd.to(VNo.dtype.element_ty), mask=m_v)
    if not SPLIT_O:
        a = tl.load(Aqk + rows[:, None] * (H * BT) + i_h * BT + jj[None, :], mask=mr[:, None], other=0.0).to(
            dt
        )
        out = tl.dot(a, vnd)  # O = A_qk V~ + (Q Gamma) S
        out += tl.dot(tl.load(QG + off1, mask=m1, other=0.0), S1d)
        out += tl.dot(tl.load(QG + off2, mask=m2, other=0.0), S2d)
        tl.store(o + off_v, out.to(o.dtype.element_ty), mask=m_v)
    last = tl.minimum(bos + t * BT + BT, eos) - 1
    Gl1 = tl.load(G + last * (H * K) + i_h * K + ck1, mask=ck1 < K, other=0.0)
    Gl2 = tl.load(G + last * (H * K) + i_h * K + ck2, mask=ck2 < K, other=0.0)
    kd1 = tl.load(KD + off1, mask=m1, other=0.0)
    kd2 = tl.load(KD + off2, mask=m2, other=0.0)
    S1 = S1 * tl.exp(Gl1)[:, None] + tl.dot(tl.trans(kd1), vnd)  # Gamma_C S + Kd^T V~
    S2 = S2 * tl.exp(Gl2)[:, None] + tl.dot(tl.trans(kd2), vnd)
    return S1, S2


@triton.jit
def state_fwd_kernel(
    QG, KD, G, W, U, Aqk, o, VNo, h, h0, ht, cu, chunk_off,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr, FOR_LOOP: tl.constexpr,
    SPLIT_O: tl.constexpr, STORE_VN: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    c0 = tl.load(chunk_off + i_n)
    BKH: tl.constexpr = BK // 2
    ck1 = tl.arange(0, BKH)
    ck2 = BKH + tl.arange(0, BKH)
    cv = i_v * BV + tl.arange(0, BV)
    jj = tl.arange(0, BT)
    m_s1 = (ck1 < K)[:, None] & (cv < V)[None, :]
    m_s2 = (ck2 < K)[:, None] & (cv < V)[None, :]
    S1 = tl.zeros([BKH, BV], dtype=tl.float32)
    S2 = tl.zeros([BKH, BV], dtype=tl.float32)
    if HAS_H0:
        S1 = tl.load(h0 + i_nh * K * V + ck1[:, None] * V + cv[None, :], mask=m_s1, other=0.0).to(tl.float32)
        S2 = tl.load(h0 + i_nh * K * V + ck2[:, None] * V + cv[None, :], mask=m_s2, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    if FOR_LOOP:  # compiled: a for loop, which Triton software-pipelines
        for t in range(NT):
            S1, S2 = _state_fwd_step(
                t, S1, S2, QG, KD, G, W, U, Aqk, o, VNo, h, bos, eos, c0, i_h, ck1, ck2, cv, jj, H, K, V,
                STORE_H, SPLIT_O, STORE_VN,
            )  # fmt: skip
    else:  # the CPU interpreter cannot take a data-dependent range(): the same loop as a while
        t = 0
        while t < NT:
            S1, S2 = _state_fwd_step(
                t, S1, S2, QG, KD, G, W, U, Aqk, o, VNo, h, bos, eos, c0, i_h, ck1, ck2, cv, jj, H, K, V,
                STORE_H, SPLIT_O, STORE_VN,
            )  # fmt: skip
            t += 1
    if STORE_HT:
        tl.store(ht + i_nh * K * V + ck1[:, None] * V + cv[None, :], S1, mask=m_s1)
        tl.store(ht + i_nh * K * V + ck2[:, None] * V + cv[None, :], S2, mask=m_s2)


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


@triton.jit
def _state_bwd_step(
    t, dS1, dS2, QG, KD, G, W, Aqk, do, dh, dvn, bos, eos, c0, i_h, ck1, ck2, cv, jj,
    H, K: tl.constexpr, V: tl.constexpr,
):  # fmt: skip
    """One chunk in reverse: dV~ = A_qk^T dO + Kd dS';  dS = (Q Gamma)^T dO + Gamma_C dS' - W^T dV~."""
    dt = KD.dtype.element_ty
    rows = bos + t * BT + jj
    mr = rows < eos
    mv = cv < V
    base = dh + ((c0 + t) * H + i_h).to(tl.int64) * (K * V)  # dS' of chunk t
    tl.store(
        base + ck1[:, None] * V + cv[None, :],
        dS1.to(dh.dtype.element_ty),
        mask=(ck1 < K)[:, None] & mv[None, :],
    )
    tl.store(
        base + ck2[:, None] * V + cv[None, :],
        dS2.to(dh.dtype.element_ty),
        mask=(ck2 < K)[:, None] & mv[None, :],
    )
    off1 = rows[:, None] * (H * K) + i_h * K + ck1[None, :]
    off2 = rows[:, None] * (H * K) + i_h * K + ck2[None, :]
    m1 = mr[:, None] & (ck1 < K)[None, :]
    m2 = mr[:, None] & (ck2 < K)[None, :]
    off_v = rows[:, None] * (H * V) + i_h * V + cv[None, :]
    m_v = mr[:, None] & mv[None, :]
    last = tl.minimum(bos + t * BT + BT, eos) - 1
    Gl1 = tl.load(G + last * (H * K) + i_h * K + ck1, mask=ck1 < K, other=0.0)
    Gl2 = tl.load(G + last * (H * K) + i_h * K + ck2, mask=ck2 < K, other=0.0)
    kd1 = tl.load(KD + off1, mask=m1, other=0.0)
    kd2 = tl.load(KD + off2, mask=m2, other=0.0)
    a = tl.load(Aqk + rows[:, None] * (H * BT) + i_h * BT + jj[None, :], mask=mr[:, None], other=0.0).to(dt)
    dob = tl.load(do + off_v, mask=m_v, other=0.0).to(dt)
    dv = tl.dot(tl.trans(a), dob)  # dV~ = A_qk^T dO + Kd dS'
    dv += tl.dot(kd1, dS1.to(dt))
    dv += tl.dot(kd2, dS2.to(dt))
    tl.store(dvn + off_v, dv.to(dvn.dtype.element_ty), mask=m_v)
    dvd = dv.to(dt)
    qg1 = tl.load(QG + off1, mask=m1, other=0.0)
    qg2 = tl.load(QG + off2, mask=m2, other=0.0)
    w1 = tl.load(W + off1, mask=m1, other=0.0)
    w2 = tl.load(W + off2, mask=m2, other=0.0)
    dS1 = dS1 * tl.exp(Gl1)[:, None] + tl.dot(tl.trans(qg1), dob) - tl.dot(tl.trans(w1), dvd)
    dS2 = dS2 * tl.exp(Gl2)[:, None] + tl.dot(tl.trans(qg2), dob) - tl.dot(tl.trans(w2), dvd)
    return dS1, dS2


@triton.jit
def state_bwd_kernel(
    QG, KD, G, W, Aqk, do, dh, dvn, dht, dh0, cu, chunk_off,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    c0 = tl.load(chunk_off + i_n)
    BKH: tl.constexpr = BK // 2
    ck1 = tl.arange(0, BKH)
    ck2 = BKH + tl.arange(0, BKH)
    cv = i_v * BV + tl.arange(0, BV)
    jj = tl.arange(0, BT)
    m_s1 = (ck1 < K)[:, None] & (cv < V)[None, :]
    m_s2 = (ck2 < K)[:, None] & (cv < V)[None, :]
    dS1 = tl.zeros([BKH, BV], dtype=tl.float32)
    dS2 = tl.zeros([BKH, BV], dtype=tl.float32)
    if HAS_DHT:
        dS1 = tl.load(dht + i_nh * K * V + ck1[:, None] * V + cv[None, :], mask=m_s1, other=0.0).to(
            tl.float32
        )
        dS2 = tl.load(dht + i_nh * K * V + ck2[:, None] * V + cv[None, :], mask=m_s2, other=0.0).to(
            tl.float32
        )
    NT = tl.cdiv(eos - bos, BT)
    if FOR_LOOP:
        for tt in range(NT):
            dS1, dS2 = _state_bwd_step(
                NT - 1 - tt,
                dS1,
                dS2,
                QG,
                KD,
                G,
                W,
                Aqk,
                do,
                dh,
                dvn,
                bos,
                eos,
                c0,
                i_h,
                ck1,
                ck2,
                cv,
                jj,
                H,
                K,
                V,
            )
    else:
        t = NT - 1
        while t >= 0:  # chunks in reverse order
            dS1, dS2 = _state_bwd_step(
                t, dS1, dS2, QG, KD, G, W, Aqk, do, dh, dvn, bos, eos, c0, i_h, ck1, ck2, cv, jj, H, K, V
            )
            t -= 1
    if STORE_DH0:
        tl.store(dh0 + i_nh * K * V + ck1[:, None] * V + cv[None, :], dS1, mask=m_s1)
        tl.store(dh0 + i_nh * K * V + ck2[:, None] * V + cv[None, :], dS2, mask=m_s2)


# ----------------------------------------------------------------------------- chunk-local gradients
# Two kernels: grads_chunk (one program per chunk and head; the [64 x K] accumulators by K slices of
# BKS, so they fit in registers) completes dA and dA_qk, then grads_subtiles takes their 16x16 blocks.
@triton.jit
def grads_chunk_kernel(
    q, k, v, G, beta, W, U, VN, Ti, h, dh, do, dvn,
    dq, dk, dv, dG, dbeta, dA, dAqk_s, cu, chunk_idx, chunk_off,
    H, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One program per (chunk, head): the K-independent products once, then the K slices in a loop
    (dL summed in registers, no atomics), V~ read back from the forward pass. Writes dv, dA, dA_qk
    and the state-side parts of dq, dk, dG, dbeta (fp32), which grads_subtiles completes."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c = tl.load(chunk_idx + 2 * i_t), tl.load(chunk_idx + 2 * i_t + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    cid = tl.load(chunk_off + i_n) + i_c
    start = bos + i_c * BT
    dt = k.dtype.element_ty
    jj = tl.arange(0, BT)
    rows = start + jj
    mr = rows < eos
    last = tl.minimum(start + BT, eos) - 1
    off_a = rows[:, None] * (H * BT) + i_h * BT + jj[None, :]
    Tm = tl.load(Ti + off_a, mask=mr[:, None], other=0.0).to(dt)
    b_beta = tl.load(beta + rows * H + i_h, mask=mr, other=0.0).to(tl.float32)
    base_s = (cid * H + i_h).to(tl.int64) * (K * V)
    dl = tl.zeros([BT, BT], dtype=tl.float32)  # dL = -(dB_W W^T + dB_U U^T), over all K slices
    daqk = tl.zeros([BT, BT], dtype=tl.float32)  # dA_qk = dO V~^T
    db = tl.zeros([BT], dtype=tl.float32)
    # 1) K-independent: A_qk and the U side of the WY factors
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        off_v = rows[:, None] * (H * V) + i_h * V + cv[None, :]
        m_v = mr[:, None] & (cv < V)[None, :]
        b_dvn = tl.load(dvn + off_v, mask=m_v, other=0.0).to(dt)
        daqk += tl.dot(
            tl.load(do + off_v, mask=m_v, other=0.0).to(dt),
            tl.trans(tl.load(VN + off_v, mask=m_v, other=0.0).to(dt)),
        )  # dO V~^T
        dbu = tl.dot(tl.trans(Tm), b_dvn)  # dB_U = T~^T dU, with dU = dV~
        tl.store(dv + off_v, (dbu * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_v)  # B_U = beta V
        db += tl.sum(dbu * tl.load(v + off_v, mask=m_v, other=0.0).to(tl.float32), axis=1)
        dl -= tl.dot(dbu.to(dt), tl.trans(tl.load(U + off_v, mask=m_v, other=0.0).to(dt)))
    tl.store(dAqk_s + off_a, tl.where(jj[None, :] <= jj[:, None], daqk, 0.0), mask=mr[:, None])
    # 2) per K slice: through O = (Q Gamma) S, the state update and the W side
    for i_k in range((K + BKS - 1) // BKS):
        ks = i_k * BKS + tl.arange(0, BKS)
        mks = ks < K
        off_ks = rows[:, None] * (H * K) + i_h * K + ks[None, :]
        m_ks = mr[:, None] & mks[None, :]
        dqg = tl.zeros([BT, BKS], dtype=tl.float32)  # d(Q Gamma)
        dkd = tl.zeros([BT, BKS], dtype=tl.float32)  # d(Kd), Kd = K e^{G_C - G}
        dw = tl.zeros([BT, BKS], dtype=tl.float32)
        dgam = tl.zeros([BKS], dtype=tl.float32)  # d G_C through Diag(Gamma_C) S
        for i_v in range(tl.cdiv(V, BV)):
            cv = i_v * BV + tl.arange(0, BV)
            mv = cv < V
            m_s = mks[:, None] & mv[None, :]
            S_k = tl.load(h + base_s + ks[:, None] * V + cv[None, :], mask=m_s, other=0.0).to(dt)
            dS_k = tl.load(dh + base_s + ks[:, None] * V + cv[None, :], mask=m_s, other=0.0).to(dt)
            off_v = rows[:, None] * (H * V) + i_h * V + cv[None, :]
            m_v = mr[:, None] & mv[None, :]
            b_do = tl.load(do + off_v, mask=m_v, other=0.0).to(dt)
            b_dvn = tl.load(dvn + off_v, mask=m_v, other=0.0).to(dt)
            b_vn = tl.load(VN + off_v, mask=m_v, other=0.0).to(dt)
            dqg += tl.dot(b_do, tl.trans(S_k))  # dO S^T
            dkd += tl.dot(b_vn, tl.trans(dS_k))  # V~ dS'^T
            dw -= tl.dot(b_dvn, tl.trans(S_k))  # dW = -dV~ S^T  (V~ = U - W S)
            dgam += tl.sum(dS_k.to(tl.float32) * S_k.to(tl.float32), axis=1)
        dbw = tl.dot(tl.trans(Tm), dw.to(dt))  # dB_W = T~^T dW (this K slice)
        dl -= tl.dot(dbw.to(dt), tl.trans(tl.load(W + off_ks, mask=m_ks, other=0.0)))
        b_G = tl.load(G + off_ks, mask=m_ks, other=0.0)
        gam = tl.exp(b_G)
        b_dG = dqg * tl.load(q + off_ks, mask=m_ks, other=0.0).to(tl.float32) * gam  # O = (Q Gamma) S
        tl.store(dq + off_ks, dqg * gam, mask=m_ks)
        b_k = tl.load(k + off_ks, mask=m_ks, other=0.0).to(tl.float32)
        t_w = dbw * gam  # B_W = beta Gamma K
        db += tl.sum(t_w * b_k, axis=1)
        b_dG += t_w * b_k * b_beta[:, None]
        Gl = tl.load(G + last * (H * K) + i_h * K + ks, mask=mks, other=0.0)
        ekd = tl.where(m_ks, tl.exp(Gl[None, :] - b_G), 0.0)
        tl.store(dk + off_ks, t_w * b_beta[:, None] + dkd * ekd, mask=m_ks)
        x = dkd * b_k * ekd
        b_dG -= x
        dgam = dgam * tl.exp(Gl) + tl.sum(x, axis=0)
        b_dG += tl.where((rows == last)[:, None], dgam[None, :], 0.0)  # G_C is the chunk's last row
        tl.store(dG + off_ks, b_dG, mask=m_ks)
    tl.store(dA + off_a, tl.where(jj[None, :] < jj[:, None], dl, 0.0), mask=mr[:, None])  # strictly lower
    tl.store(dbeta + rows * H + i_h, db, mask=mr)


@triton.jit
def grads_subtiles_kernel(
    q, k, G, beta, dq, dk, dG, dbeta, dA, dAqk_s, dq_out, dk_out, cu, chunk_idx,
    H, K: tl.constexpr, BKS: tl.constexpr,
):  # fmt: skip
    """The A_kk / A_qk gradients by 16-token sub-tiles: one program per (chunk and 16-row block r, head,
    K slice) takes the 16x16 blocks that touch rows r: as rows (blocks (r, c), c <= r) and as columns
    (blocks (c, r), c >= r). Each program owns the rows of block r: it reads dq, dk, dG (fp32, from
    grads_chunk) and writes the final dq, dk into dq_out, dk_out (the inputs' dtype) and dG in place;
    no 64-row exponent tiles, no work on the blocks above the diagonal."""
    i_tr, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_t, r = i_tr // (BT // BS), i_tr % (BT // BS)
    i_n, i_c = tl.load(chunk_idx + 2 * i_t), tl.load(chunk_idx + 2 * i_t + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    start = bos + i_c * BT
    if start + r * BS < eos:  # blocks past the end of a short last chunk have nothing to do
        dt = k.dtype.element_ty
        ks = i_k * BKS + tl.arange(0, BKS)
        mks = ks < K
        ii = tl.arange(0, BS)
        rows = start + r * BS + ii
        mr = rows < eos
        off_r = rows[:, None] * (H * K) + i_h * K + ks[None, :]
        m_r = mr[:, None] & mks[None, :]
        G_r = tl.load(G + off_r, mask=m_r, other=0.0)
        k_r = tl.load(k + off_r, mask=m_r, other=0.0).to(tl.float32)
        b_r = tl.load(beta + rows * H + i_h, mask=mr, other=0.0).to(tl.float32)
        n = start + r * BS  # reference point of the row side: first row of block r
        m = tl.minimum(start + r * BS + BS, eos) - 1  # of the column side: last row of block r
        Gn = tl.load(G + n * (H * K) + i_h * K + ks, mask=mks, other=0.0)
        Gm = tl.load(G + m * (H * K) + i_h * K + ks, mask=mks, other=0.0)
        # row side: sum_j dA_ij K_j e^{G_i - G_j} = e^{G_i - G_n} sum_j dA_ij (K_j e^{G_n - G_j}), j in blocks c <= r
        acc_k = tl.zeros([BS, BKS], dtype=tl.float32)
        acc_q = tl.zeros([BS, BKS], dtype=tl.float32)
        for c in tl.static_range(BT // BS):
            if c <= r:
                rc = start + c * BS + ii
                mc = rc < eos
                off_c = rc[:, None] * (H * K) + i_h * K + ks[None, :]
                m_c = mc[:, None] & mks[None, :]
                # e^{G_n - G_j} <= 1 before block r, < e^80 inside it (bounded gate); padded rows: k = 0
                kinv = (
                    tl.load(k + off_c, mask=m_c, other=0.0).to(tl.float32)
                    * tl.exp(Gn[None, :] - tl.load(G + off_c, mask=m_c, other=0.0))
                ).to(dt)
                off_a = rows[:, None] * (H * BT) + i_h * BT + c * BS + ii[None, :]
                acc_k += tl.dot(tl.load(dA + off_a, mask=mr[:, None], other=0.0).to(dt), kinv)
                acc_q += tl.dot(tl.load(dAqk_s + off_a, mask=mr[:, None], other=0.0).to(dt), kinv)
        e_r = tl.exp(tl.where(m_r, G_r - Gn[None, :], float("-inf")))
        t1 = acc_k * e_r  # d(raw A_kk row) K side, before beta
        t2 = acc_q * e_r
        tl.atomic_add(dbeta + rows * H + i_h, tl.sum(k_r * t1, axis=1), mask=mr)  # A_kk = beta_i (...)
        # column side: sum_i dA_ij X_i e^{G_i - G_j} = e^{G_m - G_j} sum_i dA_ij (X_i e^{G_i - G_m}), i in blocks c >= r
        acc_c = tl.zeros([BS, BKS], dtype=tl.float32)
        for c in tl.static_range(BT // BS):
            if c >= r:
                rc = start + c * BS + ii
                mc = rc < eos
                off_c = rc[:, None] * (H * K) + i_h * K + ks[None, :]
                m_c = mc[:, None] & mks[None, :]
                # e^{G_i - G_m} <= 1 after block r, < e^80 inside it; padded rows: 0
                em = tl.exp(
                    tl.where(m_c, tl.load(G + off_c, mask=m_c, other=0.0) - Gm[None, :], float("-inf"))
                )
                km = (tl.load(k + off_c, mask=m_c, other=0.0).to(tl.float32) * em).to(dt)
                qm = (tl.load(q + off_c, mask=m_c, other=0.0).to(tl.float32) * em).to(dt)
                b_c = tl.load(beta + rc * H + i_h, mask=mc, other=0.0).to(tl.float32)
                off_a = rc[:, None] * (H * BT) + i_h * BT + r * BS + ii[None, :]
                dA_c = (tl.load(dA + off_a, mask=mc[:, None], other=0.0) * b_c[:, None]).to(dt)
                dAq_c = tl.load(dAqk_s + off_a, mask=mc[:, None], other=0.0).to(dt)
                acc_c += tl.dot(tl.trans(dA_c), km) + tl.dot(tl.trans(dAq_c), qm)
        t3 = acc_c * tl.exp(tl.where(m_r, Gm[None, :] - G_r, float("-inf")))
        q_r = tl.load(q + off_r, mask=m_r, other=0.0).to(tl.float32)
        dq_r = tl.load(dq + off_r, mask=m_r, other=0.0) + t2
        dk_r = tl.load(dk + off_r, mask=m_r, other=0.0) + t1 * b_r[:, None] + t3
        tl.store(dq_out + off_r, dq_r.to(dq_out.dtype.element_ty), mask=m_r)
        tl.store(dk_out + off_r, dk_r.to(dk_out.dtype.element_ty), mask=m_r)
        tl.store(
            dG + off_r,
            tl.load(dG + off_r, mask=m_r, other=0.0) + k_r * (t1 * b_r[:, None] - t3) + q_r * t2,
            mask=m_r,
        )


# ----------------------------------------------------------------------------- host side
def _tables_from_lengths(lens, device):
    """(cu [N+1], chunk_idx [NT, 2] = (document, chunk in document), chunk_off [N+1], NT, longest in chunks)."""
    nts = [(n + CHUNK - 1) // CHUNK for n in lens]
    idx = [(d, c) for d, nt in enumerate(nts) for c in range(nt)]
    cu, off = [0], [0]
    for n, nt in zip(lens, nts, strict=True):
        cu.append(cu[-1] + n)
        off.append(off[-1] + nt)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True)
    return as_i32(cu), as_i32(idx).reshape(-1, 2), as_i32(off), len(idx), max(nts, default=0)


# The 60-odd KDA layers of one forward pass share one cu_seqlens tensor: its tables are built once
# (one host read of cu_seqlens) and reused while that tensor lives and is not modified in place.
_TABLES = WeakTensorKeyDictionary()


def _chunk_tables(B, T, cu_seqlens, device):
    if cu_seqlens is None:  # B sequences of length T: no device read at all
        return _tables_from_lengths([T] * B, device)
    hit = _TABLES.get(cu_seqlens)
    if hit is not None and hit[0] == (cu_seqlens._version, device):
        return hit[1]
    cs = cu_seqlens.tolist()
    tables = _tables_from_lengths([b - a for a, b in zip(cs[:-1], cs[1:], strict=True)], device)
    _TABLES[cu_seqlens] = ((cu_seqlens._version, device), tables)
    return tables


# launch configuration; BV = value-block width of the serial state kernels (more programs when smaller)
# (3 pipeline stages of the serial loops need 234 KB of shared memory, over the 227 KB of an H100/H200;
# 2 stages prefetch the next chunk's tiles (1.290 vs 1.314 ms forward at 1 x 4096 x 96, 19:35 sweep),
# though their 152 KB of shared memory leave one state program per SM)
# maxnreg_* caps registers per thread (None: the compiler's choice).
# Chosen by the launch sweeps of 2026-11-29 17:18 and 19:30 UTC on the H200 (benchmarks/results/kernels.md).
CONFIG = {
    # fuse_l2norm: q/k L2 norm inside intra_blocks_fwd instead of a pass of its own (needs split_intra;
    # 1.158 vs 1.288 ms forward at 1 x 4096 x 96, 20:07 sweep)
    "fuse_l2norm": True,
    "warps_gate": 8,  # gate_cumsum_fwd (19:47 sweep: 1.300 vs 1.305 ms at 4 warps, 1.322 at 2)
    # (gate + cumsum inside intra_blocks_fwd too was timed at 2.21 ms forward on 20:07 and removed)
    "BV": 64, "warps_state": 4, "stages_state": 2,  # state_fwd (BV 128 at 8 warps: one program per head)
    "BV_intra": 64,  # U = T~ (beta V) by V blocks of this width in intra_solve_fwd / intra_fwd
    # intra_blocks_fwd + intra_solve_fwd (split_intra; False: the single intra_fwd kernel, 8 warps)
    "split_intra": True, "warps_blocks": 4, "warps_solve": 4, "warps_intra": 8, "maxnreg_intra": None,
    "split_output": False, "BV_out": 64, "warps_out": 4,  # split: O by a parallel kernel after the serial pass
    "BV_bwd": 64, "warps_state_bwd": 4, "stages_state_bwd": 1,  # state_bwd
    "BKS": 16, "BV_grads": 64, "warps_grads": 4, "stages_grads": 2, "maxnreg_grads": None,  # grads_chunk
    "BKS_tiles": 32, "warps_subtiles": 2,  # grads_subtiles
}  # fmt: skip


def _maxnreg(key):
    """The register cap as a launch option (compiled kernels only; the interpreter takes none)."""
    return {} if CONFIG[key] is None or interpreter_on() else {"maxnreg": CONFIG[key]}


def _blocks(K, V, key="BV"):
    BK = max(32, triton.next_power_of_2(K))  # the state kernels split BK into two halves of >= 16
    BV = max(16, min(CONFIG[key], triton.next_power_of_2(V)))
    if BK > 256:
        raise ValueError(
            f"chunk_kda (triton): head dim K={K} is above the supported 256; use backend='torch'"
        )
    return BK, BV


class GateCumsum(torch.autograd.Function):
    """G = chunk-local cumsum of g (or of the gate computed from the raw logit z), fp32."""

    @staticmethod
    def forward(ctx, z, A_log, dt_bias, cu, tables, use_gate, lower_bound):
        chunk_idx, _, NT, _ = tables
        _, TT, H, K = z.shape
        BK = max(16, triton.next_power_of_2(K))
        G = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        has_bias = dt_bias is not None
        dummy = z
        gate_cumsum_fwd_kernel[(NT, H)](
            z, A_log if use_gate else dummy, dt_bias if has_bias else dummy, G, cu, chunk_idx,
            H=H, K=K, BK=BK, USE_GATE=use_gate, HAS_BIAS=has_bias, LB=float(lower_bound or 0.0),
            num_warps=CONFIG["warps_gate"],
        )  # fmt: skip
        ctx.save_for_backward(z, A_log if use_gate else None, dt_bias, cu, chunk_idx)
        ctx.meta = (NT, use_gate, has_bias, float(lower_bound or 0.0))
        return G

    @staticmethod
    def backward(ctx, dG):
        z, A_log, dt_bias, cu, chunk_idx = ctx.saved_tensors
        NT, use_gate, has_bias, lb = ctx.meta
        _, TT, H, K = z.shape
        BK = max(16, triton.next_power_of_2(K))
        dz = torch.empty_like(z)
        param_grads = use_gate and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        dA = torch.zeros(H, dtype=torch.float32, device=z.device) if param_grads else dz
        ddt = torch.zeros(H, K, dtype=torch.float32, device=z.device) if param_grads and has_bias else dz
        gate_cumsum_bwd_kernel[(NT, H)](
            dG.contiguous(), z, A_log if use_gate else z, dt_bias if has_bias else z, dz, dA, ddt, cu, chunk_idx,
            H=H, K=K, BK=BK, USE_GATE=use_gate, HAS_BIAS=has_bias, LB=lb, PARAM_GRADS=param_grads, num_warps=4,
        )  # fmt: skip
        dA_log = dA.reshape(A_log.shape).to(A_log.dtype) if param_grads and ctx.needs_input_grad[1] else None
        ddt = (
            ddt.reshape(dt_bias.shape).to(dt_bias.dtype)
            if param_grads and has_bias and ctx.needs_input_grad[2]
            else None
        )
        return dz, dA_log, ddt, None, None, None, None


class ChunkKDATriton(torch.autograd.Function):
    """Core: q (normalised, scaled), k, v, G (chunk-local cumsum, fp32), beta -> (o, final state)."""

    @staticmethod
    def forward(ctx, q, k, v, G, beta, h0, cu, tables, output_final_state, l2norm_scale=None):
        """With l2norm_scale (a float), q and k are raw: intra_blocks_fwd normalises them (q scaled) and
        the backward applies the normalisation's derivative (CONFIG fuse_l2norm)."""
        chunk_idx, chunk_off, NT, _ = tables
        _, TT, H, K = q.shape
        V = v.shape[-1]
        N = cu.numel() - 1
        BK, BV = _blocks(K, V)
        BVI = _blocks(K, V, "BV_intra")[1]
        dev, dt = q.device, q.dtype
        Aqk = torch.empty(1, TT, H, CHUNK, dtype=dt, device=dev)
        Ti = torch.empty(1, TT, H, CHUNK, dtype=torch.float32, device=dev)
        W = torch.empty(1, TT, H, K, dtype=dt, device=dev)
        U = torch.empty(1, TT, H, V, dtype=dt, device=dev)
        QG, KD = torch.empty_like(W), torch.empty_like(W)
        need_grad = any(ctx.needs_input_grad)
        fused_norm = l2norm_scale is not None
        if fused_norm and not CONFIG["split_intra"]:
            raise ValueError("chunk_kda (triton): the fused q/k L2 norm needs CONFIG['split_intra']")
        q_raw, k_raw = q, k
        rq = rk = None
        if fused_norm and need_grad:  # the normalised q, k and the norms, for the backward
            q, k = torch.empty_like(q_raw), torch.empty_like(k_raw)
            rq, rk = (torch.empty(1, TT, H, dtype=torch.float32, device=dev) for _ in range(2))
        if CONFIG["split_intra"]:  # the same numbers by two kernels with fewer registers each
            Tb = torch.empty(1, TT, H, CHUNK, dtype=dt, device=dev)  # T~ in the inputs' dtype (Ti: scratch)
            intra_blocks_fwd_kernel[(NT * (CHUNK // 16), H)](
                q_raw, k_raw, G, beta, Aqk, Ti, QG, KD, W, q, k, rq if rq is not None else G,
                rk if rk is not None else G, float(l2norm_scale or 1.0), cu, chunk_idx, H=H, K=K, BK=BK,
                L2NORM=fused_norm, STORE_QK=fused_norm and need_grad, EPS=L2NORM_EPS,
                num_warps=CONFIG["warps_blocks"],
            )  # fmt: skip
            intra_solve_fwd_kernel[(NT, H)](
                v, beta, Ti, Tb, W, U, cu, chunk_idx, H=H, K=K, V=V, BK=BK, BV=BVI,
                num_warps=CONFIG["warps_solve"],
            )  # fmt: skip
            Ti = Tb  # what the backward reads (it rounds T~ to the inputs' dtype in any case)
        else:
            intra_fwd_kernel[(NT, H)](
                q, k, v, G, beta, Aqk, Ti, W, U, QG, KD, cu, chunk_idx, H=H, K=K, V=V, BK=BK, BV=BVI,
                num_warps=CONFIG["warps_intra"], **_maxnreg("maxnreg_intra"),
            )  # fmt: skip
        split = bool(CONFIG["split_output"])
        store_vn = split or need_grad  # V~ kept for the split output or for the gradient kernel
        o = torch.empty_like(v)
        vn = torch.empty_like(v) if store_vn else None
        h = torch.empty(NT, H, K, V, dtype=dt, device=dev) if (need_grad or split) else o
        ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else o
        state_fwd_kernel[(triton.cdiv(V, BV), N * H)](
            QG, KD, G, W, U, Aqk, o, vn if store_vn else o, h, h0 if h0 is not None else o, ht, cu, chunk_off,
            H=H, K=K, V=V, BK=BK, BV=BV, HAS_H0=h0 is not None, STORE_HT=output_final_state,
            STORE_H=need_grad or split, FOR_LOOP=not interpreter_on(), SPLIT_O=split, STORE_VN=store_vn,
            num_warps=CONFIG["warps_state"], num_stages=CONFIG["stages_state"],
        )  # fmt: skip
        if split:
            BVO = max(16, min(CONFIG["BV_out"], triton.next_power_of_2(V)))
            output_fwd_kernel[(NT, H, triton.cdiv(V, BVO))](
                QG, h, Aqk, vn, o, cu, chunk_idx, chunk_off, H=H, K=K, V=V, BK=BK, BV=BVO,
                num_warps=CONFIG["warps_out"],
            )  # fmt: skip
        if need_grad:
            norm = (q_raw, k_raw, rq, rk) if fused_norm else ()
            ctx.save_for_backward(
                q, k, v, G, beta, W, U, QG, KD, Aqk, Ti, h, vn, cu, chunk_idx, chunk_off, *norm
            )
            ctx.meta = (NT, h0 is not None, l2norm_scale)
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, G, beta, W, U, QG, KD, Aqk, Ti, h, vn, cu, chunk_idx, chunk_off, *norm = ctx.saved_tensors
        NT, has_h0, l2norm_scale = ctx.meta
        _, TT, H, K = q.shape
        V = v.shape[-1]
        N = cu.numel() - 1
        BK, BV = _blocks(K, V, "BV_bwd")
        BVG = _blocks(K, V, "BV_grads")[1]
        dev = q.device
        do = do.contiguous()
        dh = torch.empty_like(h)
        dvn = torch.empty_like(v)
        dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if has_h0 else dvn
        state_bwd_kernel[(triton.cdiv(V, BV), N * H)](
            QG, KD, G, W, Aqk, do, dh, dvn, dht.contiguous() if dht is not None else do, dh0, cu, chunk_off,
            H=H, K=K, V=V, BK=BK, BV=BV, HAS_DHT=dht is not None, STORE_DH0=has_h0,
            FOR_LOOP=not interpreter_on(), num_warps=CONFIG["warps_state_bwd"],
            num_stages=CONFIG["stages_state_bwd"],
        )  # fmt: skip
        f32 = dict(dtype=torch.float32, device=dev)
        dq, dk, dG = (torch.empty(1, TT, H, K, **f32) for _ in range(3))
        dv = torch.empty_like(v)
        dAqk = torch.empty(1, TT, H, CHUNK, **f32)
        dbeta = torch.empty(1, TT, H, **f32)
        dA = torch.empty(1, TT, H, CHUNK, **f32)
        BKS = min(BK, CONFIG["BKS"])
        grads_chunk_kernel[(NT, H)](
            q, k, v, G, beta, W, U, vn, Ti, h, dh, do, dvn, dq, dk, dv, dG, dbeta, dA, dAqk,
            cu, chunk_idx, chunk_off, H=H, K=K, V=V, BKS=BKS, BV=BVG, num_warps=CONFIG["warps_grads"],
            num_stages=CONFIG["stages_grads"], **_maxnreg("maxnreg_grads"),
        )  # fmt: skip
        BKT = min(BK, CONFIG["BKS_tiles"])
        dq_out, dk_out = torch.empty_like(q), torch.empty_like(k)  # the final dq, dk
        grads_subtiles_kernel[(NT * (CHUNK // 16), H, triton.cdiv(K, BKT))](
            q, k, G, beta, dq, dk, dG, dbeta, dA, dAqk, dq_out, dk_out, cu, chunk_idx, H=H, K=K, BKS=BKT,
            num_warps=CONFIG["warps_subtiles"],
        )  # fmt: skip
        if norm:  # through the fused normalisation: dx = s r (dy - x r^2 (x . dy))
            q_raw, k_raw, rq, rk = norm
            dq_out = l2norm_scale_bwd(q_raw, rq, dq_out, l2norm_scale)
            dk_out = l2norm_scale_bwd(k_raw, rk, dk_out, 1.0)
        return (
            dq_out, dk_out, dv, dG, dbeta.to(beta.dtype),
            dh0 if has_h0 else None, None, None, None, None,
        )  # fmt: skip


def chunk_kda_triton(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0,
):  # fmt: skip
    """Triton chunk KDA; same contract as ``chunk_kda``. Needs the bounded ("safe") gate."""
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, "chunk_kda")
    if chunk_size != CHUNK:
        raise ValueError(
            f"chunk_kda (triton): chunk_size must be {CHUNK}, got {chunk_size}; use backend='torch'"
        )
    if lower_bound is None or not (-5.0 <= lower_bound < 0):
        raise ValueError(
            "chunk_kda (triton): the kernel's dense 16-token diagonal tiles need the safe gate, "
            f"-5 <= lower_bound < 0 (got {lower_bound}); use backend='torch' for the unbounded gate"
        )
    if use_gate_in_kernel and A_log is None:
        raise ValueError("chunk_kda: use_gate_in_kernel=True needs A_log [H]")
    B, T, H, K = q.shape
    V = v.shape[-1]
    cu, *tables = _chunk_tables(B, T, cu_seqlens, q.device)
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:]).contiguous()
    scale = K**-0.5 if scale is None else scale
    fuse_norm = use_qk_l2norm_in_kernel and CONFIG["fuse_l2norm"] and CONFIG["split_intra"]
    if fuse_norm:  # intra_blocks_fwd normalises q and k as it reads them
        qs = q
    elif use_qk_l2norm_in_kernel:  # one Triton pass each (forward and backward), the scale folded in
        qs, k = l2norm_scale_triton(q, scale), l2norm_scale_triton(k, 1.0)
    else:
        qs = q * scale if scale != 1.0 else q
    G = GateCumsum.apply(
        flat(g), A_log.float() if use_gate_in_kernel else None,
        dt_bias.float() if (use_gate_in_kernel and dt_bias is not None) else None,
        cu, tables, bool(use_gate_in_kernel), lower_bound,
    )  # fmt: skip
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o, ht = ChunkKDATriton.apply(
        flat(qs), flat(k), flat(v), G, flat(beta), h0, cu, tables, bool(output_final_state),
        float(scale) if fuse_norm else None,
    )  # fmt: skip
    return o.reshape(B, T, H, V), ht
