"""Learner throughput (training tokens/s, MFU) and batched vs looped Newton-Schulz.

    # CPU (k3-tiny, fp32)
    python benchmarks/learner.py
    # one H200: k3-small, bf16 autocast, Per-Head Muon
    python benchmarks/learner.py --preset k3-small --device cuda
    # ... and where the host waits for the GPU inside a step (by source line), and where the GPU's time goes
    python benchmarks/learner.py --preset k3-small --device cuda --skip-ns --sync-trace syncs.txt --profile ops.txt
    # ... and the host's clock against the GPU's at the step's phase boundaries, 4 more steps
    python benchmarks/learner.py --preset k3-small --device cuda --skip-ns --phases 4

Training tokens/s counts the packed positions of a `Trainer.train_step` (RL loss, all
micro-batches, gradient clipping and the optimizer step included) over its wall time,
after warm-up steps. MFU = achieved model FLOP/s / peak dense bf16 FLOP/s, with

    FLOPs per token = 6 * N_active_matmul                            (forward + backward of the GEMMs)
                    + 3 * [ n_MLA * 2 * H * (d_qk + d_v) * S / 2      (QK^T and PV over the mean causal context S/2)
                          + n_KDA * H * 6 * D^2 ]                    (KDA: state read, delta and update per token)

where N_active_matmul counts the weights one token multiplies (routed experts: k of E;
the input embedding is a lookup and is left out) and S is the sequence length. The peak
is 989 TFLOP/s for H100/H200 SXM bf16 dense (pass --peak-tflops otherwise).

Newton-Schulz: every Muon block shape of the preset (per head, per expert, whole
matrices), orthogonalised as one batched call per shape (what PerHeadMuon does) against
one call per matrix (`newton_schulz_loop`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from collections import Counter

import torch

if importlib.util.find_spec("k3rl") is None:  # not installed: the source tree (an installed k3rl wins,
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed k3rl (as on the GPU image)

from k3rl.config import LearnerSection  # noqa: E402
from k3rl.learner.optim import param_groups  # noqa: E402
from k3rl.learner.trainer import Trainer  # noqa: E402
from k3rl.model import K3Config, K3ForCausalLM, count_parameters  # noqa: E402
from k3rl.types import Trajectory  # noqa: E402

ns_ops = importlib.import_module("k3rl.kernels.newton_schulz")

PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_batch(n: int, seq_len: int, prompt_len: int, seed: int) -> list[Trajectory]:
    """n trajectories of seq_len tokens (byte-range ids, so never the media placeholder), groups of 4."""
    rng = random.Random(seed)
    C = seq_len - prompt_len
    return [
        Trajectory(
            env_id="bench", group_id=f"g{i // 4}",
            prompt_ids=[rng.randrange(256) for _ in range(prompt_len)],
            completion_ids=[rng.randrange(256) for _ in range(C)],
            logprobs=[-5.7 + rng.uniform(-0.3, 0.3) for _ in range(C)],
            loss_mask=[1] * C, versions=[0] * C, reward=rng.random(),
        )
        for i in range(n)
    ]  # fmt: skip


def flops_per_token(c: K3Config, seq_len: int) -> float:
    """Training FLOPs per token (see the module docstring)."""
    _, active = count_parameters(c)  # input embedding already excluded
    # vectors and norms do no GEMM work; they are < 0.1% of the count, so the 6N term keeps them
    la = c.linear_attn_config
    n_mla = len(la.full_attn_layers)
    n_kda = c.num_hidden_layers - n_mla
    mla = n_mla * 2 * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * seq_len / 2
    kda = n_kda * la.num_heads * 6 * la.head_dim**2
    return 6 * active + 3 * (mla + kda)


def bench_training(args, device: torch.device) -> dict:
    config = K3Config.preset(args.preset)
    torch.manual_seed(0)
    with torch.device(device):
        model = K3ForCausalLM(config)
    if args.compile:
        model.compile_layers()  # regional: each decoder layer; compiled in the warm-up step
    bf16 = args.bf16 if args.bf16 is not None else device.type == "cuda"
    cfg = LearnerSection(
        micro_batch_tokens=args.micro_batch_tokens, steps=args.steps + args.warmup + 1, bf16=bf16,
        activation_checkpointing=args.activation_checkpointing, optimizer=args.optimizer, routing_replay=False,
    )  # fmt: skip
    trainer = Trainer(model, cfg, device=device)
    n_seq = max(1, args.batch_tokens // args.seq_len)
    batches = [
        synthetic_batch(n_seq, args.seq_len, args.prompt_len, s) for s in range(args.warmup + args.steps)
    ]
    times, opt_times, tokens = [], [], 0
    original_step = trainer.optimizer.step

    def timed_step(*a, **kw):  # time the optimizer alone inside the train step: on the GPU by events, so
        if device.type != "cuda":  # the step keeps its own host syncs (a sync here let the GPU idle while
            t = time.perf_counter()  # the host launched the optimizer: ~15 ms a k3-small step)
            out = original_step(*a, **kw)
            opt_times.append(time.perf_counter() - t)
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original_step(*a, **kw)
        end.record()
        opt_times.append((start, end))
        return out

    trainer.optimizer.step = timed_step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i, batch in enumerate(batches):
        sync(device)
        t = time.perf_counter()
        m = trainer.train_step(batch)
        sync(device)
        if i == 0:
            first_step_s = time.perf_counter() - t  # with --compile: the compilation
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            tokens = m["tokens"]
    step_s = statistics.median(times)
    tok_s = tokens / step_s
    if args.phases:
        for line in phase_marks(trainer, batches[-args.phases :], device):
            print("  " + line)
    if args.profile:
        profile_step(trainer, batches[-1], device, args.profile)
    if args.sync_trace and device.type == "cuda":
        sync_trace(trainer, batches[-1], args.sync_trace)
    fpt = flops_per_token(config, args.seq_len)
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    total, active = count_parameters(config)
    return {
        "preset": args.preset, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params_total": total, "params_active_no_embed": active,
        "bf16": bf16, "optimizer": args.optimizer, "activation_checkpointing": args.activation_checkpointing,
        "compile": args.compile, "first_step_s": first_step_s,
        "seq_len": args.seq_len, "tokens_per_step": int(tokens), "micro_batch_tokens": args.micro_batch_tokens,
        "step_s_median": step_s, "optimizer_s_median": statistics.median(
            e[0].elapsed_time(e[1]) / 1e3 if isinstance(e, tuple) else e for e in opt_times[args.warmup:]),
        "tokens_per_s": tok_s, "model_tflops_per_s": tok_s * fpt / 1e12, "flops_per_token": fpt,
        "mfu": (tok_s * fpt / (peak * 1e12)) if peak else None, "peak_tflops": peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "final_loss": m["loss"],
    }  # fmt: skip


def phase_marks(trainer, batches, device: torch.device) -> list[str]:
    """Where a step waits: the host's clock and the GPU's (a CUDA event recorded at the same point) at
    the step's phase boundaries, in ms from the step's start. A GPU time well after the host's at the
    forward's start means the GPU waited for the host's work before it; a host time far ahead of the
    GPU's means the GPU is the bound there. On the CPU only the host's clock."""
    cuda = device.type == "cuda"
    marks = []

    def mark(name):
        event = None
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        marks.append((name, time.perf_counter(), event))

    forward, step = trainer._forward_logprobs, trainer.optimizer.step

    def marked_forward(*a, **kw):
        mark("forward start")
        out = forward(*a, **kw)
        mark("forward queued")
        return out

    def marked_step(*a, **kw):
        mark("optimizer start")
        out = step(*a, **kw)
        mark("optimizer queued")
        return out

    trainer._forward_logprobs, trainer.optimizer.step = marked_forward, marked_step
    lines = []
    try:
        for i, batch in enumerate(batches):
            sync(device)
            marks.clear()
            mark("step start")
            trainer.train_step(batch)
            mark("step returned")
            sync(device)
            _, h0, e0 = marks[0]
            lines.append(f"phases of step {i}: " + " | ".join(
                f"{name}: host {1e3 * (h - h0):.1f}" + (f" gpu {e0.elapsed_time(e):.1f}" if cuda else "")
                for name, h, e in marks))  # fmt: skip
    finally:
        del trainer._forward_logprobs  # the class's method again
        trainer.optimizer.step = step
    return lines


def profile_step(trainer, batch, device: torch.device, path: str) -> None:
    """One more train step under torch.profiler: where its time goes, by op and kernel (tables to `path`).
    GPU busy = the sum of kernel time; wall - GPU busy is the host's share (launches, syncs, Python)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        trainer.train_step(batch)
        sync(device)
    wall = time.perf_counter() - t
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3  # kernels
    launches = sum(
        e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    )
    copies = sum(e.count for e in events if e.key == "cudaMemcpyAsync")
    syncs = sum(e.count for e in events if "Synchronize" in e.key)
    head = (
        f"profiled step: wall {wall * 1e3:.0f} ms (under the profiler), GPU busy {busy:.0f} ms, "
        f"{launches} kernel launches, {copies} cudaMemcpyAsync, {syncs} synchronizations"
    )
    print("  " + head)
    with open(path, "w") as f:
        f.write(head + "\n\n")
        for key in ("self_device_time_total", "self_cpu_time_total"):
            f.write(events.table(sort_by=key, row_limit=40, max_name_column_width=70) + "\n")
        f.write(
            prof.key_averages(group_by_input_shape=False).table(
                sort_by="cpu_time_total", row_limit=60, max_name_column_width=70
            )
        )


def sync_trace(trainer, batch, path: str) -> None:
    """One more train step in CUDA's sync debug mode: its host waits by source line (table to `path`)."""
    from k3rl.learner.host_syncs import host_syncs

    sites = host_syncs(lambda: trainer.train_step(batch))
    head = f"host syncs in one train step: {sum(sites.values())} at {len(sites)} sites"
    print("  " + head)
    with open(path, "w") as f:
        f.write(head + "\n" + "\n".join(f"{n:5d}  {site}" for site, n in sites.most_common()) + "\n")


def muon_block_shapes(config: K3Config) -> Counter:
    """(rows, cols) -> number of blocks PerHeadMuon orthogonalises per step for this preset."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    groups, _ = param_groups(model)
    shapes: Counter = Counter()
    for g in groups:
        if g["kind"] != "muon":
            continue
        for p in g["params"]:
            rows = g["block_rows"] or p.shape[-2]
            shapes[(rows, p.shape[-1])] += p.numel() // (rows * p.shape[-1])
    return shapes


def bench_newton_schulz(args, device: torch.device) -> list[dict]:
    shapes = muon_block_shapes(K3Config.preset(args.preset))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    for (r, c), n in sorted(shapes.items(), key=lambda kv: -kv[1] * kv[0][0] * kv[0][1]):
        n = min(n, args.ns_max_blocks)
        G = torch.randn(n, r, c, device=device, dtype=dtype)
        timings = {}
        for name, fn in (("batched", ns_ops.newton_schulz), ("loop", ns_ops.newton_schulz_loop)):
            fn(G[: min(n, 2)])  # warm-up
            reps = []
            for _ in range(args.ns_reps):
                sync(device)
                t = time.perf_counter()
                fn(G)
                sync(device)
                reps.append(time.perf_counter() - t)
            timings[name] = statistics.median(reps)
        out.append(
            {
                "shape": [r, c],
                "blocks": n,
                "batched_ms": timings["batched"] * 1e3,
                "loop_ms": timings["loop"] * 1e3,
                "speedup": timings["loop"] / timings["batched"],
            }
        )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny", choices=["k3-tiny", "k3-small"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--seq-len", type=int, default=None, help="tokens per trajectory (default 512 cpu, 4096 cuda)"
    )
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--batch-tokens", type=int, default=None, help="tokens per step (default 2048 cpu, 65536 cuda)"
    )
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="default 1024 cpu; on cuda the whole step (65536: one micro-batch, 87 GiB for k3-small)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    ap.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on for cuda"
    )
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="regional torch.compile of every decoder layer")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument(
        "--ns-max-blocks", type=int, default=512, help="cap on blocks per shape in the NS benchmark"
    )
    ap.add_argument("--ns-reps", type=int, default=3)
    ap.add_argument("--skip-ns", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--profile", default=None, help="profile one more step; its op tables to this file")
    ap.add_argument("--phases", type=int, default=0, metavar="N", help="N more steps with the host's and the "
                    "GPU's clocks at each phase boundary (forward, optimizer): where the step waits")
    ap.add_argument("--sync-trace", default=None, help="one more step in CUDA's sync debug mode: its host syncs by "
                                                     "source line to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.seq_len = args.seq_len or (4096 if gpu else 512)
    args.batch_tokens = args.batch_tokens or (65536 if gpu else 2048)
    args.micro_batch_tokens = args.micro_batch_tokens or (args.batch_tokens if gpu else 1024)
    if args.seq_len <= args.prompt_len:
        ap.error("--seq-len must exceed --prompt-len")

    train = bench_training(args, device)
    print(
        f"\n== training step: {train['preset']} on {train['device_name']} "
        f"({train['params_total'] / 1e6:.1f}M params, {train['params_active_no_embed'] / 1e6:.1f}M active) =="
    )
    print(
        f"  bf16={train['bf16']} optimizer={train['optimizer']} seq_len={train['seq_len']} "
        f"tokens/step={train['tokens_per_step']} micro_batch_tokens={train['micro_batch_tokens']}"
    )
    print(
        f"  step {train['step_s_median'] * 1e3:.1f} ms (optimizer {train['optimizer_s_median'] * 1e3:.1f} ms on the device); "
        f"first step {train['first_step_s']:.1f} s, compile={train['compile']}"
    )
    print(
        f"  {train['tokens_per_s']:,.0f} tokens/s, {train['model_tflops_per_s']:.3f} model TFLOP/s, "
        + (
            f"MFU {100 * train['mfu']:.1f}% of {train['peak_tflops']} TFLOP/s"
            if train["mfu"] is not None
            else "MFU n/a (no peak for this device; pass --peak-tflops)"
        )
    )
    if train["peak_mem_gib"] is not None:
        print(f"  peak memory {train['peak_mem_gib']:.1f} GiB")
    results = {"training": train}
    if not args.skip_ns:
        ns = bench_newton_schulz(args, device)
        print(
            f"\n== Newton-Schulz (5 steps), Muon block shapes of {args.preset}: batched vs per-matrix loop =="
        )
        print(f"  {'block':>12} {'blocks':>7} {'batched ms':>11} {'loop ms':>9} {'speedup':>8}")
        for row in ns:
            print(
                f"  {str(tuple(row['shape'])):>12} {row['blocks']:>7} {row['batched_ms']:>11.2f} "
                f"{row['loop_ms']:>9.2f} {row['speedup']:>7.1f}x"
            )
        total_b = sum(r["batched_ms"] for r in ns)
        total_l = sum(r["loop_ms"] for r in ns)
        print(
            f"  {'all':>12} {sum(r['blocks'] for r in ns):>7} {total_b:>11.2f} {total_l:>9.2f} {total_l / total_b:>7.1f}x"
        )
        results["newton_schulz"] = ns
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
