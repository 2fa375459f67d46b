"""Nothing is left behind: a closed pool, and a pool whose owner process is SIGKILLed (plus `k3rl sandbox gc`),
leave no sandbox (container, bubblewrap directory or cgroup) of their job and no process that ran in one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import alive, descendants

from k3rl.sandboxes import SandboxClosedError, SandboxPool, open_sandbox

from .conftest import JOB, SMALL
from .test_pool import leftovers

K3RL = [sys.executable, "-m", "k3rl.cli"]


def remaining(backend: str, job: str, ids: list[str] = ()) -> set[str]:
    """Ids of the sandboxes of `job` (and of cgroups of `ids`) that still exist, seen from outside."""
    return {Path(item).name.lstrip("/")[: len(f"k3rl-{backend}-") + 12] for item in leftovers(backend, job, ids)}


def sandbox_pids(backend: str, sandbox_ids: list[str], owner_pid: int) -> set[int]:
    """Host pids of the processes running in these sandboxes (Docker: `docker top`; bubblewrap: the
    bwrap processes among the owner's descendants, and theirs — not the owner's other children, such
    as a local Ray another test left running in this process)."""
    if backend == "docker":
        from k3rl.sandboxes.docker_backend import docker_client

        api = docker_client().api
        pids = set()
        for sid in sandbox_ids:
            top = api.top(sid)
            column = top["Titles"].index("PID")
            pids |= {int(row[column]) for row in top["Processes"]}
        return pids
    bwraps = {p for p in descendants(owner_pid) if _comm(p) == "bwrap"}
    return bwraps.union(*(descendants(p) for p in bwraps))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_a_closed_pool_leaves_no_sandbox_and_no_sandbox_process(backend):
    job = f"{JOB}-closed-{backend}"

    async def main():
        pool = SandboxPool(backend, max_size=4, min_idle=2, starts_per_s=50, job=job, limits=SMALL)
        try:
            await pool.start()
            leased = await pool.acquire(timeout=120)
            await leased.aexec("sleep 1000 > /dev/null 2>&1 &")  # a daemon that outlives its exec
            async with asyncio.timeout(120):
                while pool.idle < 2:  # the pool refills its warm sandboxes in the background
                    await asyncio.sleep(0.05)
            ids = pool.sandbox_ids()
            assert len(ids) == 3 and remaining(backend, job) == set(ids)
            pids = sandbox_pids(backend, ids, os.getpid())
            assert pids
        finally:
            await pool.close()  # the episode still holds `leased`: closed all the same
        await pool.close()  # idempotent
        with pytest.raises(SandboxClosedError):
            await pool.acquire(timeout=5)
        return ids, pids

    ids, pids = asyncio.run(main())
    assert remaining(backend, job, ids) == set()
    assert alive(pids, within_s=10.0) == set()  # killed on close; a loaded machine may take a moment to reap


CRASHING_OWNER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from k3rl.sandboxes import SandboxError, SandboxPool, open_sandbox

    backend, job = sys.argv[1], sys.argv[2]

    async def main():
        pool = SandboxPool(backend, max_size=4, min_idle=2, starts_per_s=50, job=job, memory_mb=256, pids=64)
        await pool.start()
        sb = await pool.acquire(timeout=120)
        await sb.aexec("sleep 1000 > /dev/null 2>&1 &")
        while pool.idle < 2:
            await asyncio.sleep(0.05)
        # a sandbox whose agent a command killed (restarted only by the next call): nothing inside
        # notices the owner's death, so only `k3rl sandbox gc` can remove it
        headless = open_sandbox(backend, job=job, memory_mb=256, pids=64)
        try:
            headless.exec("sleep 1000 > /dev/null 2>&1 & kill -9 -1; sleep 5", timeout=20)
        except SandboxError:
            pass
        print(" ".join(pool.sandbox_ids()), headless.id, flush=True)
        sys.stdin.readline()  # the test looks at the sandboxes' processes, then lets us crash
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close() runs

    asyncio.run(main())
    """
)


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_the_sandboxes_of_a_killed_owner_go_away_and_gc_removes_the_rest(backend):
    job = f"{JOB}-crashed-{backend}"
    owner = subprocess.Popen([sys.executable, "-c", CRASHING_OWNER, backend, job], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        *pooled, headless = owner.stdout.readline().split()
        assert len(pooled) == 3, owner.stderr.read() if owner.poll() is not None else "no sandbox ids"
        pids = sandbox_pids(backend, [*pooled, headless], owner.pid)
        headless_pids = sandbox_pids(backend, [headless], owner.pid) if backend == "docker" else set()
        assert pids - headless_pids
        owner.stdin.write("crash\n")
        owner.stdin.flush()
        assert owner.wait(timeout=60) == -9
    finally:
        if owner.poll() is None:
            owner.kill()
    # the owner is gone: every sandbox of the pool stops by itself (Docker: the agent sees its stdin
    # close and stops the container, which the daemon removes; bubblewrap: it dies with its parent)
    assert alive(pids - headless_pids, within_s=30) == set()
    if backend == "docker":
        deadline = time.monotonic() + 30
        while remaining(backend, job) != {headless} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert remaining(backend, job) == {headless}  # the auto-removed containers are gone
    with open_sandbox(backend, job=job, limits=SMALL) as live:  # a live sandbox of the same job
        r = subprocess.run([*K3RL, "sandbox", "gc"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"{backend}:{headless}" in r.stdout  # an orphan: its owner is dead
        assert f"{backend}:{live.id}" not in r.stdout  # its owner (this process) is alive
        assert remaining(backend, job, [*pooled, headless]) == {live.id}
        assert alive(pids, within_s=10.0) == set()  # killed on close; a loaded machine may take a moment to reap
        r = subprocess.run([*K3RL, "sandbox", "gc", "--job", job], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and f"{backend}:{live.id}" in r.stdout  # --job: everything of that job
    assert remaining(backend, job, [*pooled, headless, live.id]) == set()
