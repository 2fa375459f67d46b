"""Stable LatentMoE (docs/model.md §5): fp32 sigmoid router, latent routed experts, shared experts.

    s  = sigmoid(x W_r^T)                    fp32 [N, E]
    T  = argtop_k(s + b)                     b (QB bias) only selects; top-(k+1) gives QB's cutoff
    p  = s_T / (sum_{r in T} s_r + 1e-20) * routed_scaling_factor      fp32, bias-free
    z  = x W_down^T                          [N, l], once per token before dispatch
    u  = sum_{e in T} p_e W2_e SiTU-GLU(W1_e z, W3_e z)                (the kernels op; fp32 combine)
    y  = W_shared_down SiTU-GLU(W_sg x, W_su x)  +  W_up RMSNorm(u)

Under `expert_precision: mxfp4` (K3's QAT recipe, §9.8) every routed-expert GEMM reads MXFP4 weights
and MXFP8 activations, each in blocks of 32 along the GEMM's contraction dimension (mx.py):
    h_e = fq8(SiTU-GLU(fq8(z) fq4(W1_e)^T, fq8(z) fq4(W3_e)^T)) fq4(W2_e)^T
(z and W1_e, W3_e along l; the SiTU-GLU output and W2_e along f), with straight-through gradients
to the master weights and activations. The router, shared experts and projections stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3rl.kernels._backend import resolve_backend
from k3rl.kernels.moe import latent_experts, latent_experts_loop

from . import mxfp4
from .common import RMSNorm, SiTUGLUMLP, autocast_dtype, fp32_island, matmul_input
from .config import K3Config
from .mx import fake_mxfp4, fake_mxfp8
from .quantile_balance import QuantileBalancer


@dataclass
class Routing:
    """What the router decided for N tokens (all detached)."""

    topk_idx: torch.Tensor  # [N, k] int64, the experts used
    scores: torch.Tensor  # [N, E] fp32 sigmoid scores
    cutoff: torch.Tensor  # [N] fp32, the (k+1)-th largest biased score (QB's alpha)


class MoEGate(nn.Module):
    """`mlp.gate`: router weight [E, d] (used in fp32) and `e_score_correction_bias` [E] fp32.

    The bias is a parameter with requires_grad=False: it is part of the checkpoint and of the
    parameter count, but only Quantile Balancing sets it (no optimizer group owns it).
    """

    def __init__(self, config: K3Config):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor, replay_idx: torch.Tensor | None = None):
        """x [N, d] -> (weights p [N, k] fp32, Routing). `replay_idx` [N, k] routes to recorded experts."""
        with fp32_island(x):
            scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [N, E]
            bias = self.e_score_correction_bias.float()
            top = torch.topk((scores + bias).detach(), self.top_k + 1, dim=-1)  # selection only
            cutoff = top.values[:, self.top_k]
            if replay_idx is None:
                idx = top.indices[:, : self.top_k]
            else:
                if replay_idx.shape != (x.shape[0], self.top_k):
                    raise ValueError(
                        f"routing replay: expected recorded experts of shape [{x.shape[0]}, {self.top_k}], "
                        f"got {tuple(replay_idx.shape)}"
                    )
                if bool(((replay_idx < 0) | (replay_idx >= scores.shape[-1])).any()):
                    raise ValueError(f"routing replay: expert ids must lie in [0, {scores.shape[-1]})")
                idx = replay_idx.to(device=x.device, dtype=torch.int64)
            p = scores.gather(-1, idx)  # weights from the raw scores: the bias never enters p
            if self.renormalize:
                p = p / (p.sum(-1, keepdim=True) + 1e-20)
            p = p * self.scaling
        return p, Routing(topk_idx=idx.detach(), scores=scores.detach(), cutoff=cutoff.detach())


class RoutedExperts(nn.Module):
    """`mlp.experts`: E SiTU-GLU experts in the latent width, stored stacked.

    w1 (gate), w3 (up) [E, f, l]; w2 (down) [E, l, f]. The checkpoint adapter splits them
    into the official per-expert `experts.{e}.w{1,2,3}.weight` tensors. An engine under
    expert_precision mxfp4 holds them as MXFP4 bytes instead (`hold_mxfp4_`).
    """

    NAMES = ("w1", "w3", "w2")

    def __init__(self, config: K3Config):
        super().__init__()
        E, f, lat = config.num_experts, config.moe_intermediate_size, config.routed_expert_hidden_size
        self.w1 = nn.Parameter(torch.empty(E, f, lat))
        self.w3 = nn.Parameter(torch.empty(E, f, lat))
        self.w2 = nn.Parameter(torch.empty(E, lat, f))
        self.beta_gate, self.beta_up = config.activation_situ_beta, config.activation_situ_linear_beta
        self.backend = config.kernel_backend
        self.precision = config.expert_precision
        self.held_dtype: torch.dtype | None = None  # set by hold_mxfp4_: the dtype the held values are read in

    @torch.no_grad()
    def hold_mxfp4_(self, read_dtype: torch.dtype | None = None) -> None:
        """An engine's storage under expert_precision mxfp4: each matrix w as MXFP4 bytes, buffers `{w}_packed`
        [E, rows, n/2] and `{w}_scale` [E, rows, n/32] (4.25 bits a value, mxfp4.py), in place of the dense
        parameter; the forward reads their values in `read_dtype` (default: the parameter's), `dense_weight`
        and `store_` read and write them."""
        if self.precision != "mxfp4":
            raise ValueError(f"routed experts hold MXFP4 bytes under expert_precision 'mxfp4', not {self.precision!r}")
        self.held_dtype = read_dtype or self.w1.dtype
        for name in self.NAMES:
            packed, scale = mxfp4.quantize(getattr(self, name))
            delattr(self, name)
            self.register_buffer(f"{name}_packed", packed)
            self.register_buffer(f"{name}_scale", scale)

    def dense_weight(self, name: str, values: bool = True) -> torch.Tensor:
        """w1, w3 or w2 as a dense tensor: the parameter, or the values of the held MXFP4 bytes (exact;
        with values=False an empty meta tensor of their shape and dtype)."""
        if self.held_dtype is None:
            return getattr(self, name)
        packed, scale = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
        if not values:
            return torch.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=self.held_dtype, device="meta")
        return mxfp4.dequantize(packed, scale, self.held_dtype)

    @torch.no_grad()
    def store_(self, name: str, value: torch.Tensor) -> None:
        """Write a dense [E, rows, n] value into the held MXFP4 bytes of w1, w3 or w2 (quantised)."""
        packed, scale = mxfp4.quantize(value)
        getattr(self, f"{name}_packed").copy_(packed)
        getattr(self, f"{name}_scale").copy_(scale)

    def forward(self, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The learner's forward and the engine's (prefill and decode) under both precisions."""
        if self.held_dtype is not None and resolve_backend(self.backend, "routed experts (MXFP4)", z,
                                                           self.w1_packed) == "triton":  # fmt: skip
            # lazy: triton (Linux only) loads on the first GPU call
            from k3rl.kernels.moe.triton_mx_experts import mx_experts_triton

            # an engine's MXFP4 bytes on CUDA: the reference path below in kernels (kernels/moe/triton_mx_experts.py),
            # the bytes read in place, no host sync; dt is the reference's compute dtype
            held = [getattr(self, f"{n}_{part}") for n in self.NAMES for part in ("packed", "scale")]
            dt = autocast_dtype(z) or self.held_dtype
            return mx_experts_triton(z.to(dt), idx, p, *held, self.beta_gate, self.beta_up)
        if self.held_dtype is not None:  # an engine's MXFP4 bytes: the values of the experts this batch uses
            used, idx = torch.unique(idx, return_inverse=True)  # sorted: the experts run in the same order
            w1, w3, w2 = (mxfp4.dequantize(getattr(self, f"{n}_packed")[used], getattr(self, f"{n}_scale")[used],
                                           self.held_dtype) for n in self.NAMES)
        elif self.precision == "mxfp4":  # the learner's masters, quantised before any cast (MXFP4 is exact in bf16)
            w1, w3, w2 = fake_mxfp4(self.w1), fake_mxfp4(self.w3), fake_mxfp4(self.w2)
        else:
            w1, w3, w2 = self.w1, self.w3, self.w2
        if (dt := autocast_dtype(z)) is not None:  # the op is not an autocast op: cast like one
            z, w1, w3, w2 = z.to(dt), w1.to(dt), w3.to(dt), w2.to(dt)
        elif z.dtype != w1.dtype:
            z = z.to(w1.dtype)
        if self.precision == "mxfp4":  # the reference path (plain PyTorch, any device): MXFP8 z and SiTU-GLU output
            return latent_experts_loop(fake_mxfp8(z), idx, p, w1, w3, w2, self.beta_gate, self.beta_up,
                                       act_quant=fake_mxfp8)
        return latent_experts(z, idx, p, w1, w3, w2, self.beta_gate, self.beta_up, backend=self.backend)


class StableLatentMoE(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        d, lat = config.hidden_size, config.routed_expert_hidden_size
        self.gate = MoEGate(config)
        self.routed_expert_down_proj = nn.Linear(d, lat, bias=False)
        self.experts = RoutedExperts(config)
        self.routed_expert_norm = RMSNorm(lat, config.rms_norm_eps) if config.latent_moe_use_norm else nn.Identity()
        self.routed_expert_up_proj = nn.Linear(lat, d, bias=False)
        self.shared_experts = SiTUGLUMLP(
            d, config.num_shared_experts * config.moe_intermediate_size,
            config.activation_situ_beta, config.activation_situ_linear_beta,
        )
        self.qb = QuantileBalancer(config.num_experts, config.num_experts_per_token, config.qb_num_bins)

    def forward(self, x: torch.Tensor, replay_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, Routing]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        p, routing = self.gate(flat, replay_idx)
        flat_mm = matmul_input(flat)  # the router reads flat in fp32; the projections, cast once
        z = self.routed_expert_down_proj(flat_mm)  # once per token, before dispatch
        u = self.experts(z, routing.topk_idx, p)  # [N, l], fp32 combine inside the op
        routed = self.routed_expert_up_proj(self.routed_expert_norm(u))
        y = self.shared_experts(flat_mm) + routed
        return y.reshape(shape), routing

    @torch.no_grad()
    def qb_accumulate(self, routing: Routing, token_mask: torch.Tensor | None = None) -> None:
        self.qb.accumulate(routing.scores, routing.cutoff, self.gate.e_score_correction_bias, token_mask)

    @torch.no_grad()
    def qb_apply(self) -> bool:
        """Set the bias from the accumulated counts; True when it changed."""
        new = self.qb.new_bias(self.gate.e_score_correction_bias)
        if new is None:
            return False
        self.gate.e_score_correction_bias.copy_(new)
        return True
