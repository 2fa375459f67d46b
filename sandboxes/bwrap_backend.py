"""bubblewrap backend: same contract as Docker, no daemon needed.

A sandbox is a host directory (`work/` -> /work, `tmp/` -> /tmp) plus, when the host allows,
a cgroup (memory / pids / CPU). Every exec is a fresh `bwrap` with all namespaces unshared
(network: only `lo`; pid: killing its init kills everything inside), `--die-with-parent`,
read-only root (the sandbox image's rootfs from `k3rl sandbox build`, else the host's /usr),
uid 1000 inside, no capabilities. Files and /tmp persist across execs; processes do not
(unlike Docker, a background job ends with its exec). When the host is root, bwrap runs
as `nobody` on the host (via setpriv), so the sandbox has no host privileges at all.
Without writable cgroups the limits fall back to rlimits (prlimit: address space, process
count), and `oom_killed` can no longer be observed (an allocation fails instead).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket as socketlib
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from .base import Sandbox, helper_argv, log
from .cgroups import SandboxCgroup
from .docker_backend import SANDBOX_ENV
from .image import SANDBOX_UID, TMP_SEED_DIR, rootfs_dir
from .paths import WORK_DIR
from .types import BackendUnavailableError, SandboxDeadError, SandboxError, SandboxLimits

NOBODY = 65534
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
        self._procs: set[subprocess.Popen] = set()
        self._procs_lock = threading.Lock()
        self.cgroup: SandboxCgroup | None = None
        try:
            (self.base / OWNER_FILE).write_text(
                json.dumps(
                    {"host": socketlib.gethostname(), "pid": os.getpid(), "job": self.job, "sandbox": self.id}
                )
            )
            for sub in ("work", "tmp"):
                (self.base / sub).mkdir()
            seed = self.rootfs / TMP_SEED_DIR.lstrip("/") if self.rootfs else None
            if seed is not None and seed.is_dir():  # matplotlib font cache etc. (see image.TMP_SEED_DIR)
                shutil.copytree(seed, self.base / "tmp", dirs_exist_ok=True, symlinks=True)
            if self._drop_to_nobody:
                for sub in ("work", "tmp"):
                    for path in [self.base / sub, *(self.base / sub).rglob("*")]:
                        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
            os.chmod(self.base, 0o711)
            self.cgroup = SandboxCgroup.create(self.id, self.limits)
        except Exception:
            self._destroy()
            raise
        if self.cgroup is None:
            log.warning("bwrap sandbox %s: no writable cgroups here, limits fall back to rlimits", self.id)

    @property
    def workdir_on_host(self) -> Path:
        return self.base / "work"

    def _oom_file(self) -> str | None:
        return None  # the host reads the cgroup counter itself

    def _host_oom_count(self) -> int | None:
        return self.cgroup.oom_kills() if self.cgroup else None

    def is_alive(self) -> bool:
        return not self._closed and (self.base / "work").is_dir()

    def _argv(self, inner: list[str]) -> list[str]:
        argv = [
            self.bwrap, "--die-with-parent", "--new-session", "--unshare-all", "--unshare-user",
            "--hostname", "sandbox", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            *_root_binds(self.rootfs),
            "--dev", "/dev", "--proc", "/proc",
            "--bind", str(self.base / "work"), WORK_DIR, "--bind", str(self.base / "tmp"), "/tmp",
            "--chdir", WORK_DIR, "--clearenv",
        ]  # fmt: skip
        for key, value in SANDBOX_ENV.items():
            argv += ["--setenv", key, value]
        argv += ["--cap-drop", "ALL", "--", *inner]
        if self._drop_to_nobody:
            argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
        # a shell prefix (still as the caller) joins the cgroup, or sets rlimits, then execs bwrap
        if self.cgroup is not None:
            prefix = "".join(f"echo $$ > {shlex.quote(p)} || exit 125; " for p in self.cgroup.join_paths())
        else:
            prefix = ""
            argv = [*self._rlimit_argv(), *argv]
        return ["/bin/sh", "-c", prefix + 'exec "$@"', "k3rl-bwrap", *argv]

    def _rlimit_argv(self) -> list[str]:
        """Fallback limits without cgroups: address space and process count (prlimit, util-linux).

        RLIMIT_NPROC counts every process of the real uid the sandbox runs as, so the limit is the
        sandbox's `pids` on top of what that uid already runs.
        """
        if shutil.which("prlimit") is None:
            log.warning("bwrap sandbox %s: neither cgroups nor prlimit here; no memory/pids limits", self.id)
            return []
        uid = NOBODY if self._drop_to_nobody else os.getuid()
        running = 0
        for entry in Path("/proc").iterdir():
            try:
                running += entry.name.isdigit() and entry.stat().st_uid == uid
            except OSError:
                continue
        memory = self.limits.memory_mb << 20
        return ["prlimit", f"--as={memory}", f"--nproc={running + self.limits.pids}", "--"]

    def _run_helper(
        self, mode: str, args: dict, stdin: bytes | None, host_timeout: float
    ) -> tuple[bytes, bytes]:
        if not self.is_alive():
            raise SandboxDeadError(
                f"sandbox {self.id}: its directory {self.base} is gone (removed from outside?)"
            )
        argv = self._argv(helper_argv("python3", mode, args))
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        with self._procs_lock:
            self._procs.add(proc)
        try:
            out, err = proc.communicate(stdin, timeout=host_timeout)
        except subprocess.TimeoutExpired as exc:
            self._kill(proc)
            proc.communicate()
            raise SandboxError(f"sandbox {self.id} did not answer within {host_timeout:.0f}s") from exc
        finally:
            with self._procs_lock:
                self._procs.discard(proc)
        if proc.returncode == 125 and not out:
            raise SandboxError(
                f"sandbox {self.id}: could not join its cgroup: {err.decode(errors='replace')}"
            )
        if proc.returncode != 0 and not out:
            if self._closed or not self.is_alive():
                raise SandboxDeadError(f"sandbox {self.id} was closed or removed while running {mode}")
            if proc.returncode < 0:
                raise SandboxDeadError(
                    f"sandbox {self.id}: bwrap was killed by signal {-proc.returncode} during {mode} "
                    "(killed from outside?)"
                )
            if proc.returncode == 128 + signal.SIGKILL:
                raise SandboxError(
                    f"the helper of sandbox {self.id} was killed during {mode} (did the command kill every "
                    "process, e.g. `kill -9 -1`?); the sandbox itself is fine"
                )
            raise SandboxError(
                f"bwrap failed (exit {proc.returncode}): {err.decode(errors='replace')[-2000:]}"
            )
        return out, err

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _destroy(self) -> None:
        with self._procs_lock:
            procs = list(self._procs)
        for proc in procs:
            self._kill(proc)
        if self.cgroup is not None:
            self.cgroup.remove()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("bwrap process %d of sandbox %s did not exit", proc.pid, self.id)
        for _ in range(20):
            shutil.rmtree(self.base, ignore_errors=True)
            if not self.base.exists():
                break
            time.sleep(0.05)
