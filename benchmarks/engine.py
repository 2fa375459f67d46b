"""Embedded-engine throughput and weight-sync bandwidth.

    # CPU (k3-tiny, fp32): decode and prefill tokens/s, object-store and gloo weight sync
    python benchmarks/engine.py
    # one H200: k3-small bf16 decode ms/step and tokens/s at batch 1 / 64 / 256, CUDA graphs on and
    # off, against the memory-bandwidth limit; weight sync GB/s per transport (object store, CUDA IPC;
    # NCCL when >= 2 GPUs)
    python benchmarks/engine.py --preset k3-small --device cuda

On the GPU image (torch and triton, no install of k3rl, no Ray): carry pydantic's wheels in .whl/
(pydantic, pydantic_core, annotated_types, typing_inspection for CPython 3.12, as `pip download`
gets them) and skip the weight sync, which needs Ray; `--tests` first runs the engine's CUDA tests
(tests/rollout/test_engine_cuda.py):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 benchmarks/engine.py --tests --preset k3-small --device cuda --skip-sync

Decode tokens/s counts generated tokens over the time of pure decode steps (every sequence
already prefilled, one token per sequence per step, greedy). The bandwidth limit of a decode
step is

    tokens/s_max = B / (bytes read per step / copy bandwidth)
    bytes per step = non-expert weights + n_moe_layers * E[experts touched by B tokens] * expert bytes
                     + B * (KDA state read + written, conv windows, MLA latents of the context)
    E[touched] = E * (1 - (1 - k/E)^B)         (uniform routing)

and the copy bandwidth is measured with a large device-to-device copy (2 * bytes / time).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import statistics
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # after an installed k3rl: spawned children must not find the bare k3rl/ first


def import_engine_alone() -> None:
    """Make `k3rl.rollout.engine` importable without an install of k3rl and without
    `k3rl.rollout`'s __init__ (which imports the Ray pool): map the packages to their folders."""
    try:
        import k3rl.rollout.engine  # noqa: F401
        return
    except ImportError:
        pass
    for name, folder, run_init in (("k3rl", "k3rl", False), ("k3rl.kernels", "kernels", True),
                                   ("k3rl.learner", "learner", True), ("k3rl.rollout", "rollout", False)):
        path = os.path.join(ROOT, folder)
        if run_init:
            spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                          submodule_search_locations=[path])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        else:
            mod = types.ModuleType(name)
            mod.__path__ = [path]
            sys.modules[name] = mod


import_engine_alone()
from k3rl.cluster import free_port  # noqa: E402
from k3rl.model import K3Config, K3ForCausalLM  # noqa: E402
from k3rl.model.common import RMSNorm  # noqa: E402
from k3rl.model.state_dict_adapter import to_hf  # noqa: E402
from k3rl.rollout.engine import EmbeddedEngine  # noqa: E402
from k3rl.types import SamplingParams, WeightUpdate  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(preset: str, device: str, dtype: str) -> K3ForCausalLM:
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(preset)).eval()
    if dtype != "float32":
        model.to_param_dtype(getattr(torch, dtype))
    return model.to(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """GB/s of a large copy on `device`, counting the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times) / 1e9


def bytes_per_decode_step(model: K3ForCausalLM, batch: int, context: int) -> float:
    cfg = model.config
    expert_bytes = 0.0
    other = 0.0
    for name, p in model.named_parameters():
        if name.startswith(("vision_tower", "mm_projector")):
            continue  # not used while decoding text
        if ".mlp.experts." in name:
            expert_bytes += p.numel() * p.element_size()
        else:
            other += p.numel() * p.element_size()
    E, k = cfg.num_experts, cfg.num_experts_per_token
    touched_fraction = 1 - (1 - k / E) ** batch  # E[distinct experts] / E under uniform routing
    weights = other + expert_bytes * touched_fraction
    la = cfg.linear_attn_config
    n_mla = len(cfg.mla_layer_ids)
    n_kda = cfg.num_hidden_layers - n_mla
    act = model.activation_dtype.itemsize if hasattr(model.activation_dtype, "itemsize") else 4
    kda_state = la.num_heads * la.head_dim * la.head_dim * 4 * 2  # fp32, read + write
    kda_conv = (la.short_conv_kernel_size - 1) * 3 * la.num_heads * la.head_dim * act
    mla = context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act
    per_seq = n_kda * (kda_state + kda_conv) + n_mla * mla
    return weights + batch * per_seq


def decode_throughput(model, batch: int, prompt_len: int, new_tokens: int, graphs: bool, warmup: int = 3,
                      overlap: bool | None = None, compile_decode: bool = False) -> dict:
    """Greedy decode of `batch` sequences; the first warm-up step captures the CUDA graph."""
    device = model.lm_head.weight.device
    eng = EmbeddedEngine(model, background=False, max_num_seqs=batch, prefill_chunk=prompt_len,
                         max_prefill_tokens=prompt_len * batch, prefix_cache_size=0, enforce_eager=not graphs,
                         overlap=overlap, compile_decode=compile_decode)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens + warmup + 2)
    futures = [eng.submit([(i * 7 + j * 13) % 250 + 1 for j in range(prompt_len)], params) for i in range(batch)]
    sync(device)
    t = time.perf_counter()
    eng.step()  # admits and prefills everybody, samples the first tokens
    sync(device)
    prefill_s = time.perf_counter() - t
    for _ in range(warmup):
        eng.step()
    sync(device)
    t = time.perf_counter()
    for _ in range(new_tokens):
        eng.step()
    sync(device)
    decode_s = time.perf_counter() - t
    while not all(f.done() for f in futures):
        eng.step()
    replay_ms = None
    if eng.scheduler.decoder.graphs:  # the GPU's part of a step: the captured decode step replayed alone
        graph, _ = list(eng.scheduler.decoder.graphs.values())[-1]
        t = time.perf_counter()
        for _ in range(new_tokens):
            graph.replay()
        sync(device)
        replay_ms = 1e3 * (time.perf_counter() - t) / new_tokens
    return {"batch": batch, "decode_tok_s": batch * new_tokens / decode_s, "step_ms": 1e3 * decode_s / new_tokens,
            "prefill_tok_s": batch * prompt_len / prefill_s, "context": prompt_len + warmup + new_tokens // 2,
            "replay_ms": replay_ms}


def kernels_per_step(model, batch: int = 1) -> int:
    """GPU kernels launched by one eager decode step at `batch` (what a CUDA graph of it replays);
    prints the most frequent ones and, beside them, where the step's GPU time goes."""
    from torch.profiler import ProfilerActivity, profile

    eng = EmbeddedEngine(model, background=False, max_num_seqs=batch, prefill_chunk=16, max_prefill_tokens=16 * batch,
                         prefix_cache_size=0, enforce_eager=True)
    for i in range(batch):
        eng.submit(list(range(1 + i % 7, 17 + i % 7)), SamplingParams(temperature=0.0, max_tokens=8))
    eng.step(), eng.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name]
    names = collections.Counter(e.name for e in kernels)
    busy = collections.Counter()
    for e in kernels:
        busy[e.name] += e.device_time_total
    total_us = sum(busy.values())
    print(f"batch {batch}: the step's most frequent GPU kernels (count, name):")
    for name, n in names.most_common(25):
        print(f"  {n:5d}  {name[:110]}")
    print(f"batch {batch}: GPU busy time {total_us / 1e3:.3f} ms over {sum(names.values())} kernels; the largest shares "
          "(us, count, name):")
    for name, us in busy.most_common(15):
        print(f"  {us:8.1f}  {names[name]:5d}  {name[:100]}")
    return sum(names.values())


# ----- weight sync ---------------------------------------------------------------------------------


def _update_for(model) -> WeightUpdate:
    state = {k: v.detach() for k, v in to_hf(model.state_dict()).items()}
    return WeightUpdate.from_state_dict(1, state, bucket_bytes=256 << 20)


def object_store_gbps(update: WeightUpdate) -> float:
    import ray

    from k3rl.rollout.transport import ObjectStoreTransport, publish

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)

    @ray.remote(num_cpus=0)
    class Receiver:
        def take(self, packed) -> int:
            upd = ObjectStoreTransport().receive(packed, "receiver")
            copies = [t.clone() for t in upd.state_dict().values()]  # what loading into parameters costs
            return sum(c.numel() * c.element_size() for c in copies)

    r = Receiver.remote()
    ray.get(r.take.remote(publish(WeightUpdate.from_state_dict(0, {"x": torch.zeros(4)}))))  # warm
    times = []
    for _ in range(3):
        t = time.perf_counter()
        ref = publish(update)
        ray.get(r.take.remote(ref))
        times.append(time.perf_counter() - t)
    if started:
        ray.shutdown()
    return update.nbytes / min(times) / 1e9


def _collective_receiver(port: int, backend: str, device: str, rounds: int) -> None:
    from k3rl.rollout.transport import BroadcastGroup

    sync_ = BroadcastGroup(1, 2, port=port, backend=backend, device=device)
    for _ in range(rounds):
        sync_.recv()


def collective_gbps(update: WeightUpdate, backend: str, devices: tuple[str, str], rounds: int = 3) -> float:
    import torch.multiprocessing as mp

    from k3rl.rollout.transport import BroadcastGroup

    port = free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_collective_receiver, args=(port, backend, devices[1], rounds + 1))
    proc.start()
    sender = BroadcastGroup(0, 2, port=port, backend=backend, device=devices[0])
    buckets = [b.model_copy(update={"tensors": {k: v.to(devices[0]) for k, v in b.tensors.items()}})
               for b in update.buckets]
    upd = update.model_copy(update={"buckets": buckets})
    sender.send(upd)  # warm-up round
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sender.send(upd)
        times.append(time.perf_counter() - t)
    proc.join(timeout=120)
    return update.nbytes / statistics.median(times) / 1e9


def _ipc_receiver(share, queue) -> None:
    from k3rl.rollout.transport import open_cuda_ipc

    t = time.perf_counter()
    upd = open_cuda_ipc(share)
    queue.put((time.perf_counter() - t, upd.nbytes))


def cuda_ipc_gbps(update: WeightUpdate) -> float:
    import torch.multiprocessing as mp

    from k3rl.rollout.transport import share_cuda_ipc

    t = time.perf_counter()
    share = share_cuda_ipc(update)
    pack_s = time.perf_counter() - t
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(share, queue))
    proc.start()
    open_s, nbytes = queue.get(timeout=300)
    proc.join(timeout=60)
    share.release()
    return nbytes / (pack_s + open_s) / 1e9


# ----- main -----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batches", default=None, help="comma list; default 1,8,32 (CPU) or 1,64,256 (CUDA)")
    ap.add_argument("--graphs", default=None, help="comma list of on/off; default on,off (CUDA) or off (CPU)")
    ap.add_argument("--tests", action="store_true", help="first run tests/rollout/test_engine_cuda.py")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--skip-sync", action="store_true", help="skip the weight-sync measurements")
    ap.add_argument("--norms", default="auto", choices=["auto", "torch"],
                    help="the RMSNorms' kernel backend (torch: eager PyTorch, the before of kernels/rmsnorm)")
    ap.add_argument("--router", default="auto", choices=["auto", "torch"],
                    help="the decode step's router top-k (torch: eager PyTorch, the before of kernels/moe/router.py)")
    ap.add_argument("--overlap", default="auto", choices=["auto", "off"],
                    help="the engine's overlap of step t+1's launch with step t's read (off: one after another, the before)")
    ap.add_argument("--compile", action="store_true",
                    help="the engine's compile_decode: each decode step's layers through torch.compile")
    ap.add_argument("--count-kernels", action="store_true",
                    help="count the GPU kernels of one eager decode step at each batch, and their GPU time (torch.profiler)")
    args = ap.parse_args()
    if args.tests:
        import pytest

        code = pytest.main(["--noconftest", "-q", "-p", "no:cacheprovider",
                            os.path.join(ROOT, "tests", "rollout", "test_engine_cuda.py")])
        print(f"engine CUDA tests: exit code {int(code)}\n", flush=True)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    batches = [int(b) for b in (args.batches or ("1,64,256" if device.type == "cuda" else "1,8,32")).split(",")]
    graph_modes = [g == "on" for g in (args.graphs or ("on,off" if device.type == "cuda" else "off")).split(",")]
    model = build(args.preset, args.device, dtype)
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.backend = args.norms
    if args.router == "torch":
        import k3rl.rollout.engine.decode as engine_decode
        from k3rl.kernels.moe.router import route_topk_reference

        engine_decode.route_topk = lambda *a, backend=None: route_topk_reference(*a)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({args.threads} thread(s))"
    print(f"# engine benchmark: {args.preset} {dtype} on {name} (norms: {args.norms}, router: {args.router}, "
          f"overlap: {args.overlap}, compile: {args.compile})")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} timed decode steps after 3 warm-up steps, greedy")
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 28))
    print(f"measured copy bandwidth: {bw:.1f} GB/s\n")
    print("| CUDA graphs | batch | decode tok/s | step ms | graph replay ms | prefill tok/s | bytes/step (MB) "
          "| bandwidth limit tok/s | % of limit |")
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        decode_throughput(model, 1, args.prompt_len, 2, graphs=False)  # compile the kernels outside the timings
        if args.compile:  # and the compiled layers' first variants
            decode_throughput(model, batches[0], args.prompt_len, 2, graphs=False, compile_decode=True)
        if args.count_kernels and device.type == "cuda":
            for b in batches:
                print(f"GPU kernels per eager decode step at batch {b} (norms: {args.norms}): "
                      f"{kernels_per_step(model, b)}\n", flush=True)
        for graphs in graph_modes:
            for b in batches:
                r = decode_throughput(model, b, args.prompt_len, args.new_tokens, graphs,
                                      overlap=False if args.overlap == "off" else None, compile_decode=args.compile)
                nbytes = bytes_per_decode_step(model, b, r["context"])
                limit = b / (nbytes / (bw * 1e9))
                replay = f"{r['replay_ms']:.2f}" if r["replay_ms"] is not None else "-"
                print(f"| {'on' if graphs else 'off'} | {b} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} | {replay} | "
                      f"{r['prefill_tok_s']:.0f} | {nbytes / 1e6:.1f} | {limit:.0f} | "
                      f"{100 * r['decode_tok_s'] / limit:.2f} |", flush=True)
    if args.skip_sync:
        return
    update = _update_for(model.cpu() if device.type == "cpu" else model)
    cpu_update = update.model_copy(update={"buckets": [b.model_copy(update={"tensors": {k: v.cpu() for k, v in b.tensors.items()}})
                                                       for b in update.buckets]})
    print(f"\nweight update: {update.nbytes / 1e6:.1f} MB in {len(update.buckets)} bucket(s)")
    print("| transport | GB/s |\n|---|---|")
    print(f"| object store (pack + ray.put once + get + copy out in an actor) | {object_store_gbps(cpu_update):.2f} |", flush=True)
    if device.type == "cuda":
        print(f"| CUDA IPC (pack on GPU, open + copy in another process) | {cuda_ipc_gbps(update):.2f} |", flush=True)
        if torch.cuda.device_count() >= 2:
            print(f"| NCCL broadcast (cuda:0 -> cuda:1) | {collective_gbps(update, 'nccl', ('cuda:0', 'cuda:1')):.2f} |")
        else:
            print("| NCCL broadcast | skipped: needs 2 GPUs (one per rank) |")
    else:
        print(f"| gloo broadcast (CPU, 2 processes; the NCCL code path) | {collective_gbps(cpu_update, 'gloo', ('cpu', 'cpu')):.2f} |")


if __name__ == "__main__":
    main()
