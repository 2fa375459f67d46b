"""`k3rl replay`: show a stored episode turn by turn, write it as HTML, or re-execute its tool
calls in a fresh environment (and sandbox) and report where the new tool results diverge.

Re-execution mirrors the agent loop (k3rl.rollout.agent): the environment named by
`traj.env_id` is made with `gymnasium.make` (kwargs from the run's config.yaml and
`metadata["env_kwargs"]`), reset with the recorded seed, and each recorded assistant turn is
fed to `env.step` as the agent loop fed it: a `ParsedAssistant` (text, thinking, tool calls),
or the exact generated token ids when the recorded turn failed to parse. The messages `step`
returns are compared with the recorded turns that followed (role, text, images byte for
byte, tool name and index), and so are the reward and the episode end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from k3rl.images import png_size
from k3rl.render_html import render_episode_html, turn_token_info
from k3rl.store import StoreError, TrajectoryStore
from k3rl.types import Trajectory, Turn

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
    from k3rl.tracking import RUN_DIR_TAG, TrackingError, find_run, sqlite_path

    db = sqlite_path(tracking_uri)
    if db is None or db.exists():
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
    if traj.timings:
        head.add_row("timings", "  ".join(f"{k} {v:.3f}s" for k, v in sorted(traj.timings.items())))
    if traj.error:
        head.add_row(Text("error", style="bold red"), Text(traj.error, style="red"))
    console.print(Panel(head, title="episode", expand=False))
    for i, turn in enumerate(traj.turns):
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


def _message_view(m: Any) -> dict[str, Any]:
    """The comparable part of a message the env returned (dict or k3rl.chat.Message)."""
    if hasattr(m, "model_dump"):
        m = m.model_dump()
    if not isinstance(m, dict):
        raise ReplayError(f"the environment returned a {type(m).__name__} where a message dict was expected")
    return {"role": m.get("role"), "text": m.get("content", ""), "images": list(m.get("images") or []),
            "tool_name": m.get("tool_name"), "tool_index": m.get("tool_index")}


def _turn_view(t: Turn) -> dict[str, Any]:
    return {"role": t.role, "text": t.text, "images": list(t.images), "tool_name": t.tool_name,
            "tool_index": t.tool_index}


def _observation(obs: Any) -> list[dict[str, Any]]:
    if isinstance(obs, dict) and "messages" in obs:
        obs = obs["messages"]
    if obs is None:
        return []
    if isinstance(obs, dict) or hasattr(obs, "model_dump"):
        obs = [obs]
    return [_message_view(m) for m in obs]


def _describe(view: dict[str, Any] | None) -> str:
    if view is None:
        return "(nothing)"
    imgs = ", ".join("{}x{}".format(*png_size(b)) for b in view["images"])
    return f"{view['role']}{'(' + view['tool_name'] + ')' if view['tool_name'] else ''}: {view['text']!r}" + (
        f" + images [{imgs}]" if imgs else "")


def _compare(first: int, recorded: list[dict], replayed: list[dict], out: ReExecution) -> None:
    """Compare the messages of one reset/step with the recorded turns starting at index `first`."""
    for k in range(max(len(recorded), len(replayed))):
        r = recorded[k] if k < len(recorded) else None
        n = replayed[k] if k < len(replayed) else None
        out.checked_messages += 1
        turn = first + k
        if r is None or n is None:
            out.divergences.append(Divergence(turn, f"message {k}: {'extra' if r is None else 'missing'} message",
                                              _describe(r), _describe(n)))
            continue
        for key in ("role", "tool_name", "tool_index", "text"):
            if r[key] != n[key]:
                out.divergences.append(Divergence(turn, f"message {k}: {key} differs", r[key], n[key]))
        if r["images"] != n["images"]:
            out.divergences.append(Divergence(
                turn, f"message {k}: images differ", [_png_label(b) for b in r["images"]],
                [_png_label(b) for b in n["images"]]))


def _png_label(png: bytes) -> str:
    w, h = png_size(png)
    return f"{w}x{h} PNG {len(png)}B"


def recorded_action(traj: Trajectory, turn: Turn) -> Any:
    """What the agent loop passed to env.step for this recorded assistant turn."""
    if turn.error:  # it did not parse: the env gets the exact sampled ids and reports the parse error
        lo, hi = max(turn.start - len(traj.prompt_ids), 0), max(turn.end - len(traj.prompt_ids), 0)
        return [tok for tok, m in zip(traj.completion_ids[lo:hi], traj.loss_mask[lo:hi], strict=True) if m]
    from k3rl.chat import ParsedAssistant

    return ParsedAssistant(content=turn.text, tool_calls=list(turn.tool_calls), thinking=turn.thinking)


def env_kwargs_for(traj: Trajectory, run_dir: Path | None) -> dict[str, Any]:
    """Kwargs the job made this env with: the run's config (envs.train entry + max_turns),
    overridden by `metadata["env_kwargs"]` when the episode recorded them."""
    kwargs: dict[str, Any] = {}
    cfg_file = run_dir / "config.yaml" if run_dir is not None else None
    if cfg_file is not None and cfg_file.exists():
        from k3rl.config import ConfigError, JobConfig

        try:
            cfg = JobConfig.load(cfg_file)
        except ConfigError as e:
            raise ReplayError(f"cannot read the run's config {cfg_file} for the env's kwargs: {e}") from None
        for spec in cfg.envs.train:
            if spec.id == traj.env_id:
                kwargs.update(spec.kwargs)
                break
        kwargs.setdefault("max_turns", cfg.envs.max_turns)
    kwargs.update(traj.metadata.get("env_kwargs") or {})
    return kwargs


def re_execute_episode(traj: Trajectory, env_kwargs: dict[str, Any] | None = None) -> ReExecution:
    """Run the recorded assistant turns again in a fresh environment; collect every divergence."""
    import gymnasium

    try:
        import k3rl.envs  # noqa: F401  (registers the k3rl/ namespace and entry points)
    except ImportError:
        pass
    try:
        env = gymnasium.make(traj.env_id, **(env_kwargs or {})).unwrapped
    except (gymnasium.error.Error, TypeError) as e:
        raise ReplayError(f"cannot make environment {traj.env_id!r} with kwargs {env_kwargs or {}} to re-execute "
                          f"episode {traj.id}: {e}") from None
    out = ReExecution()
    try:
        obs, _info = env.reset(seed=traj.seed)
        turns = traj.turns
        first_assistant = next((i for i, t in enumerate(turns) if t.role == "assistant"), len(turns))
        _compare(0, [_turn_view(t) for t in turns[:first_assistant]], _observation(obs), out)
        total_reward, ended = 0.0, (False, False)
        i = first_assistant
        while i < len(turns):
            turn = turns[i]
            j = i + 1
            while j < len(turns) and turns[j].role != "assistant":
                j += 1
            if ended[0] or ended[1]:
                out.divergences.append(Divergence(i, "the replayed episode had already ended", "more turns", "ended"))
                break
            try:
                obs, reward, terminated, truncated, _info = env.step(recorded_action(traj, turn))
            except Exception as e:  # noqa: BLE001  (a crash is a divergence to report, not ours to raise)
                out.divergences.append(Divergence(i, "env.step raised", traj.error or "no error",
                                                  f"{type(e).__name__}: {e}"))
                break
            out.steps += 1
            total_reward += float(reward)
            _compare(i + 1, [_turn_view(t) for t in turns[i + 1:j]], _observation(obs), out)
            if float(reward) != turn.reward:
                out.divergences.append(Divergence(i, "step reward differs", turn.reward, float(reward)))
            ended = (bool(terminated), bool(truncated))
            i = j
        if out.steps and not traj.error and ended != (traj.terminated, traj.truncated):
            out.divergences.append(Divergence(len(turns) - 1, "episode end differs (terminated, truncated)",
                                              (traj.terminated, traj.truncated), ended))
        if total_reward != traj.reward:
            out.divergences.append(Divergence(len(turns) - 1, "episode reward differs", traj.reward, total_reward))
    finally:
        env.close()
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
        result = re_execute_episode(traj, env_kwargs_for(traj, run_dir))
    except ReplayError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    print_re_execution(traj, result, console)
    return 0 if result.identical else 1
