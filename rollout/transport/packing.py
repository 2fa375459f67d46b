"""A WeightUpdate as byte buffers: what every transport moves.

Each bucket of HF-named tensors is packed into **one contiguous uint8 buffer** plus a small
manifest (name, dtype, shape, byte offset per tensor), so a bucket costs one transfer whatever
the number of tensors in it:

    offset_0 = 0,  offset_{i+1} = align_16(offset_i + nbytes_i),  buffer = concat(bytes_i)

16 bytes is a multiple of every dtype's element size, so each tensor is an aligned view of
the buffer on the receiving side.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from k3rl.types import WeightBucket, WeightUpdate

ALIGN = 16


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


def bucket_device(bucket: WeightBucket) -> torch.device:
    """Where a bucket's tensors are (packing happens there: one GPU gather, then one copy)."""
    return next(iter(bucket.tensors.values())).device if bucket.tensors else torch.device("cpu")


@dataclass
class PackedUpdate:
    """A WeightUpdate as numpy byte buffers (zero-copy in Ray's object store) plus manifests."""

    version: int
    full: bool
    manifests: list[BucketManifest]
    buffers: list[np.ndarray]

    @classmethod
    def pack(cls, update: WeightUpdate) -> PackedUpdate:
        """Each bucket packed where its tensors are, then copied to host memory once."""
        manifests, buffers = [], []
        for b in update.buckets:
            buf, man = pack_bucket(b, bucket_device(b))
            manifests.append(man)
            buffers.append(buf.cpu().numpy())
        return cls(update.version, update.full, manifests, buffers)

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
