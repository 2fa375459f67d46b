"""Teachers served by engines of their own: on-policy distillation's scoring, beside the inference pool.

Each `learner.distill.teachers[i]` with `engines: n > 0` runs as n `TeacherEngine` Ray actors, each
holding the teacher's checkpoint (`build_model(..., checkpoint=)`, the engines' dtype). Before each
training step the driver hands the step's batch, an ObjectRef (the tokens never pass through the
driver), to `TeacherGroup.score`:

    ref, metrics = await teachers.score(ref)      # then: learner.call("train_step", ref)

Every engine of teacher i fetches the batch and scores its share of the episodes teacher i takes
(`learner.distill.teacher_index`; the shares balanced by tokens) with the learner's own log-prob
code (`learner.distill.score`: packed micro-batches, segment by segment, images), so log T is what
the learner would compute itself. A Ray task then attaches each episode's log T to it,
`metadata["teacher_logprobs"]`, and returns the new batch by reference; the learner uses those
scores instead of loading the teacher (learner/distill.py). Teachers with `engines: 0` are not
started here: the learner loads and scores them in its own process.

Failures: an engine that dies (or fails to build its model) is an error naming the teacher's
checkpoint; the job then ends and releases everything. `shutdown()` kills every engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from k3rl.cluster import teacher_request
from k3rl.config import JobConfig
from k3rl.learner.distill import TEACHER_LOGPROBS, score, teacher_index
from k3rl.model import build_model
from k3rl.types import Trajectory


class TeacherError(RuntimeError):
    """A teacher's engine died or failed; the message names the teacher's checkpoint."""


def share(batch: list[Trajectory], teachers: list, index: int, engine: int, engines: int) -> list[int]:
    """The batch positions engine `engine` of `engines` of teacher `index` scores: the episodes that teacher
    takes, dealt longest first to the engine with the fewest tokens so far (the same deal on every engine)."""
    mine = [k for k, t in enumerate(batch) if teacher_index(t.env_id, teachers) == index]
    loads, dealt = [0] * engines, [[] for _ in range(engines)]
    for k in sorted(mine, key=lambda k: -len(batch[k].token_ids)):
        e = min(range(engines), key=loads.__getitem__)
        dealt[e].append(k)
        loads[e] += len(batch[k].token_ids)
    return sorted(dealt[engine])


class TeacherEngine:
    """One engine of one teacher (a Ray actor): the teacher's model, scoring its share of each batch."""

    def __init__(self, cfg: dict[str, Any], index: int, engine: int) -> None:

        self.cfg = JobConfig.model_validate(cfg)
        self.teachers = self.cfg.learner.distill.teachers
        self.index, self.engine = index, engine
        spec = self.teachers[index]
        device = "cuda" if spec.gpus_per_engine > 0 else "cpu"
        if device == "cpu":
            torch.set_num_threads(1)  # like the inference engines: one thread each is fastest for small models
        self.model = build_model(spec.preset, spec.overrides, dtype=self.cfg.model.dtype, device=device,
                                 checkpoint=spec.checkpoint).eval()

    def ping(self) -> bool:
        return True

    def score(self, batch: list[Trajectory]) -> dict[int, list[float]]:
        """log T of every completion token of this engine's share, {batch position: [len(completion_ids)]}
        (0 where loss_mask is 0)."""
        mine = share(batch, self.teachers, self.index, self.engine, self.teachers[self.index].engines)
        if not mine:
            return {}
        scored = score(self.model, [batch[k] for k in mine], self.cfg.learner.micro_batch_tokens,
                       self.cfg.rollout.sampling.policy_temperature)  # the student's policy temperature
        return {k: log_t.tolist() for k, log_t in zip(mine, scored, strict=True)}


def _attach(batch: list[Trajectory], parts: list[tuple[str, Any]]) -> tuple[dict[str, float], list[Trajectory]]:
    """(a Ray task) Each engine's scores into the episodes' metadata. `parts`: (who, ObjectRef of its
    scores), nested in a list so that Ray hands the refs over unresolved and each failure is named."""
    scored = 0
    for who, ref in parts:
        try:
            scores = ray.get(ref)
        except RayActorError as e:
            raise TeacherError(f"{who} died while scoring the step's episodes: {e}") from None
        except RayTaskError as e:
            raise TeacherError(f"{who} failed while scoring the step's episodes: {e}") from None
        for k, log_t in scores.items():
            batch[k].metadata[TEACHER_LOGPROBS] = log_t
        scored += len(scores)
    return {"distill/episodes_scored": float(scored)}, batch


_attach_task = ray.remote(num_cpus=0, max_retries=0, num_returns=2)(_attach)


class TeacherGroup:
    """The engines of every teacher with `engines > 0` (none: `score` hands the batch back as it is)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.names: list[str] = []  # per engine: "teacher i (checkpoint) engine j"
        self.engines = []
        for i, spec in enumerate(cfg.learner.distill.teachers):
            actor = ray.remote(**teacher_request(cfg, i).options(), max_restarts=0)(TeacherEngine)
            for j in range(spec.engines):
                self.names.append(f"learner.distill.teachers.{i} ({spec.checkpoint}) engine {j}")
                self.engines.append(actor.remote(cfg.to_dict(), i, j))

    async def wait_ready(self) -> None:
        """Every engine has built its teacher's model; an engine that could not is named with its error."""
        async def ready(name: str, engine) -> None:
            try:
                await engine.ping.remote()
            except RayActorError as e:
                raise TeacherError(f"{name} did not start: {e}") from None

        await asyncio.gather(*(ready(n, e) for n, e in zip(self.names, self.engines, strict=True)))

    async def score(self, batch_ref) -> tuple[Any, dict[str, float]]:
        """(the batch with every served teacher's log T attached, by reference; metrics). The driver waits
        for the small metrics only; the scored batch goes from the object store to the learner ranks."""
        if not self.engines:
            return batch_ref, {}
        t = time.monotonic()
        parts = [(name, engine.score.remote(batch_ref)) for name, engine in zip(self.names, self.engines, strict=True)]
        metrics_ref, scored_ref = _attach_task.remote(batch_ref, parts)
        try:
            metrics = await metrics_ref
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, TeacherError) else TeacherError(str(e))) from None
        return scored_ref, {**metrics, "time/teacher_s": time.monotonic() - t}

    def shutdown(self) -> None:
        """Kill every engine. Idempotent; never raises."""
        engines, self.engines = self.engines, []
        for e in engines:
            with contextlib.suppress(Exception):
                ray.kill(e, no_restart=True)
