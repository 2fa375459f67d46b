"""Multi-GPU learner and weight broadcast on one host (issue [9]).

    python benchmarks/multi_gpu.py --gpus 2 --steps 6

A. Data parallel: the same k3-small training run (same data, same init) on 1 GPU and on
   N GPUs with FSDP2; prints both loss curves and the largest difference.
B. Weight broadcast: a full k3-small WeightUpdate (HF-named buckets, bf16) broadcast by
   NCCL from rank 0 (the learner) to the other ranks (inference workers), against the
   measured NCCL broadcast bandwidth of one large buffer.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[k] = v
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def trajectories(step: int, n: int, length: int, vocab: int):
    from k3rl.types import Trajectory

    rng = random.Random(step)
    out = []
    for i in range(n):
        prompt = [rng.randrange(256) for _ in range(64)]
        comp = [rng.randrange(256) for _ in range(length - 64)]
        out.append(Trajectory(id=f"s{step}-{i}", env_id="bench", group_id=f"g{step}-{i // 4}", prompt_ids=prompt,
                              completion_ids=comp, logprobs=[-5.5] * len(comp), loss_mask=[1] * len(comp),
                              versions=[0] * len(comp), reward=float(rng.random() < 0.5)))
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank: int, world: int, port: int, args, out: str) -> None:
    from k3rl.config import LearnerSection
    from k3rl.learner.model import K3Config, K3ForCausalLM
    from k3rl.learner.trainer import Trainer

    torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-small"))
    cfg = LearnerSection(micro_batch_tokens=args.micro_batch_tokens, steps=100, bf16=True, lr=1e-3,
                         data_parallel="fsdp" if world > 1 else "none", world_size=world)
    t = Trainer(model, cfg, device=f"cuda:{rank}")
    losses, times = [], []
    for s in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = trajectories(s, args.seqs, args.seq_len, 320)
        # SFT (NLL) makes a smooth, large loss to compare; the RL loss of random rewards is ~0 +- noise
        m = t.sft_step(batch) if args.objective == "sft" else t.train_step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "times": times}))
    if world > 1:
        dist.destroy_process_group()


def _broadcast(rank: int, world: int, port: int, args, out: str) -> None:
    from k3rl.learner.model import K3Config, K3ForCausalLM
    from k3rl.learner.model.state_dict_adapter import to_hf
    from k3rl.types import WeightUpdate

    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    # raw bandwidth: one 1 GiB buffer
    buf = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        dist.broadcast(buf, 0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dist.broadcast(buf, 0)
    torch.cuda.synchronize()
    raw = reps * buf.numel() * 2 / (time.perf_counter() - t0) / 1e9
    del buf
    # a real update: every k3-small weight under its HF name, in 256 MB buckets, packed flat per bucket
    torch.manual_seed(0)
    with torch.device(dev):
        model = K3ForCausalLM(K3Config.preset("k3-small")).to(torch.bfloat16)
    hf = {k: v.detach().contiguous() for k, v in to_hf(model.state_dict()).items()}
    update = WeightUpdate.from_state_dict(1, hf, bucket_bytes=256 << 20, transport="nccl")
    flat = []
    for b in update.buckets:
        by_dtype: dict = {}
        for tensor in b.tensors.values():
            by_dtype.setdefault(tensor.dtype, []).append(tensor.reshape(-1))
        flat.extend(torch.cat(v) if rank == 0 else torch.empty(sum(x.numel() for x in v), dtype=d, device=dev)
                    for d, v in by_dtype.items())
    nbytes = sum(x.numel() * x.element_size() for x in flat)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for x in flat:
            dist.broadcast(x, 0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times[1:])
    if rank == 0:
        Path(out).write_text(json.dumps({"raw_gbps": raw, "update_bytes": nbytes, "buckets": len(update.buckets),
                                         "sync_s": best, "update_gbps": nbytes / best / 1e9}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--objective", choices=["sft", "rl"], default="sft")
    args = ap.parse_args()
    n = torch.cuda.device_count()
    if n < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, found {n}")
    tmp = Path("/tmp/k3rl_multi_gpu")
    tmp.mkdir(exist_ok=True)
    print(f"# multi-GPU: {args.gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    mp.spawn(_broadcast, args=(args.gpus, _port(), args, str(tmp / "bcast.json")), nprocs=args.gpus)
    b = json.loads((tmp / "bcast.json").read_text())
    print(f"NCCL broadcast, one 1 GiB buffer: {b['raw_gbps']:.1f} GB/s")
    print(f"k3-small WeightUpdate ({b['update_bytes'] / 1e6:.0f} MB bf16, {b['buckets']} buckets): "
          f"{b['sync_s'] * 1e3:.1f} ms, {b['update_gbps']:.1f} GB/s = {b['update_gbps'] / b['raw_gbps']:.0%} of the raw broadcast",
          flush=True)
    if args.skip_train:
        return
    _train(0, 1, 0, args, str(tmp / "one.json"))
    mp.spawn(_train, args=(args.gpus, _port(), args, str(tmp / "dp.json")), nprocs=args.gpus)
    one, dp = json.loads((tmp / "one.json").read_text()), json.loads((tmp / "dp.json").read_text())
    print(f"objective: {args.objective}, {args.seqs} x {args.seq_len} tokens per step, bf16, Per-Head Muon")
    print(f"| step | loss, 1 GPU | loss, FSDP2 x{args.gpus} | step s, 1 GPU | step s, FSDP2 |")
    print("|---|---|---|---|---|")
    for i, (a, c, ta, tc) in enumerate(zip(one["losses"], dp["losses"], one["times"], dp["times"], strict=True)):
        print(f"| {i} | {a:.5f} | {c:.5f} | {ta:.3f} | {tc:.3f} |")
    diff = max(abs(a - c) for a, c in zip(one["losses"], dp["losses"], strict=True))
    print(f"max |loss difference| = {diff:.2e} (bf16)")


if __name__ == "__main__":
    main()
