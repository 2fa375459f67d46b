"""An RL job's efficiency against its parts measured alone (issue [19], item 4):

    efficiency = (generated tokens / the engine's standalone decode rate at the job's mean decode batch
                  + trained tokens / the learner's standalone training rate) / step time

The two quotients are the seconds an engine and a learner that ran as fast as they do alone would need for the
step's work ("engine-equivalent" and "learner-equivalent" seconds). 100% is a step that is nothing but
decode and training at their standalone speed, back to back; overlap of the two can exceed it.

    python benchmarks/efficiency.py RUN [--tracking-uri sqlite:///runs/mlflow.db] [--skip 2] [--device cuda]
    python benchmarks/efficiency.py --rl-json benchmarks/results/rl_job/2026-12-04_prefill_graphs/default_on_wait0.json

From MLflow (the job's own metrics, read as `benchmarks/agent_timing.py` reads them) each step gives generated
tokens (`throughput/rollout_tokens_per_s` x `time/step_s`), trained tokens (`tokens`, the packed tokens the
learner's forward/backward saw), the step time and the mean decode batch (the engine's cumulative
`engine/decode_tokens` over `engine/steps`, as `benchmarks/rollout_profile.py` reports it; a scheduler step with
no decode rows counts too, so it reads slightly low). `benchmarks/rl_gpus.py`'s JSON keeps none of the per-step
tokens nor the decode counters: only the window's generated tok/s, the median training tok/s and every step's
times, so it gives one overall number, with the decode batch from `--batch`.

The standalone rates (overridable by `--decode-rate B=TOK_S ...` and `--learner-rate`) are BENCHMARKS.md's rows;
the decode rate at the job's batch is interpolated linearly in log(batch) between the measured batches.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
from pathlib import Path

from k3rl.tracking import find_run, metric_history, mlflow_client

# BENCHMARKS.md, "Inference engine": k3-small bf16, eager layers in the decode step's CUDA graph (the RL job's
# default), benchmarks/results/engine/2026-12-04_compiled_decode_ladder.log, "eager-graph new 1" (H200).
# "Learner": k3-small train step, bf16, 65,520 tokens a step, 213,484-221,887 tokens/s (H200, 2026-12-04 04:53).
# CPU (k3-tiny fp32, 1 thread): "Inference engine"'s last paragraph (68 / 387 tok/s at batch 1 / 8, 2026-12-01)
# and "Learner"'s k3-tiny row (~300 tokens/s, 2026-11-29).
RATES = {
    "cuda": {"decode": {1: 481.5, 64: 17_090.7, 256: 51_892.8}, "learner": (213_484 + 221_887) / 2},
    "cpu": {"decode": {1: 68.0, 8: 387.0}, "learner": 300.0},
}


def decode_rate(table: dict[int, float], batch: float) -> float:
    """The engine's standalone decode tok/s at `batch`: linear in log(batch) between the measured batches,
    the end segments' lines beyond them (a rate is never taken below 0)."""
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]]
    i = min(max(bisect.bisect_left(xs, batch), 1), len(xs) - 1)
    lo, hi = xs[i - 1], xs[i]
    t = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return max(table[lo] + t * (table[hi] - table[lo]), 1e-9)


def efficiency(generated: float, trained: float, step_s: float, batch: float, decode: dict[int, float],
               learner: float) -> dict[str, float]:
    engine_s, learner_s = generated / decode_rate(decode, batch), trained / learner
    return {"generated": generated, "batch": batch, "decode_rate": decode_rate(decode, batch), "engine_s": engine_s,
            "trained": trained, "learner_s": learner_s, "step_s": step_s,
            "efficiency": (engine_s + learner_s) / step_s}


def total(rows: list[dict[str, float]], decode: dict[int, float], learner: float) -> dict[str, float]:
    """All steps as one: tokens and seconds summed, the batch weighted by generated tokens."""
    gen = sum(r["generated"] for r in rows)
    batch = sum(r["batch"] * r["generated"] for r in rows) / gen if gen else rows[0]["batch"]
    return efficiency(gen, sum(r["trained"] for r in rows), sum(r["step_s"] for r in rows), batch, decode, learner)


def from_mlflow(run_ref: str, tracking_uri: str, skip: int, batch: float | None) -> tuple[str, list[dict]]:
    """Per step (after the first `skip`): generated, trained, step_s, batch; `batch` overrides the counters."""
    client = mlflow_client(tracking_uri)
    run = find_run(client, run_ref)

    def series(key: str) -> dict[int, float]:
        return dict(metric_history(client, run.info.run_id, key)) if key in run.data.metrics else {}

    step_s, rate, tokens = series("time/step_s"), series("throughput/rollout_tokens_per_s"), series("tokens")
    dec, eng_steps = series("engine/decode_tokens"), series("engine/steps")
    missing = [k for k, s in (("throughput/rollout_tokens_per_s", rate), ("tokens", tokens)) if not s]
    if batch is None and not (dec and eng_steps):
        missing.append("engine/decode_tokens and engine/steps (or pass --batch)")
    if missing:
        raise SystemExit(f"run {run_ref} lacks {', '.join(missing)}")
    rows = []
    for s in sorted(k for k in step_s if k > skip and k in rate and k in tokens):
        b = batch
        if b is None:
            if s - 1 not in dec or s - 1 not in eng_steps or eng_steps[s] <= eng_steps[s - 1]:
                continue  # the first step has no previous counters; an engine that did not answer has none
            b = (dec[s] - dec[s - 1]) / (eng_steps[s] - eng_steps[s - 1])
        rows.append({"step": s, "generated": rate[s] * step_s[s], "trained": tokens[s], "step_s": step_s[s],
                     "batch": max(b, 1.0)})
    return f"{run.info.run_name} ({run.info.run_id})", rows


def from_rl_json(path: Path, batch: float) -> tuple[str, list[dict]]:
    """`benchmarks/rl_gpus.py`'s output: one row per layout, over its measured window. The skipped steps are
    found from its episodes/s (episodes a step x steps / their seconds); trained tokens are the median
    training tok/s times the window's training seconds (rl_gpus.py keeps no per-step token counts)."""
    rows = []
    for r in json.loads(path.read_text()):
        h = r["history"]
        skip = min(range(len(h)), key=lambda k: abs(sum(m["time/step_s"] for m in h[k:]) / (len(h) - k) - r["step_s"]))
        w = h[skip:]
        step_s = sum(m["time/step_s"] for m in w)
        rows.append({"step": f"{r['layout']}: steps {skip + 1}-{len(h)}", "generated": r["gen_tokens_per_s"] * step_s,
                     "trained": r["train_tokens_per_s"] * sum(m["time/train_s"] for m in w), "step_s": step_s,
                     "batch": batch})
    return str(path), rows


def show(name: str, rows: list[dict], decode: dict[int, float], learner: float) -> dict[str, float]:
    print(f"# {name}\n# decode tok/s by batch {decode}; learner {learner:,.0f} tok/s")
    print("| step | generated | mean decode batch | decode tok/s alone | engine-eq s | trained | learner-eq s | "
          "step s | efficiency |\n|---|---|---|---|---|---|---|---|---|")
    line = ("| {step} | {generated:,.0f} | {batch:.1f} | {decode_rate:,.0f} | {engine_s:.3f} | {trained:,.0f} | "
            "{learner_s:.3f} | {step_s:.2f} | {efficiency:.1%} |")
    for r in rows:
        print(line.format(step=r["step"], **efficiency(r["generated"], r["trained"], r["step_s"], r["batch"],
                                                       decode, learner)))
    out = total(rows, decode, learner)
    print(line.format(step="**all**", **out).replace("| all", "| **all**"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", nargs="?", help="MLflow run name or id")
    ap.add_argument("--tracking-uri", default="sqlite:///runs/mlflow.db")
    ap.add_argument("--skip", type=int, default=2, help="leave out the first steps (compiles, pools filling)")
    ap.add_argument("--rl-json", type=Path, help="benchmarks/rl_gpus.py's output instead of an MLflow run")
    ap.add_argument("--device", choices=sorted(RATES), default="cuda", help="which standalone rates")
    ap.add_argument("--batch", type=float, help="the mean decode batch (required with --rl-json)")
    ap.add_argument("--decode-rate", nargs="+", metavar="BATCH=TOK_S", help="replace the decode table")
    ap.add_argument("--learner-rate", type=float, help="replace the learner's tok/s")
    ap.add_argument("--json", type=Path, help="write the overall row here")
    args = ap.parse_args()
    decode = ({int(b): float(v) for b, v in (kv.split("=") for kv in args.decode_rate)} if args.decode_rate
              else RATES[args.device]["decode"])
    learner = args.learner_rate or RATES[args.device]["learner"]
    if args.rl_json:
        if args.batch is None:
            ap.error("--rl-json needs --batch: rl_gpus.py keeps no decode counters")
        name, rows = from_rl_json(args.rl_json, args.batch)
    elif args.run:
        name, rows = from_mlflow(args.run, args.tracking_uri, args.skip, args.batch)
    else:
        ap.error("give a run or --rl-json")
    if not rows:
        raise SystemExit("no steps to measure")
    out = show(name, rows, decode, learner)
    if args.json:
        args.json.write_text(json.dumps({"source": name, **out, "median_step_efficiency": statistics.median(
            efficiency(r["generated"], r["trained"], r["step_s"], r["batch"], decode, learner)["efficiency"]
            for r in rows)}, indent=1))


if __name__ == "__main__":
    main()
