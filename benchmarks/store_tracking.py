"""Trajectory store and MLflow tracking costs on this machine (CPU only).

Usage:  python benchmarks/store_tracking.py [--episodes 512] [--tokens 2048] [--images 2]

Store: append + flush (Parquet part per flush, fsync, atomic publish, PNG files), full read,
step-filtered read, count. Tracking: log_metrics of a step's ~40 metrics, one episode page
(HTML with inline images), the reward-curve PNG — all against a fresh SQLite store.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from PIL import Image

from k3rl.images import to_png
from k3rl.store import TrajectoryStore
from k3rl.tracking import Tracker
from k3rl.types import ToolCall, Trajectory, Turn


def episode(i: int, tokens: int, images: int, step: int) -> Trajectory:
    rng = random.Random(i)
    pngs = [to_png(Image.frombytes("RGB", (64, 64), rng.randbytes(64 * 64 * 3))) for _ in range(images)]
    t = Trajectory(id=f"bench{i:06d}", env_id="k3rl/Bench-v0", seed=i, prompt_ids=list(range(64)),
                   metadata={"step": step, "policy_version": step})
    turns = [Turn(role="user", text="task", images=pngs[:1], start=0, end=64)]
    per_turn = tokens // 4
    for k in range(2):
        s, e = t.append([rng.randrange(50_000) for _ in range(per_turn)], generated=True,
                        logprobs=[-rng.random() for _ in range(per_turn)], version=step)
        turns.append(Turn(role="assistant", text="x" * 40, tool_calls=[ToolCall(name="run", arguments={"k": k})],
                          start=s, end=e))
        s, e = t.append([rng.randrange(50_000) for _ in range(per_turn)], generated=False)
        turns.append(Turn(role="tool", text="y" * 200, images=pngs[1:], tool_name="run", tool_index=1, start=s, end=e))
    t.turns = turns
    t.reward = rng.random()
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--flush-every", type=int, default=64)
    args = ap.parse_args()
    eps = [episode(i, args.tokens, args.images, step=i // 64) for i in range(args.episodes)]

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        store = TrajectoryStore(root, flush_every=args.flush_every)
        t0 = time.perf_counter()
        for t in eps:
            store.append(t)
        store.flush()
        write_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in store.parts())
        img_size = sum(p.stat().st_size for p in (root / "images").rglob("*.png"))
        t0 = time.perf_counter()
        got = store.read()
        read_s = time.perf_counter() - t0
        assert len(got) == len(eps)
        t0 = time.perf_counter()
        one_step = store.read(step=3)
        step_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = store.count()
        count_s = time.perf_counter() - t0
        print(f"store: {len(eps)} episodes x {args.tokens} tokens, {args.images} images of 64x64, "
              f"flush every {args.flush_every}")
        print(f"  append+flush {len(eps) / write_s:8.0f} episodes/s  ({(size + img_size) / write_s / 1e6:.1f} MB/s; "
              f"parquet {size / 1e6:.1f} MB in {len(store.parts())} parts, PNG {img_size / 1e6:.1f} MB)")
        print(f"  read all     {len(got) / read_s:8.0f} episodes/s")
        print(f"  read step=3  {step_s * 1e3:8.1f} ms for {len(one_step)} episodes")
        print(f"  count        {count_s * 1e3:8.1f} ms for {n} episodes")

        t0 = time.perf_counter()
        tracker = Tracker(uri=f"sqlite:///{tmp}/mlflow.db", experiment="bench", run_name="bench")
        open_s = time.perf_counter() - t0
        metrics = {f"group{g}/metric{k}": 0.5 for g in range(4) for k in range(10)}
        times = []
        for step in range(50):
            t0 = time.perf_counter()
            tracker.log_metrics(metrics, step=step)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tracker.log_episode_html(eps[0], step=1)
        html_s = time.perf_counter() - t0
        tracker.log_metrics({"reward/mean": 0.5}, step=1)
        t0 = time.perf_counter()
        tracker.log_reward_curve_png()
        png_s = time.perf_counter() - t0
        tracker.finish()
        print("tracking (fresh SQLite store):")
        print(f"  open store + create run  {open_s * 1e3:8.1f} ms (includes MLflow's first migrations)")
        print(f"  log_metrics, 40 metrics  {statistics.median(times) * 1e3:8.1f} ms median per step")
        print(f"  log_episode_html         {html_s * 1e3:8.1f} ms")
        print(f"  log_reward_curve_png     {png_s * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
