"""Run files of interpreter cases in a fresh process with TRITON_INTERPRET=1 set before triton is imported
(a process that already imported the kernels compiled them for a GPU).

Each test marked `@pytest.mark.interpreter_cases("x_interpret_cases.py")` calls `run_interpreted("x_...")`.
Every case file the session selected runs in ONE process (torch and triton import once, not once a file:
about 3 s each here), which `start` launches when collection ends (tests/conftest.py), beside the suite at
a lower priority (nice 5: about a quarter of a core when the suite keeps both busy); the tests that ask run
last (tests/conftest.py), so its 2-4 minutes of one core pass while the suite goes on. The first to ask
waits for it and keeps each file's outcome; the others read theirs. A file asked for that the launched
process does not cover (a test run alone) runs on demand, as before."""

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
_STARTED: dict = {}  # "proc", "files", "tmp": the process `start` launched, until its outcomes are read


def start(files: list[str]) -> None:
    """Launch the process of `files` now (nice 5); `run_interpreted` reads its outcome when first asked."""
    if not files or _STARTED:
        return
    tmp = tempfile.TemporaryDirectory()
    log = open(pathlib.Path(tmp.name) / "log", "w")  # a file, not a pipe: nobody reads it until the end
    command = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-W",
               "ignore::RuntimeWarning", f"--junit-xml={pathlib.Path(tmp.name) / 'cases.xml'}"]
    proc = subprocess.Popen(["nice", "-n", "5", *command], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, TRITON_INTERPRET="1"), cwd=HERE)
    log.close()
    _STARTED.update(proc=proc, files=list(files), tmp=tmp)


def stop() -> None:
    """End a launched process nobody waited for (a session stopped early)."""
    proc, tmp = _STARTED.pop("proc", None), _STARTED.pop("tmp", None)
    _STARTED.clear()
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if tmp is not None:
        tmp.cleanup()


def run_interpreted(cases_file: str) -> None:
    """pytest `cases_file` (beside this module) under the interpreter; every case must run and pass."""
    if cases_file not in _OUTCOMES:
        if cases_file not in _STARTED.get("files", ()):  # not launched at collection (or another file was)
            if _STARTED:
                _collect_started()
            start(sorted((WANTED - _OUTCOMES.keys()) | {cases_file}))
        _collect_started()
    ok, report = _OUTCOMES[cases_file]
    assert ok, report


def _collect_started() -> None:
    proc, files, folder = _STARTED["proc"], _STARTED["files"], pathlib.Path(_STARTED["tmp"].name)
    try:
        proc.wait(timeout=1800)
        _record(files, folder / "cases.xml", proc.returncode, (folder / "log").read_text(errors="replace"))
    finally:
        stop()


def _record(files: list[str], report_xml: pathlib.Path, returncode: int, log: str) -> None:
    """Each file's outcome from the run's junit report."""
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
                           f"{file}: no case ran (exit {returncode})\n{log[-6000:]}")


def run_sm90_check(script: str, timeout: float = 600) -> dict[str, int]:
    """Run a *_sm90_check.py script (beside this module) in its own process, which compiles kernels for Hopper
    with triton's compiler on the CPU; the shared memory in bytes of each kernel it built (its last line)."""
    run = subprocess.run([sys.executable, str(HERE / script)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
