"""A sandbox's memory watched from the host, for bubblewrap without cgroups (a user without root).

rlimits cap each process's address space, not the sandbox's: five processes of `memory_mb` each fit. While
a call runs, `MemoryWatch` sums the resident memory of the sandbox's processes every `interval_s`
(/proc, no dependency) and, past the limit, SIGKILLs the call's processes, the sandbox's agent and its
bubblewrap parents spared: the call ends with 137 and `oom_killed`, as under a cgroup's OOM killer.

    total = sum over the tree below the agent and the agent itself of /proc/<pid>/statm resident x page size
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
AGENT_DEPTH = 2  # bwrap (the host's child) -> bwrap, the sandbox's PID 1 -> the agent -> the calls' processes


def children_map() -> dict[int, list[int]]:
    """Every process's children, from one pass over /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def tree_by_depth(root: int) -> list[tuple[int, int]]:
    """(pid, depth) of `root` (depth 0) and its descendants."""
    kids, out, todo = children_map(), [], [(root, 0)]
    while todo:
        pid, depth = todo.pop()
        out.append((pid, depth))
        todo.extend((child, depth + 1) for child in kids.get(pid, ()))
    return out


def resident_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0  # gone meanwhile


class MemoryWatch:
    """`with MemoryWatch(bwrap_pid, limit) as watch: ...` then `watch.killed`."""

    def __init__(self, root_pid: int, limit_bytes: int, interval_s: float = 0.05):
        self.root, self.limit, self.interval = root_pid, limit_bytes, interval_s
        self.killed = False
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k3rl-sandbox-memory", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            tree = [(pid, depth) for pid, depth in tree_by_depth(self.root) if depth >= AGENT_DEPTH]
            total = sum(resident_bytes(pid) for pid, _ in tree)
            self.peak = max(self.peak, total)
            if total > self.limit:
                for pid, depth in tree:
                    if depth > AGENT_DEPTH:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                self.killed = True
