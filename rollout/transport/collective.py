"""Weights by broadcast (`rollout.weight_transport: nccl`): the learner's rank 0 and the engines
form a process group of their own (NCCL between GPUs, gloo between CPU processes: the same
code) and rank 0 broadcasts the packed buckets.

    learner rank 0 (send)                         engine workers (receive), ranks 1..N
    members = pool.members()
    members changed (or no group): new port  ->   Broadcast(address, members) via the pool:
    BroadcastGroup(rank 0) + manifest round  <->    join the group when its address is new
    one broadcast per bucket buffer          ->     one buffer per bucket -> WeightUpdate

A failed broadcast (an engine died, or a rank ran past `rollout.weight_sync_timeout_s`, which is
also the group's own timeout) sends the same version through the object store, which restarts
dead engines and replays them the update; the group is formed again at the next sync.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import ray
import torch
import torch.distributed as dist

from k3rl.cluster import free_port
from k3rl.types import WeightUpdate

from .object_store import fall_back, wait_for_pool
from .packing import pack_bucket, unpack_bucket


@dataclass
class Broadcast:
    """What the pool hands every engine: receive the broadcast of `version` in the group at
    `address`, joining it first when it is new. `members[i]` (an engine worker's name) is rank i + 1."""

    version: int
    full: bool
    address: str  # host:port of the group's store, on the sender's node
    members: list[str]
    backend: str  # "nccl" or "gloo"
    timeout_s: float
    transport: ClassVar[str] = "nccl"


class BroadcastGroup:
    """A process group of its own between a sender (rank `src`) and receivers.

    Every member constructs it with the same host/port/world_size and its own rank (the
    constructors return together), then the sender calls `send(update)` while every receiver
    calls `recv()`. backend "nccl" needs one distinct GPU per rank; "gloo" works on CPU tensors.
    """

    def __init__(self, rank: int, world_size: int, host: str = "127.0.0.1", port: int = 29555,
                 backend: str = "nccl", device: str | torch.device | None = None, src: int = 0,
                 timeout_s: float = 300.0):
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

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def send(self, update: WeightUpdate) -> dict[str, float]:
        """Broadcast `update`; returns seconds spent packing, waiting for every receiver to reach
        the broadcast (the manifest's round), and moving the buckets, and the bytes moved."""
        if self.rank != self.src:
            raise RuntimeError(f"rank {self.rank} is a receiver; only rank {self.src} sends")
        t0 = time.perf_counter()
        packed = [pack_bucket(b, self.device) for b in update.buckets]
        self._sync()
        t1 = time.perf_counter()
        self._bcast_object((update.version, update.full, [m for _, m in packed]))
        self._sync()
        t2 = time.perf_counter()
        for buf, _ in packed:
            self._bcast(buf)
        self._sync()
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
        """Leave the group; a peer blocked in a broadcast with this rank fails instead of waiting."""
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.abort()


class CollectiveTransport:
    name = "nccl"

    def __init__(self, device: str = "cpu", timeout_s: float = 300.0, host: str = "127.0.0.1"):
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.timeout_s, self.host = timeout_s, host
        self.group: BroadcastGroup | None = None
        self.address: str | None = None
        self.members: list[str] | None = None  # sender: the engines in the group

    # ----- send half (learner rank 0) -------------------------------------------------------------
    def send(self, update: WeightUpdate, pool) -> dict[str, float]:
        """Broadcast `update` to every engine of `pool` (a PoolActor handle); on failure the same
        version goes through the object store. Returns the timings."""
        members = ray.get(pool.members.remote(), timeout=self.timeout_s)
        new_group = self.group is None or members != self.members  # an engine was restarted: re-form
        if new_group:
            self.close()
            self.address = f"{self.host}:{free_port(self.host)}"
        message = Broadcast(update.version, update.full, self.address, members, self.backend, self.timeout_s)
        receiving = pool.update_weights.remote(message)
        try:
            if new_group:
                host, port = self.address.rsplit(":", 1)
                self.group = BroadcastGroup(0, len(members) + 1, host, int(port), self.backend, self.device,
                                            timeout_s=self.timeout_s)
                self.members = members
            t = self.group.send(update)
            behind = [v for v in wait_for_pool(receiving, update.version, self.timeout_s) if v < update.version]
            if behind:
                raise RuntimeError(f"{len(behind)} engine(s) were restarted during the broadcast")
        except Exception as e:  # noqa: BLE001 - any failure: the object store delivers it instead
            self.close()  # receivers still in the broadcast fail now instead of at their timeout
            with contextlib.suppress(Exception):
                ray.get(receiving, timeout=self.timeout_s)  # the pool is done with this update
            return fall_back(update, pool, e, self.timeout_s)
        return {"weight_sync/bytes": t["bytes"], "weight_sync/wait_for_engines_s": t["wait_s"],
                "weight_sync/broadcast_s": t["transfer_s"],
                "weight_sync/broadcast_gbps": t["bytes"] / max(t["transfer_s"], 1e-9) / 1e9,
                "weight_sync/new_group": float(new_group), "weight_sync/fallbacks": 0.0}

    # ----- receive half (engine worker) ------------------------------------------------------------
    def receive(self, message: Broadcast, member: str) -> WeightUpdate:
        if member not in message.members:
            raise RuntimeError(f"engine {member} is not in the weight-broadcast group at {message.address} "
                               f"(members {message.members}); the sender forms a new group at its next sync")
        if self.group is None or self.address != message.address:
            self.close()
            host, port = message.address.rsplit(":", 1)
            device = self.device if message.backend == "nccl" else torch.device("cpu")
            self.group = BroadcastGroup(message.members.index(member) + 1, len(message.members) + 1, host, int(port),
                                        message.backend, device, timeout_s=message.timeout_s)
            self.address = message.address
        try:
            return self.group.recv()
        except Exception:
            self.close()  # a failed group is not used again; the next Broadcast names a new one
            raise

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.address, self.members = None, None, None
