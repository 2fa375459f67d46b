"""Weights through Ray's object store (the default; works on any cluster).

Send half (learner rank 0): pack the update into byte buffers, `ray.put` them once, hand the
pool a `PublishedUpdate` (version + reference). Receive half (engine worker): read the
buffers (zero-copy from the node's shared memory) and unpack. The pool keeps the latest
full `PublishedUpdate` (and the partial ones after it) to replay to a restarted engine, which
is why the other transports fall back to this one when they fail.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
from ray.exceptions import GetTimeoutError

from k3rl.types import WeightUpdate

from .packing import PackedUpdate

log = logging.getLogger(__name__)


@dataclass
class PublishedUpdate:
    """An update already in the object store: only this handle travels between actors."""

    version: int
    full: bool
    ref: Any  # ray.ObjectRef of a PackedUpdate
    transport: ClassVar[str] = "object_store"


def publish(update: WeightUpdate) -> PublishedUpdate:
    """Put `update` into the object store once (owned by the calling process)."""
    return PublishedUpdate(update.version, update.full, ray.put(PackedUpdate.pack(update)))


def wait_for_pool(ref, version: int, timeout_s: float) -> list[int]:
    """The pool's answer to an update (the version each engine runs), or a TimeoutError saying so."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(f"the inference engines did not apply weight update v{version} within "
                           f"rollout.weight_sync_timeout_s={timeout_s:g}s") from None


class ObjectStoreTransport:
    name = "object_store"

    def __init__(self, device: str = "cpu", timeout_s: float = 300.0, host: str = "127.0.0.1"):
        self.timeout_s = timeout_s

    # ----- send half (learner rank 0) -------------------------------------------------------------
    def send(self, update: WeightUpdate, pool) -> dict[str, float]:
        """Bring every engine of `pool` (a PoolActor handle) to `update`; returns the timings."""
        t0 = time.perf_counter()
        packed = PackedUpdate.pack(update)
        message = PublishedUpdate(update.version, update.full, ray.put(packed))
        t1 = time.perf_counter()
        wait_for_pool(pool.update_weights.remote(message), update.version, self.timeout_s)
        return {"weight_sync/bytes": float(packed.nbytes), "weight_sync/publish_s": t1 - t0,
                "weight_sync/apply_s": time.perf_counter() - t1, "weight_sync/fallbacks": 0.0}

    # ----- receive half (engine worker) ------------------------------------------------------------
    def receive(self, message: PublishedUpdate, member: str) -> WeightUpdate:
        return ray.get(message.ref).to_update()

    def close(self) -> None:
        pass


def fall_back(update: WeightUpdate, pool, reason: BaseException | str, timeout_s: float) -> dict[str, float]:
    """Send `update` through the object store after a faster transport failed. The pool restarts
    dead engines and replays them the update; engines that already have it skip it."""
    if isinstance(reason, BaseException):
        reason = f"{type(reason).__name__}: {(str(reason).splitlines() or [''])[0][:300]}"
    log.warning("weight update v%d: %s; sending it through the object store instead", update.version, reason)
    return {**ObjectStoreTransport(timeout_s=timeout_s).send(update, pool), "weight_sync/fallbacks": 1.0}
