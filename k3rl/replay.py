"""`k3rl replay`: show a stored episode turn by turn among its step, write it as HTML pages, or
re-execute its tool calls (k3rl.reexecute).

Which episode: by default the best trained episode of the run's last step (what RL has learned so
far); `--worst` the worst, `--failed` the episodes that failed (an error: never trained), `--eval` the
held-out evaluation's, `--step N` another step, `--episode ID` one by id (a prefix is enough). With
`--html PAGE` the episode is written to PAGE, and every other episode of the same kind at that step
beside it (`<PAGE stem>_step<N>/`), linked from the page's list, so a browser walks the step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from k3rl.config import JobConfig
from k3rl.images import png_size
from k3rl.reexecute import ReplayError, env_kwargs_for, print_re_execution, re_execute_episode, run_config
from k3rl.render_html import Nav, NavEntry, advantage_text, render_episode_html, turn_token_info
from k3rl.runs import RunNotFoundError, newest_run, resolve_run
from k3rl.step_view import StepView, kind_of, reward_note, reward_parts, step_views
from k3rl.store import StoreError, TrajectoryStore
from k3rl.tokenizer import load_tokenizer
from k3rl.types import Trajectory, Turn

ROLE_STYLE = {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}
FLAGS = {"trained": "", "eval": " --eval", "failed": " --failed"}

__all__ = ["ReplayError", "choose_episode", "print_episode", "replay_command", "resolve_run_dir"]


# -- finding the run and the episode ------------------------------------------------------------
def resolve_run_dir(run: str | None, runs_dir: str | Path = "runs", tracking_uri: str | None = None) -> Path:
    """The run folder of a run reference (k3rl.runs): a folder, a run name or an MLflow run name or id;
    None: the newest run under `runs_dir`."""
    try:
        if run is None:
            return newest_run(runs_dir)
        ref = resolve_run(run, runs_dir, tracking_uri)
    except RunNotFoundError as e:
        raise ReplayError(str(e)) from None
    if ref.dir is None or not (ref.dir / "trajectories").is_dir():
        raise ReplayError(f"{run!r} is MLflow run {ref.name} ({ref.run_id}), but its run folder with the episodes "
                          f"is not here (looked at {ref.dir or Path(runs_dir) / ref.name}); pass the folder")
    return ref.dir


class AmbiguousEpisodeError(ReplayError):
    def __init__(self, prefix: str, rows: list[dict]):
        self.rows = rows
        super().__init__(f"{len(rows)} episodes start with {prefix!r}: give more of the id")


def choose_episode(rows: list[dict], root: Path, *, episode: str | None = None, step: int | None = None,
                   kind: str = "trained", worst: bool = False) -> dict:
    """The summary row (TrajectoryStore.summary) of the episode to show; see the module doc."""
    if not rows:
        raise ReplayError(f"{root} holds no episodes yet")
    if episode is not None:
        found = [r for r in rows if r["id"].startswith(episode) and (step is None or r["step"] == step)]
        if not found:
            steps = sorted({r["step"] for r in rows if r["step"] is not None})
            what = " and ".join(x for x in (f"id starting with {episode!r}", f"step {step}" if step is not None else "")
                                if x)
            raise ReplayError(f"no episode with {what} in {root} ({len(rows)} episodes; steps "
                              f"{_ranges(steps) or 'none recorded'}; ids like {rows[0]['id']})")
        exact = [r for r in found if r["id"] == episode]
        if len(found) > 1 and not exact:
            raise AmbiguousEpisodeError(episode, found)
        return (exact or found)[0]
    of_kind = [r for r in rows if kind_of(r) == kind]
    if not of_kind:
        raise ReplayError(f"{root} holds no {kind} episodes ({_counts(rows)})")
    if step is None:
        step = max((r["step"] for r in of_kind if r["step"] is not None), default=None)
    at = [r for r in of_kind if r["step"] == step]
    if not at:
        steps = sorted({r["step"] for r in of_kind if r["step"] is not None})
        raise ReplayError(f"no {kind} episode at step {step} in {root} ({kind} episodes at steps {_ranges(steps)})")
    pick = min if worst else max  # the first of equals, in the order they were stored
    return pick(at, key=lambda r: r["reward"])


def _counts(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[kind_of(r)] = counts.get(kind_of(r), 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _step_episodes(store: TrajectoryStore, step: int | None) -> list[Trajectory]:
    """The episodes stored at training step `step`."""
    if step is None:  # episodes stored without a step: their group is all that belongs with them
        return [t for t in store.read() if t.metadata.get("step") is None]
    return store.read(step=step)


# -- printing ---------------------------------------------------------------------------------
def print_episode(traj: Trajectory, console: Console, store: TrajectoryStore | None = None) -> None:
    meta = traj.metadata
    head = Table.grid(padding=(0, 2))
    head.add_row("episode", traj.id)
    head.add_row("env", f"{traj.env_id}  seed {traj.seed}  task {traj.task_id or '-'}")
    head.add_row("step", f"{meta.get('step', '-')}  policy version {meta.get('policy_version', '-')}  "
                         f"status {meta.get('status', '-')}")
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


def print_listing(rows: list[dict], console: Console, limit: int = 20) -> None:
    table = Table(title=f"{len(rows)} matching episodes" + (f" (first {limit})" if len(rows) > limit else ""))
    for col in ("id", "step", "status", "env", "reward", "turns", "error"):
        table.add_column(col)
    for r in rows[:limit]:
        table.add_row(r["id"], str(r["step"] if r["step"] is not None else "-"), r.get("status") or "-", r["env_id"],
                      f"{r['reward']:g}", str(r["num_turns"]), (r["error"] or "")[:40])
    console.print(table)


def print_context(view: StepView, console: Console) -> None:
    """The episode's group (rewards, advantages) and what its reward is made of."""
    traj = view.episode
    if len(view.group) > 1 or view.method:
        what = f"advantage ({view.method})" if view.method else "advantage (not trained)"
        table = Table(title=f"its group {traj.group_id or '-'}: {len(view.group)} samples of one prompt"
                            + (f", baseline {view.baseline:.3f}" if view.baseline is not None else ""))
        for col, justify in (("member", "left"), ("reward", "right"), (what, "right"), ("status", "left"),
                             ("turns", "right"), ("error", "left")):
            table.add_column(col, justify=justify, no_wrap=col == "member")
        for m in view.group:
            style = "bold reverse" if m.id == traj.id else None
            member = m.id.removeprefix(traj.group_id).lstrip("-") if traj.group_id else m.id
            table.add_row(member or m.id, f"{m.reward:g}", advantage_text(m.advantages), m.status, str(m.turns),
                          (m.error or "")[:40], style=style)
        console.print(table)
    parts = reward_parts(traj)
    if parts:
        console.print("reward parts (the env's): " + ", ".join(f"#{i} {name} {v:g}" for i, name, v in parts)
                      + f"  = {sum(v for _, _, v in parts):g}", highlight=False)
    note = reward_note(traj)
    if note:
        console.print(f"[yellow]{note}[/]", highlight=False)


# -- HTML pages ---------------------------------------------------------------------------------
def write_pages(page: Path, chosen: Trajectory, shown: list[Trajectory], step_episodes: list[Trajectory],
                kind: str, learner_cfg: Any, tokenizer: Any, run: str) -> list[Path]:
    """`chosen` at `page`, and each of `shown` (its step's episodes of its kind) in a folder beside it, every
    page listing them all (linked). Returns the paths written."""
    step = chosen.metadata.get("step")
    folder = page.parent / f"{page.stem}_{'step' + str(step) if step is not None else 'episodes'}"
    views = step_views(shown, step_episodes, learner_cfg)
    others = [t for t in shown if t.id != chosen.id]
    counts = next(iter(views.values())).counts if views else {}
    notes = [f"{n} {k}: k3rl replay {run}{FLAGS[k]}" + (f" --step {step}" if step is not None else "")
             for k, n in sorted(counts.items()) if k != kind and k in FLAGS]
    title = f"step {step}: {len(shown)} {kind}" if step is not None else f"{len(shown)} {kind}"

    def nav(here_in_folder: bool) -> Nav:
        def href(t: Trajectory) -> str:
            if t.id == chosen.id:
                return f"../{page.name}" if here_in_folder else page.name
            return f"{t.id}.html" if here_in_folder else f"{folder.name}/{t.id}.html"

        order = sorted(shown, key=lambda t: (t.group_id, -t.reward, t.id))
        return Nav(title, [NavEntry(t.id, t.reward, f"group {t.group_id}" if t.group_id else kind, href(t))
                           for t in order], notes)

    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render_episode_html(chosen, _title(chosen), tokenizer=tokenizer, view=views.get(chosen.id),
                                        nav=nav(False)), encoding="utf-8")
    written = [page]
    if others:
        folder.mkdir(exist_ok=True)
        inside = nav(True)
        for t in others:
            path = folder / f"{t.id}.html"
            path.write_text(render_episode_html(t, _title(t), tokenizer=tokenizer, view=views.get(t.id), nav=inside),
                            encoding="utf-8")
            written.append(path)
    return written


def _title(t: Trajectory) -> str:
    step = t.metadata.get("step")
    return (f"step {step} · " if step is not None else "") + f"episode {t.id} · reward {t.reward:g}"


def _tokenizer(cfg: JobConfig, console: Console) -> Any:
    try:
        return load_tokenizer(cfg.model.tokenizer)
    except (OSError, ValueError) as e:
        console.print(f"[yellow]note:[/] the run's tokenizer cannot be loaded ({e}); the pages show no tokens")
        return None


# -- the command ----------------------------------------------------------------------------------
def replay_command(run: str | None = None, episode: str | None = None, step: int | None = None,
                   html: Path | None = None, re_execute: bool = False, *, worst: bool = False, failed: bool = False,
                   eval_: bool = False, console: Console | None = None, runs_dir: str | Path = "runs",
                   tracking_uri: str | None = None) -> int:
    """Exit code: 0 shown (and, with re_execute, identical), 1 re-execution diverged, 2 bad input."""
    console = console or Console()
    kind = "failed" if failed else "eval" if eval_ else "trained"
    try:
        run_dir = resolve_run_dir(run, runs_dir, tracking_uri)
        store = TrajectoryStore(run_dir, readonly=True)
        rows = store.summary()
        if kind == "trained" and episode is None and not any(kind_of(r) == "trained" for r in rows) \
                and any(kind_of(r) == "eval" for r in rows):
            console.print(f"no trained episodes in {run_dir} yet: showing the evaluation's")
            kind = "eval"
        row = choose_episode(rows, run_dir, episode=episode, step=step, kind=kind, worst=worst)
        own_cfg = run_config(run_dir)  # the run's config.yaml (None: none written)
        cfg = own_cfg or JobConfig()
    except AmbiguousEpisodeError as e:
        print_listing(e.rows, console)
        console.print(f"[bold red]error:[/] {e}")
        return 2
    except (ReplayError, StoreError) as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    kind = kind_of(row)
    step_eps = _step_episodes(store, row["step"])
    traj = next(t for t in step_eps if t.id == row["id"])
    shown = [t for t in step_eps if kind_of({"error": t.error, "status": t.metadata.get("status")}) == kind] or [traj]
    view = step_views([traj], step_eps, cfg.learner)[traj.id]
    if run is None:
        console.print(f"run {run_dir} (the newest; `k3rl runs` lists them all)")
    where = f"step {row['step']}" if row["step"] is not None else "the run"
    if episode is None:
        console.print(f"{where}: {_counts([{'error': t.error, 'status': t.metadata.get('status')} for t in step_eps])}; "
                      f"showing {'a failed' if kind == 'failed' else ('the worst ' if worst else 'the best ') + kind} episode "
                      "(--worst, --failed, --eval, --step N or --episode ID show others)")
    print_context(view, console)
    print_episode(traj, console, store)
    if html is not None:
        written = write_pages(Path(html), traj, shown, step_eps, kind, cfg.learner, _tokenizer(cfg, console),
                              str(run if run is not None else run_dir))
        more = f" and {len(written) - 1} more {kind} episodes of {where} beside it ({written[1].parent})" \
            if len(written) > 1 else ""
        console.print(f"wrote {html}{more}")
    if not re_execute:
        return 0
    try:
        result = re_execute_episode(traj, env_kwargs_for(traj, own_cfg), own_cfg)
    except ReplayError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    print_re_execution(traj, result, console)
    return 0 if result.identical else 1
