"""RolloutWorker against a real inference pool (k3-tiny) and trajectory buffer on a local Ray: episodes
that work, fail and use sandboxes; summaries; `close()` leaves no sandbox behind.

The worker runs in this process (the same class the job makes a Ray actor of), so it sees the test
env registered here and its sandbox pool can be inspected."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess

import gymnasium
import pytest
import ray

from k3rl.chat import Message
from k3rl.config import JobConfig
from k3rl.envs.python_tool import PythonToolEnv
from k3rl.rollout.buffer import TrajectoryBuffer
from k3rl.rollout.pool import EngineSpec, PoolActor
from k3rl.rollout.worker import RolloutWorker

NO_CPU_SLOT = {"num_cpus": 0}  # schedulable whatever Ray cluster another test module left running
BACKEND = os.environ.get("K3RL_TEST_SANDBOX_BACKEND", "auto")


class SandboxOpening(PythonToolEnv):
    """Its opening runs a program in the episode's sandbox (so every episode takes one from the pool)."""

    def opening_messages(self, task):
        out = self.sandbox.exec(["python3", "-c", "print(6 * 7)"], timeout=30).stdout.strip()
        return [Message(role="user", content=f"the sandbox says {out}; {task.question}")]


gymnasium.register("k3rltest/SandboxOpening-v0", entry_point=SandboxOpening)


@contextlib.asynccontextmanager
async def engine_and_buffer():
    """A one-engine k3-tiny pool (ready) and a trajectory buffer, as Ray actors, ended on exit."""
    pool = PoolActor.options(num_cpus=0, max_concurrency=100).remote(
        1, EngineSpec(preset="k3-tiny", seed=0), actor_options=NO_CPU_SLOT)
    buffer = ray.remote(num_cpus=0)(TrajectoryBuffer).remote(1)
    try:
        await pool.wait_ready.remote()
        yield pool, buffer
    finally:
        await pool.shutdown.remote()
        ray.kill(pool)
        ray.kill(buffer)


def _spec(i: int, env_id: str, **kwargs) -> dict:
    return {"id": f"wt-g{i:07d}-s0", "env_id": env_id, "seed": i, "group_id": f"wt-g{i:07d}", "env_kwargs": kwargs,
            "issued_version": 0}


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_worker_records_every_episode_and_closes_its_sandboxes(ray_cluster):
    from k3rl.sandboxes import open_sandbox

    try:
        with open_sandbox(backend=BACKEND) as sb:
            assert sb.exec(["python3", "-c", "print(1)"], timeout=60).exit_code == 0
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no working {BACKEND} sandbox here ({type(e).__name__}: {e}): run `k3rl sandbox build`")
    job = f"worker-test-{os.getpid()}"
    cfg = JobConfig.from_dict({
        "name": job, "rollout": {"max_context_tokens": 2048, "sampling": {"max_tokens_per_turn": 8}},
        "envs": {"max_turns": 2}, "learner": {"routing_replay": False},
        "sandbox": {"pool_size": 1, "max_concurrency": 2, "backend": BACKEND},
    })

    async def main():
        async with engine_and_buffer() as (pool, buffer):
            worker = RolloutWorker(cfg.to_dict(), pool, buffer, index=3)
            specs = [_spec(0, "k3rl/KeyLookup-v0"), _spec(1, "k3rl/KeyLokup-v0"),
                     _spec(2, "k3rl/KeyLookup-v0", num_keys=0), _spec(3, "k3rltest/SandboxOpening-v0")]
            done = await asyncio.gather(*(worker.run_episode(s) for s in specs))
            pool_sandboxes = worker.sandbox_pool.sandbox_ids()
            backend = worker.sandbox_pool.backend
            again = await worker.run_episode(specs[1])  # a retried episode: the buffer keeps the first copy
            await worker.close()
            await worker.close()  # idempotent
            return done, again, pool_sandboxes, backend, worker.sandbox_pool.sandbox_ids()

    done, again, opened, backend, left = asyncio.run(main())
    ok, unknown, bad_kwargs, sandboxed = done
    keys = {"id", "group_id", "env_id", "reward", "error", "failed_at", "truncated", "turns", "tokens", "generated",
            "min_version", "max_version", "version_sum", "seconds", "parse_errors", "images", "timings",
            "accepted"}  # k3rl.metrics.episode_stats + accepted
    assert all(set(s) == keys and s["accepted"] is True for s in done)
    assert ok["error"] is None and ok["generated"] > 0 and ok["turns"] >= 1 and ok["group_id"] == "wt-g0000000"
    assert unknown["failed_at"] == "make_env" and "KeyLokup" in unknown["error"] and "Did you mean" in unknown["error"]
    assert bad_kwargs["failed_at"] == "make_env" and "num_keys must be in 1..26" in bad_kwargs["error"]
    assert (unknown["reward"], unknown["generated"], unknown["env_id"]) == (0.0, 0, "k3rl/KeyLokup-v0")
    assert sandboxed["error"] is None and sandboxed["generated"] > 0 and opened  # the opening ran in a pool sandbox
    assert again["accepted"] is False and again["failed_at"] == "make_env"
    assert left == []
    if backend == "docker":
        leftovers = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=k3rl.job={job}"], capture_output=True,
                                   text=True, check=True).stdout.split()
        assert leftovers == []


@pytest.mark.slow  # seconds: make test runs it, make test-fast leaves it out
def test_an_episode_out_of_time_stops_its_request_on_the_engine(ray_cluster):
    """An episode whose time budget runs out while the engine decodes for it: the worker aborts the
    request, so the engine frees its slot at once instead of decoding the rest of the turn's tokens
    (an untrained k3-tiny rarely ends a turn: up to 4,000 tokens, tens of seconds on the CPU)."""
    cfg = JobConfig.from_dict({
        "name": f"abort-test-{os.getpid()}",
        "rollout": {"max_context_tokens": 8192, "sampling": {"max_tokens_per_turn": 4000}},
        "envs": {"max_turns": 2, "episode_time_budget_s": 2.0}, "learner": {"routing_replay": False},
        "sandbox": {"backend": "none"},
    })

    async def main():
        async with engine_and_buffer() as (pool, buffer):
            worker = RolloutWorker(cfg.to_dict(), pool, buffer, index=0)
            summary = await worker.run_episode(_spec(0, "k3rl/KeyLookup-v0"))
            running = []
            for _ in range(15):  # the abort reaches the engine within its next steps (without it: 3.3 s more here)
                running.append(sum(p["running"] + p["waiting"] for p in await pool.check_health.remote()))
                if running[-1] == 0:
                    break
                await asyncio.sleep(0.1)
            await worker.close()
            return summary, running

    summary, running = asyncio.run(main())
    assert summary["failed_at"] == "time_budget" and "time budget of 2s ran out" in summary["error"], summary
    assert running[-1] == 0, f"the engine still decodes the timed-out episode's request 1.5 s later: {running}"
