"""Each weight transport end to end: its send half (here in the test process, in a job in the
learner's rank 0) against its receive half in real engine workers behind a PoolActor, on a
local Ray cluster. CUDA IPC needs engines on the sender's GPU and is skipped without one."""

from __future__ import annotations

import pytest
import ray
import torch

from k3rl.model import build_model
from k3rl.model.state_dict_adapter import to_hf
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.pool import EngineSpec, PoolActor
from k3rl.rollout.transport import CollectiveTransport, CudaIpcTransport, ObjectStoreTransport
from k3rl.types import SamplingParams, WeightUpdate

torch.set_num_threads(1)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(11)]
GREEDY = SamplingParams(temperature=0, max_tokens=5)


def _pool(device: str = "cpu"):
    spec = EngineSpec(preset="k3-tiny", seed=0, device=device, engine_kwargs={"max_num_seqs": 4})
    options = {"num_cpus": 0, "num_gpus": 0.3 if device == "cuda" else 0}
    pool = PoolActor.remote(2, spec, actor_options=options)
    ray.get(pool.wait_ready.remote(), timeout=180)
    return pool


def _stop(pool) -> None:
    ray.get(pool.shutdown.remote())
    ray.kill(pool)


def _update(version: int, seed: int, device: str = "cpu") -> WeightUpdate:
    state = {k: v.to(device) for k, v in to_hf(build_model("k3-tiny", seed=seed).state_dict()).items()}
    return WeightUpdate.from_state_dict(version, state, bucket_bytes=1 << 20)


def _serves(pool, seed: int, version: int) -> None:
    """Every engine runs `version` and samples exactly what the model of `seed` samples."""
    assert {h["version"] for h in ray.get(pool.check_health.remote(), timeout=120)} == {version}
    want = EmbeddedEngine(build_model("k3-tiny", seed=seed), background=False).generate(PROMPT, GREEDY).token_ids
    for key in ("a", "b", "c", "d"):  # least-loaded routing spreads these over both engines
        r = ray.get(pool.generate.remote(PROMPT, GREEDY, key=key), timeout=120)
        assert r.versions == [version] * 5 and r.token_ids == want


def _model_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in _update(0, 0).state_dict().values())


@pytest.mark.slow
def test_object_store_send_and_receive(ray_cluster):
    pool = _pool()
    try:
        transport = ObjectStoreTransport(timeout_s=120)
        report = transport.send(_update(1, seed=5), pool)
        assert report["weight_sync/fallbacks"] == 0 and report["weight_sync/bytes"] >= _model_bytes()
        _serves(pool, seed=5, version=1)
        # a restarted engine is replayed the update from the object store
        ray.kill(ray.get(pool.worker_handles.remote())[0], no_restart=True)
        ray.get(pool.check_health.remote(), timeout=120)
        _serves(pool, seed=5, version=1)
        report = transport.send(_update(2, seed=6), pool)
        _serves(pool, seed=6, version=2)
    finally:
        _stop(pool)


@pytest.mark.slow
def test_collective_broadcast_reuses_its_group_and_falls_back_when_an_engine_dies(ray_cluster):
    """gloo between CPU processes (NCCL between GPUs: the same code)."""
    pool = _pool()
    transport = CollectiveTransport("cpu", timeout_s=30)
    try:
        first = transport.send(_update(1, seed=5), pool)
        assert first["weight_sync/fallbacks"] == 0 and first["weight_sync/new_group"] == 1
        assert first["weight_sync/bytes"] >= _model_bytes() and first["weight_sync/broadcast_s"] > 0
        _serves(pool, seed=5, version=1)
        second = transport.send(_update(2, seed=6), pool)
        assert second["weight_sync/fallbacks"] == 0 and second["weight_sync/new_group"] == 0  # same group
        _serves(pool, seed=6, version=2)

        # engine 1 dies: the broadcast to it fails, the same version arrives through the object
        # store (the pool restarts the engine and replays it the update) ...
        ray.kill(ray.get(pool.worker_handles.remote())[1], no_restart=True)
        third = transport.send(_update(3, seed=7), pool)
        assert third["weight_sync/fallbacks"] == 1 and "weight_sync/broadcast_s" not in third
        assert third["weight_sync/bytes"] >= _model_bytes()
        _serves(pool, seed=7, version=3)

        # ... and the next update forms a new group that holds the replacement
        fourth = transport.send(_update(4, seed=8), pool)
        assert fourth["weight_sync/fallbacks"] == 0 and fourth["weight_sync/new_group"] == 1
        _serves(pool, seed=8, version=4)
    finally:
        transport.close()
        _stop(pool)


def test_collective_receiver_outside_the_group_is_refused():
    from k3rl.rollout.transport import Broadcast

    message = Broadcast(1, True, "127.0.0.1:1", ["pool-w0-g0"], "gloo", 5.0)
    with pytest.raises(RuntimeError, match="not in the weight-broadcast group"):
        CollectiveTransport("cpu").receive(message, "pool-w0-g1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs engines on the learner's GPU")
def test_cuda_ipc_send_and_receive(ray_cluster):
    pool = _pool("cuda")
    try:
        report = CudaIpcTransport("cuda", timeout_s=120).send(_update(1, seed=5, device="cuda"), pool)
        assert report["weight_sync/fallbacks"] == 0 and report["weight_sync/bytes"] >= _model_bytes()
        _serves(pool, seed=5, version=1)
    finally:
        _stop(pool)
