"""Helpers shared by the sandbox-backed environments.

`pooled(pool, loop)` lets a synchronous env take its sandboxes from an asyncio `SandboxPool`
running on `loop` (the env must then step in another thread, e.g. `asyncio.to_thread`):

    env = gym.make("k3rl/CodeFix-v0", **pooled(pool, loop))
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from k3rl.envs.tools import ToolError
from k3rl.sandboxes.types import PathEscapeError, SandboxFileError


def on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def pooled(pool: Any, loop: asyncio.AbstractEventLoop, timeout: float | None = None) -> dict[str, Any]:
    """`sandbox_factory`/`sandbox_release` kwargs that acquire from / release to `pool` on `loop`.

    Acquiring blocks, so the env must step in another thread (`asyncio.to_thread(env.step, ...)`).
    Releasing works from anywhere: on the loop's own thread (e.g. `env.close()` inside a
    coroutine) it schedules the release instead of blocking the loop it waits for.
    """

    def factory():
        if on_loop_thread(loop):
            raise RuntimeError("a pooled sandbox cannot be acquired on the event loop's thread (it would wait for "
                               "itself): run env.reset/env.step in a worker thread, e.g. asyncio.to_thread")
        return asyncio.run_coroutine_threadsafe(pool.acquire(timeout=timeout), loop).result()

    def release(sb):
        if on_loop_thread(loop):
            loop.create_task(pool.release(sb))
        else:
            asyncio.run_coroutine_threadsafe(pool.release(sb), loop).result()

    return {"sandbox_factory": factory, "sandbox_release": release}


def format_exec(result: Any, timeout: float) -> str:
    """What the model sees of one command: stdout, stderr, and how it ended when not cleanly."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"[timed out after {timeout:g}s and was killed]")
    elif result.oom_killed:
        parts.append("[killed: out of memory]")
    elif result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


def sandbox_path_errors() -> tuple[type[BaseException], ...]:
    return (PathEscapeError, SandboxFileError)


def _for_model(e: BaseException) -> str:
    return re.sub(r"^sandbox \S+: ", "", str(e))


def read_text(sandbox: Any, path: str) -> str:
    """A file of the sandbox as text; a missing file or an escaping path is the model's error."""
    try:
        return sandbox.read_file(path).decode("utf-8", errors="replace")
    except sandbox_path_errors() as e:
        raise ToolError(_for_model(e)) from None


def write_text(sandbox: Any, path: str, content: str) -> None:
    try:
        sandbox.write_file(path, content)
    except sandbox_path_errors() as e:
        raise ToolError(_for_model(e)) from None
