"""`SandboxPool`: warm sandboxes for many concurrent episodes (asyncio).

    async with SandboxPool(backend="auto", max_size=32, min_idle=4, job="run-7") as pool:
        async with pool.sandbox() as sb:          # acquire ... release
            result = await sb.aexec("python3 -c 'print(1)'")

- `max_size` bounds live sandboxes (idle + leased + starting): the concurrency limit. An
  `acquire` beyond it waits for a `release`.
- `min_idle` warm sandboxes are kept ready by a background task, so `acquire` normally just
  pops one (no container start on the critical path).
- `starts_per_s` spaces out sandbox starts (a burst of 1000 episodes must not stampede the
  Docker daemon).
- Idle sandboxes are health-checked every `health_interval_s` (a helper round trip); dead or
  unhealthy ones are closed and replaced. A leased sandbox that died (e.g. killed from
  outside: its exec raised `SandboxDeadError`) is replaced when it is released.
- Between episodes a released sandbox is `reset` (processes killed, /work and /tmp emptied)
  or, with `reuse="recreate"` / after `max_uses` leases / when the reset fails, replaced by
  a fresh one.
- `close()` closes every sandbox it ever handed out, leased or idle: nothing is left behind.
  It is idempotent. `image` names the Docker image of the sandboxes (the job's `sandbox.image`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from dataclasses import dataclass, field

from .base import EXECUTOR, Sandbox, in_thread, log
from .factory import choose_backend, default_job, open_sandbox
from .types import SandboxClosedError, SandboxError, SandboxLimits

REUSE_MODES = ("reset", "recreate")


class StartRateLimiter:
    """At most `per_s` starts per second: each start gets the next free slot, `1/per_s` apart."""

    def __init__(self, per_s: float):
        if per_s <= 0:
            raise ValueError(f"starts_per_s must be > 0, got {per_s}")
        self.interval = 1.0 / per_s
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        async with self._lock:
            now = loop.time()
            slot = max(now, self._next)
            self._next = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)


@dataclass
class PoolStats:
    created: int = 0
    replaced_dead: int = 0
    resets: int = 0
    recreated: int = 0
    acquires: int = 0
    acquire_wait_s: list[float] = field(default_factory=list)


class SandboxPool:
    def __init__(
        self,
        backend: str = "auto",
        *,
        max_size: int = 16,
        min_idle: int = 2,
        starts_per_s: float = 8.0,
        health_interval_s: float = 10.0,
        reuse: str = "reset",
        max_uses: int | None = None,
        job: str | None = None,
        image: str | None = None,
        limits: SandboxLimits | None = None,
        **limit_overrides,
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if not 0 <= min_idle <= max_size:
            raise ValueError(f"min_idle must be in [0, max_size={max_size}], got {min_idle}")
        if reuse not in REUSE_MODES:
            raise ValueError(f"reuse must be one of {REUSE_MODES}, got {reuse!r}")
        if max_uses is not None and max_uses < 1:
            raise ValueError(f"max_uses must be >= 1 or None, got {max_uses}")
        self.backend = backend
        self.max_size = max_size
        self.min_idle = min_idle
        self.health_interval_s = health_interval_s
        self.reuse = reuse
        self.max_uses = max_uses
        self.job = job or default_job()
        self.image = image  # Docker image of the sandboxes (None: the k3rl-sandbox image)
        base = limits or SandboxLimits()
        self.limits = (
            SandboxLimits.from_kwargs(**{**base.__dict__, **limit_overrides}) if limit_overrides else base
        )
        self.stats = PoolStats()
        self._rate = StartRateLimiter(starts_per_s)
        self._idle: collections.deque[Sandbox] = collections.deque()
        self._leased: set[Sandbox] = set()
        self._resetting: set[Sandbox] = set()  # released, being reset in the background before they are idle
        self._uses: dict[str, int] = {}
        self._live = 0  # idle + leased + starting + resetting
        self._cond: asyncio.Condition | None = None
        self._wake: asyncio.Event | None = None
        self._maintainer: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._closers: set[asyncio.Task] = set()
        self._all: set[Sandbox] = set()  # every sandbox opened and not yet closed, whatever its state
        self._all_lock = threading.Lock()
        self._creating: set[concurrent.futures.Future] = set()
        self._closed = False
        self._started = False

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> SandboxPool:
        """Resolve the backend, start the maintainer and wait until `min_idle` sandboxes are warm."""
        if self._started:
            return self
        self._started = True
        self.backend = await in_thread(choose_backend, self.backend, self.image)
        self._cond = asyncio.Condition()
        self._wake = asyncio.Event()
        self._maintainer = asyncio.create_task(self._maintain(), name="k3rl-sandbox-pool")
        await self._fill()
        return self

    async def close(self) -> None:
        """Close every sandbox of the pool (idle and leased) and stop its tasks."""
        if self._closed:
            return
        self._closed = True
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer
        for task in list(self._background):  # resets in flight: pointless now
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._closers:  # closes in flight finish (cancelling one could skip the close)
            await asyncio.gather(*self._closers, return_exceptions=True)
        # sandboxes still being opened close themselves once they see `_closed` (_open_blocking)
        await asyncio.gather(*(asyncio.wrap_future(f) for f in list(self._creating)), return_exceptions=True)
        with self._all_lock:
            everything = list(self._all)
            self._all.clear()
        self._idle.clear()
        self._leased.clear()
        self._resetting.clear()
        await asyncio.gather(*(sb.aclose() for sb in everything), return_exceptions=True)
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- acquire / release -------------------------------------------------------------------
    async def acquire(self, timeout: float | None = None) -> Sandbox:
        """A healthy sandbox for one episode; waits (up to `timeout` s) while `max_size` are in use."""
        if not self._started:
            await self.start()
        t0 = time.perf_counter()
        async with asyncio.timeout(timeout):
            while True:
                sb = await self._take_or_reserve()
                if sb is None:  # we reserved a slot: start a fresh one
                    try:
                        sb = await self._create()
                    except BaseException:
                        await self._free_slot()
                        raise
                elif not sb.is_alive():
                    self.stats.replaced_dead += 1
                    log.warning("sandbox pool: idle sandbox %s is dead, replacing it", sb.id)
                    await self._discard(sb)
                    continue
                self._leased.add(sb)
                self._uses[sb.id] = self._uses.get(sb.id, 0) + 1
                self.stats.acquires += 1
                self.stats.acquire_wait_s.append(time.perf_counter() - t0)
                self._wake.set()
                return sb

    async def release(self, sb: Sandbox) -> None:
        """Give `sb` back. It is reset (or recreated) in the background; dead ones are replaced."""
        if sb not in self._leased:
            raise ValueError(f"{sb!r} is not leased from this pool")
        self._leased.discard(sb)
        if self._closed:
            await self._close_one(sb)
            return
        if sb.closed or not sb.is_alive():
            self.stats.replaced_dead += 1
            log.warning("sandbox pool: released sandbox %s is dead, replacing it", sb.id)
            await self._discard(sb)
            return
        worn_out = self.max_uses is not None and self._uses.get(sb.id, 0) >= self.max_uses
        if self.reuse == "recreate" or worn_out:
            self.stats.recreated += 1
            await self._discard(sb)
            return
        self._resetting.add(sb)
        self._spawn(self._reset_and_return(sb))

    @contextlib.asynccontextmanager
    async def sandbox(self, timeout: float | None = None):
        """`async with pool.sandbox() as sb:` — acquire, and release even when the episode fails."""
        sb = await self.acquire(timeout=timeout)
        try:
            yield sb
        finally:
            await self.release(sb)

    # ---- introspection -----------------------------------------------------------------------
    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def leased(self) -> int:
        return len(self._leased)

    @property
    def live(self) -> int:
        return self._live

    def sandbox_ids(self) -> list[str]:
        """The pool's sandboxes: idle, leased, and released ones still being reset."""
        return list(dict.fromkeys(sb.id for sb in [*self._idle, *self._leased, *self._resetting]))

    # ---- internals -----------------------------------------------------------------------------
    async def _take_or_reserve(self) -> Sandbox | None:
        async with self._cond:
            while True:
                if self._closed:
                    raise SandboxClosedError("the sandbox pool is closed")
                if self._idle:
                    return self._idle.popleft()
                if self._live < self.max_size:
                    self._live += 1
                    return None
                await self._cond.wait()

    async def _free_slot(self) -> None:
        async with self._cond:
            self._live -= 1
            self._cond.notify()
        self._wake.set()

    async def _create(self) -> Sandbox:
        await self._rate.wait()
        if self._closed:
            raise SandboxClosedError("the sandbox pool is closed")
        future = EXECUTOR.submit(self._open_blocking)
        self._creating.add(future)
        future.add_done_callback(self._creating.discard)
        sb = await asyncio.wrap_future(future)
        if sb is None:
            raise SandboxClosedError("the sandbox pool is closed")
        self.stats.created += 1
        return sb

    def _open_blocking(self) -> Sandbox | None:
        """Open one sandbox (worker thread); registered in `_all` so `close()` always finds it."""
        sb = open_sandbox(self.backend, job=self.job, image=self.image, limits=self.limits)
        with self._all_lock:
            if not self._closed:
                self._all.add(sb)
                return sb
        sb.close()
        return None

    async def _close_one(self, sb: Sandbox) -> None:
        await sb.aclose()
        with self._all_lock:  # only once it is really closed: close() relies on `_all`
            self._all.discard(sb)

    async def _put_idle(self, sb: Sandbox) -> None:
        async with self._cond:
            if self._closed:
                self._live -= 1
            else:
                self._idle.append(sb)
                self._cond.notify()
                return
        await self._close_one(sb)

    async def _discard(self, sb: Sandbox) -> None:
        """Close `sb` (in the background) and free its slot; the maintainer refills."""
        self._uses.pop(sb.id, None)
        task = asyncio.create_task(self._close_one(sb))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)
        await self._free_slot()

    async def _reset_and_return(self, sb: Sandbox) -> None:
        try:
            try:
                await sb.areset()
                self.stats.resets += 1
            except SandboxError as exc:
                log.warning("sandbox pool: reset of %s failed (%s), recreating it", sb.id, exc)
                self.stats.recreated += 1
                await self._discard(sb)
                return
            await self._put_idle(sb)
        finally:  # idle, discarded or (close) cancelled: no longer being reset
            self._resetting.discard(sb)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _fill(self) -> None:
        """Start sandboxes until `min_idle` are idle (never beyond `max_size`)."""
        while not self._closed:
            async with self._cond:
                starting_needed = self.min_idle - len(self._idle)
                if starting_needed <= 0 or self._live >= self.max_size:
                    return
                self._live += 1
            try:
                sb = await self._create()
            except SandboxClosedError:
                await self._free_slot()
                return
            except Exception as exc:
                await self._free_slot()
                log.error("sandbox pool: could not start a sandbox: %s", exc)
                raise
            await self._put_idle(sb)

    async def _health_check(self) -> None:
        """Ping the idle sandboxes; they stay available meanwhile (the agent serves requests concurrently)."""
        batch = list(self._idle)
        healthy = await asyncio.gather(*(sb.aping(timeout=10.0) for sb in batch), return_exceptions=True)
        for sb, ok in zip(batch, healthy, strict=True):
            if ok is True:
                continue
            async with self._cond:
                still_idle = sb in self._idle
                if still_idle:
                    self._idle.remove(sb)
            if still_idle:  # a sandbox leased meanwhile is checked again at its release
                self.stats.replaced_dead += 1
                log.warning("sandbox pool: idle sandbox %s failed its health check, replacing it", sb.id)
                await self._discard(sb)

    async def _maintain(self) -> None:
        last_check = asyncio.get_running_loop().time()
        while not self._closed:
            try:
                await self._fill()
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(1.0)  # logged in _fill; retry later rather than die
            now = asyncio.get_running_loop().time()
            if now - last_check >= self.health_interval_s:
                last_check = now
                await self._health_check()
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), timeout=max(0.05, self.health_interval_s - (now - last_check))
                )
