"""Call a user's Python function inside a sandbox that reaches one host loopback URL, and no network.

    reward = call_in_sandbox(sb, "my_agent.py", "solve", [base_url, model, task], url_arg=0,
                             host_url="http://127.0.0.1:8123/episodes/e1/v1", timeout_s=300)

The module's file is copied into the sandbox and imported there alone (its imports must be in the
sandbox's image: the standard library, or what the image installs). The function runs in
`inside_call_runner.py`, which gives it `http://127.0.0.1:<port><path>` in place of `args[url_arg]`,
a port on the sandbox's own loopback; each connection to it is relayed over the runner's pipes (the
sandbox's agent channel) to `host_url`'s host and port on the host's loopback. The sandbox keeps no
network interface but `lo`: the relay is a pipe, not a route.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .types import SandboxError

RUNNER_SOURCE = Path(__file__).with_name("inside_call_runner.py").read_text()
CALL_DIR = ".k3rl_call"


class SandboxCallError(SandboxError):
    """The function raised inside the sandbox (`traceback` holds its traceback), or never answered."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


def call_in_sandbox(sb: Any, module_file: str | Path, function: str, args: list[Any], *, url_arg: int,
                    host_url: str, timeout_s: float) -> Any:
    """`function(*args)` from `module_file`, run inside `sb`, with `args[url_arg]` a sandbox-local URL relayed
    to `host_url` (which must be on the host's loopback); its JSON-able return value, or SandboxCallError."""
    target = urlsplit(host_url)
    if target.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"host_url {host_url!r} must be on the host's loopback (127.0.0.1): the relay reaches "
                         "nothing else")
    host = (target.hostname, target.port or 80)
    sb.write_file(f"{CALL_DIR}/runner.py", RUNNER_SOURCE)
    sb.write_file(f"{CALL_DIR}/user_module.py", Path(module_file).read_bytes())
    sb.write_file(f"{CALL_DIR}/call.json", json.dumps({
        "module": Path(module_file).stem, "module_file": f"{CALL_DIR}/user_module.py", "function": function,
        "args": args, "url_arg": url_arg, "path": target.path}))
    proc = sb.spawn(["python3", "-u", "-I", f"{CALL_DIR}/runner.py", f"{CALL_DIR}/call.json"])
    relay = _Relay(proc, host)
    try:
        return relay.run(time.monotonic() + timeout_s)
    finally:
        relay.close()
        proc.kill()


class _Relay:
    """The host end: connection N inside the sandbox <-> a socket to `host` here."""

    def __init__(self, proc: Any, host: tuple[str, int]) -> None:
        self.proc, self.host = proc, host
        self.socks: dict[int, socket.socket] = {}

    def run(self, deadline: float) -> Any:
        pending = b""
        while True:
            if time.monotonic() > deadline:
                raise SandboxCallError(f"the call did not return within its time budget; its stderr: "
                                       f"{self.proc.stderr_tail[-2000:]!r}")
            pending += self.proc.read(timeout=0.5)
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    message = json.loads(line)
                    if "result" in message:
                        return message["result"]
                    if "error" in message:
                        raise SandboxCallError(f"the function raised inside the sandbox:\n{message['error']}",
                                               traceback=message["error"])
                    self.handle(message)
            if self.proc.at_eof:
                raise SandboxCallError(f"the sandboxed process ended (exit code {self.proc.returncode}) without an "
                                       f"answer; its stderr: {self.proc.stderr_tail[-2000:]!r}")

    def handle(self, message: dict[str, Any]) -> None:
        n = message["c"]
        sock = self.socks.get(n)
        if sock is None:  # a new connection inside: open its twin here
            sock = self.socks[n] = socket.create_connection(self.host, timeout=None)
            threading.Thread(target=self.to_sandbox, args=(n, sock), daemon=True).start()
        if "d" in message:
            sock.sendall(base64.b64decode(message["d"]))
        elif message.get("eof"):
            sock.shutdown(socket.SHUT_WR)

    def to_sandbox(self, n: int, sock: socket.socket) -> None:
        try:
            while data := sock.recv(1 << 16):
                self.proc.write(json.dumps({"c": n, "d": base64.b64encode(data).decode()}) + "\n")
            self.proc.write(json.dumps({"c": n, "eof": True}) + "\n")
        except (OSError, SandboxError):  # the sandboxed process ended: nothing left to answer
            pass

    def close(self) -> None:
        for sock in self.socks.values():
            try:
                sock.close()
            except OSError:
                pass
