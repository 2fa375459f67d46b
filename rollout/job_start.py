"""What a job does with its envs before the first RL step: the start-of-job checks (`preflight`)
and the SFT warm start's oracle demonstrations (`collect_demonstrations`), both through the
episode loop with the job's limits."""

from __future__ import annotations

import asyncio
import functools
import random
import threading
import warnings
from pathlib import Path

from k3rl.chat import ChatTemplate
from k3rl.config import ConfigError, JobConfig
from k3rl.config.learner import SftPhase
from k3rl.envs.base import ToolEnv, registered_entry_point
from k3rl.envs.registration import import_env_modules
from k3rl.model import K3Config
from k3rl.model.factory import architecture_differences, model_config
from k3rl.rollout.episode import (
    EpisodeSpec,
    job_limits,
    make_env,
    make_template,
    open_session,
    oracle_episode,
    run_sync,
)
from k3rl.sandboxes import BackendUnavailableError, choose_backend
from k3rl.types import Trajectory

DEMONSTRATIONS_AT_ONCE = 8
PREFLIGHT_RESETS = 3  # seeds preflight tries an env's reset at before it refuses the job


class PreflightError(ConfigError):
    """A training env that cannot work with the job's limits; the message names the field to change."""


def preflight(cfg: JobConfig) -> None:
    """Start-of-job checks, in the driver before Ray starts. For every env of `envs.train`: it
    can be made and reset, and its first prompt (one seed) fits `rollout.max_context_tokens`;
    with an SFT warm start, its oracle plays an episode whose messages each fit
    `rollout.sampling.max_tokens_per_turn`. A `model.checkpoint` must exist and hold the
    architecture the config describes; so must each `learner.distill.teachers` checkpoint.
    Raises PreflightError naming the env or the field."""
    _check_checkpoint(cfg)
    _check_teachers(cfg)
    import_env_modules(cfg.envs.imports)
    _check_sandbox_backend(cfg)
    template = make_template(cfg)
    limit = cfg.rollout.max_context_tokens
    for e in cfg.envs.train:
        spec, n = _first_prompt(e, cfg, template)
        if n >= limit:
            raise PreflightError(f"{e.id}: the first prompt is {n} tokens, {'at' if n == limit else 'over'} "
                                 f"rollout.max_context_tokens={limit}; raise it or shorten the env's opening")
        if cfg.learner.sft_steps > 0:
            _check_oracle(spec, cfg, template)
            for i, phase in enumerate(cfg.learner.sft_phases):  # its kwargs reach the env: a typo fails here
                if phase.envs is not None and e.id not in phase.envs:
                    continue
                kwargs = phase.kwargs_for(e.id, e.kwargs)
                try:
                    _check_oracle(EpisodeSpec(id=f"preflight-{e.id}-phase{i}", env_id=e.id, seed=spec.seed,
                                              env_kwargs=kwargs), cfg, template)
                except Exception as err:  # noqa: BLE001 - the env's own error, named by the phase it came from
                    why = str(err) if isinstance(err, PreflightError) else f"{type(err).__name__}: {err}"
                    raise PreflightError(f"learner.sft_phases.{i}.env_kwargs: {e.id} with kwargs {kwargs} cannot "
                                         f"play an oracle episode: {why}") from err


def _first_prompt(e, cfg: JobConfig, template: ChatTemplate) -> tuple[EpisodeSpec, int]:
    """Make and reset env `e` at learner.seed; when that raises, at up to PREFLIGHT_RESETS - 1 more seeds (a
    transient failure does not refuse the job; a warning names it). Returns the spec of the seed that reset and
    its first prompt's length in tokens. Raises PreflightError when every reset raised, or when one does not
    return within envs.episode_time_budget_s (a hanging reset would hang the driver)."""
    budget = cfg.envs.episode_time_budget_s
    rng = random.Random(f"preflight:{cfg.learner.seed}")
    seeds = [cfg.learner.seed] + [rng.randrange(2**31) for _ in range(PREFLIGHT_RESETS - 1)]
    errors = []
    for seed in seeds:
        spec = EpisodeSpec(id=f"preflight-{e.id}", env_id=e.id, seed=seed, env_kwargs=dict(e.kwargs))
        done: list = []

        def reset(spec=spec, done=done) -> None:
            try:
                env = make_env(spec, cfg, template)
                try:
                    obs, _ = env.reset(seed=spec.seed)
                    # an agent env's prompts are its agent's to make (the endpoint refuses one past the context)
                    agent = getattr(env.unwrapped, "is_agent_env", False)
                    done.append(0 if agent else len(open_session(template, env, obs)[0].rendered))
                finally:
                    env.close()
            except Exception as err:  # noqa: BLE001 - reported below, by seed
                done.append(err)

        worker = threading.Thread(target=reset, name=f"preflight-{e.id}", daemon=True)
        worker.start()
        worker.join(budget)
        if not done:
            raise PreflightError(f"{e.id} (kwargs {dict(e.kwargs)}): making and resetting it at seed {seed} did not "
                                 f"return within envs.episode_time_budget_s={budget:g}s; its reset hangs (a sandbox "
                                 f"that never starts, a service that never answers?)")
        if not isinstance(done[0], Exception):
            if errors:
                warnings.warn(f"{e.id}: reset failed at {'; '.join(errors)}, then worked at seed {seed}: a flaky env "
                              f"(its failed episodes are stored as failed, never trained)", stacklevel=3)
            return spec, done[0]
        errors.append(f"seed {seed}: {type(done[0]).__name__}: {done[0]}")
    raise PreflightError(f"{e.id} (kwargs {dict(e.kwargs)}) cannot be made and reset at {len(seeds)} seeds "
                         f"({'; '.join(errors)})")


def _check_sandbox_backend(cfg: JobConfig) -> None:
    """Envs whose tools run in sandboxes need a backend that works here; "auto" never falls back to running
    them unsandboxed: that takes `sandbox.backend: none`, by name."""
    needing = sorted({e.id for e in [*cfg.envs.train, *cfg.envs.eval]
                      if isinstance(cls := registered_entry_point(e.id), type) and issubclass(cls, ToolEnv)
                      and cls.uses_sandbox})
    if not needing or cfg.sandbox.backend == "none":
        return
    try:
        choose_backend(cfg.sandbox.backend, cfg.sandbox.image)
    except BackendUnavailableError as err:
        raise PreflightError(f"sandbox.backend: {cfg.sandbox.backend!r} cannot run the sandboxes of {', '.join(needing)} "
                             f"here ({err}). Install Docker (k3rl sandbox build) or bubblewrap, or, for tools that need "
                             f"no isolation, set sandbox.backend: none (plain host processes, no isolation)") from err


def checkpoint_problem(path: str) -> str | None:
    """What keeps `path` from being an HF-layout checkpoint directory, if anything."""
    if not Path(path).exists():
        return f"{path} does not exist"
    if not Path(path).is_dir():
        return f"{path} is a file, not a checkpoint directory"
    if not (Path(path) / "config.json").is_file():
        return f"{path} holds no config.json"
    return None


def _check_checkpoint(cfg: JobConfig) -> None:
    ckpt = cfg.model.checkpoint
    if ckpt is None:
        return
    problem = checkpoint_problem(ckpt)
    if problem:
        raise PreflightError(f"model.checkpoint: {problem}; point it at an HF-layout checkpoint "
                             "directory (the release's, or one save_hf / a job's checkpoints/step-N/model wrote)")
    differ = architecture_differences(cfg.model.k3_config(), ckpt)
    if differ:
        raise PreflightError(f"model.checkpoint: {ckpt} was written for another architecture than model.preset="
                             f"{cfg.model.preset!r} with model.overrides: {differ}; set the preset and overrides "
                             "that match it")


def _check_teachers(cfg: JobConfig) -> None:
    """Each learner.distill.teachers checkpoint holds the K3 architecture its preset + overrides
    describe, with the student's vocabulary (it scores the student's token ids)."""

    for i, t in enumerate(cfg.learner.distill.teachers):
        field = f"learner.distill.teachers.{i}"
        path = Path(t.checkpoint) / "config.json"
        problem = checkpoint_problem(t.checkpoint)
        if problem:
            raise PreflightError(f"{field}.checkpoint: {problem}; point it at an HF-layout "
                                 "checkpoint directory of the K3 architecture (e.g. one save_hf wrote)")
        try:
            ours = model_config(t.preset, t.overrides)
        except Exception as err:
            raise PreflightError(f"{field}.overrides: {err}") from err
        try:
            theirs = K3Config.from_hf(path)
            differ = architecture_differences(ours, t.checkpoint)
        except Exception as err:
            raise PreflightError(f"{field}.checkpoint: {path} is not a K3-architecture config ({type(err).__name__}: "
                                 f"{err}); a teacher must be a K3 model of any preset") from err
        if differ:
            raise PreflightError(f"{field}.checkpoint: {t.checkpoint} was written for another architecture than "
                                 f"preset={t.preset!r} with overrides {t.overrides}: {differ}; set {field}.preset "
                                 "and .overrides to match it")
        student = cfg.model.k3_config().vocab_size
        if theirs.vocab_size != student:
            raise PreflightError(f"{field}.checkpoint: vocab_size {theirs.vocab_size}, the student's (model) is "
                                 f"{student}; a teacher scores the student's token ids, so it needs the same "
                                 "tokenizer and vocabulary")


def _check_oracle(spec: EpisodeSpec, cfg: JobConfig, template: ChatTemplate) -> None:
    limits = job_limits(cfg)
    traj = run_sync(oracle_episode(functools.partial(make_env, spec, cfg, template), spec, template, **limits))
    field_of = {"max_turns": "envs.max_turns", "context": "rollout.max_context_tokens"}
    if traj.error:
        if traj.error.startswith("NoOracleError"):
            raise PreflightError(f"{spec.env_id}: learner.sft_steps={cfg.learner.sft_steps} warm-starts on oracle "
                                 f"demonstrations, but the env has no oracle ({traj.error}); define "
                                 "oracle(history) or set learner.sft_steps=0")
        raise PreflightError(f"{spec.env_id}: the oracle episode for the SFT warm start failed at "
                             f"{traj.metadata['failed_at']}: {traj.error}")
    P = len(traj.prompt_ids)  # an assistant turn may start inside the prompt (its header is prompted)
    longest = max((sum(traj.loss_mask[max(0, t.start - P):max(0, t.end - P)])
                   for t in traj.turns if t.role == "assistant"), default=0)
    per_turn = cfg.rollout.sampling.max_tokens_per_turn
    if longest > per_turn:
        raise PreflightError(f"{spec.env_id}: an oracle message is {longest} tokens, over "
                             f"rollout.sampling.max_tokens_per_turn={per_turn}; raise it (the SFT warm start would "
                             "teach messages the policy cannot finish) or set learner.sft_steps=0")
    by = traj.metadata.get("truncated_by")
    if traj.truncated and by in field_of:
        name = field_of[by]
        value = limits["max_turns" if by == "max_turns" else "max_context_tokens"]
        raise PreflightError(f"{spec.env_id}: the oracle episode for the SFT warm start was truncated by {by} "
                             f"({name}={value}); raise {name} or set learner.sft_steps=0")


def collect_demonstrations(cfg: JobConfig, run_name: str, n: int) -> list[Trajectory]:
    """`n` oracle episodes for the SFT warm start, through the episode loop with the job's limits
    (tokens exactly as the template renders them). Raises when one fails or does not finish."""
    import_env_modules(cfg.envs.imports)
    template = make_template(cfg)
    limits = job_limits(cfg)

    running = asyncio.Semaphore(DEMONSTRATIONS_AT_ONCE)  # sandboxed envs wait on their tools: overlap them

    async def one(i: int) -> Trajectory:
        spec = demonstration_spec(cfg, run_name, i)
        async with running:
            traj = await oracle_episode(functools.partial(make_env, spec, cfg, template), spec, template,
                                        max_tokens=cfg.rollout.sampling.max_tokens_per_turn, **limits)
        if traj.error or not traj.terminated:
            why = traj.error or f"truncated by {traj.metadata.get('truncated_by')}"
            raise RuntimeError(f"oracle demonstration {traj.id} of {traj.env_id} did not finish ({why}); "
                               f"`k3rl train` checks this at start (preflight), or set learner.sft_steps=0")
        return traj

    async def collect() -> list[Trajectory]:
        return list(await asyncio.gather(*(one(i) for i in range(n))))

    return run_sync(collect())


def phase_config(cfg: JobConfig, phase: SftPhase) -> JobConfig:
    """`cfg` with the phase's env kwargs merged into every envs.train entry's kwargs, and only the entries
    named in its `envs` (all when None): an SFT phase's demonstrations."""
    train = [e.model_copy(update={"kwargs": phase.kwargs_for(e.id, e.kwargs)}) for e in cfg.envs.train
             if phase.envs is None or e.id in phase.envs]
    return cfg.model_copy(update={"envs": cfg.envs.model_copy(update={"train": train})})


def collect_demonstration_sets(cfg: JobConfig, run_name: str, n: int) -> list[list[Trajectory]]:
    """The SFT warm start's demonstrations: `n` oracle episodes of envs.train, then `n` for each of
    learner.sft_phases (the phase's envs and env kwargs). A first phase at step 0 replaces the first
    set, which is then empty."""
    phases = cfg.learner.sft_phases
    first = [] if phases and phases[0].from_step == 0 else collect_demonstrations(cfg, run_name, n)
    return [first, *(collect_demonstrations(phase_config(cfg, p), run_name, n) for p in phases)]


def demonstration_spec(cfg: JobConfig, run_name: str, i: int) -> EpisodeSpec:
    """Demonstration i: the env (by `envs.train` weights) and seed of prompt group i of the job."""
    rng = random.Random(f"{cfg.learner.seed}:{i}")
    env = cfg.envs.env_of_group(i, rng)
    gid = f"{run_name}-demo-g{i:07d}"
    return EpisodeSpec(id=f"{gid}-s0", env_id=env.id, seed=rng.randrange(2**31), group_id=gid,
                       env_kwargs=dict(env.kwargs))
