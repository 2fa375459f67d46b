"""Plain data types and errors shared by every sandbox backend."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


class SandboxError(RuntimeError):
    """Base class of every error raised by `k3rl.sandboxes`."""


class PathEscapeError(SandboxError, ValueError):
    """A path given to `write_file` / `read_file` / `exec(workdir=...)` leaves the sandbox work dir."""


class SandboxFileError(SandboxError):
    """A file operation failed inside the sandbox (missing file, directory, too large...)."""


class SandboxDeadError(SandboxError):
    """The sandbox stopped existing under us (container killed from outside, daemon gone...)."""


class SandboxClosedError(SandboxError):
    """The sandbox was already closed."""


class BackendUnavailableError(SandboxError):
    """The requested backend cannot run on this host (no daemon, no bwrap, no image...)."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one `Sandbox.exec`.

    `exit_code` follows the shell convention: 128 + N when the command was killed by signal N
    (137 after a timeout or an OOM kill). `stdout` / `stderr` are decoded UTF-8 (invalid bytes
    replaced); when a stream exceeded the output cap it is cut and ends with `TRUNCATION_MARKER`.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


TRUNCATION_MARKER = "[k3rl: output truncated: {shown} of {total} bytes shown]"


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox. Defaults are secure and small; raise them per job.

    memory_mb:    memory limit (no swap); an exec that exceeds it is OOM-killed (`oom_killed`).
    cpus:         CPU share (1.0 = one core).
    pids:         maximum number of processes/threads (contains fork bombs).
    timeout_s:    default wall-clock limit of one `exec`.
    output_bytes: cap of stdout and of stderr (each) returned by one `exec`.
    workdir_mb:   size of the writable work dir (Docker: tmpfs size; its contents count toward memory_mb).
    tmp_mb:       size of the writable /tmp (Docker: tmpfs size; counts toward memory_mb as well).
    max_file_bytes: largest file `write_file` / `read_file` moves.
    """

    memory_mb: int = 1024
    cpus: float = 1.0
    pids: int = 256
    timeout_s: float = 60.0
    output_bytes: int = 1 << 20
    workdir_mb: int = 512
    tmp_mb: int = 256
    max_file_bytes: int = 64 << 20
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("memory_mb", "pids", "output_bytes", "workdir_mb", "tmp_mb", "max_file_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive int, got {value!r}")
        if self.memory_mb < 32:
            raise ValueError(
                f"SandboxLimits.memory_mb={self.memory_mb} is too small to start Python (need >= 32)"
            )
        if self.pids < 8:
            raise ValueError(f"SandboxLimits.pids={self.pids} is too small to run a shell (need >= 8)")
        for name in ("cpus", "timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> SandboxLimits:
        """Build limits from `open_sandbox(**limits)` keywords, naming any unknown keyword."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown sandbox limit(s) {unknown}; known limits are {sorted(known)}")
        return cls(**kwargs)

    def with_(self, **changes) -> SandboxLimits:
        return replace(self, **changes)
