"""Kimi Delta Attention (KDA): naive loop, chunkwise reference, recurrent form, dispatchers.

- ``chunk_kda``             training / prefill entry point (Triton on CUDA, reference elsewhere)
- ``fused_recurrent_kda``   decode entry point (Triton on CUDA, per-token loop elsewhere)
- ``naive_recurrent_kda``   per-token loop of docs/model.md §2.4 (ground truth)
- ``chunk_kda_reference``   chunkwise algorithm of docs/model.md §2.5 in PyTorch
- ``kda_chunk_transition`` / ``kda_transition``  M_chunk of §2.5 step 7 and its product (§9.3)
- ``kda_gate``, ``l2norm``  the gate and q/k normalisation the kernels fuse in
- ``short_conv``, ``output_norm_gate``  the fp32 islands around the recurrence (the short convolution,
  the output norm + gate): references and dispatchers in ``islands.py``, kernels in
  ``triton_short_conv.py`` and ``triton_output_gate.py``

The Triton chunk kernel is ``triton_chunk.py`` (host side: launch settings, autograd, the entry point)
with one module per stage, in the order they run: ``triton_chunk_gate.py`` (gate, chunk cumsum),
``triton_chunk_intra.py`` (A_qk, A_kk blocks), ``triton_chunk_solve.py`` (T~, W, U),
``triton_chunk_state.py`` (the serial state passes), ``triton_chunk_output.py`` and
``triton_chunk_grads.py`` (chunk-local gradients); the decode kernel is ``triton_recurrent.py``.
"""

from .chunk import chunk_kda
from .chunk_reference import chunk_kda_reference, kda_chunk_transition, kda_transition
from .fused_recurrent import fused_recurrent_kda
from .gate import kda_gate, l2norm
from .islands import (
    document_windows,
    output_norm_gate,
    output_norm_gate_reference,
    short_conv,
    short_conv_reference,
)
from .naive import naive_recurrent_kda

__all__ = [
    "chunk_kda",
    "chunk_kda_reference",
    "document_windows",
    "fused_recurrent_kda",
    "kda_chunk_transition",
    "kda_gate",
    "kda_transition",
    "l2norm",
    "naive_recurrent_kda",
    "output_norm_gate",
    "output_norm_gate_reference",
    "short_conv",
    "short_conv_reference",
]
