"""Fixtures for the sandbox tests: real Docker daemon, real bubblewrap, nothing simulated.

Tests that need a backend take the `backend` fixture (parametrised over "docker" and
"bwrap"); a backend that cannot run here is skipped with the reason and the fix.
"""

from __future__ import annotations

import functools
import os

import pytest

from k3rl.sandboxes import SandboxLimits, open_sandbox
from k3rl.sandboxes.types import BackendUnavailableError

JOB = f"pytest-sandboxes-{os.getpid()}"
SMALL = SandboxLimits(memory_mb=256, pids=64, timeout_s=30.0, output_bytes=64 << 10, workdir_mb=64, tmp_mb=64)


@functools.cache
def docker_skip_reason() -> str | None:
    from k3rl.sandboxes.docker_backend import docker_client
    from k3rl.sandboxes.image import image_exists, image_tag

    try:
        client = docker_client()
    except BackendUnavailableError as exc:
        return f"{exc} (run sandboxes/host_setup.sh as root)"
    if not image_exists(client):
        return f"sandbox image {image_tag()} is not built (run `k3rl sandbox build`)"
    return None


@functools.cache
def bwrap_skip_reason() -> str | None:
    from k3rl.sandboxes.bwrap_backend import bwrap_available

    if not bwrap_available():
        return "bubblewrap is missing or cannot create namespaces here (apt-get install -y bubblewrap)"
    return None


def require(backend: str) -> None:
    reason = docker_skip_reason() if backend == "docker" else bwrap_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(params=[pytest.param("docker", marks=pytest.mark.docker), "bwrap"])
def backend(request) -> str:
    require(request.param)
    return request.param


@pytest.fixture
def sb(backend):
    with open_sandbox(backend, job=JOB, limits=SMALL) as sandbox:
        yield sandbox


@pytest.fixture
def docker_only():
    require("docker")
    return "docker"
