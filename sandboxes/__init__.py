"""k3rl.sandboxes: secure places to run tool calls.

    from k3rl.sandboxes import open_sandbox
    with open_sandbox(backend="auto", memory_mb=512) as sb:
        sb.write_file("main.py", "print(1 + 1)")
        result = sb.exec("python3 main.py", timeout=10)   # ExecResult(exit_code=0, stdout="2\\n", ...)

Backends: Docker (`docker_backend`) and bubblewrap (`bwrap_backend`), same contract (`base.Sandbox`).
`SandboxPool` hands out warm sandboxes to many coroutines; `render` turns matplotlib code or SVG
into PNG bytes inside a sandbox; `image` builds `k3rl-sandbox:<version>` offline; `gc` removes
leftovers of crashed jobs; `doctor` says what this host can run. CLI: `k3rl sandbox build|doctor|gc`.
"""

from .base import Sandbox
from .doctor import print_report
from .factory import choose_backend, open_sandbox
from .gc import gc
from .image import build_image, image_tag, image_version
from .pool import SandboxPool
from .process import SandboxProcess
from .render import RenderError, render_matplotlib, render_svg
from .types import (
    BackendUnavailableError,
    ExecResult,
    PathEscapeError,
    SandboxClosedError,
    SandboxDeadError,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
)


def cli_build(force: bool = False) -> str:
    """`k3rl sandbox build`: build the image if its recipe changed; return the tag."""
    return build_image(force=force)


def cli_doctor() -> bool:
    """`k3rl sandbox doctor`: print what is available and what to install; True when a backend works."""
    return print_report()


def cli_gc(job: str | None = None, all: bool = False) -> list[str]:
    """`k3rl sandbox gc`: remove leftovers of crashed jobs (or of `job`, or `all`)."""
    removed = gc(job=job, all=all)
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} leftover(s) removed")
    return removed


__all__ = [
    "BackendUnavailableError",
    "ExecResult",
    "PathEscapeError",
    "RenderError",
    "Sandbox",
    "SandboxClosedError",
    "SandboxDeadError",
    "SandboxError",
    "SandboxFileError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxProcess",
    "build_image",
    "choose_backend",
    "cli_build",
    "cli_doctor",
    "cli_gc",
    "gc",
    "image_tag",
    "image_version",
    "open_sandbox",
    "render_matplotlib",
    "render_svg",
]
