"""The `none` backend (no isolation): the contract's semantics as plain host processes, chosen only by
name, and a job that needs sandboxes it cannot have is refused, naming sandbox.backend."""

import os
import subprocess
import time

import pytest

from k3rl.config import JobConfig
from k3rl.rollout.job_start import PreflightError, preflight
from k3rl.sandboxes import PathEscapeError, SandboxError, SandboxFileError, choose_backend, open_sandbox
from k3rl.sandboxes.types import BackendUnavailableError


def test_exec_files_and_limits_as_host_processes(tmp_path):
    with open_sandbox(backend="none", timeout_s=5, output_bytes=64) as sb:
        assert sb.backend == "none"
        sb.write_file("d/in.txt", "hello")
        assert sb.read_file("d/in.txt") == b"hello"
        r = sb.exec("cat d/in.txt; echo oops >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "hello", "oops\n")
        r = sb.exec(["python3", "-"], stdin="print(6 * 7)")
        assert r.ok and r.stdout == "42\n"
        # the timeout kills the command's whole process group, children included
        # (a duration no other process has: `pgrep -f "sleep 30"` also found a "sleep 300" of the machine's)
        nap = f"30.{os.getpid():07d}"
        t0 = time.monotonic()
        r = sb.exec(f"sleep {nap} & sleep {nap}; wait", timeout=1)
        assert r.timed_out and r.exit_code == 137 and time.monotonic() - t0 < 10
        assert subprocess.run(["pgrep", "-f", f"sleep {nap}$"], capture_output=True).stdout == b""
        r = sb.exec("python3 -c \"print('x' * 1000)\"")
        assert r.truncated and r.stdout.startswith("x" * 64) and "64 of 1001 bytes" in r.stdout
        base = sb.base
        sb.reset()
        assert list(base.iterdir()) == [] and sb.exec("ls").stdout == ""
    assert not base.exists()  # closed: its directory is gone


def test_paths_stay_in_the_work_dir():
    with open_sandbox(backend="none") as sb:
        with pytest.raises(PathEscapeError):
            sb.read_file("../../etc/passwd")
        os.symlink("/etc", sb.base / "etc")  # a link out, made by a command in the work dir
        with pytest.raises(PathEscapeError, match="through a symlink"):
            sb.read_file("etc/passwd")
        with pytest.raises(PathEscapeError):
            sb.write_file("etc/evil", "x")
        with pytest.raises(SandboxFileError, match="no file"):
            sb.read_file("missing.txt")
        with pytest.raises(SandboxError, match="docker or bwrap"):
            sb.spawn("sleep 1")


def test_auto_never_chooses_none():
    assert choose_backend("none") == "none"
    with pytest.raises(BackendUnavailableError, match="cannot run here"):
        choose_backend("auto", image="k3rl-no-such-image:0")  # no Docker image: an error, never "none"


def test_a_job_whose_sandboxes_cannot_run_is_refused_naming_the_setting():
    cfg = JobConfig.load("examples/agent_from_scratch.yaml", ["sandbox.image=k3rl-no-such-image:0",
                                                              "learner.sft_steps=0", "learner.sft_phases=[]"])
    with pytest.raises(PreflightError, match=r"sandbox.backend: 'auto' cannot run the sandboxes of "
                                             r"k3rl/LongHorizon-v0, k3rl/PythonTool-v0 here .*set sandbox.backend: none"):
        preflight(cfg)
    with pytest.raises(ValueError, match="sandbox.image"):  # an image means Docker: never with backend none
        JobConfig.load("examples/agent_from_scratch.yaml", ["sandbox.backend=none", "sandbox.image=x:1"])
    preflight(JobConfig.load("examples/agent_from_scratch.yaml", ["sandbox.backend=none", "learner.sft_steps=0",
                                                                  "learner.sft_phases=[]"]))
