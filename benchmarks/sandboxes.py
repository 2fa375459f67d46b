"""Sandbox benchmarks: open latency, warm-pool acquire latency, exec round trip, throughput.

    .venv/bin/python benchmarks/sandboxes.py [--backends docker,bwrap] [--out benchmarks/results/sandboxes.md]

For each backend: cold open+close, acquire from a warm `SandboxPool` (p50/p99), one `exec`
round trip of `true` (p50/p99), and exec throughput at concurrency 1 / 8 / 32 (one sandbox
per worker, `echo hi` each). For comparison, a plain `docker run --rm --network none IMAGE
true` (the CLI, one container per command) at the same concurrencies.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3rl.sandboxes import SandboxPool, image_tag, open_sandbox
from k3rl.sandboxes.types import SandboxLimits

LIMITS = SandboxLimits(memory_mb=256, pids=128)
JOB = f"bench-{os.getpid()}"


def pct(values: list[float], q: float) -> float:
    """q-th percentile (nearest rank) in milliseconds."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k] * 1000


def bench_open(backend: str, n: int) -> dict:
    opens, closes = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = open_sandbox(backend, job=JOB, limits=LIMITS)
        t1 = time.perf_counter()
        sb.close()
        opens.append(t1 - t0)
        closes.append(time.perf_counter() - t1)
    return {"open_p50": pct(opens, 50), "open_p99": pct(opens, 99), "close_p50": pct(closes, 50)}


def bench_exec(backend: str, n: int) -> dict:
    with open_sandbox(backend, job=JOB, limits=LIMITS) as sb:
        sb.exec("true")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = sb.exec("true")
            times.append(time.perf_counter() - t0)
            assert r.exit_code == 0
    return {"exec_p50": pct(times, 50), "exec_p99": pct(times, 99)}


async def bench_acquire(backend: str, n: int) -> dict:
    async with SandboxPool(backend, max_size=8, min_idle=8, job=JOB, limits=LIMITS, starts_per_s=50) as pool:
        waits = []
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await pool.acquire()
            waits.append(time.perf_counter() - t0)
            await pool.release(sb)
            for _ in range(500):  # measure a *warm* acquire: wait until the reset sandbox is idle again
                if pool.idle == pool.min_idle:
                    break
                await asyncio.sleep(0.01)
    return {"acquire_p50": pct(waits, 50), "acquire_p99": pct(waits, 99)}


async def bench_throughput(backend: str, concurrency: int, per_worker: int) -> float:
    async with SandboxPool(
        backend, max_size=concurrency, min_idle=concurrency, job=JOB, limits=LIMITS, starts_per_s=50
    ) as pool:

        async def worker():
            async with pool.sandbox(timeout=600) as sb:
                for _ in range(per_worker):
                    r = await sb.aexec("echo hi")
                    assert r.stdout == "hi\n"

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return concurrency * per_worker / (time.perf_counter() - t0)


def docker_run_once(image: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        ["docker", "run", "--rm", "--network", "none", image, "true"], check=True, capture_output=True
    )
    return time.perf_counter() - t0


def bench_docker_run(image: str, concurrencies: list[int], n_latency: int) -> dict:
    lat = [docker_run_once(image) for _ in range(n_latency)]
    out = {"run_p50": pct(lat, 50), "run_p99": pct(lat, 99)}
    for c in concurrencies:
        total = max(c, 8) if c < 32 else 32
        with ThreadPoolExecutor(c) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda _: docker_run_once(image), range(total)))
            out[f"tput_{c}"] = total / (time.perf_counter() - t0)
    return out


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    docker_v = subprocess.run(
        ["docker", "version", "-f", "{{.Server.Version}}"], capture_output=True, text=True
    )
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} CPU ({cpu}), kernel {platform.release()}, Docker {docker_v.stdout.strip() or '?'}, "
        f"load average at start {load[0]:.1f} (shared machine: other jobs were running)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="docker,bwrap")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--per-worker", type=int, default=8, help="execs per worker in the throughput runs")
    parser.add_argument("--out", default="benchmarks/results/sandboxes.md")
    args = parser.parse_args()
    backends = args.backends.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    host = machine()
    rows = []
    for backend in backends:
        print(f"[{backend}] open / exec / acquire ...", flush=True)
        r = {"backend": backend, **bench_open(backend, 10), **bench_exec(backend, 50)}
        r.update(asyncio.run(bench_acquire(backend, 100)))
        for c in levels:
            print(f"[{backend}] throughput at concurrency {c} ...", flush=True)
            r[f"tput_{c}"] = asyncio.run(bench_throughput(backend, c, args.per_worker))
        rows.append(r)
        print(r, flush=True)
    print("[docker run] ...", flush=True)
    plain = bench_docker_run(image_tag(), levels, 10) if "docker" in backends else None

    lines = [
        "# Sandbox benchmarks",
        "",
        f"Measured {started} on {host}.",
        "",
        f"Command: `.venv/bin/python benchmarks/sandboxes.py --backends {args.backends} "
        f"--concurrency {args.concurrency} --per-worker {args.per_worker}`",
        "",
        f"Image `{image_tag()}`; limits memory 256 MB, pids 128, 1 CPU per sandbox. Latencies in ms "
        "(p50 / p99); throughput in commands per second with one sandbox per concurrent worker "
        f"({args.per_worker} `echo hi` execs each). `acquire` is taken from a warm pool of 8.",
        "",
        "| backend | open (p50/p99) | close p50 | acquire warm (p50/p99) | exec `true` (p50/p99) | "
        + " | ".join(f"exec/s @{c}" for c in levels)
        + " |",
        "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in levels) + " |",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['open_p50']:.0f} / {r['open_p99']:.0f} | {r['close_p50']:.0f} | "
            f"{r['acquire_p50']:.2f} / {r['acquire_p99']:.2f} | {r['exec_p50']:.0f} / {r['exec_p99']:.0f} | "
            + " | ".join(f"{r[f'tput_{c}']:.1f}" for c in levels)
            + " |"
        )
    if plain:
        lines.append(
            f"| plain `docker run --rm` (CLI, new container per command) | run {plain['run_p50']:.0f} / "
            f"{plain['run_p99']:.0f} | - | - | - | "
            + " | ".join(f"{plain[f'tput_{c}']:.1f}" for c in levels)
            + " |"
        )
    lines += [
        "",
        "Reading: a warm-pool acquire is a queue pop plus a liveness check; a tool call is one request "
        "to the sandbox's long-lived agent (no `docker exec`, no process start on the host), so its "
        "round trip is the command's own fork/exec inside the sandbox. `open` is paid once per sandbox "
        "and hidden by the warm pool. `docker run` pays a full container start per command.",
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
