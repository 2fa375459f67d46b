"""`k3rl train`: the asynchronous agentic RL loop, top to bottom.

    Scheduler -> RolloutWorkers (episodes, envs, sandboxes) -> TrajectoryBuffer -> TrajectoryStore
        ^ admission (lag bound)          | generate                 | batch by reference
    InferencePool (engines) <- push_weights(version) -- LearnerGroup (K3 + Per-Head Muon)

The driver holds handles and small per-episode stats, never tokens. Who does what:
`rollout/scheduler.py` (admission, supervision, staleness, failures), `rollout/buffer.py`
(groups, the store), `learner/teacher_engines.py` (distillation teachers on engines of their own, scoring
each batch before the learner trains it), `learner/actor.py` (ranks, checkpoints, the weight transport),
`k3rl/metrics.py` (step metrics and the policy-version convention), `docs/architecture.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from rich.console import Console
from rich.live import Live

from k3rl.cluster import check_resources, engine_request, init_ray, on_driver_node, rollout_worker_request
from k3rl.config import JobConfig
from k3rl.envs.registration import check_env_ids
from k3rl.guard import FormatGuard
from k3rl.learner.actor import LearnerGroup, latest_checkpoint
from k3rl.learner.teacher_engines import TeacherGroup
from k3rl.metrics import eval_metrics, rollout_metrics, step_metrics, step_table, trainable
from k3rl.rollout.buffer import TrajectoryBuffer
from k3rl.rollout.job_start import collect_demonstration_sets, preflight
from k3rl.rollout.pool import EngineSpec, PoolActor
from k3rl.rollout.scheduler import Scheduler, heldout_groups
from k3rl.rollout.worker import RolloutWorker
from k3rl.store import TrajectoryStore
from k3rl.tracking import Tracker

console = Console()
TRAIN_STEP_S, BUFFER_S = 3600.0, 300.0
ENGINE_METRICS_S = 10.0
SFT_PIECE = 10  # SFT steps per call to the learner: the warm start reports its loss every SFT_PIECE steps


async def within(awaitable, seconds: float, what: str):
    """Every wait of the driver has a deadline, and its error says what it waited for."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise TimeoutError(f"waited {seconds:.0f}s for {what}") from None


def run_job(cfg: JobConfig, resume: bool = False, *, quiet: bool = False,
            kill_worker_at_step: int | None = None, kill_engine_at_step: int | None = None,
            kill_learner_at_step: int | None = None, kill_teacher_at_step: int | None = None) -> dict[str, Any]:
    """Run (or with `resume`, continue) the job. `kill_*_at_step` kill rollout worker 0, inference
    engine 0, learner rank 0 or the first teacher engine after that step's training (the failure tests)."""
    check_env_ids(cfg)  # before Ray starts: an unknown id, a prompt over the context, a bad oracle
    preflight(cfg)
    faults = {"worker": kill_worker_at_step, "engine": kill_engine_at_step, "learner": kill_learner_at_step,
              "teacher": kill_teacher_at_step}
    return asyncio.run(_run_job(cfg, resume, quiet, faults))


def run_dir_of(cfg: JobConfig) -> Path:
    """The job's run folder: tracking.runs_dir / (tracking.run_name, else the job's name)."""
    return Path(cfg.tracking.runs_dir) / (cfg.tracking.run_name or cfg.name)


class StoppedWhileStarting(BaseException):
    """A stop signal while the job's parts were starting: what had started is released, the MLflow run
    (if it was made) ends KILLED. A BaseException, as KeyboardInterrupt is: no `except Exception` takes it."""


async def _run_job(cfg: JobConfig, resume: bool, quiet: bool, faults: dict[str, int | None]) -> dict[str, Any]:
    stop = Stop(cfg.learner.preempt_grace_s)  # from here on Ctrl-C, SIGTERM and SIGHUP end the job cleanly
    run_dir = run_dir_of(cfg)
    try:
        return await _run_started(cfg, resume, quiet, faults, stop)
    except StoppedWhileStarting:
        console.print(f"[yellow]stopped by signal {stop.signal} while the job was starting: nothing was trained, "
                      f"everything it had started is released[/]")
        summary = {"completed": False, "steps": 0, "run_dir": str(run_dir), "signal": stop.signal,
                   "abandoned_step": False, "stopped_while_starting": True, "history": [], "eval": {}}
        if run_dir.is_dir():
            (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "history"}))
        return summary


async def _start(cfg: JobConfig, resume: bool, stack: contextlib.AsyncExitStack, stop: Stop) -> Job:
    """`Job.start`, unless a stop signal comes first: then its task is cancelled (and awaited, so that nothing
    it was starting is half-registered) and StoppedWhileStarting unwinds `stack`, which releases the rest."""
    task = asyncio.ensure_future(Job.start(cfg, resume, stack, stop))
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise StoppedWhileStarting(stop.signal)


async def _run_started(cfg: JobConfig, resume: bool, quiet: bool, faults: dict[str, int | None],
                       stop: Stop) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:  # every actor, episode and the MLflow run end on every exit
        job = await _start(cfg, resume, stack, stop)
        step, steps, history, evals, t_job = job.step, cfg.learner.steps, [], {}, time.monotonic()
        done, warmed = step, None  # done: the last step trained to its end
        async with stop.grace():  # a step in progress is abandoned learner.preempt_grace_s after a stop signal
            warmed = await _unless(stop, _then_true(job.warm_start()))  # None: stopped during the warm start
            if warmed and not job.resumed and cfg.learner.sft_steps and cfg.learner.checkpoint_every:
                await job.save(step)  # the SFT's policy as step 0's checkpoint: a warm start to keep or resume from
            if warmed:
                await job.push(step + 1)
            if warmed and not job.resumed and cfg.envs.eval:  # step 0: the warm-started policy, before the first RL step
                evals[0] = await job.evaluate(0)
                job.tracker.log_metrics(evals[0], step=0)
            with _progress(quiet, step, steps) as show:
                while warmed and step < steps:
                    t0 = time.monotonic()
                    # fresh groups, under the lag bound
                    batch = await _unless(stop, job.sched.next_batch(step + 1), undo=job.sched.put_back)
                    if batch is None:  # a stop signal: end with a checkpoint of the last complete step
                        break
                    step += 1
                    ids = [g.id for g in batch]
                    stats = [s for g in batch for s in g.results.values()]  # what the driver sees: a few numbers each
                    m = {**step_metrics(stats, step), "policy_version": float(step)}
                    # the collapse guard judges the batch by its format error rate before it is trained or stored
                    verdict = job.guard.observe(m.get("episodes/format_error_rate", 0.0)) if job.guard else "ok"
                    if verdict == "rollback":  # back to the last good policy, at a lower rate; this batch is not trained
                        await within(job.buffer.drop.remote(ids, step, "rolled_back"), BUFFER_S,
                                     f"the buffer to store step {step}'s rolled-back batch")
                        t1 = time.monotonic()
                        console.log(f"[yellow]step {step}: format error rate {m['episodes/format_error_rate']:.2f} over "
                                    f"the guard's bound; rolling back to the last good policy at "
                                    f"{job.guard.lr_scale:g}x the learning rate")
                        m.update(await within(job.learner.call("restore", job.guard.lr_scale), TRAIN_STEP_S,
                                              f"the guard's rollback at step {step}"))
                    else:
                        if verdict == "ok" and job.guard:  # the policy that sampled this batch is the last good one
                            await within(job.learner.call("snapshot"), TRAIN_STEP_S, f"the guard's snapshot at step {step}")
                        ref = (await within(job.buffer.take_ref.remote(ids, step), BUFFER_S,
                                            f"the buffer to hand out step {step}'s batch"))[0]  # tokens go by reference
                        t1 = time.monotonic()
                        # teachers on engines of their own attach log T to the episodes (learner/teacher_engines.py)
                        ref, scored = await within(job.teachers.score(ref), TRAIN_STEP_S, f"the teachers to score step {step}")
                        m.update(scored)
                        m.update(await within(job.learner.call("train_step", ref), TRAIN_STEP_S, f"training step {step}"))
                    if job.guard:
                        m.update(job.guard.metrics())
                    t2 = time.monotonic()
                    _inject_faults(faults, step, job)
                    if step < steps or job.eval_due(step):  # nothing samples from the last step's weights but its eval
                        m.update(await job.push(step + 1, admit=step < steps))
                    m.update(_timings(stats, t0, t1, t2), **job.sched.metrics(), **await _engine_metrics(job.pool))
                    if job.eval_due(step):  # between the push of version step + 1 and the next batch
                        evals[step] = await job.evaluate(step)
                        m.update(evals[step])
                    history.append(m)
                    job.tracker.log_metrics(m, step=step)
                    show(step, m)
                    if cfg.tracking.sample_episodes and (step % cfg.tracking.sample_every == 0 or step == steps):
                        _log_samples(job, stats, step)
                    if cfg.learner.checkpoint_every and step % cfg.learner.checkpoint_every == 0:
                        await job.save(step)
                    done = step
        # stopped in the warm start: nothing trained by RL yet; past the grace: the last checkpoint stands
        if warmed and not stop.abandoned:
            await job.save(step)  # a no-op when that step already has its checkpoint
        await job.sched.stop()
        # what finished but was not trained is stored as unused; a resume rolls it back and re-issues it
        await within(job.buffer.flush_unused.remote(step + 1), BUFFER_S, "the buffer to store the unused episodes")
        summary = {"completed": bool(warmed) and done >= steps, "steps": done, "run_dir": str(job.run_dir),
                   "signal": stop.signal, "abandoned_step": stop.abandoned,
                   "mlflow_run_id": job.tracker.run_id, "history": history, "eval": evals,
                   "buffer": await within(job.buffer.get_stats.remote(), BUFFER_S, "the buffer's counts"),
                   "accounting": job.sched.metrics(),
                   "restarts": int(job.sched.counts["workers/restarts"]), "seconds": time.monotonic() - t_job}
        job.tracker.log_reward_curve_png()
        job.tracker.finish("FINISHED" if summary["completed"] else "KILLED")
        summary["tracking"] = job.tracker.writer.stats()  # what MLflow took, and what waits in the spool
    _report(job, summary, quiet)
    return summary


@dataclass
class Job:
    """The job's parts, started (and registered for release on `stack`) by `Job.start`."""

    cfg: JobConfig
    run_dir: Path
    tracker: Any
    pool: Any
    learner: Any
    teachers: Any  # the engines of learner.distill.teachers (learner/teacher_engines.py)
    buffer: Any
    sched: Any
    step: int  # training steps done (the checkpoint's, on resume)
    resumed: bool
    guard: FormatGuard | None = None  # the collapse guard (k3rl/guard.py); its state starts afresh on resume

    @classmethod
    async def start(cls, cfg: JobConfig, resume: bool, stack: contextlib.AsyncExitStack,
                    stop: Stop | None = None) -> Job:

        run_dir = run_dir_of(cfg)
        run_name = run_dir.name
        if not resume and any((run_dir / "checkpoints").glob("step-*")):
            raise SystemExit(f"run directory {run_dir} already holds a run: pass --resume to continue it, "
                             f"or set tracking.run_name to start a new one")
        ckpt = latest_checkpoint(run_dir) if resume else None  # the newest complete one (torn ones: a warning)
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(run_dir / "config.yaml")
        meta_file = run_dir / "run.json"
        meta = json.loads(meta_file.read_text()) if (resume and meta_file.exists()) else {}
        init_ray(cfg)
        if stop is not None:  # ray.init put its own SIGTERM handler in the driver (it exits at once): ours again
            stop.install()
        check_resources(cfg)  # an impossible request fails now, not after ray.start_timeout_s
        tracker = stack.enter_context(Tracker(uri=cfg.tracking.uri, experiment=cfg.tracking.experiment,
                                              run_name=run_name, run_id=meta.get("mlflow_run_id"), run_dir=run_dir,
                                              write_deadline_s=cfg.tracking.write_deadline_s))
        meta_file.write_text(json.dumps({**meta, "mlflow_run_id": tracker.run_id}))
        if not resume:
            tracker.log_params(cfg.flat())
            tracker.log_artifact_file(str(run_dir / "config.yaml"))

        r = cfg.rollout
        spec = EngineSpec(kind=r.engine, preset=cfg.model.preset, overrides=cfg.model.k3_overrides,
                          checkpoint=cfg.model.checkpoint, dtype=cfg.model.dtype, seed=cfg.model.seed,
                          device="cuda" if r.gpus_per_inference_worker > 0 else "cpu",
                          engine_kwargs={"max_num_seqs": r.max_batch_sequences,
                                         **({"compile_decode": True} if r.compile_decode else {}),
                                         **({"prefill_graphs": r.prefill_graphs}
                                            if r.prefill_graphs is not None else {}),
                                         **({"prefill_wait_steps": r.prefill_wait_steps}
                                            if r.prefill_wait_steps is not None else {})})  # embedded only
        pool = PoolActor.options(num_cpus=0, max_concurrency=10_000, **on_driver_node()).remote(
            r.num_inference_workers, spec, actor_options={
            **engine_request(cfg).options(), "max_concurrency": 10_000})
        stack.push_async_callback(_stop_pool, pool)
        learner = LearnerGroup(cfg, run_dir, pool)
        stack.callback(learner.shutdown)
        teachers = TeacherGroup(cfg)
        stack.callback(teachers.shutdown)
        start_s = cfg.ray.start_timeout_s
        await within(asyncio.gather(pool.wait_ready.remote(), learner.start(), teachers.wait_ready()), start_s,
                     "the inference engines, the learner ranks and the teachers' engines to build their models "
                     "(ray.start_timeout_s)")
        state = await within(learner.call("load", str(ckpt)), start_s, f"loading {ckpt} (ray.start_timeout_s)") if ckpt else {}
        step = int(state.get("step", 0))
        # episodes decided after the checkpoint are re-issued under the same ids (exactly once)
        TrajectoryStore(run_dir).rollback(step if ckpt else -1)
        buffer = ray.remote(num_cpus=0, max_concurrency=1000)(TrajectoryBuffer).options(**on_driver_node()).remote(
            r.group_size, store_dir=str(run_dir))
        stack.callback(ray.kill, buffer)
        workers = []

        def make_worker(i: int):
            workers.append(ray.remote(**rollout_worker_request(cfg).options(), max_concurrency=r.episodes_per_worker + 1,
                                      max_restarts=0)(RolloutWorker).remote(cfg.to_dict(), pool, buffer, i))
            return workers[-1]

        stack.push_async_callback(_close_workers, workers)
        sched = Scheduler(cfg, run_name, make_worker, buffer, first_step=step + 1,
                          next_index=int(state.get("next_group", 0)), reopen=state.get("open_groups", []))
        stack.push_async_callback(sched.stop)
        guard = FormatGuard.from_config(cfg.learner.guard) if cfg.learner.guard.enabled else None
        return cls(cfg, run_dir, tracker, pool, learner, teachers, buffer, sched, step, ckpt is not None, guard)

    async def warm_start(self) -> None:
        """A fresh run: the starting policy's reward (the curve's step 0: untrained, or model.checkpoint's), then
        SFT on oracle demonstrations, collected in a Ray task so the driver never holds their tokens."""

        cfg, P = self.cfg, self.cfg.rollout.prompts_per_step
        if self.resumed:
            return
        if cfg.learner.eval_before_training:
            m0 = rollout_metrics(await self.sched.evaluate(P, version=0), version=0)
            self.tracker.log_metrics(m0, step=0)
            console.log(f"policy before training: reward {m0['reward/mean']:.3f} success {m0['episodes/success_rate']:.2f}")
        if cfg.learner.sft_steps > 0:
            console.log(f"SFT warm start: collecting {cfg.learner.sft_episodes} oracle episodes a phase, then "
                        f"{cfg.learner.sft_steps} steps")
            demos = ray.remote(num_cpus=0)(collect_demonstration_sets).remote(cfg, self.run_dir.name,
                                                                              cfg.learner.sft_episodes)
            sft, total, t0 = [], cfg.learner.sft_steps, time.monotonic()
            while len(sft) < total:  # in pieces: the loss shows up (console, MLflow) while the warm start runs
                n = min(SFT_PIECE, total - len(sft))
                piece = await within(self.learner.call("sft", demos, n, len(sft)), TRAIN_STEP_S,
                                     f"SFT steps {len(sft) + 1}-{len(sft) + n}")
                for i, m in enumerate(piece, start=len(sft)):
                    self.tracker.log_metrics({f"sft/{k}": v for k, v in m.items()}, step=i)
                sft += piece
                console.log(f"SFT step {len(sft)}/{total}: loss {piece[-1].get('loss', float('nan')):.4f} "
                            f"({time.monotonic() - t0:.0f}s)")
            n_phases = len(cfg.learner.sft_phases) + (cfg.learner.sft_phases[0].from_step > 0 if cfg.learner.sft_phases else 1)
            phases = f" ({n_phases} phases)" if n_phases > 1 else ""
            console.log(f"SFT warm start: {cfg.learner.sft_episodes} oracle episodes{phases}, {len(sft)} steps, loss "
                        f"{sft[0].get('loss', float('nan')):.3f} -> {sft[-1].get('loss', float('nan')):.3f}")

    async def push(self, version: int, admit: bool = True) -> dict[str, float]:
        """The learner's weights to every engine as `version`; admission then opens what it may sample."""
        t = time.monotonic()
        report = await within(self.learner.push_weights(version), 2 * self.cfg.rollout.weight_sync_timeout_s + 120,
                              f"the weights of version {version} to reach the engines")
        self.sched.set_serving(version, admit)
        return {**report, "time/weight_sync_s": time.monotonic() - t}

    def eval_due(self, step: int) -> bool:
        every = self.cfg.tracking.eval_every
        return bool(self.cfg.envs.eval and every and (step % every == 0 or step == self.cfg.learner.steps))

    async def evaluate(self, step: int) -> dict[str, float]:
        """The held-out evaluation (envs.eval) logged at `step`: the policy after `step` RL steps, version
        step + 1, which the engines serve now. The driver pushes no weights until this returns, so every
        eval token is of that version, also with max_policy_lag > 0 (training episodes run beside it)."""
        version, t = step + 1, time.monotonic()
        assert self.sched.serving == version, f"evaluating version {version}, the engines serve {self.sched.serving}"
        plan = heldout_groups(self.cfg, self.sched.run_name, step, version)
        await self.sched.run_apart([g for _, groups in plan for g in groups], step)
        m = {"time/eval_s": time.monotonic() - t}
        for spec, groups in plan:
            m.update(eval_metrics(spec.metric_name, self.cfg.envs.eval_sizes(spec)[0],
                                  [g.ordered_results() for g in groups], version))
        console.log(f"eval at step {step}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.2f}" for k, v in m.items()
                                                         if k.endswith(("/success", "/reward")) or "/pass_at_" in k))
        return m

    async def save(self, step: int) -> None:
        """A checkpoint, with the scheduler's state: a resume re-issues the groups open now, under their ids."""
        data = {"next_group": self.sched.next_index, "open_groups": self.sched.open_indices()}
        await within(self.learner.call("save", step, data), TRAIN_STEP_S, f"the checkpoint of step {step}")


# ----- small pieces of the loop -------------------------------------------------------------------
async def _unless(stop: Stop | asyncio.Event, coro, undo=None):
    """`coro`'s result, or None when `stop` is set first (its task is then cancelled). Stop wins a tie:
    an asynchronous job whose next batch is always ready when a step ends must still stop on Ctrl-C;
    the result that came anyway goes to `undo` (a batch back to the scheduler, whose checkpoint then
    re-issues its groups)."""
    if stop.is_set():
        coro.close()
        return None
    task, waiter = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this wait is cancelled (Stop.grace)
        waiter.cancel()
        if not task.done():
            task.cancel()
    if not stop.is_set():
        return task.result()
    if undo and task.done() and not task.cancelled() and task.exception() is None:
        undo(task.result())
    return None


async def _then_true(coro) -> bool:
    await coro
    return True


async def _quietly(ref) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ref, 30)


async def _stop_pool(pool) -> None:
    await _quietly(pool.shutdown.remote())  # kills the engine actors
    with contextlib.suppress(Exception):
        ray.kill(pool)


async def _close_workers(workers: list) -> None:
    """Each rollout worker closes its sandbox pool (its warm containers), then is killed."""
    await asyncio.gather(*(_quietly(w.close.remote()) for w in workers))
    for w in workers:
        with contextlib.suppress(Exception):
            ray.kill(w, no_restart=True)


def _inject_faults(faults: dict[str, int | None], step: int, job: Job) -> None:
    if faults["learner"] == step:
        ray.kill(job.learner.actors[0], no_restart=True)
    if faults["worker"] == step:
        ray.kill(job.sched.workers[0], no_restart=True)
    if faults["engine"] == step:
        ray.kill(ray.get(job.pool.worker_handles.remote())[0], no_restart=True)
    if faults["teacher"] == step:
        ray.kill(job.teachers.engines[0], no_restart=True)


def _timings(stats: list[dict], t0: float, t1: float, t2: float) -> dict[str, float]:
    now = time.monotonic()
    step_s, train_s = now - t0, max(t2 - t1, 1e-9)
    stats = [s for s in stats if trainable(s)]
    return {"time/wait_for_rollouts_s": t1 - t0, "time/train_s": t2 - t1, "time/step_s": step_s,
            "learner/idle_fraction": (t1 - t0) / max(step_s, 1e-9),
            "throughput/rollout_tokens_per_s": sum(s["generated"] for s in stats) / max(step_s, 1e-9),
            "throughput/train_tokens_per_s": sum(s["tokens"] for s in stats) / train_s,
            "throughput/episodes_per_s": len(stats) / max(step_s, 1e-9),
            "throughput/images_per_episode": sum(s.get("images", 0) for s in stats) / max(len(stats), 1)}


async def _engine_metrics(pool) -> dict[str, float]:
    """The engines' counters (`engine/...`, cumulative; EmbeddedEngine.metrics). Only observed: an engine
    that does not answer within ENGINE_METRICS_S leaves them out of this step's metrics."""
    try:
        return await asyncio.wait_for(pool.engine_metrics.remote(), ENGINE_METRICS_S)
    except (TimeoutError, ray.exceptions.RayError):
        return {}


class Stop:
    """Ctrl-C, or a scheduler's SIGTERM or SIGHUP (a preemption): the loop ends at the next step boundary,
    which the driver waits for at most `grace_s` after the signal (`grace()`); past that, the step in
    progress is abandoned (`abandoned`), the last checkpoint stands and a resume re-issues its episodes.
    Either way the MLflow run ends KILLED, every actor and container is released, and `k3rl train` exits
    128 + the signal (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, grace_s: float):
        self.grace_s, self.signal, self.abandoned = grace_s, None, False
        self.event, self._deadline = asyncio.Event(), None
        self.install()

    def install(self) -> None:
        """The handlers of SIGNALS, in place of any before (Ray's SIGTERM handler in the driver exits at once)."""
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, self.set, sig)

    def set(self, sig: int = signal.SIGINT) -> None:
        self.signal = self.signal or int(sig)
        self.event.set()
        if self._deadline is not None and self._deadline.when() is None:
            self._deadline.reschedule(asyncio.get_running_loop().time() + self.grace_s)

    def is_set(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()

    @contextlib.asynccontextmanager
    async def grace(self):
        """The block runs to its end, or is cancelled `grace_s` after a stop signal (then `abandoned`)."""
        try:
            async with asyncio.timeout(None) as self._deadline:
                if self.is_set():
                    self._deadline.reschedule(asyncio.get_running_loop().time() + self.grace_s)
                yield
        except TimeoutError:
            if not self._deadline.expired():  # a wait of the block's own ran out: not ours
                raise
            self.abandoned = True
        finally:
            self._deadline = None


@contextlib.contextmanager
def _progress(quiet: bool, step: int, total: int):
    """`show(step, metrics)`: a live table on a terminal, one line per step in logs and CI."""
    if quiet:
        yield lambda step, m: None
    elif console.is_terminal:
        with Live(step_table(step, total, {}), console=console, refresh_per_second=2) as live:
            yield lambda step, m: live.update(step_table(step, total, m))
    else:
        yield lambda step, m: console.log(
            f"step {step}: reward {m.get('reward/mean', float('nan')):.3f} success "
            f"{m.get('episodes/success_rate', float('nan')):.2f} loss {m.get('loss', float('nan')):.4f} "
            f"staleness {m.get('staleness/mean', 0):.2f} failed {m.get('episodes/failed', 0):.0f}")


def _report(job: Job, summary: dict[str, Any], quiet: bool) -> None:
    (job.run_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1))
    if not quiet:
        name, uri = job.run_dir.name, job.cfg.tracking.uri
        console.print(f"\n[bold]done[/]: {summary['steps']} steps in {summary['seconds']:.0f}s; run dir {job.run_dir}")
        console.print(f"  MLflow UI:   k3rl ui --tracking-uri {uri}")
        console.print(f"  reward plot: k3rl compare {name} --tracking-uri {uri}")
        console.print(f"  episodes:    k3rl replay {job.run_dir} --html {job.run_dir}/episode.html")
        if summary["tracking"]["pending"]:
            console.print(f"[yellow]  MLflow was down at the end: {summary['tracking']['pending']} records wait in "
                          f"{job.run_dir}/tracking_spool.jsonl; `k3rl sync {job.run_dir}` sends them[/]")


def _log_samples(job: Job, stats: list[dict], step: int) -> None:
    """The step's best episodes as HTML artifacts and MLflow traces, read back from the store (the driver
    holds no tokens)."""
    n = job.cfg.tracking.sample_episodes
    best = {s["id"] for s in sorted(filter(trainable, stats), key=lambda s: -s["reward"])[:n]}
    for t in TrajectoryStore(job.run_dir, readonly=True).read(step=step):
        if t.id in best:
            job.tracker.log_episode_html(t, step=step)
            job.tracker.log_episode_trace(t, step=step)
