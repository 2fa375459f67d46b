"""Long job tests that run beside the rest of the suite.

On 2 cores pytest runs one test at a time and leaves much of the machine idle: a unit test is one Python
thread, and a job test waits on its Ray actors about a third of its time. So a test marked
`@pytest.mark.background("<job>")` does not run its job itself. When collection ends, `tests/conftest.py`
starts this file as one process that runs the selected tests' jobs one after another (each `run_job` in this
process, sharing one local Ray of its own), and the tests, which come late in the suite, wait for their job's
result and assert on it. The jobs and the assertions are the same as when each test ran its own job.

    python tests/background.py FOLDER MODULE.py:JOB [MODULE.py:JOB ...]

MODULE.py's `BACKGROUND_JOBS[JOB](folder)` gives the JobConfig, or a function of no arguments for a job that is
more than one `run_job` (a `k3rl train` command, a run and its resume); it returns what the test reads. Each job
writes FOLDER/JOB/summary.pkl (what `run_job` or the function returned) or FOLDER/JOB/error.txt (its traceback);
the tests read them through `wait_for`. Jobs of one module share the runner's Ray; it stops between modules.
The process ends with its parent: pytest stopped, the jobs stop (SIGTERM: each ends as a Ctrl-C would end it).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path


def start(folder: Path, jobs: list[str]) -> subprocess.Popen:
    """Start the runner for `jobs` ("path/to/test_x.py:name"), its output in FOLDER/runner.log."""
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / "runner.log", "wb")
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(folder), *jobs], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop(runner: subprocess.Popen, folder: Path, grace_s: float = 30.0) -> None:
    """Stop the runner: no further job starts, SIGTERM to its process group (the running job ends as on
    Ctrl-C), SIGKILL to what is left after `grace_s`."""
    (folder / "stop").touch()
    if runner.poll() is None:
        os.killpg(runner.pid, signal.SIGTERM)
        try:
            runner.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(runner.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for(folder: Path, job: str, runner: subprocess.Popen, timeout_s: float) -> dict:
    """The summary of `job` once the runner has written it. Raises with the job's traceback if it failed, and
    with the runner's log if the runner ended without a result for it or the wait passed `timeout_s`."""
    out = folder / job
    deadline = time.monotonic() + timeout_s
    while True:
        finished = runner.poll() is not None  # before the files: a runner that ends after writing is seen
        if (out / "summary.pkl").exists():
            return pickle.loads((out / "summary.pkl").read_bytes())
        if (out / "error.txt").exists():
            raise AssertionError(f"background job {job} failed:\n{(out / 'error.txt').read_text()}")
        if finished or time.monotonic() > deadline:
            log = (folder / "runner.log").read_text(errors="replace")[-4000:]
            why = f"ended (exit {runner.returncode})" if finished else f"gave no result within {timeout_s:.0f} s"
            raise AssertionError(f"the background runner {why} before job {job}; the end of its log:\n{log}")
        time.sleep(1.0)


def _end_with_parent(folder: Path) -> None:
    """Stop as `stop` would when the parent (pytest) is gone: no job outlives the suite."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(2.0)
    (folder / "stop").touch()
    os.kill(os.getpid(), signal.SIGTERM)


def main(folder: Path, jobs: list[str]) -> None:
    threading.Thread(target=_end_with_parent, args=(folder,), daemon=True).start()
    import ray

    from k3rl.job import run_job

    modules, previous = {}, None
    for spec in jobs:
        path, name = spec.rsplit(":", 1)
        if path != previous:
            ray.shutdown()  # the next module's first job starts Ray with its own config
            previous = path
        if path not in modules:
            loader = importlib.util.spec_from_file_location(Path(path).stem, path)
            modules[path] = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(modules[path])
        if (folder / "stop").exists():
            break
        out = folder / name
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        print(f"[background] {name}: starting", flush=True)
        try:
            job = modules[path].BACKGROUND_JOBS[name](out)
            summary = job() if callable(job) else run_job(job, quiet=True)
        except BaseException:
            (out / "error.txt").write_text(traceback.format_exc())
            if not isinstance(sys.exc_info()[1], Exception):
                raise  # SystemExit, KeyboardInterrupt: the suite is stopping
        else:
            tmp = out / "summary.pkl.tmp"
            tmp.write_bytes(pickle.dumps(summary))
            tmp.rename(out / "summary.pkl")
        print(f"[background] {name}: done in {time.monotonic() - t0:.0f} s", flush=True)
    ray.shutdown()


def k3rl_train(cwd: Path, args: list[str], timeout_s: float = 600) -> dict:
    """`python -m k3rl.cli train ARGS` in `cwd`, as a user runs it: its exit status and output."""
    r = subprocess.run([sys.executable, "-m", "k3rl.cli", "train", *args], capture_output=True, text=True,
                       timeout=timeout_s, cwd=cwd, env={**os.environ, "COLUMNS": "200"})
    return {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
