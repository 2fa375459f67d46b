"""Versioned weight updates: the atomic switch inside the engine, packing, and the transports'
process-level pieces (the broadcast group, CUDA IPC handles). With a pool: test_transport.py."""

from __future__ import annotations

import io
import time

import pytest
import torch

from k3rl.cluster import free_port
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.state_dict_adapter import to_hf
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.transport import BroadcastGroup, PackedUpdate, pack_bucket, unpack_bucket
from k3rl.types import SamplingParams, WeightBucket, WeightUpdate

torch.set_num_threads(1)


def _model(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


PROMPT = [(5 * i + 1) % 250 + 1 for i in range(17)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def _argmax_continuation(model, ids: list[int], start: int, n: int) -> list[int]:
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    return [int(logits[start - 1 + i].argmax()) for i in range(n)]


def test_update_changes_outputs_exactly_at_the_switch():
    old = _model(0)
    eng = EmbeddedEngine(_model(0), background=False)
    free = eng.generate(PROMPT, GREEDY).token_ids
    # new lm_head only (a partial update): the caches do not depend on it, so after the switch the
    # engine must produce exactly what a full forward of the new model gives on the same tokens
    new = _model(0)
    with torch.no_grad():
        new.lm_head.weight.copy_(_model(7).lm_head.weight)
    fut = eng.submit(PROMPT, GREEDY)
    for _ in range(4):  # 4 tokens with version 0
        eng.step()
    upd = WeightUpdate(version=1, full=False, buckets=[WeightBucket(tensors={"lm_head.weight": new.lm_head.weight.clone()})])
    assert eng.update_weights(upd) == 1 and eng.version == 1
    while not fut.done():
        eng.step()
    r = fut.result()
    assert r.versions == [0] * 4 + [1] * 6
    assert r.token_ids[:4] == free[:4]
    full = PROMPT + r.token_ids
    assert r.token_ids[4:] == _argmax_continuation(new, full, len(PROMPT) + 4, 6)
    assert r.token_ids[4:] != free[4:]
    # the old model's log-probs before the switch, the new one's after
    with torch.no_grad():
        lp_old = torch.log_softmax(old(torch.tensor([full]))[0].float(), -1)
        lp_new = torch.log_softmax(new(torch.tensor([full]))[0].float(), -1)
    P = len(PROMPT)
    for i, tok in enumerate(r.token_ids):
        ref = (lp_old if i < 4 else lp_new)[P - 1 + i, tok]
        assert r.logprobs[i] == pytest.approx(float(ref), rel=1e-4, abs=1e-4)


def test_full_update_with_official_names_replaces_the_model():
    target = _model(3)
    eng = EmbeddedEngine(_model(0), background=False)
    before = eng.generate(PROMPT, GREEDY)
    hf = to_hf(target.state_dict())
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in hf)  # official per-expert names travel
    eng.update_weights(WeightUpdate.from_state_dict(5, hf, bucket_bytes=1 << 16))
    after = eng.generate(PROMPT, GREEDY)
    assert after.versions == [5] * 10 and after.cached_prompt_tokens == 0  # old-version prefix states dropped
    assert after.token_ids == EmbeddedEngine(_model(3), background=False).generate(PROMPT, GREEDY).token_ids
    assert after.token_ids != before.token_ids


def test_bad_updates_are_refused_and_leave_the_weights_untouched():
    eng = EmbeddedEngine(_model(0), background=False)
    ref = eng.model.lm_head.weight.clone()
    good = eng.model.lm_head.weight + 1
    cases = [
        (WeightUpdate(version=0, full=False, buckets=[WeightBucket(tensors={"lm_head.weight": good})]), "not newer"),
        (WeightUpdate(version=1, full=False, buckets=[WeightBucket(tensors={"lm_head.weight": good,
                                                                           "model.nope.weight": good})]), "names the model does not have"),
        (WeightUpdate(version=1, full=False, buckets=[WeightBucket(tensors={"lm_head.weight": good,
                                                                           "model.norm.weight": torch.ones(3)})]), "shape"),
        (WeightUpdate(version=1, full=True, buckets=[WeightBucket(tensors={"lm_head.weight": good})]), "marked full"),
    ]
    for upd, msg in cases:
        with pytest.raises(ValueError, match=msg):
            eng.update_weights(upd)
        assert torch.equal(eng.model.lm_head.weight, ref) and eng.version == 0


def test_partial_update_of_some_experts_keeps_the_others():
    eng = EmbeddedEngine(_model(0), background=False)
    layer = eng.config.moe_layer_ids[0]
    w1 = eng.model.model.layers[layer].mlp.experts.w1
    before = w1.detach().clone()
    new0 = torch.randn_like(before[0])
    name = f"language_model.model.layers.{layer}.block_sparse_moe.experts.0.w1.weight"  # one expert, official name
    eng.update_weights(WeightUpdate(version=1, full=False, buckets=[WeightBucket(tensors={name: new0})]))
    assert torch.equal(w1[0], new0) and torch.equal(w1[1:], before[1:])
    with pytest.raises(ValueError, match="marked full"):  # a full update must carry every expert
        full = to_hf(eng.model.state_dict())
        del full[f"language_model.model.layers.{layer}.block_sparse_moe.experts.3.w2.weight"]
        eng.update_weights(WeightUpdate.from_state_dict(2, full))
    assert eng.version == 1


def test_threaded_engine_switches_between_steps():
    eng = EmbeddedEngine(_model(0), max_num_seqs=8)
    try:
        futures = [eng.submit(PROMPT[: 5 + i], SamplingParams(temperature=0, max_tokens=30)) for i in range(6)]
        new = _model(9)
        while eng.stats["decode_tokens"] == 0:  # every request is past its prefill and decoding
            time.sleep(0.005)
        eng.update_weights(WeightUpdate.from_state_dict(1, to_hf(new.state_dict())))
        results = [f.result(timeout=120) for f in futures]
    finally:
        eng.close()
    for r in results:  # each token has one version, and a request never goes back in versions
        assert set(r.versions) <= {0, 1} and r.versions == sorted(r.versions)
    assert eng.version == 1 and any(r.versions[0] == 0 and r.versions[-1] == 1 for r in results)


def test_pack_unpack_round_trip_keeps_dtypes_shapes_and_bits():
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3, 5), "b.bf16": torch.randn(7).to(torch.bfloat16), "c": torch.arange(5),
               "d": torch.randn(2, 2, 3).double(), "e.scalar": torch.tensor(2.5)}
    buf, man = pack_bucket(WeightBucket(tensors=tensors))
    assert all(s.offset % 16 == 0 for s in man.slots) and buf.numel() == man.nbytes
    out = unpack_bucket(buf, man).tensors
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t)
    upd = WeightUpdate.from_state_dict(4, tensors, bucket_bytes=32)
    back = PackedUpdate.from_wire(PackedUpdate.pack(upd).to_wire()).to_update()  # through the plain-data form
    assert back.version == 4 and len(back.buckets) == len(upd.buckets)
    assert all(torch.equal(back.state_dict()[k], t) for k, t in tensors.items())
    with pytest.raises(ValueError, match="disagree"):
        unpack_bucket(buf[:-1], man)


def _receiver(port: int, backend: str, queue) -> None:
    sync = BroadcastGroup(1, 2, port=port, backend=backend, device="cuda:1" if backend == "nccl" else "cpu")
    upd = sync.recv()
    queue.put((upd.version, upd.full, _as_bytes(upd.state_dict())))


def _as_bytes(state: dict) -> bytes:
    """A state dict as bytes for a queue: a tensor put on a queue is a shared-memory handle, and the
    child may exit before the parent opens it (CI saw FileNotFoundError from the handle's vanished socket).
    Each tensor is cloned: they are views of one received buffer, which torch.save refuses."""
    buf = io.BytesIO()
    torch.save({k: v.cpu().clone() for k, v in state.items()}, buf)
    return buf.getvalue()


def _collective_round_trip(backend: str) -> None:
    import torch.multiprocessing as mp

    torch.manual_seed(1)
    state = {"w": torch.randn(64, 33), "v": torch.randn(100).to(torch.bfloat16), "i": torch.arange(9)}
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, backend, queue))
    proc.start()
    try:
        sync = BroadcastGroup(0, 2, port=port, backend=backend, device="cuda:0" if backend == "nccl" else "cpu",
                                    timeout_s=120)
        times = sync.send(WeightUpdate.from_state_dict(2, state, bucket_bytes=4096, full=False))
        version, full, raw_state = queue.get(timeout=120)
        got = torch.load(io.BytesIO(raw_state))
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert version == 2 and full is False
    assert all(torch.equal(got[k], t) for k, t in state.items())
    # every byte of every tensor moved (plus at most 15 bytes of alignment after each)
    raw = sum(t.numel() * t.element_size() for t in state.values())
    assert raw <= times["bytes"] <= raw + 15 * len(state)
    assert min(times["pack_s"], times["wait_s"], times["transfer_s"]) >= 0


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_collective_broadcast_on_gloo():
    _collective_round_trip("gloo")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL weight broadcast needs 2 CUDA GPUs (one per rank)")
def test_collective_broadcast_on_nccl():
    _collective_round_trip("nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU shared by two processes")
def test_cuda_ipc_share_and_open():
    import torch.multiprocessing as mp

    from k3rl.rollout.transport import share_cuda_ipc

    state = {"w": torch.randn(128, 7, device="cuda"), "b": torch.randn(9, device="cuda").to(torch.bfloat16)}
    share = share_cuda_ipc(WeightUpdate.from_state_dict(1, state, bucket_bytes=1024))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_open_ipc, args=(share, queue))
    proc.start()
    got = torch.load(io.BytesIO(queue.get(timeout=120)))
    proc.join(timeout=60)
    share.release()
    assert all(torch.equal(got[k], t.cpu()) for k, t in state.items())


def _open_ipc(share, queue) -> None:
    from k3rl.rollout.transport import open_cuda_ipc

    upd = open_cuda_ipc(share)
    queue.put(_as_bytes(upd.state_dict()))


def test_a_transport_receive_never_runs_beside_a_graph_capture(ray_cluster):
    """An engine worker receives a weight update (IPC handles opened, copies, device syncs) holding the
    engine's device lock, the one every CUDA graph capture holds: on the GPU a receive beside a capture
    invalidated it (a job's engine then lost every later capture)."""
    import asyncio

    import ray

    from k3rl.rollout.pool import EngineSpec, EngineWorker
    from k3rl.rollout.transport import TRANSPORTS
    from k3rl.rollout.transport.object_store import PublishedUpdate

    worker = EngineWorker(EngineSpec(preset="k3-tiny", engine_kwargs={"background": True}), "e0")
    real = TRANSPORTS["object_store"](device="cpu")
    held = []

    class Watched:  # the real receive, and whether the engine's lock is held around it
        def receive(self, message, member):
            held.append(worker.engine.device_lock.locked())
            return real.receive(message, member)

    worker.receivers["object_store"] = Watched()
    new = _model(3).lm_head.weight.clone()
    update = WeightUpdate(version=1, full=False, buckets=[WeightBucket(tensors={"lm_head.weight": new})])
    message = PublishedUpdate(1, False, ray.put(PackedUpdate.pack(update)))
    try:
        assert asyncio.run(worker.update_weights(message)) == 1
        assert held == [True] and not worker.engine.device_lock.locked()
        assert torch.equal(worker.engine.model.lm_head.weight, new)
    finally:
        worker.engine.close()


def test_a_slow_receive_never_stops_the_engine_decoding(ray_cluster):
    """A weight transfer that takes seconds (a slow network) runs beside the engine's steps: a request
    submitted while it is received is decoded and answered before the receive ends, and the new weights
    apply after it. (The receive once held the step lock: every running episode waited through the whole
    transfer, and a slow broadcast spent their time budgets, failing them as if the env had hung.)"""
    import asyncio

    import ray

    from k3rl.rollout.pool import EngineSpec, EngineWorker
    from k3rl.rollout.transport import TRANSPORTS
    from k3rl.rollout.transport.object_store import PublishedUpdate

    worker = EngineWorker(EngineSpec(preset="k3-tiny", engine_kwargs={"background": True}), "e0")
    real = TRANSPORTS["object_store"](device="cpu")
    receiving = asyncio.Event()

    class SlowNetwork:  # the real receive after 2 s on the wire
        def receive(self, message, member):
            loop.call_soon_threadsafe(receiving.set)
            time.sleep(2.0)
            return real.receive(message, member)

    worker.receivers["object_store"] = SlowNetwork()
    new = _model(3).lm_head.weight.clone()
    update = WeightUpdate(version=1, full=False, buckets=[WeightBucket(tensors={"lm_head.weight": new})])
    message = PublishedUpdate(1, False, ray.put(PackedUpdate.pack(update)))

    async def main():
        switch = asyncio.create_task(worker.update_weights(message))
        await receiving.wait()
        result = await worker.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), None, "r1")
        answered_during_receive = not switch.done()
        return result, answered_during_receive, await switch

    try:
        loop = asyncio.new_event_loop()
        result, answered_during_receive, version = loop.run_until_complete(main())
        assert answered_during_receive and len(result.token_ids) == 4 and result.versions == [0] * 4
        assert version == 1 and torch.equal(worker.engine.model.lm_head.weight, new)
    finally:
        loop.close()
        worker.engine.close()
