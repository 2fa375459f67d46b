"""Per-sandbox cgroups for the bubblewrap backend (Docker does this itself).

`SandboxCgroup.create(name, limits)` returns a cgroup with memory (no swap), pids and CPU
limits when the host lets us write cgroups (root on cgroup v1, or a writable v2 tree), else
None — the backend then falls back to rlimits and says so. Processes join by writing their
own pid into `cgroup.procs` before they exec bwrap (`join_paths`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from .types import SandboxLimits

ROOT = Path("/sys/fs/cgroup")
PARENT = "k3rl"
CPU_PERIOD_US = 100_000


def _write(path: Path, value: str) -> None:
    path.write_text(value)


class SandboxCgroup:
    def __init__(self, version: int, dirs: dict[str, Path]):
        self.version = version
        self.dirs = dirs  # controller -> directory ("unified" for v2)

    @staticmethod
    def create(name: str, limits: SandboxLimits) -> SandboxCgroup | None:
        """Create and configure the cgroup; None when the host does not allow it."""
        try:
            if (ROOT / "cgroup.controllers").exists():
                return SandboxCgroup._create_v2(name, limits)
            if (ROOT / "memory").is_dir() and (ROOT / "pids").is_dir():
                return SandboxCgroup._create_v1(name, limits)
        except OSError:
            return None
        return None

    @staticmethod
    def _create_v1(name: str, limits: SandboxLimits) -> SandboxCgroup:
        dirs: dict[str, Path] = {}
        try:
            for controller in ("memory", "pids", "cpu"):
                parent = ROOT / controller / PARENT
                if not (ROOT / controller).is_dir():
                    continue
                parent.mkdir(exist_ok=True)
                path = parent / name
                path.mkdir()
                dirs[controller] = path
            group = SandboxCgroup(1, dirs)
            memory = limits.memory_mb << 20
            _write(dirs["memory"] / "memory.limit_in_bytes", str(memory))
            if (dirs["memory"] / "memory.memsw.limit_in_bytes").exists():
                _write(dirs["memory"] / "memory.memsw.limit_in_bytes", str(memory))
            _write(dirs["pids"] / "pids.max", str(limits.pids))
            if "cpu" in dirs:
                _write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(dirs["cpu"] / "cpu.cfs_quota_us", str(int(limits.cpus * CPU_PERIOD_US)))
            return group
        except OSError:
            SandboxCgroup(1, dirs).remove()
            raise

    @staticmethod
    def _create_v2(name: str, limits: SandboxLimits) -> SandboxCgroup:
        parent = ROOT / PARENT
        parent.mkdir(exist_ok=True)
        for ctl in ("memory", "pids", "cpu"):
            for where in (ROOT, parent):
                try:
                    _write(where / "cgroup.subtree_control", f"+{ctl}")
                except OSError:
                    pass
        path = parent / name
        path.mkdir()
        group = SandboxCgroup(2, {"unified": path})
        try:
            _write(path / "memory.max", str(limits.memory_mb << 20))
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0")
            _write(path / "pids.max", str(limits.pids))
            if (path / "cpu.max").exists():
                _write(path / "cpu.max", f"{int(limits.cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
        except OSError:
            group.remove()
            raise
        return group

    def join_paths(self) -> list[str]:
        """Files a process writes its pid into to join this cgroup (all controllers)."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def oom_kills(self) -> int | None:
        path = (
            self.dirs["memory"] / "memory.oom_control"
            if self.version == 1
            else self.dirs["unified"] / "memory.events"
        )
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError, KeyError):
            return None
        return None

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return sorted(found)

    def kill_all(self) -> None:
        for _ in range(200):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
