"""The learner as Ray actors: `LearnerActor` is one rank (the model or its FSDP / expert shard,
the optimizer, the checkpoints and, on rank 0, the send half of the weight transport);
`LearnerGroup` is the ranks as one object, which is what the driver holds.

    group = LearnerGroup(cfg, run_dir, pool)        # pool: the PoolActor handle
    await group.start()                             # process group, trainers, transport
    metrics = await group.call("train_step", ref)   # same call on every rank, rank 0's answer
    report = await group.push_weights(version)      # every engine of the pool runs `version`
    await group.call("save", step, data_state)
    group.shutdown()

Every rank sees the same full batch (the trainer's data-parallel contract) and trains on its
share of the micro-batches; collectives (FSDP gathers, the weight export, checkpoints) need
every rank, which is why every call goes to all of them.

Checkpoints: `checkpoints/step-000012/` holds what `Trainer.save_checkpoint` writes, and
`checkpoints/latest` names the newest complete one. A save writes into
`checkpoints/.step-000012.tmp`; once every rank is done, rank 0 fsyncs every file, writes the
manifest `complete.json` (each file's size) last and fsyncs it and the directories, renames the
directory to `step-000012`, fsyncs `checkpoints/`, and only then replaces `latest` (written aside,
fsync'd, then `os.replace`): a crash at any point, of the process or the machine, leaves the
previous complete step, and the next save removes the leftovers. `latest_checkpoint` (what
`--resume` loads) still checks the newest `step-*` against its manifest and falls back, with a
warning, to the newest one that is complete (a disk that lost writes despite the fsyncs, a copy
cut short); a save over a torn `step-*` replaces it. Under FSDP the ranks must share the run
directory's filesystem.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from k3rl.cluster import free_port, learner_request, rendezvous_host
from k3rl.config import JobConfig
from k3rl.learner.free_cores import FreeCores
from k3rl.learner.trainer import Trainer
from k3rl.rollout.transport import make_transport
from k3rl.store import fsync_dir, fsync_file
from k3rl.types import Trajectory

MANIFEST = "complete.json"  # written last into a checkpoint: {file: size}; a complete checkpoint has it


class CheckpointError(RuntimeError):
    """A run whose checkpoints cannot be resumed."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def trim_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim). Each step's batch has other
    shapes, so its freed CPU tensors leave holes below live blocks that free() cannot return: resident
    memory would keep the largest step's high-water mark, and a soak could not tell it from a leak."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "malloc_trim") and libc.malloc_trim(0))


def seal_checkpoint(directory: str | Path) -> None:
    """Make a written checkpoint durable and mark it complete: fsync every file, write the manifest
    (every file's size) and fsync it, then fsync the directories, deepest first. Call it before the
    rename that publishes the checkpoint."""
    d = Path(directory)
    files = sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST)
    for p in files:
        fsync_file(p)
    manifest = d / MANIFEST
    manifest.write_text(json.dumps({str(p.relative_to(d)): p.stat().st_size for p in files}, indent=1) + "\n")
    fsync_file(manifest)
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    fsync_dir(d)


def checkpoint_problem(directory: str | Path) -> str | None:
    """What is wrong with a checkpoint (None when it is complete): no or an unreadable manifest, a
    file it lists missing or of another size than was written, or a trainer.json that does not parse."""
    d = Path(directory)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return f"it has no {MANIFEST} (written last by a save: the save did not finish)"
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(manifest, dict) or "trainer.json" not in manifest:
        return f"its {MANIFEST} does not list the checkpoint's files"
    for name, size in manifest.items():
        p = d / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes where {size} were written"
    try:
        json.loads((d / "trainer.json").read_text())
    except (OSError, ValueError) as e:
        return f"trainer.json does not parse ({type(e).__name__}: {e})"
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (None when it has no `step-*`): the highest `step-*`
    directory that `checkpoint_problem` passes; newer, torn ones are skipped with a warning that
    says what is wrong with them. `latest` names the same one, except after a save interrupted
    between its rename and `latest`'s move. Raises CheckpointError when every `step-*` is torn."""
    torn = []
    for p in sorted((p for p in (Path(run_dir) / "checkpoints").glob("step-*") if p.is_dir()), reverse=True):
        problem = checkpoint_problem(p)
        if problem is None:
            if torn:
                warnings.warn(f"resuming from {p}, not from the newer checkpoints that are torn: " + "; ".join(torn),
                              stacklevel=2)
            return p
        torn.append(f"{p.name}: {problem}")
    if torn:
        raise CheckpointError(f"no checkpoint of {run_dir} is complete ({'; '.join(torn)}). Start a new run (another "
                              "tracking.run_name), or, for a checkpoint written before k3rl sealed them that you "
                              f"know is whole, seal it: python -c \"from k3rl.learner.actor import seal_checkpoint; "
                              f"seal_checkpoint('{run_dir}/checkpoints/step-NNNNNN')\"")
    return None


class LearnerActor:
    """One rank of the learner, in its own Ray process. `setup` joins the ranks' process group
    and builds the trainer; every other method is called on all ranks with the same arguments."""

    def __init__(self, cfg: dict[str, Any], run_dir: str, rank: int = 0, world_size: int = 1, pool=None) -> None:
        torch.set_num_threads(max(1, int(os.environ.get("K3RL_LEARNER_THREADS", "1"))))
        self.cfg = JobConfig.model_validate(cfg)
        self.run_dir = Path(run_dir)
        self.rank, self.world_size = rank, world_size
        self._sft_rng, self._sft_next = None, 0  # the warm start's draws (made at its step 0), its next step
        self.pool = pool  # the PoolActor the weights go to (used by rank 0)
        self.device = "cuda" if self.cfg.learner.gpus > 0 and torch.cuda.is_available() else "cpu"
        self.trainer = None
        self.transport = None  # rank 0: the send half of rollout.weight_transport

    def rendezvous_address(self) -> str:
        """A free host:port on this (rank 0's) node for the ranks' process group store."""
        host = rendezvous_host(bool(self.cfg.ray.address))
        return f"{host}:{free_port(host)}"

    def setup(self, rendezvous: str | None) -> None:

        if self.world_size > 1:
            backend = "nccl" if self.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{rendezvous}", rank=self.rank,
                                    world_size=self.world_size)
            if self.device == "cuda":
                torch.cuda.set_device(0)  # Ray gives each rank its own visible GPU
        self.trainer = Trainer.from_job(self.cfg, device=self.device)
        if self.rank == 0:
            self.transport = make_transport(self.cfg, self.device)

    # ----- training -----------------------------------------------------------------------------
    def sft(self, demo_sets: list[list[Trajectory]], steps: int, start: int = 0) -> list[dict[str, float]]:
        """SFT steps start .. start + steps - 1, each on learner.sft_batch demonstrations (one RL batch unless
        set): of demo_sets[0], and from learner.sft_phases[k].from_step on of demo_sets[k + 1]. The driver
        calls it in pieces to show progress; the demonstrations drawn do not depend on the pieces (one RNG
        from step 0). After step learner.sft_steps - 1 the KL term's reference becomes the warm-started policy."""

        starts = [p.from_step for p in self.cfg.learner.sft_phases]
        if len(demo_sets) != len(starts) + 1:
            raise ValueError(f"sft: {len(demo_sets)} demonstration sets for {len(starts)} learner.sft_phases; "
                             "pass one set, then one per phase")
        if start == 0:
            self._sft_rng = random.Random(self.cfg.learner.seed)
        elif start != self._sft_next:
            raise ValueError(f"sft: asked to start at step {start}, but the warm start is at step "
                             f"{self._sft_next}; SFT steps run in order from 0")
        batch = self.cfg.learner.sft_batch or self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        out = []
        threads = torch.get_num_threads()
        # nothing of the job computes during the warm start: the cores the ranks share that no other process
        # uses, measured before each step (learner/free_cores.py: threads beside a busy core run slower than
        # one). K3RL_LEARNER_THREADS fixes the count instead: the same count every step, the same bits every run
        adapt = self.device == "cpu" and "K3RL_LEARNER_THREADS" not in os.environ
        free = FreeCores(len(os.sched_getaffinity(0)) // self.world_size) if adapt else None
        try:
            for i in range(start, start + steps):
                if free is not None:
                    torch.set_num_threads(max(threads, free.threads()))
                demos = demo_sets[sum(i >= s for s in starts)]
                out.append(self.trainer.sft_step(self._sft_rng.sample(demos, k=min(len(demos), batch))))
        finally:
            torch.set_num_threads(threads)
        self._sft_next = start + steps
        if self._sft_next >= self.cfg.learner.sft_steps:
            self.trainer.reset_reference()  # collective under FSDP
        return out

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        metrics = self.trainer.train_step(trajectories)
        trim_heap()
        return metrics

    def logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        return self.trainer.logprobs(trajectories)

    def snapshot(self) -> None:
        self.trainer.snapshot()

    def restore(self, lr_scale: float) -> dict[str, float]:
        return self.trainer.restore(lr_scale)

    # ----- weights to the engines -----------------------------------------------------------------
    def push_weights(self, version: int) -> dict[str, float]:
        """Every rank exports the whole model (collective under FSDP), in the engines' dtype (the
        fp32 allow-list stays fp32) and where it is (packed on the GPU, if any); rank 0 sends it.
        With `learner.lora.sync: adapters` the update is the adapters alone (fp32), which is what
        the report's `weight_sync/bytes` then counts."""
        dtype = torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else None
        update = self.trainer.export_weights(version, dtype=dtype, to_cpu=False)
        if self.rank != 0:
            return {}
        if self.pool is None:
            raise RuntimeError("this learner has no inference pool to push weights to: pass the PoolActor "
                               "handle to LearnerGroup(cfg, run_dir, pool)")
        return self.transport.send(update, self.pool)

    # ----- checkpoints ----------------------------------------------------------------------------
    def save(self, step: int, data_state: dict[str, Any]) -> str:
        """Write checkpoint `step` atomically (see the module docstring); a step that already has
        a complete checkpoint is not written again. Returns its directory."""
        ckpts = self.run_dir / "checkpoints"
        final = ckpts / f"step-{step:06d}"
        if not final.is_dir() or checkpoint_problem(final) is not None:
            tmp = ckpts / f".{final.name}.tmp"
            if self.rank == 0:  # the leftovers of an interrupted save (before any rank writes: save's barrier)
                for stale in [*ckpts.glob(".step-*.tmp"), *([final] if final.is_dir() else [])]:  # and a torn step
                    shutil.rmtree(stale, ignore_errors=True)
            self.trainer.data_state = dict(data_state)
            self.trainer.save_checkpoint(tmp)  # collective: returns once every rank has written its part
            if self.rank == 0:
                seal_checkpoint(tmp)  # durable and marked complete before it gets its final name
                tmp.rename(final)
                fsync_dir(ckpts)
        if self.rank == 0:
            marker = ckpts / "latest.tmp"
            marker.write_text(final.name + "\n")
            fsync_file(marker)
            os.replace(marker, ckpts / "latest")
            fsync_dir(ckpts)
        return str(final)

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint; returns {"step": ..., **the data_state saved with it}."""
        self.trainer.load_checkpoint(path)
        return {"step": self.trainer.step, **self.trainer.data_state}


class LearnerGroup:
    """The learner's ranks as one object. The weight transport is chosen here, once, from
    `cfg.rollout.weight_transport` (its send half lives in rank 0)."""

    def __init__(self, cfg: JobConfig, run_dir: Path, pool) -> None:
        request = learner_request(cfg)
        ranks = request.count
        actor = ray.remote(**request.options(), max_restarts=0)(LearnerActor)
        self.actors = [actor.remote(cfg.to_dict(), str(run_dir), r, ranks, pool) for r in range(ranks)]

    async def start(self) -> None:
        """Ranks join their process group and build their trainers (and rank 0 the transport)."""
        address = await self.actors[0].rendezvous_address.remote() if len(self.actors) > 1 else None
        await asyncio.gather(*(a.setup.remote(address) for a in self.actors))

    async def call(self, method: str, *args: Any) -> Any:
        """`method(*args)` on every rank; rank 0's answer. An ObjectRef argument is passed as it
        is (each rank's Ray resolves it); the others are put into the object store once."""
        if len(self.actors) > 1:
            args = tuple(a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args)
        answers = await asyncio.gather(*(getattr(a, method).remote(*args) for a in self.actors))
        return answers[0]

    async def push_weights(self, version: int) -> dict[str, float]:
        """Bring every engine of the pool to the learner's weights as `version`. Returns the
        transport's report: weight_sync/seconds, /bytes, /fallbacks (1 when the update went
        through the object store after the transport failed) and transport-specific timings."""
        t0 = time.monotonic()
        report = await self.call("push_weights", version)
        return {**report, "weight_sync/seconds": time.monotonic() - t0}

    def shutdown(self) -> None:
        """Kill every rank (their process groups, transport groups and published weights go with
        them). Idempotent; never raises."""
        actors, self.actors = self.actors, []
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
