"""The Block AttnRes aggregation as one Triton pass forward and one backward (K3 report, Block AttnRes).

Per token row, S sources v_i [d] in their dtype, the query q = gamma * w [d] in fp32:
    r_i = 1 / sqrt(mean_d v_i^2 + eps),  l_i = r_i (v_i . q),  a = softmax_i(l),  h = sum_i a_i v_i
Backward, given dh (g_i = dh . v_i):
    dl_i = a_i (g_i - sum_j a_j g_j),    sum_j a_j g_j = dh . h  (h before its rounding)
    dv_i = a_i dh + dl_i (r_i q - r_i^2 l_i v_i / d)      (r_i^3 (v_i . q) = r_i^2 l_i)
    dq   = sum_rows sum_i dl_i r_i v_i

A program holds whole rows of d channels in registers (d <= MAX_D), so the forward reads each
source once: an online softmax over the sources (running max m, normaliser z, numerator acc) needs
no second pass. Only l and r (fp32, S per row) are kept for backward; no [S, T, d] tensor is made in
fp32 or stacked. The sources reach the kernels as a tuple of pointers (S is a compile-time constant,
one specialisation per source count), the source gradients leave as a tuple of separate tensors.
Backward reads the sources once when h is fp32 (the learner under autocast: an fp32 embedding block
first), taking sum_j a_j g_j = dh . h from the saved output; otherwise (h rounded to bf16 / fp16 would
carry its rounding into a difference that can cancel) twice: sum_j a_j g_j first, then dv_i. dq is summed
per program in fp32, then over the programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import eager_only

# elements per row block (rows x padded d): one row per program from d = 513 on (a launch sweep at
# k3-small's d = 768 found one row a program faster than 8, forward and backward, at 3 to 9 sources)
ROWS = 1024
MAX_D = 16384  # widest row a program holds in registers
MAX_PROGRAMS = 8192  # backward programs at most, each over consecutive row blocks ...
DQ_PARTIALS = 2**23  # ... and at most this many fp32 dq partials (programs x padded d): at K3's d = 7168
# more programs than that cost more in the partials' sum than they gain


@triton.jit(do_not_specialize=["n_rows"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def aggregate_fwd_kernel(srcs, q, h, logit, rstd, n_rows, eps, S: tl.constexpr, D: tl.constexpr,
                         BD: tl.constexpr, BR: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mr, md = rows < n_rows, cols < D
    m = mr[:, None] & md[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    b_q = tl.load(q + cols, mask=md, other=0.0)
    run_max = tl.full([BR], float("-inf"), tl.float32)
    z = tl.zeros([BR], dtype=tl.float32)
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    for i in tl.static_range(S):
        v = tl.load(srcs[i] + off, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        lg = r * tl.sum(v * b_q[None, :], axis=1)
        tl.store(logit + i * n_rows + rows, lg, mask=mr)
        tl.store(rstd + i * n_rows + rows, r, mask=mr)
        new_max = tl.maximum(run_max, lg)
        keep, p = tl.exp(run_max - new_max), tl.exp(lg - new_max)  # keep = 0 at the first source
        z = z * keep + p
        acc = acc * keep[:, None] + p[:, None] * v
        run_max = new_max
    tl.store(h + off, (acc / z[:, None]).to(h.dtype.element_ty), mask=m)


@triton.jit
def softmax_weight(logit, rows, mr, n_rows, i, run_max, z):
    """a_i of these rows from the saved logits, the max and the normaliser."""
    return tl.exp(tl.load(logit + i * n_rows + rows, mask=mr, other=0.0) - run_max) / z


@triton.jit(do_not_specialize=["n_rows", "per_prog"])  # counts of tokens: one compile for any length (kernels/__init__.py)
def aggregate_bwd_kernel(srcs, q, h, logit, rstd, dh, dsrcs, dq_part, n_rows, per_prog, S: tl.constexpr,
                         D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, H_SAVED: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    md = cols < D
    b_q = tl.load(q + cols, mask=md, other=0.0)
    b_dq = tl.zeros([BD], dtype=tl.float32)
    blk = 0
    while blk < per_prog:  # this program's row blocks, one after another (a while: the interpreter
        rows = (pid * per_prog + blk) * BR + tl.arange(0, BR)  # cannot range() over an int argument)
        blk += 1
        mr = rows < n_rows
        m = mr[:, None] & md[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        b_dh = tl.load(dh + off, mask=m, other=0.0).to(tl.float32)
        # softmax statistics of the saved logits
        run_max = tl.full([BR], float("-inf"), tl.float32)
        for i in tl.static_range(S):
            run_max = tl.maximum(run_max, tl.load(logit + i * n_rows + rows, mask=mr, other=0.0))
        z = tl.zeros([BR], dtype=tl.float32)
        for i in tl.static_range(S):
            z += tl.exp(tl.load(logit + i * n_rows + rows, mask=mr, other=0.0) - run_max)
        # gbar = sum_j a_j g_j = dh . h: from the fp32 output when it was saved, else over the sources
        if H_SAVED:
            gbar = tl.sum(b_dh * tl.load(h + off, mask=m, other=0.0), axis=1)
        else:
            gbar = tl.zeros([BR], dtype=tl.float32)
            for i in tl.static_range(S):
                v = tl.load(srcs[i] + off, mask=m, other=0.0).to(tl.float32)
                gbar += softmax_weight(logit, rows, mr, n_rows, i, run_max, z) * tl.sum(b_dh * v, axis=1)
        # dv_i and this block's share of dq
        for i in tl.static_range(S):
            v = tl.load(srcs[i] + off, mask=m, other=0.0).to(tl.float32)
            a = softmax_weight(logit, rows, mr, n_rows, i, run_max, z)
            lg = tl.load(logit + i * n_rows + rows, mask=mr, other=0.0)
            r = tl.load(rstd + i * n_rows + rows, mask=mr, other=0.0)
            dl = a * (tl.sum(b_dh * v, axis=1) - gbar)
            dv = a[:, None] * b_dh + dl[:, None] * (r[:, None] * b_q[None, :] - (r * r * lg / D)[:, None] * v)
            tl.store(dsrcs[i] + off, dv.to(dsrcs[i].dtype.element_ty), mask=m)
            b_dq += tl.sum((dl * r)[:, None] * v, axis=0)
    tl.store(dq_part + pid * D + cols, b_dq, mask=md)


def launch_settings(d):
    """(BD, BR, num_warps): the padded row, rows per block, warps (about 16 elements of a row block each)."""
    BD = triton.next_power_of_2(d)
    BR = max(1, ROWS // BD)
    return BD, BR, min(16, max(4, BR * BD // 512))


class Aggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, eps, *sources):
        shape, d = sources[0].shape, sources[0].shape[-1]
        srcs = tuple(s.contiguous() for s in sources)
        n = srcs[0].numel() // d
        BD, BR, warps = launch_settings(d)
        h = torch.empty(shape, dtype=srcs[0].dtype, device=srcs[0].device)
        logit = torch.empty(len(srcs), n, dtype=torch.float32, device=h.device)
        rstd = torch.empty_like(logit)
        q = query.contiguous()
        aggregate_fwd_kernel[(triton.cdiv(n, BR),)](
            srcs, q, h, logit, rstd, n, float(eps), S=len(srcs), D=d, BD=BD, BR=BR, num_warps=warps
        )  # fmt: skip
        # an fp32 h is kept for the backward's dh . h (the next layer's norm keeps the same tensor)
        ctx.save_for_backward(q, logit, rstd, h if h.dtype == torch.float32 else None, *srcs)
        return h

    @staticmethod
    def backward(ctx, dh):
        q, logit, rstd, h, *srcs = ctx.saved_tensors
        S, n = logit.shape
        d = q.shape[0]
        BD, BR, warps = launch_settings(d)
        per_prog = triton.cdiv(triton.cdiv(n, BR), min(MAX_PROGRAMS, max(1, DQ_PARTIALS // BD)))
        grid = triton.cdiv(n, BR * per_prog)
        dsrcs = tuple(torch.empty_like(s) for s in srcs)
        dq_part = torch.empty(grid, d, dtype=torch.float32, device=q.device)
        aggregate_bwd_kernel[(grid,)](
            tuple(srcs), q, h if h is not None else q, logit, rstd, dh.contiguous(), dsrcs, dq_part, n, per_prog,
            S=S, D=d, BD=BD, BR=BR, H_SAVED=h is not None, num_warps=warps,
        )  # fmt: skip
        return dq_part.sum(0), None, *dsrcs


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
def aggregate_triton(sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """h = sum_i softmax_i(RMSNorm(v_i) . query) v_i by the kernels: sources of one shape [..., d], each
    fp32 / bf16 / fp16 (2 <= S <= 16, d <= MAX_D), query fp32 [d]; h in the first source's dtype, each
    source's gradient in its own."""
    return Aggregate.apply(query, eps, *sources)
