"""The full K3 preset's engine memory per GPU (issue [21] item 3): what one GPU of an engine instance holds at
EP 8 / 16 / 32 with the routed experts in bf16 against MXFP4, counted from the preset built on the `meta`
device (shapes and dtypes only, nothing allocated), beside k3rl.plan's arithmetic for the same layout, and
how many 128K-token sequences the rest of an H200 holds (results: BENCHMARKS.md, "[21]").

The engine's dtypes: bf16, the fp32 allow-list (KDA gate parameters, convolutions, QB bias: build_model),
the router's W_r and KDA's W_beta widened to fp32 (rollout.engine.decode.keep_fp32_island_weights), and
under mxfp4 the routed experts as MXFP4 bytes (RoutedExperts.hold_mxfp4_: weight_packed n/2 + weight_scale
n/32 bytes a row of n values, 4.25 bits a value). The layout is k3rl.plan's (its ASSUMPTIONS): an instance
of g GPUs splits everything but the routed experts over TP = min(g, 8) ranks and the experts over EP = g.

    .venv/bin/python benchmarks/engine_memory.py
"""

from __future__ import annotations

import math

from k3rl.model import K3Config, build_model, mxfp4
from k3rl.model.moe import RoutedExperts
from k3rl.plan import GPUS, USABLE, ModelShape, rollout_layout
from k3rl.rollout.engine.decode import keep_fp32_island_weights

GiB = 2**30
CONTEXT = 131072


def engine_bytes(precision: str) -> tuple[int, int]:
    """(routed-expert bytes, every other byte) of the full preset as an engine holds it, from the meta model."""
    model = build_model("k3", {"expert_precision": precision}, dtype="bfloat16", device="meta")
    keep_fp32_island_weights(model)  # W_r, W_beta in fp32, as the engine keeps them
    experts = dense_experts = 0
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            for name in m.NAMES:
                w = getattr(m, name)
                dense_experts += w.numel() * w.element_size()
                if precision == "mxfp4":  # weight_packed [.., n/2] + weight_scale [.., n/32], uint8
                    experts += sum(math.prod(s) for s in mxfp4.packed_shapes(tuple(w.shape)))
                else:
                    experts += w.numel() * w.element_size()
    everything = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return experts, everything - dense_experts


def main() -> None:
    gpu = GPUS["h200"]
    counted = {p: engine_bytes(p) for p in ("bf16", "mxfp4")}
    rest = counted["bf16"][1]
    print(f"full K3 preset on meta: routed experts {counted['bf16'][0] / 1e12:.3f} TB in bf16, "
          f"{counted['mxfp4'][0] / 1e12:.3f} TB in MXFP4; everything else {rest / 1e9:.1f} GB "
          f"(bf16 with the fp32 allow-list and fp32 W_r, W_beta)")
    print(f"one GPU of an instance: everything else / TP (TP = min(EP, 8)) + experts / EP; {gpu.name}: "
          f"{gpu.memory_gib:.1f} GiB, {USABLE:.0%} usable; a {CONTEXT // 1024}K-token sequence's decode state as "
          f"k3rl.plan counts it")
    print()
    print("| EP (TP) | experts | experts / GPU (GiB) | other / GPU (GiB) | weights / GPU (GiB) | k3rl.plan (GiB) "
          "| 128K sequences / instance (H200) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for ep in (8, 16, 32):
        tp = min(ep, gpu.gpus_per_node)
        for precision in ("bf16", "mxfp4"):
            experts, other = counted[precision]
            per_gpu = experts / ep + other / tp
            m = ModelShape(K3Config.preset("k3"), precision)
            plan = rollout_layout(m, gpu, gpus=ep, g=ep, context=CONTEXT, sequences=1)
            per_seq = m.kda_state_bytes / tp + CONTEXT * m.mla_bytes_per_token
            free = gpu.memory_gib * GiB * USABLE - per_gpu
            seqs = max(0, int(free // per_seq))
            fits = f"{seqs}" if free > 0 else f"does not fit ({per_gpu / GiB:.0f} > {gpu.memory_gib * USABLE:.0f})"
            print(f"| {ep} ({tp}) | {precision} | {experts / ep / GiB:.1f} | {other / tp / GiB:.1f} | "
                  f"{per_gpu / GiB:.1f} | {plan.memory_gib['weights']:.1f} | {fits} |")


if __name__ == "__main__":
    main()
