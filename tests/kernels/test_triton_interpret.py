"""Runs interpret_cases.py (every Triton kernel against its reference, forward and backward, on the
CPU) in a fresh process with TRITON_INTERPRET=1 set before triton is imported."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_the_interpreter():
    cases = pathlib.Path(__file__).with_name("interpret_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(cases), "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
