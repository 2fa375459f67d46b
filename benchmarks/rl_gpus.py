"""The asynchronous agentic RL job on one GPU and across GPUs of one host.

    python benchmarks/rl_gpus.py --steps 5                         # every layout below
    python benchmarks/rl_gpus.py --layouts 2gpu --steps 3
    python benchmarks/rl_gpus.py --cpu --preset k3-tiny --steps 2 --prompts 2 --group 2   # smoke run

The real job (local Ray, k3-small in bf16 in the learner and the embedded engines, KeyLookup
episodes, MLflow on SQLite, the Parquet store), the same work in every layout:

  1gpu       learner and one engine share GPU 0 (0.5 GPU each); weights by CUDA IPC
  1gpu-os    the same, weights through Ray's object store (host memory)
  2gpu       learner on GPU 0, one engine on GPU 1; weights by an NCCL broadcast in buckets
  2gpu-2eng  learner and engine 0 share GPU 0, engine 1 on GPU 1; weights by the object store

Reported per layout, over the steps after the first `--skip-steps` (which compile and autotune the
learner's Triton kernels for each new packed length: 30, 13, 4, 4 s of training in the first four
steps on a fresh H200, 0.8-1.1 s after):
episodes/s and generated tokens/s of the whole loop, the learner's train tokens/s, the time
to bring the engines to new weights, and the learner's idle fraction (waiting for rollouts).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, forwarded to every Ray actor).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[k] = v
if importlib.util.find_spec("k3rl") is None:  # a checkout without an install (not the device's installed layout)
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # after an installed k3rl: spawned children must not find the bare k3rl/ first

LAYOUTS = {
    "1gpu": ["learner.gpus=0.5", "rollout.gpus_per_inference_worker=0.5", "rollout.weight_transport=cuda_ipc"],
    "1gpu-os": ["learner.gpus=0.5", "rollout.gpus_per_inference_worker=0.5", "rollout.weight_transport=object_store"],
    "2gpu": ["learner.gpus=1", "rollout.gpus_per_inference_worker=1", "rollout.weight_transport=nccl"],
    "2gpu-2eng": ["learner.gpus=0.5", "rollout.gpus_per_inference_worker=0.5", "rollout.num_inference_workers=2",
                  "rollout.weight_transport=object_store"],
}


def run(layout: str, args, root: Path) -> dict:
    import ray

    from k3rl.config import JobConfig
    from k3rl.job import run_job

    place = LAYOUTS[layout]
    if args.cpu:  # a smoke run of the same loop: no GPUs, CUDA IPC replaced by the object store
        place = [o.replace("cuda_ipc", "object_store") for o in place if "gpus" not in o]
    cfg = JobConfig.load(None, [
        f"name=gpu-{layout}", f"model.preset={args.preset}",
        *([] if args.cpu else ["model.dtype=bfloat16", "learner.bf16=true"]),
        f"rollout.group_size={args.group}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.episodes_per_worker={args.prompts * args.group * 2}", "rollout.num_rollout_workers=2",
        f"rollout.max_batch_sequences={args.prompts * args.group * 2}",
        f"rollout.sampling.max_tokens_per_turn={args.max_tokens}", "rollout.max_context_tokens=2048",
        f"rollout.max_policy_lag={args.lag}", "envs.max_turns=3", "envs.train.0.id=k3rl/KeyLookup-v0",
        f"learner.steps={args.steps}", "learner.checkpoint_every=0", "learner.sft_steps=0",
        "learner.micro_batch_tokens=16384", "tracking.sample_episodes=0",
        f"tracking.runs_dir={root}/runs", f"tracking.uri=sqlite:///{root}/runs/mlflow.db",
        *place, *args.set,
    ])
    t0 = time.monotonic()
    try:
        summary = run_job(cfg, quiet=True)
    finally:
        ray.shutdown()
    wall = time.monotonic() - t0
    # the first steps compile and autotune the learner's kernels for new packed lengths (seconds each)
    h = summary["history"][args.skip_steps:] or summary["history"]
    step_s = sum(m["time/step_s"] for m in h)
    out = {
        "layout": layout, "steps": len(summary["history"]), "job_seconds": wall,
        "episodes_per_s": sum(args.prompts * args.group for _ in h) / step_s,
        "gen_tokens_per_s": sum(m["throughput/rollout_tokens_per_s"] * m["time/step_s"] for m in h) / step_s,
        "train_tokens_per_s": statistics.median(m["throughput/train_tokens_per_s"] for m in h),
        "train_s": statistics.median(m["time/train_s"] for m in h),
        # the last step pushes no weights (nothing samples from them) unless an eval follows it
        "weight_sync_s": statistics.median([m["time/weight_sync_s"] for m in h if "time/weight_sync_s" in m] or [0.0]),
        "learner_idle": sum(m["time/wait_for_rollouts_s"] for m in h) / step_s,
        "step_s": step_s / len(h),
        "reward": h[-1]["reward/mean"],
        # every step's times: medians above hide a slow step (a new shape compiling, an eval)
        "history": [{k: round(v, 3) for k, v in m.items() if k.startswith(("time/", "weight_sync/wait"))
                     or k in ("learner/idle_fraction", "throughput/episodes_per_s", "loss_tokens",
                              "engine/graph_captures", "engine/capture_s", "engine/decode_s", "engine/prefill_s",
                              "engine/prefill_forwards", "engine/prefill_tokens", "engine/fed_prompt_tokens",
                              "engine/prefill_graph_runs", "engine/prefill_graph_captures",
                              "engine/prefill_graph_cached_runs")}
                    for m in summary["history"]],
    }
    synced = [m for m in h if "weight_sync/broadcast_gbps" in m]
    if synced:
        out["broadcast_gbps"] = statistics.median(m["weight_sync/broadcast_gbps"] for m in synced)
        out["update_mb"] = synced[-1]["weight_sync/bytes"] / 1e6
        out["wait_for_engines_s"] = statistics.median(m["weight_sync/wait_for_engines_s"] for m in synced)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="1gpu,2gpu,2gpu-2eng")
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--skip-steps", type=int, default=1,
                    help="steps left out of the summary (kernels compiling; 4 reach the steady state on a fresh GPU)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another config override, e.g. rollout.compile_decode=true (repeatable)")
    ap.add_argument("--cpu", action="store_true", help="smoke run on CPUs (gloo for the broadcast)")
    args = ap.parse_args()
    import torch

    device = "CPU" if args.cpu else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    print(f"# RL job: {args.preset} bf16, {args.steps} steps x {args.prompts} prompts x {args.group} samples, "
          f"KeyLookup, 3 turns x {args.max_tokens} tokens, max_policy_lag {args.lag}; "
          f"{device}, torch {torch.__version__}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="k3rl-rl-gpus-"))
    results = []
    try:
        for layout in args.layouts.split(","):
            r = run(layout, args, root)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| layout | episodes/s | generated tok/s | train tok/s | train s | weight sync s | learner idle | step s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['layout']} | {r['episodes_per_s']:.2f} | {r['gen_tokens_per_s']:.0f} | {r['train_tokens_per_s']:.0f} | "
              f"{r['train_s']:.2f} | {r['weight_sync_s']:.3f} | {r['learner_idle']:.0%} | {r['step_s']:.1f} |")
    base = next((r for r in results if r["layout"] == "1gpu"), None)
    for r in results:
        if base is not None and r is not base:
            print(f"{r['layout']} / 1gpu episodes/s: {r['episodes_per_s'] / base['episodes_per_s']:.2f}x")
        if "broadcast_gbps" in r:
            print(f"{r['layout']}: NCCL broadcast of {r['update_mb']:.0f} MB per step at {r['broadcast_gbps']:.1f} GB/s, "
                  f"after {r['wait_for_engines_s'] * 1e3:.1f} ms waiting for the engines to join")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
