"""Host end of the in-container agent (`inside_helper.py serve`) of a Docker sandbox.

The agent is started once per container with `docker exec -i`; its attach socket stays open.
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
import socket
import struct
import threading


class AgentLost(ConnectionError):
    """The agent's stream closed (its container died, or something killed the agent)."""


class AgentChannel:
    def __init__(self, api, container: str, argv: list[str], user: str, workdir: str):
        exec_id = api.exec_create(
            container, argv, stdin=True, stdout=True, stderr=True, user=user, workdir=workdir
        )["Id"]
        self._hijacked = api.exec_start(exec_id, socket=True)
        self._sock: socket.socket = getattr(self._hijacked, "_sock", self._hijacked)
        self._sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self.stderr_tail = bytearray()
        self.closed = False
        self._reader = threading.Thread(
            target=self._read_loop, name=f"k3rl-agent-{container[:12]}", daemon=True
        )
        self._reader.start()

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
                self._sock.sendall(struct.pack(">QI", req_id, len(body) + len(stdin or b"")) + body)
                if stdin:
                    self._sock.sendall(stdin)
        except OSError as exc:
            self._lost(AgentLost(f"could not send to the sandbox agent: {exc}"))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._pending.pop(req_id, None)
            raise TimeoutError(f"no reply from the sandbox agent within {timeout:.0f}s") from None

    def _read_loop(self) -> None:
        raw, out = bytearray(), bytearray()
        try:
            while True:
                chunk = self._sock.recv(1 << 16)
                if not chunk:
                    break
                raw += chunk
                while len(raw) >= 8:  # Docker's multiplexing frames
                    length = struct.unpack(">I", raw[4:8])[0]
                    if len(raw) < 8 + length:
                        break
                    stream, data = raw[0], bytes(raw[8 : 8 + length])
                    del raw[: 8 + length]
                    if stream == 1:
                        out += data
                        self._dispatch(out)
                    else:
                        self.stderr_tail += data
                        del self.stderr_tail[:-4096]
        except OSError:
            pass
        tail = self.stderr_tail.decode(errors="replace").strip()
        self._lost(
            AgentLost(
                "the sandbox agent's stream closed" + (f" (agent stderr: {tail[-500:]})" if tail else "")
            )
        )

    def _dispatch(self, out: bytearray) -> None:
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
        for closer in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close, self._hijacked.close):
            try:
                closer()
            except OSError:
                pass
