"""Shape checks and the shared pre-processing of every KDA entry point.

Layouts (flash-linear-attention): q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K];
beta [B, T, H]; state [B, H, K, V] fp32 ([N, H, K, V] with cu_seqlens of N documents).
"""

from __future__ import annotations

import torch

from ..varlen import host_offsets, pad_documents, unpad_documents
from .gate import compute_dtype, kda_gate, l2norm


def check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, op: str) -> None:
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be a {nd}-D tensor (layout [B, T, H, ...]), got {shape}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"{op}: q, k and g must share shape [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}"
        )
    if v.shape[:3] != (B, T, H):
        raise ValueError(
            f"{op}: v must be [B, T, H, V] with B, T, H of q {tuple(q.shape)}; got {tuple(v.shape)}"
        )
    if beta.shape != (B, T, H):
        raise ValueError(f"{op}: beta must be [B, T, H] = {(B, T, H)}; got {tuple(beta.shape)}")
    n_states = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{op}: with cu_seqlens the batch must be packed to B=1; got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"{op}: cu_seqlens must be a 1-D integer tensor [N+1]; got {cu_seqlens}")
        cs = host_offsets(cu_seqlens)  # read from the device once per tensor, not once per layer
        if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:], strict=False)):
            raise ValueError(
                f"{op}: cu_seqlens must start at 0, be non-decreasing and end at T={T}; got {cs}"
            )
        n_states = len(cs) - 1
    if initial_state is not None and initial_state.shape != (n_states, H, K, v.shape[-1]):
        raise ValueError(
            f"{op}: initial_state must be [{n_states}, H={H}, K={K}, V={v.shape[-1]}] "
            f"({'one per document' if cu_seqlens is not None else 'one per sequence'}); got {tuple(initial_state.shape)}"
        )


def check_inplace_state(initial_state, op: str) -> None:
    """The state an in-place update writes into: given, fp32 and contiguous (the kernel's own layout)."""
    if initial_state is None:
        raise ValueError(
            f"{op}: inplace_final_state=True needs an initial_state to write the final state into"
        )
    if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
        raise ValueError(
            f"{op}: inplace_final_state=True needs a contiguous fp32 initial_state; got {initial_state.dtype}"
            f"{'' if initial_state.is_contiguous() else ', not contiguous'} (pass initial_state.float().contiguous(),"
            " or inplace_final_state=False)"
        )
    if initial_state.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: inplace_final_state=True cannot overwrite a state that requires grad")


def prepare_qkgb(
    q, k, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound
):
    """Apply the in-kernel pre-processing in the compute dtype (fp32, or fp64 for fp64 inputs).

    Returns (q * scale, k, g, beta) with q, k L2-normalised when asked and g the log-decay.
    """
    dt = compute_dtype(q, k, g)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    return q.to(dt) * scale, k.to(dt), g.to(dt), beta.to(dt)


def document_bounds(cu_seqlens, T: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, T)]
    cs = cu_seqlens.tolist()
    return list(zip(cs[:-1], cs[1:], strict=True))


def run_reference(
    core,
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    use_qk_l2norm_in_kernel,
    use_gate_in_kernel,
    A_log,
    dt_bias,
    lower_bound,
    op: str,
):
    """Run a head-first reference ``core(q, k, v, g, beta, S0) -> (o, S)`` on the public layout.

    ``core`` sees [B, H, T, *] tensors in the compute dtype with q already scaled and g the
    log-decay; with ``cu_seqlens`` it runs once per document, the state starting afresh
    (from ``initial_state[i]`` or zeros) at each document.
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, op)
    qs, ks, gs, bs = prepare_qkgb(
        q, k, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound
    )
    dt = qs.dtype
    vs = v.to(dt)
    B, T, H, K = q.shape
    V = v.shape[-1]
    hf = lambda x: x.transpose(1, 2)  # [B, T, H, *] -> [B, H, T, *]
    if cu_seqlens is not None:
        # every document at once: right-pad to the longest (zero padding leaves the state
        # unchanged: g = 0 keeps it, beta = k = 0 writes nothing) and run one batched core
        n_docs = cu_seqlens.numel() - 1
        S0 = (
            torch.zeros(n_docs, H, K, V, dtype=dt, device=q.device)
            if initial_state is None
            else initial_state.to(dt)
        )
        padded = [pad_documents(x, cu_seqlens) for x in (qs, ks, vs, gs, bs)]
        o_p, S = core(*(hf(x) for x in padded[:4]), padded[4].transpose(1, 2), S0)
        o = unpad_documents(o_p.transpose(1, 2), cu_seqlens).to(v.dtype)
        return o, (S if output_final_state else None)
    S0 = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    o, S = core(hf(qs), hf(ks), hf(vs), hf(gs), bs.transpose(1, 2), S0)
    return o.transpose(1, 2).to(v.dtype), (S if output_final_state else None)
