"""`open_sandbox`: pick a backend and open one sandbox."""

from __future__ import annotations

import os
from pathlib import Path

from .base import Sandbox, log
from .bwrap_backend import BwrapSandbox, bwrap_path
from .docker_backend import DockerSandbox, docker_client
from .image import image_exists, image_tag
from .types import BackendUnavailableError, SandboxLimits
from .unsandboxed import UnsandboxedSandbox

BACKENDS = ("docker", "bwrap", "auto", "none")


def default_job() -> str:
    """The job label of sandboxes opened without `job=`: $K3RL_JOB_ID, else `adhoc-<pid>`."""
    return os.environ.get("K3RL_JOB_ID") or f"adhoc-{os.getpid()}"


def choose_backend(backend: str = "auto", image: str | None = None) -> str:
    """Resolve "auto": Docker when a daemon answers and the image is there, else bubblewrap (logged).
    A Docker `image` named by the caller is never silently replaced: without it "auto" raises. "auto"
    never resolves to "none" (no isolation): that backend is only ever asked for by name."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    tag = image or image_tag()
    try:
        client = docker_client()
        if image_exists(client, tag):
            log.info("sandbox backend auto -> docker (daemon answers, image %s present)", tag)
            return "docker"
        reason = f"image {tag} is not " + ("built (run `k3rl sandbox build`)" if image is None else "on this host")
    except BackendUnavailableError as exc:
        reason = str(exc)
    if image is not None:
        raise BackendUnavailableError(f"sandboxes in the Docker image {image} cannot run here: {reason}")
    if bwrap_path() is None:
        raise BackendUnavailableError(
            f"no sandbox backend available: Docker: {reason}; bubblewrap: not installed "
            "(apt-get install -y bubblewrap). Run `k3rl sandbox doctor` for details. Tools that need no "
            "isolation can run as plain host processes with backend 'none' (sandbox.backend: none), chosen "
            "by name only."
        )
    log.info("sandbox backend auto -> bwrap (docker unusable: %s)", reason)
    return "bwrap"


def open_sandbox(
    backend: str = "auto",
    *,
    job: str | None = None,
    image: str | None = None,
    rootfs: str | Path | None = None,
    limits: SandboxLimits | None = None,
    **limit_overrides,
) -> Sandbox:
    """Open a sandbox (use it as a context manager so it is always closed).

    backend: "docker", "bwrap", "auto" or "none" (no isolation: `unsandboxed.py`). job: label that `k3rl sandbox gc --job` matches.
    image (docker) / rootfs (bwrap): override the built sandbox image. Limits: pass a
    `SandboxLimits` and/or its fields as keywords, e.g. `open_sandbox(memory_mb=512, pids=64)`.
    """
    base = limits or SandboxLimits()
    if limit_overrides:
        base = SandboxLimits.from_kwargs(**{**base.__dict__, **limit_overrides})
    chosen = choose_backend(backend, image)
    job = job or default_job()
    if chosen == "none":
        return UnsandboxedSandbox(base, job=job)
    if chosen == "docker":
        return DockerSandbox(base, job=job, image=image)
    return BwrapSandbox(base, job=job, rootfs=rootfs)
