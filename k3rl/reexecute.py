"""`k3rl replay --re-execute`: run a stored episode's tool calls again in a fresh environment (and
sandbox) and report where the new tool results diverge.

Re-execution runs the episode loop of the rollout workers (k3rl.rollout.episode) again, with
the recorded tokens in place of the model: the environment named by `traj.env_id` is made as
the job made it (the run's config.yaml, kwargs from its `envs.train` entry and
`metadata["env_kwargs"]`), reset with the recorded seed, and each turn `generate` returns the
exact ids the model sampled then. What the env says back is compared with the recorded turns
(role, text, images byte for byte, tool name and index), step by step, and so are the rewards
and the episode's end.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from k3rl.config import ConfigError, JobConfig
from k3rl.images import png_size
from k3rl.types import SamplingParams, Trajectory, Turn


class ReplayError(RuntimeError):
    """A run or episode that cannot be found or replayed; the message says what exists."""


@dataclass
class Divergence:
    turn: int  # index into traj.turns of the recorded turn that differs (or where a message is missing/extra)
    what: str
    recorded: Any
    replayed: Any


@dataclass
class ReExecution:
    steps: int = 0
    checked_messages: int = 0
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.divergences


def _view(t: Turn) -> dict[str, Any]:
    return {"role": t.role, "tool_name": t.tool_name, "tool_index": t.tool_index, "text": t.text,
            "images": list(t.images)}


def _describe(t: Turn | None) -> str:
    if t is None:
        return "(nothing)"
    imgs = ", ".join("{}x{}".format(*png_size(b)) for b in t.images)
    return f"{t.role}{'(' + t.tool_name + ')' if t.tool_name else ''}: {t.text!r}" + (
        f" + images [{imgs}]" if imgs else "")


def _png_label(png: bytes) -> str:
    w, h = png_size(png)
    return f"{w}x{h} PNG {len(png)}B"


def _blocks(turns: list[Turn]) -> list[tuple[int, Turn | None, list[Turn]]]:
    """(index of the block's first turn, its assistant turn, the env's messages after it): the
    opening first (no assistant turn), then one block per assistant turn."""
    out: list[tuple[int, Turn | None, list[Turn]]] = [(0, None, [])]
    for i, t in enumerate(turns):
        if t.role == "assistant":
            out.append((i, t, []))
        else:
            out[-1][2].append(t)
    return out


def _compare_messages(first: int, recorded: list[Turn], replayed: list[Turn], out: ReExecution) -> None:
    """The env's messages of one reset/step, recorded and re-executed; `first` indexes the recorded turns."""
    for k in range(max(len(recorded), len(replayed))):
        r = recorded[k] if k < len(recorded) else None
        n = replayed[k] if k < len(replayed) else None
        out.checked_messages += 1
        if r is None or n is None:
            out.divergences.append(Divergence(first + k, f"message {k}: {'extra' if r is None else 'missing'} message",
                                              _describe(r), _describe(n)))
            continue
        a, b = _view(r), _view(n)
        for key in ("role", "tool_name", "tool_index", "text"):
            if a[key] != b[key]:
                out.divergences.append(Divergence(first + k, f"message {k}: {key} differs", a[key], b[key]))
        if a["images"] != b["images"]:
            out.divergences.append(Divergence(first + k, f"message {k}: images differ",
                                              [_png_label(x) for x in a["images"]], [_png_label(x) for x in b["images"]]))


def recorded_actions(traj: Trajectory) -> list[list[int]]:
    """The exact ids the model sampled, one list per recorded assistant turn (summaries included;
    a message carried into a new context segment was not sampled again)."""
    n = len(traj.prompt_ids)
    return [[tok for tok, m in zip(traj.completion_ids[max(t.start - n, 0):t.end - n],
                                   traj.loss_mask[max(t.start - n, 0):t.end - n], strict=True) if m]
            for t in traj.turns if t.role == "assistant" and t.compaction != "carried"]


def run_config(run_dir: Path | None) -> JobConfig | None:
    """The config the run was made with (its config.yaml), if it has one."""
    cfg_file = run_dir / "config.yaml" if run_dir is not None else None
    if cfg_file is None or not cfg_file.exists():
        return None
    try:
        return JobConfig.load(cfg_file)
    except ConfigError as e:
        raise ReplayError(f"cannot read the run's config {cfg_file}: {e}") from None


def env_kwargs_for(traj: Trajectory, cfg: JobConfig | None) -> dict[str, Any]:
    """Kwargs the job made this env with: its `envs.train` entry in the run's config, overridden by
    `metadata["env_kwargs"]` when the episode recorded them."""
    kwargs: dict[str, Any] = {}
    for spec in cfg.envs.train if cfg is not None else []:
        if spec.id == traj.env_id:
            kwargs.update(spec.kwargs)
            break
    kwargs.update(traj.metadata.get("env_kwargs") or {})
    return kwargs


def re_execute_episode(traj: Trajectory, env_kwargs: dict[str, Any] | None = None,
                       cfg: JobConfig | None = None) -> ReExecution:
    """Run the recorded assistant turns (their exact sampled ids) again through the episode loop,
    in a fresh environment made as the job made it (`cfg`: the run's config, else the defaults);
    collect every divergence of what the env says back, the rewards and the episode's end."""
    # lazy: torch (seconds) and every env plugin load only for --re-execute
    from k3rl.envs.registration import import_env_modules
    from k3rl.rollout.episode import (
        NO_LIMIT,
        EpisodeSpec,
        job_limits,
        make_env,
        make_template,
        run_episode,
        scripted_generate,
    )

    cfg = cfg or JobConfig()
    try:
        import_env_modules(cfg.envs.imports)  # the run's own envs register themselves
    except ConfigError as e:
        raise ReplayError(f"cannot re-execute episode {traj.id}: {e}") from None
    template = make_template(cfg)
    spec = EpisodeSpec(id=traj.id, env_id=traj.env_id, seed=traj.seed, group_id=traj.group_id,
                       env_kwargs=dict(env_kwargs or {}))
    actions = iter(recorded_actions(traj))

    def next_action() -> list[int]:
        action = next(actions, None)
        if action is None:
            raise ReplayError("the recording has no more assistant turns: the re-executed episode went on longer")
        return action

    # the recorded ids already end where the engine stopped them: no per-turn cut, no clock
    limits = {**job_limits(cfg), "time_budget_s": float("inf")}
    new = asyncio.run(run_episode(lambda: make_env(spec, cfg, template), spec, scripted_generate(template, next_action),
                                  template, SamplingParams(max_tokens=NO_LIMIT), **limits))
    if new.metadata.get("failed_at") == "make_env":
        raise ReplayError(f"cannot make environment {traj.env_id!r} with kwargs {env_kwargs or {}} to re-execute "
                          f"episode {traj.id}: {new.error}")
    out = ReExecution(steps=new.num_turns)
    recorded, replayed = _blocks(traj.turns), _blocks(new.turns)
    for b in range(len(recorded)):
        if b >= len(replayed):  # (it cannot go on longer: generate has no more recorded turns to play)
            out.divergences.append(Divergence(recorded[b][0], "the re-executed episode had already ended",
                                              "more turns", new.error or "ended"))
            break
        first, said, answer = recorded[b]
        _compare_messages(first + (said is not None), answer, replayed[b][2], out)
        if said is not None and said.reward != replayed[b][1].reward:
            out.divergences.append(Divergence(first, "step reward differs", said.reward, replayed[b][1].reward))
    if new.error and new.error != traj.error and not any("had already ended" in d.what for d in out.divergences):
        out.divergences.append(Divergence(len(traj.turns) - 1, f"the re-executed episode failed at "
                                          f"{new.metadata.get('failed_at')}", traj.error or "no error", new.error))
    if not traj.error and not new.error and (new.terminated, new.truncated) != (traj.terminated, traj.truncated):
        out.divergences.append(Divergence(len(traj.turns) - 1, "episode end differs (terminated, truncated)",
                                          (traj.terminated, traj.truncated), (new.terminated, new.truncated)))
    if new.reward != traj.reward:
        out.divergences.append(Divergence(len(traj.turns) - 1, "episode reward differs", traj.reward, new.reward))
    return out


def print_re_execution(traj: Trajectory, result: ReExecution, console: Console) -> None:
    if result.identical:
        console.print(f"[bold green]identical[/]: {result.steps} steps re-executed in a fresh {traj.env_id}, "
                      f"{result.checked_messages} messages match the recording")
        return
    table = Table(title=f"{len(result.divergences)} divergences in {result.steps} re-executed steps", show_lines=True)
    for col in ("turn", "what", "recorded", "re-executed"):
        table.add_column(col, overflow="fold")
    for d in result.divergences:
        role = traj.turns[d.turn].role if d.turn < len(traj.turns) else "-"
        table.add_row(f"{d.turn} {role}", d.what, str(d.recorded)[:300], str(d.replayed)[:300])
    console.print(table)
