"""Docker backend: one long-lived container per sandbox, driven through the `docker` SDK.

Secure by default (docs/architecture.md, "Sandboxes"): `network_mode=none` (only `lo`), read-only root with tmpfs
`/work` and `/tmp`, `cap_drop=ALL`, `no-new-privileges`, uid 1000, memory (no swap) / CPU /
pids limits, and labels `k3rl.job` / `k3rl.sandbox` / `k3rl.owner` so `gc` finds leftovers.
PID 1 is a tiny reaper (below; it first copies the image's /tmp seed, e.g. matplotlib's font
cache, into the empty /tmp): it cannot be killed from inside the container (the kernel
protects a namespace's init), reaps orphans so killed fork bombs do not keep pids, and
lets `reset` kill everything else. One long-lived agent per container (`inside_helper.py serve`,
started with one `docker exec`, see `agent_channel`) runs every request, so a tool call costs
no `docker exec`; if a command kills the agent, the next call starts a new one.

The container is started with auto-remove: when the host process dies, the daemon closes the
agent's stdin, the agent stops the reaper (SIGTERM, its only way out), and the daemon removes
the container. What that cannot catch (the owner died while the agent was down) `gc` removes.
"""

from __future__ import annotations

import os
import socket as socketlib
import threading
import time

import docker
import docker.errors
from docker.types import LogConfig, Ulimit

from .agent_channel import AgentChannel, AgentLost, DockerAgentChannel
from .base import AGENT_ARGV, Sandbox, agent_preamble, log
from .image import SANDBOX_UID, image_tag
from .paths import WORK_DIR
from .types import BackendUnavailableError, SandboxDeadError, SandboxError, SandboxLimits

LABEL_SANDBOX = "k3rl.sandbox"
LABEL_JOB = "k3rl.job"
LABEL_OWNER = "k3rl.owner"  # "<hostname>:<pid>" of the process that opened it
LABEL_BACKEND = "k3rl.backend"

REAPER = """
import os, shutil, signal
try:
    for name in os.listdir("/etc/k3rl/tmp-seed"):
        shutil.copytree(os.path.join("/etc/k3rl/tmp-seed", name), os.path.join("/tmp", name), dirs_exist_ok=True)
except OSError:
    pass
signals = {signal.SIGCHLD, signal.SIGTERM}  # blocked, so they queue for sigwait (an unhandled signal to init is dropped)
signal.pthread_sigmask(signal.SIG_BLOCK, signals)
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    if signal.sigwait(signals) == signal.SIGTERM:  # from the agent when the host is gone, or `docker stop`
        os._exit(0)
"""

SANDBOX_ENV = {
    "HOME": "/home/sandbox",
    "MPLBACKEND": "Agg",
    "MPLCONFIGDIR": "/tmp/.matplotlib",
    "XDG_CACHE_HOME": "/tmp/.cache",
    "PYTHONDONTWRITEBYTECODE": "1",
    "LANG": "C.UTF-8",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}

_client_lock = threading.Lock()
_client: docker.DockerClient | None = None
_cgroup_version: dict[int, str] = {}


def owner_label() -> str:
    return f"{socketlib.gethostname()}:{os.getpid()}"


def docker_client(timeout: float = 60.0) -> docker.DockerClient:
    """One shared client per process (connection pool sized for many concurrent execs)."""
    global _client
    with _client_lock:
        if _client is None:
            try:
                client = docker.DockerClient.from_env(timeout=int(timeout), max_pool_size=128)
                client.ping()
            except docker.errors.DockerException as exc:
                raise BackendUnavailableError(
                    f"no Docker daemon answers ({exc}); start one (e.g. `dockerd --bridge=none &` as root, "
                    "or run sandboxes/host_setup.sh) or use backend='bwrap'"
                ) from exc
            _client = client
        return _client


def docker_available() -> bool:
    try:
        docker_client()
        return True
    except BackendUnavailableError:
        return False


def _oom_path(client: docker.DockerClient) -> str:
    key = id(client)
    if key not in _cgroup_version:
        _cgroup_version[key] = str(client.info().get("CgroupVersion", "1"))
    # inside the container its own cgroup is mounted at /sys/fs/cgroup
    return (
        "/sys/fs/cgroup/memory.events"
        if _cgroup_version[key] == "2"
        else "/sys/fs/cgroup/memory/memory.oom_control"
    )


class DockerSandbox(Sandbox):
    backend = "docker"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        job: str | None = None,
        image: str | None = None,
        client: docker.DockerClient | None = None,
    ):
        super().__init__(limits or SandboxLimits(), job)
        self.client = client or docker_client()
        self.api = self.client.api
        self.image = image or image_tag()
        try:
            self.client.images.get(self.image)
        except docker.errors.ImageNotFound as exc:
            fix = ("run `k3rl sandbox build` (or sandboxes/host_setup.sh)" if self.image == image_tag()
                   else "pull or build it on this host (sandbox.image of the job config)")
            raise BackendUnavailableError(f"sandbox image {self.image} is not on this host: {fix}") from exc
        self._oom = _oom_path(self.client)
        self.container_id: str | None = None
        self._agent: AgentChannel | None = None
        self._agent_lock = threading.Lock()
        lim = self.limits
        try:
            container = self.client.containers.run(
                self.image,
                command=["python3", "-I", "-S", "-c", REAPER],
                name=self.id,
                detach=True,
                labels={
                    LABEL_SANDBOX: self.id,
                    LABEL_JOB: self.job,
                    LABEL_OWNER: owner_label(),
                    LABEL_BACKEND: "docker",
                },
                user=f"{SANDBOX_UID}:{SANDBOX_UID}",
                working_dir=WORK_DIR,
                environment=SANDBOX_ENV,
                hostname="sandbox",
                network_mode="none",
                read_only=True,
                tmpfs={
                    WORK_DIR: f"size={lim.workdir_mb}m,uid={SANDBOX_UID},gid={SANDBOX_UID},mode=0755,exec",
                    "/tmp": f"size={lim.tmp_mb}m,mode=1777,exec",
                },
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                mem_limit=f"{lim.memory_mb}m",
                memswap_limit=f"{lim.memory_mb}m",
                nano_cpus=int(lim.cpus * 1e9),
                pids_limit=lim.pids,
                ulimits=[Ulimit(name="nofile", soft=4096, hard=4096)],
                ipc_mode="private",
                log_config=LogConfig(type="none"),
                auto_remove=True,
            )
            self.container_id = container.id
            self._start_agent().request("ping", {}, None, 60.0)  # warm, and fail here if it cannot run
        except Exception as exc:  # daemon errors, HTTP timeouts of an overloaded daemon, agent failures
            self._destroy()
            raise SandboxError(f"could not start sandbox container {self.id}: {exc}") from exc
        log.debug("docker sandbox %s started (job=%s)", self.id, self.job)

    def _oom_file(self) -> str | None:
        return self._oom

    def is_alive(self) -> bool:
        agent = self._agent
        if agent is not None and not agent.closed and not self._closed:
            return True  # its exec stream is open, so the container runs (the stream closes when it dies)
        try:
            return bool(self.api.inspect_container(self.id)["State"]["Running"])
        except docker.errors.NotFound:
            return False
        except docker.errors.DockerException:
            return False

    def _dead(self, during: str, exc: Exception | None = None) -> SandboxDeadError:
        return SandboxDeadError(
            f"sandbox {self.id} (container) is not running during {during}: it was killed or removed "
            f"from outside{f' ({exc})' if exc else ''}; open a new sandbox (a SandboxPool replaces it)"
        )

    def _start_agent(self) -> AgentChannel:
        with self._agent_lock:
            if self._agent is None or self._agent.closed:
                self._agent = DockerAgentChannel(
                    self.api,
                    self.id,
                    AGENT_ARGV,
                    agent_preamble(),
                    f"{SANDBOX_UID}:{SANDBOX_UID}",
                    WORK_DIR,
                )
            return self._agent

    def _request(self, mode: str, args: dict, stdin: bytes | None, host_timeout: float) -> bytes:
        try:
            agent = self._start_agent()
        except docker.errors.NotFound as exc:
            raise self._dead(mode, exc) from exc
        except docker.errors.APIError as exc:
            if exc.status_code == 409 or not self.is_alive():
                raise self._dead(mode, exc) from exc
            raise SandboxError(f"could not start the agent of sandbox {self.id}: {exc}") from exc
        except OSError as exc:  # the new agent's stream broke at once (container going away?)
            if self._settles_dead():
                raise self._dead(mode, exc) from exc
            raise SandboxError(f"could not start the agent of sandbox {self.id}: {exc}") from exc
        try:
            return agent.request(mode, args, stdin, host_timeout)
        except AgentLost as exc:
            if self._closed:
                raise SandboxDeadError(f"sandbox {self.id} was closed during {mode}") from exc
            if self._settles_dead():
                raise self._dead(mode, exc) from exc
            raise SandboxError(
                f"the agent of sandbox {self.id} was killed during {mode} (did the command kill every "
                f"process, e.g. `kill -9 -1`?); it is restarted on the next call: {exc}"
            ) from exc
        except TimeoutError as exc:
            raise SandboxError(
                f"sandbox {self.id} did not answer within {host_timeout:.0f}s (hung daemon or container)"
            ) from exc

    def _destroy(self) -> None:
        agent = getattr(self, "_agent", None)
        if agent is not None:
            agent.close()  # the agent sees its stdin close and stops the container (auto-remove)
        for attempt in range(3):
            try:
                self.api.remove_container(self.id, force=True, v=True)
                return
            except docker.errors.NotFound:
                return
            except docker.errors.APIError as exc:
                if "already in progress" in str(exc):
                    return self._wait_removed()
                if attempt == 2:
                    log.error(
                        "could not remove sandbox container %s: %s (run `k3rl sandbox gc`)", self.id, exc
                    )
                time.sleep(0.2)

    def _wait_removed(self, timeout_s: float = 30.0) -> None:
        """The daemon is removing the container already: return once it is gone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.api.inspect_container(self.id)
            except docker.errors.NotFound:
                return
            except docker.errors.DockerException:
                pass
            time.sleep(0.05)
        log.error("sandbox container %s is still being removed after %.0fs (run `k3rl sandbox gc`)", self.id, timeout_s)
