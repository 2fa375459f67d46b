"""`k3rl train`: the asynchronous agentic RL loop, top to bottom.

    Scheduler -> RolloutWorkers (episodes, envs, sandboxes) -> TrajectoryBuffer -> TrajectoryStore
        ^ admission (lag bound)          | generate                 | batch by reference
    InferencePool (engines) <- push_weights(version) -- LearnerGroup (K3 + Per-Head Muon)

The driver holds handles and small per-episode stats, never tokens. Who does what:
`rollout/scheduler.py` (admission, supervision, staleness, failures), `rollout/buffer.py`
(groups, the store), `learner/actor.py` (ranks, checkpoints, the weight transport),
`k3rl/metrics.py` (step metrics and the policy-version convention), `docs/architecture.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from k3rl.config import JobConfig
from k3rl.metrics import rollout_metrics, step_metrics, step_table, trainable

console = Console()
LEARNER_START_S, TRAIN_STEP_S, ENGINES_READY_S = 1800.0, 3600.0, 900.0


async def within(awaitable, seconds: float, what: str):
    """Every wait of the driver has a deadline, and its error says what it waited for."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise TimeoutError(f"waited {seconds:.0f}s for {what}") from None


def run_job(cfg: JobConfig, resume: bool = False, *, quiet: bool = False,
            kill_worker_at_step: int | None = None, kill_engine_at_step: int | None = None,
            kill_learner_at_step: int | None = None) -> dict[str, Any]:
    """Run (or with `resume`, continue) the job. `kill_*_at_step` kill rollout worker 0, inference
    engine 0 or learner rank 0 after that step's training (the failure tests)."""
    from k3rl.envs.registration import check_env_ids
    from k3rl.rollout.episode import preflight

    check_env_ids(cfg)  # before Ray starts: an unknown id, a prompt over the context, a bad oracle
    preflight(cfg)
    faults = {"worker": kill_worker_at_step, "engine": kill_engine_at_step, "learner": kill_learner_at_step}
    return asyncio.run(_run_job(cfg, resume, quiet, faults))


async def _run_job(cfg: JobConfig, resume: bool, quiet: bool, faults: dict[str, int | None]) -> dict[str, Any]:
    import ray

    from k3rl.cluster import init_ray
    from k3rl.learner.actor import LearnerGroup, latest_checkpoint
    from k3rl.rollout.buffer import TrajectoryBuffer
    from k3rl.rollout.episode import collect_demonstrations
    from k3rl.rollout.pool import EngineSpec, PoolActor
    from k3rl.rollout.scheduler import Scheduler
    from k3rl.rollout.worker import RolloutWorker
    from k3rl.store import TrajectoryStore
    from k3rl.tracking import Tracker

    run_name = cfg.tracking.run_name or cfg.name
    run_dir = Path(cfg.tracking.runs_dir) / run_name
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and not resume:
        raise SystemExit(f"run directory {run_dir} already holds a run: pass --resume to continue it, "
                         f"or set tracking.run_name to start a new one")
    ckpt = ckpt if resume else None
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.yaml")
    meta_file = run_dir / "run.json"
    meta = json.loads(meta_file.read_text()) if (resume and meta_file.exists()) else {}
    init_ray(cfg)

    async with contextlib.AsyncExitStack() as job:  # every actor and episode is released on every exit
        tracker = job.enter_context(Tracker(uri=cfg.tracking.uri, experiment=cfg.tracking.experiment,
                                            run_name=run_name, run_id=meta.get("mlflow_run_id"), run_dir=run_dir))
        meta["mlflow_run_id"] = tracker.run_id
        meta_file.write_text(json.dumps(meta))
        if not resume:
            tracker.log_params(cfg.flat())
            tracker.log_artifact_file(str(run_dir / "config.yaml"))

        spec = EngineSpec(kind=cfg.rollout.engine, preset=cfg.model.preset, overrides=cfg.model.overrides,
                          checkpoint=cfg.model.checkpoint, dtype=cfg.model.dtype, seed=cfg.model.seed,
                          device="cuda" if cfg.rollout.gpus_per_inference_worker > 0 else "cpu",
                          engine_kwargs={"max_num_seqs": cfg.rollout.max_batch_sequences})
        pool = PoolActor.options(num_cpus=0, max_concurrency=10_000).remote(
            cfg.rollout.num_inference_workers, spec, actor_options={
                "num_cpus": 1, "num_gpus": cfg.rollout.gpus_per_inference_worker, "max_concurrency": 10_000})
        job.push_async_callback(_stop_pool, pool)
        learner = LearnerGroup(cfg, run_dir, pool)
        job.callback(learner.shutdown)
        await within(asyncio.gather(pool.wait_ready.remote(), learner.start()), LEARNER_START_S,
                     "the inference engines and the learner ranks to build their models")
        state = await within(learner.call("load", str(ckpt)), LEARNER_START_S, f"loading {ckpt}") if ckpt else {}
        step = int(state.get("step", 0))
        # episodes decided after the checkpoint are re-issued under the same ids (exactly once)
        TrajectoryStore(run_dir).rollback(step if ckpt else -1)
        buffer = ray.remote(num_cpus=0, max_concurrency=1000)(TrajectoryBuffer).remote(
            cfg.rollout.group_size, store_dir=str(run_dir))
        job.callback(lambda: ray.kill(buffer))
        workers = []

        def make_worker(i: int):
            workers.append(ray.remote(num_cpus=0, max_concurrency=cfg.rollout.episodes_per_worker + 1, max_restarts=0)(
                RolloutWorker).remote(cfg.to_dict(), pool, buffer, i))
            return workers[-1]

        job.push_async_callback(_close_workers, workers)
        sched = Scheduler(cfg, run_name, make_worker, buffer, first_step=step + 1, next_index=int(state.get("next_group", 0)),
                          reopen=state.get("open_groups", []))
        job.push_async_callback(sched.stop)
        P = cfg.rollout.prompts_per_step

        if ckpt is None and cfg.learner.eval_before_training:  # the reward curve's step 0: the untrained policy
            m0 = rollout_metrics(await sched.evaluate(P, version=0), version=0)
            tracker.log_metrics(m0, step=0)
            console.log(f"untrained policy: reward {m0['reward/mean']:.3f} success {m0['episodes/success_rate']:.2f}")
        if ckpt is None and cfg.learner.sft_steps > 0:  # warm start on oracle demonstrations
            demos = await asyncio.to_thread(collect_demonstrations, cfg, run_name, cfg.learner.sft_episodes)
            sft = await within(learner.call("sft", demos, cfg.learner.sft_steps), TRAIN_STEP_S * 4, "the SFT warm start")
            for i, m in enumerate(sft):
                tracker.log_metrics({f"sft/{k}": v for k, v in m.items()}, step=i)
            console.log(f"SFT warm start: {len(demos)} oracle episodes, {len(sft)} steps, loss "
                        f"{sft[0].get('loss', float('nan')):.3f} -> {sft[-1].get('loss', float('nan')):.3f}")

        async def push(version: int) -> dict[str, float]:
            t = time.monotonic()
            report = await within(learner.push_weights(version), 2 * cfg.rollout.weight_sync_timeout_s + 120,
                                  f"the weights of version {version} to reach the engines")
            sched.set_serving(version)  # admission opens the groups this version may sample
            return {**report, "time/weight_sync_s": time.monotonic() - t}

        async def save(step: int) -> None:
            data = {"next_group": sched.next_index, "open_groups": sched.open_indices()}
            await within(learner.call("save", step, data), TRAIN_STEP_S, f"the checkpoint of step {step}")

        stop = asyncio.Event()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        await push(step + 1)
        history: list[dict[str, float]] = []
        t_job = time.monotonic()
        live = Live(step_table(step, cfg.learner.steps, {}), console=console, refresh_per_second=2)
        use_live = not quiet and console.is_terminal
        with live if use_live else contextlib.nullcontext():
            while step < cfg.learner.steps:
                t0 = time.monotonic()
                batch = await _unless(stop, sched.next_batch(step + 1))
                if batch is None:  # Ctrl-C: end with a checkpoint of the last complete step
                    break
                step += 1
                ref = (await buffer.take_ref.remote([g.id for g in batch], step))[0]
                stats = [s for g in batch for s in g.results.values()]
                t1 = time.monotonic()
                m = {**step_metrics(stats, step), "policy_version": float(step),
                     **await within(learner.call("train_step", ref), TRAIN_STEP_S, f"training step {step}")}
                t2 = time.monotonic()
                _inject_faults(faults, step, sched, pool, learner)
                if step < cfg.learner.steps:  # nothing samples from the weights of the last step
                    m.update(await push(step + 1))
                m.update(_timings(stats, t0, t1, t2), **sched.metrics())
                history.append(m)
                tracker.log_metrics(m, step=step)
                _show(live if use_live else None, quiet, step, cfg.learner.steps, m)
                if cfg.tracking.sample_episodes and (step % cfg.tracking.sample_every == 0 or step == cfg.learner.steps):
                    _log_samples(tracker, run_dir, stats, step, cfg.tracking.sample_episodes)
                if cfg.learner.checkpoint_every and step % cfg.learner.checkpoint_every == 0:
                    await save(step)

        completed = step >= cfg.learner.steps
        await save(step)  # a no-op when that step already has its checkpoint
        await sched.stop()
        await buffer.flush_unused.remote(step + 1)  # rolled back and re-issued if the run is resumed
        summary = {"completed": completed, "steps": step, "run_dir": str(run_dir), "mlflow_run_id": tracker.run_id,
                   "history": history, "buffer": await buffer.get_stats.remote(), "accounting": sched.metrics(),
                   "restarts": int(sched.counts["workers/restarts"]), "seconds": time.monotonic() - t_job}
        tracker.log_reward_curve_png()
        tracker.finish("FINISHED" if completed else "KILLED")
    (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1))
    if not quiet:
        console.print(f"\n[bold]done[/]: {step} steps in {summary['seconds']:.0f}s; run dir {run_dir}")
        console.print(f"  MLflow UI:   k3rl ui --tracking-uri {cfg.tracking.uri}")
        console.print(f"  reward plot: k3rl compare {run_name} --tracking-uri {cfg.tracking.uri}")
        console.print(f"  episodes:    k3rl replay {run_dir} --html {run_dir}/episode.html")
    return summary


# ----- small pieces of the loop -------------------------------------------------------------------
async def _unless(stop: asyncio.Event, coro):
    """`coro`'s result, or None when `stop` is set first (its task is then cancelled)."""
    task, waiter = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _quietly(ref) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ref, 30)


async def _stop_pool(pool) -> None:
    import ray

    await _quietly(pool.shutdown.remote())  # kills the engine actors
    with contextlib.suppress(Exception):
        ray.kill(pool)


async def _close_workers(workers: list) -> None:
    """Each rollout worker closes its sandbox pool (its warm containers), then is killed."""
    import ray

    await asyncio.gather(*(_quietly(w.close.remote()) for w in workers))
    for w in workers:
        with contextlib.suppress(Exception):
            ray.kill(w, no_restart=True)


def _inject_faults(faults: dict[str, int | None], step: int, sched, pool, learner) -> None:
    import ray

    if faults["learner"] == step:
        ray.kill(learner.actors[0], no_restart=True)
    if faults["worker"] == step:
        ray.kill(sched.workers[0], no_restart=True)
    if faults["engine"] == step:
        ray.kill(ray.get(pool.worker_handles.remote())[0], no_restart=True)


def _timings(stats: list[dict], t0: float, t1: float, t2: float) -> dict[str, float]:
    now = time.monotonic()
    step_s, train_s = now - t0, max(t2 - t1, 1e-9)
    stats = [s for s in stats if trainable(s)]
    return {"time/wait_for_rollouts_s": t1 - t0, "time/train_s": t2 - t1, "time/step_s": step_s,
            "learner/idle_fraction": (t1 - t0) / max(step_s, 1e-9),
            "throughput/rollout_tokens_per_s": sum(s["generated"] for s in stats) / max(step_s, 1e-9),
            "throughput/train_tokens_per_s": sum(s["tokens"] for s in stats) / train_s,
            "throughput/episodes_per_s": len(stats) / max(step_s, 1e-9)}


def _show(live, quiet: bool, step: int, total: int, m: dict[str, float]) -> None:
    if live is not None:
        live.update(step_table(step, total, m))
    elif not quiet:  # logs and CI: one line per step
        console.log(f"step {step}: reward {m.get('reward/mean', float('nan')):.3f} "
                    f"success {m.get('episodes/success_rate', float('nan')):.2f} loss {m.get('loss', float('nan')):.4f} "
                    f"staleness {m.get('staleness/mean', 0):.2f} failed {m.get('episodes/failed', 0):.0f}")


def _log_samples(tracker, run_dir: Path, stats: list[dict], step: int, n: int) -> None:
    """The step's best episodes as HTML artifacts, read back from the store (the driver holds no tokens)."""
    from k3rl.store import TrajectoryStore

    best = {s["id"] for s in sorted(filter(trainable, stats), key=lambda s: -s["reward"])[:n]}
    for t in TrajectoryStore(run_dir, readonly=True).read(step=step):
        if t.id in best:
            tracker.log_episode_html(t, step=step)
