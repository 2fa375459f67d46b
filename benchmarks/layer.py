"""One GPU's shard of full-width K3 layers in bf16: forward + backward time, model FLOPs, MFU.

    python3 benchmarks/layer.py [--tokens 8192,32768] [--only kda_moe,mla_moe,kda,moe,mla] [--profile]

The layers are the real modules of ``k3rl/model`` built from the ``k3`` preset (hidden 7168;
KDA 96 heads of 128; Gated MLA 96 heads; Stable LatentMoE latent 3584, experts of 3072, top-16 of
896, two shared experts), one layer at a time, bf16 weights (the fp32 allow-list kept fp32):

  kda_moe   a decoder layer (0-based index 25: KDA mixer, LatentMoE, Block AttnRes over the bank of
            three completed blocks that layer 25 sees, block size 12), as rank 0 of EP 8 runs it
  mla_moe   the same with the Gated MLA mixer (index 27)
  kda, mla  the mixer alone (input norm included); moe: the EP-8 LatentMoE alone

EP 8 as one rank sees it: the router scores all 896 experts and picks 16 per token; the rank
owns experts 0..111. Of its N tokens' N * 16 routes it computes a fixed N * 16 / 8 (what balanced
EP, or MoonEP's fixed per-rank counts, gives each rank): its own routes first, padded with
weight-0 routes when fewer land here; the routes to other experts leave (their compute happens on
the other ranks, and the tokens those ranks send here are the same count). The all-to-all itself
is not in the time (one GPU). One document of N tokens (no cu_seqlens).

Model FLOPs of one forward (backward = 2x forward, so a step is 3x):
  2 N * sum of every nn.Linear's in x out applied per token (the AttnRes pseudo-queries excluded)
  + 2 N * E * d                          router (fp32)
  + 2 R * 3 * l * f                      routed experts, R = N * k / EP routes on this rank
  + N * H * (3 C K + 2 C V + 6 K V)      KDA core, chunk C = 64: A_qk and A_kk (2 C K over the lower
                                         triangles), W (C K), U (C V), A_qk V~ (C V), W S, Q S and the
                                         state update (6 K V)
  + 2 N * H * (d_qk + d_v) * (N + 1) / 2 MLA core: QK^T and PV over the mean causal context
Norms, gates, activations, AttnRes and the short convolutions are not counted. MFU = model FLOPs /
time / the bf16 matmul peak measured in the same run (an 8192^3 bf16 matmul).

Levers (rows), each measured on the same layer and inputs:
  eager              the model's own code path (``latent_experts`` with its input check; the KDA
                     mixer's short convolutions and output norm + gate by the fused Triton kernels
                     of ``kernels/kda/islands.py``; the Block AttnRes aggregations by the fused
                     kernel of ``kernels/attnres``)
  attnres torch      the layer's two Block AttnRes aggregations by the PyTorch reference instead (the
                     code before the fused kernel: the sources stacked in fp32, normalised, weighted)
  kda islands torch  the KDA islands by their PyTorch references instead (the code before the fused
                     kernels: fp32 cuDNN convolutions, fp32 norm and gate on [N, 96, 128], casts)
  norms torch        the layer's RMSNorms by eager PyTorch instead of the fused kernel of ``kernels/rmsnorm``
  experts loop       one GEMM chain per expert (the loop reference) instead of torch._grouped_mm
  router tf32        the fp32 router matmul on TF32 tensor cores (allow_tf32)
  recompute experts  selective activation recompute: the routed experts under torch.utils.checkpoint
  compile            regional torch.compile of the decoder layer (first token count only: compile time)
  kda conv bf16      the KDA short convolutions by cuDNN in bf16 instead of the fused kernel (output
                     norm + gate still fused)
  mla bf16 sdpa      MLA attention by SDPA on bf16 inputs (flash / cuDNN) instead of the fp32 kernel
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings

import torch
from torch import nn

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed k3rl: spawned children must not find the bare k3rl/ first

from k3rl.kernels._backend import before_compile  # noqa: E402
from k3rl.kernels.attnres import attnres_aggregate_reference  # noqa: E402
from k3rl.kernels.kda import output_norm_gate_reference, short_conv_reference  # noqa: E402
from k3rl.kernels.moe import latent_experts, latent_experts_loop  # noqa: E402
from k3rl.model import kda as kda_module  # noqa: E402
from k3rl.model import model as model_module  # noqa: E402
from k3rl.model import model_config  # noqa: E402
from k3rl.model.common import RMSNorm  # noqa: E402
from k3rl.model.model import FP32_PARAM_SUFFIXES, K3DecoderLayer  # noqa: E402
from k3rl.model.moe import MoEGate  # noqa: E402

EP = 8
KDA_IDX, MLA_IDX = 25, 27  # 0-based; 25 % 12 = 1: three completed blocks in the bank
BANK = 3


class EPShardMoE(nn.Module):
    """The LatentMoE of one EP rank, made of the layer's own modules: its 896-way router, the
    projections, norm and shared experts, and the rank's E / EP experts (see the module docstring)."""

    def __init__(self, full, moe_local, ep=EP):
        super().__init__()
        self.gate = MoEGate(full)
        self.routed_expert_down_proj = moe_local.routed_expert_down_proj
        self.experts = moe_local.experts
        self.routed_expert_norm = moe_local.routed_expert_norm
        self.routed_expert_up_proj = moe_local.routed_expert_up_proj
        self.shared_experts = moe_local.shared_experts
        self.ep = ep
        self.experts_fn = latent_experts  # levers swap this
        self.recompute = False

    def local_experts(self, z, idx, p):
        N, k = idx.shape
        e_local = self.experts.w1.shape[0]
        here = idx < e_local  # rank 0 owns experts [0, E / EP)
        routes = N * k // self.ep  # fixed per-rank count
        order = torch.argsort((~here).reshape(-1).to(torch.int8), stable=True)[:routes]  # own routes first
        tok = order // k
        e = idx.reshape(-1)[order].remainder(e_local)[:, None]
        w = (p * here).reshape(-1)[order][:, None]  # padding routes weigh 0
        ex = self.experts
        y = self.experts_fn(z[tok], e, w, ex.w1, ex.w3, ex.w2, ex.beta_gate, ex.beta_up)
        return (
            torch.zeros(z.shape, dtype=torch.float32, device=z.device)
            .index_add(0, tok, y.float())
            .to(z.dtype)
        )

    def forward(self, x, replay_idx=None):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        p, routing = self.gate(flat)
        z = self.routed_expert_down_proj(flat)
        if self.recompute:
            u = torch.utils.checkpoint.checkpoint(
                self.local_experts, z, routing.topk_idx, p, use_reentrant=False
            )
        else:
            u = self.local_experts(z, routing.topk_idx, p)
        routed = self.routed_expert_up_proj(self.routed_expert_norm(u))
        return (self.shared_experts(flat) + routed).reshape(shape), routing


def to_bf16(module):
    for name, prm in module.named_parameters():
        if not name.endswith(FP32_PARAM_SUFFIXES):
            prm.data = prm.data.to(torch.bfloat16)
    return module


@torch.no_grad()
def init_weights(module, std=0.02):
    """N(0, std) for every matrix the modules leave uninitialised (experts, router) or Kaiming-initialise."""
    for name, prm in module.named_parameters():
        if prm.dim() >= 2 and "conv" not in name and not name.endswith("_res_proj.weight"):
            prm.normal_(0.0, std)


def build_layer(idx):
    full = model_config("k3")
    local = model_config(full, {"num_experts": full.num_experts // EP})
    with torch.device("cuda"):
        layer = K3DecoderLayer(local, idx)
        layer.mlp = EPShardMoE(full, layer.mlp)
    init_weights(layer)
    if not layer.is_mla:  # K3's gate range (A_log = log U(1, 16)): strong gates, as trained
        layer.self_attn.A_log.data.uniform_(1, 16).log_()
    return to_bf16(layer), full


def layer_flops(layer, full, N):
    """Forward model FLOPs of `layer` (or of its parts) on N tokens (formula in the module docstring)."""
    flops = 0
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear) and not name.endswith("_res_proj"):
            flops += 2 * N * m.in_features * m.out_features
        if isinstance(m, MoEGate):
            flops += 2 * N * m.weight.numel()
        if isinstance(m, EPShardMoE):
            E_l, f, lat = m.experts.w1.shape
            flops += 2 * (N * full.num_experts_per_token // m.ep) * 3 * lat * f
        if type(m).__name__ == "KimiDeltaAttention":
            C, K = m.chunk_size, m.head_dim
            V = K  # d_k = d_v
            flops += N * m.num_heads * (3 * C * K + 2 * C * V + 6 * K * V)
        if type(m).__name__ == "GatedMLA":
            flops += 2 * N * m.num_heads * (m.nope_dim + m.rope_dim + m.v_dim) * (N + 1) // 2
    return flops


def bf16_attention(mla):
    """MLA's naive attention with SDPA on bf16 inputs (the lever); fp32 output as the model expects."""
    import torch.nn.functional as F

    def naive_attention(q, lat, cu_seqlens=None):
        B, S, _ = lat.shape
        H = mla.num_heads
        c, kx = lat.split([mla.kv_rank, mla.rope_dim], dim=-1)
        kv = mla.kv_b_proj(c).reshape(B, S, H, mla.nope_dim + mla.v_dim)
        k_nope, v = kv.split([mla.nope_dim, mla.v_dim], dim=-1)
        k = torch.cat([k_nope, kx.unsqueeze(2).expand(B, S, H, mla.rope_dim).to(k_nope.dtype)], dim=-1)
        qt, kt, vt = (t.to(torch.bfloat16).transpose(1, 2) for t in (q, k, v))
        return (
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=mla.scale)
            .transpose(1, 2)
            .float()
        )

    return naive_attention


def short_conv_bf16(x, weight, left, cu_seqlens, backend=None):
    """k3rl.model.kda.short_conv for one unpacked batch, in x's dtype instead of fp32 (the lever)."""
    import torch.nn.functional as F

    if cu_seqlens is not None or left is not None:
        raise ValueError("the bf16 short-conv lever covers one unpacked batch without a cache")
    W = weight.shape[-1]
    xx = F.pad(x.transpose(1, 2), (W - 1, 0))  # [B, C, W-1+T]
    y = F.conv1d(xx, weight.to(x.dtype), groups=x.shape[-1]).transpose(1, 2)
    return F.silu(y), xx.transpose(1, 2)[:, xx.shape[-1] - (W - 1) :]


def kda_islands_torch(_layer):
    """The lever: the KDA mixer's short convolutions and output norm + gate by their PyTorch references."""
    undo = [
        _swap_global(kda_module, "short_conv", lambda *a: short_conv_reference(*a[:4])),  # a[4]: backend
        _swap_global(kda_module, "output_norm_gate", lambda *a: output_norm_gate_reference(*a[:5])),
    ]
    return lambda: [u() for u in undo]


def attnres_torch(_layer):
    """The lever: the decoder layer's Block AttnRes aggregations by the PyTorch reference (one source
    stays the identity, as in the model)."""

    def reference(sources, query, eps, backend=None):
        return sources[0] if len(sources) == 1 else attnres_aggregate_reference(sources, query, eps)

    return _swap_global(model_module, "aggregate", reference)


def norms_torch(layer):
    """The lever: the layer's RMSNorms by eager PyTorch (the code before kernels/rmsnorm)."""
    norms = [m for m in layer.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m.backend = "torch"

    def undo():
        for m in norms:
            m.backend = "auto"

    return undo


def matmul_peak():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b, reps=20, warmup=5)
    return 2 * 8192**3 / ms / 1e9  # TFLOP/s


def timed(step, reps=3, warmup=1):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def host_syncs(step):
    """Host synchronisations in one step (CUDA sync debug mode, counted warnings)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def make_step(fn, x, d_out):
    def step():
        out = fn(x)
        out.backward(d_out)
        for t in x if isinstance(x, list) else [x]:
            t.grad = None

    return step


def part_fn(kind, layer):
    """x -> output tensor of the part timed: the decoder layer (bank + partial in), a mixer or the MoE."""
    if kind in ("kda_moe", "mla_moe"):
        return lambda xs: layer(xs[:-1], xs[-1])[1]
    if kind in ("kda", "mla"):
        return lambda xs: layer.self_attn(layer.input_layernorm(xs[-1]))
    return lambda xs: layer.mlp(layer.post_attention_layernorm(xs[-1]))[0]


def levers(kind, first_n):
    """(name, setup) pairs for this kind; setup(layer) applies the lever and returns an undo. The MoE
    levers run on kda_moe and moe (mla_moe shares the MoE; its fp32 attention makes each step slow)."""
    rows = [("eager", None)]
    if kind in ("kda_moe", "moe"):
        rows += [("experts loop", lambda L: _swap(L.mlp, "experts_fn", latent_experts_loop))]
        rows += [("router tf32", _tf32)]
        rows += [("recompute experts", lambda L: _swap(L.mlp, "recompute", True))]
    if kind in ("kda_moe", "kda"):
        rows += [("kda islands torch", kda_islands_torch)]
        rows += [("kda conv bf16", lambda L: _swap_global(kda_module, "short_conv", short_conv_bf16))]
    if kind in ("kda_moe", "mla_moe"):
        rows += [("attnres torch", attnres_torch)]
    rows += [("norms torch", norms_torch)]
    if kind in ("mla_moe", "mla"):
        rows += [
            ("mla bf16 sdpa", lambda L: _swap(L.self_attn, "naive_attention", bf16_attention(L.self_attn)))
        ]
    if kind == "kda_moe" and first_n:
        rows += [("compile", "compile")]
    return rows


def _swap(obj, name, value):
    old = obj.__dict__.get(name, None)
    had = name in obj.__dict__
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old) if had else delattr(obj, name)


def _swap_global(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    return lambda: setattr(module, name, old)


def _tf32(_layer):
    torch.backends.cuda.matmul.allow_tf32 = True
    return lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def profile_step(step, label, top=15):
    """The CUDA kernels of one step by total device time (where a part's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"\nprofile: {label}, top {top} kernels by device time")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=70))


def run_kind(kind, N, peak, first_n, only_levers=None, profile=False):
    layer, full = build_layer(MLA_IDX if kind.startswith("mla") else KDA_IDX)
    d = full.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(1, N, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
          for _ in range(BANK + 1)]  # fmt: skip
    d_out = torch.randn(1, N, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    parts = {
        "kda_moe": layer,
        "mla_moe": layer,
        "kda": layer.self_attn,
        "mla": layer.self_attn,
        "moe": layer.mlp,
    }
    flops = 3 * layer_flops(parts[kind], full, N)
    base = None
    for name, setup in levers(kind, first_n):
        if only_levers and name not in only_levers:
            continue
        undo = None
        fn = part_fn(kind, layer)
        if setup == "compile":
            before_compile()  # the Triton kernels' host wrappers become graph breaks
            compiled = torch.compile(layer)
            fn = lambda xs, c=compiled: c(xs[:-1], xs[-1])[1]  # noqa: E731
        elif setup is not None:
            undo = setup(layer)
        step = make_step(fn, xs, d_out)
        try:
            t0 = time.time()
            step()  # warm-up (and compilation) outside the timed steps
            first_s = time.time() - t0
            syncs = host_syncs(step)
            torch.cuda.reset_peak_memory_stats()
            ms = timed(step)
            mem = torch.cuda.max_memory_allocated() / 2**30
            if profile and name == "eager":
                profile_step(step, f"{kind}, {N} tokens, eager")
            base = base or ms
            tflops = flops / ms / 1e9
            print(
                f"| {kind} | {N} | {name} | {ms:.2f} | {base / ms:.2f}x | {tflops:.0f} | {100 * tflops / peak:.1f}% "
                f"| {syncs} | {mem:.1f} | {first_s:.1f} |",
                flush=True,
            )
        except Exception as e:  # one failing lever must not hide the others
            print(
                f"| {kind} | {N} | {name} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]} |",
                flush=True,
            )
        finally:
            if undo:
                undo()
    del layer, xs
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--only", default="kda_moe,mla_moe,kda,moe,mla")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--levers", default="", help="only these rows, e.g. eager,compile (default: all)")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of each eager step")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# layer benchmark {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")  # fmt: skip
    peak = matmul_peak()
    print(f"bf16 matmul peak (8192^3, same run): {peak:.0f} TFLOP/s\n")
    print(
        "| part | tokens | lever | fwd+bwd ms | vs eager | model TFLOP/s | MFU | host syncs | peak GiB | first step s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, N in enumerate(int(n) for n in args.tokens.split(",")):
        for kind in args.only.split(","):
            only = set(args.levers.split(",")) if args.levers else None
            first = i == 0 and not args.no_compile
            run_kind(kind, N, peak, first_n=first, only_levers=only, profile=args.profile)


if __name__ == "__main__":
    main()
