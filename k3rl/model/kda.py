"""Kimi Delta Attention token mixer (docs/model.md §2).

    q~, k~, v~ = x Wq^T, x Wk^T, x Wv^T                        [B, T, H*D]
    q, k, v    = SiLU(causal depthwise conv_4(.))  (fp32 weights, reset at documents)
    q, k       = L2-normalised per head (eps inside the sqrt), q * D^-1/2      (in the op)
    beta       = sigmoid(x Wb^T)                                 fp32
    g          = -5 sigmoid(exp(A) (f_b(f_a(x)) + dt_bias))      fp32            (in the op)
    o~         = KDA recurrence (chunk form for prefill/training, recurrent for decode)
    y          = Wo [ sigmoid(x Wg^T) * RMSNorm_head(o~) ]       fp32 island, cast at o_proj

The recurrence, the L2 norm and the gate live in `k3rl.kernels.kda` (the in-kernel flags of
the K3 training call, §2.5), and so do the two fp32 islands, `short_conv` and `output_norm_gate`
(fused Triton kernels on CUDA, their PyTorch references elsewhere; `config.kernel_backend` picks);
this module owns the parameters, the decode caches and the wiring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3rl.kernels.kda import chunk_kda, fused_recurrent_kda, output_norm_gate, short_conv

from .common import fp32_island, matmul_input
from .config import K3Config

# Parameter names (suffixes) that must stay fp32 whatever the model dtype (§1.5).
KDA_FP32_PARAMS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log", "dt_bias", "o_norm.weight")


@dataclass
class KDACacheEntry:
    """Decode state of one KDA layer for B sequences.

    state  [B, H, K, V] fp32 recurrent state (K-first, the kernels' layout)
    conv   [B, W-1, 3*P] the last W-1 *pre-conv* projections of q | k | v (activation dtype)
    """

    state: torch.Tensor
    conv: torch.Tensor


def init_dt_bias(P: int, dt_min: float = 1e-3, dt_max: float = 1e-1, floor: float = 1e-4) -> torch.Tensor:
    """Mamba-2 / GDN recipe: dt ~ log-uniform[dt_min, dt_max], clamp >= floor, store softplus^-1(dt)."""
    u = torch.rand(P)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt) = dt + log(1 - e^-dt)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        la = config.linear_attn_config
        d = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = la.num_heads, la.head_dim
        self.conv_size = la.short_conv_kernel_size
        self.lower_bound = la.gate_lower_bound
        self.chunk_size = la.chunk_size
        self.norm_eps = config.rms_norm_eps
        self.backend = config.kernel_backend
        P = self.num_heads * self.head_dim
        self.proj_dim = P
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, self.conv_size, groups=P, bias=False)
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)  # forget-gate rank = head_dim
        self.f_b_proj = nn.Linear(self.head_dim, P, bias=False)
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        self.g_proj = nn.Linear(d, P, bias=False)  # full-rank output gate
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))  # A_h = 0 at init [R]
        self.dt_bias = nn.Parameter(init_dt_bias(P))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.head_dim))  # shared by every head
        self.o_proj = nn.Linear(P, d, bias=False)

    def new_cache(self, batch_size: int, dtype: torch.dtype, device) -> KDACacheEntry:
        H, D = self.num_heads, self.head_dim
        return KDACacheEntry(
            state=torch.zeros(batch_size, H, D, D, dtype=torch.float32, device=device),
            conv=torch.zeros(batch_size, self.conv_size - 1, 3 * self.proj_dim, dtype=dtype, device=device),
        )

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache: KDACacheEntry | None = None,
        context_parallel=None,
    ) -> torch.Tensor:
        """`context_parallel`: a `learner.context_parallel_layers.ContextParallel`; x is then this
        rank's shard of one packed sequence and `cu_seqlens` the whole sequence's documents: the
        short convolutions and the recurrence run through its collectives (KCP). A
        `learner.prefix_tree.PrefixTree` comes the same way (x: its tree stream): branches start from
        their shared prefix's state and conv window."""
        B, T, _ = x.shape
        H, D, P = self.num_heads, self.head_dim, self.proj_dim
        if cache is not None and cu_seqlens is not None:
            raise ValueError("KDA: packed cu_seqlens and a decode cache cannot be combined; decode unpacked batches")

        # 1-2. projections and short convolutions (fp32 weights, SiLU)
        xm = matmul_input(x)  # the projections' input, cast once under autocast (b_proj reads x in fp32)
        if context_parallel is not None:  # one exchange for the three (the conv is per channel)
            qkv = torch.cat([self.q_proj(xm), self.k_proj(xm), self.v_proj(xm)], dim=-1)
            w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
            q, k, v = context_parallel.short_conv(qkv, w, cu_seqlens).split(P, dim=-1)
        else:
            left_q = left_k = left_v = None
            if cache is not None:
                left_q, left_k, left_v = cache.conv.split(P, dim=-1)
            q, cq = short_conv(self.q_proj(xm), self.q_conv1d.weight, left_q, cu_seqlens, self.backend)
            k, ck = short_conv(self.k_proj(xm), self.k_conv1d.weight, left_k, cu_seqlens, self.backend)
            v, cv = short_conv(self.v_proj(xm), self.v_conv1d.weight, left_v, cu_seqlens, self.backend)
        q, k, v = (t.reshape(B, T, H, D) for t in (q, k, v))  # channel c = h*D + d

        with fp32_island(x):
            beta = torch.sigmoid(F.linear(x.float(), self.b_proj.weight.float()))  # [B, T, H] fp32
        z = self.f_b_proj(self.f_a_proj(xm)).reshape(B, T, H, D)  # raw decay logit z~ (dt_bias added in the op)

        # 3-8. recurrence with the in-kernel L2 norm of q, k, the q scale and the decay gate
        kda_args = dict(
            scale=D**-0.5,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            lower_bound=self.lower_bound,
            backend=self.backend,
        )
        initial = cache.state if cache is not None else None
        if cache is not None and T == 1:
            # without autograd (an engine's decode) the cache's state is updated where it lies
            o, final = fused_recurrent_kda(
                q, k, v, z, beta, initial_state=initial, output_final_state=True,
                inplace_final_state=not torch.is_grad_enabled(), **kda_args,
            )  # fmt: skip
        else:
            run = context_parallel.chunk_kda if context_parallel is not None else chunk_kda
            o, final = run(
                q, k, v, z, beta, initial_state=initial, output_final_state=cache is not None,
                cu_seqlens=cu_seqlens, chunk_size=self.chunk_size, **kda_args,
            )
        if cache is not None:
            cache.state = final
            cache.conv = torch.cat([cq, ck, cv], dim=-1)

        # 9. y = Wo [ sigmoid(x Wg^T) * RMSNorm_head(o) ], the norm and gate in fp32
        gate = self.g_proj(xm).reshape(B, T, H, D)
        y = output_norm_gate(o, gate, self.o_norm.weight, self.norm_eps, self.o_proj.weight.dtype, self.backend)
        return self.o_proj(y.reshape(B, T, P))
