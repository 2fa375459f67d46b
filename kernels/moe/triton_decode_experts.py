"""The routed experts of a small decode batch in two Triton kernels, reading the expert weights in place.

For route r = (token t = r // k, slot j = r % k) with expert e = idx[t, j] (dt = the weights' dtype):

    a_r = dt( situ( dt(W1[e] z_t), dt(W3[e] z_t) ) )        kernel 1, grid (R = N k, cdiv(f, BLOCK_F1))
    y_t = dt( sum_j fp32(p[t, j]) * fp32(dt(W2[e] a_r)) )   kernel 2, grid (N, cdiv(l, BLOCK_L2))

The dots accumulate in fp32 and are rounded to dt (as bmm rounds its output), SiTU runs in fp32, and the
k expert outputs of a token are summed in fp32 in routing order j = 0..k-1 (h never reaches memory).
These are the roundings of the batched products the engine's decode step used before
(decode_experts_reference below: gathered weights, bmm, SiTU, an fp32 combine), without its weight
gathers: 2 launches a MoE layer instead of ~11, no host sync, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only
from ..situ.triton_situ import _tanh

# kernel 1: at most BLOCK_F1 rows of W1/W3 per program, l columns per step of the reduction loop
BLOCK_F1, BLOCK_L1 = 32, 128
# kernel 2: at most BLOCK_L2 rows of W2 per program, f columns per step of the reduction loop
BLOCK_L2, BLOCK_F2 = 32, 128
# fewer rows per program while the grid has fewer programs than this (about two per SM of an H200): at
# batch 1 of k3-small (k = 4, f = 256, l = 384) 32 rows gave only 32 and 12 programs. The rows a program
# covers do not change a sum's order: same results.
MIN_PROGRAMS, MIN_ROWS = 256, 2


def rows_per_program(programs_per_row_block, rows: int, most: int) -> int:
    """The largest power of two <= `most` (>= MIN_ROWS) whose grid, programs_per_row_block * cdiv(rows, b),
    reaches MIN_PROGRAMS."""
    b = min(most, triton.next_power_of_2(rows))
    while b > MIN_ROWS and programs_per_row_block * triton.cdiv(rows, b) < MIN_PROGRAMS:
        b //= 2
    return b


@triton.jit
def gate_up_kernel(z, idx, w1, w3, a, B1: tl.constexpr, B2: tl.constexpr, K: tl.constexpr, L: tl.constexpr,
                   F: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)  # route r = t k + j
    t = r // K
    e = tl.load(idx + r).to(tl.int64)  # its expert
    rows = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mf = rows < F
    acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
    w_off = e * (F * L) + rows.to(tl.int64)[:, None] * L  # W1[e, rows, :] (W3 alike)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        ml = cols < L
        m = mf[:, None] & ml[None, :]
        zt = tl.load(z + t.to(tl.int64) * L + cols, mask=ml, other=0.0).to(tl.float32)
        b1 = tl.load(w1 + w_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
        b3 = tl.load(w3 + w_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(b1 * zt[None, :], axis=1)  # g = W1[e] z_t, in fp32
        acc_u += tl.sum(b3 * zt[None, :], axis=1)  # u = W3[e] z_t
    g = acc_g.to(a.dtype.element_ty).to(tl.float32)  # dt(g), as bmm rounds its output
    u = acc_u.to(a.dtype.element_ty).to(tl.float32)
    act = B1 * _tanh(g / B1) * tl.sigmoid(g)  # a(g) = b1 tanh(g/b1) sigmoid(g)
    out = act * (B2 * _tanh(u / B2))  # a(g) * b2 tanh(u/b2)
    tl.store(a + r.to(tl.int64) * F + rows, out.to(a.dtype.element_ty), mask=mf)


@triton.jit
def down_combine_kernel(a, idx, p, w2, y, K: tl.constexpr, L: tl.constexpr, F: tl.constexpr,
                        BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    ml = rows < L
    acc_y = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in range(K):  # routing order j = 0..k-1
        r = t.to(tl.int64) * K + j
        e = tl.load(idx + r).to(tl.int64)
        pj = tl.load(p + r).to(tl.float32)
        w_off = e * (L * F) + rows.to(tl.int64)[:, None] * F  # W2[e, rows, :]
        acc_h = tl.zeros([BLOCK_L], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            mf = cols < F
            ar = tl.load(a + r * F + cols, mask=mf, other=0.0).to(tl.float32)
            b2 = tl.load(w2 + w_off + cols[None, :], mask=ml[:, None] & mf[None, :], other=0.0).to(tl.float32)
            acc_h += tl.sum(b2 * ar[None, :], axis=1)  # h = W2[e] a_r, in fp32
        h = acc_h.to(y.dtype.element_ty).to(tl.float32)  # dt(h)
        acc_y += pj * h  # y_t += p_tj h_r, in fp32
    tl.store(y + t.to(tl.int64) * L + rows, acc_y.to(y.dtype.element_ty), mask=ml)


def _check(z, idx, p, w1, w3, w2):
    name = "decode_experts_triton"
    if z.dim() != 2:
        raise ValueError(f"{name}: z must be [N, l], got {tuple(z.shape)}")
    N, L = z.shape
    if idx.dim() != 2 or idx.shape[0] != N or idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: idx must be integer [N={N}, k], got {tuple(idx.shape)} {idx.dtype}")
    if p.shape != idx.shape or not p.is_floating_point():
        raise ValueError(
            f"{name}: p must be floating [N, k] = {tuple(idx.shape)}, got {tuple(p.shape)} {p.dtype}"
        )
    if w1.dim() != 3 or w1.shape[2] != L or w3.shape != w1.shape:
        raise ValueError(
            f"{name}: w1 and w3 must be [E, f, l={L}]; got {tuple(w1.shape)} and {tuple(w3.shape)}"
        )
    E, F, _ = w1.shape
    if w2.shape != (E, L, F):
        raise ValueError(f"{name}: w2 must be [E={E}, l={L}, f={F}], got {tuple(w2.shape)}")
    if z.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: z must be bf16, fp16 or fp32, got {z.dtype}")
    if not (w1.dtype == w3.dtype == w2.dtype == z.dtype):
        raise ValueError(
            f"{name}: z, w1, w3, w2 must share one dtype; got {z.dtype}, {w1.dtype}, {w3.dtype}, {w2.dtype}"
        )
    if not (w1.is_contiguous() and w3.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"{name}: w1, w3, w2 must be contiguous (they are read in place)")
    if len({t.device for t in (z, idx, p, w1, w3, w2)}) != 1:
        raise ValueError(f"{name}: all inputs must be on one device")


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def decode_experts_triton(z, idx, p, w1, w3, w2, beta_gate: float, beta_up: float) -> torch.Tensor:
    """y [N, l] in z's dtype: sum_j p[t, j] W2[e] SiTU-GLU(W1[e] z_t, W3[e] z_t), e = idx[t, j] (module doc).
    z [N, l], idx [N, k] int64/int32 (in [0, E): not checked, that would sync), p [N, k] float,
    w1, w3 [E, f, l], w2 [E, l, f] contiguous, of z's dtype."""
    _check(z, idx, p, w1, w3, w2)
    if not (beta_gate > 0 and beta_up > 0):
        raise ValueError(
            f"decode_experts_triton: beta_gate and beta_up must be positive, got {beta_gate}, {beta_up}"
        )
    N, L = z.shape
    K, F = idx.shape[1], w1.shape[1]
    z, idx, p = z.contiguous(), idx.contiguous(), p.contiguous()
    a = torch.empty(N * K, F, dtype=z.dtype, device=z.device)
    y = torch.empty(N, L, dtype=z.dtype, device=z.device)
    if N == 0 or K == 0:
        return y.zero_()
    bf1, bl1 = rows_per_program(N * K, F, BLOCK_F1), min(BLOCK_L1, triton.next_power_of_2(L))
    gate_up_kernel[(N * K, triton.cdiv(F, bf1))](
        z, idx, w1, w3, a, B1=float(beta_gate), B2=float(beta_up), K=K, L=L, F=F, BLOCK_F=bf1, BLOCK_L=bl1
    )
    bl2, bf2 = rows_per_program(N, L, BLOCK_L2), min(BLOCK_F2, triton.next_power_of_2(F))
    down_combine_kernel[(N, triton.cdiv(L, bl2))](a, idx, p, w2, y, K=K, L=L, F=F, BLOCK_L=bl2, BLOCK_F=bf2)
    return y


def decode_experts_reference(z, idx, p, w1, w3, w2, beta_gate: float, beta_up: float) -> torch.Tensor:
    """The kernels' formula in plain PyTorch with the same roundings: each route's expert weights gathered
    and applied as one batched product."""
    N, L = z.shape
    K = idx.shape[1]
    flat = idx.reshape(-1)
    x = z.unsqueeze(1).expand(N, K, L).reshape(-1, 1, L)  # [R, 1, l]: route r = t k + j reads z_t
    g = torch.bmm(x, w1[flat].transpose(1, 2)).float()  # dt(W1[e] z_t)  [R, 1, f]
    u = torch.bmm(x, w3[flat].transpose(1, 2)).float()  # dt(W3[e] z_t)
    act = beta_gate * torch.tanh(g / beta_gate) * torch.sigmoid(g)  # a(g) = b1 tanh(g/b1) sigmoid(g)
    a = (act * (beta_up * torch.tanh(u / beta_up))).to(z.dtype)  # dt(a(g) b2 tanh(u/b2))
    h = torch.bmm(a, w2[flat].transpose(1, 2)).view(N, K, L).float()  # fp32(dt(W2[e] a_r))
    y = torch.zeros(N, L, dtype=torch.float32, device=z.device)
    for j in range(K):  # in routing order
        y = y + p[:, j].float()[:, None] * h[:, j]  # y_t += p_tj h_r in fp32
    return y.to(z.dtype)
