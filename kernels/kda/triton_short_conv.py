"""KDA's short convolution as one Triton pass forward and one backward (no fp32 tensor in memory).

    a_t[c] = sum_{s=0..W-1} w[c, W-1-s] x_{t-s}[c]   over the taps inside t's document (s <= p_t)
    y_t[c] = SiLU(a_t[c])                             fp32 in registers, stored in x's dtype
    da_t   = dy_t sigma(a_t) (1 + a_t (1 - sigma(a_t)))
    dx_t   = sum_s w[c, W-1-s] da_{t+s}  [s <= p_{t+s}]
    dw[c, W-1-s] = sum_t da_t x_{t-s}    [s <= p_t]

p_t is token t's position in its document (t itself without documents), computed on the device
from ``cu_seqlens``, so packed documents need no host sync. x_{t-s} before a sequence's first token
(p_t < s) comes from its left window, row W-1+p_t-s, instead of zeros: one a batch row [B, W-1, C]
(decoding: the cached projections) or one a document [N, W-1, C] (a branch forked from a shared
prefix). Its gradient needs only the first W-1 tokens' da:
    dleft_n[r] = sum_{p=0..r} w[c, r-p] da_{start_n + p}       (p < the document's length)
A decode step (one token, no autograd) has a kernel of its own that also writes the next left context. Backward recomputes a from x (only x,
the weight and p are kept) in two passes: da (fp32, stored) with dw summed in fp32 registers over a
program's run of token blocks, then dx from W shifted reads of da. (One pass recomputed a at each of
the W taps: W^2 + W reads of x a tile, several times what its bytes need.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only

BT, BC = 32, 128  # tokens x channels per program
# backward pass 1: blocks of DA_BT tokens, DA_NB of them a program (dw summed over them in registers)
DA_BT, DA_NB, DA_WARPS = 32, 16, 4  # the best of a launch sweep at the k3-small micro-batch (65,536 x 768)


@triton.jit
def _x_at(base, rows, left, seq, u, s, pu, mu, c, mc, C, W: tl.constexpr, HAS_LEFT: tl.constexpr):
    """x_{u-s}[c] (fp32) inside u's document, or from its sequence's left window before its first token
    (`seq`: the batch row, or each token's document); `rows` = u * C (int64), so a tap costs an add per
    element, not a 64-bit multiply."""
    m = (mu & (pu >= s))[:, None] & mc[None, :]
    x_s = tl.load(base + (rows - s * C)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_LEFT:  # row W-1+p-s of the sequence's left window [W-1, C] when p - s < 0
        m = (mu & (pu < s))[:, None] & mc[None, :]
        row = seq.to(tl.int64) * (W - 1) + (W - 1 + pu - s)
        x_s += tl.load(left + row[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    return x_s


@triton.jit
def _conv_at(
    base, left, seq, w, u, pu, mu, c, mc, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_LEFT: tl.constexpr,
):  # fmt: skip
    """a_u[c] (fp32) for the tokens u of a block, their positions pu and mask mu."""
    rows = u.to(tl.int64) * C
    a = tl.zeros([BT, BC], dtype=tl.float32)
    for s in tl.static_range(W):
        w_s = tl.load(w + c * W + (W - 1 - s), mask=mc, other=0.0).to(tl.float32)
        a += w_s[None, :] * _x_at(base, rows, left, seq, u, s, pu, mu, c, mc, C, W, HAS_LEFT)
    return a


@triton.jit
def _tile(T, C, BT: tl.constexpr, BC: tl.constexpr):
    """This program's block: tokens t and channels c with their masks, and its batch row's offset."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = i_t * BT + tl.arange(0, BT)
    c = i_c * BC + tl.arange(0, BC)
    return i_t, i_b, t, c, t < T, c < C, i_b.to(tl.int64) * T * C


@triton.jit
def _positions(pos, u, mu, HAS_POS: tl.constexpr):
    if HAS_POS:
        return tl.load(pos + u, mask=mu, other=0)
    return u


@triton.jit
def _sequences(doc, u, mu, i_b, HAS_POS: tl.constexpr):
    """Whose left window a token reads: its document's (packed documents) or its batch row's."""
    if HAS_POS:
        return tl.load(doc + u, mask=mu, other=0)
    return u * 0 + i_b  # a vector like the other branch's


@triton.jit(do_not_specialize=["T"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def short_conv_fwd_kernel(
    x, w, pos, doc, left, y, T, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr, HAS_LEFT: tl.constexpr,
):  # fmt: skip
    i_t, i_b, t, c, mt, mc, off = _tile(T, C, BT, BC)
    seq = _sequences(doc, t, mt, i_b, HAS_POS)
    a = _conv_at(x + off, left, seq, w, t, _positions(pos, t, mt, HAS_POS), mt, c, mc, C, W, BT, BC, HAS_LEFT)
    out = a * tl.sigmoid(a)
    ptr = y + off + (t.to(tl.int64) * C)[:, None] + c[None, :]
    tl.store(ptr, out.to(y.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit(do_not_specialize=["T"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def short_conv_da_kernel(
    x, w, pos, doc, left, dy, da, dw_part, T, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
):  # fmt: skip
    """Backward, pass 1, over this program's NB blocks of BT tokens: da_t = dy_t SiLU'(a_t) (fp32,
    stored) and its share of dw[c, W-1-s] = sum_t da_t x_{t-s}, summed elementwise in registers
    (acc_s[t, c] += da_t x_{t-s}) and reduced over the tokens once, at the end: one reduction and
    one store per tap a program, not one per block (W <= 4)."""
    i_p, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = i_c * BC + tl.arange(0, BC)
    mc = c < C
    off = i_b.to(tl.int64) * T * C
    acc0 = tl.zeros([BT, BC], dtype=tl.float32)
    acc1 = tl.zeros([BT, BC], dtype=tl.float32)
    acc2 = tl.zeros([BT, BC], dtype=tl.float32)
    acc3 = tl.zeros([BT, BC], dtype=tl.float32)
    for j in range(NB):
        t = (i_p * NB + j) * BT + tl.arange(0, BT)
        mt = t < T
        pt = _positions(pos, t, mt, HAS_POS)
        seq = _sequences(doc, t, mt, i_b, HAS_POS)
        a = _conv_at(x + off, left, seq, w, t, pt, mt, c, mc, C, W, BT, BC, HAS_LEFT)
        rows = t.to(tl.int64) * C
        m = mt[:, None] & mc[None, :]
        b_dy = tl.load(dy + off + rows[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        da_t = b_dy * sig * (1.0 + a * (1.0 - sig))  # d SiLU(a) / da = sigma(a) (1 + a (1 - sigma(a)))
        tl.store(da + off + rows[:, None] + c[None, :], da_t, mask=m)
        acc0 += da_t * _x_at(x + off, rows, left, seq, t, 0, pt, mt, c, mc, C, W, HAS_LEFT)
        if W > 1:
            acc1 += da_t * _x_at(x + off, rows, left, seq, t, 1, pt, mt, c, mc, C, W, HAS_LEFT)
        if W > 2:
            acc2 += da_t * _x_at(x + off, rows, left, seq, t, 2, pt, mt, c, mc, C, W, HAS_LEFT)
        if W > 3:
            acc3 += da_t * _x_at(x + off, rows, left, seq, t, 3, pt, mt, c, mc, C, W, HAS_LEFT)
    part = dw_part + (i_b * tl.num_programs(0) + i_p).to(tl.int64) * W * C + c  # [programs, W, C]
    tl.store(part + (W - 1) * C, tl.sum(acc0, axis=0), mask=mc)
    if W > 1:
        tl.store(part + (W - 2) * C, tl.sum(acc1, axis=0), mask=mc)
    if W > 2:
        tl.store(part + (W - 3) * C, tl.sum(acc2, axis=0), mask=mc)
    if W > 3:
        tl.store(part + (W - 4) * C, tl.sum(acc3, axis=0), mask=mc)


@triton.jit(do_not_specialize=["T"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def short_conv_dx_kernel(
    da, w, pos, dx, T, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    """Backward, pass 2: dx_t = sum_s w[c, W-1-s] da_{t+s} over the taps inside t+s's document."""
    i_t, i_b, t, c, mt, mc, off = _tile(T, C, BT, BC)
    rows = t.to(tl.int64) * C
    b_dx = tl.zeros([BT, BC], dtype=tl.float32)
    for s in tl.static_range(W):  # da at t + s, through tap s back to t
        u = t + s
        mu = u < T
        pu = _positions(pos, u, mu, HAS_POS)
        m = (mu & (pu >= s))[:, None] & mc[None, :]
        b_da = tl.load(da + off + (rows + s * C)[:, None] + c[None, :], mask=m, other=0.0)
        w_s = tl.load(w + c * W + (W - 1 - s), mask=mc, other=0.0).to(tl.float32)
        b_dx += w_s[None, :] * b_da
    tl.store(dx + off + rows[:, None] + c[None, :], b_dx.to(dx.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit
def short_conv_decode_kernel(x, w, left, y, tail, B, C, W: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """One decode token a sequence (T = 1) after its cached left context, BB sequences x BC channels a
    program (the general kernel's grid would be one program a sequence, 31 of its 32 rows masked):

        y[b, c] = SiLU(w[c, W-1] x[b, c] + sum_{s=1..W-1} w[c, W-1-s] left[b, W-1-s, c])
        tail[b] = (left[b, 1], ..., left[b, W-2], x[b])       the next step's left context
    """
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    m = (b < B)[:, None] & mc[None, :]
    x0 = tl.load(x + b.to(tl.int64)[:, None] * C + c[None, :], mask=m, other=0.0)
    a = tl.load(w + c * W + (W - 1), mask=mc, other=0.0).to(tl.float32)[None, :] * x0.to(tl.float32)
    rows = b.to(tl.int64)[:, None] * (W - 1)  # sequence b's first row in left and tail [B, W-1, C]
    for s in tl.static_range(1, W):
        l_s = tl.load(left + (rows + (W - 1 - s)) * C + c[None, :], mask=m, other=0.0)  # x_{-s}
        a += tl.load(w + c * W + (W - 1 - s), mask=mc, other=0.0).to(tl.float32)[None, :] * l_s.to(tl.float32)
        if s < W - 1:  # left row W-1-s moves one up
            tl.store(tail + (rows + (W - 2 - s)) * C + c[None, :], l_s.to(tail.dtype.element_ty), mask=m)
    tl.store(tail + (rows + (W - 2)) * C + c[None, :], x0.to(tail.dtype.element_ty), mask=m)
    tl.store(y + b.to(tl.int64)[:, None] * C + c[None, :], (a * tl.sigmoid(a)).to(y.dtype.element_ty), mask=m)


DECODE_BB = 8  # sequences a program of the decode kernel (256 x 768: 32 x 6 programs)


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's short conv without autograd: x [B, 1, C], weight [C, 1, W] (W >= 2), left
    [B, W-1, C] -> (y [B, 1, C], the next left context [B, W-1, C]), both in x's dtype, one kernel."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if T != 1 or W < 2 or left.shape != (B, W - 1, C):
        raise ValueError(f"short_conv_decode: x [B, 1, C] and left [B, W-1, C] with W >= 2; got x {tuple(x.shape)}, "
                         f"left {tuple(left.shape)}, W={W}")
    x, w, left = x.contiguous(), weight.contiguous(), left.to(x.dtype).contiguous()
    y, tail = torch.empty_like(x), torch.empty_like(left)
    short_conv_decode_kernel[(triton.cdiv(B, DECODE_BB), triton.cdiv(C, BC))](
        x, w, left, y, tail, B, C, W=W, BB=DECODE_BB, BC=BC
    )  # fmt: skip
    return y, tail


def positions_in_documents(cu_seqlens: torch.Tensor, T: int, with_documents: bool = False):
    """int32 [T]: each token's position in its document, on cu_seqlens' device (no host sync); with
    `with_documents`, also each token's document index (int32 [T])."""
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(T, device=cu.device)
    doc = torch.searchsorted(cu, t, right=True) - 1
    pos = (t - cu[doc]).to(torch.int32)
    return (pos, doc.to(torch.int32)) if with_documents else pos


def left_window_grad(da: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """dleft [N, W-1, C] from da [T', C] (fp32; the sequences' tokens on one axis), each sequence's first
    token at `starts` [N] with `lengths` [N]: dleft_n[r] = sum_{p=0..r} w[c, r-p] da_{start_n+p}, p < length."""
    W = w.shape[-1]
    wf = w.reshape(-1, W).float()  # [C, W]
    first = []  # da of each sequence's p-th token, zero past its end
    for p in range(W - 1):
        idx = (starts + p).clamp(max=max(da.shape[0] - 1, 0))
        first.append(torch.where((p < lengths)[:, None], da[idx], da.new_zeros(())))
    rows = [sum(wf[:, r - p] * first[p] for p in range(r + 1)) for r in range(W - 1)]
    return torch.stack(rows, dim=1)


def _grid(B, T, C):
    return (triton.cdiv(T, BT), triton.cdiv(C, BC), B)


class ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, pos, doc, cu, left):
        B, T, C = x.shape
        W = weight.shape[-1]
        x, w = x.contiguous(), weight.contiguous()
        ctx.left_dtype = None if left is None else left.dtype
        left = None if left is None else left.to(x.dtype).contiguous()
        y = torch.empty_like(x)
        short_conv_fwd_kernel[_grid(B, T, C)](
            x, w, pos, doc, left, y, T, C, W=W, BT=BT, BC=BC, HAS_POS=pos is not None, HAS_LEFT=left is not None
        )  # fmt: skip
        ctx.save_for_backward(x, w, pos, doc, cu, left)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, pos, doc, cu, left = ctx.saved_tensors
        B, T, C = x.shape
        W = w.shape[-1]
        NP = triton.cdiv(T, DA_BT * DA_NB)
        da = torch.empty(B, T, C, dtype=torch.float32, device=x.device)
        dw_part = torch.empty(B * NP, W, C, dtype=torch.float32, device=x.device)
        short_conv_da_kernel[(NP, triton.cdiv(C, BC), B)](
            x, w, pos, doc, left, dy.contiguous(), da, dw_part, T, C,
            W=W, BT=DA_BT, BC=BC, NB=DA_NB, HAS_POS=pos is not None, HAS_LEFT=left is not None, num_warps=DA_WARPS,
        )  # fmt: skip
        dx = torch.empty_like(x)
        short_conv_dx_kernel[_grid(B, T, C)](da, w, pos, dx, T, C, W=W, BT=BT, BC=BC, HAS_POS=pos is not None)
        dw = dw_part.sum(0).t().reshape(C, 1, W).to(w.dtype)
        dleft = None
        if left is not None and ctx.needs_input_grad[5]:
            if cu is not None:  # one window a document: its first tokens' da in the packed stream
                starts, lengths = cu[:-1], cu[1:] - cu[:-1]
            else:  # one a batch row: row b's tokens start at b * T
                starts = torch.arange(B, device=x.device) * T
                lengths = torch.full((B,), T, device=x.device)
            dleft = left_window_grad(da.reshape(B * T, C), w, starts, lengths).to(ctx.left_dtype)
        return dx, dw, None, None, None, dleft


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def short_conv_triton(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None, left: torch.Tensor | None = None
) -> torch.Tensor:
    """SiLU(causal depthwise conv(x)) with a zero left context at every document start, or the given
    one: x [B, T, C], weight [C, 1, W] (fp32), cu_seqlens [N+1] on x's device or None; left [B, W-1, C]
    (a window a batch row: decoding's cached context), or with cu_seqlens [N, W-1, C] (a window a
    document), differentiable. Returns y [B, T, C] in x's dtype."""
    if weight.shape[-1] > 4:
        raise ValueError(f"short_conv_triton: kernel sizes up to 4 (K3's is 4), got {weight.shape[-1]}; "
                         "use the reference path (backend='torch') for longer convolutions")
    pos = doc = cu = None
    if cu_seqlens is not None:
        pos, doc = positions_in_documents(cu_seqlens, x.shape[1], with_documents=True)
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    return ShortConvSiLU.apply(x, weight, pos, doc, cu, left)
