"""k3rl.kernels: each op beside its pure-PyTorch reference, with a ``backend=`` dispatcher.

Ops (one sub-package each): ``kda`` (chunk and recurrent Kimi Delta Attention), ``situ``
(SiTU-GLU), ``moe`` (latent experts), ``attention`` (causal attention, fp32 output),
``qb_histogram`` (Quantile Balancing), ``newton_schulz`` (batched Muon orthogonalisation).
This package imports nothing else of the project.
"""

from .attention import causal_attention
from .kda import chunk_kda, fused_recurrent_kda, kda_chunk_transition, naive_recurrent_kda
from .moe import latent_experts
from .newton_schulz import newton_schulz
from .qb_histogram import qb_histogram, qb_quantile
from .situ import situ_glu

__all__ = [
    "causal_attention",
    "chunk_kda",
    "fused_recurrent_kda",
    "kda_chunk_transition",
    "latent_experts",
    "naive_recurrent_kda",
    "newton_schulz",
    "qb_histogram",
    "qb_quantile",
    "situ_glu",
]
