"""bubblewrap backend: same contract as Docker, no daemon needed.

A sandbox is a host directory (`work/` -> /work, `tmp/` -> /tmp) plus, when the host allows,
a cgroup (memory / pids / CPU), plus one long-lived `bwrap` that runs the sandbox's agent
(`inside_helper.py serve`, see `agent_channel`): all namespaces unshared (network: only `lo`;
pid: killing bwrap kills everything inside), `--die-with-parent`, read-only root (the sandbox
image's rootfs from `k3rl sandbox build`, else the host's /usr), uid 1000 inside, no
capabilities. As with Docker, files, /tmp and background processes persist across execs, and
an exec costs no process start on the host. When the host is root, bwrap runs
as `nobody` on the host (via setpriv), so the sandbox has no host privileges at all.
Without writable cgroups the limits fall back to rlimits (prlimit: address space, process
count; each process of a call gets `cpus x timeout` CPU seconds instead of a CPU share), and the
host watches the sandbox's resident memory during each call (`memory_watch`): past `memory_mb` the
call's processes are killed and the result says `oom_killed`, as under a cgroup.
Disk: /tmp is a tmpfs capped at `tmp_mb`, as Docker's. /work stays a host folder, so its files
outlive the agent's processes; no file may grow past `workdir_mb` (RLIMIT_FSIZE), and after each
call a /work over `workdir_mb` loses its newest files until it fits, which the call's stderr says.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import shlex
import shutil
import socket as socketlib
import subprocess
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from .agent_channel import AgentLost, PipeAgentChannel
from .base import AGENT_ARGV, Sandbox, agent_preamble, log
from .cgroups import SandboxCgroup
from .docker_backend import SANDBOX_ENV
from .image import SANDBOX_UID, TMP_SEED_DIR, rootfs_dir
from .memory_watch import MemoryWatch
from .paths import WORK_DIR
from .seccomp import filter_program
from .types import (
    BackendUnavailableError,
    ExecResult,
    SandboxClosedError,
    SandboxDeadError,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
)

NOBODY = 65534
SHARED_PIDS = 24  # without cgroups: how many sandboxes' `pids` the uid's one process budget holds
OWNER_FILE = "k3rl-owner.json"


def sandbox_base_dir() -> Path:
    return Path(os.environ.get("K3RL_SANDBOX_DIR") or os.path.join(tempfile.gettempdir(), "k3rl-sandboxes"))


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def bwrap_available() -> bool:
    """True when bwrap exists and can create its namespaces here (quick real probe)."""
    exe = bwrap_path()
    if exe is None:
        return False
    argv = [exe, "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "--", "/bin/true"]
    if os.geteuid() == 0 and shutil.which("setpriv"):
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    try:
        return subprocess.run(argv, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def _bwrap_help(exe: str) -> str:
    try:
        return subprocess.run([exe, "--help"], capture_output=True, text=True).stdout
    except OSError:
        return ""


def _supports_disable_userns(exe: str) -> bool:
    """bwrap >= 0.8 can forbid new user namespaces inside (a large kernel attack surface)."""
    return "--disable-userns" in _bwrap_help(exe)


def _supports_tmpfs_size(exe: str) -> bool:
    """bwrap >= 0.8 can cap a tmpfs's size (`--size BYTES --tmpfs DEST`)."""
    return "--size" in _bwrap_help(exe)


def disk_usage(root: Path) -> tuple[int, list[tuple[float, Path]]]:
    """(bytes a tree occupies on disk, its files as (mtime, path)); symlinks are not followed."""
    total, files = 0, []
    for sub, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(sub) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            total += st.st_blocks * 512
            if name in names:
                files.append((st.st_mtime, path))
    return total, files


def tasks_of_uid(uid: int) -> int:
    """The tasks (threads, which the kernel's RLIMIT_NPROC counts, not just processes) that `uid` runs."""
    n = 0
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                n += sum(1 for _ in (entry / "task").iterdir())
        except OSError:
            continue
    return n


def _root_binds(rootfs: Path | None) -> list[str]:
    if rootfs is not None:
        return ["--ro-bind", str(rootfs), "/"]
    binds = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("bin", "sbin", "lib", "lib64", "lib32"):
        host = Path("/") / name
        if host.is_symlink():
            binds += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            binds += ["--ro-bind", str(host), f"/{name}"]
    return binds


class BwrapSandbox(Sandbox):
    backend = "bwrap"

    def __init__(
        self, limits: SandboxLimits | None = None, job: str | None = None, rootfs: str | Path | None = None
    ):
        super().__init__(limits or SandboxLimits(), job)
        self.bwrap = bwrap_path()
        if self.bwrap is None:
            raise BackendUnavailableError("bubblewrap is not installed: apt-get install -y bubblewrap")
        if rootfs is None and (rootfs_dir() / "usr/bin/python3").exists():
            rootfs = rootfs_dir()
        self.rootfs = Path(rootfs) if rootfs is not None else None
        if self.rootfs is None:
            log.warning(
                "bwrap sandbox %s uses the host's /usr (no sandbox rootfs; run `k3rl sandbox build`)", self.id
            )
        elif not (self.rootfs / "usr/bin/python3").exists():
            raise BackendUnavailableError(
                f"rootfs {self.rootfs} has no usr/bin/python3; rebuild with `k3rl sandbox build`"
            )
        self._drop_to_nobody = os.geteuid() == 0
        if self._drop_to_nobody and shutil.which("setpriv") is None:
            raise BackendUnavailableError(
                "running bwrap as root needs setpriv (util-linux) to drop to nobody"
            )
        base_parent = sandbox_base_dir()
        base_parent.mkdir(parents=True, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(prefix=self.id + "-", dir=base_parent))
        self._agent: PipeAgentChannel | None = None
        self._agent_lock = threading.Lock()
        self.cgroup: SandboxCgroup | None = None
        self.seccomp: Path | None = None
        try:
            (self.base / OWNER_FILE).write_text(
                json.dumps(
                    {"host": socketlib.gethostname(), "pid": os.getpid(), "job": self.job, "sandbox": self.id}
                )
            )
            # /tmp: a tmpfs capped at tmp_mb (as Docker's), seeded by the agent; a host dir on an older bwrap
            self._tmpfs = _supports_tmpfs_size(self.bwrap)
            for sub in ("work",) if self._tmpfs else ("work", "tmp"):
                (self.base / sub).mkdir()
            seed = self.rootfs / TMP_SEED_DIR.lstrip("/") if self.rootfs else None
            if not self._tmpfs and seed is not None and seed.is_dir():  # matplotlib font cache etc.
                shutil.copytree(seed, self.base / "tmp", dirs_exist_ok=True, symlinks=True)
            if self._drop_to_nobody:
                for sub in ("work",) if self._tmpfs else ("work", "tmp"):
                    for path in [self.base / sub, *(self.base / sub).rglob("*")]:
                        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
            os.chmod(self.base, 0o711)
            program = filter_program()
            self.seccomp = self.base / "seccomp.bpf" if program else None
            if self.seccomp is not None:
                self.seccomp.write_bytes(program)
            else:
                log.warning("bwrap sandbox %s: no seccomp filter for this architecture (%s)", self.id,
                            platform.machine())
            self.cgroup = SandboxCgroup.create(self.id, self.limits)
        except Exception:
            self._destroy()
            raise
        if self.cgroup is None:
            log.warning("bwrap sandbox %s: no writable cgroups here, limits fall back to rlimits", self.id)
        try:  # warm: the agent runs before the first call, and a broken setup fails here, not later
            self._start_agent().request("ping", {}, None, 60.0)
        except Exception as exc:
            self._destroy()
            raise SandboxError(f"could not start bwrap sandbox {self.id}: {exc}") from exc

    @property
    def workdir_on_host(self) -> Path:
        return self.base / "work"

    def _oom_file(self) -> str | None:
        return None  # the host reads the cgroup counter itself

    def _host_oom_count(self) -> int | None:
        return self.cgroup.oom_kills() if self.cgroup else None

    def is_alive(self) -> bool:
        return not self._closed and (self.base / "work").is_dir()

    def _exec_limits(self, timeout: float) -> dict:
        # without cgroups no CPU share holds: each process of a call gets cpus x timeout CPU seconds (RLIMIT_CPU)
        return {} if self.cgroup is not None else {"cpu_s": math.ceil(self.limits.cpus * timeout) + 1}

    # /work is a host folder (its files outlive the agent's processes): a file is capped at workdir_mb by
    # RLIMIT_FSIZE, and the whole folder after each call, when the newest files go until it fits (Docker's
    # tmpfs would have refused their writes: ENOSPC)
    def exec(self, cmd, timeout=None, stdin=None, env=None, workdir=None) -> ExecResult:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed")
        if self.cgroup is None and self.host_pid is None:
            self._start_agent()  # the watch below needs the sandbox's processes to exist
        watch = (MemoryWatch(self.host_pid, self.limits.memory_mb << 20) if self.cgroup is None and self.host_pid
                 else contextlib.nullcontext())
        with watch:
            result = super().exec(cmd, timeout=timeout, stdin=stdin, env=env, workdir=workdir)
        if isinstance(watch, MemoryWatch) and watch.killed:  # the sandbox's memory, not one process's
            result = replace(result, oom_killed=True)
        full = self._enforce_workdir_quota()
        if full:
            result = replace(result, exit_code=result.exit_code or 1, stderr=result.stderr + full)
        return result

    def write_file(self, path: str, data: bytes | str) -> None:
        size = len(data.encode() if isinstance(data, str) else data)
        used, _ = disk_usage(self.base / "work")
        if used + size > self.limits.workdir_mb << 20:
            raise SandboxFileError(
                f"write_file({path!r}): no space left in /work: it holds {used / 2**20:.1f} MB of its "
                f"{self.limits.workdir_mb} MB (sandbox workdir_mb) and the file is {size / 2**20:.1f} MB"
            )
        super().write_file(path, data)

    def _enforce_workdir_quota(self) -> str:
        """'' while /work fits its quota; else the newest files are removed until it does, and a note says which."""
        quota, work = self.limits.workdir_mb << 20, self.base / "work"
        used, files = disk_usage(work)
        if used <= quota:
            return ""
        before, removed = used, []
        for _, path in sorted(files, reverse=True):
            if used <= quota:
                break
            try:
                size = path.lstat().st_blocks * 512
                path.unlink()
            except OSError:
                continue
            used -= size
            removed.append(str(path.relative_to(work)))
        log.warning("bwrap sandbox %s: /work held %d bytes, over its quota; removed %s", self.id, before, removed)
        shown = ", ".join(removed[:10]) + (f" and {len(removed) - 10} more" if len(removed) > 10 else "")
        return (f"\n[k3rl: No space left on device: /work held {before / 2**20:.1f} MB, over its "
                f"{self.limits.workdir_mb} MB (sandbox workdir_mb); the newest files were removed to fit: {shown}]\n")

    def _argv(self, inner: list[str]) -> list[str]:
        argv = [
            self.bwrap, "--die-with-parent", "--new-session", "--unshare-all", "--unshare-user",
            "--hostname", "sandbox", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            *(["--disable-userns"] if _supports_disable_userns(self.bwrap) else []),
            *_root_binds(self.rootfs),
            "--dev", "/dev", "--proc", "/proc",
            "--bind", str(self.base / "work"), WORK_DIR,
            *(["--perms", "1777", "--size", str(self.limits.tmp_mb << 20), "--tmpfs", "/tmp"] if self._tmpfs
              else ["--bind", str(self.base / "tmp"), "/tmp"]),
            "--chdir", WORK_DIR, "--clearenv",
        ]  # fmt: skip
        for key, value in SANDBOX_ENV.items():
            argv += ["--setenv", key, value]
        if self._tmpfs:
            argv += ["--setenv", "K3RL_SEED_TMP", "1"]
        if self.cgroup is None:  # RLIMIT_AS counts address space: glibc's per-thread arenas (64 MiB each,
            argv += ["--setenv", "MALLOC_ARENA_MAX", "2"]  # reserved) used it up before memory did
        if self.seccomp is not None:  # the shell prefix below opens it as fd 3; bwrap loads it before the command
            argv += ["--seccomp", "3"]
        argv += ["--cap-drop", "ALL", "--", *inner]
        if self._drop_to_nobody:
            argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
        # a shell prefix (still as the caller) joins the cgroup, or sets rlimits, then execs bwrap
        if self.cgroup is not None:
            prefix = "".join(f"echo $$ > {shlex.quote(p)} || exit 125; " for p in self.cgroup.join_paths())
            if shutil.which("prlimit"):  # no file larger than /work's quota (the whole folder: after each call)
                argv = ["prlimit", f"--fsize={self.limits.workdir_mb << 20}", "--", *argv]
        else:
            prefix = ""
            argv = [*self._rlimit_argv(), *argv]
        if self.seccomp is not None:
            prefix = f"exec 3< {shlex.quote(str(self.seccomp))} || exit 125; " + prefix
        return ["/bin/sh", "-c", prefix + 'exec "$@"', "k3rl-bwrap", *argv]

    def _rlimit_argv(self) -> list[str]:
        """Fallback limits without cgroups: address space and process count (prlimit, util-linux).

        RLIMIT_NPROC counts every task (thread) of the real uid the sandbox runs as, so the limit is the
        sandbox's `pids` on top of what that uid already runs.
        """
        if shutil.which("prlimit") is None:
            log.warning("bwrap sandbox %s: neither cgroups nor prlimit here; no memory/pids limits", self.id)
            return []
        running = tasks_of_uid(NOBODY if self._drop_to_nobody else os.getuid())
        memory = self.limits.memory_mb << 20
        # RLIMIT_NPROC is per uid, and every sandbox of a job runs as one uid: sandboxes started later raise
        # the count an earlier one's limit is checked against. So the budget is shared by up to SHARED_PIDS
        # sandboxes' worth of tasks: a fork bomb stops there, not at this sandbox's own `pids`.
        return ["prlimit", f"--as={memory}", f"--nproc={running + SHARED_PIDS * self.limits.pids}",
                f"--fsize={self.limits.workdir_mb << 20}", "--"]

    def _start_agent(self) -> PipeAgentChannel:
        with self._agent_lock:
            if self._agent is None or self._agent.closed:
                if self._agent is not None:
                    self._agent.close()  # reap the old process tree
                self._agent = PipeAgentChannel(self._argv(AGENT_ARGV), agent_preamble(), self.id)
            return self._agent

    @property
    def host_pid(self) -> int | None:
        """Host pid of the sandbox's process tree root (its bwrap), None before the first call."""
        agent = self._agent
        return agent.proc.pid if agent is not None and not agent.closed else None

    def _request(self, mode: str, args: dict, stdin: bytes | None, host_timeout: float) -> bytes:
        if not self.is_alive():
            raise SandboxDeadError(
                f"sandbox {self.id}: its directory {self.base} is gone (removed from outside?)"
            )
        agent = self._start_agent()
        try:
            return agent.request(mode, args, stdin, host_timeout)
        except AgentLost as exc:
            if self._closed:
                raise SandboxDeadError(f"sandbox {self.id} was closed during {mode}") from exc
            code = agent.proc.poll()
            if code == 125:
                raise SandboxError(f"sandbox {self.id}: could not join its cgroup or open its seccomp filter: {exc}") from exc
            raise SandboxDeadError(
                f"the processes of sandbox {self.id} were killed during {mode} (killed from outside, or the "
                "command killed every process, e.g. `kill -9 -1`); its files are kept and the next call "
                f"starts fresh processes ({exc})"
            ) from exc
        except TimeoutError as exc:
            raise SandboxError(f"sandbox {self.id} did not answer within {host_timeout:.0f}s") from exc

    def _destroy(self) -> None:
        agent = getattr(self, "_agent", None)
        if agent is not None:
            agent.close()  # kills bwrap's process group: its pid namespace and everything in it die
        if self.cgroup is not None:
            self.cgroup.remove()
        for _ in range(20):
            shutil.rmtree(self.base, ignore_errors=True)
            if not self.base.exists():
                break
            time.sleep(0.05)
