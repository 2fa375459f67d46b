"""The routed experts under expert_precision mxfp4 in Triton: MXFP4 expert weights read as their bytes, MXFP8
activations, both dequantised inside the kernels (docs/model.md §5.3, §9.8; OCP Microscaling v1.0).

The formula, with fq8 the MXFP8 round trip of k3rl/model/mx.py (blocks of 32 along the contraction dim),
W the values of the MXFP4 bytes (k3rl/model/mxfp4.py) and dt the compute dtype (the engine's read dtype or
autocast's):

    h_r = dt( fq8(a_r) W2[e]^T ),   a_r = dt( SiTU-GLU( dt(fq8(z_t) W1[e]^T), dt(fq8(z_t) W3[e]^T) ) )
    u_t = dt( sum_{j in expert order} fp32(p[t, j]) * fp32(h_{t k + j}) )      (route r = t k + j, e = idx[t, j])

Its PyTorch reference is the engine's reference path, RoutedExperts.forward on held MXFP4 bytes
(k3rl/model/moe.py: latent_experts_loop over mxfp4.dequantize'd weights with mx.fake_mxfp8 on z and on the
SiTU-GLU output); the kernels make each of its roundings at the same place:
- the MXFP8 quantiser is mx.mxfp8_quantize bit for bit: X = floor(log2 amax) - 8 clamped to [-127, 127]
  (-127 for a zero block, E8M0's NaN byte 255 for a block holding inf or NaN), each element x / 2^X rounded to
  the nearest E4M3 value, ties to even, saturating to +-448; floor(log2 .) is read from the float's exponent
  bits and the rounding to an integer is fp32's own (r + 2^23 - 2^23 rounds half to even for 0 <= r < 2^22);
- dequantising (E4M3 or E2M1 element times 2^(s - 127)) is exact in fp32, then cast to dt as .to(dt) does;
- the GEMMs multiply dt values and sum in fp32, rounded to dt once (as a bf16 matmul does); SiTU-GLU is an
  fp32 island rounded to dt; the combine sums fp32 products in the reference's order (a token's routes sorted
  by expert, ties by slot: the order of latent_experts_loop's index_add), launched without FMA contraction.
What the kernels cannot share with the reference is the order of the fp32 sums inside a GEMM: a result
lying within a few fp32 ulps of a dt rounding boundary can round the other way (in bf16 about one value in
10^4-10^5), and SiTU's tanh / sigmoid may differ from torch's in the last fp32 bits.

Two paths, chosen by the number of routes R = N k:
- decode (few routes, 4 R <= E): `mx_decode_gate_up_kernel` (grid R x cdiv(f, BLOCK_F)) quantises z_t on the
  fly, reads its expert's rows of W1 / W3 bytes in place and writes fq8(a_r) in dt; `mx_decode_down_kernel`
  (grid N x cdiv(l, BLOCK_L)) reads W2 bytes in place and sums a token's k outputs in fp32;
- grouped (prefill and larger batches): z quantised once to MXFP8 bytes (`mxfp8_quantize_kernel`); routes
  sorted into per-expert groups of BLOCK_M-row tiles; `mx_grouped_gate_up_kernel` (a tile's rows gathered
  from the token rows of the MXFP8 z, tl.dot on dequantised tiles, SiTU-GLU and the MXFP8 quantisation of a
  in its epilogue, stored as bytes), `mx_grouped_down_kernel`, then `mx_combine_kernel`.
No host synchronisation in either path (a CUDA graph can capture them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only
from ..situ.triton_situ import _tanh
from . import permute_by_expert

GROUP = 32  # values per E8M0 scale (MXFP4 weights and MXFP8 activations alike)
G32 = tl.constexpr(GROUP)  # the same, for the kernels
# decode: rows of W1/W3 a program covers (a multiple of 32: its a rows are quantised in whole blocks) and the
# reduction step over l; rows of W2 a program covers and the reduction step over f
BLOCK_F1, BLOCK_L1 = 32, 128
BLOCK_L2, BLOCK_F2 = 32, 128
# grouped: rows of a tile (each expert's group is padded to a multiple of it), columns, reduction step
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64
# the quantiser: columns a program covers
BLOCK_Q = 256
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
NO_FMA = dict(enable_fp_fusion=False)  # p * h then +, two roundings, as the reference's combine


@triton.jit
def _exp2i(k):
    """2^k in fp32 for int32 k in [-149, 127], built from its bits (exact, subnormals included)."""
    normal = ((k + 127) << 23).to(tl.float32, bitcast=True)  # biased exponent k + 127, mantissa 0
    sub = (1 << tl.minimum(tl.maximum(k + 149, 0), 22)).to(tl.float32, bitcast=True)  # 2^-149 .. 2^-127
    return tl.where(k >= -126, normal, sub)


@triton.jit
def _floor_log2(a):
    """floor(log2 a) of a normal positive fp32 a, from its exponent bits (0 and subnormals give -127)."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _round_e4m3(y):
    """mx.round_e4m3: y rounded to the nearest E4M3 value, ties to even, saturating to +-448, sign kept."""
    a = tl.abs(y)
    step = tl.maximum(_floor_log2(a), -6) - 3  # E4M3's spacing in a's binade is 2^(E-3); 2^-9 among subnormals
    r = a * _exp2i(-step)  # |y| / spacing, in [0, 16) for a block's values: exact
    r = (r + 8388608.0) - 8388608.0  # to an integer, half to even: fp32's spacing is 1 in [2^23, 2^24)
    q = tl.minimum(r * _exp2i(step), 448.0, propagate_nan=tl.PropagateNan.ALL)  # saturate (NaN stays NaN)
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31  # y's sign bit (copysign: -0 stays -0)
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp8_blocks(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """mx.mxfp8_quantize of x [ROWS, COLS] fp32 (COLS % 32 == 0) in blocks of 32 along the columns:
    (E4M3 values q [ROWS, COLS/32, 32] as fp32, shared exponent X [ROWS, COLS/32] int32, finite [ROWS, COLS/32])."""
    xb = tl.reshape(x, (ROWS, COLS // 32, 32))
    amax = tl.max(tl.abs(xb), axis=2)
    # a block holding inf or NaN: an exponent field of all ones (tl.max need not carry a NaN through)
    special = tl.max((((tl.abs(xb).to(tl.int32, bitcast=True) >> 23) & 0xFF) == 0xFF).to(tl.int32), axis=2)
    finite = special == 0
    X = tl.minimum(tl.maximum(_floor_log2(amax) - 8, -127), 127)  # floor(log2 amax) - emax(E4M3), clamped
    X = tl.where(finite, X, 0)  # any finite X for a NaN block's elements (its scale byte is 255)
    q = _round_e4m3(xb * _exp2i(-X)[:, :, None])
    return q, X, finite


@triton.jit
def _mxfp8_round_trip(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fq8(x): x [ROWS, COLS] fp32 -> the dequantised MXFP8 values q 2^X (exact in fp32), NaN for a NaN block."""
    q, X, finite = _mxfp8_blocks(x, ROWS, COLS)
    v = tl.where(finite[:, :, None], q * _exp2i(X)[:, :, None], float("nan"))
    return tl.reshape(v, (ROWS, COLS))


@triton.jit
def _e4m3_byte(q):
    """The E4M3 byte of an E4M3 value q (fp32): sign | exponent (bias 7) | 3 mantissa bits; NaN -> 0x7F."""
    bits = q.to(tl.int32, bitcast=True)
    a = tl.abs(q)
    E = _floor_log2(a)
    normal = ((E + 7) << 3) | ((a.to(tl.int32, bitcast=True) >> 20) & 7)  # the top 3 mantissa bits
    sub = (a * 512.0).to(tl.int32)  # k 2^-9, k = 0..7
    byte = tl.where(E >= -6, normal, sub)
    byte = tl.where(a != a, 0x7F, byte)
    return byte | ((bits >> 24) & 0x80)


@triton.jit
def _e4m3_value(b):
    """fp32 value of E4M3 bytes b (int32): (8 + m) 2^(e - 10) for e >= 1, m 2^-9 for e = 0; S.1111.111 is NaN."""
    e = (b >> 3) & 0xF
    m = b & 7
    mag = tl.where(e == 0, m, m + 8).to(tl.float32) * _exp2i(tl.maximum(e, 1) - 10)
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _e8m0(s):
    """2^(s - 127) of E8M0 scale bytes s (int32); byte 255 is NaN."""
    return tl.where(s == 255, float("nan"), _exp2i(s - 127))


@triton.jit
def _mxfp4_values(packed, scale, rows, mr, cols, mc, N: tl.constexpr):
    """mxfp4.dequantize of W[rows, cols] (fp32, exact) from one expert's weight_packed [R, N/2] and weight_scale
    [R, N/32] (pointers at the expert): value 2j in the low nibble of byte j; a code is sign (bit 3) |
    exponent x (bits 2-1) | mantissa m (bit 0), E2M1 magnitude (2 + m) 2^(x - 2) for x >= 1, m / 2 for x = 0."""
    r = rows.to(tl.int64)[:, None]
    m = mr[:, None] & mc[None, :]
    byte = tl.load(packed + r * (N // 2) + (cols // 2)[None, :], mask=m, other=0).to(tl.int32)
    code = (byte >> ((cols % 2) * 4)[None, :]) & 0xF
    s = tl.load(scale + r * (N // G32) + (cols // G32)[None, :], mask=m, other=127).to(tl.int32)
    x = (code >> 1) & 3
    mant = code & 1
    mag = tl.where(x == 0, mant, mant + 2).to(tl.float32) * _exp2i(tl.maximum(x, 1) - 2)
    mag = tl.where((code & 8) != 0, -mag, mag)
    return mag * _exp2i(s - 127)  # E2M1 x 2^(s - 127): exact


@triton.jit
def mxfp8_quantize_kernel(x, el, sc, N: tl.constexpr, BLOCK: tl.constexpr):
    """One row's BLOCK columns of x [rows, N] -> E4M3 bytes el [rows, N] and E8M0 bytes sc [rows, N/32]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    v = tl.load(x + row * N + cols, mask=m, other=0.0).to(tl.float32)
    q, X, finite = _mxfp8_blocks(v[None, :], 1, BLOCK)
    tl.store(el + row * N + cols[None, :], tl.reshape(_e4m3_byte(q), (1, BLOCK)).to(tl.uint8), mask=m[None, :])
    blocks = tl.program_id(1) * (BLOCK // G32) + tl.arange(0, BLOCK // G32)
    tl.store(sc + row * (N // G32) + blocks[None, :], tl.where(finite, X + 127, 255).to(tl.uint8),
             mask=(blocks < N // G32)[None, :])  # fmt: skip


@triton.jit
def mx_decode_gate_up_kernel(z, idx, w1p, w1s, w3p, w3s, a, B1: tl.constexpr, B2: tl.constexpr, K: tl.constexpr,
                             L: tl.constexpr, F: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr):  # fmt: skip
    """Route r = t k + j, rows of f: a_r = fq8(dt(SiTU-GLU(dt(fq8(z_t) W1[e]^T), dt(fq8(z_t) W3[e]^T)))) in dt."""
    r = tl.program_id(0)
    t = r // K
    e = tl.load(idx + r).to(tl.int64)  # its expert
    dt = a.dtype.element_ty
    rows = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # BLOCK_F % 32 == 0: whole blocks of a_r
    mf = rows < F
    acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        ml = cols < L
        zt = tl.load(z + t.to(tl.int64) * L + cols, mask=ml, other=0.0).to(tl.float32)
        zq = _mxfp8_round_trip(zt[None, :], 1, BLOCK_L).to(dt).to(tl.float32)  # fq8(z_t) in dt, [1, BLOCK_L]
        b1 = _mxfp4_values(w1p + e * (F * L // 2), w1s + e * (F * L // G32), rows, mf, cols, ml, L)
        b3 = _mxfp4_values(w3p + e * (F * L // 2), w3s + e * (F * L // G32), rows, mf, cols, ml, L)
        acc_g += tl.sum(b1.to(dt).to(tl.float32) * zq, axis=1)  # g = W1[e] fq8(z_t), summed in fp32
        acc_u += tl.sum(b3.to(dt).to(tl.float32) * zq, axis=1)  # u = W3[e] fq8(z_t)
    g = acc_g.to(dt).to(tl.float32)  # dt(g), as the matmul rounds its output
    u = acc_u.to(dt).to(tl.float32)
    act = B1 * _tanh(g / B1) * tl.sigmoid(g)  # a(g) = b1 tanh(g/b1) sigmoid(g)
    out = (act * (B2 * _tanh(u / B2))).to(dt).to(tl.float32)  # dt(a(g) b2 tanh(u/b2))
    aq = _mxfp8_round_trip(out[None, :], 1, BLOCK_F)  # fq8(a_r): blocks of 32 along f
    tl.store(a + r.to(tl.int64) * F + rows[None, :], aq.to(dt), mask=mf[None, :])


@triton.jit
def mx_decode_down_kernel(a, idx, order, p, w2p, w2s, y, K: tl.constexpr, L: tl.constexpr, F: tl.constexpr,
                          BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr):  # fmt: skip
    """Token t, rows of l: y_t = dt(sum_j fp32(p_tj) fp32(dt(W2[e] fq8(a_r)))), j in expert order."""
    t = tl.program_id(0).to(tl.int64)
    dt = y.dtype.element_ty
    rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    ml = rows < L
    acc_y = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in range(K):
        r = t * K + tl.load(order + t * K + j).to(tl.int64)  # the token's routes sorted by expert
        e = tl.load(idx + r).to(tl.int64)
        pj = tl.load(p + r).to(tl.float32)
        acc_h = tl.zeros([BLOCK_L], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            mf = cols < F
            ar = tl.load(a + r * F + cols, mask=mf, other=0.0).to(tl.float32)
            b2 = _mxfp4_values(w2p + e * (L * F // 2), w2s + e * (L * F // G32), rows, ml, cols, mf, F)
            acc_h += tl.sum(b2.to(dt).to(tl.float32) * ar[None, :], axis=1)  # h = W2[e] a_r, in fp32
        h = acc_h.to(dt).to(tl.float32)  # dt(h)
        acc_y += pj * h  # y_t += p_tj h_r in fp32 (launched without FMA contraction)
    tl.store(y + t * L + rows, acc_y.to(dt), mask=ml)


@triton.jit
def mx_grouped_gate_up_kernel(x_el, x_sc, row_token, tile_expert, w1p, w1s, w3p, w3s, a_el, a_sc,
                              B1: tl.constexpr, B2: tl.constexpr, L: tl.constexpr, F: tl.constexpr, DT: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """A tile of BLOCK_M rows of one expert's group x BLOCK_N columns of f: the rows gathered from the MXFP8 z
    (x_el, x_sc) by their token, a = fq8(dt(SiTU-GLU(...))) stored as MXFP8 bytes (a_el [M, f], a_sc [M, f/32])."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert + tile).to(tl.int64)  # -1: a tile past every group
    if e >= 0:
        rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = tl.load(row_token + rows).to(tl.int64)  # -1: a padding row of the group
        mm = tok >= 0
        tok = tl.where(mm, tok, 0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N % 32 == 0: whole blocks of a
        mn = cols < F
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mk = ks < L
            mx = mm[:, None] & mk[None, :]
            xb = tl.load(x_el + tok[:, None] * L + ks[None, :], mask=mx, other=0).to(tl.int32)
            xs = tl.load(x_sc + tok[:, None] * (L // G32) + (ks // G32)[None, :], mask=mx, other=127).to(tl.int32)
            xv = (_e4m3_value(xb) * _e8m0(xs)).to(DT)  # fq8(z) in dt
            b1 = _mxfp4_values(w1p + e * (F * L // 2), w1s + e * (F * L // G32), cols, mn, ks, mk, L).to(DT)
            b3 = _mxfp4_values(w3p + e * (F * L // 2), w3s + e * (F * L // G32), cols, mn, ks, mk, L).to(DT)
            # dt products summed in fp32 (MX values are exact in TF32 too: 4 and 2 significant bits)
            acc_g += tl.dot(xv, tl.trans(b1))
            acc_u += tl.dot(xv, tl.trans(b3))
        g = acc_g.to(DT).to(tl.float32)
        u = acc_u.to(DT).to(tl.float32)
        act = B1 * _tanh(g / B1) * tl.sigmoid(g)  # a(g) = b1 tanh(g/b1) sigmoid(g)
        out = (act * (B2 * _tanh(u / B2))).to(DT).to(tl.float32)  # dt(a(g) b2 tanh(u/b2))
        q, X, finite = _mxfp8_blocks(out, BLOCK_M, BLOCK_N)
        tl.store(a_el + rows[:, None] * F + cols[None, :],
                 tl.reshape(_e4m3_byte(q), (BLOCK_M, BLOCK_N)).to(tl.uint8), mask=mn[None, :])  # fmt: skip
        blocks = tl.program_id(1) * (BLOCK_N // G32) + tl.arange(0, BLOCK_N // G32)
        tl.store(a_sc + rows[:, None] * (F // G32) + blocks[None, :], tl.where(finite, X + 127, 255).to(tl.uint8),
                 mask=(blocks < F // G32)[None, :])  # fmt: skip


@triton.jit
def mx_grouped_down_kernel(a_el, a_sc, tile_expert, w2p, w2s, y, L: tl.constexpr, F: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """A tile of BLOCK_M rows x BLOCK_N columns of l: y = dt(fq8(a) W2[e]^T), summed in fp32."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert + tile).to(tl.int64)
    if e >= 0:
        dt = y.dtype.element_ty
        rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = cols < L
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mk = ks < F
            ab = tl.load(a_el + rows[:, None] * F + ks[None, :], mask=mk[None, :], other=0).to(tl.int32)
            asc = tl.load(a_sc + rows[:, None] * (F // G32) + (ks // G32)[None, :], mask=mk[None, :],
                          other=127).to(tl.int32)  # fmt: skip
            av = (_e4m3_value(ab) * _e8m0(asc)).to(dt)  # fq8(a) in dt
            b2 = _mxfp4_values(w2p + e * (L * F // 2), w2s + e * (L * F // G32), cols, mn, ks, mk, F).to(dt)
            acc += tl.dot(av, tl.trans(b2))
        tl.store(y + rows[:, None] * L + cols[None, :], acc.to(dt), mask=mn[None, :])


@triton.jit
def mx_combine_kernel(y, pos, order, p, u, K: tl.constexpr, L: tl.constexpr, BLOCK_L: tl.constexpr):
    """u_t = dt(sum_j fp32(p_tj) fp32(y[pos_tj])), j in expert order (ties by slot)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    m = cols < L
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in range(K):
        r = t * K + tl.load(order + t * K + j).to(tl.int64)
        row = tl.load(pos + r).to(tl.int64)
        w = tl.load(p + r).to(tl.float32)
        acc += w * tl.load(y + row * L + cols, mask=m, other=0.0).to(tl.float32)  # no FMA: p h rounded, then +
    tl.store(u + t * L + cols, acc.to(u.dtype.element_ty), mask=m)


def _check(z, idx, p, w1p, w1s, w3p, w3s, w2p, w2s):
    name = "mx_experts_triton"
    if z.dim() != 2 or z.dtype not in TL_DTYPES:
        raise ValueError(f"{name}: z must be [N, l] in bf16, fp16 or fp32, got {tuple(z.shape)} {z.dtype}")
    N, L = z.shape
    if idx.dim() != 2 or idx.shape[0] != N or idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: idx must be integer [N={N}, k], got {tuple(idx.shape)} {idx.dtype}")
    if p.shape != idx.shape or not p.is_floating_point():
        raise ValueError(f"{name}: p must be floating [N, k] = {tuple(idx.shape)}, got {tuple(p.shape)} {p.dtype}")
    if any(w.dtype != torch.uint8 for w in (w1p, w1s, w3p, w3s, w2p, w2s)):
        raise ValueError(f"{name}: MXFP4 weights come as uint8 weight_packed and weight_scale tensors")
    E, F = w1p.shape[0], w1p.shape[1]
    if L % GROUP or F % GROUP:
        raise ValueError(f"{name}: l = {L} and f = {F} must be multiples of {GROUP} (one scale per {GROUP} values)")
    want = {"w1_packed": (w1p, (E, F, L // 2)), "w1_scale": (w1s, (E, F, L // GROUP)),
            "w3_packed": (w3p, (E, F, L // 2)), "w3_scale": (w3s, (E, F, L // GROUP)),
            "w2_packed": (w2p, (E, L, F // 2)), "w2_scale": (w2s, (E, L, F // GROUP))}
    for n, (w, shape) in want.items():
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: {n} must be {list(shape)} for E = {E}, f = {F}, l = {L}; got {list(w.shape)}")
        if not w.is_contiguous():
            raise ValueError(f"{name}: {n} must be contiguous (the bytes are read in place)")
    if len({t.device for t in (z, idx, p, w1p, w1s, w3p, w3s, w2p, w2s)}) != 1:
        raise ValueError(f"{name}: all inputs must be on one device")


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def mxfp8_quantize_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mx.mxfp8_quantize in one kernel: x [rows, n] (float, n % 32 == 0) -> (elements float8_e4m3fn [rows, n],
    scale uint8 [rows, n / 32]), the same bytes."""
    if x.dim() != 2 or x.dtype not in TL_DTYPES or x.shape[1] % GROUP:
        raise ValueError(f"mxfp8_quantize_triton: x must be [rows, n] float, n a multiple of {GROUP}; got "
                         f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    rows, n = x.shape
    x = x.contiguous()
    el = torch.empty(rows, n, dtype=torch.uint8, device=x.device)
    sc = torch.empty(rows, n // GROUP, dtype=torch.uint8, device=x.device)
    if rows and n:
        block = min(BLOCK_Q, triton.next_power_of_2(n))
        mxfp8_quantize_kernel[(rows, triton.cdiv(n, block))](x, el, sc, N=n, BLOCK=block)
    return el.view(torch.float8_e4m3fn), sc


def group_routes(idx: torch.Tensor, num_experts: int, block_m: int):
    """The grouped path's layout, without host synchronisation: the N k routes sorted by expert into groups
    padded to block_m rows, inside a buffer of the static bound M = R + E (block_m - 1) rows (rounded up).
    Returns (pos [R] buffer row of route r, row_token [M] token of each row (-1: padding),
    tile_expert [M / block_m] expert of each tile of block_m rows (-1: past every group))."""
    flat = idx.reshape(-1)
    R, K, E, dev = flat.numel(), idx.shape[1], num_experts, idx.device
    order, _, counts = permute_by_expert(idx, E)  # routes by expert, ties in route order
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    expert_sorted = flat[order]
    rank = torch.arange(R, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_sorted]  # place in its group
    pos = torch.empty_like(order).scatter_(0, order, starts[expert_sorted] + rank)
    M = -(-(R + E * (block_m - 1)) // block_m) * block_m
    row_token = torch.full((M,), -1, dtype=torch.int64, device=dev).scatter_(0, pos, torch.arange(R, device=dev) // K)
    tile_expert = torch.searchsorted(ends, torch.arange(0, M, block_m, device=dev), right=True)  # ends[e] > start
    return pos, row_token, torch.where(tile_expert < E, tile_expert, -1)


def expert_order(idx: torch.Tensor) -> torch.Tensor:
    """[N, k] slots of each token's routes sorted by expert, ties by slot: the order latent_experts_loop's
    combine adds them in (routes sorted stably by expert, then index_add)."""
    return torch.sort(idx, dim=1, stable=True).indices


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def mx_decode_experts_triton(z, idx, p, w1p, w1s, w3p, w3s, w2p, w2s, beta_gate: float, beta_up: float):
    """The decode path (module doc): u [N, l] in z's dtype, expert weights read as bytes in place."""
    _check(z, idx, p, w1p, w1s, w3p, w3s, w2p, w2s)
    N, L = z.shape
    K, F = idx.shape[1], w1p.shape[1]
    z, idx, p = z.contiguous(), idx.contiguous(), p.contiguous()
    y = torch.zeros(N, L, dtype=z.dtype, device=z.device)
    if N == 0 or K == 0:
        return y
    a = torch.empty(N * K, F, dtype=z.dtype, device=z.device)  # fq8(a_r) in dt
    bl1 = min(BLOCK_L1, max(GROUP, triton.next_power_of_2(L)))
    mx_decode_gate_up_kernel[(N * K, triton.cdiv(F, BLOCK_F1))](
        z, idx, w1p, w1s, w3p, w3s, a, B1=float(beta_gate), B2=float(beta_up), K=K, L=L, F=F,
        BLOCK_F=BLOCK_F1, BLOCK_L=bl1)  # fmt: skip
    bf2 = min(BLOCK_F2, triton.next_power_of_2(F))
    mx_decode_down_kernel[(N, triton.cdiv(L, BLOCK_L2))](
        a, idx, expert_order(idx), p, w2p, w2s, y, K=K, L=L, F=F, BLOCK_L=BLOCK_L2, BLOCK_F=bf2, **NO_FMA)
    return y


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def mx_grouped_experts_triton(z, idx, p, w1p, w1s, w3p, w3s, w2p, w2s, beta_gate: float, beta_up: float):
    """The grouped path (module doc): u [N, l] in z's dtype."""
    _check(z, idx, p, w1p, w1s, w3p, w3s, w2p, w2s)
    N, L = z.shape
    K, E, F = idx.shape[1], w1p.shape[0], w1p.shape[1]
    idx, p = idx.contiguous(), p.contiguous()
    u = torch.zeros(N, L, dtype=z.dtype, device=z.device)
    if N == 0 or K == 0:
        return u
    x_el, x_sc = mxfp8_quantize_triton(z)  # once per token, before the routes read it
    pos, row_token, tile_expert = group_routes(idx, E, BLOCK_M)
    M = row_token.numel()
    a_el = torch.empty(M, F, dtype=torch.uint8, device=z.device)
    a_sc = torch.empty(M, F // GROUP, dtype=torch.uint8, device=z.device)
    bn1, bk1 = min(BLOCK_N, max(GROUP, triton.next_power_of_2(F))), min(BLOCK_K, max(GROUP, triton.next_power_of_2(L)))
    mx_grouped_gate_up_kernel[(M // BLOCK_M, triton.cdiv(F, bn1))](
        x_el.view(torch.uint8), x_sc, row_token, tile_expert, w1p, w1s, w3p, w3s, a_el, a_sc,
        B1=float(beta_gate), B2=float(beta_up), L=L, F=F, DT=TL_DTYPES[z.dtype],
        BLOCK_M=BLOCK_M, BLOCK_N=bn1, BLOCK_K=bk1)  # fmt: skip
    y = torch.empty(M, L, dtype=z.dtype, device=z.device)
    bn2, bk2 = min(BLOCK_N, max(GROUP, triton.next_power_of_2(L))), min(BLOCK_K, max(GROUP, triton.next_power_of_2(F)))
    mx_grouped_down_kernel[(M // BLOCK_M, triton.cdiv(L, bn2))](
        a_el, a_sc, tile_expert, w2p, w2s, y, L=L, F=F, BLOCK_M=BLOCK_M, BLOCK_N=bn2, BLOCK_K=bk2)
    bl = min(BLOCK_Q, triton.next_power_of_2(L))
    mx_combine_kernel[(N, triton.cdiv(L, bl))](y, pos, expert_order(idx), p, u, K=K, L=L, BLOCK_L=bl, **NO_FMA)
    return u


def mx_experts_triton(z, idx, p, w1p, w1s, w3p, w3s, w2p, w2s, beta_gate: float, beta_up: float):
    """u [N, l] = sum_j p[t, j] h_{e = idx[t, j]}(z_t) under MXFP4 weights and MXFP8 activations (module doc),
    in z's dtype (the compute dtype dt). z [N, l]; idx [N, k] (in [0, E): not checked, that would sync);
    p [N, k] float; w1p, w3p [E, f, l/2] and w1s, w3s [E, f, l/32], w2p [E, l, f/2] and w2s [E, l, f/32]
    uint8 (RoutedExperts' held buffers). A few routes (4 N k <= E) take the decode kernels, more the grouped."""
    few = 4 * idx.numel() <= w1p.shape[0]
    fn = mx_decode_experts_triton if few else mx_grouped_experts_triton
    return fn(z, idx, p, w1p, w1s, w3p, w3s, w2p, w2s, beta_gate, beta_up)
