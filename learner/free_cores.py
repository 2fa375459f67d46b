"""How many threads a CPU step may use without fighting other processes for the cores.

torch's OpenMP threads spin while they wait for each other. On idle cores more threads make a small
model's training step faster; but when another process already uses one of the cores, the spinning threads
take turns on the cores left and the step runs several times slower than on one thread
(benchmarks/results/learner/threads.md). So the warm start, which would like every core it may run on, takes
only those nobody else is using, measured over the last step:

    others = (busy CPU time of this process's CPUs - this process's CPU time) / wall time   (in cores)
    threads = clamp(round(cores - others), 1, cores)

The CPUs' busy time comes from their lines of /proc/stat (Linux); elsewhere every core counts as free.
"""

from __future__ import annotations

import os
import time

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _busy_s(cpus: set[int]) -> float | None:
    """CPU seconds the CPUs `cpus` have spent busy since boot, or None without /proc/stat."""
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *ticks = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in ticks[:8])
                    busy += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return None
    return busy * _TICK_S


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


def _cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


class FreeCores:
    """`threads()`: how many of `cores` (at most the CPUs this process may run on) no other process used
    since the previous call, or since creation. Until a window of 50 ms has passed it answers 1."""

    def __init__(self, cores: int | None = None) -> None:
        self.cpus = _cpus()
        self.cores = max(1, min(cores or len(self.cpus), len(self.cpus)))
        self._last = (_busy_s(self.cpus), _own_s(), time.monotonic())

    def threads(self) -> int:
        busy, own, now = _busy_s(self.cpus), _own_s(), time.monotonic()
        (busy0, own0, then), self._last = self._last, (busy, own, now)
        if now - then < 0.05:
            return 1
        if busy is None or busy0 is None:
            return self.cores
        others = max(0.0, (busy - busy0) - (own - own0)) / (now - then)
        return max(1, min(self.cores, round(self.cores - others)))
