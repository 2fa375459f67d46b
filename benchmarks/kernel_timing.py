"""What the kernel benchmarks share: k3rl.kernels imported on the bare GPU image, fla-core (the anchor)
when present, CUDA-event timing, CUDA-graph timing, progress stamps, markdown rows and the measured
ceilings (bf16 matmul, device copy)."""

from __future__ import annotations

import torch


def _load_kernels_alone():
    """Import k3rl.kernels without k3rl/__init__ (the GPU image lacks k3rl's other dependencies)."""
    import importlib.util
    import pathlib
    import sys
    import types

    try:
        import k3rl.kernels  # noqa: F401
    except ImportError:
        root = pathlib.Path(__file__).resolve().parents[1]
        pkg = types.ModuleType("k3rl")
        pkg.__path__ = []
        sys.modules["k3rl"] = pkg
        spec = importlib.util.spec_from_file_location(
            "k3rl.kernels",
            root / "kernels" / "__init__.py",
            submodule_search_locations=[str(root / "kernels")],
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["k3rl.kernels"] = mod
        spec.loader.exec_module(mod)


_load_kernels_alone()
from triton.testing import do_bench  # noqa: E402

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
except ImportError:  # pragma: no cover - the anchor is optional
    fla_chunk_kda = fla_fused_recurrent_kda = None

DEV = "cuda"
BF16 = torch.bfloat16


def bench(fn, grad_to_none=None, rep=200):
    return do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


_T0 = None


def stamp(what):
    """Progress line with the seconds since the start (a stalled phase shows as the last stamp)."""
    import time

    global _T0
    _T0 = _T0 or time.time()
    print(f"[{time.time() - _T0:7.1f} s] {what}", flush=True)


def row(*cells):
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def peak():
    print("\n## Ceilings (measured)\n")
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    ms = bench(lambda: a @ b, rep=100)
    copy, copy_bytes = big_copy()
    ms_copy = bench(copy, rep=100)
    tflops = 2 * 8192**3 / ms / 1e9
    bw = copy_bytes / ms_copy / 1e6  # GB/s
    row("bf16 matmul 8192^3 (random)", f"{tflops:.0f} TFLOP/s")
    row("device copy 2 GiB (read + write)", f"{bw / 1000:.2f} TB/s")
    return tflops, bw


def big_copy():
    """A 2 GiB device-to-device copy (the bandwidth ceiling) and the bytes it moves (read + write)."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return (lambda: y.copy_(x)), 2 * x.numel()



def bench_graph(fn, calls=20, replays=10):
    """ms per call of `calls` back-to-back calls captured in one CUDA graph: no launch gaps and no cache
    flush between calls (do_bench flushes L2 before each call and times each launch on its own)."""
    try:
        return _bench_graph(fn, calls, replays)
    except RuntimeError as e:  # a call that syncs with the host cannot be captured: report, go on
        print(f"(CUDA graph capture failed: {str(e).splitlines()[0][:100]})")
        return float("nan")


def _bench_graph(fn, calls, replays):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (calls * replays))
    return sorted(times)[len(times) // 2]

