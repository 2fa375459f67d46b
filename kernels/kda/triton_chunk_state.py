"""Chunk KDA, stage 4: the serial inter-chunk state passes, one program per (document, head, V-block).

state_fwd   V~ = U - W S; O = (Q Gamma) S + A_qk V~; S <- Diag(Gamma_C) S + ((Gamma_C/Gamma) K)^T V~
state_bwd   in reverse: dV~ = A_qk^T dO + Kd dS';  dS = (Q Gamma)^T dO + Gamma_C dS' - W^T dV~
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_chunk_tiles import BT


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
