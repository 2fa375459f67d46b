"""Processes as the tests look at them, through /proc: a process's descendants, and which are still alive."""

from __future__ import annotations

import time
from pathlib import Path


def _state(pid: int) -> str | None:
    """The /proc state letter of `pid` ("Z" for a zombie), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (zombies count as gone)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int], within_s: float = 0.0) -> set[int]:
    """The pids still running after waiting up to `within_s` for them to go (zombies count as gone)."""
    deadline = time.monotonic() + within_s
    while True:
        running = {p for p in pids if _state(p) not in (None, "Z")}
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.1)


def port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def start_ui(uri: str, cwd: Path, timeout_s: float = 180.0):
    """`k3rl ui` on a free loopback port, returned once its MLflow server answers, as (the k3rl ui
    process, the port, the server's processes). The caller stops them."""
    import subprocess
    import sys

    from k3rl.cluster import free_port

    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "k3rl.cli", "ui", "--port", str(port), "--tracking-uri", uri],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not port_open(port):
        if ui.poll() is not None:
            raise AssertionError("k3rl ui exited before its server answered")
        if time.monotonic() > deadline:
            ui.kill()
            raise AssertionError(f"the MLflow server did not answer within {timeout_s:.0f} s")
        time.sleep(0.5)
    return ui, port, descendants(ui.pid)
