"""RMSNorm in one Triton pass forward and one backward (the formula in ``__init__.py``).

Forward, per row: r = 1/sqrt(mean(x^2) + eps) in fp32, n = x r rounded to x's dtype, y = w n rounded to
x's dtype (w first cast to x's dtype), exactly the reference's roundings. Backward, in fp32:

    dw = sum_rows dy n                       (per program, then over the programs)
    dx = r (dn - xh mean_d(dn xh)),   dn = dy w,   xh = x r
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only

ROWS = 4096  # elements per row block (rows x padded d), forward
# backward: smaller blocks and more programs than the forward (faster at the k3-small micro-batch,
# [65536, 768] bf16, in a launch sweep)
BWD_ROWS = 2048
MAX_PROGRAMS = 4096  # backward programs at most, each over consecutive row blocks


@triton.jit(do_not_specialize=["n_rows"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def rms_norm_fwd_kernel(x, w, y, rstd, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mr, md = rows < n_rows, cols < D
    m = mr[:, None] & md[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + cols, mask=md, other=0.0).to(y.dtype.element_ty).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    tl.store(rstd + rows, r, mask=mr)
    n = (b_x * r[:, None]).to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + off, (b_w[None, :] * n).to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows", "per_prog"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def rms_norm_bwd_kernel(x, w, rstd, dy, dx, dw_part, n_rows, per_prog, D: tl.constexpr, BD: tl.constexpr,
                        BR: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    md = cols < D
    b_w = tl.load(w + cols, mask=md, other=0.0).to(dx.dtype.element_ty).to(tl.float32)
    b_dw = tl.zeros([BD], dtype=tl.float32)
    i = 0
    while i < per_prog:  # this program's row blocks in turn (a while: the interpreter cannot range() over
        rows = (pid * per_prog + i) * BR + tl.arange(0, BR)  # an int argument)
        i += 1
        mr = rows < n_rows
        m = mr[:, None] & md[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
        r = tl.load(rstd + rows, mask=mr, other=0.0)
        xh = b_x * r[:, None]
        b_dw += tl.sum(b_dy * xh.to(dx.dtype.element_ty).to(tl.float32), axis=0)
        dn = b_dy * b_w[None, :]
        b_dx = r[:, None] * (dn - xh * (tl.sum(dn * xh, axis=1) / D)[:, None])
        tl.store(dx + off, b_dx.to(dx.dtype.element_ty), mask=m)
    tl.store(dw_part + pid * D + cols, b_dw, mask=md)


def launch_settings(d: int, rows: int | None = None) -> tuple[int, int, int]:
    """(BD, BR, num_warps): the padded row, rows per block (`rows` elements, ROWS by default), warps
    (about 16 elements of a block each)."""
    BD = triton.next_power_of_2(d)
    BR = max(1, (rows or ROWS) // BD)
    return BD, BR, min(16, max(4, BR * BD // 512))


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x = x.contiguous()
        D = x.shape[-1]
        n = x.numel() // D
        BD, BR, warps = launch_settings(D)
        y = torch.empty_like(x)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        rms_norm_fwd_kernel[(triton.cdiv(n, BR),)](x, weight, y, rstd, n, float(eps), D=D, BD=BD, BR=BR,
                                                   num_warps=warps)  # fmt: skip
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        D = x.shape[-1]
        n = x.numel() // D
        BD, BR, warps = launch_settings(D, BWD_ROWS)
        per_prog = triton.cdiv(triton.cdiv(n, BR), MAX_PROGRAMS)
        grid = triton.cdiv(n, BR * per_prog)
        dx = torch.empty_like(x)
        dw_part = torch.empty(grid, D, dtype=torch.float32, device=x.device)
        rms_norm_bwd_kernel[(grid,)](x, weight, rstd, dy.contiguous(), dx, dw_part, n, per_prog, D=D, BD=BD, BR=BR,
                                     num_warps=warps)  # fmt: skip
        return dx, dw_part.sum(0).to(weight.dtype), None


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows (fp32 statistic) times weight, in x's dtype, by the kernels."""
    return RMSNormFn.apply(x, weight, eps)
