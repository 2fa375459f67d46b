"""Where the rollout's time goes: the RL job's episodes against one embedded engine, in one process.

    python3 benchmarks/rollout_profile.py --device cuda --episodes 128 --rounds 3 --profile out/prof

The episodes of `benchmarks/rl_gpus.py` (KeyLookup, 3 turns, 48 tokens a turn, groups of 8), run
by `rollout/episode.py`'s `run_episode` against `EmbeddedEngine.agenerate` with no Ray in between:
the engine alone, so the gap to the job's episodes/s is Ray's and the learner's share of the GPU.
Reported per round (the first captures the CUDA graphs): episodes/s, generated tokens/s, the
engine's steps, prefill forwards and the host seconds of its phases (admit, prefill, decode and
sampling), the mean decode batch, and the episodes' own time in `generate` and in the env.
`--profile DIR` writes cProfile tables of the scheduler thread for the last round (sorted by
cumulative and by own time; Python 3.12 allows one cProfile at a time), `--torch-profile DIR`
torch.profiler's tables of it (host and device time per op).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib.util
import io
import json
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

if importlib.util.find_spec("k3rl") is None:  # a checkout without an install
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch


def job_config(args):
    from k3rl.config import JobConfig

    return JobConfig.load(None, [
        "name=rollout-profile", f"model.preset={args.preset}", f"rollout.group_size={args.group}",
        f"rollout.sampling.max_tokens_per_turn={args.max_tokens}", "rollout.max_context_tokens=2048",
        "envs.max_turns=3", "envs.train.0.id=k3rl/KeyLookup-v0",
    ])


def drive(engine, stop: threading.Event, profiler: cProfile.Profile | None) -> None:
    """The scheduler loop (the engine's own `_loop`, under a profiler when asked)."""
    if profiler:
        profiler.enable()
    torch.set_grad_enabled(False)
    try:
        while not stop.is_set():
            if engine._has_work():
                engine.step()
            else:
                time.sleep(0.0002)
    finally:
        if profiler:
            profiler.disable()


def table(profiler: cProfile.Profile, sort: str, n: int = 45) -> str:
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats(sort).print_stats(n)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--prefix-cache", type=int, default=None, help="the engine's prefix_cache_size (default: its own)")
    ap.add_argument("--decode-append", type=int, default=None, help="the engine's decode_append (default: its own)")
    ap.add_argument("--share-prefix", type=int, default=None, help="the engine's share_prefix (default: its own)")
    ap.add_argument("--prefill-wait", type=int, default=None, help="the engine's prefill_wait_steps (default: its own)")
    ap.add_argument("--profile", default=None, help="directory for cProfile tables of the last round's scheduler")
    ap.add_argument("--torch-profile", default=None, help="directory for torch.profiler tables of the last round")
    ap.add_argument("--prefill-trace", action="store_true",
                    help="after the rounds, one prefill forward (a 91-token prompt, a fresh cache) traced: its host "
                         "waits by source line, and its launches and host-to-device copies under torch.profiler")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run, seconds (Python's default: 0.005)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.episode import EpisodeSpec, job_sampling, make_env, make_template, run_episode
    from k3rl.rollout.scheduler import episode_specs

    torch.set_num_threads(1)
    cfg = job_config(args)
    template, sampling = make_template(cfg), job_sampling(cfg)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    engine = EmbeddedEngine.from_preset(args.preset, device=args.device, dtype=dtype, background=False,
                                        max_num_seqs=args.max_num_seqs,
                                        **{k: v for k, v in (("prefix_cache_size", args.prefix_cache),
                                                             ("decode_append", args.decode_append),
                                                             ("share_prefix", args.share_prefix),
                                                             ("prefill_wait_steps", args.prefill_wait)) if v is not None})

    async def generate(ids, params, images=None, key=None, group_key=None):
        return await asyncio.wrap_future(engine.submit(ids, params, images=images))

    results = []
    for r in range(args.rounds):
        last = r == args.rounds - 1
        sched_prof = cProfile.Profile() if (args.profile and last) else None
        specs = [EpisodeSpec(**{k: v for k, v in s.items() if k in EpisodeSpec.__dataclass_fields__})
                 for g in range(r * 1000, r * 1000 + args.episodes // args.group)
                 for s in episode_specs(cfg, "profile", g, 0)]
        before = dict(engine.stats)
        stop = threading.Event()
        thread = threading.Thread(target=drive, args=(engine, stop, sched_prof), daemon=True)
        thread.start()

        async def run(specs=specs):
            return await asyncio.gather(*(run_episode(lambda s=s: make_env(s, cfg, template), s, generate, template,
                                                      sampling, max_turns=cfg.envs.max_turns,
                                                      max_context_tokens=cfg.rollout.max_context_tokens)
                                          for s in specs))

        tprof = None
        if args.torch_profile and last:
            tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                       *([torch.profiler.ProfilerActivity.CUDA]
                                                         if args.device.startswith("cuda") else [])])
            tprof.__enter__()
        t0 = time.perf_counter()
        trajs = asyncio.run(run())
        wall = time.perf_counter() - t0
        stop.set()
        thread.join()
        if tprof:
            tprof.__exit__(None, None, None)
            out = Path(args.torch_profile)
            out.mkdir(parents=True, exist_ok=True)
            for key in ("self_cpu_time_total", "self_device_time_total", "cpu_time_total"):
                if key == "self_device_time_total" and not args.device.startswith("cuda"):
                    continue
                (out / f"torch_{key}.txt").write_text(tprof.key_averages().table(sort_by=key, row_limit=60))
        d = {k: engine.stats[k] - before.get(k, 0) for k in engine.stats}
        gen = sum(sum(t.loss_mask) for t in trajs)
        row = {
            "round": r, "episodes": len(trajs), "wall_s": round(wall, 3), "episodes_per_s": round(len(trajs) / wall, 2),
            "gen_tokens_per_s": round(gen / wall, 1), "errors": sum(bool(t.error) for t in trajs),
            "reward": round(statistics.mean(t.reward for t in trajs), 3),
            "turns": round(statistics.mean(len([x for x in t.turns if x.role == "assistant"]) for t in trajs), 2),
            "engine_steps": d["steps"], "prefill_forwards": d["prefill_forwards"], "prefill_tokens": d["prefill_tokens"],
            "prefix_hit_tokens": d["prefix_hit_tokens"], "fed_prompt_tokens": d["fed_prompt_tokens"],
            "decode_tokens": d["decode_tokens"], "mean_decode_batch": round(d["decode_tokens"] / max(1, d["steps"]), 1),
            "admit_s": round(d["admit_s"], 3), "prefill_s": round(d["prefill_s"], 3), "decode_s": round(d["decode_s"], 3),
            "idle_s": round(wall - d["admit_s"] - d["prefill_s"] - d["decode_s"], 3),
            "episode_generate_s": round(statistics.mean(t.timings.get("generate_s", 0)
                                                        for t in trajs), 3),
            "episode_env_s": round(statistics.mean(t.timings.get("env_s", 0) for t in trajs), 3),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
        if sched_prof:
            out = Path(args.profile)
            out.mkdir(parents=True, exist_ok=True)
            (out / "scheduler_cumulative.txt").write_text(table(sched_prof, "cumulative", 80))
            (out / "scheduler_tottime.txt").write_text(table(sched_prof, "tottime"))
    if args.prefill_trace:
        results.append(prefill_trace(engine, args.device))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


@torch.no_grad()
def prefill_trace(engine, device: str) -> dict:
    """One eager prefill forward as the engine runs it (KeyLookup's first prompt is ~91 tokens):
    wall time, host waits by source line (CUDA only), and the launches and copies it issues."""
    model = engine.model
    ids = torch.arange(1, 92, device=device)[None] % 200 + 1

    def forward():
        model(ids, cache=model.new_cache(1, engine.autocast_dtype))

    for _ in range(3):
        forward()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        forward()
    if cuda:
        torch.cuda.synchronize()
    row = {"prefill_forward_ms": round((time.perf_counter() - t0) / 5 * 1e3, 2)}
    if cuda:
        from k3rl.learner.host_syncs import host_syncs

        row["host_waits"] = dict(host_syncs(forward).most_common())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward()
    counts = {e.key: e.count for e in prof.key_averages()}
    row["calls"] = {k: counts[k] for k in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
                                            "cudaStreamSynchronize", "aten::item", "aten::_local_scalar_dense",
                                            "aten::copy_", "aten::to") if k in counts}
    print(json.dumps(row, indent=1), flush=True)
    return row


if __name__ == "__main__":
    main()
