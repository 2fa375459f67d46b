"""InferencePool on a real local Ray cluster with two k3-tiny workers (one cluster for the module)."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch

from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.state_dict_adapter import to_hf
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.pool import EngineSpec, InferencePool
from k3rl.rollout.transport import publish
from k3rl.types import SamplingParams, WeightUpdate

torch.set_num_threads(1)
SPEC = EngineSpec(preset="k3-tiny", seed=0, engine_kwargs={"max_num_seqs": 16})
NO_CPU_SLOT = {"num_cpus": 0}  # schedulable whatever Ray cluster another test module left running


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(11 * i + offset) % 250 + 1 for i in range(n)]


def _local(prompt, params):
    torch.manual_seed(0)
    return EmbeddedEngine(K3ForCausalLM(K3Config.preset("k3-tiny")), background=False).generate(prompt, params)


@pytest.mark.slow
def test_pool_routing_failover_and_weight_broadcast(ray_cluster):
    async def main():
        pool = InferencePool(2, SPEC, max_retries=3, actor_options=NO_CPU_SLOT)
        await pool.wait_ready()
        try:
            # least-loaded: 4 concurrent requests spread 2 / 2
            params = [SamplingParams(temperature=1.0, max_tokens=6, seed=s) for s in range(4)]
            res = await asyncio.gather(*(pool.generate(_prompt(9, s), p) for s, p in enumerate(params)))
            assert sorted(r.worker[-5:] for r in res).count(res[0].worker[-5:]) == 2
            for s, (p, r) in enumerate(zip(params, res, strict=True)):
                assert r.token_ids == _local(_prompt(9, s), p).token_ids  # seeded: same tokens on any worker

            # sticky: the second turn of an episode goes to the same worker and reuses its prefix
            first = await pool.generate(_prompt(20), SamplingParams(temperature=0, max_tokens=4), key="episode-7")
            turn2 = _prompt(20) + first.token_ids + _prompt(5, 3)
            second = await pool.generate(turn2, SamplingParams(temperature=0, max_tokens=4), key="episode-7")
            assert second.worker == first.worker and second.cached_prompt_tokens == 24

            # group key: the episodes of one GRPO group start on one worker, which forks the prompt
            group = await asyncio.gather(*(pool.generate(_prompt(30, 50), SamplingParams(max_tokens=3, seed=s),
                                                         key=f"ep-{s}", group_key="g1") for s in range(3)))
            assert len({r.worker for r in group}) == 1
            assert sorted(r.cached_prompt_tokens for r in group) == [0, 30, 30]

            # a bad request fails with the engine's message and is not retried
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await pool.generate([1, 10**6], SamplingParams(max_tokens=2))
            assert pool.retries == 0

            # abort through the pool: the request returns its tokens so far
            task = asyncio.create_task(pool.generate(_prompt(8), SamplingParams(max_tokens=500, seed=1), request_id="ab"))
            while not await pool.abort("ab"):
                await asyncio.sleep(0.01)
            aborted = await asyncio.wait_for(task, 60)
            assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 500
            assert not await pool.abort("ab")

            # kill a worker mid-request: every request still completes, with the tokens of a local run
            long = [SamplingParams(temperature=0.9, max_tokens=60, seed=100 + s) for s in range(6)]
            tasks = [asyncio.create_task(pool.generate(_prompt(12, s), p)) for s, p in enumerate(long)]
            victim = pool.workers[0]
            for _ in range(400):  # until the victim is decoding
                if (await victim.ping.remote())["running"] > 0:
                    break
                await asyncio.sleep(0.01)
            ray.kill(victim, no_restart=True)
            done = await asyncio.wait_for(asyncio.gather(*tasks), 240)
            assert len(done) == 6 and all(len(r.token_ids) == 60 for r in done)
            for s, (p, r) in enumerate(zip(long, done, strict=True)):
                assert r.token_ids == _local(_prompt(12, s), p).token_ids
            assert pool.retries >= 1
            health = await pool.check_health()
            assert all(h["alive"] for h in health) and pool.restarts == 1

            # weights: one publish, every worker (the restarted one included) switches to v1
            torch.manual_seed(5)
            new = K3ForCausalLM(K3Config.preset("k3-tiny"))
            assert await pool.update_weights(WeightUpdate.from_state_dict(1, to_hf(new.state_dict()))) == [1, 1]
            assert {h["version"] for h in await pool.check_health()} == {1}
            r = await pool.generate(_prompt(10), SamplingParams(temperature=0, max_tokens=5))
            ref = EmbeddedEngine(new.eval(), background=False).generate(_prompt(10), SamplingParams(temperature=0, max_tokens=5))
            assert r.versions == [1] * 5 and r.token_ids == ref.token_ids

            # an update its maker already put into the object store: only the handle travels,
            # and a worker restarted later is replayed it from there (under a new name)
            torch.manual_seed(6)
            newer = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
            members = pool.members()
            assert await pool.update_weights(publish(WeightUpdate.from_state_dict(2, to_hf(newer.state_dict())))) == [2, 2]
            ray.kill(pool.workers[1], no_restart=True)
            await asyncio.sleep(0.5)
            health = await pool.check_health(timeout_s=20)
            assert [h["alive"] for h in health] == [True, False] and pool.restarts == 2
            assert [h["version"] for h in await pool.check_health()] == [2, 2]
            assert pool.members()[0] == members[0] and pool.members()[1] != members[1]
            r = await pool.generate(_prompt(10), SamplingParams(temperature=0, max_tokens=5))
            ref = EmbeddedEngine(newer, background=False).generate(_prompt(10), SamplingParams(temperature=0, max_tokens=5))
            assert r.versions == [2] * 5 and r.token_ids == ref.token_ids

            # the current version again is a re-send (workers that have it skip it); older is refused
            assert await pool.update_weights(WeightUpdate.from_state_dict(2, to_hf(new.state_dict()))) == [2, 2]
            r = await pool.generate(_prompt(10), SamplingParams(temperature=0, max_tokens=5))
            assert r.token_ids == ref.token_ids  # still v2's weights: nothing was applied twice
            with pytest.raises(ValueError, match="older than the pool's v2"):
                await pool.update_weights(WeightUpdate.from_state_dict(1, to_hf(new.state_dict())))
            with pytest.raises(TypeError, match="takes a WeightUpdate or a weight transport message"):
                await pool.update_weights({"version": 6})
        finally:
            pool.shutdown()

    asyncio.run(main())


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_pool_actor_is_one_shared_handle(ray_cluster):
    from k3rl.rollout.pool import PoolActor

    actor = PoolActor.remote(1, SPEC, actor_options=NO_CPU_SLOT)
    try:
        ray.get(actor.wait_ready.remote(), timeout=120)
        params = SamplingParams(temperature=0, max_tokens=4)
        r = ray.get(actor.generate.remote(_prompt(7), params, key="e1"), timeout=120)
        assert r.token_ids == _local(_prompt(7), params).token_ids and r.versions == [0] * 4
        assert ray.get(actor.version.remote()) == 0
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
