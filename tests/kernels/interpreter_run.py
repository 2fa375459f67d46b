"""Run a file of interpreter cases in a fresh process with TRITON_INTERPRET=1 set before triton is
imported (a process that already imported the kernels compiled them for a GPU)."""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def run_interpreted(cases_file: str) -> None:
    """pytest `cases_file` (beside this module) under the interpreter; every case must run and pass."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", cases_file, "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"],
        capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=900, cwd=HERE,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
