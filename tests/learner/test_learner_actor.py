"""The learner actor and its rank group: atomic checkpoints, and the group on a real Ray cluster
(two FSDP ranks on gloo, a KL reference reset by an SFT warm start, trajectories by reference,
weights pushed to a real engine pool, save / load, shutdown)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import ray
import torch
from learner_helpers import make_trajectories

from k3rl.config import JobConfig
from k3rl.learner.actor import (
    CheckpointError,
    LearnerActor,
    LearnerGroup,
    checkpoint_problem,
    latest_checkpoint,
)

torch.set_num_threads(1)


def _cfg(*extra: str) -> JobConfig:
    return JobConfig.load(None, ["learner.micro_batch_tokens=64", "rollout.prompts_per_step=2",
                                 "rollout.group_size=2", *extra])


def test_sft_trains_each_phase_on_its_own_demonstrations(tmp_path):
    """learner.sft_phases: steps before from_step sample demo_sets[0], later ones demo_sets[1] (told
    apart here by their loss tokens: the later set's completions are 8 times as long)."""
    cfg = _cfg("learner.sft_steps=5", "learner.sft_phases=[{from_step: 3, env_kwargs: {x: 1}}]")
    actor = LearnerActor(cfg.to_dict(), str(tmp_path))
    actor.setup(None)
    short = make_trajectories(0, n=4, max_completion=4)
    long = [t.model_copy(update={"completion_ids": t.completion_ids * 8, "logprobs": t.logprobs * 8,
                                 "loss_mask": t.loss_mask * 8, "versions": t.versions * 8}) for t in short]
    out = actor.sft([short, long], 5)
    S = sum(sum(t.loss_mask) for t in short)  # a step's batch is all 4 (prompts_per_step x group_size)
    assert [m["loss_tokens"] for m in out] == [S] * 3 + [8 * S] * 2
    with pytest.raises(ValueError, match=r"sft: 1 demonstration sets for 1 learner.sft_phases"):
        actor.sft([short], 2)
    # learner.sft_batch: demonstrations per step apart from the RL batch (here 1 of the 4)
    actor = LearnerActor(_cfg("learner.sft_steps=2", "learner.sft_batch=1").to_dict(), str(tmp_path))
    actor.setup(None)
    one = {8 * sum(t.loss_mask) for t in short}
    assert all(m["loss_tokens"] in one for m in actor.sft([long], 2))


def test_sft_in_pieces_trains_as_one_call(tmp_path, monkeypatch):
    """The driver runs the warm start in pieces (k3rl/job.py, SFT_PIECE) to report its loss as it goes:
    the same demonstrations, phases and weights as one call; a piece out of order is refused. (At a fixed
    thread count: K3RL_LEARNER_THREADS; the count that follows the free cores can differ from step to step,
    and with it the sums' rounding.)"""
    monkeypatch.setenv("K3RL_LEARNER_THREADS", "1")
    cfg = _cfg("learner.sft_steps=5", "learner.sft_phases=[{from_step: 2, env_kwargs: {x: 1}}]")
    sets = [make_trajectories(0, n=4), make_trajectories(1, n=4, max_completion=12)]
    whole = LearnerActor(cfg.to_dict(), str(tmp_path / "a"))
    whole.setup(None)
    one = whole.sft(sets, 5)
    pieces = LearnerActor(cfg.to_dict(), str(tmp_path / "b"))
    pieces.setup(None)
    with pytest.raises(ValueError, match="asked to start at step 3, but the warm start is at step 0"):
        pieces.sft(sets, 2, 3)
    parts = pieces.sft(sets, 3) + pieces.sft(sets, 2, 3)
    assert [m["loss"] for m in parts] == [m["loss"] for m in one]
    for (name, a), b in zip(whole.trainer.model.state_dict().items(), pieces.trainer.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_interrupted_save_leaves_latest_at_the_previous_step(tmp_path):
    actor = LearnerActor(_cfg().to_dict(), str(tmp_path))
    actor.setup(None)
    ckpts = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) is None
    assert actor.save(1, {"groups_issued": 2}) == str(ckpts / "step-000001")
    actor.train_step(make_trajectories(0, n=4))

    # a save that fails midway (its data cursor cannot be written, after the model and optimizer were)
    with pytest.raises(TypeError, match="not JSON serializable"):
        actor.save(2, {"groups_issued": object()})
    assert (ckpts / ".step-000002.tmp" / "model").is_dir()  # the half-written step stays aside
    assert not (ckpts / "step-000002").exists()
    assert (ckpts / "latest").read_text().strip() == "step-000001"
    assert latest_checkpoint(tmp_path) == ckpts / "step-000001"

    # the next save succeeds and removes the leftovers
    actor.save(2, {"groups_issued": 4})
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000001", "step-000002"]
    assert (ckpts / "latest").read_text().strip() == "step-000002"
    assert latest_checkpoint(tmp_path) == ckpts / "step-000002"

    # saving a step that is already complete writes nothing (the final save after a periodic one)
    before = {p: p.stat().st_mtime_ns for p in (ckpts / "step-000002").rglob("*")}
    actor.save(2, {"groups_issued": 99})
    assert {p: p.stat().st_mtime_ns for p in (ckpts / "step-000002").rglob("*")} == before
    fresh = LearnerActor(_cfg().to_dict(), str(tmp_path))
    fresh.setup(None)
    assert fresh.load(str(ckpts / "step-000002")) == {"step": 1, "groups_issued": 4}

    # a save interrupted after its rename but before `latest` moved: the complete step counts
    (ckpts / "latest").write_text("step-000001\n")
    assert latest_checkpoint(tmp_path) == ckpts / "step-000002"


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}})
    yield
    if started:
        ray.shutdown()


@pytest.mark.slow
def test_group_of_two_fsdp_ranks_trains_pushes_and_checkpoints(ray_cluster, tmp_path):
    from k3rl.model import load_hf
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.pool import EngineSpec, PoolActor
    from k3rl.types import SamplingParams

    cfg = _cfg("learner.data_parallel=fsdp", "learner.world_size=2", "learner.kl_coef=0.1")
    pool = PoolActor.remote(1, EngineSpec(preset="k3-tiny", seed=cfg.model.seed), actor_options={"num_cpus": 0})
    group = LearnerGroup(cfg, tmp_path, pool)

    async def main():
        await asyncio.gather(group.start(), pool.wait_ready.remote())
        sft = await group.call("sft", [make_trajectories(0, n=4)], 2)  # then the KL reference is reset (collective)
        assert len(sft) == 2 and sft[1]["nll"] < sft[0]["nll"]
        metrics = await group.call("train_step", ray.put(make_trajectories(1, n=4)))  # by reference
        assert metrics["step"] == 1 and abs(metrics["kl"]) < 1e-6  # the step starts at the reference
        report = await group.push_weights(2)
        path = await group.call("save", 1, {"groups_issued": 2})
        state = await group.call("load", path)
        return report, path, state

    try:
        report, path, state = asyncio.run(main())
        assert report["weight_sync/fallbacks"] == 0 and report["weight_sync/bytes"] > 0
        assert report["weight_sync/seconds"] > 0
        assert state == {"step": 1, "groups_issued": 2} and latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000001"
        # the engine serves exactly the weights the ranks trained (and checkpointed)
        greedy = SamplingParams(temperature=0, max_tokens=6)
        prompt = [(5 * i + 2) % 250 + 1 for i in range(9)]
        served = ray.get(pool.generate.remote(prompt, greedy), timeout=120)
        trained = EmbeddedEngine(load_hf(os.path.join(path, "model"), dtype=torch.float32), background=False)
        assert served.versions == [2] * 6 and served.token_ids == trained.generate(prompt, greedy).token_ids
    finally:
        actors = list(group.actors)
        group.shutdown()
        group.shutdown()  # idempotent
        ray.get(pool.shutdown.remote())
        ray.kill(pool)
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.rendezvous_address.remote(), timeout=60)


def test_resume_skips_a_torn_checkpoint_with_a_warning_and_a_save_replaces_it(tmp_path):
    """A machine crash can leave the newest `step-*` torn (a file cut short, the manifest never written):
    `latest_checkpoint` (what --resume loads) says what is wrong with it and falls back to the
    previous complete step, which loads; the next save of that step replaces the torn one."""
    actor = LearnerActor(_cfg().to_dict(), str(tmp_path))
    actor.setup(None)
    ckpts = tmp_path / "checkpoints"
    actor.save(1, {"groups_issued": 2})
    actor.train_step(make_trajectories(0, n=4))
    actor.save(2, {"groups_issued": 4})
    actor.train_step(make_trajectories(1, n=4))
    actor.save(3, {"groups_issued": 6})
    assert latest_checkpoint(tmp_path) == ckpts / "step-000003"

    # step 3: the optimizer file cut short; step 2: the manifest (written last) never made it
    optimizer = ckpts / "step-000003" / "optimizer-rank0.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    (ckpts / "step-000002" / "complete.json").unlink(missing_ok=True)
    with pytest.warns(UserWarning, match=r"step-000003: optimizer-rank0.pt has 100 bytes where \d+ were written; "
                                         r"step-000002: it has no complete.json"):
        resume_from = latest_checkpoint(tmp_path)
    assert resume_from == ckpts / "step-000001"
    fresh = LearnerActor(_cfg().to_dict(), str(tmp_path))
    fresh.setup(None)
    assert fresh.load(str(resume_from)) == {"step": 0, "groups_issued": 2}

    # the resumed run saves step 2 again: the torn directory is replaced by a complete one
    fresh.train_step(make_trajectories(0, n=4))
    fresh.save(2, {"groups_issued": 4})
    manifest = json.loads((ckpts / "step-000002" / "complete.json").read_text())
    assert {"trainer.json", "optimizer-rank0.pt", "rng-rank0.pt"} <= set(manifest)
    assert checkpoint_problem(ckpts / "step-000002") is None
    with pytest.warns(UserWarning, match="step-000003"):
        assert latest_checkpoint(tmp_path) == ckpts / "step-000002"

    # every step torn: a clear refusal, not a silent fresh start
    for step in (1, 2):
        (ckpts / f"step-{step:06d}" / "trainer.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* is complete \(step-000003: .*step-000001: "
                                              r"trainer.json has 1 bytes.*Start a new run"):
        latest_checkpoint(tmp_path)


def test_trim_heap_returns_freed_blocks_below_live_ones():
    # 160 MB in 64 KiB blocks (under glibc's mmap threshold: on the heap), all freed but the last, which
    # pins the heap's top: free() alone keeps them resident, malloc_trim gives them back
    import psutil

    from k3rl.learner.actor import _libc, trim_heap

    if _libc() is None or not hasattr(_libc(), "malloc_trim"):
        pytest.skip("not glibc")
    me = psutil.Process()
    trim_heap()
    blocks = [bytearray(64 << 10) for _ in range(2560)]
    pin = blocks.pop()
    held = me.memory_info().rss
    del blocks
    kept = me.memory_info().rss
    assert trim_heap()
    after = me.memory_info().rss
    assert held - kept < 40 << 20, (held, kept)  # free() alone gave little back
    assert kept - after > 100 << 20, (kept, after)
    del pin
