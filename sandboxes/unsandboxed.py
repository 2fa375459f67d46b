"""The `none` backend: the sandbox contract with no isolation at all, for tools that need none.

Commands run as plain host processes (`/bin/sh -c`) of the calling user in a fresh temporary
directory that stands for `/work`; `write_file` / `read_file` stay inside it (the same path checks
as every backend, symlinks resolved on the host). What it keeps of the limits: the wall-clock
timeout (the command's whole process group is killed), the output caps, the file-size cap, and
an address-space rlimit of `memory_mb`. What it does NOT give: no network isolation, no
read-only root, no separate user, pid namespace or cgroup — a command sees the host as its
user does.

So it is never chosen by `backend="auto"`; a job asks for it by name (`sandbox.backend: none`),
e.g. on a GPU machine without Docker for envs whose tools run the env's own code (reading files
the env wrote, rendering its screens), never for code a policy wrote that must not touch the host.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from .base import Sandbox, _cut, _timed, log
from .paths import WORK_DIR, resolve_in_workdir
from .types import (
    ExecResult,
    PathEscapeError,
    SandboxClosedError,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
)


class UnsandboxedSandbox(Sandbox):
    backend = "none"

    def __init__(self, limits: SandboxLimits | None = None, job: str | None = None):
        super().__init__(limits or SandboxLimits(), job)
        self.base = Path(tempfile.mkdtemp(prefix=f"{self.id}-"))
        self._groups: set[int] = set()  # process groups of commands that may still run

    # -- paths --------------------------------------------------------------------------------
    def host_path(self, path: str, *, allow_root: bool = False) -> Path:
        """The host path of sandbox path `path` (relative to /work); refuses one that leaves the work dir,
        also through a symlink."""
        inside = resolve_in_workdir(path, allow_root=allow_root)
        host = self.base / os.path.relpath(inside, WORK_DIR)
        real = Path(os.path.realpath(host))
        if real != self.base.resolve() and self.base.resolve() not in real.parents:
            raise PathEscapeError(f"sandbox {self.id}: path {path!r} resolves outside the work dir (through a symlink)")
        return host

    # -- the contract -----------------------------------------------------------------------------
    @_timed
    def exec(self, cmd, timeout=None, stdin=None, env=None, workdir=None) -> ExecResult:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed")
        timeout = self.limits.timeout_s if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"exec timeout must be > 0 seconds, got {timeout}")
        args = self._command(cmd, env, workdir)
        cwd = self.host_path(args["cwd"], allow_root=True)
        if not cwd.is_dir():
            raise SandboxFileError(f"sandbox {self.id}: workdir {workdir!r} does not exist (create it first)")
        environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.base), "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg", **args["env"]}
        memory = self.limits.memory_mb << 20

        def limit() -> None:  # in the child: an address-space cap (the only limit a plain process takes)
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

        t0 = time.monotonic()
        proc = subprocess.Popen(["/bin/sh", "-c", args["cmd"]], cwd=cwd, env=environ, start_new_session=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=limit)
        self._groups.add(proc.pid)
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode() if isinstance(stdin, str) else stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill_group(proc.pid)
            out, err = proc.communicate()
        finally:
            self._kill_group(proc.pid)  # what the command left running in its group
            self._groups.discard(proc.pid)
        self.exec_count += 1
        cap = self.limits.output_bytes
        stdout, cut_out = _cut(out[:cap], len(out))
        stderr, cut_err = _cut(err[:cap], len(err))
        code = proc.returncode
        return ExecResult(exit_code=137 if timed_out else (128 - code if code < 0 else code), stdout=stdout,
                          stderr=stderr, timed_out=timed_out, truncated=cut_out or cut_err,
                          duration_s=time.monotonic() - t0)

    @_timed
    def write_file(self, path: str, data: bytes | str) -> None:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed")
        data = data.encode() if isinstance(data, str) else bytes(data)
        if len(data) > self.limits.max_file_bytes:
            raise SandboxFileError(f"write_file({path!r}): {len(data)} bytes is over "
                                   f"max_file_bytes={self.limits.max_file_bytes}")
        host = self.host_path(path)
        host.parent.mkdir(parents=True, exist_ok=True)
        self.host_path(path)  # the parents made may not be links out either
        host.write_bytes(data)

    @_timed
    def read_file(self, path: str) -> bytes:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed")
        host = self.host_path(path)
        if host.is_dir():
            raise SandboxFileError(f"sandbox {self.id}: {path!r} is a directory")
        if not host.is_file():
            raise SandboxFileError(f"sandbox {self.id}: no file {path!r}")
        if host.stat().st_size > self.limits.max_file_bytes:
            raise SandboxFileError(f"sandbox {self.id}: {path!r} is over max_file_bytes={self.limits.max_file_bytes}")
        return host.read_bytes()

    def ping(self, timeout: float = 10.0) -> bool:
        return not self._closed and self.base.is_dir()

    def reset(self) -> None:
        """Kill what the commands left running and empty the work dir (pool reuse)."""
        for pgid in list(self._groups):
            self._kill_group(pgid)
        for child in self.base.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def spawn(self, cmd, env=None, workdir=None):
        raise SandboxError("sandbox.backend none runs commands to completion only (exec); long-lived processes "
                           "(spawn, e.g. an MCP server) need the docker or bwrap backend")

    # -- what the base class asks of a backend ------------------------------------------------------
    def _request(self, mode, args, stdin, host_timeout):
        raise SandboxError(f"the none backend has no in-sandbox agent (asked for {mode!r})")

    def _oom_file(self) -> str | None:
        return None

    def is_alive(self) -> bool:
        return not self._closed and self.base.is_dir()

    def _destroy(self) -> None:
        for pgid in list(self._groups):
            self._kill_group(pgid)
        shutil.rmtree(self.base, ignore_errors=True)

    @staticmethod
    def _kill_group(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        except OSError as e:  # pragma: no cover - reported, never raised from cleanup
            log.warning("could not kill process group %d: %s", pgid, e)
