"""Chunkwise KDA in Triton: forward and backward (docs/model.md §2.5-2.6), chunk C = 64, 16-token sub-tiles.

This module is the host side (launch configuration, chunk tables, the autograd functions and
``chunk_kda_triton``); the kernels live in one module per stage, in the order they run
(one program per (chunk, head) unless said otherwise):

  triton_chunk_gate.py    gate_cumsum_fwd / _bwd: g = lower_bound * sigmoid(exp(A_log) (z + dt_bias))
                          (optional), G = chunk-local cumsum; backward: reverse cumsum, gate derivative
  triton_chunk_intra.py   intra_blocks_fwd per (chunk and 16-row block, head): A_qk, A_kk by 16x16
                          blocks (dense thanks to the bounded gate), the diagonal blocks' inverses,
                          QG = Q Gamma, KD = K e^{G_C - G}, beta Gamma K (intra_fwd: all of stages 2-3
                          in one kernel, CONFIG["split_intra"] = False: slower, at 255 registers)
  triton_chunk_solve.py   intra_solve_fwd: T~ = (I + A_kk)^-1 by block forward substitution,
                          W = T~ (beta Gamma K), U = T~ (beta V)
  triton_chunk_state.py   state_fwd, serial over chunks per (document, head, V-block):
                          V~ = U - W S; O = (Q Gamma) S + A_qk V~; S <- Diag(Gamma_C) S + ((Gamma_C/Gamma) K)^T V~;
                          state_bwd in reverse: dV~ = A_qk^T dO + Kd dS';  dS = (Q Gamma)^T dO + Gamma_C dS' - W^T dV~
  triton_chunk_output.py  output_fwd: O by a parallel kernel after the serial pass (CONFIG["split_output"])
  triton_chunk_grads.py   grads_chunk: gradients through O, the state update and the WY factors;
                          grads_subtiles: through A_qk / A_kk by 16x16 blocks on and below the diagonal
  triton_chunk_tiles.py   the chunk / sub-tile sizes and the 16x16 block helpers they share

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

import functools

import torch
import triton
from torch.utils.weak import WeakTensorKeyDictionary

from .._backend import eager_only, interpreter_on
from ..varlen import host_offsets
from .gate import L2NORM_EPS
from .inputs import check_kda_inputs
from .triton_chunk_gate import gate_cumsum_bwd_kernel, gate_cumsum_fwd_kernel
from .triton_chunk_grads import grads_chunk_kernel, grads_subtiles_kernel
from .triton_chunk_intra import intra_blocks_fwd_kernel, intra_fwd_kernel
from .triton_chunk_output import output_fwd_kernel
from .triton_chunk_solve import intra_solve_fwd_kernel
from .triton_chunk_state import state_bwd_kernel, state_fwd_kernel
from .triton_chunk_tiles import CHUNK
from .triton_l2norm import l2norm_scale_bwd, l2norm_scale_triton


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
# (from its host values, `host_offsets`) and reused while that tensor lives and is not modified in place.
_TABLES = WeakTensorKeyDictionary()


@functools.lru_cache(maxsize=512)
def _equal_tables(B, T, device):
    """B equal sequences of length T (an engine's batched prefill chunk): the tables depend on (B, T) alone,
    built once each instead of three host-to-device copies in every KDA layer of every prefill forward."""
    return _tables_from_lengths([T] * B, device)


def _chunk_tables(B, T, cu_seqlens, device):
    if cu_seqlens is None:  # B sequences of length T: no device read at all
        return _equal_tables(B, T, torch.device(device))
    hit = _TABLES.get(cu_seqlens)
    if hit is not None and hit[0] == (cu_seqlens._version, device):
        return hit[1]
    cs = host_offsets(cu_seqlens)
    tables = _tables_from_lengths([b - a for a, b in zip(cs[:-1], cs[1:], strict=True)], device)
    _TABLES[cu_seqlens] = ((cu_seqlens._version, device), tables)
    return tables


# launch configuration; BV = value-block width of the serial state kernels (more programs when smaller)
# (3 pipeline stages of the serial loops need 234 KB of shared memory, over the 227 KB of an H100/H200;
# 2 stages prefetch the next chunk's tiles, though their 152 KB of shared memory leave one state program
# per SM). maxnreg_* caps registers per thread (None: the compiler's choice).
# Each value is the best of a launch sweep on the GPU (benchmarks/kernels.py --only sweep).
CONFIG = {
    # fuse_l2norm: q/k L2 norm inside intra_blocks_fwd as it reads the rows, instead of a pass of its own
    # (needs split_intra)
    "fuse_l2norm": True,
    "warps_gate": 8,  # gate_cumsum_fwd (the gate + cumsum inside intra_blocks_fwd was slower and removed)
    "BV": 64, "warps_state": 4, "stages_state": 2,  # state_fwd (BV 128 at 8 warps: one program per head)
    "BV_intra": 64,  # U = T~ (beta V) by V blocks of this width in intra_solve_fwd / intra_fwd
    # intra_blocks_fwd + intra_solve_fwd (split_intra; False: the single intra_fwd kernel, 8 warps)
    "split_intra": True, "warps_blocks": 4, "warps_solve": 4, "warps_intra": 8, "maxnreg_intra": None,
    "split_output": False, "BV_out": 64, "warps_out": 4,  # split: O by a parallel kernel after the serial pass
    "BV_bwd": 64, "warps_state_bwd": 4, "stages_state_bwd": 1,  # state_bwd
    # grads_chunk and grads_subtiles take K in slices (BKS, BKS_tiles): the same sums in other slices,
    # sized by the sweep at 1 x 16384 x 96. stages_grads 1 faults (illegal address; Triton 3.6), so 2 stays.
    "BKS": 32, "BV_grads": 64, "warps_grads": 4, "stages_grads": 2, "maxnreg_grads": None,  # grads_chunk
    "BKS_tiles": 64, "warps_subtiles": 4,  # grads_subtiles
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


@eager_only  # compiled callers run it as it is (launch settings are computed on the host)
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
