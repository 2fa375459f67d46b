"""The old import path of the weight transports, which now live in `k3rl.rollout.transport`
(one module per transport). Only benchmarks/engine.py still imports from here: delete this
file once it imports `BroadcastGroup`, `publish`, `share_cuda_ipc`, `open_cuda_ipc` from there
(and receives with `ObjectStoreTransport().receive(message, name)`)."""

from .transport import BroadcastGroup as CollectiveWeightSync
from .transport import ObjectStoreTransport, PublishedUpdate, open_cuda_ipc, publish, share_cuda_ipc


def receive(message: PublishedUpdate):
    return ObjectStoreTransport().receive(message, "receiver")


__all__ = ["CollectiveWeightSync", "open_cuda_ipc", "publish", "receive", "share_cuda_ipc"]
