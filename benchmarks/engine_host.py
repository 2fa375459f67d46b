"""The embedded engine's host time per step, split: the model's forward, the sampling arithmetic, and the rest
(scheduler, state pool, prefix cache, feeding, input buffers, bookkeeping), on a tiny model so that the forward is cheap.

    python3 benchmarks/engine_host.py --device cpu --repeats 5
    python3 benchmarks/engine_host.py --device cpu --ab HEAD~1 --repeats 5      # before/after, alternated
    python3 benchmarks/engine_host.py --device cpu --profile out/engine_host    # cProfile of one run

The workload is KeyLookup's shape (issue [19] item 4): `--groups` groups of `--group` sequences (GRPO: one
prompt per group, a seed per sequence), a ~91-token first prompt that starts with a 60-token system
prompt shared by all, `--turns` turns, each completion 16-48 tokens (a fixed draw per request; no stop
tokens, so an untrained model's turns end where a trained one's would), then a 20-token tool result and
header appended to the conversation for the next turn, submitted as soon as the turn ends. The engine
runs with the CUDA defaults (decode_append 64, share_prefix 64, prefill_wait_steps 8, a prefix cache of
2 x max_num_seqs, overlap on) on any device, driven by `step()` in this thread (no background thread), so
a CPU run goes through every host path a GPU run does except the CUDA graphs.

Reported per run: engine steps, decode tokens, ms per step of the whole step, of the decode forward, of
the prefill forwards, of the sampling arithmetic (`sample_tokens`, `policy_logprobs`) and of the rest, of
which the state pool's copies (load, move, extract, write_back) and the prefix cache (lookup, remember,
split_point); `outside_graph_ms`, the step's time outside `DecodeRunner._run` (what a CUDA graph replays:
forward, write-back, sampling) and the prefill forwards, i.e. the host work around a CUDA decode step; and
a checksum of every sampled token and log-prob (equal checksums: the same outputs bit for bit).
On CUDA the forward's time is its launches plus what the host waits for (no device sync is added).
`--count-ops` counts instead the aten ops run outside `_run` and the forwards (`kernel_ops_per_step`: those
that are kernels on CUDA, views left out): a device-independent measure of the host's launches.

`--ab REF` runs the engine package of git REF (`rollout/engine` extracted to a temporary directory) and the
working tree's, alternated, `--repeats` times each, in fresh processes, and prints the medians.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import hashlib
import importlib.util
import io
import json
import pstats
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("k3rl") is None:  # a checkout without an install
    sys.path.append(str(ROOT))


def use_engine_dir(path: str) -> None:
    """Import `k3rl.rollout.engine` from `path` (another version of rollout/engine) instead of the install."""
    # imported here: only the A/B child needs it
    import k3rl.rollout

    spec = importlib.util.spec_from_file_location("k3rl.rollout.engine", Path(path) / "__init__.py",
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules["k3rl.rollout.engine"] = module
    spec.loader.exec_module(module)
    k3rl.rollout.engine = module


# ops that make a view or wrap a host value: host work, no kernel
VIEW_OPS = {"select", "slice", "view", "alias", "unbind", "lift_fresh", "as_strided", "detach", "t", "expand",
            "transpose", "unsqueeze", "squeeze", "permute", "split", "narrow", "_unsafe_view", "_reshape_alias"}


class count_ops(TorchDispatchMode):
    """Counts the aten ops the engine runs outside the decode step's `DecodeRunner._run` (what a CUDA graph
    replays) and outside the model's forward (a prefill): on CUDA each is about a kernel launch, or a copy,
    issued from Python every step. A device-independent count of the host's device work."""

    def __init__(self, engine):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.inside = 0
        decoder = engine.scheduler.decoder
        run = decoder._run

        def wrapped(*a, **k):
            self.inside += 1
            try:
                return run(*a, **k)
            finally:
                self.inside -= 1
        decoder._run = wrapped
        engine.model.register_forward_pre_hook(lambda m, a: setattr(self, "inside", self.inside + 1))
        engine.model.register_forward_hook(lambda m, a, o: setattr(self, "inside", self.inside - 1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def workload(args, seed: int):
    """The first prompts, and [(group, member, turns)] with each turn's (tail tokens, max_tokens)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 256) for _ in range(60)]
    prompts = [system + [rng.randrange(1, 256) for _ in range(31)] for _ in range(args.groups)]
    convs = []
    for g in range(args.groups):
        for m in range(args.group):
            turns = [([rng.randrange(1, 256) for _ in range(20)], rng.randrange(16, 49)) for _ in range(args.turns)]
            convs.append((g, m, turns))
    return prompts, convs


def run(args) -> dict:
    # imported here: after use_engine_dir
    import torch

    # imported here: after use_engine_dir (the engine of --engine-dir)
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.engine import decode as decode_mod
    from k3rl.rollout.engine import sampler as sampler_mod
    from k3rl.types import SamplingParams

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    engine = EmbeddedEngine.from_preset(args.preset, device=args.device, dtype=dtype, background=False,
                                        max_num_seqs=args.max_num_seqs, decode_append=64, share_prefix=64,
                                        prefill_wait_steps=8, prefix_cache_size=args.prefix_cache,
                                        overlap=True, enforce_eager=args.eager)
    times = {"decode_forward": 0.0, "prefill_forward": 0.0, "sampling": 0.0}
    parts = {"state_pool": 0.0, "prefix_cache": 0.0, "decode_run": 0.0}  # parts of the above or of the rest

    def timed(fn, key):
        into = times if key in times else parts

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                into[key] += time.perf_counter() - t0
        return wrapper

    decode_mod.decode_forward = timed(decode_mod.decode_forward, "decode_forward")
    for mod in (decode_mod, sampler_mod):
        mod.sample_tokens = timed(mod.sample_tokens, "sampling")
        mod.policy_logprobs = timed(mod.policy_logprobs, "sampling")
    decoder = engine.scheduler.decoder
    decoder._run = timed(decoder._run, "decode_run")  # what a CUDA graph replays: forward, write-back, sampling
    profiler = cProfile.Profile() if args.profile else None
    profiling = [False]  # the timed round is being profiled
    if profiler:  # the profile covers the host's work outside the graph and the prefill forwards
        run = decoder._run

        def pause(on: bool) -> None:
            if profiling[0]:
                (profiler.enable if on else profiler.disable)()

        def paused(*a, **k):
            pause(False)
            try:
                return run(*a, **k)
            finally:
                pause(True)
        decoder._run = paused
        engine.model.register_forward_pre_hook(lambda m, a: pause(False))
        engine.model.register_forward_hook(lambda m, a, o: pause(True))
    pool, prefix = engine.scheduler.pool, engine.scheduler.prefix
    for name in ("load", "move", "extract", "write_back"):
        setattr(pool, name, timed(getattr(pool, name), "state_pool"))
    for name in ("lookup", "remember", "split_point"):
        setattr(prefix, name, timed(getattr(prefix, name), "prefix_cache"))
    t_fwd = []
    engine.model.register_forward_pre_hook(lambda m, a: t_fwd.append(time.perf_counter()))
    engine.model.register_forward_hook(
        lambda m, a, o: times.__setitem__("prefill_forward", times["prefill_forward"] + time.perf_counter() - t_fwd.pop()))

    def play(prompts, convs, digest, profiler=None):
        """Every conversation to its end, each next turn submitted when the last ends: engine steps, their
        seconds."""
        def submit(c: int, turn: int, context: list[int]):
            tail, max_tokens = convs[c][2][turn]
            ids = context + tail if turn else context
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1000 * c + turn)
            return engine.submit(ids, params), ids

        live = {c: (0, *submit(c, 0, prompts[convs[c][0]])) for c in range(len(convs))}
        step_times = []
        if profiler:
            profiling[0] = True
            profiler.enable()
        while live:
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
            for c in [c for c, (_, fut, _) in live.items() if fut.done()]:
                turn, fut, ids = live.pop(c)
                r = fut.result()
                digest.update(struct.pack(f"<{len(r.token_ids)}q", *r.token_ids))
                digest.update(struct.pack(f"<{len(r.logprobs)}d", *r.logprobs))
                if turn + 1 < args.turns:
                    live[c] = (turn + 1, *submit(c, turn + 1, ids + r.token_ids))
        if profiler:
            profiler.disable()
            profiling[0] = False
        return step_times

    # warm-up: one short request (first-use costs of the forward's ops), and --warmup-rounds of the workload
    # on other prompts (on CUDA: the decode graphs of every batch and context rung)
    engine.generate([5] * 40, SamplingParams(max_tokens=4, seed=1))
    for r in range(args.warmup_rounds):
        play(*workload(args, args.seed + 1 + r), hashlib.sha256())
    engine.scheduler.prefix.clear()
    base = dict(engine.stats)
    for d in (times, parts):
        for k in d:
            d[k] = 0.0
    digest = hashlib.sha256()
    counter = count_ops(engine) if args.count_ops else contextlib.nullcontext()
    with counter:
        step_times = play(*workload(args, args.seed), digest, profiler)
    steps, wall = len(step_times), sum(step_times)
    d = {k: engine.stats[k] - base.get(k, 0) for k in engine.stats}
    rest = wall - sum(times.values())
    row = {
        "steps": steps, "decode_tokens": d["decode_tokens"], "prefill_forwards": d["prefill_forwards"],
        "fed_prompt_tokens": d["fed_prompt_tokens"], "prefix_hit_tokens": d["prefix_hit_tokens"],
        "mean_decode_batch": round(d["decode_tokens"] / max(1, steps), 1),
        "wall_s": round(wall, 3),
        "step_ms": round(wall / steps * 1e3, 3),
        "median_step_ms": round(statistics.median(step_times) * 1e3, 3),
        "decode_forward_ms": round(times["decode_forward"] / steps * 1e3, 3),
        "prefill_forward_ms": round(times["prefill_forward"] / steps * 1e3, 3),
        "sampling_ms": round(times["sampling"] / steps * 1e3, 3),
        "rest_ms": round(rest / steps * 1e3, 3),
        # the host's time outside what a CUDA graph replays and outside the prefill forwards: on CUDA, the
        # host work of a step around its graph
        "outside_graph_ms": round((wall - parts["decode_run"] - times["prefill_forward"]) / steps * 1e3, 3),
        "state_pool_ms": round(parts["state_pool"] / steps * 1e3, 3),
        "prefix_cache_ms": round(parts["prefix_cache"] / steps * 1e3, 3),
        "admit_ms": round(d["admit_s"] / steps * 1e3, 3),
        "checksum": digest.hexdigest()[:16],
    }
    if args.count_ops:
        ops = counter.ops
        kernels = {k: v for k, v in ops.items() if k not in VIEW_OPS}
        row["eager_ops_per_step"] = round(sum(ops.values()) / steps, 2)
        row["kernel_ops_per_step"] = round(sum(kernels.values()) / steps, 2)  # views and wrappers left out
        row["kernel_ops"] = dict(collections.Counter(kernels).most_common())
        row["view_ops"] = {k: v for k, v in ops.most_common() if k in VIEW_OPS}
    if profiler:
        out = Path(args.profile)
        out.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(out / "engine_host.prof"))
        for sort in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(profiler, stream=buf).sort_stats(sort).print_stats(60)
            (out / f"engine_host_{sort}.txt").write_text(buf.getvalue())
    return row


def ab(args) -> None:
    """Alternate the engine of git `args.ab` and the working tree's, in fresh processes."""
    tmp = Path(tempfile.mkdtemp(prefix="engine_ab_"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.ab, "rollout/engine"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    builds = {"before": str(tmp / "rollout/engine"), "after": None}
    argv = sys.argv[1:]
    for flag in ("--ab", "--repeats"):
        argv = [a for a in argv if not a.startswith(flag + "=")]
        while flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
    rows = {name: [] for name in builds}
    for rep in range(args.repeats):
        for name, path in builds.items():
            cmd = [sys.executable, __file__, *argv, "--repeats", "1", "--json-line"]
            if path:
                cmd += ["--engine-dir", path]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            out = done.stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows[name].append(row)
            print(json.dumps({"build": name, "repeat": rep, **row}), flush=True)
    summary = {}
    for name, rs in rows.items():
        summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
        summary[name]["checksums"] = sorted({r["checksum"] for r in rs})
    print(json.dumps({"medians": summary}, indent=1), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prefix-cache", type=int, default=512, help="prefix_cache_size (the GPU job's: 2 x 256 slots)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="untimed rounds of the workload (other prompts) first: on CUDA 1, to capture the graphs")
    ap.add_argument("--count-ops", action="store_true",
                    help="count the aten ops run outside the decode graph and the forwards (times then meaningless)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--profile", default=None, help="directory for cProfile tables of one run, outside the decode "
                    "graph's work and the prefill forwards")
    ap.add_argument("--ab", default=None, help="git ref of the 'before' engine: alternate it with the working tree's")
    ap.add_argument("--engine-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-line", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ab:
        ab(args)
        return
    if args.engine_dir:
        use_engine_dir(args.engine_dir)
    rows = [run(args) for _ in range(args.repeats)]
    for row in rows:
        print(json.dumps(row), flush=True)
    if len(rows) > 1:
        print(json.dumps({"median": {k: statistics.median(r[k] for r in rows) for k in rows[0]
                                     if isinstance(rows[0][k], (int, float))}}), flush=True)


if __name__ == "__main__":
    main()
