"""Every Triton kernel compiles once for any token count: its arguments that count tokens are not
specialised (kernels/__init__.py). Triton keys a compiled kernel on each integer argument being 1, a
multiple of 16 or neither; a count that moves with every packed batch would otherwise compile each
kernel again the first time a length is a multiple of 16 (a multi-second train step in the RL job)."""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

import k3rl.kernels

COUNTS = {"n_rows", "per_prog", "n", "m", "N", "T", "P"}  # argument names that count tokens (or blocks of them)
# kept specialised on purpose: the recurrent kernel runs decode steps, T = 1, where the constant unrolls its
# loop; the histogram's n is the number of experts (fixed, and its row stride)
SPECIALISED = {("recurrent_fwd_kernel", "T"), ("qb_hist_kernel", "n")}

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="under the interpreter kernels are not JITFunctions")


def _kernels() -> dict[str, JITFunction]:
    found = {}
    for mod in pkgutil.walk_packages(k3rl.kernels.__path__, "k3rl.kernels."):
        if mod.name.rsplit(".", 1)[-1].startswith("triton_"):
            for name, obj in vars(importlib.import_module(mod.name)).items():
                if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                    found[name] = obj
    return found


def _keys(kp, values) -> set:
    """The specialisation Triton's launcher computes for each value of this argument."""
    return {native_specialize_impl(BaseBackend, v, False, not kp.do_not_specialize,
                                   not kp.do_not_specialize_on_alignment) for v in values}


def test_token_counts_are_not_specialised():
    kernels = _kernels()
    assert {"rms_norm_fwd_kernel", "aggregate_bwd_kernel", "short_conv_da_kernel", "qb_hist_kernel",
            "gather_sum_kernel", "situ_bwd_kernel", "norm_gate_bwd_kernel"} <= set(kernels)
    checked = []
    for name, kernel in kernels.items():
        for kp in kernel.params:
            if kp.name in COUNTS and not kp.is_constexpr and (name, kp.name) not in SPECIALISED:
                assert len(_keys(kp, [1, 16, 4096, 4097, 65_521])) == 1, f"{name}({kp.name}) is specialised"
                checked.append((name, kp.name))
    assert len(checked) >= 15, checked


def test_a_specialised_argument_would_be_caught():
    """The check can fail: an argument left specialised (the recurrent kernel's T) keys 1, 4096 and 4097
    apart, which is what the rule keeps from happening to a token count."""
    kp = next(p for p in _kernels()["recurrent_fwd_kernel"].params if p.name == "T")
    assert len(_keys(kp, [1, 4096, 4097])) == 3
