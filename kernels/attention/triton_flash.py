"""Flash attention in Triton for Gated MLA's packed documents, with an optional prefix shared by every document.

What it computes is ``causal_attention``'s packed case (``reference.py``), and with ``k_prefix``/``v_prefix``
``shared_prefix_attention``'s: query i of document n sees the P prefix keys, then its own document's keys
j <= i. Per query row, online softmax over key blocks, in fp32 (FlashAttention-2, Dao 2023):

    s_j = scale q . k_j                     (tl.dot of the inputs' dtype, fp32 accumulation)
    m' = max(m, max_j s_j);  l' = l e^(m - m') + sum_j e^(s_j - m');  acc' = acc e^(m - m') + sum_j e^(s_j - m') v_j
    o = acc / l (fp32, as K3's MLA keeps it up to o_proj),   lse = m + log l

Backward, from lse and delta_i = sum_d dO_id o_id (no score matrix stored):

    p_ij = e^(s_ij - lse_i);  dv_j = sum_i p_ij dO_i;  ds_ij = p_ij (dO_i . v_j - delta_i)
    dq_i = scale sum_j ds_ij k_j;  dk_j = scale sum_i ds_ij q_i

The prefix is read in place by every document's programs (no per-document copy of its keys and values, which
the SDPA path of ``shared_prefix_attention`` makes) and its key gradients sum over every query of the batch.
Head dims are padded to a power of two inside the kernel (MLA's 192 runs as 256). fp32 inputs multiply in
IEEE fp32 (no TF32), so the fp32 path matches the reference to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the best of benchmarks/mla_attention.py --sweep on an H100 (2026-12-06, bf16, 96 heads, MLA's 192/128):
# forward + backward of 8K packed tokens 12.9 ms (64 x 64 at 4 warps: 18.6 ms), of a 4K prefix shared by
# 16 branches 18.6 ms (23.7 ms)
BLOCK_M, BLOCK_N = 128, 64
LAUNCH = {"num_warps": 8, "num_stages": 2}


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; fp32 inputs in IEEE fp32 (no TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend(b_q, k_ptrs, v_ptrs, k_mask, v_mask, ok, acc, m_i, l_i, scale, IEEE: tl.constexpr):
    """One key block's online-softmax update of (acc, m, l) for a query block; ok [BM, BN] the pairs that
    attend, k_mask / v_mask the key and value elements that exist (the rest load as zero)."""
    b_k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    s = tl.where(ok, _dot(b_q, tl.trans(b_k), IEEE) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    b_v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    return acc * alpha[:, None] + _dot(p.to(b_v.dtype), b_v, IEEE), m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=["P"])  # token counts: one compile for any length (kernels/__init__.py)
def flash_fwd_kernel(q, k, v, kp, vp, cu, o, lse, scale, H, P,
                     D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    mb, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu + n)
    L = tl.load(cu + n + 1) - start
    if mb * BM >= L:
        return
    rows = mb * BM + tl.arange(0, BM)
    cols, vcols = tl.arange(0, BD), tl.arange(0, BDV)
    mr = rows < L
    q_off = (start + rows).to(tl.int64)[:, None] * H * D + h * D + cols[None, :]
    b_q = tl.load(q + q_off, mask=mr[:, None] & (cols < D)[None, :], other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    cmask, vmask = (cols < D)[None, :], (vcols < DV)[None, :]
    j0 = 0
    while j0 < P:  # the shared prefix: every query sees every key
        keys = j0 + tl.arange(0, BN)
        mk = keys < P
        kk = keys.to(tl.int64)[:, None]
        acc, m_i, l_i = _attend(b_q, kp + kk * H * D + h * D + cols[None, :], vp + kk * H * DV + h * DV + vcols[None, :],
                                mk[:, None] & cmask, mk[:, None] & vmask, mk[None, :], acc, m_i, l_i, scale, IEEE)
        j0 += BN
    j0 = 0
    end = tl.minimum(L, (mb + 1) * BM)
    while j0 < end:  # the document's own keys, causal
        keys = j0 + tl.arange(0, BN)
        mk = keys < L
        kk = (start + keys).to(tl.int64)[:, None]
        acc, m_i, l_i = _attend(b_q, k + kk * H * D + h * D + cols[None, :], v + kk * H * DV + h * DV + vcols[None, :],
                                mk[:, None] & cmask, mk[:, None] & vmask, mk[None, :] & (keys[None, :] <= rows[:, None]),
                                acc, m_i, l_i, scale, IEEE)
        j0 += BN
    o_off = (start + rows).to(tl.int64)[:, None] * H * DV + h * DV + vcols[None, :]
    tl.store(o + o_off, acc / l_i[:, None], mask=mr[:, None] & (vcols < DV)[None, :])
    tl.store(lse + (start + rows).to(tl.int64) * H + h, m_i + tl.log(l_i), mask=mr)


@triton.jit
def _key_block_grads(q, do, lse, delta, b_k, b_v, rows, q_rows_ok, keys, causal: tl.constexpr, scale, H,
                     D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, IEEE: tl.constexpr):
    """One query block's contribution to a key block's dk, dv (rows: absolute query rows; keys, when
    causal, positions comparable with `rows`)."""
    cols, vcols = tl.arange(0, BD), tl.arange(0, BDV)
    off = rows.to(tl.int64)
    b_q = tl.load(q + off[:, None] * H * D + tl.program_id(2) * D + cols[None, :],
                  mask=q_rows_ok[:, None] & (cols < D)[None, :], other=0.0)
    b_do = tl.load(do + off[:, None] * H * DV + tl.program_id(2) * DV + vcols[None, :],
                   mask=q_rows_ok[:, None] & (vcols < DV)[None, :], other=0.0)
    b_lse = tl.load(lse + off * H + tl.program_id(2), mask=q_rows_ok, other=0.0)
    b_delta = tl.load(delta + off * H + tl.program_id(2), mask=q_rows_ok, other=0.0)
    s = _dot(b_q, tl.trans(b_k), IEEE) * scale
    dp = _dot(b_do, tl.trans(b_v), IEEE)
    ok = q_rows_ok[:, None]
    if causal:
        ok = ok & (keys[None, :] <= rows[:, None])
    p = tl.where(ok, tl.exp(s - b_lse[:, None]), 0.0)
    ds = p * (dp - b_delta[:, None])
    dv = _dot(tl.trans(p.to(b_do.dtype)), b_do, IEEE)
    dk = _dot(tl.trans(ds.to(b_q.dtype)), b_q, IEEE) * scale
    return dk, dv


@triton.jit
def flash_bwd_kv_kernel(q, k, v, do, lse, delta, cu, dk, dv, scale, H,
                        D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """dk, dv of a document's own key block: the document's queries at or after it."""
    nb, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu + n)
    L = tl.load(cu + n + 1) - start
    if nb * BN >= L:
        return
    keys = nb * BN + tl.arange(0, BN)
    cols, vcols = tl.arange(0, BD), tl.arange(0, BDV)
    mk = keys < L
    k_off = (start + keys).to(tl.int64)[:, None]
    b_k = tl.load(k + k_off * H * D + h * D + cols[None, :], mask=mk[:, None] & (cols < D)[None, :], other=0.0)
    b_v = tl.load(v + k_off * H * DV + h * DV + vcols[None, :], mask=mk[:, None] & (vcols < DV)[None, :], other=0.0)
    acc_k = tl.zeros([BN, BD], tl.float32)
    acc_v = tl.zeros([BN, BDV], tl.float32)
    i0 = (nb * BN // BM) * BM  # the first query block that reaches this key block
    while i0 < L:
        rows = i0 + tl.arange(0, BM)
        g_k, g_v = _key_block_grads(q + start * H * D, do + start * H * DV, lse + start * H, delta + start * H,
                                    b_k, b_v, rows, rows < L, keys, True, scale, H, D, DV, BD, BDV, IEEE)
        acc_k += g_k
        acc_v += g_v
        i0 += BM
    tl.store(dk + k_off * H * D + h * D + cols[None, :], acc_k, mask=mk[:, None] & (cols < D)[None, :])
    tl.store(dv + k_off * H * DV + h * DV + vcols[None, :], acc_v, mask=mk[:, None] & (vcols < DV)[None, :])


@triton.jit(do_not_specialize=["P", "T"])  # token counts: one compile for any length (kernels/__init__.py)
def flash_bwd_prefix_kernel(q, kp, vp, do, lse, delta, dkp, dvp, scale, H, P, T,
                            D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """dk, dv of a prefix key block: every query of the batch sees it (the sum over the documents)."""
    nb, h = tl.program_id(0), tl.program_id(2)
    keys = nb * BN + tl.arange(0, BN)
    cols, vcols = tl.arange(0, BD), tl.arange(0, BDV)
    mk = keys < P
    k_off = keys.to(tl.int64)[:, None]
    b_k = tl.load(kp + k_off * H * D + h * D + cols[None, :], mask=mk[:, None] & (cols < D)[None, :], other=0.0)
    b_v = tl.load(vp + k_off * H * DV + h * DV + vcols[None, :], mask=mk[:, None] & (vcols < DV)[None, :], other=0.0)
    acc_k = tl.zeros([BN, BD], tl.float32)
    acc_v = tl.zeros([BN, BDV], tl.float32)
    i0 = 0
    while i0 < T:
        rows = i0 + tl.arange(0, BM)
        g_k, g_v = _key_block_grads(q, do, lse, delta, b_k, b_v, rows, rows < T, keys, False, scale, H,
                                    D, DV, BD, BDV, IEEE)
        acc_k += g_k
        acc_v += g_v
        i0 += BM
    tl.store(dkp + k_off * H * D + h * D + cols[None, :], acc_k, mask=mk[:, None] & (cols < D)[None, :])
    tl.store(dvp + k_off * H * DV + h * DV + vcols[None, :], acc_v, mask=mk[:, None] & (vcols < DV)[None, :])


@triton.jit
def _query_block_grad(b_q, b_do, b_lse, b_delta, k_ptrs, v_ptrs, k_mask, v_mask, ok, scale, IEEE: tl.constexpr):
    """dq (before its scale) of a query block from one key block: k_mask, v_mask the elements that exist,
    ok [BM, BN] the pairs that attend."""
    b_k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    b_v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    s = _dot(b_q, tl.trans(b_k), IEEE) * scale
    dp = _dot(b_do, tl.trans(b_v), IEEE)
    p = tl.where(ok, tl.exp(s - b_lse[:, None]), 0.0)
    ds = p * (dp - b_delta[:, None])
    return _dot(ds.to(b_k.dtype), b_k, IEEE)


@triton.jit(do_not_specialize=["P"])  # token counts: one compile for any length (kernels/__init__.py)
def flash_bwd_q_kernel(q, k, v, kp, vp, do, lse, delta, cu, dq, scale, H, P,
                       D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    mb, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu + n)
    L = tl.load(cu + n + 1) - start
    if mb * BM >= L:
        return
    rows = mb * BM + tl.arange(0, BM)
    cols, vcols = tl.arange(0, BD), tl.arange(0, BDV)
    mr = rows < L
    off = (start + rows).to(tl.int64)
    b_q = tl.load(q + off[:, None] * H * D + h * D + cols[None, :], mask=mr[:, None] & (cols < D)[None, :], other=0.0)
    b_do = tl.load(do + off[:, None] * H * DV + h * DV + vcols[None, :], mask=mr[:, None] & (vcols < DV)[None, :],
                   other=0.0)
    b_lse = tl.load(lse + off * H + h, mask=mr, other=0.0)
    b_delta = tl.load(delta + off * H + h, mask=mr, other=0.0)
    cmask, vmask = (cols < D)[None, :], (vcols < DV)[None, :]
    acc = tl.zeros([BM, BD], tl.float32)
    j0 = 0
    while j0 < P:
        keys = j0 + tl.arange(0, BN)
        kk = keys.to(tl.int64)[:, None]
        acc += _query_block_grad(b_q, b_do, b_lse, b_delta, kp + kk * H * D + h * D + cols[None, :],
                                 vp + kk * H * DV + h * DV + vcols[None, :], (keys < P)[:, None] & cmask,
                                 (keys < P)[:, None] & vmask, mr[:, None] & (keys < P)[None, :], scale, IEEE)
        j0 += BN
    j0 = 0
    end = tl.minimum(L, (mb + 1) * BM)
    while j0 < end:
        keys = j0 + tl.arange(0, BN)
        kk = (start + keys).to(tl.int64)[:, None]
        ok = mr[:, None] & (keys < L)[None, :] & (keys[None, :] <= rows[:, None])
        acc += _query_block_grad(b_q, b_do, b_lse, b_delta, k + kk * H * D + h * D + cols[None, :],
                                 v + kk * H * DV + h * DV + vcols[None, :], (keys < L)[:, None] & cmask,
                                 (keys < L)[:, None] & vmask, ok, scale, IEEE)
        j0 += BN
    tl.store(dq + off[:, None] * H * D + h * D + cols[None, :], acc * scale, mask=mr[:, None] & (cols < D)[None, :])


def _launch_shape(q, v, cu_host):
    T, H, D = q.shape
    DV = v.shape[-1]
    longest = max(b - a for a, b in zip(cu_host[:-1], cu_host[1:], strict=True))
    return T, H, D, DV, triton.next_power_of_2(D), triton.next_power_of_2(DV), longest


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_prefix, v_prefix, cu_seqlens, cu_host, scale):
        T, H, D, DV, BD, BDV, longest = _launch_shape(q, v, cu_host)
        N = len(cu_host) - 1
        P = 0 if k_prefix is None else k_prefix.shape[0]
        kp = k if k_prefix is None else k_prefix.contiguous()
        vp = v if v_prefix is None else v_prefix.contiguous()
        o = torch.empty(T, H, DV, device=q.device, dtype=torch.float32)
        lse = torch.empty(T, H, device=q.device, dtype=torch.float32)
        ieee = q.dtype == torch.float32
        flash_fwd_kernel[(triton.cdiv(longest, BLOCK_M), N, H)](
            q, k, v, kp, vp, cu_seqlens, o, lse, scale, H, P, D, DV, BD, BDV, BLOCK_M, BLOCK_N, ieee, **LAUNCH)
        ctx.save_for_backward(q, k, v, kp, vp, cu_seqlens, o, lse)
        ctx.meta = (cu_host, scale, P, k_prefix is not None)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, kp, vp, cu_seqlens, o, lse = ctx.saved_tensors
        cu_host, scale, P, has_prefix = ctx.meta
        T, H, D, DV, BD, BDV, longest = _launch_shape(q, v, cu_host)
        N = len(cu_host) - 1
        ieee = q.dtype == torch.float32
        do = do.to(v.dtype).contiguous()
        delta = (do.float() * o).sum(-1)  # [T, H]: sum_d dO o
        dq = torch.empty(T, H, D, device=q.device, dtype=torch.float32)
        dk = torch.empty_like(dq)
        dv = torch.empty(T, H, DV, device=q.device, dtype=torch.float32)
        flash_bwd_q_kernel[(triton.cdiv(longest, BLOCK_M), N, H)](
            q, k, v, kp, vp, do, lse, delta, cu_seqlens, dq, scale, H, P, D, DV, BD, BDV, BLOCK_M, BLOCK_N, ieee, **LAUNCH)
        flash_bwd_kv_kernel[(triton.cdiv(longest, BLOCK_N), N, H)](
            q, k, v, do, lse, delta, cu_seqlens, dk, dv, scale, H, D, DV, BD, BDV, BLOCK_M, BLOCK_N, ieee, **LAUNCH)
        dkp = dvp = None
        if has_prefix:
            dkp = torch.empty(P, H, D, device=q.device, dtype=torch.float32)
            dvp = torch.empty(P, H, DV, device=q.device, dtype=torch.float32)
            flash_bwd_prefix_kernel[(triton.cdiv(P, BLOCK_N), 1, H)](
                q, kp, vp, do, lse, delta, dkp, dvp, scale, H, P, T, D, DV, BD, BDV, BLOCK_M, BLOCK_N, ieee, **LAUNCH)
            dkp, dvp = dkp.to(kp.dtype), dvp.to(vp.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dkp, dvp, None, None, None


def flash_attention(q, k, v, scale, cu_seqlens, cu_host, k_prefix=None, v_prefix=None):
    """Packed causal attention: q, k [T, H, D], v [T, H, Dv] of the documents `cu_seqlens` [N+1] (int32, on
    the device; `cu_host` the same offsets as a list), each also seeing `k_prefix`/`v_prefix` [P, H, D|Dv]
    if given. Returns o [T, H, Dv] fp32. q, k, v and the prefix share one dtype (fp32 or bf16)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return FlashAttention.apply(q, k, v, k_prefix, v_prefix, cu_seqlens.to(torch.int32), list(cu_host), scale)
