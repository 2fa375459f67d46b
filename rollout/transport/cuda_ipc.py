"""Weights by CUDA IPC (`rollout.weight_transport: cuda_ipc`): engines that share the learner's
GPU copy the update straight out of the learner's GPU memory.

Send half (learner rank 0): pack the buckets on the GPU and hand the pool an `IpcShare`,
picklable handles to those buffers; release them once every engine has copied them out.
Receive half (engine worker): open the handles and copy. An engine restarted meanwhile (it
cannot open handles of an update it never saw) or any failure sends the same version through
the object store instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.multiprocessing.reductions import reduce_tensor

from k3rl.types import WeightUpdate

from .object_store import fall_back, wait_for_pool
from .packing import BucketManifest, pack_bucket, unpack_bucket


@dataclass
class IpcShare:
    """Picklable handles to bucket buffers living in the sender's GPU memory."""

    version: int
    full: bool
    manifests: list[BucketManifest]
    handles: list[tuple]  # torch.multiprocessing.reductions.reduce_tensor() of each buffer
    _keep: list[torch.Tensor] = field(default_factory=list, repr=False)
    transport: ClassVar[str] = "cuda_ipc"

    def __getstate__(self):
        return {"version": self.version, "full": self.full, "manifests": self.manifests, "handles": self.handles,
                "_keep": []}

    def release(self) -> None:
        """Drop the sender's buffers (after every receiver has copied them out)."""
        self._keep.clear()


def share_cuda_ipc(update: WeightUpdate, device: str | torch.device = "cuda") -> IpcShare:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("CUDA IPC weight sharing needs a CUDA device shared by sender and receivers; "
                           "use the object store (default) elsewhere")
    bufs, mans = zip(*(pack_bucket(b, device) for b in update.buckets), strict=True) if update.buckets else ((), ())
    torch.cuda.synchronize(device)
    return IpcShare(update.version, update.full, list(mans), [reduce_tensor(b) for b in bufs], list(bufs))


def open_cuda_ipc(share: IpcShare, device: str | torch.device | None = None) -> WeightUpdate:
    """Open the handles (same host, the GPU visible to this process) and copy the tensors out."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA IPC handles can only be opened by a process that sees the sender's GPU")
    buckets = []
    for man, (rebuild, args) in zip(share.manifests, share.handles, strict=True):
        buf = rebuild(*args)
        if device is not None:
            buf = buf.to(device)
        buckets.append(unpack_bucket(buf, man, copy=True))  # own copy: the sender may release its buffer
    torch.cuda.synchronize()
    return WeightUpdate(version=share.version, buckets=buckets, full=share.full, transport="cuda_ipc")


class CudaIpcTransport:
    name = "cuda_ipc"

    def __init__(self, device: str = "cuda", timeout_s: float = 300.0, host: str = "127.0.0.1"):
        self.device = torch.device(device)
        self.timeout_s = timeout_s

    # ----- send half (learner rank 0) -------------------------------------------------------------
    def send(self, update: WeightUpdate, pool) -> dict[str, float]:
        """Bring every engine of `pool` (a PoolActor handle) to `update`; returns the timings."""
        t0 = time.perf_counter()
        share = share_cuda_ipc(update, self.device)
        try:
            versions = wait_for_pool(pool.update_weights.remote(share), update.version, self.timeout_s)
            behind = [v for v in versions if v < update.version]
            if behind:
                raise RuntimeError(f"{len(behind)} engine(s) were restarted during the update")
        except Exception as e:  # noqa: BLE001 - any failure: the object store delivers it instead
            return fall_back(update, pool, e, self.timeout_s)
        finally:
            share.release()  # every engine copied it out (or gave up)
        return {"weight_sync/bytes": float(sum(m.nbytes for m in share.manifests)),
                "weight_sync/ipc_s": time.perf_counter() - t0, "weight_sync/fallbacks": 0.0}

    # ----- receive half (engine worker) ------------------------------------------------------------
    def receive(self, message: IpcShare, member: str) -> WeightUpdate:
        return open_cuda_ipc(message)

    def close(self) -> None:
        pass
