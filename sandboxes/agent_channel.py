"""Host end of a sandbox's agent (`inside_helper.py serve`): one long-lived process per sandbox.

Docker: the agent is started once per container with `docker exec -i`; its attach socket
stays open. bubblewrap: the agent is the process bwrap runs, talking over pipes.
Requests are written as frames `>QI` (request id, length) + `JSON\\n` + input bytes; Docker
multiplexes the agent's stdout/stderr back (8-byte headers: stream, 0, 0, 0, `>I` length),
and the agent's stdout carries reply frames `>QI` (request id, length) + reply. A reader
thread matches replies to the waiting callers, so many calls can be in flight at once. When
the socket closes (container killed, agent killed), every waiting call gets `AgentLost`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import signal
import socket
import struct
import subprocess
import threading
from abc import ABC, abstractmethod


class AgentLost(ConnectionError):
    """The agent's stream closed (its container died, or something killed the agent)."""


class AgentChannel(ABC):
    """Request/reply multiplexing over one agent's byte streams; transports subclass it."""

    def __init__(self, name: str, preamble: bytes):
        self._send(preamble)  # the agent's source (see base.AGENT_BOOTSTRAP)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self.stderr_tail = bytearray()
        self.closed = False
        self._out = bytearray()
        self._reader = threading.Thread(target=self._read_loop, name=f"k3rl-agent-{name}", daemon=True)
        self._reader.start()

    # transport ------------------------------------------------------------------------------
    @abstractmethod
    def _send(self, data: bytes) -> None:
        """Write bytes to the agent's stdin."""

    @abstractmethod
    def _pump(self) -> None:
        """Read the transport until it closes, calling `_on_stdout` / `_on_stderr`."""

    @abstractmethod
    def _close_transport(self) -> None:
        """Stop the agent and release the transport."""

    # protocol -------------------------------------------------------------------------------
    def request(self, mode: str, args: dict, stdin: bytes | None, timeout: float) -> bytes:
        """Send one request and wait (up to `timeout` s) for its reply bytes."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                raise AgentLost("the sandbox agent's stream is closed")
            req_id = next(self._ids)
            self._pending[req_id] = future
        body = json.dumps({"mode": mode, "args": args, "has_stdin": stdin is not None}).encode() + b"\n"
        try:
            with self._send_lock:
                self._send(struct.pack(">QI", req_id, len(body) + len(stdin or b"")) + body + (stdin or b""))
        except OSError as exc:
            self._lost(AgentLost(f"could not send to the sandbox agent: {exc}"))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._pending.pop(req_id, None)
            raise TimeoutError(f"no reply from the sandbox agent within {timeout:.0f}s") from None

    def _read_loop(self) -> None:
        try:
            self._pump()
        except (OSError, ValueError):
            pass
        tail = self.stderr_tail.decode(errors="replace").strip()
        self._lost(
            AgentLost(
                "the sandbox agent's stream closed" + (f" (agent stderr: {tail[-500:]})" if tail else "")
            )
        )

    def _on_stderr(self, data: bytes) -> None:
        self.stderr_tail += data
        del self.stderr_tail[:-4096]

    def _on_stdout(self, data: bytes) -> None:
        out = self._out
        out += data
        while len(out) >= 12:
            req_id, length = struct.unpack(">QI", out[:12])
            if len(out) < 12 + length:
                return
            body = bytes(out[12 : 12 + length])
            del out[: 12 + length]
            with self._lock:
                future = self._pending.pop(req_id, None)
            if future is not None:
                future.set_result(body)

    def _lost(self, exc: AgentLost) -> None:
        with self._lock:
            self.closed = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(exc)

    def close(self) -> None:
        self._lost(AgentLost("the sandbox was closed"))
        self._close_transport()


class DockerAgentChannel(AgentChannel):
    """The agent runs as a `docker exec -i` process; its attach socket carries both directions."""

    def __init__(self, api, container: str, argv: list[str], preamble: bytes, user: str, workdir: str):
        exec_id = api.exec_create(
            container, argv, stdin=True, stdout=True, stderr=True, user=user, workdir=workdir
        )["Id"]
        self._hijacked = api.exec_start(exec_id, socket=True)
        self._sock: socket.socket = getattr(self._hijacked, "_sock", self._hijacked)
        self._sock.settimeout(None)
        super().__init__(container[:12], preamble)

    def _send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def _pump(self) -> None:
        raw = bytearray()
        while True:
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                return
            raw += chunk
            while len(raw) >= 8:  # Docker's multiplexing frames
                length = struct.unpack(">I", raw[4:8])[0]
                if len(raw) < 8 + length:
                    break
                stream, data = raw[0], bytes(raw[8 : 8 + length])
                del raw[: 8 + length]
                (self._on_stdout if stream == 1 else self._on_stderr)(data)

    def _close_transport(self) -> None:
        for closer in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close, self._hijacked.close):
            try:
                closer()
            except OSError:
                pass


# bwrap's --die-with-parent fires when the *thread* that started it exits, so every agent is
# started from this one long-lived thread.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3rl-agent-spawn")


class PipeAgentChannel(AgentChannel):
    """The agent is a local process (bubblewrap) talking over its stdin/stdout pipes."""

    def __init__(self, argv: list[str], preamble: bytes, name: str):
        self.proc = _SPAWNER.submit(
            subprocess.Popen,
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        ).result()
        super().__init__(name, preamble)
        threading.Thread(target=self._pump_stderr, name=f"k3rl-agent-err-{name}", daemon=True).start()

    def _send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _pump(self) -> None:
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 1 << 16):
            self._on_stdout(chunk)

    def _pump_stderr(self) -> None:
        try:
            fd = self.proc.stderr.fileno()
            while chunk := os.read(fd, 1 << 16):
                self._on_stderr(chunk)
        except (OSError, ValueError):
            pass

    def _close_transport(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass
