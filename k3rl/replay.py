"""`k3rl replay`: show a stored episode turn by turn, write it as HTML, or re-execute its tool
calls in a fresh environment (and sandbox) and report where the new tool results diverge.

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
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from k3rl.config import ConfigError, JobConfig
from k3rl.images import png_size
from k3rl.render_html import render_episode_html, turn_token_info
from k3rl.store import StoreError, TrajectoryStore
from k3rl.types import SamplingParams, Trajectory, Turn

ROLE_STYLE = {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}


class ReplayError(RuntimeError):
    """A run or episode that cannot be found or replayed; the message says what exists."""


# -- finding the run and the episode ------------------------------------------------------------
def resolve_run_dir(run: str, runs_dir: str | Path = "runs", tracking_uri: str = "sqlite:///runs/mlflow.db") -> Path:
    """A run directory from `run`: a directory holding trajectories/, a run name under
    `runs_dir`, or an MLflow run name/id (its `k3rl.run_dir` tag, else runs_dir/<run name>)."""
    for candidate in (Path(run), Path(runs_dir) / run):
        if (candidate / "trajectories").is_dir():
            return candidate
    # lazy: MLflow (seconds) only for a run named in MLflow
    from k3rl.tracking import RUN_DIR_TAG, TrackingError, find_run, sqlite_path

    db = sqlite_path(tracking_uri)
    if db is None or db.exists():
        # lazy: MLflow (seconds) only for a run named in MLflow
        from k3rl.tracking import mlflow_client

        try:
            mlrun = find_run(mlflow_client(tracking_uri), run)
        except TrackingError:
            mlrun = None
        if mlrun is not None:
            for candidate in (mlrun.data.tags.get(RUN_DIR_TAG), Path(runs_dir) / mlrun.info.run_name):
                if candidate and (Path(candidate) / "trajectories").is_dir():
                    return Path(candidate)
    raise ReplayError(f"{run!r} is not a run directory with trajectories/ (looked at {Path(run)}, "
                      f"{Path(runs_dir) / run}, and MLflow runs in {tracking_uri})")


def select_episodes(store: TrajectoryStore, episode: str | None, step: int | None) -> list[Trajectory]:
    found = store.read(step=step, episode=episode)
    if found:
        return found
    summary = store.summary()
    if not summary:
        raise ReplayError(f"{store.root} holds no episodes yet")
    steps = sorted({s["step"] for s in summary if s["step"] is not None})
    what = " and ".join(x for x in (f"id starting with {episode!r}" if episode else "",
                                   f"step {step}" if step is not None else "") if x)
    raise ReplayError(f"no episode with {what} in {store.root} ({len(summary)} episodes; steps "
                      f"{_ranges(steps) or 'none recorded'}; ids like {summary[0]['id']})")


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


# -- printing ---------------------------------------------------------------------------------
def print_episode(traj: Trajectory, console: Console, store: TrajectoryStore | None = None) -> None:
    meta = traj.metadata
    head = Table.grid(padding=(0, 2))
    head.add_row("episode", traj.id)
    head.add_row("env", f"{traj.env_id}  seed {traj.seed}  task {traj.task_id or '-'}")
    head.add_row("step", f"{meta.get('step', '-')}  policy version {meta.get('policy_version', '-')}")
    ended = "terminated" if traj.terminated else "truncated" if traj.truncated else "unfinished"
    head.add_row("reward", f"{traj.reward:g} ({ended})")
    head.add_row("tokens", f"{len(traj.prompt_ids)} prompt + {len(traj.completion_ids)} completion "
                           f"({traj.num_generated} generated)")
    if traj.segment_starts:
        head.add_row("segments", f"{len(traj.segment_bounds)} contexts (compacted), tokens "
                                 + ", ".join(f"[{lo}, {hi})" for lo, hi in traj.segment_bounds))
    if traj.timings:
        head.add_row("timings", "  ".join(f"{k} {v:.3f}s" for k, v in sorted(traj.timings.items())))
    if traj.error:
        head.add_row(Text("error", style="bold red"), Text(traj.error, style="red"))
    console.print(Panel(head, title="episode", expand=False))
    segment = 0
    for i, turn in enumerate(traj.turns):
        if turn.segment != segment:
            segment = turn.segment
            lo, hi = traj.segment_bounds[segment]
            console.rule(f"segment {segment}: a new context, tokens [{lo}, {hi})")
        console.print(_turn_renderable(traj, i, turn, store))


def _turn_renderable(traj: Trajectory, i: int, turn: Turn, store: TrajectoryStore | None) -> Panel:
    info = turn_token_info(traj, turn)
    body = Text()
    if turn.thinking:
        body.append("thinking: ", style="dim bold")
        body.append(turn.thinking + "\n", style="dim")
    body.append(turn.text or "")
    for call in turn.tool_calls:
        if body.plain and not body.plain.endswith("\n"):
            body.append("\n")
        body.append(f"-> call {call.index} {call.name}(", style="bold")
        body.append(json.dumps(call.arguments, ensure_ascii=False, sort_keys=True))
        body.append(")", style="bold")
    for k, png in enumerate(turn.images):
        w, h = png_size(png)
        if body.plain and not body.plain.endswith("\n"):
            body.append("\n")
        where = ""
        if store is not None:
            path = store.image_path(traj.id, i, k)
            where = f" at {path}" if path.exists() else " (no PNG file written)"
        body.append(f"[image {k}: {w}x{h} PNG, {len(png)} bytes{where}]", style="blue")
    if turn.error:
        if body.plain and not body.plain.endswith("\n"):
            body.append("\n")
        body.append(f"error: {turn.error}", style="bold red")
    sub = f"{info['tokens']} tokens"
    if turn.role == "assistant":
        versions = ",".join(map(str, info["versions"])) or "-"
        sub += f", {info['generated']} generated, policy v{versions}"
    if turn.reward:
        sub += f", reward {turn.reward:g}"
    title = f"#{i} {turn.role}" + (f" ({turn.tool_name})" if turn.tool_name else "")
    if turn.compaction:
        title += f" · {turn.compaction.replace('_', ' ')}"
    return Panel(body, title=title, subtitle=sub, title_align="left", subtitle_align="right",
                 border_style=ROLE_STYLE.get(turn.role, "white"))


def print_listing(episodes: list[Trajectory], console: Console, limit: int = 20) -> None:
    table = Table(title=f"{len(episodes)} matching episodes" + (f" (first {limit})" if len(episodes) > limit else ""))
    for col in ("id", "step", "env", "reward", "turns", "error"):
        table.add_column(col)
    for t in episodes[:limit]:
        table.add_row(t.id, str(t.metadata.get("step", "-")), t.env_id, f"{t.reward:g}", str(t.num_turns),
                      (t.error or "")[:40])
    console.print(table)


# -- re-execution -------------------------------------------------------------------------------
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


# -- the command ----------------------------------------------------------------------------------
def replay_command(run: str, episode: str | None = None, step: int | None = None, html: Path | None = None,
                   re_execute: bool = False, console: Console | None = None, runs_dir: str | Path = "runs",
                   tracking_uri: str = "sqlite:///runs/mlflow.db") -> int:
    """Exit code: 0 shown (and, with re_execute, identical), 1 re-execution diverged, 2 bad input."""
    console = console or Console()
    try:
        run_dir = resolve_run_dir(run, runs_dir, tracking_uri)
        store = TrajectoryStore(run_dir, readonly=True)
        episodes = select_episodes(store, episode, step)
    except (ReplayError, StoreError) as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    if episode is not None and len({t.id for t in episodes}) > 1:
        print_listing(episodes, console)
        console.print(f"[bold red]error:[/] {len(episodes)} episodes start with {episode!r}: give more of the id")
        return 2
    if len(episodes) > 1:
        print_listing(episodes, console)
        console.print("showing the first; pick another with --episode ID")
    traj = episodes[0]
    print_episode(traj, console, store)
    if html is not None:
        html = Path(html)
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text(render_episode_html(traj), encoding="utf-8")
        console.print(f"wrote {html}")
    if not re_execute:
        return 0
    try:
        cfg = run_config(run_dir)
        result = re_execute_episode(traj, env_kwargs_for(traj, cfg), cfg)
    except ReplayError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    print_re_execution(traj, result, console)
    return 0 if result.identical else 1
