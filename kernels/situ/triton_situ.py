"""Fused SiTU-GLU in Triton: one pass forward, one pass backward (recomputing the fp32 chain).

Forward  f = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]
Backward df/dg = u~ [(1 - tanh^2(g/b1)) sigmoid(g) + b1 tanh(g/b1) sigmoid(g)(1 - sigmoid(g))],
         df/du = a(g) (1 - tanh^2(u/b2))
Only the (bf16) inputs are kept for backward (docs/model.md §5.4 memory trick).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only

BLOCK = 2048


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)  # saturates cleanly to +-1 for large |x|


@triton.jit(do_not_specialize=["n"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def situ_fwd_kernel(g_ptr, u_ptr, o_ptr, n, B1: tl.constexpr, B2: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    a = B1 * _tanh(g / B1) * tl.sigmoid(g)  # a(g) = b1 tanh(g/b1) sigma(g)
    tl.store(o_ptr + offs, (a * B2 * _tanh(u / B2)).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def situ_bwd_kernel(
    g_ptr, u_ptr, do_ptr, dg_ptr, du_ptr, n, B1: tl.constexpr, B2: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tg = _tanh(g / B1)
    sg = tl.sigmoid(g)
    tu = _tanh(u / B2)
    da = (1.0 - tg * tg) * sg + B1 * tg * sg * (1.0 - sg)
    tl.store(dg_ptr + offs, (do * B2 * tu * da).to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(du_ptr + offs, (do * B1 * tg * sg * (1.0 - tu * tu)).to(du_ptr.dtype.element_ty), mask=m)


class SiTUGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta_gate, beta_up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        situ_fwd_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, out, n, B1=beta_gate, B2=beta_up, BLOCK=BLOCK, num_warps=8
        )
        ctx.save_for_backward(gate, up)
        ctx.betas = (beta_gate, beta_up)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        b1, b2 = ctx.betas
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        situ_bwd_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, dout.contiguous(), dg, du, n, B1=b1, B2=b2, BLOCK=BLOCK, num_warps=8
        )
        return dg, du, None, None


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def situ_glu_triton(gate, up, beta_gate=4.0, beta_up=25.0):
    return SiTUGLUTriton.apply(gate, up, float(beta_gate), float(beta_up))
