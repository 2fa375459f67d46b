"""The job driver: `k3rl train` — one Ray job running the asynchronous agentic RL loop.

    InferencePool (engines)  <- versioned weights --  Learner (K3 + Per-Head Muon)
          ^  token ids / log-probs                          ^ batches of prompt groups
    RolloutWorkers (asyncio episodes, envs, sandboxes) -> TrajectoryBuffer -> TrajectoryStore

Staleness admission (bounded policy lag): with P prompt groups per step and the learner at
version v, at most (v + 1 + max_policy_lag) * P groups may have been issued. With
max_policy_lag = 0 a step's episodes start only after the previous step's weights are in
every engine, which is the synchronous on-policy algorithm exactly. Episodes that straddle
a weight update (partial rollouts) carry a version per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from k3rl.config import JobConfig
from k3rl.types import Trajectory

console = Console()


# --------------------------------------------------------------------------------------
# Learner actor
# --------------------------------------------------------------------------------------
class LearnerActor:
    """One rank of the learner: owns the model (or its FSDP / expert shard), the optimizer and the
    checkpoints; runs in its own Ray process. `setup` joins the ranks' process group and builds
    the trainer; every other method is called on all ranks with the same arguments."""

    def __init__(self, cfg: dict[str, Any], run_dir: str, rank: int = 0, world_size: int = 1) -> None:
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("K3RL_LEARNER_THREADS", "1"))))
        self.cfg = JobConfig.model_validate(cfg)
        self.run_dir = Path(run_dir)
        self.rank, self.world_size = rank, world_size
        self.device = "cuda" if self.cfg.learner.gpus > 0 and torch.cuda.is_available() else "cpu"
        self.trainer = None
        self.weight_sync = None  # nccl: rank 0's end of the broadcast group
        self.ipc_share = None  # cuda_ipc: the last update shared, alive until the next one

    def rendezvous_address(self) -> str:
        """A free host:port for a process group's store on this (rank 0's) node: loopback when the
        job runs its own local Ray (every process is on this machine), the node's address on a
        cluster. Used for the learner's ranks and for the weight-broadcast group."""
        import ray

        from k3rl.learner.distributed import free_port

        host = ray.util.get_node_ip_address() if self.cfg.ray.address else "127.0.0.1"
        return f"{host}:{free_port(host)}"

    def setup(self, rendezvous: str | None) -> None:
        import torch
        import torch.distributed as dist

        from k3rl.learner.trainer import Trainer

        if self.world_size > 1:
            backend = "nccl" if self.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{rendezvous}", rank=self.rank,
                                    world_size=self.world_size)
            if self.device == "cuda":
                torch.cuda.set_device(0)  # Ray gives each rank its own visible GPU
        self.trainer = Trainer.from_job(self.cfg, device=self.device)

    def sft(self, trajectories: list[Trajectory], steps: int) -> list[dict[str, float]]:
        out = []
        rng = random.Random(self.cfg.learner.seed)
        for _ in range(steps):
            # one RL batch worth of demonstrations per SFT step
            batch = rng.sample(trajectories, k=min(len(trajectories), self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size))
            out.append(self.trainer.sft_step(batch))
        self.trainer.reset_reference()  # the KL term anchors RL to the warm-started policy
        return out

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        return self.trainer.train_step(trajectories)

    # ----- weights to the engines (rollout.weight_transport) ------------------------------
    def _export(self, version: int, on_device: bool):
        import torch

        # ship in the engines' dtype (the fp32 allow-list stays fp32); collective: every rank gathers
        dtype = torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else None
        return self.trainer.export_weights(version, dtype=dtype, to_cpu=not on_device)

    def export_weights(self, version: int):
        """object_store: rank 0 puts the update into the object store itself and returns only
        the reference (the weights never pass through the driver or the pool actor)."""
        from k3rl.rollout.weight_sync import publish_here

        update = self._export(version, on_device=True)  # packed on the GPU, one copy to host
        return publish_here(update) if self.rank == 0 else None

    def join_weight_sync(self, address: str, world_size: int) -> None:
        """nccl: rank 0 becomes rank 0 (the sender) of a broadcast group with the engines."""
        from k3rl.rollout.weight_sync import CollectiveWeightSync

        if self.rank != 0:
            return
        if self.weight_sync is not None:
            self.weight_sync.close()
        host, port = address.rsplit(":", 1)
        backend = "nccl" if self.device == "cuda" else "gloo"
        self.weight_sync = CollectiveWeightSync(0, world_size, host, int(port), backend, self.device,
                                                timeout_s=self.cfg.rollout.weight_sync_timeout_s)

    def send_weights(self, version: int) -> dict[str, float]:
        """nccl: broadcast the update (the engines receive it at the same time)."""
        update = self._export(version, on_device=self.device == "cuda")
        if self.rank != 0:
            return {}
        t = self.weight_sync.send(update)
        return {"weight_sync/bytes": t["bytes"], "weight_sync/wait_for_engines_s": t["wait_s"],
                "weight_sync/broadcast_s": t["transfer_s"],
                "weight_sync/broadcast_gbps": t["bytes"] / max(t["transfer_s"], 1e-9) / 1e9}

    def share_weights(self, version: int):
        """cuda_ipc: handles to the update in this GPU's memory; kept alive until the next one."""
        from k3rl.rollout.weight_sync import share_cuda_ipc

        update = self._export(version, on_device=True)
        if self.rank != 0:
            return None
        if self.ipc_share is not None:
            self.ipc_share.release()  # the engines copied the previous one out before it was replaced
        self.ipc_share = share_cuda_ipc(update, "cuda")
        return self.ipc_share

    def logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        return self.trainer.logprobs(trajectories)

    def save(self, step: int, extra: dict[str, Any]) -> str:
        path = self.run_dir / "checkpoints" / f"step-{step:06d}"
        self.trainer.data_state = dict(extra)
        self.trainer.save_checkpoint(path)  # collective under FSDP
        if self.rank != 0:
            return str(path)
        tmp = self.run_dir / "checkpoints" / "latest.tmp"
        tmp.write_text(path.name)
        tmp.replace(self.run_dir / "checkpoints" / "latest")  # atomic: never points at a half-written step
        return str(path)

    def load(self, path: str) -> dict[str, Any]:
        self.trainer.load_checkpoint(path)
        return {"step": self.trainer.step, **self.trainer.data_state}


class LearnerGroup:
    """The learner's ranks as one object: a call goes to every rank with the same arguments (the
    trainer's data-parallel contract: each rank sees the full batch) and returns rank 0's answer."""

    def __init__(self, cfg: JobConfig, run_dir: Path) -> None:
        import ray

        ranks = cfg.learner.world_size if cfg.learner.data_parallel == "fsdp" else 1
        gpus = cfg.learner.gpus / ranks  # learner.gpus is the learner's total
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(LearnerActor)
        self.actors = [actor.remote(cfg.to_dict(), str(run_dir), r, ranks) for r in range(ranks)]

    async def start(self) -> None:
        address = await self.actors[0].rendezvous_address.remote() if len(self.actors) > 1 else None
        await asyncio.gather(*(a.setup.remote(address) for a in self.actors))

    async def call(self, method: str, *args: Any) -> Any:
        import ray

        refs = [ray.put(a) for a in args]  # one copy in the object store, shared by the ranks
        answers = await asyncio.gather(*(getattr(a, method).remote(*refs) for a in self.actors))
        return answers[0]


class WeightSync:
    """Brings the engines to the learner's weights of a version, by `rollout.weight_transport`:

    * object_store: rank 0 puts the packed update into Ray's object store once and the
      reference goes to the pool; every engine reads it (restarted engines are replayed it);
    * nccl: the learner's rank 0 and the engines form a broadcast group of their own (NCCL on
      GPUs, gloo on CPUs) and the buckets go GPU to GPU; the group is formed again, on a new
      port, at the first sync after an engine restart (until then the restarted engine, behind,
      is routed to only when no up-to-date engine is alive);
    * cuda_ipc: rank 0 packs the update in its GPU memory and the engines copy it out through
      CUDA IPC handles (engines sharing the learner's GPU)."""

    def __init__(self, cfg: JobConfig, learner: LearnerGroup, pool) -> None:
        self.transport = cfg.rollout.weight_transport
        self.world = cfg.rollout.num_inference_workers + 1
        self.backend = "nccl" if cfg.learner.gpus > 0 else "gloo"
        self.learner, self.pool = learner, pool

    async def _form_group(self) -> None:
        address = await self.learner.actors[0].rendezvous_address.remote()
        host, port = address.rsplit(":", 1)
        await asyncio.gather(self.learner.call("join_weight_sync", address, self.world),
                             self.pool.join_collective.remote(host, int(port), self.backend))

    async def __call__(self, version: int) -> dict[str, float]:
        if self.transport == "nccl":
            return await self._broadcast(version)
        if self.transport == "cuda_ipc":
            await self.pool.update_weights.remote(await self.learner.call("share_weights", version))
            return {}
        await self._through_object_store(version)
        return {}

    async def _through_object_store(self, version: int) -> None:
        await self.pool.update_weights.remote(await self.learner.call("export_weights", version))

    async def _broadcast(self, version: int) -> dict[str, float]:
        """One broadcast; if it fails (an engine died, the group timed out), the same version goes
        through the object store, which also restarts and replays dead engines, and the group is
        formed again at the next sync. Nothing is lost and the job goes on."""
        if not await self.pool.collective_intact.remote():
            await self._form_group()
        sent, received = await asyncio.gather(self.learner.call("send_weights", version),
                                              self.pool.receive_collective_update.remote(), return_exceptions=True)
        failure = next((r for r in (sent, received) if isinstance(r, BaseException)), None)
        if failure is None:
            return sent
        console.log(f"[yellow]weight broadcast of v{version} failed ({type(failure).__name__}: "
                    f"{str(failure).splitlines()[0][:200]}); sending it through the object store instead")
        await self.pool.drop_collective.remote()
        await self._through_object_store(version)
        return {"weight_sync/fallbacks": 1.0}


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / "checkpoints" / "latest"
    if marker.exists():
        p = run_dir / "checkpoints" / marker.read_text().strip()
        if p.exists():
            return p
    return None


# --------------------------------------------------------------------------------------
# Episode issuing and worker supervision
# --------------------------------------------------------------------------------------
def episode_specs(cfg: JobConfig, run_name: str, group_index: int, version: int) -> list[dict[str, Any]]:
    """The group_size specs of one prompt group. Ids and seeds depend only on the group index."""
    rng = random.Random(f"{cfg.learner.seed}:{group_index}")
    envs = cfg.envs.train
    env = rng.choices(envs, weights=[e.weight for e in envs])[0]
    seed = rng.randrange(2**31)
    gid = f"{run_name}-g{group_index:07d}"
    return [
        {"id": f"{gid}-s{k}", "env_id": env.id, "seed": seed, "group_id": gid, "env_kwargs": dict(env.kwargs),
         "issued_version": version}
        for k in range(cfg.rollout.group_size)
    ]


class WorkerSupervisor:
    """Submits episodes to rollout workers; restarts a dead worker and re-submits its episodes."""

    def __init__(self, make_worker, n: int) -> None:
        self.make_worker = make_worker
        self.workers = [make_worker(i) for i in range(n)]
        self.outstanding: dict[int, int] = dict.fromkeys(range(n), 0)
        self.tasks: set[asyncio.Task] = set()
        self.restarts = 0
        self.done: list[dict[str, Any]] = []

    def submit(self, spec: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._run(spec))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, spec: dict[str, Any]) -> None:
        import ray

        attempts = 0
        while True:
            i = min(self.outstanding, key=self.outstanding.get)
            worker = self.workers[i]
            self.outstanding[i] += 1
            try:
                summary = await worker.run_episode.remote(spec)
                self.done.append(summary)
                return
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                attempts += 1
                if self.workers[i] is worker:  # first to notice: replace the worker
                    console.log(f"[yellow]rollout worker {i} died ({type(e).__name__}); restarting it and re-running its episodes")
                    self.workers[i] = self.make_worker(i)
                    self.restarts += 1
                if attempts > 5:
                    raise RuntimeError(f"episode {spec['id']} failed on 5 restarted workers") from e
            finally:
                self.outstanding[i] -= 1

    def kill(self, i: int) -> None:
        import ray

        ray.kill(self.workers[i], no_restart=True)

    async def drain(self) -> None:
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------
def rollout_metrics(trajs: list[Trajectory], version: int) -> dict[str, float]:
    m: dict[str, float] = {}
    rewards = [t.reward for t in trajs]
    m["reward/mean"] = sum(rewards) / len(rewards)
    m["reward/std"] = math.sqrt(sum((r - m["reward/mean"]) ** 2 for r in rewards) / len(rewards))
    m["episodes/success_rate"] = sum(1 for t in trajs if t.reward >= 1.0 - 1e-6) / len(trajs)
    m["episodes/error_rate"] = sum(1 for t in trajs if t.error) / len(trajs)
    m["episodes/turns"] = sum(t.num_turns for t in trajs) / len(trajs)
    m["episodes/tokens"] = sum(len(t.token_ids) for t in trajs) / len(trajs)
    m["episodes/generated_tokens"] = sum(t.num_generated for t in trajs) / len(trajs)
    gen_versions = [v for t in trajs for v, mk in zip(t.versions, t.loss_mask, strict=True) if mk]
    if gen_versions:
        m["staleness/mean"] = sum(version - v for v in gen_versions) / len(gen_versions)
        m["staleness/max"] = float(max(version - v for v in gen_versions))
    by_env: dict[str, list[float]] = {}
    for t in trajs:
        by_env.setdefault(t.env_id, []).append(t.reward)
    for env_id, rs in by_env.items():
        name = env_id.replace("/", "_")
        mean = sum(rs) / len(rs)
        m[f"reward/{name}/mean"] = mean
        m[f"reward/{name}/std"] = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
    return m


def _table(step: int, total: int, m: dict[str, float], extra: dict[str, Any]) -> Table:
    t = Table(title=f"k3rl train — step {step}/{total}", show_header=True, header_style="bold")
    for col in ("reward", "success", "turns", "gen tok/s", "train tok/s", "staleness", "sync s", "loss", "restarts"):
        t.add_column(col, justify="right")
    t.add_row(
        f"{m.get('reward/mean', float('nan')):.3f}", f"{m.get('episodes/success_rate', float('nan')):.2f}",
        f"{m.get('episodes/turns', float('nan')):.2f}", f"{m.get('throughput/rollout_tokens_per_s', 0):.0f}",
        f"{m.get('throughput/train_tokens_per_s', 0):.0f}", f"{m.get('staleness/mean', 0):.2f}",
        f"{m.get('time/weight_sync_s', 0):.2f}", f"{m.get('loss', float('nan')):.4f}",
        str(extra.get("restarts", 0)),
    )
    return t


# --------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------
def init_ray(cfg: JobConfig) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=False)
    else:
        # address="local": always a fresh local Ray, never a cluster that happens to run here
        ray.init(address="local", num_cpus=cfg.ray.num_cpus or max(4, os.cpu_count() or 1), namespace=cfg.ray.namespace,
                 include_dashboard=cfg.ray.include_dashboard, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", **_forwarded_env()}})


def _forwarded_env() -> dict[str, str]:
    """Communication settings the actors must share with the driver (NCCL_NVLS_ENABLE=0 and its
    relatives keep NVLink multicast off on shared GPU hosts; a worker without them would not)."""
    prefixes = ("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_", "TORCH_NCCL_")
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def run_job(cfg: JobConfig, resume: bool = False, *, kill_worker_at_step: int | None = None,
            kill_engine_at_step: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run (or with `resume`, continue) the job. `kill_worker_at_step` / `kill_engine_at_step` kill
    rollout worker 0 / inference engine 0 after that step's training (the failure tests)."""
    return asyncio.run(_run_job(cfg, resume=resume, kill_worker_at_step=kill_worker_at_step,
                                kill_engine_at_step=kill_engine_at_step, quiet=quiet))


async def _run_job(cfg: JobConfig, resume: bool, kill_worker_at_step: int | None, quiet: bool,
                   kill_engine_at_step: int | None = None) -> dict[str, Any]:
    import ray

    from k3rl.rollout.buffer import TrajectoryBuffer
    from k3rl.rollout.pool import EngineSpec, PoolActor
    from k3rl.rollout.worker import RolloutWorker
    from k3rl.tracking import Tracker

    run_name = cfg.tracking.run_name or cfg.name
    run_dir = Path(cfg.tracking.runs_dir) / run_name
    if run_dir.exists() and not resume and latest_checkpoint(run_dir) is not None:
        raise SystemExit(f"run directory {run_dir} already holds a run: pass --resume to continue it, "
                         f"or set tracking.run_name to start a new one")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.yaml")
    meta_file = run_dir / "run.json"
    meta = json.loads(meta_file.read_text()) if (resume and meta_file.exists()) else {}

    init_ray(cfg)
    tracker = Tracker(uri=cfg.tracking.uri, experiment=cfg.tracking.experiment, run_name=run_name,
                      run_id=meta.get("mlflow_run_id"), run_dir=run_dir)
    meta["mlflow_run_id"] = tracker.run_id
    meta_file.write_text(json.dumps(meta))
    if not meta.get("params_logged"):
        tracker.log_params(cfg.flat())
        tracker.log_artifact_file(str(run_dir / "config.yaml"))
        meta["params_logged"] = True
        meta_file.write_text(json.dumps(meta))

    cfg_dict = cfg.to_dict()
    learner = LearnerGroup(cfg, run_dir)
    await learner.start()
    start_step = 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state = await learner.call("load", str(ckpt))
        start_step = int(state.get("step", 0))
        console.log(f"resumed from {ckpt} at step {start_step}")
    elif resume:
        console.log(f"[yellow]--resume: no checkpoint in {run_dir}, starting from scratch")

    # Policy versions: the weights after `step` RL steps are version step + 1. Version 0 is the
    # engines' own seeded init (the same init as the learner's); it serves only the optional
    # evaluation of the untrained policy below.
    spec = EngineSpec(kind=cfg.rollout.engine, preset=cfg.model.preset, overrides=cfg.model.overrides,
                      checkpoint=cfg.model.checkpoint, dtype=cfg.model.dtype,
                      device="cuda" if cfg.rollout.gpus_per_inference_worker > 0 else "cpu", seed=cfg.model.seed,
                      engine_kwargs={"max_num_seqs": cfg.rollout.max_batch_sequences})
    pool = PoolActor.options(num_cpus=0, max_concurrency=10_000).remote(
        cfg.rollout.num_inference_workers, spec,
        actor_options={"num_cpus": 1, "num_gpus": cfg.rollout.gpus_per_inference_worker, "max_concurrency": 10_000})
    await pool.wait_ready.remote()
    buffer = ray.remote(num_cpus=0, max_concurrency=1000)(TrajectoryBuffer).remote(
        cfg.rollout.group_size, store_dir=str(run_dir))

    def make_worker(i: int):
        return ray.remote(num_cpus=0, max_concurrency=cfg.rollout.episodes_per_worker, max_restarts=0)(
            RolloutWorker).remote(cfg_dict, pool, buffer, i)

    sup = WorkerSupervisor(make_worker, cfg.rollout.num_rollout_workers)
    P = cfg.rollout.prompts_per_step

    if ckpt is None and cfg.learner.eval_before_training:
        # the untrained policy on one batch of prompts: the reward curve's step 0
        for g in range(P):
            for spec_ in episode_specs(cfg, f"{run_name}-eval", g, 0):
                sup.submit(spec_)
        groups = await buffer.get_groups.remote(P, None, -1)
        m0 = rollout_metrics([t for grp in groups for t in grp], 0)
        tracker.log_metrics(m0, step=0)
        console.log(f"untrained policy: reward {m0['reward/mean']:.3f} success {m0['episodes/success_rate']:.2f}")

    # SFT warm start on oracle demonstrations (only for a fresh run).
    if cfg.learner.sft_steps > 0 and ckpt is None:
        demos = await asyncio.to_thread(collect_demonstrations, cfg, run_name)
        sft_metrics = await learner.call("sft", demos, cfg.learner.sft_steps)
        for i, m in enumerate(sft_metrics):
            tracker.log_metrics({f"sft/{k}": v for k, v in m.items()}, step=i)
        console.log(f"SFT warm start: {len(demos)} oracle episodes, {cfg.learner.sft_steps} steps, "
                    f"loss {sft_metrics[0].get('loss', float('nan')):.3f} -> {sft_metrics[-1].get('loss', float('nan')):.3f}")

    sync = WeightSync(cfg, learner, pool)
    await sync(start_step + 1)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    except (NotImplementedError, RuntimeError):  # not the main thread
        pass

    lag = cfg.rollout.max_policy_lag
    issued = start_step * P  # groups consumed before a resume are not re-issued
    version = start_step

    def issue() -> None:
        nonlocal issued
        while issued < (version + 1 + lag) * P:
            for spec in episode_specs(cfg, run_name, issued, version):
                sup.submit(spec)
            issued += 1

    history: list[dict[str, float]] = []
    step = start_step
    completed = False
    t_job = time.monotonic()
    live = Live(_table(step, cfg.learner.steps, {}, {}), console=console, refresh_per_second=2, transient=False)
    use_live = not quiet and console.is_terminal
    with live if use_live else contextlib.nullcontext():
        issue()
        while step < cfg.learner.steps and not stop.is_set():
            t0 = time.monotonic()
            get = asyncio.ensure_future(buffer.get_groups.remote(P, None, step))
            waiter = asyncio.ensure_future(stop.wait())
            await asyncio.wait({get, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                break
            waiter.cancel()
            groups = get.result()
            trajs = [t for g in groups for t in g]
            t_wait = time.monotonic() - t0
            m = rollout_metrics(trajs, version + 1)
            t1 = time.monotonic()
            train_m = await learner.call("train_step", trajs)
            t_train = time.monotonic() - t1
            m.update(train_m)
            version = step + 1
            if kill_engine_at_step is not None and step + 1 == kill_engine_at_step:
                ray.kill((await pool.worker_handles.remote())[0], no_restart=True)
            t2 = time.monotonic()
            m.update(await sync(version + 1))
            m["time/weight_sync_s"] = time.monotonic() - t2
            m["time/wait_for_rollouts_s"] = t_wait
            m["time/train_s"] = t_train
            m["time/step_s"] = time.monotonic() - t0
            m["learner/idle_fraction"] = t_wait / max(m["time/step_s"], 1e-9)
            gen = sum(t.num_generated for t in trajs)
            m["throughput/rollout_tokens_per_s"] = gen / max(m["time/step_s"], 1e-9)
            m["throughput/train_tokens_per_s"] = sum(len(t.token_ids) for t in trajs) / max(t_train, 1e-9)
            m["throughput/episodes_per_s"] = len(trajs) / max(m["time/step_s"], 1e-9)
            m["workers/restarts"] = float(sup.restarts)
            step += 1
            issue()
            history.append(m)
            tracker.log_metrics(m, step=step)
            if cfg.tracking.sample_episodes and (step % (5 * cfg.tracking.log_every) == 0 or step == cfg.learner.steps):
                for t in sorted(trajs, key=lambda t: -t.reward)[: cfg.tracking.sample_episodes]:
                    tracker.log_episode_html(t, step=step)
            if use_live:
                live.update(_table(step, cfg.learner.steps, m, {"restarts": sup.restarts}))
            elif not quiet:  # logs and CI: one line per step
                console.log(f"step {step}: reward {m['reward/mean']:.3f} success {m['episodes/success_rate']:.2f} "
                            f"loss {m.get('loss', float('nan')):.4f} staleness {m.get('staleness/mean', 0):.2f}")
            if cfg.learner.checkpoint_every and step % cfg.learner.checkpoint_every == 0:
                await learner.call("save", step, {"groups_issued": step * P})
            if kill_worker_at_step is not None and step == kill_worker_at_step:
                sup.kill(0)
        completed = step >= cfg.learner.steps

    # graceful end (normal or Ctrl-C): checkpoint, stop issuing, flush the store
    await learner.call("save", step, {"groups_issued": step * P})
    for task in list(sup.tasks):
        task.cancel()
    await buffer.flush.remote()
    stats = await buffer.get_stats.remote()
    tracker.log_reward_curve_png()
    tracker.finish("FINISHED" if completed else "KILLED")
    await pool.shutdown.remote()
    ray.kill(pool)
    summary = {
        "completed": completed, "steps": step, "run_dir": str(run_dir), "mlflow_run_id": tracker.run_id,
        "history": history, "buffer": stats, "restarts": sup.restarts, "seconds": time.monotonic() - t_job,
    }
    (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1))
    if not quiet:
        console.print(f"\n[bold]done[/]: {step} steps in {summary['seconds']:.0f}s; run dir {run_dir}")
        console.print(f"  MLflow UI:   k3rl ui --tracking-uri {cfg.tracking.uri}")
        console.print(f"  reward plot: k3rl compare {run_name} --tracking-uri {cfg.tracking.uri}")
        console.print(f"  episodes:    k3rl replay {run_dir} --html {run_dir}/episode.html")
    return summary


def collect_demonstrations(cfg: JobConfig, run_name: str) -> list[Trajectory]:
    """Oracle episodes through the same agent loop (tokens exactly as the template renders them)."""
    from k3rl.rollout.agent import EpisodeSpec, run_episode
    from k3rl.rollout.worker import make_env, make_template
    from k3rl.types import SamplingParams

    template = make_template(cfg)
    out: list[Trajectory] = []

    async def one(i: int) -> Trajectory:
        spec = EpisodeSpec(**{k: v for k, v in episode_specs(cfg, f"{run_name}-demo", i, 0)[0].items()})
        env = make_env(spec, cfg, template)
        oracle = env.oracle if hasattr(env, "oracle") else None
        if oracle is None:
            raise RuntimeError(f"{spec.env_id} has no oracle policy; set learner.sft_steps=0")
        from types import SimpleNamespace

        from k3rl.envs.actions import encode_with_specials

        async def generate(token_ids, sampling, images=None, key=None, **kw):
            ids = encode_with_specials(template, oracle())
            return SimpleNamespace(token_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason="stop")

        return await run_episode(env, spec, generate, template, SamplingParams(max_tokens=10_000),
                                 max_turns=cfg.envs.max_turns, max_context_tokens=cfg.rollout.max_context_tokens)

    async def all_():
        for i in range(cfg.learner.sft_episodes):
            t = await one(i)
            if t.error:
                raise RuntimeError(f"oracle episode {t.id} failed: {t.error}")
            out.append(t)

    asyncio.run(all_())
    return out
