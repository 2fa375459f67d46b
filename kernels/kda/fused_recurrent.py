"""``fused_recurrent_kda``: token-by-token KDA for decoding (state in, state out).

Picks the Triton kernel (``triton_recurrent.py``) on CUDA and the per-token PyTorch
loop (``naive.py``) elsewhere.
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .inputs import check_inplace_state
from .naive import naive_recurrent_kda

HAS_TRITON_RECURRENT = True


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    backend="auto",
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=-5.0,
    inplace_final_state=False,
):
    """Kimi Delta Attention, recurrent form (decode: usually T = 1 with a carried state).

    Same layouts, arguments and returns as ``chunk_kda`` (without ``chunk_size``):
    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V] fp32.
    Returns ``(o [B, T, H, V] in v's dtype, final_state fp32 or None)``.
    With ``inplace_final_state`` the final state is written over ``initial_state`` (fp32, contiguous)
    and returned: a decode cache is updated where it lies, with no second state buffer.
    The Triton kernel is inference-only; with gradients required "auto" uses the PyTorch loop.
    """
    if inplace_final_state:
        check_inplace_state(initial_state, "fused_recurrent_kda")
        output_final_state = True
    path = resolve_backend(backend, "fused_recurrent_kda", q, k, v, g, beta, has_triton=HAS_TRITON_RECURRENT)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias)
    )
    if path == "triton" and backend == "auto" and needs_grad:
        path = "torch"  # the Triton kernel is inference-only (decode)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    kwargs = dict(
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
    )
    if path == "triton":
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_recurrent import fused_recurrent_kda_triton

        return fused_recurrent_kda_triton(*args, **kwargs, inplace_final_state=inplace_final_state)
    o, final = naive_recurrent_kda(*args, **kwargs)
    if inplace_final_state:
        final = initial_state.copy_(final)
    return o, final
