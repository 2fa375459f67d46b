"""A soak (issue [23] item 5): one long CPU job, killed with SIGKILL midway and resumed, watched from outside.

The job is examples/demo.yaml (k3-tiny from the stored KeyLookup warm start) with small batches, checkpoints
every 20 steps and no held-out eval, on `faulty/FlakyLookup-v0` (tests/faulty_envs.py): KeyLookup whose tool
dies with probability `--fault` per call, an infrastructure failure that fails the episode. After the checkpoint
of step `--kill-after` and a few more steps the driver gets SIGKILL; `k3rl sandbox gc` clears what it left;
`k3rl train --resume` finishes the job. Every `--sample-s` seconds this script reads, from outside the job:

* the resident memory (RSS) of the driver and of each Ray actor by class (TrajectoryBuffer, RolloutWorker,
  EngineWorker, LearnerActor), from the driver's process tree;
* the bytes in Ray's object store (the raylet's store stats, through the cluster's GCS; no driver attaches).

It reports, per job segment (before the kill, after the resume), each role's RSS growth from the warm-up
window (the `--warmup` steps after the segment's first) to its last `--window` steps, floor to floor (the
lowest sample of each window: what a process holds between steps), and its peak; the step time's trend
(a Theil-Sen slope over the steps after warm-up, as a share of the median step per 100 steps; the
least-squares slope and the two halves' medians beside); the object
store's growth; and the store: every trained episode stored once, each step trained on P whole groups.

    python benchmarks/soak.py [--steps 300] [--kill-after 140] [--out benchmarks/results/soak]

Writes OUT/soak.json (samples, per-step times, the verdicts) and OUT/soak.png.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
ROLES = ("TrajectoryBuffer", "RolloutWorker", "EngineWorker", "LearnerActor")
LIMITS = {"rss_growth": 0.10, "step_trend_per_100": 0.10, "object_store_growth": 0.10}


def job_config(out: Path, steps: int, fault: float, checkpoint_every: int) -> dict:
    from k3rl.config import JobConfig

    cfg = JobConfig.load(REPO / "examples" / "demo.yaml", [
        "name=soak", f"learner.steps={steps}", f"learner.checkpoint_every={checkpoint_every}",
        "learner.eval_before_training=false", "envs.eval=[]", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.episodes_per_worker=16", "tracking.sample_episodes=0", "tracking.eval_every=0",
        f"tracking.runs_dir={out}/runs", f"tracking.uri=sqlite:///{out}/runs/mlflow.db", "ray.num_cpus=4"]).to_dict()
    keylookup = cfg["envs"]["train"][0]["kwargs"]
    cfg["envs"]["train"] = [{"id": "faulty/FlakyLookup-v0",
                             "kwargs": {**keylookup, "tool_failure": fault, "reset_fails": 0.0}}]
    cfg["envs"]["imports"] = ["faulty_envs"]
    cfg["ray"]["runtime_env"] = {"env_vars": {"PYTHONPATH": str(TESTS)}}
    cfg["model"]["checkpoint"] = str(REPO / "examples" / "keylookup_warm_start")
    return cfg


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}


def train(config_path: Path, log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "k3rl.cli", "train", str(config_path), *args], env=child_env(),
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True, cwd=config_path.parent)


def role_of(cmdline: list[str]) -> str | None:
    """The actor class of a Ray worker process (its title is `ray::Class.method` or `ray::Class`)."""
    title = " ".join(cmdline)
    return next((r for r in ROLES if f"ray::{r}" in title), None)


def object_store_bytes(gcs_address: str) -> int | None:
    """Bytes in the object store of the cluster at `gcs_address` (all its raylets), without attaching a driver."""
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        reply = get_memory_info_reply(get_state_from_address(gcs_address), timeout_seconds=10)
        return int(reply.store_stats.object_store_bytes_used)
    except Exception:  # the cluster starting or gone: no sample
        return None


class Sampler(threading.Thread):
    """Samples the driver's process tree every `period_s`: RSS by role, and the object store's bytes."""

    def __init__(self, period_s: float):
        super().__init__(daemon=True)
        self.period_s, self.samples, self.driver, self.segment = period_s, [], None, 0
        self.done = threading.Event()

    def sample(self) -> dict | None:
        try:
            driver = psutil.Process(self.driver.pid)
            tree = driver.children(recursive=True)
        except (psutil.NoSuchProcess, AttributeError):
            return None
        rss = {"driver": driver.memory_info().rss}
        gcs = None
        for p in tree:
            try:
                cmd = p.cmdline()
                if role := role_of(cmd):
                    rss[role] = rss.get(role, 0) + p.memory_info().rss
                gcs = gcs or next((a.split("=", 1)[1] for a in cmd if a.startswith("--gcs-address=")), None)
            except psutil.NoSuchProcess:
                continue
        return {"t": time.time(), "segment": self.segment, "rss": rss,
                "object_store": object_store_bytes(gcs) if gcs else None}

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            if self.driver is not None and (s := self.sample()):
                self.samples.append(s)


def step_times(uri: str, run_name: str) -> list[dict]:
    """(step, wall time, step seconds) of every logged step of the run, from MLflow."""
    from k3rl.tracking import find_run, mlflow_client

    client = mlflow_client(uri)
    history = client.get_metric_history(find_run(client, run_name).info.run_id, "time/step_s")
    return sorted(({"step": m.step, "t": m.timestamp / 1000, "step_s": m.value} for m in history),
                  key=lambda r: r["step"])


def growth(samples: list[dict], key, start: float, end: float, last_from: float) -> float | None:
    """min over the samples from `last_from` on / min over [start, end) - 1: the floor, what a process holds
    between its steps. A leak raises the floor; a step's transient peak (the learner's activations, freed and,
    since the learner trims its heap after each step, given back) does not, and the samples catch it at random."""
    early = [v for s in samples if start <= s["t"] < end and (v := key(s)) is not None]
    late = [v for s in samples if s["t"] >= last_from and (v := key(s)) is not None]
    if not early or not late:
        return None
    return min(late) / max(min(early), 1.0) - 1


def trend_per_100(steps: list[dict]) -> float:
    """The Theil-Sen slope of step seconds over steps (the median of every pair's slope), x 100 steps, as a
    share of the median step. Robust: a step's time is heavy-tailed (a wait for the next batch runs 0-4 s), and a
    few long waits near one end tilt a least-squares line (`ls_trend_per_100`, reported beside) without any
    trend in the bulk of the steps."""
    xs, ys = [r["step"] for r in steps], [r["step_s"] for r in steps]
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return statistics.median(slopes) * 100 / statistics.median(ys)


def ls_trend_per_100(steps: list[dict]) -> float:
    """The least-squares slope of step seconds over steps, x 100 steps, as a share of the median step."""
    xs, ys = [r["step"] for r in steps], [r["step_s"] for r in steps]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope * 100 / statistics.median(ys)


def analyse(samples: list[dict], steps: list[dict], kill_step: int, warmup: int, window: int) -> dict:
    segments = [[r for r in steps if r["step"] <= kill_step], [r for r in steps if r["step"] > kill_step]]
    out = {"segments": []}
    for i, seg in enumerate(segments):
        if len(seg) < warmup + 2 * window:
            out["segments"].append({"steps": len(seg), "too_short": True})
            continue
        mine = [s for s in samples if s["segment"] == i]
        start, end, last_from = seg[warmup]["t"], seg[warmup + window]["t"], seg[-window]["t"]
        roles = sorted({r for s in mine for r in s["rss"]})
        out["segments"].append({
            "steps": [seg[0]["step"], seg[-1]["step"]],
            "rss_growth": {r: growth(mine, lambda s, r=r: s["rss"].get(r), start, end, last_from) for r in roles},
            "rss_mb_end": {r: min(s["rss"][r] for s in mine if s["t"] >= last_from and r in s["rss"]) / 2**20
                           for r in roles if any(s["t"] >= last_from and r in s["rss"] for s in mine)},
            "rss_mb_peak": {r: max(s["rss"].get(r) or 0 for s in mine) / 2**20 for r in roles},
            "object_store_growth": growth(mine, lambda s: s["object_store"], start, end, last_from),
            "object_store_mb_end": max((s["object_store"] or 0 for s in mine if s["t"] >= last_from), default=0) / 2**20,
            "step_trend_per_100": trend_per_100(seg[warmup:]),
            "step_trend_ls_per_100": ls_trend_per_100(seg[warmup:]),
            "median_step_s_halves": [statistics.median(r["step_s"] for r in half) for half in
                                     (seg[warmup:][: (len(seg) - warmup) // 2], seg[warmup:][(len(seg) - warmup) // 2:])],
            "median_step_s": statistics.median(r["step_s"] for r in seg[warmup:]),
        })
    return out


def check_store(run_dir: Path, steps: int, prompts: int, group: int) -> dict:
    from k3rl.store import TrajectoryStore

    rows = TrajectoryStore(run_dir, readonly=True).summary()
    ids = [r["id"] for r in rows]
    trained = [r for r in rows if r["status"] == "trained"]
    per_step = {}
    for r in trained:
        per_step.setdefault(r["step"], set()).add(r["id"].rsplit("-s", 1)[0])
    return {"episodes": len(rows), "stored_once": len(ids) == len(set(ids)), "trained": len(trained),
            "failed": sum(r["status"] == "failed" for r in rows),
            "steps_with_p_groups": sum(len(per_step.get(s, ())) == prompts for s in range(1, steps + 1)),
            "steps": steps, "parts": len(list((run_dir / "trajectories").glob("*")))}


def verdicts(report: dict) -> dict[str, bool]:
    v = {"stored_once": report["store"]["stored_once"],
         "every_step_p_groups": report["store"]["steps_with_p_groups"] == report["store"]["steps"],
         "resume_completed": report["resumed_exit"] == 0}
    for i, seg in enumerate(report["analysis"]["segments"]):
        if seg.get("too_short"):
            continue
        v[f"segment{i}_rss"] = all(g is None or g <= LIMITS["rss_growth"] for g in seg["rss_growth"].values())
        v[f"segment{i}_step_trend"] = seg["step_trend_per_100"] <= LIMITS["step_trend_per_100"]
        v[f"segment{i}_object_store"] = (seg["object_store_growth"] is None
                                         or seg["object_store_growth"] <= LIMITS["object_store_growth"]
                                         or seg["object_store_mb_end"] < 1.0)
    return v


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    t = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended before {path.name}:\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() - t > timeout_s:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.5)


def soak(out: Path, steps: int = 300, kill_after: int = 140, checkpoint_every: int = 20, fault: float = 0.1,
         sample_s: float = 5.0, warmup: int = 20, window: int = 20, into_next_s: float = 8.0,
         progress=print, gc: bool = True) -> dict:
    """Run the soak in `out` and return its report (also written to out/soak.json). `gc`: clear the killed
    driver's leftovers with `k3rl sandbox gc`, as a user would; else kill exactly the processes of its tree (on a
    machine where other jobs start and stop, as in the test suite, a machine-wide gc is not this job's to run)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = job_config(out, steps, fault, checkpoint_every)
    config_path = out / "soak.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    run_dir, log = out / "runs" / "soak", out / "job.log"
    sampler = Sampler(sample_s)
    sampler.start()
    t0 = time.time()
    proc = sampler.driver = train(config_path, log)
    progress(f"soak: job started (pid {proc.pid}); SIGKILL after the checkpoint of step {kill_after}")
    wait_for(run_dir / "checkpoints" / f"step-{kill_after:06d}", proc, log, timeout_s=steps * 30)
    time.sleep(into_next_s)  # into the next steps: their work is lost and redone
    tree = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    killed_at = time.time()
    progress(f"soak: driver killed {killed_at - t0:.0f} s in; clearing what it left")
    if gc:
        gc_exit = subprocess.run([sys.executable, "-m", "k3rl.cli", "sandbox", "gc"], env=child_env(),
                                 capture_output=True, text=True, timeout=300).returncode
    else:
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        gc_exit = 0 if not psutil.wait_procs(tree, timeout=30)[1] else 1
    sampler.segment = 1
    proc = sampler.driver = train(config_path, log, "--resume")
    resumed_exit = proc.wait(timeout=steps * 30)
    sampler.done.set()
    sampler.join()
    progress(f"soak: resumed job ended (exit {resumed_exit}) {time.time() - t0:.0f} s in")
    times = step_times(cfg["tracking"]["uri"], "soak")
    kill_step = max((r["step"] for r in times if r["t"] <= killed_at), default=0)
    report = {"steps": steps, "kill_after_checkpoint": kill_after, "last_step_before_kill": kill_step,
              "fault": fault, "gc_exit": gc_exit, "resumed_exit": resumed_exit, "wall_s": time.time() - t0,
              "limits": LIMITS, "analysis": analyse(sampler.samples, times, kill_step, warmup, window),
              "store": check_store(run_dir, steps, cfg["rollout"]["prompts_per_step"], cfg["rollout"]["group_size"]),
              "step_times": times, "samples": sampler.samples}
    report["verdicts"] = verdicts(report)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = report["samples"][0]["t"] if report["samples"] else 0
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    roles = sorted({r for s in report["samples"] for r in s["rss"]})
    for r in roles:
        pts = [(s["t"] - t0, s["rss"][r] / 2**20) for s in report["samples"] if r in s["rss"]]
        ax[0].plot(*zip(*pts, strict=True), ".", ms=3, label=r)
    ax[0].set(title="RSS by process (MiB)", xlabel="seconds")
    ax[0].legend(fontsize=8)
    st = report["step_times"]
    ax[1].plot([r["step"] for r in st], [r["step_s"] for r in st], ".", ms=3)
    ax[1].axvline(report["last_step_before_kill"], color="red", lw=1, label="SIGKILL, resume")
    ax[1].set(title="step time (s)", xlabel="step")
    ax[1].legend(fontsize=8)
    pts = [(s["t"] - t0, s["object_store"] / 2**20) for s in report["samples"] if s["object_store"] is not None]
    if pts:
        ax[2].plot(*zip(*pts, strict=True), ".", ms=3)
    ax[2].set(title="Ray object store (MiB)", xlabel="seconds")
    fig.suptitle(f"soak: {report['steps']} steps, {report['fault']:.0%} tool faults, SIGKILL after step "
                 f"{report['last_step_before_kill']}, resumed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill-after", type=int, default=140)
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--fault", type=float, default=0.1)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "soak")
    a = ap.parse_args()
    report = soak(a.out, a.steps, a.kill_after, a.checkpoint_every, a.fault, a.sample_s, a.warmup, a.window)
    plot(report, a.out / "soak.png")
    summary = {k: report[k] for k in ("wall_s", "last_step_before_kill", "store", "verdicts")}
    summary["segments"] = report["analysis"]["segments"]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
