"""`k3rl plan`: a K3 RL job on N GPUs, on paper (issue [22] item 4; docs/parallel.md, "The plan").

Given a GPU kind, a GPU count and a job shape, `plan_job` picks a learner layout (FSDP x EP, KCP,
activation checkpointing, sequences per micro-batch, optimizer state on the host or not) and a rollout
layout (engine instances of TP x EP GPUs), and says what each rank holds, how long a step takes, how
long a weight sync takes, how fast the fleet decodes, and whether it fits. Plain arithmetic, no torch:
the formulas are in comments beside the code, the measured constants in `CALIBRATION` with the
BENCHMARKS.md row each comes from. What is assumed rather than measured is in `ASSUMPTIONS`.
"""

from __future__ import annotations

import math
from itertools import product

from pydantic import BaseModel, ConfigDict
from rich.console import Console
from rich.table import Table

from k3rl.model.config import K3Config
from k3rl.model.params import (
    count_parameters,
    count_vision_parameters,
    expert_parameters,
    kda_layer_parameters,
    moe_non_expert_parameters,
)

GiB = 2**30
USABLE = 0.9  # of a GPU's memory a plan may fill: CUDA context, NCCL buffers, the allocator's fragmentation


class GPU(BaseModel):
    """A GPU kind's published specs (SXM parts; memory as nvidia-smi reports it)."""

    model_config = ConfigDict(frozen=True)
    name: str
    memory_gib: float  # usable HBM
    bf16_tflops: float  # dense bf16 tensor-core peak
    hbm_tbs: float  # HBM bandwidth
    nvlink_gbs: float  # NVLink, one direction, per GPU
    internode_gbs: float  # network per GPU (one 400 Gb/s NIC a GPU)
    pcie_gbs: float  # host <-> GPU, one direction
    gpus_per_node: int = 8
    host_gib_per_gpu: float = 256.0  # host memory a GPU may use (2 TiB nodes of 8)


GPUS: dict[str, GPU] = {
    "h100": GPU(name="H100 SXM 80GB", memory_gib=79.6, bf16_tflops=989.4, hbm_tbs=3.35, nvlink_gbs=450,
                internode_gbs=50, pcie_gbs=55),
    "h200": GPU(name="H200 SXM 141GB", memory_gib=140.4, bf16_tflops=989.4, hbm_tbs=4.8, nvlink_gbs=450,
                internode_gbs=50, pcie_gbs=55),
    "b200": GPU(name="B200 SXM 180GB", memory_gib=179.1, bf16_tflops=2250.0, hbm_tbs=8.0, nvlink_gbs=900,
                internode_gbs=50, pcie_gbs=110),
}

# Measured on one H200 (BENCHMARKS.md), each with the row it comes from; other GPUs scale by their specs.
CALIBRATION = {
    # "Devices": 772 TFLOP/s bf16 matmul of 989.4: the GEMMs' fraction of the peak
    "matmul_efficiency": 772 / 989.4,
    # "Kernels": KDA chunk fwd + bwd, 1 x 65536 x 96 heads in 74.14 ms (memory-bound: scales with HBM)
    "kda_chunk_ns_per_token_head": 74.14e6 / (65536 * 96),
    # "Learner": k3-small's step, 65,520 tokens in 295-307 ms: what is not GEMM or KDA chunk is element-wise
    # traffic; solved for its bytes per activation element (fwd + bwd) at the H200's 4.8 TB/s (see learner_step)
    "elementwise_bytes_per_activation": 43.1,
    # "Learner": k3-small's peak 65.7 GiB at 65,520 tokens, no checkpointing: bytes kept per activation element
    "saved_bytes_per_activation": 3.33,
    # "Inference engine", eager layers in the graph, 481.5 / 17,091 / 51,893 tok/s at batch 1 / 64 / 256:
    # decode_step_seconds' two constants fitted to the three (least worst error: 11.6%); a batch-1 step is
    # launch-bound (the fixed time a layer), a batch-256 step moves its bytes at 18% of the HBM peak
    "decode_fixed_us_per_layer": 132.0,
    "decode_bandwidth_efficiency": 0.182,
    # "Full-width layers": a KDA + LatentMoE layer's shard at 8K tokens, 49.0% MFU (2026-12-02): at K3's
    # width the compute takes at least the FLOPs at this MFU (learner_layout)
    "layer_mfu": 0.490,
    # "Weight sync": NCCL broadcast 344 GB/s between two H200s (NV18, 450 GB/s a direction)
    "sync_efficiency": 344 / 450,
}

ASSUMPTIONS = [
    "Every sequence is --context tokens long (prompt, tool results and generation); a quarter of them generated.",
    "Learner state: fp32 masters, fp32 gradients, fp32 Per-Head Muon momentum (12 B/param, what learner/ does); "
    "AdamW's second moment for the embedding and head (+4 B); with the optimizer on the host the GPU keeps "
    "a bf16 shard and the fp32 gradients (6 B/param).",
    "FSDP x EP: every tensor's state is sharded over all learner ranks (experts over EP, then over the "
    "W/EP replicas); a layer is gathered in bf16 two at a time (prefetch) with its fp32 gradients.",
    "Step compute: GEMM FLOPs (benchmarks/learner.py's count) at the measured matmul efficiency, plus the KDA "
    "chunk kernel at its measured rate, plus element-wise traffic calibrated on k3-small's step; x4/3 under "
    "activation checkpointing (one more forward).",
    "Communication: EP dispatch and combine of the latent (k x l bf16 values a token, forward and backward) "
    "is exposed; FSDP's all-gathers and reduce-scatters overlap compute and only their excess is exposed; "
    "intra-node traffic at NVLink speed, the rest at the NIC's, both at the measured NCCL efficiency.",
    "Engine: attention and shared weights split over TP = min(instance, 8) ranks, experts over EP = the "
    "instance; the MLA latent is replicated over TP, the KDA state is split by heads; 2 us-latency "
    "collectives are not modelled beyond 20 us (TP all-reduce) and 40 us / 80 us (EP all-to-all in / "
    "across nodes) a call.",
    "Colocated: learner and engines time-share every GPU; the learner's GPU state goes to the host during "
    "rollouts and comes back (over PCIe), the engines' weights leave during training and come back with the "
    "weight sync; split: the learner and the fleet run at once (asynchronous RL).",
    f"A plan fills at most {USABLE:.0%} of a GPU's memory (CUDA context, NCCL buffers, fragmentation); "
    "host memory 256 GiB a GPU.",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class ModelShape:
    """The counts the formulas need, from a K3Config (k3rl.model.params for the parameters)."""

    def __init__(self, c: K3Config, expert_precision: str):
        la = c.linear_attn_config
        self.c = c
        self.L = c.num_hidden_layers
        self.n_mla = len(la.full_attn_layers)
        self.n_kda = self.L - self.n_mla
        self.n_moe = len(c.moe_layer_ids)
        self.total, self.active = count_parameters(c)
        tower, projector = count_vision_parameters(c)
        self.vision = tower + projector
        self.expert = expert_parameters(c)
        self.experts_total = self.n_moe * c.num_experts * self.expert
        self.non_expert = self.total - self.experts_total
        # bytes of one routed-expert weight as the engines hold it: bf16 2 B, MXFP4 4 bits + an E8M0 scale per 32
        self.expert_byte = 2.0 if expert_precision == "bf16" else 0.5 + 1 / 32
        d, H, D = c.hidden_size, la.num_heads, la.head_dim
        P = H * D
        k, lat, f = c.num_experts_per_token, c.routed_expert_hidden_size, c.moe_intermediate_size
        # activation elements a token touches per layer: the output widths of every projection, the
        # block-AttnRes sources (embedding + the blocks so far, about half of them on average) twice
        sources = 1 + math.ceil(self.L / c.attn_res_block_size) / 2
        self.act_kda = 3 * P + P + D + P + H + P + d  # q k v, gate, f_a, f_b, beta, kernel out, o_proj
        self.act_mla = (c.q_lora_rank + H * c.qk_head_dim + c.kv_lora_rank + c.qk_rope_head_dim
                        + H * (c.qk_nope_head_dim + c.v_head_dim) + 2 * H * c.v_head_dim + d)
        self.act_moe = c.num_experts + lat + k * (2 * f + lat) + d + c.num_shared_experts * 2 * f + d
        self.act_dense = 2 * c.intermediate_size + d
        self.act_res = 2 * sources * d + 4 * d  # two AttnRes mixes over the sources, two norms
        self.act_per_token = (self.n_kda * self.act_kda + self.n_mla * self.act_mla + self.n_moe * self.act_moe
                              + (self.L - self.n_moe) * self.act_dense + self.L * self.act_res)
        # decode state a sequence keeps: KDA state fp32 [H, D, D] and 3 conv windows per KDA layer; MLA latent a token
        self.kda_state_bytes = self.n_kda * (H * D * D * 4 + (la.short_conv_kernel_size - 1) * 3 * P * 2)
        self.mla_bytes_per_token = self.n_mla * (c.kv_lora_rank + c.qk_rope_head_dim) * 2

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs a token as benchmarks/learner.py counts them:
        6 N_active + 3 [n_MLA 2 H (d_qk + d_v) S/2 + n_KDA H 6 D^2]."""
        c, la = self.c, self.c.linear_attn_config
        mla = self.n_mla * 2 * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * seq_len / 2
        kda = self.n_kda * la.num_heads * 6 * la.head_dim**2
        return 6 * self.active + 3 * (mla + kda)


def compute_seconds(m: ModelShape, gpu: GPU, tokens: float, seq_len: int) -> float:
    """Forward + backward of `tokens` tokens on one GPU (its share of the routed rows under balanced EP):
    GEMM FLOPs / (peak x matmul efficiency) + KDA chunk kernel + element-wise bytes / HBM bandwidth."""
    gemm = m.flops_per_token(seq_len) * tokens / (gpu.bf16_tflops * 1e12 * CALIBRATION["matmul_efficiency"])
    hbm_scale = 4.8 / gpu.hbm_tbs  # the KDA kernel was measured on an H200's HBM
    kda = m.n_kda * m.c.linear_attn_config.num_heads * tokens * CALIBRATION["kda_chunk_ns_per_token_head"] * 1e-9
    elementwise = m.act_per_token * tokens * CALIBRATION["elementwise_bytes_per_activation"] / (gpu.hbm_tbs * 1e12)
    return gemm + kda * hbm_scale + elementwise


def layer_seconds(m: ModelShape, gpu: GPU, tokens: int, routes_per_token: int, sources: int) -> float:
    """One KDA + LatentMoE decoder layer's fwd + bwd on one GPU, as benchmarks/layer.py times it (the
    rank's `routes_per_token` of k, `sources` AttnRes sources): the same three terms as compute_seconds.
    The out-of-sample check of the element-wise constant (fitted on k3-small, width 768) at width 7168."""
    c, la = m.c, m.c.linear_attn_config
    params = kda_layer_parameters(c) + moe_non_expert_parameters(c) + routes_per_token * m.expert
    flops = tokens * (6 * params + 3 * la.num_heads * 6 * la.head_dim**2)
    gemm = flops / (gpu.bf16_tflops * 1e12 * CALIBRATION["matmul_efficiency"])
    kda = la.num_heads * tokens * CALIBRATION["kda_chunk_ns_per_token_head"] * 1e-9 * 4.8 / gpu.hbm_tbs
    lat, f, d = c.routed_expert_hidden_size, c.moe_intermediate_size, c.hidden_size
    moe = c.num_experts + lat + routes_per_token * (2 * f + lat) + d + c.num_shared_experts * 2 * f + d
    acts = m.act_kda + moe + 2 * sources * d + 4 * d
    return gemm + kda + tokens * acts * CALIBRATION["elementwise_bytes_per_activation"] / (gpu.hbm_tbs * 1e12)


def optimizer_seconds(m: ModelShape, gpu: GPU, params_on_rank: float, expert_share: float) -> float:
    """Per-Head Muon on a rank's shard: Newton-Schulz (5 steps, a [m, n] block costs 5 (4 m^2 n + 2 m^3)
    FLOPs: 5 (4 m + 2 m^2 / n) a parameter; experts whole [f, l], the rest per head, m = 128) at the matmul
    efficiency, plus ~8 passes over 12 B a parameter of state."""
    c = m.c
    mm, nn = sorted((c.moe_intermediate_size, c.routed_expert_hidden_size))
    per_param_expert = 5 * (4 * mm + 2 * mm * mm / nn)
    per_param_other = 5 * (4 * 128 + 2 * 128 * 128 / max(128, c.hidden_size))
    flops = params_on_rank * (expert_share * per_param_expert + (1 - expert_share) * per_param_other)
    return flops / (gpu.bf16_tflops * 1e12 * CALIBRATION["matmul_efficiency"]) + params_on_rank * 12 * 8 / (gpu.hbm_tbs * 1e12)


def _link_seconds(nbytes: float, group: int, gpu: GPU) -> float:
    """A collective's bytes a rank sends, spread evenly over its group: the peers in its node at NVLink
    speed, the others at the NIC's (both at the measured NCCL efficiency)."""
    if group <= 1:
        return 0.0
    inside = min(group, gpu.gpus_per_node) - 1
    outside = group - 1 - inside
    eff = CALIBRATION["sync_efficiency"]
    return nbytes * (inside / (group - 1)) / (gpu.nvlink_gbs * 1e9 * eff) + \
        nbytes * (outside / (group - 1)) / (gpu.internode_gbs * 1e9 * eff)


class LearnerLayout(BaseModel):
    gpus: int
    ep: int
    cp: int
    fsdp: int  # ranks every non-expert tensor is sharded over (all of them)
    seqs_per_micro_batch: int
    checkpointing: bool
    optimizer_on_host: bool
    colocated: bool
    memory_gib: dict[str, float]
    step_s: dict[str, float]
    compute_model_s: float  # the compute by the three-term model
    compute_at_layer_mfu_s: float  # the compute at the measured full-width layer's MFU

    @property
    def total_gib(self) -> float:
        return sum(self.memory_gib.values())


def learner_layout(m: ModelShape, gpu: GPU, gpus: int, ep: int, cp: int, seqs: int, ckpt: bool, host_opt: bool,
                   context: int, sequences: int, colocated: bool) -> LearnerLayout:
    c = m.c
    # state a rank holds: total params x bytes / W (FSDP x EP shards everything over all W ranks)
    adamw = 2 * c.vocab_size * c.hidden_size  # embedding + head under AdamW: one more fp32 moment
    state_b = (6 if host_opt else 12) * m.total + (0 if host_opt else 4 * adamw)
    state = state_b / gpus
    # the gathered unit: one layer's non-expert weights plus its E/ep local experts, bf16, two in flight,
    # with the unit's fp32 gradients before the reduce-scatter
    layer_params = m.non_expert / m.L + (c.num_experts // ep) * m.expert
    gathered = layer_params * (2 * 2 + 4)
    # activations of a micro-batch's tokens on this rank, T = seqs x context / cp:
    #   kept for backward   T x act_per_token x saved B          (no checkpointing)
    #   or                  T x L x d x 2 B (layer inputs) + one layer's T x act x saved B (its recompute)
    #   plus the fp32 logits of the loss, T x V x 4 B, and MLA's all-gathered latent of the whole sequence
    T = seqs * context / cp
    saved = CALIBRATION["saved_bytes_per_activation"]
    if ckpt:
        acts = T * m.L * c.hidden_size * 2 + T * (m.act_per_token / m.L) * saved * 2
    else:
        acts = T * m.act_per_token * saved
    logits = T * c.vocab_size * 4
    latent = seqs * context * (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * 2 if cp > 1 else 0
    memory = {"parameters + gradients + optimizer": state / GiB, "gathered layers (FSDP prefetch)": gathered / GiB,
              "activations": (acts + latent) / GiB, "logits": logits / GiB}
    # step: each data-parallel group (W / cp ranks... each a CP group of cp) takes sequences / (W / cp) of them
    dp = gpus // cp
    mbs = math.ceil(math.ceil(sequences / dp) / seqs)
    tokens_rank = mbs * T
    # compute: the larger of the three-term model (GEMMs, KDA kernel, element-wise; what width does to
    # efficiency, k3-small's 14% MFU) and the FLOPs at the full-width layer shard's measured MFU (its ceiling
    # at K3's width: the three-term model reads 22% under that layer's measured time)
    model_s = compute_seconds(m, gpu, tokens_rank, context) * (4 / 3 if ckpt else 1)
    at_mfu = (m.flops_per_token(context) * tokens_rank * (4 / 3 if ckpt else 1)
              / (gpu.bf16_tflops * 1e12 * CALIBRATION["layer_mfu"]))
    compute = max(model_s, at_mfu) if m.c.hidden_size >= 7168 else model_s
    # EP dispatch + combine, forward and backward: 4 x k x l x 2 B a token and MoE layer, over the EP group;
    # checkpointing runs the forward's pair again (x 3/2), and KCP's exchanges likewise
    again = 1.5 if ckpt else 1.0
    a2a = again * _link_seconds(tokens_rank * m.n_moe * 4 * c.num_experts_per_token * c.routed_expert_hidden_size * 2,
                                ep, gpu)
    # KCP: per KDA layer one all-gather of [M | S~] ([H, K, K + V] fp32) forward, its reduce backward
    la = c.linear_attn_config
    kcp = _link_seconds(mbs * m.n_kda * 2 * cp * la.num_heads * la.head_dim * 2 * la.head_dim * 4, cp, gpu)
    kcp += _link_seconds(mbs * m.n_mla * 2 * seqs * context * (c.kv_lora_rank + c.qk_rope_head_dim) * 2, cp, gpu)
    kcp *= again
    # FSDP: per micro-batch every layer gathered twice (forward, backward) in bf16 and its gradients
    # reduce-scattered in fp32: 8 B a parameter a rank gathers; overlaps compute. Non-expert tensors over
    # all W ranks; a rank's E/ep experts over the W/ep replicas of its EP group (EP groups fill nodes first,
    # so the replicas are in other nodes once EP >= a node)
    fsdp_s = _link_seconds(mbs * m.non_expert * 8, gpus, gpu)
    replicas, expert_bytes = gpus // ep, mbs * (m.experts_total / ep) * 8
    if replicas > 1 and ep >= gpu.gpus_per_node:
        fsdp_s += expert_bytes * (replicas - 1) / replicas / (gpu.internode_gbs * 1e9 * CALIBRATION["sync_efficiency"])
    else:
        fsdp_s += _link_seconds(expert_bytes, replicas, gpu)
    fsdp = max(0.0, fsdp_s - compute)
    opt = optimizer_seconds(m, gpu, m.total / gpus, m.experts_total / m.total)
    if host_opt:  # the shard's masters and momentum cross PCIe twice a step (the update runs on the GPU)
        opt += 2 * 8 * m.total / gpus / (gpu.pcie_gbs * 1e9)
    step = {"compute (fwd + bwd)": compute, "EP all-to-all": a2a, "KCP exchange": kcp,
            "FSDP (exposed)": fsdp, "optimizer": opt}
    return LearnerLayout(gpus=gpus, ep=ep, cp=cp, fsdp=gpus, seqs_per_micro_batch=seqs, checkpointing=ckpt,
                         optimizer_on_host=host_opt, colocated=colocated, memory_gib=memory, step_s=step,
                         compute_model_s=model_s, compute_at_layer_mfu_s=at_mfu)


def decode_step_seconds(m: ModelShape, gpu: GPU, batch: int, mean_context: float, tp: int = 1, ep: int = 1) -> float:
    """One decode step of an engine instance (benchmarks/engine.py's bandwidth bound, plus what bounds it
    at small batches):
        step  = L x fixed per-layer time (launches, small kernels: what a batch-1 step is made of)
              + bytes / (HBM x measured efficiency) + TP all-reduces + EP all-to-alls
        bytes = non-expert weights (the head, not the embedding table) / TP
              + touched experts / EP,  E[touched] = E (1 - (1 - k/E)^B)  (uniform routing)
              + B x (KDA state read + written / TP + MLA latents of the mean context)"""
    c = m.c
    b = max(batch, 1)
    touched = 1 - (1 - c.num_experts_per_token / c.num_experts) ** b
    weights = (m.non_expert - c.vocab_size * c.hidden_size) * 2 / tp + m.experts_total * m.expert_byte * touched / ep
    state = b * (2 * m.kda_state_bytes / tp + mean_context * m.mla_bytes_per_token)
    step = (m.L * CALIBRATION["decode_fixed_us_per_layer"] * 1e-6
            + (weights + state) / (gpu.hbm_tbs * 1e12 * CALIBRATION["decode_bandwidth_efficiency"]))
    if tp > 1:
        step += m.L * 2 * 20e-6
    if ep > 1:
        step += m.n_moe * 2 * (40e-6 if ep <= gpu.gpus_per_node else 80e-6)
    return step


def update_bytes(m: ModelShape, tp: int = 1, ep: int = 1) -> float:
    """What one engine GPU receives in a weight update: non-expert weights and the vision tower in bf16 / TP,
    routed experts as the engines hold them (bf16, or MXFP4 at 4.25 bits) / EP."""
    return (m.non_expert + m.vision) * 2 / tp + m.experts_total * m.expert_byte / ep


def weight_sync_seconds(m: ModelShape, gpu: GPU, tp: int = 1, ep: int = 1, across_nodes: bool = False) -> float:
    """Every engine GPU receives its shard at once (NCCL broadcasts in buckets, one per shard):
    bytes / (link x the measured NCCL efficiency); NVLink inside a node, the NIC across nodes."""
    link = gpu.internode_gbs if across_nodes else gpu.nvlink_gbs
    return update_bytes(m, tp, ep) / (link * 1e9 * CALIBRATION["sync_efficiency"])


class RolloutLayout(BaseModel):
    gpus: int
    instance_gpus: int
    tp: int
    ep: int
    instances: int
    batch: int  # sequences decoding at once per instance
    memory_gib: dict[str, float]
    decode_step_ms: float
    decode_tok_s: float  # the whole fleet
    prefill_s: float  # a step's prefill (tool results and prompts)
    rollout_s: float  # a step's generation and prefill
    sync_s: float


def rollout_layout(m: ModelShape, gpu: GPU, gpus: int, g: int, context: int, sequences: int,
                   max_batch: int = 256) -> RolloutLayout:
    c = m.c
    tp = min(g, gpu.gpus_per_node)
    while c.num_attention_heads % tp:
        tp //= 2
    weights = (m.non_expert + m.vision) * 2 / tp + m.experts_total * m.expert_byte / g
    # a sequence's state on one GPU: KDA state split by heads over TP, the MLA latent (whole context) replicated
    per_seq = m.kda_state_bytes / tp + context * m.mla_bytes_per_token
    free = gpu.memory_gib * GiB * USABLE - weights
    batch = max(0, min(max_batch, int(free // per_seq)))
    instances = gpus // g
    step = decode_step_seconds(m, gpu, batch, context / 2, tp, g)
    fleet = instances * batch / step if batch else 0.0
    gen_tokens = sequences * context / 4
    prefill_tokens = sequences * context - gen_tokens
    # prefill: the forward third of the learner's compute model over all the fleet's GPUs
    prefill = compute_seconds(m, gpu, prefill_tokens / max(instances * g, 1), context) / 3
    rollout = (gen_tokens / fleet if fleet else math.inf) + prefill
    sync = weight_sync_seconds(m, gpu, tp, g, across_nodes=gpus > gpu.gpus_per_node)
    memory = {"weights": weights / GiB, "decode state": batch * per_seq / GiB}
    return RolloutLayout(gpus=gpus, instance_gpus=g, tp=tp, ep=g, instances=instances, batch=batch,
                         memory_gib=memory, decode_step_ms=step * 1e3, decode_tok_s=fleet, prefill_s=prefill, rollout_s=rollout,
                         sync_s=sync)


class Plan(BaseModel):
    preset: str
    gpu: GPU
    gpus: int
    context: int
    group_size: int
    prompts_per_step: int
    expert_precision: str
    learner: LearnerLayout
    rollout: RolloutLayout
    step_s: float
    fits: bool
    problems: list[str]
    suggestions: list[str]


class PlanError(ValueError):
    """Input no layout can take (unknown GPU kind, a count no layout divides)."""


def plan_job(preset: str = "k3", gpu: str = "h200", gpus: int = 256, context: int = 131072, group_size: int = 8,
             prompts_per_step: int = 32, expert_precision: str = "mxfp4") -> Plan:
    """The fastest layout that fits (or, when none does, the one closest to fitting and what to change)."""
    kind = GPUS.get(gpu.lower())
    if kind is None:
        raise PlanError(f"unknown GPU kind {gpu!r}; known: {', '.join(sorted(GPUS))}")
    if expert_precision not in ("bf16", "mxfp4"):
        raise PlanError(f"expert precision must be bf16 or mxfp4, got {expert_precision!r}")
    if gpus < 1 or context < 1 or group_size < 1 or prompts_per_step < 1:
        raise PlanError("gpus, context, group size and prompts per step must be positive")
    if gpus > kind.gpus_per_node and gpus % kind.gpus_per_node:
        raise PlanError(f"{gpus} GPUs is not a whole number of {kind.gpus_per_node}-GPU nodes")
    try:
        m = ModelShape(K3Config.preset(preset), expert_precision)
    except ValueError as e:  # an unknown preset: K3Config names the known ones
        raise PlanError(str(e)) from None
    E = m.c.num_experts
    sequences = group_size * prompts_per_step
    candidates = []
    # colocated (learner and engines time-share all GPUs) or split in halves (they run at once)
    splits = [(gpus, True)] + ([(gpus // 2, False)] if gpus % 2 == 0 else [])
    for (lg, colocated) in splits:
        rg = gpus if colocated else gpus - lg
        # the fleet: the fastest instance size that holds a sequence (the engines' memory is the learner's
        # while colocated, its state being on the host then)
        rolls = [rollout_layout(m, kind, rg, g, context, sequences) for g in _divisors(rg) if E % g == 0]
        roll = min(rolls, key=lambda r: (r.batch < 1, -r.instance_gpus if r.batch < 1 else 0, r.rollout_s))
        eps = [e for e in _divisors(lg) if E % e == 0]
        cps = [p for p in _divisors(lg) if p & (p - 1) == 0 and p <= 64]
        for ep, cp, seqs, ckpt, host in product(eps, cps, (1, 2, 4, 8), (False, True), (False, True)):
            lay = learner_layout(m, kind, lg, ep, cp, seqs, ckpt, host, context, sequences, colocated)
            candidates.append((lay, roll))
    lay, roll = min(candidates, key=lambda lr: _score(lr, m, kind))
    problems = _problems(lay, roll, kind.memory_gib, kind, m)
    step = _step_seconds(lay, roll, m, kind)
    return Plan(preset=preset, gpu=kind, gpus=gpus, context=context, group_size=group_size,
                prompts_per_step=prompts_per_step, expert_precision=expert_precision, learner=lay, rollout=roll,
                step_s=step, fits=not problems, problems=problems,
                suggestions=_suggestions(problems, lay, roll, m, kind, gpus, expert_precision) if problems else [])


def _host_gib(lay: LearnerLayout, m: ModelShape) -> float:
    """Host memory a GPU's share takes: its shard of the optimizer state when that lives on the host
    (8 B a parameter: fp32 masters and momentum) and, colocated, its GPU learner state while the engines run."""
    on_host = 8 * m.total / lay.gpus / GiB if lay.optimizer_on_host else 0.0
    return on_host + (lay.memory_gib["parameters + gradients + optimizer"] if lay.colocated else 0.0)


def _problems(lay: LearnerLayout, roll: RolloutLayout, cap: float, gpu: GPU, m: ModelShape) -> list[str]:
    out = []
    if lay.total_gib > cap * USABLE:
        out.append(f"learner: {lay.total_gib:.1f} GiB a rank of {cap * USABLE:.1f} usable")
    if roll.batch < 1:
        out.append(f"rollout: weights {roll.memory_gib['weights']:.1f} GiB leave no room for one sequence's state")
    if _host_gib(lay, m) > gpu.host_gib_per_gpu:
        out.append(f"host: {_host_gib(lay, m):.0f} GiB a GPU of {gpu.host_gib_per_gpu:.0f}")
    return out


def _step_seconds(lay: LearnerLayout, roll: RolloutLayout, m: ModelShape, gpu: GPU) -> float:
    learner = sum(lay.step_s.values())
    if lay.colocated:  # time-shared: rollouts, then the learner; its GPU state leaves for the host and comes back
        swap = 2 * lay.memory_gib["parameters + gradients + optimizer"] * GiB / (gpu.pcie_gbs * 1e9)
        return roll.rollout_s + learner + roll.sync_s + swap
    return max(roll.rollout_s, learner) + roll.sync_s  # asynchronous: they overlap


def _score(lr: tuple[LearnerLayout, RolloutLayout], m: ModelShape, gpu: GPU) -> tuple:
    """Layouts that fit first, fastest first; else the one closest to fitting."""
    lay, roll = lr
    over = (max(0.0, lay.total_gib - gpu.memory_gib * USABLE) + (1e3 if roll.batch < 1 else 0.0)
            + max(0.0, _host_gib(lay, m) - gpu.host_gib_per_gpu))
    return (over > 0, over, _step_seconds(lay, roll, m, gpu), -lay.seqs_per_micro_batch)  # ties: fuller micro-batches


def _suggestions(problems, lay, roll, m, gpu, gpus, precision) -> list[str]:
    out = []
    floor = 6 * m.total / (gpu.memory_gib * GiB * 0.85)  # the state alone, optimizer on the host
    if floor > gpus:
        n = gpu.gpus_per_node * math.ceil(floor / gpu.gpus_per_node)
        out.append(f"more GPUs: the learner state alone (6 B/param with the optimizer on the host) needs "
                   f"at least {n} {gpu.name}s")
    if lay.memory_gib["activations"] + lay.memory_gib["logits"] > 0.25 * gpu.memory_gib:
        if not lay.checkpointing:
            out.append("activation checkpointing (learner.activation_checkpointing: true)")
        if lay.seqs_per_micro_batch > 1:
            out.append("fewer sequences per micro-batch")
        if lay.cp * 2 <= lay.gpus:
            out.append(f"more context parallel (KCP {lay.cp * 2})")
    if lay.memory_gib["gathered layers (FSDP prefetch)"] > 0.1 * gpu.memory_gib:
        out.append(f"more EP (now {lay.ep}): fewer experts gathered a layer")
    if roll.batch < 1:
        if precision == "bf16":
            out.append("--expert-precision mxfp4: the engines' experts in 4.25 bits (the release's format)")
        if roll.instance_gpus * 2 <= gpus:
            out.append(f"larger engine instances (EP {roll.instance_gpus * 2})")
    if not lay.optimizer_on_host:
        out.append("the optimizer state on the host (8 B/param off the GPU)")
    return out


def _ms_or_s(seconds: float) -> str:
    if math.isinf(seconds):
        return "-"
    return f"{seconds * 1e3:,.1f} ms" if seconds < 1 else f"{seconds:,.1f} s"


def print_plan(plan: Plan, console: Console) -> None:
    """The plan as rich tables: job, layout, memory per rank, times, verdict."""
    lay, roll, gpu = plan.learner, plan.rollout, plan.gpu
    m = ModelShape(K3Config.preset(plan.preset), plan.expert_precision)
    seqs = plan.group_size * plan.prompts_per_step
    console.print(f"[bold]{plan.preset}[/] ({m.total / 1e9:,.1f}B parameters, {m.active / 1e9:,.1f}B active) on "
                  f"{plan.gpus} x {gpu.name}: {plan.prompts_per_step} prompts x {plan.group_size} = {seqs} sequences "
                  f"of {plan.context:,} tokens a step ({seqs * plan.context / 1e6:,.1f}M tokens), experts "
                  f"{plan.expert_precision} in the engines")

    t = Table(title="Layout")
    for col in ("role", "GPUs", "layout", "batch"):
        t.add_column(col)
    mode = "colocated: time-shares every GPU with the fleet" if lay.colocated else "its own GPUs, beside the fleet"
    t.add_row("learner", str(lay.gpus),
              f"FSDP {lay.fsdp} x EP {lay.ep}, KCP {lay.cp}, no PP; activation checkpointing "
              f"{'on' if lay.checkpointing else 'off'}; optimizer state on the {'host' if lay.optimizer_on_host else 'GPU'}"
              f"; {mode}", f"{lay.seqs_per_micro_batch} sequence(s) a micro-batch")
    t.add_row("rollout", str(roll.gpus), f"{roll.instances} engine(s) of {roll.instance_gpus} GPUs: TP {roll.tp} "
              f"(attention, shared), EP {roll.ep} (routed experts)", f"{roll.batch} sequences an engine")
    console.print(t)

    t = Table(title=f"Memory per rank (GiB; {gpu.memory_gib * USABLE:.1f} usable of {gpu.memory_gib:.1f})")
    t.add_column("role")
    t.add_column("part")
    t.add_column("GiB", justify="right")
    for part, gib in lay.memory_gib.items():
        t.add_row("learner", part, f"{gib:,.1f}")
    t.add_row("learner", "[bold]total[/]", f"[bold]{lay.total_gib:,.1f}[/]")
    for part, gib in roll.memory_gib.items():
        t.add_row("rollout", part, f"{gib:,.1f}")
    t.add_row("rollout", "[bold]total[/]", f"[bold]{sum(roll.memory_gib.values()):,.1f}[/]")
    host = _host_gib(lay, m)
    if host:
        t.add_row("host", "learner state off the GPU", f"{host:,.1f} (of {gpu.host_gib_per_gpu:.0f})")
    console.print(t)

    t = Table(title="Time per step")
    t.add_column("what")
    t.add_column("time", justify="right")
    for part, s in lay.step_s.items():
        t.add_row(f"learner: {part}", _ms_or_s(s))
        if part.startswith("compute"):  # the larger of the two (at K3's width), each shown
            t.add_row("  three-term model (GEMMs, KDA kernel, element-wise)", _ms_or_s(lay.compute_model_s))
            t.add_row(f"  FLOPs at the full-width layer's measured {CALIBRATION['layer_mfu']:.0%} MFU",
                      _ms_or_s(lay.compute_at_layer_mfu_s))
    t.add_row("[bold]learner step[/]", f"[bold]{_ms_or_s(sum(lay.step_s.values()))}[/]")
    t.add_row("rollout: decode step (an engine)", f"{roll.decode_step_ms:,.1f} ms")
    t.add_row("rollout: decode rate (the fleet)", f"{roll.decode_tok_s:,.0f} tok/s")
    t.add_row("rollout: prefill (3/4 of the tokens)", _ms_or_s(roll.prefill_s))
    t.add_row("[bold]rollout (decode + prefill)[/]", f"[bold]{_ms_or_s(roll.rollout_s)}[/]")
    t.add_row("weight sync", _ms_or_s(roll.sync_s))
    how = "rollout + learner + sync + state to the host and back" if lay.colocated else "max(rollout, learner) + sync"
    t.add_row(f"[bold]job step[/] ({how})", f"[bold]{_ms_or_s(plan.step_s)}[/]")
    console.print(t)

    if plan.fits:
        console.print("[bold green]fits[/]")
    else:
        console.print("[bold red]does not fit:[/] " + "; ".join(plan.problems))
        for s in plan.suggestions:
            console.print(f"  - {s}")
