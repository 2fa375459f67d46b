"""Moving a versioned `WeightUpdate` (buckets of HF-named tensors) from the learner to engines.

Every transport moves the same thing: each bucket packed into **one contiguous byte buffer**
plus a small manifest (name, dtype, shape, byte offset per tensor), so a bucket costs one
transfer whatever the number of tensors in it:

    offset_0 = 0,  offset_{i+1} = align_16(offset_i + nbytes_i),  buffer = concat(bytes_i)

* **object store** (default, any cluster): `publish(update)` packs the buckets into numpy
  byte arrays and `ray.put`s them once; every worker gets the same object (zero-copy reads
  from shared memory on its node) and unpacks with `PackedUpdate.to_update()`.
* **collective broadcast** (`CollectiveWeightSync`, NCCL between GPU processes): the learner
  rank and the inference workers form their own process group (a TCPStore on a given
  host:port, independent of any training group); the learner broadcasts the manifest, then
  each bucket buffer. The same code runs on gloo with CPU tensors (that is how it is tested
  without GPUs).
* **CUDA IPC** (colocated on one GPU host): `share_cuda_ipc(update)` packs the buckets on the
  GPU and returns picklable handles to that memory; a worker on the same host opens them with
  `open_cuda_ipc(handles)` and copies out, with no host round trip. The sender keeps the
  buffers alive until `IpcShare.release()` (after every worker has acknowledged).
"""

from __future__ import annotations

import io
import pickle
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from k3rl.types import WeightBucket, WeightUpdate

ALIGN = 16  # bytes; every dtype's element size divides it, so views of the buffer are aligned


@dataclass
class TensorSlot:
    name: str
    dtype: str  # e.g. "float32", "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class BucketManifest:
    slots: list[TensorSlot]
    nbytes: int  # buffer size, padding included


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a weight-update manifest")
    return dt


def pack_bucket(bucket: WeightBucket, device: torch.device | str = "cpu") -> tuple[torch.Tensor, BucketManifest]:
    """One bucket -> (uint8 buffer on `device`, manifest)."""
    slots, offset = [], 0
    for name, t in bucket.tensors.items():
        nbytes = t.numel() * t.element_size()
        slots.append(TensorSlot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    pieces = []
    for i, (slot, t) in enumerate(zip(slots, bucket.tensors.values(), strict=True)):
        pieces.append(t.detach().to(device).contiguous().reshape(-1).view(torch.uint8))
        end = slots[i + 1].offset if i + 1 < len(slots) else offset
        if end > slot.offset + slot.nbytes:  # alignment padding
            pieces.append(torch.zeros(end - slot.offset - slot.nbytes, dtype=torch.uint8, device=device))
    buf = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)
    return buf, BucketManifest(slots, offset)


def unpack_bucket(buf: torch.Tensor, manifest: BucketManifest, copy: bool = True) -> WeightBucket:
    """(buffer, manifest) -> a WeightBucket; with `copy` the tensors own their memory."""
    if buf.dtype != torch.uint8 or buf.numel() != manifest.nbytes:
        raise ValueError(f"bucket buffer holds {buf.numel()} {buf.dtype} values, the manifest describes "
                         f"{manifest.nbytes} bytes; the sender and receiver disagree")
    tensors = {}
    for s in manifest.slots:
        t = buf[s.offset : s.offset + s.nbytes].view(_dtype(s.dtype)).reshape(s.shape)
        tensors[s.name] = t.clone() if copy else t
    return WeightBucket(tensors=tensors)


# ----------------------------------------------------------------------------------------------
# Ray object store
# ----------------------------------------------------------------------------------------------


@dataclass
class PackedUpdate:
    """A WeightUpdate as numpy byte buffers (zero-copy in Ray's object store) plus manifests."""

    version: int
    full: bool
    manifests: list[BucketManifest]
    buffers: list[np.ndarray]
    transport: str = "object_store"

    @classmethod
    def pack(cls, update: WeightUpdate) -> PackedUpdate:
        """Each bucket packed where its tensors are (one GPU gather, then one copy to host)."""
        manifests, buffers = [], []
        for b in update.buckets:
            device = next(iter(b.tensors.values())).device if b.tensors else torch.device("cpu")
            buf, man = pack_bucket(b, device)
            manifests.append(man)
            buffers.append(buf.cpu().numpy())
        return cls(update.version, update.full, manifests, buffers, update.transport)

    def to_update(self, copy: bool = False) -> WeightUpdate:
        """The update again. Without `copy` the tensors are read-only views of the received
        buffers (Ray's shared memory): the engine copies them into its parameters anyway."""
        buckets = []
        for man, arr in zip(self.manifests, self.buffers, strict=True):
            if arr.size:
                with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
                    warnings.simplefilter("ignore", UserWarning)
                    buf = torch.frombuffer(memoryview(arr).cast("B"), dtype=torch.uint8)
            else:
                buf = torch.zeros(0, dtype=torch.uint8)
            buckets.append(unpack_bucket(buf, man, copy=copy))
        return WeightUpdate(version=self.version, buckets=buckets, full=self.full, transport="object_store")

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.buffers)

    def to_wire(self) -> dict:
        """Only ints, strings, lists and numpy arrays: what RPC layers with a restricted
        serialiser (vLLM's msgpack `collective_rpc`) carry without pickling our classes."""
        return {
            "version": self.version,
            "full": self.full,
            "manifests": [[[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in m.slots] + [m.nbytes]
                          for m in self.manifests],
            "buffers": list(self.buffers),
        }

    @classmethod
    def from_wire(cls, wire: dict) -> PackedUpdate:
        manifests = [BucketManifest([TensorSlot(n, d, tuple(sh), int(o), int(b)) for n, d, sh, o, b in m[:-1]], int(m[-1]))
                     for m in wire["manifests"]]
        buffers = [np.asarray(b, dtype=np.uint8) for b in wire["buffers"]]
        return cls(int(wire["version"]), bool(wire["full"]), manifests, buffers)


def publish(update: WeightUpdate):
    """Put `update` into Ray's object store once; hand the ref to every worker (`receive` it there)."""
    import ray

    return ray.put(PackedUpdate.pack(update))


@dataclass
class PublishedUpdate:
    """An update its maker already put into the object store (`publish_here`): what travels
    between actors is this handle, not the weights (the learner publishes, the driver and the
    pool only pass the reference on, and the engines read the buffers once)."""

    version: int
    full: bool
    ref: Any  # ray.ObjectRef of a PackedUpdate


def publish_here(update: WeightUpdate) -> PublishedUpdate:
    return PublishedUpdate(update.version, update.full, publish(update))


def receive(obj: PackedUpdate | WeightUpdate | IpcShare) -> WeightUpdate:
    """What a worker does with what arrived (Ray resolves a top-level ObjectRef argument itself)."""
    if isinstance(obj, WeightUpdate):
        return obj
    if isinstance(obj, PackedUpdate):
        return obj.to_update()
    if isinstance(obj, IpcShare):
        return open_cuda_ipc(obj)
    raise TypeError(f"expected a PackedUpdate, IpcShare or WeightUpdate, got {type(obj).__name__}")


# ----------------------------------------------------------------------------------------------
# collective broadcast (NCCL on GPUs, gloo on CPUs)
# ----------------------------------------------------------------------------------------------


class CollectiveWeightSync:
    """A process group of its own between the learner (rank `src`) and the inference workers.

    Every member constructs it with the same host/port/world_size and its own rank, then the
    learner calls `send(update)` while every worker calls `recv()`; all return together.
    backend "nccl" needs one distinct GPU per rank; "gloo" works on CPU tensors.
    """

    def __init__(self, rank: int, world_size: int, host: str = "127.0.0.1", port: int = 29555,
                 backend: str = "nccl", device: str | torch.device | None = None, src: int = 0,
                 timeout_s: float = 300.0):
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' (GPUs) or 'gloo' (CPUs), got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("the NCCL weight transport needs CUDA GPUs; use the object store (default) on CPUs")
        self.rank, self.world_size, self.src, self.backend = rank, world_size, src, backend
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": this process's current GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        store = dist.TCPStore(host, port, world_size, is_master=(rank == src), timeout=timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(self.device)  # the communicator binds to the current device
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)  # a dead member fails the broadcast instead of hanging it
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.src, 0
        self.group.broadcast([t], opts).wait()
        return t

    def _bcast_object(self, obj: Any) -> Any:
        if self.rank == self.src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
            self._bcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device))
            self._bcast(data)
            return obj
        n = self._bcast(torch.zeros(1, dtype=torch.int64, device=self.device))
        data = self._bcast(torch.empty(int(n.item()), dtype=torch.uint8, device=self.device))
        return pickle.load(io.BytesIO(data.cpu().numpy().tobytes()))

    def send(self, update: WeightUpdate) -> dict[str, float]:
        """Broadcast `update`; returns seconds spent packing, waiting for every receiver to reach
        the broadcast (the manifest's round), and moving the buckets, and the bytes moved."""
        import time

        if self.rank != self.src:
            raise RuntimeError(f"rank {self.rank} is a receiver; only rank {self.src} sends")

        def sync():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        t0 = time.perf_counter()
        packed = [pack_bucket(b, self.device) for b in update.buckets]
        sync()
        t1 = time.perf_counter()
        self._bcast_object((update.version, update.full, [m for _, m in packed]))
        sync()
        t2 = time.perf_counter()
        for buf, _ in packed:
            self._bcast(buf)
        sync()
        t3 = time.perf_counter()
        return {"pack_s": t1 - t0, "wait_s": t2 - t1, "transfer_s": t3 - t2,
                "bytes": float(sum(buf.numel() for buf, _ in packed))}

    def recv(self) -> WeightUpdate:
        if self.rank == self.src:
            raise RuntimeError(f"rank {self.rank} is the sender; call send()")
        version, full, manifests = self._bcast_object(None)
        buckets = []
        for man in manifests:
            buf = self._bcast(torch.empty(man.nbytes, dtype=torch.uint8, device=self.device))
            buckets.append(unpack_bucket(buf, man, copy=False))  # the buffer is ours: views are enough
        return WeightUpdate(version=version, buckets=buckets, full=full, transport="nccl")

    def close(self) -> None:
        self.group = None


# ----------------------------------------------------------------------------------------------
# CUDA IPC (same GPU host)
# ----------------------------------------------------------------------------------------------


@dataclass
class IpcShare:
    """Picklable handles to bucket buffers living in the sender's GPU memory."""

    version: int
    full: bool
    manifests: list[BucketManifest]
    handles: list[tuple]  # torch.multiprocessing.reductions.reduce_tensor() of each buffer
    _keep: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __getstate__(self):
        return {"version": self.version, "full": self.full, "manifests": self.manifests, "handles": self.handles,
                "_keep": []}

    def release(self) -> None:
        """Drop the sender's buffers (after every receiver has copied them out)."""
        self._keep.clear()


def share_cuda_ipc(update: WeightUpdate, device: str | torch.device = "cuda") -> IpcShare:
    from torch.multiprocessing.reductions import reduce_tensor

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
