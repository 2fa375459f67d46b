"""`gc` removes what a crashed job left behind, and nothing that a live job still uses."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from k3rl.sandboxes import gc, open_sandbox

from .conftest import JOB, SMALL

CRASHING_JOB = textwrap.dedent(
    """
    import os, signal, sys
    from k3rl.sandboxes import SandboxError, open_sandbox
    sb = open_sandbox(sys.argv[1], job=sys.argv[2])
    try:  # its agent killed: nothing in the sandbox notices the crash below (a Docker sandbox whose
        # agent runs stops itself when its owner dies; this one is what gc is for)
        sb.exec("sleep 1000 > /dev/null 2>&1 & kill -9 -1; sleep 5", timeout=20)
    except SandboxError:
        pass
    print(sb.id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # crash: close() never runs
    """
)


def exists(backend: str, sandbox_id: str) -> bool:
    if backend == "docker":
        from k3rl.sandboxes.docker_backend import LABEL_SANDBOX, docker_client

        return bool(
            docker_client().api.containers(all=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"})
        )
    from k3rl.sandboxes.bwrap_backend import sandbox_base_dir
    from k3rl.sandboxes.cgroups import PARENT, ROOT

    return any(sandbox_base_dir().glob(f"{sandbox_id}-*")) or any(ROOT.glob(f"*/{PARENT}/{sandbox_id}"))


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_gc_removes_a_crashed_jobs_leftovers_but_not_live_sandboxes(backend):
    job = f"{JOB}-gc-{backend}"
    crash = subprocess.run(
        [sys.executable, "-c", CRASHING_JOB, backend, job], capture_output=True, text=True, timeout=120
    )
    assert crash.returncode == -9, crash.stderr
    orphan = crash.stdout.strip()
    assert orphan.startswith(f"k3rl-{backend}-") and exists(backend, orphan)
    with open_sandbox(backend, job=job, limits=SMALL) as live:
        removed = gc()  # default: only sandboxes whose owner process is gone
        assert f"{backend}:{orphan}" in removed
        assert not exists(backend, orphan)
        assert exists(backend, live.id)
        assert live.exec("echo alive").stdout == "alive\n"
        removed = gc(job=job)  # explicit job: everything of that job, live or not
        assert f"{backend}:{live.id}" in removed
        assert not exists(backend, live.id)
