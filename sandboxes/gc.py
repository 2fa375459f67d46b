"""Remove sandboxes that outlived their job (`k3rl sandbox gc`).

Every sandbox records its job and owner (`<hostname>:<pid>`): Docker in container labels,
bubblewrap in `<dir>/k3rl-owner.json` (its cgroups are named after the sandbox id). By
default `gc` removes only orphans — sandboxes whose owner process on this host is gone —
so it is safe to run while other jobs are live. `job=` removes every sandbox of that job,
`all=True` every k3rl sandbox.

A job's driver killed with SIGKILL also leaves Ray processes behind: its local Ray's raylet and
GCS die with it, but agents and workers started by the raylet live on, re-parented to init.
`gc_ray_orphans` removes every Ray process whose session (`/tmp/ray/session_*`, read off the
files it holds open) has no raylet alive any more; a live cluster always has its raylet, so
running jobs are never touched.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import docker.errors

from .base import log
from .bwrap_backend import OWNER_FILE, sandbox_base_dir
from .cgroups import PARENT, ROOT, SandboxCgroup
from .docker_backend import LABEL_JOB, LABEL_OWNER, LABEL_SANDBOX, docker_client
from .types import BackendUnavailableError


def _owner_alive(owner: str) -> bool:
    """True when owner "<host>:<pid>" is a live process on this host (other hosts: assume alive)."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except ValueError:
        return False


def _doomed(job_label: str | None, owner: str, job: str | None, all: bool) -> bool:
    if all:
        return True
    if job is not None:
        return job_label == job
    return not _owner_alive(owner)


def gc_docker(job: str | None = None, all: bool = False) -> list[str]:

    try:
        client = docker_client()
    except BackendUnavailableError:
        return []
    removed = []
    filters = {"label": [LABEL_SANDBOX] + ([f"{LABEL_JOB}={job}"] if job else [])}
    for info in client.api.containers(all=True, filters=filters):
        labels = info.get("Labels") or {}
        if not _doomed(labels.get(LABEL_JOB), labels.get(LABEL_OWNER, ""), job, all):
            continue
        try:
            client.api.remove_container(info["Id"], force=True, v=True)
            removed.append(f"docker:{labels.get(LABEL_SANDBOX, info['Id'][:12])}")
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            log.error("gc: could not remove container %s: %s", info["Id"][:12], exc)
    return removed


SANDBOX_ID = re.compile(r"k3rl-bwrap-[0-9a-f]{12}")


def _trusted(entry: Path, meta: dict) -> bool:
    """Whether a sandbox folder's owner file can be acted on. The folder lies in a shared temp directory
    where anyone may write, and its `sandbox` field names the cgroups gc kills and removes: so the id must
    be a sandbox id (no path: `../` would reach any cgroup, or any directory holding a `cgroup.procs`),
    the folder must be that sandbox's and no symlink, and it must belong to whoever runs gc."""
    sid = meta.get("sandbox")
    try:
        ours = entry.lstat().st_uid == os.geteuid()
    except OSError:
        return False
    ok = (isinstance(sid, str) and SANDBOX_ID.fullmatch(sid) is not None and entry.name.startswith(f"{sid}-")
          and not entry.is_symlink() and entry.is_dir() and ours)
    if not ok:
        log.warning("sandbox gc: skipped %s (its owner file names sandbox %r: not a sandbox id of this folder, or "
                    "the folder is not yours or a symlink)", entry, sid)
    return ok


def gc_bwrap(job: str | None = None, all: bool = False) -> list[str]:
    removed = []
    base = sandbox_base_dir()
    live_ids = set()
    if base.is_dir():
        for entry in base.iterdir():
            owner_file = entry / OWNER_FILE
            try:
                meta = json.loads(owner_file.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(meta, dict) or not _trusted(entry, meta):
                continue
            owner = f"{meta.get('host')}:{meta.get('pid')}"
            if not _doomed(meta.get("job"), owner, job, all):
                live_ids.add(meta.get("sandbox"))
                continue
            _remove_cgroups(meta.get("sandbox", ""))
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(f"bwrap:{meta.get('sandbox', entry.name)}")
    # cgroups whose sandbox dir is gone (crash between cgroup creation and cleanup)
    for parent in [ROOT / PARENT, *ROOT.glob(f"*/{PARENT}")]:
        if not parent.is_dir():
            continue
        for group in parent.iterdir():
            if group.is_dir() and group.name.startswith("k3rl-bwrap-") and group.name not in live_ids:
                if job is not None and not all:
                    continue  # a job-scoped gc only touches sandboxes it can attribute
                if not any(d.name.startswith(group.name) for d in base.glob("k3rl-bwrap-*")) or all:
                    SandboxCgroup(1, {"x": group}).remove()
                    removed.append(f"cgroup:{group}")
    return removed


def _remove_cgroups(sandbox_id: str) -> None:
    if not sandbox_id:
        return
    dirs = {
        str(i): p for i, p in enumerate([ROOT / PARENT / sandbox_id, *ROOT.glob(f"*/{PARENT}/{sandbox_id}")])
    }
    dirs = {k: Path(p) for k, p in dirs.items() if Path(p).is_dir()}
    if dirs:
        SandboxCgroup(1, dirs).remove()


SESSION = re.compile(r"/session_\d{4}-\d\d-\d\d_[\d-]+_\d+_\d+")


def _ray_process(pid: int) -> tuple[str, str | None, bool] | None:
    """(name, session dir, is_raylet) of a Ray process, None for any other process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in argv if a]
    if not argv:
        return None
    name = argv[0]
    raylet = name.endswith("/raylet")
    if not (name.startswith("ray::") or raylet or any("/site-packages/ray/" in a for a in argv[:3])):
        return None
    found = next((m.group(0) for a in argv if (m := SESSION.search(a))), None)
    if found is None:  # renamed processes (ray::...) name their session only through their open files
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with_session = SESSION.search(os.readlink(fd.path))
                if with_session:
                    found = with_session.group(0)
                    break
        except OSError:
            pass
    return name.split()[0], found, raylet


STARTING_S = 30.0  # a session this young may still be starting: its GCS comes up before its raylet


def _session_age_s(session: str) -> float:
    """Seconds since the session began, from its name (`/session_2026-12-06_04-08-20_123456_PID`, local time)."""
    stamp = session.split("_", 1)[1].rsplit("_", 2)[0]
    return (datetime.datetime.now() - datetime.datetime.strptime(stamp, "%Y-%m-%d_%H-%M-%S")).total_seconds()


def orphaned_ray_processes() -> list[tuple[int, str]]:
    """(pid, name) of every Ray process whose session has no live raylet and is not just starting (a cluster
    that another job is starting has its GCS before its raylet: a gc in that moment must not take it)."""
    procs = {int(d): info for d in os.listdir("/proc") if d.isdigit() and (info := _ray_process(int(d)))}
    live = {session for _, session, raylet in procs.values() if raylet and session}
    return [(pid, name) for pid, (name, session, _) in procs.items()
            if session and session not in live and _session_age_s(session) > STARTING_S]


def gc_ray_orphans() -> list[str]:
    removed = []
    for pid, name in orphaned_ray_processes():
        try:
            os.kill(pid, signal.SIGKILL)
            removed.append(f"ray process {pid} ({name})")
        except ProcessLookupError:
            pass
    return removed


def gc(job: str | None = None, all: bool = False) -> list[str]:
    """Remove orphaned sandboxes of both backends and Ray processes of dead sessions (see module
    doc); return what was removed."""
    return gc_docker(job=job, all=all) + gc_bwrap(job=job, all=all) + gc_ray_orphans()
