"""SiTU-GLU activation (docs/model.md §5.4): reference, fused Triton kernel, dispatcher."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import SiTUGLUTorch, situ_glu_formula, situ_glu_grads

HAS_TRITON_SITU = True


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0, beta_up: float = 25.0, backend="auto"
):
    """``[b1 tanh(gate/b1) sigmoid(gate)] * [b2 tanh(up/b2)]`` element-wise, any shape.

    ``gate`` and ``up`` have the same shape and dtype; computed in fp32 (fp64 for fp64),
    returned in the input dtype. Backward recomputes from the saved inputs.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"situ_glu: gate and up must match in shape and dtype; got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    if not (beta_gate > 0 and beta_up > 0):
        raise ValueError(f"situ_glu: beta_gate and beta_up must be positive, got {beta_gate}, {beta_up}")
    path = resolve_backend(backend, "situ_glu", gate, up, has_triton=HAS_TRITON_SITU)
    if path == "triton":
        # lazy: triton (Linux only) loads on the first GPU call
        from .triton_situ import situ_glu_triton

        return situ_glu_triton(gate, up, beta_gate, beta_up)
    return SiTUGLUTorch.apply(gate, up, beta_gate, beta_up)


__all__ = ["situ_glu", "situ_glu_formula", "situ_glu_grads"]
