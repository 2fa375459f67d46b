"""Runs interpret_cases.py (every Triton kernel against its reference, forward and backward, on the
CPU) in a fresh process with TRITON_INTERPRET=1 set before triton is imported."""

import importlib.util

import pytest
from interpreter_run import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.slow
@pytest.mark.interpreter_cases("interpret_cases.py")
def test_triton_kernels_under_the_interpreter():
    run_interpreted("interpret_cases.py")
