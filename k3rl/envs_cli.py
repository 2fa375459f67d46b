"""`k3rl envs list` and `k3rl envs check ID`. The check drives the rollout workers' episode loop
(`k3rl.rollout.episode`), so it lives with the driver, above both `envs` and `rollout`."""

from __future__ import annotations

import time
import warnings

import gymnasium as gym
from gymnasium.utils.env_checker import check_env
from rich.console import Console
from rich.table import Table

import k3rl.envs  # noqa: F401  (registers the built-ins and the entry points)
from k3rl.envs.base import ToolEnv, registered_entry_point
from k3rl.envs.builtin import DESCRIPTIONS
from k3rl.images import png_size


def tool_env_ids() -> list[str]:
    """Registered ids whose entry point is a ToolEnv subclass (k3rl/* first)."""
    ids = []
    for env_id in sorted(gym.registry):
        spec = gym.registry[env_id]
        if spec.namespace == "k3rl":
            ids.append(env_id)
            continue
        try:
            cls = registered_entry_point(env_id)
        except Exception:
            continue
        if isinstance(cls, type) and issubclass(cls, ToolEnv):
            ids.append(env_id)
    return sorted(ids, key=lambda i: (not i.startswith("k3rl/"), i))


def tool_names(env: ToolEnv) -> list[str]:
    """The env's tools before any reset: its own, and those its MCP server declares it lists (the server
    itself starts in the episode's sandbox, at reset)."""
    server = getattr(env, "mcp_server", None)
    mcp = [f"{name} (MCP)" for name in getattr(server, "tools", ())]
    if server is not None and not mcp:
        mcp = ["(the MCP server's, listed at reset)"]
    return [*env.tool_names, *mcp]


def list_envs(console: Console | None = None) -> list[str]:
    console = console or Console()
    table = Table(title="k3rl tool environments")
    table.add_column("id", no_wrap=True, style="bold")
    for column in ("sandbox", "max turns", "tools", "description"):
        table.add_column(column)
    ids = tool_env_ids()
    for env_id in ids:
        try:
            cls = registered_entry_point(env_id)
            if getattr(cls, "is_agent_env", False):  # made from a user's agent and tasks: nothing to make here
                table.add_row(env_id, "no", "the agent's", "the agent's", DESCRIPTIONS.get(env_id, ""))
                continue
            env = gym.make(env_id).unwrapped
            tools = ", ".join(tool_names(env))
            env.close()
            description = DESCRIPTIONS.get(env_id) or (cls.__doc__ or "").strip().split("\n")[0]
            table.add_row(env_id, "yes" if cls.uses_sandbox else "no", str(cls.default_max_turns), tools, description)
        except Exception as e:  # a broken plugin shows up as broken, the list still prints
            table.add_row(env_id, "?", "?", "?", f"[red]cannot be made: {type(e).__name__}: {e}[/]")
    console.print(table)
    return ids


def _role_style(role: str) -> str:
    return {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}.get(role, "white")


def check_env_command(env_id: str, seed: int = 0, console: Console | None = None) -> int:
    """Gymnasium's env checker, then one oracle episode with its transcript. Exit code 0 when both pass."""
    console = console or Console()
    if env_id not in gym.registry:
        known = ", ".join(tool_env_ids())
        console.print(f"[bold red]error:[/] no environment {env_id!r} is registered; known: {known}")
        return 2
    ok = True
    env = gym.make(env_id)
    try:
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped, skip_render_check=False)
        console.print(f"[bold green]env checker passed[/] ({time.perf_counter() - t:.1f}s)")
        for w in caught:
            console.print(f"  [yellow]warning:[/] {w.message}")
    except Exception as e:
        ok = False
        console.print(f"[bold red]env checker failed:[/] {type(e).__name__}: {e}")
    finally:
        env.close()

    # lazy: torch (seconds) loads only for `check`
    from k3rl.rollout.episode import run_oracle_episode

    episode = run_oracle_episode(env_id, seed=seed)  # through the episode loop, the env's oracle behind generate
    if episode.error:
        console.print(f"[bold red]oracle episode failed at {episode.metadata.get('failed_at')}:[/] {episode.error}",
                      highlight=False)
        console.print(episode.metadata.get("traceback", ""), markup=False, highlight=False)
        return 1
    console.rule(f"oracle episode of {env_id}, seed {seed}")
    for turn in episode.turns:
        head = turn.role if turn.role != "tool" else f"tool {turn.tool_name}#{turn.tool_index}"
        console.print(f"[bold {_role_style(turn.role)}]{head}[/]", highlight=False)
        for png in turn.images:
            w, h = png_size(png)
            console.print(f"  [dim][image {w}x{h}, {len(png)} bytes][/]")
        if turn.text:
            console.print("  " + turn.text.replace("\n", "\n  "), markup=False, highlight=False)
        for c in turn.tool_calls:
            console.print(f"  [bold]-> {c.name}[/]({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})",
                          highlight=False)
        if turn.error:
            console.print(f"  [red]error: {turn.error}[/]", highlight=False)
    console.rule()
    status = "terminated" if episode.terminated else f"truncated ({episode.metadata.get('truncated_by')})"
    console.print(f"reward {episode.reward:.4f}, {episode.num_turns} turns, {status}, "
                  f"{len(episode.token_ids)} context tokens, {episode.timings.get('episode_s', 0.0):.1f}s")
    if episode.reward < 1.0 - 1e-6:
        console.print("[bold red]the oracle did not reach full reward[/]")
        ok = False
    return 0 if ok else 1
