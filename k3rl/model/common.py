"""Small shared pieces: RMSNorm, fp32 islands, the SiTU-GLU MLP."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from k3rl.kernels.rmsnorm import rms_norm
from k3rl.kernels.situ import situ_glu


@contextlib.contextmanager
def fp32_island(x: torch.Tensor):
    """Disable autocast for the device of `x`, so code inside really runs in fp32.

    Under `torch.autocast(bfloat16)` a linear or conv with fp32 inputs would otherwise be
    downcast to bf16; the router, the KDA gate/conv and the AttnRes scores must stay fp32.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        yield


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes x's matmuls in on x's device, or None outside autocast."""
    dev = x.device.type
    if dev != "meta" and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def matmul_input(x: torch.Tensor) -> torch.Tensor:
    """x cast once to the autocast dtype, for a mixer whose several projections read it.

    Autocast casts an fp32 activation again at every linear that reads it, and its backward widens
    each of their input gradients to fp32 before summing them: a KDA layer's five projections cost
    five casts forward and five widenings and four fp32 sums backward (the dtype-copy count of
    benchmarks/dtype_copies.py). Cast once, the forward values are the same bits; the projections'
    input gradients are summed in the autocast dtype and widened once. A no-op outside autocast.
    """
    dt = autocast_dtype(x)
    return x.to(dt) if dt is not None and x.is_floating_point() and x.dtype != dt else x


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps), statistic in fp32, result in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm_eps(x; gamma) = gamma * x / sqrt(mean(x^2) + eps).

    The statistic is fp32; gamma multiplies after the downcast to the input dtype, as the
    reference code does (docs/model.md §0). One fused kernel on CUDA (``kernels/rmsnorm``);
    ``backend`` is the model's ``kernel_backend`` (K3ForCausalLM sets it).
    """

    def __init__(self, dim: int, eps: float, backend: str = "auto"):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.backend)


class SiTUGLUMLP(nn.Module):
    """down( SiTU-GLU(gate(x), up(x)) ): the dense layer-0 MLP and the fused shared experts.

    SiTU-GLU(g, u) = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)] (docs/model.md §5.4), computed
    by the kernels op. Two shared experts of width f equal one expert of width 2f (§5.3 step 5),
    so they are stored fused at full width.
    """

    def __init__(self, hidden: int, intermediate: int, beta_gate: float, beta_up: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.beta_gate, self.beta_up = beta_gate, beta_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = matmul_input(x)
        act = situ_glu(self.gate_proj(x), self.up_proj(x), beta_gate=self.beta_gate, beta_up=self.beta_up)
        return self.down_proj(act)

