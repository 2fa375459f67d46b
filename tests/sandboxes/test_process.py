"""`Sandbox.spawn`: a long-lived process with pipes, in both real backends."""

import time

import pytest

from k3rl.sandboxes import SandboxError

UPPER = "import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)\nsys.stderr.write('bye')\nsys.exit(3)"


def read_until_eof(proc, limit_s=30.0):
    out, deadline = b"", time.monotonic() + limit_s
    while not proc.at_eof and time.monotonic() < deadline:
        out += proc.read(timeout=1.0)
    return out


def read_line(proc, limit_s=10.0):
    out, deadline = b"", time.monotonic() + limit_s
    while not out.endswith(b"\n") and time.monotonic() < deadline:
        out += proc.read(timeout=1.0)
    return out


def test_spawned_process_talks_over_its_pipes_and_reports_how_it_ended(sb):
    proc = sb.spawn(["python3", "-u", "-c", UPPER])
    proc.write("hello\n")
    assert read_line(proc) == b"HELLO\n"  # answered while it still runs
    assert not proc.at_eof
    proc.write(b"world\n")
    proc.close_stdin()
    assert read_until_eof(proc) == b"WORLD\n"
    assert (proc.returncode, proc.stderr_tail) == (3, "bye")
    with pytest.raises(SandboxError, match="no longer reads its stdin"):
        proc.write("late\n")
    proc.kill()


def test_read_waits_at_most_its_timeout_and_kill_ends_everything_it_started(sb):
    proc = sb.spawn("sleep 300 & sleep 301")
    t0 = time.monotonic()
    assert proc.read(timeout=0.5) == b""
    assert 0.4 < time.monotonic() - t0 < 10
    assert proc.kill() is not None and proc.at_eof
    ps = sb.exec("ps -eo args", timeout=10).stdout
    assert "sleep 30" not in ps
    proc.kill()  # idempotent


def test_reset_forgets_spawned_processes(sb):
    proc = sb.spawn("cat")
    sb.reset()
    with pytest.raises(SandboxError, match="no spawned process"):
        proc.write("x\n")
