"""Where the host waits for the GPU: run a function in CUDA's sync debug mode and count every
operation that made the host wait (`.item()`, `.tolist()`, a copy to pageable host memory,
`nonzero`, ...) by the innermost line of k3rl that called it. Used by `benchmarks/learner.py
--sync-trace` and by the test that keeps a train step free of waits inside it."""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the k3rl package (or the source tree)


def _site() -> str:
    frames = [
        f for f in traceback.extract_stack()[:-2] if "k3rl" in f.filename or f.filename.startswith(_ROOT)
    ]
    frames = [f for f in frames if not f.filename.endswith("host_syncs.py")]
    inner = [
        f
        for f in frames
        if os.sep + "benchmarks" + os.sep not in f.filename and os.sep + "tests" + os.sep not in f.filename
    ]
    where = (inner or frames or [None])[-1]
    if where is None:
        return "?"
    path = where.filename.split("k3rl" + os.sep)[-1] if "k3rl" + os.sep in where.filename else where.filename
    return f"{path}:{where.lineno} {where.line}"


def host_syncs(fn: Callable[[], object]) -> Counter:
    """Run `fn()` (CUDA work) and return {source line: waits}. The GPU is idle before it starts."""
    torch.cuda.synchronize()
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):
            sites[_site()] += 1

    with warnings.catch_warnings():  # restores showwarning and the filters on leaving
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites
