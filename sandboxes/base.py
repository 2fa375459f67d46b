"""`Sandbox`: the contract every backend implements, and the host side of the agent protocol.

A backend only knows how to start/stop its isolation unit and how to send one request to the
sandbox's agent (`inside_helper.py`, `_request`). Everything else — exec semantics, output
caps, path checks, file transfer, async variants — lives here once, so Docker and
bubblewrap behave the same.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shlex
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .paths import WORK_DIR, resolve_in_workdir
from .process import SandboxProcess
from .types import (
    TRUNCATION_MARKER,
    ExecResult,
    PathEscapeError,
    SandboxClosedError,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
)

log = logging.getLogger("k3rl.sandboxes")

HELPER_SOURCE = (Path(__file__).with_name("inside_helper.py")).read_text()
MAGIC = b"K3RL/1 "
# Blocking sandbox calls from asyncio run here: asyncio's default executor has only cpus+4 threads,
# too few for dozens of concurrent tool calls that mostly wait on the sandbox.
EXECUTOR = ThreadPoolExecutor(
    max_workers=int(os.environ.get("K3RL_SANDBOX_THREADS", "64")), thread_name_prefix="k3rl-sb"
)
# The host waits this much longer than the in-sandbox timeout before declaring the sandbox hung.
HOST_SLACK_S = 15.0


async def in_thread(fn, *args, **kwargs):
    """Run a blocking sandbox call on the sandbox thread pool from a coroutine."""
    return await asyncio.get_running_loop().run_in_executor(EXECUTOR, functools.partial(fn, *args, **kwargs))


# The agent is started with a one-line bootstrap that reads its source from stdin (so `ps` in
# the sandbox shows a short command line); the host sends `<length>\n<source>` first.
AGENT_BOOTSTRAP = (
    "import sys; n = int(sys.stdin.buffer.readline()); "
    "exec(compile(sys.stdin.buffer.read(n), 'k3rl-agent', 'exec'))"
)
AGENT_ARGV = ["python3", "-I", "-S", "-c", AGENT_BOOTSTRAP]


def agent_preamble() -> bytes:
    source = HELPER_SOURCE.encode()
    return f"{len(source)}\n".encode() + source


def parse_reply(raw: bytes, where: str) -> tuple[dict, bytes]:
    """Split an agent reply into (header, payload); raise SandboxError when it is malformed."""
    if not raw.startswith(MAGIC) or b"\n" not in raw:
        snippet = raw[:200].decode(errors="replace")
        raise SandboxError(f"{where}: malformed reply from the sandbox agent (got {snippet!r})")
    line, _, payload = raw.partition(b"\n")
    return json.loads(line[len(MAGIC) :]), payload


def _cut(data: bytes, total: int) -> tuple[str, bool]:
    text = data.decode("utf-8", errors="replace")
    if total > len(data):
        return text + "\n" + TRUNCATION_MARKER.format(shown=len(data), total=total) + "\n", True
    return text, False


def _timed(fn):
    """Add the call's wall time to the sandbox's `busy_s`."""

    @functools.wraps(fn)
    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    return timed


class Sandbox(ABC):
    """An isolated place to run commands: `exec`, `write_file`, `read_file`, `close` (+ `a*` async twins).

    Use as a context manager (`with open_sandbox() as sb:` / `async with`). Paths are relative to
    the work dir `/work`; paths that leave it are refused with `PathEscapeError`.
    """

    backend: str = "?"

    def __init__(self, limits: SandboxLimits, job: str | None = None):
        self.limits = limits
        self.job = job or "adhoc"
        self.id = f"k3rl-{self.backend}-{uuid.uuid4().hex[:12]}"
        self.created_at = time.time()
        self.exec_count = 0
        self.busy_s = 0.0  # wall seconds spent in exec / write_file / read_file calls (the env's step timings)
        self._closed = False
        self._lock = threading.Lock()
        self._destroyed = threading.Event()

    # ---- what a backend provides -------------------------------------------------------
    @abstractmethod
    def _request(self, mode: str, args: dict, stdin: bytes | None, host_timeout: float) -> bytes:
        """Send one request to the sandbox's agent; return its reply. Raise SandboxDeadError if gone."""

    @abstractmethod
    def _oom_file(self) -> str | None:
        """Path of the cgroup oom counter *as seen by the helper*, or None (backend checks it itself)."""

    @abstractmethod
    def _destroy(self) -> None:
        """Kill everything and remove all traces (idempotent)."""

    @abstractmethod
    def is_alive(self) -> bool:
        """Cheap liveness check (container running / directories present)."""

    def _settles_dead(self, within_s: float = 3.0) -> bool:
        """After a lost agent: is the sandbox dead? (A killed container may still look running for a moment.)"""
        deadline = time.monotonic() + within_s
        while True:
            if not self.is_alive():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _host_oom_count(self) -> int | None:
        """Backends that watch the cgroup from the host return its oom_kill counter here."""
        return None

    def _exec_limits(self, timeout: float) -> dict:
        """Limits the agent applies to one command itself (a backend without cgroups: CPU seconds)."""
        return {}

    # ---- contract ------------------------------------------------------------------------
    def _call(
        self, mode: str, args: dict, stdin: bytes | None = None, timeout: float = 30.0
    ) -> tuple[dict, bytes]:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed")
        raw = self._request(mode, args, stdin, timeout + HOST_SLACK_S)
        header, payload = parse_reply(raw, f"sandbox {self.id} ({mode})")
        if "error" in header:
            kind, message = header["error"], f"sandbox {self.id}: {header['message']}"
            if kind == "escape":
                raise PathEscapeError(message)
            if kind in ("notfound", "isdir", "toolarge", "nospace"):
                raise SandboxFileError(message)
            raise SandboxError(message)
        return header, payload

    @_timed
    def exec(
        self,
        cmd: str | Sequence[str],
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
    ) -> ExecResult:
        """Run `cmd` (a shell string, or an argv list that is quoted for you) in the sandbox.

        Killed (with every process it started) after `timeout` seconds (default `limits.timeout_s`).
        stdout and stderr are capped at `limits.output_bytes` each and marked when cut.
        """
        timeout = self.limits.timeout_s if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"exec timeout must be > 0 seconds, got {timeout}")
        if isinstance(stdin, str):
            stdin = stdin.encode()
        args = {
            **self._command(cmd, env, workdir),
            "timeout": timeout,
            "cap": self.limits.output_bytes,
            "oom_file": self._oom_file(),
            **self._exec_limits(timeout),
        }
        oom_before = self._host_oom_count()
        header, payload = self._call("exec", args, stdin=stdin, timeout=timeout)
        self.exec_count += 1
        out_len = header["out_len"]
        stdout, cut_out = _cut(payload[:out_len], header["out_total"])
        stderr, cut_err = _cut(payload[out_len : out_len + header["err_len"]], header["err_total"])
        oom = header["oom_killed"]
        if oom_before is not None:
            oom_after = self._host_oom_count()
            oom = oom or (oom_after is not None and oom_after > oom_before)
        return ExecResult(
            exit_code=int(header["exit_code"]),
            stdout=stdout,
            stderr=stderr,
            timed_out=bool(header["timed_out"]),
            oom_killed=bool(oom),
            truncated=cut_out or cut_err,
            duration_s=float(header["duration_s"]),
        )

    def _command(self, cmd: str | Sequence[str], env: Mapping[str, str] | None, workdir: str | None) -> dict:
        """The agent's arguments naming a command: its shell text, environment, working dir, and a fresh id."""
        if not isinstance(cmd, str):
            cmd = shlex.join([str(part) for part in cmd])
        merged = {**self.limits.env, **(env or {})}
        for key, value in merged.items():
            if not isinstance(key, str) or not isinstance(value, str) or "=" in key or not key:
                raise ValueError(
                    f"env must map non-empty names without '=' to str values, got {key!r}={value!r}"
                )
        return {
            "cmd": cmd,
            "id": uuid.uuid4().hex,
            "cwd": resolve_in_workdir(workdir, allow_root=True) if workdir else WORK_DIR,
            "env": merged,
        }

    def spawn(
        self, cmd: str | Sequence[str], env: Mapping[str, str] | None = None, workdir: str | None = None
    ) -> SandboxProcess:
        """Start `cmd` as a long-lived process with pipes to its stdin and stdout (see `SandboxProcess`).

        It runs until it exits, `kill()` ends it, or the sandbox is reset or closed; no timeout applies.
        """
        args = self._command(cmd, env, workdir)
        header, _ = self._call("spawn", args)
        return SandboxProcess(self, args["id"], args["cmd"], header["pid"])

    @_timed
    def write_file(self, path: str, data: bytes | str) -> None:
        """Write `data` to `path` (relative to the work dir); parent dirs are created."""
        if isinstance(data, str):
            data = data.encode()
        if len(data) > self.limits.max_file_bytes:
            raise SandboxFileError(
                f"write_file({path!r}): {len(data)} bytes is over max_file_bytes={self.limits.max_file_bytes}"
            )
        target = resolve_in_workdir(path)
        self._call("write", {"path": target, "max": self.limits.max_file_bytes}, stdin=bytes(data))

    @_timed
    def read_file(self, path: str) -> bytes:
        """Return the bytes of `path` (relative to the work dir)."""
        target = resolve_in_workdir(path)
        header, payload = self._call("read", {"path": target, "max": self.limits.max_file_bytes})
        if len(payload) != header["len"]:
            raise SandboxError(f"read_file({path!r}): got {len(payload)} of {header['len']} bytes")
        return payload

    def ping(self, timeout: float = 10.0) -> bool:
        """Health check: True when a helper round trip succeeds."""
        try:
            header, _ = self._call("ping", {}, timeout=timeout)
            return bool(header.get("ok"))
        except SandboxError:
            return False

    def reset(self) -> None:
        """Kill every process in the sandbox and empty /work and /tmp (reuse between episodes)."""
        self._call("reset", {}, timeout=30.0)

    def close(self) -> None:
        """Destroy the sandbox; nothing it started survives. Idempotent."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            try:
                self._destroy()
            finally:
                self._destroyed.set()
        else:  # another thread is closing it: return only once it is really gone
            self._destroyed.wait(timeout=120)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- async twins (run the blocking call in a worker thread) ---------------------------
    async def aexec(self, cmd, timeout=None, stdin=None, env=None, workdir=None) -> ExecResult:
        return await in_thread(self.exec, cmd, timeout, stdin, env, workdir)

    async def awrite_file(self, path: str, data: bytes | str) -> None:
        await in_thread(self.write_file, path, data)

    async def aread_file(self, path: str) -> bytes:
        return await in_thread(self.read_file, path)

    async def aping(self, timeout: float = 10.0) -> bool:
        return await in_thread(self.ping, timeout)

    async def areset(self) -> None:
        await in_thread(self.reset)

    async def aclose(self) -> None:
        await in_thread(self.close)

    # ---- context managers -------------------------------------------------------------------
    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __del__(self):  # last resort; close() is the contract
        try:
            if not self._closed:
                log.warning("sandbox %s was garbage-collected without close(); closing it now", self.id)
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.id} job={self.job} {state}>"
