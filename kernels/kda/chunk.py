"""``chunk_kda``: the chunkwise KDA entry point used for training and prefill.

Picks the Triton kernel (``triton_chunk.py``) on CUDA and the PyTorch reference
(``chunk_reference.py``) elsewhere; see ``k3rl.kernels._backend``.
"""

from __future__ import annotations

from .._backend import resolve_backend
from .chunk_reference import chunk_kda_reference

HAS_TRITON_CHUNK = True


def triton_eligible(q, v, chunk_size, lower_bound) -> bool:
    """Whether the Triton kernel covers these settings (otherwise "auto" uses the reference)."""
    safe = lower_bound is not None and -5.0 <= lower_bound < 0
    return safe and chunk_size == 64 and q.shape[-1] <= 256 and v.shape[-1] <= 256


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=64,
    backend="auto",
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=-5.0,
):
    """Kimi Delta Attention, chunkwise-parallel form. Returns ``(o, final_state)``.

    Layouts (flash-linear-attention):
      q, k          [B, T, H, K]   (any float dtype; L2-normalised here when ``use_qk_l2norm_in_kernel``)
      v             [B, T, H, V]
      g             [B, T, H, K]   log-decay (<= 0), or the raw gate logit z when ``use_gate_in_kernel``:
                                   g = lower_bound * sigmoid(exp(A_log) * (z + dt_bias)), or with
                                   ``lower_bound=None`` the old g = -exp(A_log) * softplus(z + dt_bias)
      beta          [B, T, H]      write strength, already in (0, 1)
      A_log         [H]; dt_bias [H*K] or [H, K]  (only with ``use_gate_in_kernel``)
      scale         float, default K**-0.5 (applied to q)
      initial_state [B, H, K, V] fp32, or [N, H, K, V] with ``cu_seqlens``
      cu_seqlens    [N+1] int: packed batch of N documents (B must be 1); the state restarts
                    at every document
    The Triton kernel (CUDA default) needs the safe gate: -5 <= lower_bound < 0, and with a raw
    ``g`` (``use_gate_in_kernel=False``) the caller promises g >= lower_bound per token; other
    settings run the reference under "auto" and raise under "triton".
    Returns o [B, T, H, V] in v's dtype and the final state [B or N, H, K, V] in fp32
    (``None`` unless ``output_final_state``). Intermediates and the state are fp32.
    """
    path = resolve_backend(backend, "chunk_kda", q, k, v, g, beta, has_triton=HAS_TRITON_CHUNK)
    if path == "triton" and backend == "auto" and not triton_eligible(q, v, chunk_size, lower_bound):
        path = "torch"  # the kernel needs the safe gate, chunk 64 and head dims <= 256
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    kwargs = dict(
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
    )
    if path == "triton":
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_chunk import chunk_kda_triton

        return chunk_kda_triton(*args, **kwargs)
    return chunk_kda_reference(*args, **kwargs)
