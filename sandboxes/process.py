"""`SandboxProcess`: a long-lived process in a sandbox, with pipes to its stdin and stdout.

    proc = sandbox.spawn(["python3", "server.py"])
    proc.write(b'{"jsonrpc": "2.0", ...}\\n')
    data = proc.read(timeout=1.0)      # what it wrote since the last read (b"" when nothing yet)
    proc.at_eof                        # its stdout closed (then `returncode`, `stderr_tail`)
    proc.kill()                        # it and everything it started

It travels over the sandbox's agent channel like `exec` (the agent keeps the process and
buffers its stdout), so it works in every backend and needs no network: a server speaking
stdio (MCP, LSP...) runs inside the sandbox and the host talks to it through these calls.
Each `read` waits at most `timeout` seconds; many reads and writes may be in flight at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Sandbox


class SandboxProcess:
    """A process started by `Sandbox.spawn`; ends with `kill()` or with its sandbox."""

    def __init__(self, sandbox: Sandbox, spawn_id: str, cmd: str, pid: int) -> None:
        self.sandbox, self.id, self.cmd, self.pid = sandbox, spawn_id, cmd, pid
        self.at_eof = False
        self.returncode: int | None = None
        self.stderr_tail = ""

    def write(self, data: bytes | str) -> None:
        """Write to its stdin; SandboxError when it no longer reads it (it exited)."""
        self.sandbox._call("send", {"id": self.id}, stdin=data.encode() if isinstance(data, str) else bytes(data))

    def close_stdin(self) -> None:
        self.sandbox._call("send", {"id": self.id, "close": True})

    def read(self, timeout: float = 1.0, max_bytes: int = 1 << 20) -> bytes:
        """Up to `max_bytes` of its stdout, waiting at most `timeout` s for some; b"" when none came
        (check `at_eof`: then its stdout closed and `returncode` / `stderr_tail` say how it ended)."""
        if self.at_eof:
            return b""
        header, payload = self.sandbox._call("recv", {"id": self.id, "timeout": timeout, "max": max_bytes},
                                             timeout=timeout)
        if header["eof"]:
            self.at_eof, self.returncode, self.stderr_tail = True, header["exit_code"], header.get("stderr", "")
        return payload

    def kill(self) -> int | None:
        """End it and every process it started (idempotent); its exit code when known."""
        if self.sandbox.closed:
            return self.returncode
        header, _ = self.sandbox._call("kill", {"id": self.id})
        if header["exit_code"] is not None:
            self.returncode = header["exit_code"]
        self.at_eof = True
        return self.returncode

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"<SandboxProcess {self.cmd!r} pid={self.pid} in {self.sandbox.id}>"
