"""SandboxPool against the real backends: concurrency, replacement, reuse, clean shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from k3rl.sandboxes import SandboxDeadError, SandboxPool

from .conftest import JOB, SMALL


def leftovers(backend: str, job: str, ids: list[str] = ()) -> list[str]:
    """Sandboxes of `job` (and cgroups of sandboxes `ids`) that still exist, looked up from the outside."""
    if backend == "docker":
        from k3rl.sandboxes.docker_backend import LABEL_JOB, docker_client

        found = docker_client().api.containers(all=True, filters={"label": f"{LABEL_JOB}={job}"})
        return [c["Names"][0] for c in found]
    import json

    from k3rl.sandboxes.bwrap_backend import OWNER_FILE, sandbox_base_dir
    from k3rl.sandboxes.cgroups import PARENT, ROOT

    names = []
    for entry in sandbox_base_dir().glob("k3rl-bwrap-*"):
        try:
            if json.loads((entry / OWNER_FILE).read_text())["job"] == job:
                names.append(str(entry))
        except (OSError, ValueError):
            continue
    return names + [str(p) for sid in ids for p in ROOT.glob(f"*/{PARENT}/{sid}")]


def test_16_concurrent_sandboxes_and_none_left_after_close(backend):
    job = f"{JOB}-pool16"

    async def main():
        async with SandboxPool(
            backend, max_size=16, min_idle=2, starts_per_s=50, job=job, limits=SMALL
        ) as pool:
            peak = 0
            gate = asyncio.Event()
            arrived = 0

            async def episode(i):
                nonlocal peak, arrived
                async with pool.sandbox(timeout=120) as sb:
                    arrived += 1
                    peak = max(peak, pool.leased)
                    if arrived == 16:
                        gate.set()
                    await asyncio.wait_for(gate.wait(), 120)  # all 16 hold a sandbox at once
                    await sb.awrite_file("id.txt", str(i))
                    r = await sb.aexec("cat id.txt; echo; hostname")
                    return sb.id, r.stdout.split()

            results = await asyncio.gather(*(episode(i) for i in range(16)))
            assert peak == 16
            assert len({sid for sid, _ in results}) == 16  # 16 distinct sandboxes
            assert [out[0] for _, out in results] == [str(i) for i in range(16)]
            assert len(leftovers(backend, job)) == 16
            return [sid for sid, _ in results]

    ids = asyncio.run(main())
    assert leftovers(backend, job, ids) == []


def test_pool_waits_at_max_size_and_rate_limits_starts(backend):
    async def main():
        async with SandboxPool(
            backend, max_size=2, min_idle=0, starts_per_s=4, job=JOB, limits=SMALL
        ) as pool:
            t0 = time.monotonic()
            a = await pool.acquire()
            b = await pool.acquire()
            # 2 starts at 4/s: the second one waited for its slot (>= 0.25 s after the first)
            assert time.monotonic() - t0 >= 0.24
            with pytest.raises(TimeoutError):
                await pool.acquire(timeout=0.5)  # concurrency limit: nobody released
            waiter = asyncio.create_task(pool.acquire(timeout=30))
            await asyncio.sleep(0.1)
            assert not waiter.done()
            await pool.release(a)
            c = await waiter
            assert c is a  # the released (reset) sandbox was handed on
            await pool.release(b)
            await pool.release(c)

    asyncio.run(main())


def test_reset_between_episodes_or_recreate(backend):
    async def main(reuse):
        async with SandboxPool(backend, max_size=1, min_idle=1, job=JOB, reuse=reuse, limits=SMALL) as pool:
            async with pool.sandbox() as sb:
                first = sb.id
                await sb.awrite_file("secret.txt", "episode 1")
                await sb.aexec("sleep 1000 > /dev/null 2>&1 &")
            async with pool.sandbox(timeout=60) as sb:
                listing = (await sb.aexec("ls -A /work /tmp")).stdout
                procs = (await sb.aexec("ps -eo comm")).stdout
                return first, sb.id, listing, procs, pool.stats

    first, second, listing, procs, stats = asyncio.run(main("reset"))
    assert first == second and stats.resets >= 1
    assert "secret.txt" not in listing and "sleep" not in procs
    first, second, listing, _, stats = asyncio.run(main("recreate"))
    assert first != second and stats.recreated >= 1 and stats.resets == 0
    assert "secret.txt" not in listing


@pytest.mark.docker
def test_killed_container_gives_clear_error_and_pool_replaces_it(docker_only):
    job = f"{JOB}-kill"

    async def main():
        async with SandboxPool("docker", max_size=2, min_idle=1, job=job, limits=SMALL) as pool:
            sb = await pool.acquire()
            victim = sb.id

            async def kill_soon():
                await asyncio.sleep(1.0)
                await asyncio.to_thread(sb.client.api.kill, victim)

            killer = asyncio.create_task(kill_soon())
            with pytest.raises(SandboxDeadError, match="killed or removed from outside|killed from outside"):
                await sb.aexec("sleep 60", timeout=30)
            await killer
            await pool.release(sb)
            assert pool.stats.replaced_dead == 1
            async with pool.sandbox(timeout=60) as fresh:
                assert fresh.id != victim
                assert (await fresh.aexec("echo ok")).stdout == "ok\n"
            return victim

    victim = asyncio.run(main())
    assert leftovers("docker", job) == []
    assert victim


@pytest.mark.docker
def test_health_check_replaces_an_idle_sandbox_killed_from_outside(docker_only):
    async def main():
        async with SandboxPool(
            "docker", max_size=3, min_idle=2, health_interval_s=0.5, job=JOB, limits=SMALL
        ) as pool:
            victim = pool._idle[0]
            await asyncio.to_thread(victim.client.api.kill, victim.id)
            for _ in range(100):
                await asyncio.sleep(0.2)
                if victim.id not in pool.sandbox_ids() and pool.idle == 2:
                    break
            assert victim.id not in pool.sandbox_ids()
            assert pool.idle == 2 and pool.stats.replaced_dead >= 1
            async with pool.sandbox() as sb:
                assert (await sb.aexec("echo fine")).stdout == "fine\n"

    asyncio.run(main())


def test_max_uses_retires_a_sandbox(backend):
    async def main():
        async with SandboxPool(backend, max_size=1, min_idle=0, max_uses=2, job=JOB, limits=SMALL) as pool:
            ids = []
            for _ in range(3):
                async with pool.sandbox(timeout=60) as sb:
                    ids.append(sb.id)
            return ids, pool.stats

    ids, stats = asyncio.run(main())
    assert ids[0] == ids[1] != ids[2] and stats.recreated >= 1


def test_pool_argument_errors():
    with pytest.raises(ValueError, match="max_size"):
        SandboxPool("bwrap", max_size=0)
    with pytest.raises(ValueError, match="min_idle"):
        SandboxPool("bwrap", max_size=2, min_idle=3)
    with pytest.raises(ValueError, match="reuse"):
        SandboxPool("bwrap", reuse="keep")
