"""k3-small learns KeyLookup on one H200: two real jobs that differ in one config value, by default
rollout.max_policy_lag.

    python experiments/learn_gpu.py --out /tmp/learn                    # one H200: lags 0 and 2 at once
    python experiments/learn_gpu.py --out /tmp/learn --vary learner.lr=2e-5,5e-5   # two rates instead
    python experiments/learn_gpu.py --out /tmp/learn --task num_keys=6 --set learner.sft_steps=10
    python experiments/learn_gpu.py --cpu --out /tmp/learn-smoke        # smoke run: k3-tiny, CPU, 2 steps
    bash experiments/learn_gpu.sh 2>&1 | tee $OUT/log                   # on the device (wheels, layout, $OUT)

Each job is `k3rl train examples/demo_from_scratch.yaml --set ...` in a process of its own (its own local Ray:
the learner on 0.5 GPU, one embedded engine on 0.5 GPU, weights by CUDA IPC), both writing into
one MLflow SQLite store under --out. The recipe is the demo's (KeyLookup with per-turn rewards,
turn_grpo_no_std, an SFT warm start, held-out eval) at k3-small's size, with a warm start kept
short on purpose: k3-small copies KeyLookup's content within ~50 SFT steps at 1e-3, which would
leave RL nothing to show. `--task key=value` changes the KeyLookup task of training and eval
alike; `--set key.path=value` any config value of both jobs (after the script's own, so it wins);
`--vary key.path=v1,v2` the value the jobs differ in (one job per value, applied last).

Every line a job prints comes through with its name and the seconds since start; after
--budget-s the jobs get Ctrl-C (each ends with a checkpoint of its last complete step) and,
--grace-s later, are killed. Then both runs are read back from MLflow into <out>/learn_gpu.json
(per step: reward, success, format error rate, staleness, timings; per eval: greedy success,
reward, pass@k), <out>/learn_gpu.png (training reward and held-out greedy success by step) and
<out>/compare.png (`k3rl compare` of the two runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo_from_scratch.yaml"
EXPERIMENT = "k3rl-learn-gpu"
START = time.monotonic()
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# the KeyLookup task of training and eval (the demo's: 2 keys of abcd, 1-digit values)
TASK = {"num_keys": "4", "value_digits": "2", "key_letters": "abcdefgh", "key_digit": "false"}
# on top of examples/demo_from_scratch.yaml (temperature 0.7, per-turn credit and format penalty, token mean); lr 5e-5 is the
# rate measured to learn on the H200 (experiments/results/learn_gpu/README.md: 2e-5's job hit an engine fault)
RECIPE = [
    "learner.steps=30", "learner.sft_steps=20", "learner.sft_lr=1e-3", "learner.lr=5e-5",
    # the warm start of 2026-12-02's run (held-out greedy 0.92): one careful phase of 128 demonstrations a
    # step. The demo's careless second phase (from step 10 of 20) left k3-small unable to copy the value,
    # and its 32 a step after 20 steps copied on 0.14 of held-out tasks (experiments/results/learn_gpu/README.md)
    "learner.sft_phases=[]", "learner.sft_batch=128",
    "rollout.prompts_per_step=16", "rollout.group_size=8",
    "rollout.num_rollout_workers=2", "rollout.episodes_per_worker=128", "rollout.max_batch_sequences=256",
    "learner.checkpoint_every=0", "learner.eval_before_training=false", "tracking.sample_episodes=0",
    "tracking.eval_every=10", "envs.eval.0.num_tasks=64", "envs.eval.0.pass_k=2",
]
GPU = ["model.preset=k3-small", "model.dtype=bfloat16", "learner.bf16=true", "learner.micro_batch_tokens=16384",
       "learner.gpus=0.5", "rollout.gpus_per_inference_worker=0.5", "rollout.weight_transport=cuda_ipc"]
CPU = ["model.preset=k3-tiny", "model.dtype=float32", "learner.steps=2", "learner.sft_steps=2",
       "learner.sft_episodes=16", "rollout.prompts_per_step=2", "rollout.group_size=2",
       "rollout.num_rollout_workers=1", "rollout.episodes_per_worker=8", "rollout.max_batch_sequences=16",
       "tracking.eval_every=1", "envs.eval.0.num_tasks=2", "envs.eval.0.pass_k=1"]
STEP_KEYS = {"reward": "reward/mean", "success": "episodes/success_rate",
             "format_error_rate": "episodes/format_error_rate", "staleness": "staleness/mean",
             "clip_frac": "clip_frac", "kl": "kl", "entropy": "entropy", "step_s": "time/step_s",
             "train_s": "time/train_s", "wait_for_rollouts_s": "time/wait_for_rollouts_s",
             "weight_sync_s": "time/weight_sync_s", "eval_s": "time/eval_s",
             "episodes_per_s": "throughput/episodes_per_s"}


def job_overrides(args) -> list[str]:
    """The overrides both jobs share, in order: recipe, device, task, the user's --set. With --config (a job
    of its own, e.g. experiments/agent_gpu.yaml) neither the KeyLookup recipe nor its task applies."""
    own = args.config is not None
    task = {} if own else {**TASK, **dict(parse_pair(t, "--task") for t in args.task)}
    out = Path(args.out).resolve()
    return [*([] if own else RECIPE), *(CPU if args.cpu else GPU),
            *(f"envs.{part}.0.kwargs.{k}={v}" for k, v in task.items() for part in ("train", "eval")),
            f"tracking.runs_dir={out}/runs", f"tracking.uri=sqlite:///{out}/mlflow.db",
            f"tracking.experiment={EXPERIMENT}", *args.set]


def parse_pair(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"{flag} {item!r}: expected key=value, e.g. {flag} num_keys=6")
    return key, value


def run_name(args, key: str, value: str) -> str:
    """k3-small-lag0 for rollout.max_policy_lag=0, k3-small-lr2e-5 for learner.lr=2e-5."""
    leaf = {"max_policy_lag": "lag"}.get(key.split(".")[-1], key.split(".")[-1])
    return f"{'k3-tiny' if args.cpu else 'k3-small'}-{leaf}{value}"


def train_command(overrides: list[str], config: Path = DEMO) -> list[str]:
    """`k3rl train examples/demo_from_scratch.yaml --set ...` (run from --out: the path is absolute)."""
    return [sys.executable, "-m", "k3rl.cli", "train", str(config), *(a for o in overrides for a in ("--set", o))]


def shown(overrides: list[str], config: Path = DEMO) -> str:
    return shlex.join(["k3rl", "train", str(config.relative_to(ROOT)), *train_command(overrides)[5:]])


class Job:
    """One `k3rl train` process (a session of its own: its Ray processes go with it), its output
    relayed line by line with its name, and kept in <out>/<name>.log."""

    def __init__(self, name: str, label: str, overrides: list[str], out: Path, config: Path = DEMO):
        self.name, self.label, self.overrides, self.out, self.config = name, label, overrides, out, config
        self.proc: subprocess.Popen | None = None
        self.relay: threading.Thread | None = None
        self.started = self.ended = None
        self.interrupted = self.killed = False

    def start(self) -> None:
        env = {**os.environ, **NO_MULTICAST, "COLUMNS": "200", "PYTHONUNBUFFERED": "1",
               "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
               # two local Rays on one host: each takes 10% of the memory for its object store, not 30%
               "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": "0.1"}
        self.proc = subprocess.Popen(train_command(self.overrides, self.config), cwd=self.out, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        self.started = time.monotonic()
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()
        say(f"[{self.name}] started (pid {self.proc.pid})")

    def _relay(self) -> None:
        with open(self.out / f"{self.name}.log", "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                say(f"[{self.name}] " + re.sub(r"\s{3,}", "  ", line.rstrip()))  # rich pads its log lines

    def running(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None and self.ended is None:
                self.ended = time.monotonic()
                say(f"[{self.name}] exited with {self.proc.returncode}")
            return False
        return True

    def interrupt(self) -> None:
        """Ctrl-C: the job stops at the end of its step (or warm start) and saves a checkpoint. Not
        always: a job whose next batch is already waiting when the step ends (max_policy_lag > 0 and
        rollouts that keep up) trains on, since the driver takes a ready batch before it looks at
        Ctrl-C (k3rl/job.py, `_unless`); such a job is killed --grace-s later."""
        if self.running():
            self.interrupted = True
            self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        """The job's whole session (driver and its Ray processes), only ours."""
        if self.proc is not None:
            self.killed |= self.proc.poll() is None
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.running()
            if self.relay is not None:
                self.relay.join(timeout=5)  # its last lines before the results


def say(line: str) -> None:
    print(f"{time.monotonic() - START:6.0f}s {line}", flush=True)


def run_jobs(jobs: list[Job], args) -> list[dict]:
    """Start the jobs (all at once, or one after the other), stop them at the budget; GPU use every 30 s."""
    deadline, gpu, last_poll = START + args.budget_s, [], 0.0
    pending = list(jobs)
    try:
        while pending or any(j.running() for j in jobs):
            now = time.monotonic()
            if pending and now < deadline and not (args.sequential and any(j.running() for j in jobs)):
                pending.pop(0).start()
                continue
            if now >= deadline:
                pending.clear()
                for j in jobs:
                    if j.running() and not j.interrupted:
                        say(f"[{j.name}] budget of {args.budget_s:.0f}s spent: Ctrl-C")
                        j.interrupt()
                if now >= deadline + args.grace_s:
                    for j in jobs:
                        if j.running():
                            say(f"[{j.name}] still running {args.grace_s:.0f}s after Ctrl-C: killed")
                            j.kill()
            if not args.cpu and now - last_poll >= 30:
                last_poll = now
                if (sample := gpu_sample()) is not None:
                    gpu.append(sample)
                    say(f"GPU: {sample['memory_used_mib']:.0f} MiB used, {sample['utilization']:.0f}% busy")
            time.sleep(1)
    finally:
        for j in jobs:
            j.kill()
    return gpu


def gpu_sample() -> dict | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        mem, util = (float(x) for x in out.splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return {"memory_used_mib": mem, "utilization": util}


# ----- results, read back from MLflow -------------------------------------------------------------
def read_run(client, job: Job) -> dict:
    from k3rl.tracking import TrackingError, find_run, metric_history

    try:
        run = find_run(client, job.name, experiment=EXPERIMENT)
    except TrackingError as e:  # the job stopped before it made its MLflow run: its log says why
        return {"name": job.name, "label": job.label, "status": "NO RUN", "error": str(e),
                "exit_code": job.proc.returncode if job.proc else None, "steps": [], "eval": [], "sft": {},
                "timings": {"median_step_s": None}}
    keys = sorted(run.data.metrics)

    def history(key: str) -> dict[int, float]:
        return dict(metric_history(client, run.info.run_id, key)) if key in run.data.metrics else {}

    status = run.info.status
    if job.killed and status == "RUNNING":  # killed before it could end its MLflow run
        client.set_terminated(run.info.run_id, status="KILLED")
        status = "KILLED"
    series = {name: history(key) for name, key in STEP_KEYS.items()}
    steps = sorted(s for s in series["reward"] if s >= 1)  # step 0 is the untrained policy, if rolled out
    evals: dict[int, dict] = {}
    for key in keys:
        parts = key.split("/")
        if parts[0] == "eval" and len(parts) == 3 and (parts[2] in ("success", "reward") or parts[2].startswith("pass_at_")):
            for step, v in history(key).items():
                evals.setdefault(step, {"step": step})[f"{parts[1]}/{parts[2]}"] = v
    sft = {k.removeprefix("sft/"): [v for _, v in sorted(history(k).items())] for k in keys if k.startswith("sft/")}
    step_s = [series["step_s"][s] for s in steps if s in series["step_s"]]
    return {
        "name": job.name, "label": job.label, "run_id": run.info.run_id, "status": status,
        "exit_code": job.proc.returncode if job.proc else None, "stopped_by_budget": job.interrupted,
        "killed": job.killed,
        "steps": [{"step": s, **{n: series[n][s] for n in series if s in series[n]}} for s in steps],
        "eval": [evals[s] for s in sorted(evals)],
        "sft": {k: {"first": v[0], "last": v[-1], "steps": len(v)} for k, v in sft.items() if k in ("loss", "nll")},
        "timings": {"job_wall_s": (job.ended or time.monotonic()) - job.started if job.started else None,
                    "mlflow_run_s": ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1e3,
                    "rl_steps_s": sum(step_s), "median_step_s": statistics.median(step_s) if step_s else None,
                    "eval_s": sum(series["eval_s"].values())},
    }


def success_key(run: dict) -> str | None:
    return next((k for e in run["eval"] for k in e if k.endswith("/success")), None)


def plot(runs: list[dict], path: Path) -> None:
    """Training reward and held-out greedy success (pass@k dashed) by step, a colour per run."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    from k3rl.tracking import figure_png

    fig = Figure(figsize=(8, 8), dpi=100)
    top, bottom = fig.subplots(2, 1)
    for i, r in enumerate(runs):
        colour, label = f"C{i}", r["label"]
        top.plot([s["step"] for s in r["steps"]], [s["reward"] for s in r["steps"]], "-o", color=colour,
                 markersize=3, label=label)
        keys = sorted({k for e in r["eval"] for k in e if k.endswith("/success") or "/pass_at_" in k})
        envs = sorted({k.split("/")[-2] for k in keys if "/" in k})
        for key in keys:
            greedy = key.endswith("/success")
            kind = "greedy success" if greedy else key.split("/")[-1].replace("pass_at_", "pass@")
            env = key.split("/")[-2] if "/" in key else ""
            # several envs (<env>/success, ...): a marker per env, so their lines tell apart
            marker = "osd^v"[envs.index(env) % 5] if env in envs else "o"
            bottom.plot([e["step"] for e in r["eval"] if key in e], [e[key] for e in r["eval"] if key in e],
                        f"-{marker}" if greedy else f"--{marker}", color=colour, markersize=4,
                        label=f"{label}: {env + ' ' if len(envs) > 1 else ''}{kind}")
    top.set(title="training reward (sampled episodes of each step)", xlabel="RL step", ylabel="reward/mean")
    bottom.set(title="held-out evaluation (step 0: the SFT warm start)", xlabel="RL steps done", ylabel="rate",
               ylim=(-0.03, 1.03))
    path.write_bytes(figure_png(fig, [top, bottom]))


def summary_lines(runs: list[dict]) -> list[str]:
    lines = []
    for r in runs:
        rewards = [s["reward"] for s in r["steps"]]
        key = success_key(r)
        ev = " -> ".join(f"{e[key]:.2f}" for e in r["eval"] if key in e) if key else "-"
        first, last = (statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])) if rewards else (float("nan"),) * 2
        lines.append(f"{r['name']}: {len(rewards)} RL steps ({r['status']}), training reward steps 1-5 {first:.3f}, "
                     f"last 5 {last:.3f}; held-out greedy success by eval {ev}; "
                     f"median step {r['timings']['median_step_s'] or float('nan'):.1f}s")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a new (or empty) folder: MLflow store, runs, logs, results")
    ap.add_argument("--vary", default="rollout.max_policy_lag=0,2", metavar="KEY.PATH=V1,V2",
                    help="one job per value of this config key (default rollout.max_policy_lag=0,2)")
    ap.add_argument("--task", action="append", default=[], metavar="KEY=VALUE",
                    help=f"a KeyLookup kwarg of training and eval (default {TASK})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                    help="a config override of both jobs, applied last (repeatable)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="seconds from the script's start after which the jobs get Ctrl-C")
    ap.add_argument("--grace-s", type=float, default=40.0, help="then this long to save and stop before a kill")
    ap.add_argument("--sequential", action="store_true", help="one job after the other (default: all at once)")
    ap.add_argument("--cpu", action="store_true", help="smoke run: k3-tiny in float32 on CPUs, 2 steps, tiny eval")
    ap.add_argument("--config", type=Path, default=None, metavar="YAML",
                    help="a job config of its own instead of the KeyLookup demo's recipe (then --task does not apply)")
    ap.add_argument("--name", default=None, help="the runs' name prefix (default k3-small / k3-tiny)")
    args = ap.parse_args()
    for item in args.set:
        parse_pair(item, "--set")
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} is not empty: give a new folder (the runs' names repeat between runs)")
    out.mkdir(parents=True, exist_ok=True)
    vary_key, values = parse_pair(args.vary, "--vary")
    values = [v for v in values.split(",") if v]
    if not values:
        raise SystemExit(f"--vary {args.vary!r}: expected values separated by commas, e.g. --vary learner.lr=2e-5,5e-5")

    from k3rl.config import ConfigError, JobConfig
    from k3rl.envs.registration import check_env_ids
    from k3rl.rollout.job_start import preflight
    from k3rl.tracking import mlflow_client

    shared = job_overrides(args)
    config = (args.config or DEMO).resolve()
    jobs = []
    for value in values:
        name = run_name(args, vary_key, value) if args.name is None else f"{args.name}-{value}"
        overrides = [*shared, f"{vary_key}={value}", f"name={name}", f"tracking.run_name={name}"]
        try:  # refused here, before any job starts, with the field and what to change (the job's own checks)
            cfg = JobConfig.load(config, overrides)
            check_env_ids(cfg)
            preflight(cfg)
        except ConfigError as e:
            raise SystemExit(f"the recipe is refused: {e}") from None
        jobs.append(Job(name, f"{vary_key.split('.')[-1]} {value}", overrides, out, config))
    client = mlflow_client(f"sqlite:///{out}/mlflow.db")
    client.search_experiments()  # the store's schema, made once here rather than by two jobs at once
    say(f"learn_gpu: {len(jobs)} jobs ({'one after the other' if args.sequential else 'at once'}), budget "
        f"{args.budget_s:.0f}s; each: {shown(shared, config)} "
        f"--set {vary_key}=VALUE")
    gpu = run_jobs(jobs, args)

    runs = [read_run(client, j) for j in jobs if j.started is not None]
    import torch

    result = {"command": shlex.join(["python", "experiments/learn_gpu.py", *sys.argv[1:]]),
              "job_command": shown(shared, config) + f" --set {vary_key}=VALUE", "vary": {vary_key: values},
              "device": "cpu" if args.cpu else "cuda", "torch": torch.__version__, "budget_s": args.budget_s,
              "wall_s": time.monotonic() - START, "runs": runs,
              "gpu": {"samples": gpu, "max_memory_used_mib": max((g["memory_used_mib"] for g in gpu), default=None),
                      "mean_utilization": statistics.mean(g["utilization"] for g in gpu) if gpu else None}}
    (out / "learn_gpu.json").write_text(json.dumps(result, indent=1))
    with_steps = [r for r in runs if r["steps"] or r["eval"]]
    if with_steps:
        plot(with_steps, out / "learn_gpu.png")
        from k3rl.compare import CompareError, compare_runs

        try:
            compare_runs([r["run_id"] for r in with_steps if r["steps"]], out=out / "compare.png",
                         tracking_uri=f"sqlite:///{out}/mlflow.db")
        except CompareError as e:
            print(f"compare: {e}", flush=True)
    for line in summary_lines(runs):
        print(line, flush=True)
    print(f"results: {out / 'learn_gpu.json'}, {out / 'learn_gpu.png'}, {out / 'compare.png'}", flush=True)


if __name__ == "__main__":
    main()
