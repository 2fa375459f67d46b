"""`gc` removes what a crashed job left behind, and nothing that a live job still uses."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

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


def test_gc_trusts_no_path_from_an_owner_file(tmp_path, monkeypatch):
    """Owner files lie in a shared temp folder anyone can write to. One naming `../..` as its sandbox once
    pointed gc (run as root) at any directory with a `cgroup.procs`, whose pids it killed; a symlinked folder
    or one whose name is not its sandbox's is not gc's either. Nothing of theirs is touched."""
    import json
    import os
    import socket

    from k3rl.sandboxes.bwrap_backend import OWNER_FILE
    from k3rl.sandboxes.cgroups import PARENT, ROOT
    from k3rl.sandboxes.gc import gc_bwrap

    base = tmp_path / "sandboxes"
    monkeypatch.setenv("K3RL_SANDBOX_DIR", str(base))
    victim = tmp_path / "victim"
    victim.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (victim / "cgroup.procs").write_text(f"{sleeper.pid}\n")
        dead = {"host": socket.gethostname(), "pid": 2**22 + 12345, "job": "j"}  # no such pid: a crashed owner
        planted = {
            "k3rl-bwrap-aaaaaaaaaaaa-x": os.path.relpath(victim, ROOT / PARENT),  # a path for an id
            "k3rl-bwrap-bbbbbbbbbbbb-x": "k3rl-bwrap-cccccccccccc",  # another sandbox's id
        }
        for name, sid in planted.items():
            (base / name).mkdir(parents=True)
            (base / name / OWNER_FILE).write_text(json.dumps({**dead, "sandbox": sid}))
        (victim / OWNER_FILE).write_text(json.dumps({**dead, "sandbox": "k3rl-bwrap-dddddddddddd"}))
        (base / "k3rl-bwrap-dddddddddddd-x").symlink_to(victim, target_is_directory=True)
        removed = gc_bwrap(all=True)
        assert sleeper.poll() is None  # not killed
        assert victim.is_dir() and (victim / "cgroup.procs").exists()
        assert all((base / name).exists() for name in planted) and not any(r.startswith("bwrap:") for r in removed)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_rlimit_fallback_counts_the_threads_the_kernel_counts():
    """Without cgroups a bwrap sandbox's process budget is RLIMIT_NPROC on top of what its uid already runs;
    the kernel counts every thread against that limit, so the count must too (it once counted processes,
    and a uid whose programs ran many threads left the sandbox no room to start one)."""
    import os

    from k3rl.sandboxes.bwrap_backend import tasks_of_uid

    code = "import threading, time\nfor _ in range(24): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\nprint(1, flush=True); time.sleep(30)"
    counts = []
    for _ in range(10):  # the uid's other tasks must hold still around the count (a fork bomb burning out did not)
        before = tasks_of_uid(os.getuid())
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == b"1"
            during = tasks_of_uid(os.getuid())
        finally:
            proc.kill()
            proc.wait()
        after = tasks_of_uid(os.getuid())
        counts.append((before, during, after))
        if before == after:
            assert during - before >= 25, counts  # the process and its 24 threads
            return
        time.sleep(1)
    pytest.fail(f"the uid's other tasks never held still around a count (before, during, after): {counts}")
