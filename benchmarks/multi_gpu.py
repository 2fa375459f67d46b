"""Multi-GPU learner and weight broadcast on one host.

    python benchmarks/multi_gpu.py --gpus 2 --steps 6
    python benchmarks/multi_gpu.py --gpus 4 --ep 4 --skip-broadcast     # + expert parallel
    python benchmarks/multi_gpu.py --cpu --gpus 2 --ep 2 --seq-len 96 --seqs 4 --steps 2   # gloo smoke run

A. Data parallel: the same k3-small training run (same data, same init) on 1 GPU and on
   N GPUs with FSDP2; prints both loss curves and the largest difference. With `--ep E`
   also FSDP2 + expert parallel (routed experts sharded over groups of E ranks, all-to-all
   dispatch; `learner.expert_parallel`), the same Trainer code the CPU tests run with gloo.
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
import sys
import time
from pathlib import Path

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[k] = v
sys.path.append(str(Path(__file__).resolve().parents[1]))  # after an installed k3rl: spawned children must not find the bare k3rl/ first

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from k3rl.cluster import free_port  # noqa: E402


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


def _sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def _train(rank: int, world: int, port: int, args, out: str, ep: int = 1) -> None:
    """One run of the learner on `world` ranks (FSDP2 when > 1, expert parallel over `ep`)."""
    from k3rl.config import LearnerSection
    from k3rl.learner.expert_parallel import local_expert_params
    from k3rl.learner.trainer import Trainer
    from k3rl.model import K3Config, K3ForCausalLM

    cpu = args.cpu
    if not cpu:
        torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if cpu:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(args.preset))
    cfg = LearnerSection(micro_batch_tokens=args.micro_batch_tokens, steps=100, bf16=not cpu, lr=1e-3,
                         data_parallel="fsdp" if world > 1 else "none", world_size=world, expert_parallel=ep)
    t = Trainer(model, cfg, device="cpu" if cpu else f"cuda:{rank}")
    expert_numel = sum(p.numel() for p in local_expert_params(t.model))  # this rank's slice (0 without EP)
    losses, times = [], []
    for s in range(args.steps):
        _sync(cpu)
        t0 = time.perf_counter()
        batch = trajectories(s, args.seqs, args.seq_len, 320)
        # SFT (NLL) makes a smooth, large loss to compare; the RL loss of random rewards is ~0 +- noise
        m = t.sft_step(batch) if args.objective == "sft" else t.train_step(batch)
        _sync(cpu)
        times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
    peak = torch.cuda.max_memory_allocated() / 2**30 if not cpu else 0.0
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "times": times, "peak_gib": peak,
                                         "expert_numel_rank0": expert_numel}))
    if world > 1:
        dist.destroy_process_group()


def _broadcast(rank: int, world: int, port: int, args, out: str) -> None:
    from k3rl.model import K3Config, K3ForCausalLM
    from k3rl.model.state_dict_adapter import to_hf
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
    ap.add_argument("--skip-broadcast", action="store_true")
    ap.add_argument("--ep", type=int, default=1, help="also run FSDP2 + expert parallel over groups of EP ranks")
    ap.add_argument("--objective", choices=["sft", "rl"], default="sft")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes (a smoke run of the same code)")
    ap.add_argument("--preset", default=None, help="model preset (default k3-small; k3-tiny with --cpu)")
    args = ap.parse_args()
    args.preset = args.preset or ("k3-tiny" if args.cpu else "k3-small")
    if args.ep > 1 and args.gpus % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide --gpus {args.gpus}")
    tmp = Path("/tmp/k3rl_multi_gpu")
    tmp.mkdir(exist_ok=True)
    if args.cpu:
        print(f"# multi-process CPU (gloo): {args.gpus} ranks, torch {torch.__version__}", flush=True)
    else:
        n = torch.cuda.device_count()
        if n < args.gpus:
            raise SystemExit(f"needs {args.gpus} GPUs, found {n}")
        print(f"# multi-GPU: {args.gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    if not (args.cpu or args.skip_broadcast):
        mp.spawn(_broadcast, args=(args.gpus, free_port(), args, str(tmp / "bcast.json")), nprocs=args.gpus)
        b = json.loads((tmp / "bcast.json").read_text())
        print(f"NCCL broadcast, one 1 GiB buffer: {b['raw_gbps']:.1f} GB/s")
        print(f"k3-small WeightUpdate ({b['update_bytes'] / 1e6:.0f} MB bf16, {b['buckets']} buckets): "
              f"{b['sync_s'] * 1e3:.1f} ms, {b['update_gbps']:.1f} GB/s = {b['update_gbps'] / b['raw_gbps']:.0%} of the raw broadcast",
              flush=True)
    if args.skip_train:
        return
    _train(0, 1, 0, args, str(tmp / "one.json"))
    one_name = "1 process" if args.cpu else "1 GPU"
    runs = {one_name: json.loads((tmp / "one.json").read_text())}
    mp.spawn(_train, args=(args.gpus, free_port(), args, str(tmp / "dp.json")), nprocs=args.gpus)
    runs[f"FSDP2 x{args.gpus}"] = json.loads((tmp / "dp.json").read_text())
    if args.ep > 1:
        mp.spawn(_train, args=(args.gpus, free_port(), args, str(tmp / "ep.json"), args.ep), nprocs=args.gpus)
        runs[f"FSDP2+EP{args.ep} x{args.gpus}"] = json.loads((tmp / "ep.json").read_text())
    print(f"objective: {args.objective}, {args.preset}, {args.seqs} x {args.seq_len} tokens per step, "
          f"{'fp32' if args.cpu else 'bf16'}, Per-Head Muon")
    names = list(runs)
    header = [f"loss, {n}" for n in names] + [f"step s, {n}" for n in names]
    print("| step | " + " | ".join(header) + " |")
    print("|---" * (1 + 2 * len(names)) + "|")
    for i in range(args.steps):
        cells = [f"{runs[n]['losses'][i]:.5f}" for n in names] + [f"{runs[n]['times'][i]:.3f}" for n in names]
        print(f"| {i} | " + " | ".join(cells) + " |")
    base = runs[one_name]["losses"]
    for n in names[1:]:
        diff = max(abs(a - c) for a, c in zip(base, runs[n]["losses"], strict=True))
        memory = "" if args.cpu else f", peak memory of rank 0 {runs[n]['peak_gib']:.2f} GiB"
        print(f"{n}: max |loss difference| to {one_name} = {diff:.2e} ({'fp32' if args.cpu else 'bf16'}){memory}")
    if not args.cpu:
        print(f"{one_name}: peak memory {runs[one_name]['peak_gib']:.2f} GiB")
    if args.ep > 1:
        numel = runs[names[-1]]["expert_numel_rank0"]
        print(f"routed-expert parameters held by rank 0 with EP{args.ep}: {numel:,}")


if __name__ == "__main__":
    main()
