"""Run files of interpreter cases in a fresh process with TRITON_INTERPRET=1 set before triton is imported
(a process that already imported the kernels compiled them for a GPU).

Each test marked `@pytest.mark.interpreter_cases("x_interpret_cases.py")` calls `run_interpreted("x_...")`.
The first such call runs every case file the session selected in ONE process (torch and triton import once,
not once a file: about 3 s each here) and keeps each file's outcome; the others read theirs. `WANTED` is
filled at collection (tests/conftest.py)."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).parent
WANTED: set[str] = set()  # the case files of the session's selected tests
_OUTCOMES: dict[str, tuple[bool, str]] = {}  # case file -> (every case ran and passed, what to show if not)


def run_interpreted(cases_file: str) -> None:
    """pytest `cases_file` (beside this module) under the interpreter; every case must run and pass."""
    if cases_file not in _OUTCOMES:
        _run_together(sorted((WANTED - _OUTCOMES.keys()) | {cases_file}))
    ok, report = _OUTCOMES[cases_file]
    assert ok, report


def _run_together(files: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report_xml = pathlib.Path(tmp) / "cases.xml"
        run = subprocess.run(
            [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
             f"--junit-xml={report_xml}"],
            capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=1800, cwd=HERE,
        )  # fmt: skip
        cases = ET.parse(report_xml).getroot().iter("testcase") if report_xml.exists() else []
        by_file: dict[str, list[tuple[str, str]]] = {f: [] for f in files}  # file -> (case, "" or what went wrong)
        for case in cases:
            file = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
            bad = [f"{e.tag}: {e.get('message', '')}\n{(e.text or '')[-3000:]}" for e in case
                   if e.tag in ("failure", "error", "skipped")]
            by_file.setdefault(file, []).append((case.get("name", ""), "\n".join(bad)))
    for file in files:
        results = by_file.get(file, [])
        bad = [f"{name}: {what}" for name, what in results if what]
        ok = bool(results) and not bad
        _OUTCOMES[file] = (ok, "\n\n".join(bad)[-6000:] if bad else
                           f"{file}: no case ran (exit {run.returncode})\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}")


def run_sm90_check(script: str, timeout: float = 600) -> dict[str, int]:
    """Run a *_sm90_check.py script (beside this module) in its own process, which compiles kernels for Hopper
    with triton's compiler on the CPU; the shared memory in bytes of each kernel it built (its last line)."""
    run = subprocess.run([sys.executable, str(HERE / script)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
