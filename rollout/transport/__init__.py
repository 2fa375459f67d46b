"""How new weights get from the learner to the inference engines: one class per
`rollout.weight_transport`, each with a send half (runs in the learner's rank 0) and a receive
half (runs in every engine worker).

    learner/actor.py   LearnerActor.push_weights: every rank exports the update (collective
                       under FSDP), rank 0 calls `transport.send(update, pool)`
    transport/<name>   send: pack, hand the pool a small message (a reference, handles, or a
                       group address), wait until every engine runs the new version
    rollout/pool.py    InferencePool.update_weights(message): every worker calls
                       `receive(message, its name)` and switches its engine between two steps;
                       restarts dead engines and replays them the latest object-store update

| name           | message           | what travels                                                  |
| -------------- | ----------------- | ------------------------------------------------------------- |
| `object_store` | `PublishedUpdate` | a reference; every engine reads the packed buffers once       |
| `nccl`         | `Broadcast`       | a group address; the buffers go by NCCL (gloo on CPUs)        |
| `cuda_ipc`     | `IpcShare`        | handles to the buffers in the learner's GPU memory            |

The last two fall back to the object store when they fail (`object_store.fall_back`), so an
update is never lost. Packing (a bucket = one byte buffer + a manifest) is in `packing.py`.
"""

from __future__ import annotations

from k3rl.cluster import rendezvous_host

from .collective import Broadcast, BroadcastGroup, CollectiveTransport
from .cuda_ipc import CudaIpcTransport, IpcShare, open_cuda_ipc, share_cuda_ipc
from .object_store import ObjectStoreTransport, PublishedUpdate, fall_back, publish
from .packing import BucketManifest, PackedUpdate, TensorSlot, pack_bucket, unpack_bucket

TRANSPORTS = {t.name: t for t in (ObjectStoreTransport, CollectiveTransport, CudaIpcTransport)}


def make_transport(cfg, device: str = "cpu"):
    """The send half of `cfg.rollout.weight_transport` for a learner rank 0 on `device`. Its
    group's store listens on this node's address on a cluster, on loopback for a local Ray."""
    name = cfg.rollout.weight_transport
    if name not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={name!r} is not one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](device=device, timeout_s=cfg.rollout.weight_sync_timeout_s,
                            host=rendezvous_host(bool(cfg.ray.address)))


__all__ = [
    "TRANSPORTS", "Broadcast", "BroadcastGroup", "BucketManifest", "CollectiveTransport", "CudaIpcTransport",
    "IpcShare", "ObjectStoreTransport", "PackedUpdate", "PublishedUpdate", "TensorSlot", "fall_back",
    "make_transport", "open_cuda_ipc", "pack_bucket", "publish", "share_cuda_ipc", "unpack_bucket",
]
