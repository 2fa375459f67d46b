"""`k3rl sandbox doctor`: what can run sandboxes on this host, and what to install if nothing can."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import docker

from .bwrap_backend import bwrap_available, bwrap_path
from .cgroups import ROOT
from .docker_backend import docker_client
from .factory import choose_backend
from .image import cache_dir, debian_mirrors, image_exists, image_tag, rootfs_dir, rootfs_tarball
from .types import BackendUnavailableError


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def run_checks() -> list[Check]:
    checks = [Check("docker SDK", True, f"docker-py {docker.__version__}")]  # a dependency of the package
    daemon_ok = False
    try:
        client = docker_client()
        info = client.info()
        daemon_ok = True
        checks.append(
            Check(
                "docker daemon",
                True,
                f"server {info.get('ServerVersion')}, storage {info.get('Driver')}, cgroup v{info.get('CgroupVersion', '?')}",
            )
        )
    except BackendUnavailableError as exc:
        checks.append(
            Check(
                "docker daemon",
                False,
                str(exc).split(";")[0],
                "as root: apt-get install -y docker.io && dockerd --bridge=none & (or sandboxes/host_setup.sh)",
            )
        )
    if daemon_ok:
        present = image_exists(client)
        checks.append(
            Check(
                "sandbox image",
                present,
                image_tag() + (" present" if present else " not built"),
                "k3rl sandbox build",
            )
        )
    # bubblewrap
    exe = bwrap_path()
    works = exe is not None and bwrap_available()
    checks.append(
        Check(
            "bubblewrap",
            works,
            f"{exe} can create namespaces"
            if works
            else (f"{exe} cannot create namespaces here" if exe else "not installed"),
            "apt-get install -y bubblewrap (and allow unprivileged user namespaces)" if not works else "",
        )
    )
    if os.geteuid() == 0:
        has_setpriv = shutil.which("setpriv") is not None
        checks.append(
            Check(
                "setpriv",
                has_setpriv,
                "drops bwrap to nobody when run as root",
                "apt-get install -y util-linux",
            )
        )
    has_rootfs = (rootfs_dir() / "usr/bin/python3").exists()
    checks.append(
        Check(
            "bwrap rootfs",
            has_rootfs,
            str(rootfs_dir()) if has_rootfs else "missing: bwrap would use the host's /usr",
            "k3rl sandbox build (as root)",
        )
    )
    v2 = (ROOT / "cgroup.controllers").exists()
    writable = os.access(ROOT / ("" if v2 else "memory"), os.W_OK)
    checks.append(
        Check(
            "cgroups for bwrap",
            writable,
            f"cgroup v{2 if v2 else 1} {'writable' if writable else 'not writable'}",
            "run as root (else bwrap limits fall back to rlimits and OOM kills cannot be reported)",
        )
    )
    # building the image
    checks.append(
        Check(
            "debootstrap",
            shutil.which("debootstrap") is not None,
            "builds the image offline",
            "apt-get install -y debootstrap",
        )
    )
    mirrors = debian_mirrors()
    checks.append(
        Check(
            "Debian mirror",
            "bookworm" in mirrors,
            mirrors.get("bookworm", "no bookworm 'deb' line in /etc/apt/sources.list*"),
            "add a Debian bookworm mirror to apt's sources",
        )
    )
    checks.append(
        Check(
            "rootfs cache",
            rootfs_tarball().exists(),
            f"{rootfs_tarball()}" if rootfs_tarball().exists() else f"nothing cached in {cache_dir()}",
            "k3rl sandbox build",
        )
    )
    return checks


def print_report() -> bool:
    """Print every check and the backend `auto` would pick; return True when some backend works."""
    for check in run_checks():
        mark = "ok  " if check.ok else "MISS"
        line = f"[{mark}] {check.name:18s} {check.detail}"
        if not check.ok and check.fix:
            line += f"\n        -> {check.fix}"
        print(line)
    try:
        backend = choose_backend("auto")
        print(f"backend 'auto' -> {backend}")
        return True
    except BackendUnavailableError as exc:
        print(f"no sandbox backend usable: {exc}")
        return False
