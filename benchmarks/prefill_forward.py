"""What one engine prefill forward costs, by size, and where its time goes.

    python3 benchmarks/prefill_forward.py --preset k3-small --device cuda      # on the H200
    python3 benchmarks/prefill_forward.py                                      # k3-tiny on the CPU
    python3 benchmarks/prefill_forward.py --preset k3-small --device cuda --graphs --cached 200   # next turns

The embedded engine's prefill is the model's forward over a fresh cache (`rollout/engine/prefill.py`),
eager. For each (rows, tokens) the median of 8 timed forwards after 3 warm-ups, then a torch.profiler
table of one forward (host time by op, GPU time by kernel) and its host-device copies and syncs: when
the host time is many times the GPU's, the forward is launch-bound and its size barely moves its time.
`--graphs` times the engine's prefill graphs at the same shapes (a replay plus copying the rows' states out);
`--cached N` makes every chunk follow a cached prefix of N tokens, as a conversation's next turn does (the
eager forward then runs on the rows' stacked caches, the graphs copy them in).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import build, sync  # noqa: E402

SYNCS = ("Synchronize", "MemcpyAsync", "_local_scalar", "nonzero", "bincount")


def timed_row(label: str, fn, device: torch.device) -> None:
    """A table row: median and min ms of 8 calls of `fn` after 3 warm-ups, each to the device's sync."""
    for _ in range(3):
        fn()
    sync(device)
    times = []
    for _ in range(8):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t))
    print(f"| {label} | {statistics.median(times):.1f} | {min(times):.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", default="1x32,1x128,8x128,32x128,8x512", help="rows x tokens, comma separated")
    ap.add_argument("--profile", default="8x128", help="the shape profiled ('' for none)")
    ap.add_argument("--graphs", action="store_true",
                    help="also time the engine's prefill graphs (rollout/engine/prefill_graphs.py) at the shapes whose tokens "
                         "are a multiple of 16: a replay and the copy of its caches (the first call captures)")
    ap.add_argument("--cached", type=int, default=0, help="each chunk after a cached prefix of this many tokens")
    args = ap.parse_args()
    from k3rl.model import K3Cache
    from k3rl.rollout.engine import EmbeddedEngine

    device = torch.device(args.device)
    model = build(args.preset, args.device, "bfloat16" if device.type == "cuda" else "float32")
    eng = EmbeddedEngine(model, background=False)  # the engine's own preparation of the model (fp32 islands)
    autocast = (torch.autocast(device.type, dtype=eng.autocast_dtype, cache_enabled=False)
                if eng.autocast_dtype else contextlib.nullcontext())

    prefixes: dict[int, list[K3Cache]] = {}

    def prefix_caches(rows: int) -> list[K3Cache] | None:
        """`rows` batch-1 caches after --cached tokens (made once; a forward reads them, never writes)."""
        if not args.cached:
            return None
        if rows not in prefixes:
            ids = torch.randint(1, 200, (rows, args.cached), device=device)
            cache = model.new_cache(rows)
            model(ids, cache=cache)
            prefixes[rows] = cache.split()
        return prefixes[rows]

    def forward(rows: int, tokens: int) -> torch.Tensor:
        ids = torch.randint(1, 200, (rows, tokens), device=device)
        caches = prefix_caches(rows)
        cache = K3Cache.stack([c.clone() for c in caches]) if caches else model.new_cache(rows)
        return model(ids, cache=cache)[:, -1]

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    print(f"# prefill forward: {args.preset} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
          + (f", each chunk after a cached prefix of {args.cached} tokens" if args.cached else ""))
    print("| rows x tokens | median ms | min ms |\n|---|---|---|")
    with torch.no_grad(), autocast:
        for rows, tokens in shapes:
            timed_row(f"{rows} x {tokens}", lambda r=rows, t=tokens: forward(r, t), device)
        if args.graphs:
            from k3rl.rollout.engine.prefill_graphs import PrefillGraphs

            graphs = PrefillGraphs(model, eng.autocast_dtype, max_tokens=max(t for _, t in shapes), use_graphs=True)
            with torch.no_grad():
                for rows, _ in shapes:
                    prefix_caches(rows)
            print("\n| rows x tokens, prefill graphs | median ms | min ms |\n|---|---|---|")
            for rows, tokens in shapes:
                if not graphs.takes(tokens, args.cached) or rows > graphs.max_rows:
                    continue
                batch = [[(7 * i + r) % 200 + 1 for i in range(tokens)] for r in range(rows)]
                timed_row(f"{rows} x {tokens}", lambda b=batch, c=prefix_caches(rows): graphs.run(b, c), device)
            print(f"captures {graphs.captures}, failed {sorted(graphs.failed)}")
        if not args.profile:
            return
        from torch.profiler import ProfilerActivity, profile

        rows, tokens = (int(x) for x in args.profile.split("x"))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            forward(rows, tokens)
            sync(device)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=30))
    if device.type == "cuda":
        print(table.table(sort_by="cuda_time_total", row_limit=20))
    for e in table:
        if any(s in e.key for s in SYNCS):
            print(f"host-device: {e.key} x {e.count}, {e.self_cpu_time_total / 1e3:.2f} ms of host time")


if __name__ == "__main__":
    main()
