"""Backend choice shared by every kernel dispatcher.

Each public op takes ``backend="auto"|"torch"|"triton"``:

- ``"torch"``  the pure-PyTorch reference (any device, any float dtype, autograd by PyTorch);
- ``"triton"`` the Triton kernel (CUDA tensors; on the CPU only under ``TRITON_INTERPRET=1``,
  which is how the tests run the kernels without a GPU);
- ``"auto"``   Triton when every tensor is on CUDA and the op has a Triton kernel, the
  reference otherwise.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "torch", "triton")


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401  (the check itself: triton is a Linux-only dependency)
    except ImportError:  # pragma: no cover - triton is a Linux dependency of the project
        return False
    return True


def interpreter_on() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, op: str, *tensors: torch.Tensor | None, has_triton: bool = True) -> str:
    """Return ``"torch"`` or ``"triton"`` for ``op`` given the requested ``backend``.

    Raises ``ValueError`` for an unknown backend name, or when ``"triton"`` is asked for
    tensors the Triton path cannot run on.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    present = [t for t in tensors if t is not None]
    on_cuda = bool(present) and all(t.is_cuda for t in present)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if (has_triton and on_cuda and triton_importable()) else "torch"
    # explicit "triton"
    if not has_triton:
        raise ValueError(f"{op}: there is no Triton kernel for this op; use backend='torch' or 'auto'")
    if not triton_importable():
        raise ValueError(
            f"{op}: backend='triton' needs the triton package; install it or use backend='torch'"
        )
    if not on_cuda and not interpreter_on():
        raise ValueError(
            f"{op}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before importing "
            "triton, for CPU tests); move the inputs to CUDA or use backend='torch'"
        )
    return "triton"


# eager_only: `torch.compiler.disable` for the kernels' host wrappers, without importing torch._dynamo at
# import time (about 1 s of every process that imports the model: Ray actors, ranks, CLI runs). Until
# before_compile() each wrapper calls its function directly; after it, through torch.compiler.disable.
_EAGER_ONLY: list[tuple[object, list]] = []  # (function, [what its wrapper calls])


def eager_only(fn):
    """Decorator: compiled callers run `fn` as it is (a graph break; its launch settings are computed on
    the host), once before_compile() has run. Anything that torch.compiles code reaching a Triton kernel
    calls before_compile() first (k3rl.model.model.allow_layer_recompiles does)."""
    target = [fn]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return target[0](*args, **kwargs)

    _EAGER_ONLY.append((fn, target))
    return call


def before_compile() -> None:
    """Make every eager_only function a graph break for torch.compile (imports torch._dynamo)."""
    for fn, target in _EAGER_ONLY:
        if target[0] is fn:
            target[0] = torch.compiler.disable(fn)
