"""TrajectoryStore appends against a store that already holds many parts (a long job's).

Usage:  python benchmarks/store_appends.py [--parts 100 1000 3000] [--appends 256] [--flush-every 64]

For each count of existing parts (each a small part of 4 episodes, written straight with pyarrow so the
set-up is cheap): the time to open the store (it reads every part's ids once) and the time of `--appends`
small appends (flushed every `--flush-every`, as the buffer's steps do). Appends must not slow down as
the parts pile up: a week-long job writes thousands.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from k3rl.store import PART_SCHEMA, TrajectoryStore
from k3rl.types import Trajectory


def episode(i: int, step: int) -> Trajectory:
    return Trajectory(id=f"bench-g{i // 4:07d}-s{i % 4}", env_id="k3rl/Bench-v0", seed=i, prompt_ids=list(range(32)),
                      metadata={"step": step, "policy_version": step, "status": "trained"})


def fill(root: Path, parts: int, per_part: int = 4) -> None:
    """`parts` published parts of `per_part` episodes each, as a job's store holds them."""
    directory = root / "trajectories"
    directory.mkdir(parents=True)
    for p in range(parts):
        rows = []
        for i in range(p * per_part, (p + 1) * per_part):
            row = episode(i, p).to_arrow_row()
            row.update(step=p, policy_version=p, status="trained")
            rows.append(row)
        pq.write_table(pa.Table.from_pylist(rows, schema=PART_SCHEMA), directory / f"part-{p:06d}.parquet",
                       compression="zstd")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=int, nargs="+", default=[100, 1000, 3000])
    ap.add_argument("--appends", type=int, default=256)
    ap.add_argument("--flush-every", type=int, default=64)
    args = ap.parse_args()
    print(f"{'parts':>6} {'open_s':>8} {f'{args.appends} appends_s':>16} {'ms/append':>10}")
    for n in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            fill(root, n)
            t0 = time.perf_counter()
            store = TrajectoryStore(root, flush_every=args.flush_every, write_images=False)
            t1 = time.perf_counter()
            base = n * 4
            for i in range(base, base + args.appends):
                store.append(episode(i, n))
            store.flush()
            t2 = time.perf_counter()
            assert store.count() == base + args.appends
            print(f"{n:>6} {t1 - t0:>8.3f} {t2 - t1:>16.3f} {1000 * (t2 - t1) / args.appends:>10.2f}")


if __name__ == "__main__":
    main()
