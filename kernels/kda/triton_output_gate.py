"""KDA's output island as one Triton pass forward and one backward: per-head RMSNorm times the gate.

    r = 1 / sqrt(mean_d o^2 + eps),  n = o r,  s = sigmoid(g)        (per head row of D channels)
    y = n * w * s                                     fp32 in registers, stored in the output dtype
    dg = dy n w s (1 - s),  dw = sum_rows dy n s,  do = r (dn - n mean_d(dn n)),  dn = dy w s

o and g are read in their own dtype (bf16 in training) and never widened in memory; only r (fp32,
one per row) is kept for backward. dw is summed per program in fp32, then over the programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only

ROWS = 4096  # elements per row block (rows x D)
MAX_PROGRAMS = 1024  # backward programs at most, each over consecutive row blocks


@triton.jit(do_not_specialize=["n_rows"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def norm_gate_fwd_kernel(o, g, w, y, rstd, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mr, md = rows < n_rows, cols < D
    m = mr[:, None] & md[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    b_o = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + cols, mask=md, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(b_o * b_o, axis=1) / D + eps)
    tl.store(rstd + rows, r, mask=mr)
    out = b_o * r[:, None] * b_w[None, :] * tl.sigmoid(b_g)
    tl.store(y + off, out.to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows", "per_prog"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def norm_gate_bwd_kernel(
    o, g, w, rstd, dy, do, dg, dw_part, n_rows, per_prog, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    md = cols < D
    b_w = tl.load(w + cols, mask=md, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BD], dtype=tl.float32)
    i = 0
    while i < per_prog:  # this program's row blocks, one after another (a while: the interpreter
        rows = (pid * per_prog + i) * BR + tl.arange(0, BR)  # cannot range() over an int argument)
        i += 1
        mr = rows < n_rows
        m = mr[:, None] & md[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        b_o = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
        b_g = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
        r = tl.load(rstd + rows, mask=mr, other=0.0)
        n = b_o * r[:, None]
        s = tl.sigmoid(b_g)
        b_dw += tl.sum(b_dy * n * s, axis=0)
        dn = b_dy * b_w[None, :] * s
        tl.store(dg + off, (dn * n * (1.0 - s)).to(dg.dtype.element_ty), mask=m)
        b_do = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
        tl.store(do + off, b_do.to(do.dtype.element_ty), mask=m)
    tl.store(dw_part + pid * D + cols, b_dw, mask=md)


def _blocks(D):
    BD = triton.next_power_of_2(D)
    return BD, max(1, ROWS // BD)


class OutputNormGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, g, weight, eps, out_dtype):
        o, g = o.contiguous(), g.contiguous()
        D = o.shape[-1]
        n = o.numel() // D
        BD, BR = _blocks(D)
        y = torch.empty(o.shape, dtype=out_dtype, device=o.device)
        rstd = torch.empty(n, dtype=torch.float32, device=o.device)
        norm_gate_fwd_kernel[(triton.cdiv(n, BR),)](o, g, weight, y, rstd, n, float(eps), D=D, BD=BD, BR=BR)
        ctx.save_for_backward(o, g, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        o, g, weight, rstd = ctx.saved_tensors
        D = o.shape[-1]
        n = o.numel() // D
        BD, BR = _blocks(D)
        per_prog = triton.cdiv(triton.cdiv(n, BR), MAX_PROGRAMS)
        grid = triton.cdiv(n, BR * per_prog)
        do, dg = torch.empty_like(o), torch.empty_like(g)
        dw_part = torch.empty(grid, D, dtype=torch.float32, device=o.device)
        norm_gate_bwd_kernel[(grid,)](
            o, g, weight, rstd, dy.contiguous(), do, dg, dw_part, n, per_prog, D=D, BD=BD, BR=BR
        )  # fmt: skip
        return do, dg, dw_part.sum(0).to(weight.dtype), None, None


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def output_norm_gate_triton(
    o: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """RMSNorm over o's last dim (fp32 statistic, weight [D]) times sigmoid(g), in out_dtype."""
    return OutputNormGate.apply(o, g, weight, eps, out_dtype)
