"""The Sandbox contract (docs/architecture.md, "Sandboxes"), checked against each real backend.

Isolation is checked by looking (interfaces, routes, capabilities, mounts), never by
sending traffic anywhere.
"""

from __future__ import annotations

import errno
import os
import platform
import shlex
import signal
import threading
import time

import pytest

from k3rl.sandboxes import (
    PathEscapeError,
    SandboxClosedError,
    SandboxDeadError,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
    open_sandbox,
)
from k3rl.sandboxes.types import TRUNCATION_MARKER

from .conftest import JOB, SMALL


def test_exec_reports_exit_code_streams_stdin_env_and_workdir(sb):
    r = sb.exec("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")
    assert not r.ok and not r.timed_out and not r.oom_killed and not r.truncated
    assert r.duration_s >= 0
    assert sb.exec("tr a-z A-Z", stdin="hello sandbox").stdout == "HELLO SANDBOX"
    assert sb.exec("echo $GREETING", env={"GREETING": "bonjour"}).stdout == "bonjour\n"
    sb.exec("mkdir -p sub/dir")
    assert sb.exec("pwd", workdir="sub/dir").stdout == "/work/sub/dir\n"
    assert sb.exec(["printf", "%s|", "a b", "c;d"]).stdout == "a b|c;d|"  # argv lists are quoted


def test_sees_only_loopback_and_no_route(sb):
    # /proc/net/* describe the sandbox's own network namespace
    interfaces = [line.split(":")[0].strip() for line in sb.exec("cat /proc/net/dev").stdout.splitlines()[2:]]
    assert interfaces == ["lo"]
    routes = sb.exec("cat /proc/net/route").stdout.splitlines()
    assert routes[0].startswith("Iface") and routes[1:] == []  # no default (or any) route
    if sb.backend == "docker":
        assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]


def test_runs_as_non_root_without_capabilities(sb):
    assert sb.exec("id -u; id -g").stdout.split() == ["1000", "1000"]
    status = dict(
        line.split(":\t", 1) for line in sb.exec("cat /proc/self/status").stdout.splitlines() if ":\t" in line
    )
    for cap in ("CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[cap], 16) == 0, f"{cap}={status[cap]}"
    assert status["NoNewPrivs"].strip() == "1"
    nested = sb.exec("unshare --user --map-root-user id")  # no new user namespace (kernel attack surface)
    assert nested.exit_code != 0 and "uid=0" not in nested.stdout


def test_a_seccomp_filter_refuses_calls_a_sandboxed_program_has_no_use_for(sb):
    """Both backends filter system calls (Docker by its default profile, bwrap by `sandboxes/seccomp.py`):
    calls that succeed unfiltered even without capabilities, `unshare(0)` (a no-op) and `kcmp` on the
    program's own pid, answer EPERM, while ordinary calls go through. A seccomp-filtered process says so in
    /proc/self/status."""
    if platform.machine() != "x86_64":
        pytest.skip("the probe uses x86_64 call numbers")
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def call(nr, *a):\n"
        "    ctypes.set_errno(0)\n"
        "    return libc.syscall(nr, *a), ctypes.get_errno()\n"
        "print(call(272, 0), call(312, os.getpid(), os.getpid(), 0, 0, 0), call(39) == (os.getpid(), 0))\n"
    )
    out = sb.exec(f"python3 -c {shlex.quote(probe)}").stdout.strip()
    assert out == f"(-1, {errno.EPERM}) (-1, {errno.EPERM}) True", out
    assert "Seccomp:\t2" in sb.exec("cat /proc/self/status").stdout  # 2: SECCOMP_MODE_FILTER


def test_the_seccomp_program_is_well_formed():
    """sock_filter entries of 8 bytes: the architecture check first, ALLOW last, an EPERM after every denied
    call number; no table for an architecture it does not know."""
    import struct

    from k3rl.sandboxes.seccomp import SECCOMP_RET_ALLOW, X86_64_DENIED, filter_program

    prog = filter_program("x86_64")
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert len(prog) % 8 == 0 and insns[0] == (0x20, 0, 0, 4) and insns[-1] == (0x06, 0, 0, SECCOMP_RET_ALLOW)
    checked = {k for code, jt, jf, k in insns if code == 0x15 and (jt, jf) == (0, 1)}
    assert checked == set(X86_64_DENIED.values()) and len(insns) <= 4096  # the kernel's BPF_MAXINSNS
    assert filter_program("sparc") is None


def test_writes_outside_the_work_dir_fail(sb):
    for target in ("/etc/planted", "/usr/planted", "/planted", "/home/sandbox/planted", "/var/planted"):
        r = sb.exec(f"echo x > {target}")
        assert r.exit_code != 0, target
        assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr, r.stderr
    assert sb.exec("echo x > /work/ok && echo y > /tmp/ok && cat /work/ok /tmp/ok").stdout == "x\ny\n"


def test_timeout_kills_the_whole_process_tree(sb):
    t0 = time.monotonic()
    r = sb.exec("sleep 100", timeout=2)
    assert r.timed_out and r.exit_code == 137
    assert time.monotonic() - t0 < 8
    # children that left the process group (setsid) are killed too
    r = sb.exec("setsid sleep 300 & (sleep 301 &) ; sleep 302", timeout=1)
    assert r.timed_out
    assert "sleep" not in sb.exec("ps -eo comm").stdout


def test_background_job_holding_the_output_is_ended_with_the_exec(sb):
    t0 = time.monotonic()
    r = sb.exec("sleep 300 & echo started", timeout=20)
    assert r.stdout == "started\n" and not r.timed_out
    assert time.monotonic() - t0 < 8
    assert "sleep" not in sb.exec("ps -eo comm").stdout


def test_a_daemon_with_redirected_output_keeps_running_between_calls(sb):
    sb.exec("nohup sh -c 'while :; do date +%s%N >> beat.log; sleep 0.1; done' > /dev/null 2>&1 &")
    sb.exec("for i in $(seq 100); do [ -s beat.log ] && break; sleep 0.05; done")
    assert "beat.log" in sb.exec("ps -eo args").stdout
    first = sb.read_file("beat.log").count(b"\n")
    time.sleep(0.5)
    assert sb.read_file("beat.log").count(b"\n") > first  # still beating after its exec returned
    sb.reset()  # ... until the sandbox is reset
    assert "beat.log" not in sb.exec("ps -eo args").stdout
    assert sb.exec("ls -A").stdout == ""


def test_fork_bomb_is_contained_and_sandbox_stays_usable(backend):
    with open_sandbox(backend, job=JOB, limits=SMALL.with_(pids=48)) as box:
        # the shell that starts the bomb stays 2 s: when it exits first, bwrap's pid namespace (and the bomb with
        # it) can end before any fork meets the limit, and nothing would show that the limit held
        r = box.exec("bash -c ':(){ :|:& };:; sleep 2'", timeout=5)
        assert "Resource temporarily unavailable" in r.stderr or r.timed_out, r
        # the bomb burns out once its forks keep failing (on a loaded host that takes a few seconds more)
        deadline = time.monotonic() + 30
        while True:
            lines = box.exec("echo alive; ps -e --no-headers | wc -l").stdout.split()
            assert lines[0] == "alive", lines  # the sandbox answers while the bomb runs
            if int(lines[1]) < 10 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert int(lines[1]) < 10, lines
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 15  # closing is quick
    assert box.closed


def test_memory_bomb_is_oom_killed(backend):
    with open_sandbox(backend, job=JOB, limits=SMALL.with_(memory_mb=128)) as box:
        if backend == "bwrap" and box.cgroup is None:
            pytest.skip(
                "no writable cgroups on this host: one process past memory_mb fails its allocation (RLIMIT_AS) "
                "before anything is killed; the sandbox-wide kill: test_memory_is_capped_for_the_whole_sandbox"
            )
        r = box.exec("python3 -c 'x = \"x\" * (1 << 30); print(len(x))'", timeout=30)
        assert r.oom_killed and r.exit_code == 137 and not r.timed_out
        assert box.exec("echo still here").stdout == "still here\n"


def test_memory_is_capped_for_the_whole_sandbox(backend):
    # three processes of 60 MB each, each under the limit, together over it: Docker's and bubblewrap's cgroup
    # OOM killer, or without cgroups the host's watch over the sandbox's resident memory, ends the call
    with open_sandbox(backend, job=JOB, limits=SMALL.with_(memory_mb=128)) as box:
        r = box.exec("for i in 1 2 3; do python3 -c 'import time; x = b\"x\" * (60 << 20); time.sleep(3)' & done; "
                     "wait", timeout=15)
        assert r.oom_killed and not r.timed_out, r
        assert box.exec("echo still here").stdout == "still here\n"


def test_tmp_is_capped_at_tmp_mb(sb):
    # /tmp is a tmpfs of tmp_mb (64 MB here) on both backends: a larger write fails, nothing spills to the host
    r = sb.exec("head -c 80M /dev/zero > /tmp/big; echo rc=$?; du -sm /tmp/big", timeout=30)
    assert "No space left on device" in r.stderr and "rc=1" in r.stdout, r
    assert int(r.stdout.split()[-2]) <= 64, r
    assert sb.exec("rm /tmp/big && echo ok > /tmp/small && cat /tmp/small").stdout == "ok\n"


def work_kib(sb) -> int:
    return int(sb.exec("du -sk /work").stdout.split()[0])


def test_work_dir_is_capped_at_workdir_mb(sb):
    # one file larger than the quota fails as it is written (Docker: ENOSPC; bubblewrap: RLIMIT_FSIZE)
    r = sb.exec("head -c 80M /dev/zero > big", timeout=30)
    assert r.exit_code != 0 and work_kib(sb) <= 65 << 10, r
    # files that fit one by one but not together: the call fails, and /work ends within its quota
    # (Docker: the last write gets ENOSPC; bubblewrap: the newest files are removed after the call, and said so)
    r = sb.exec("rm -f big; for f in a b c; do head -c 30M /dev/zero > $f || exit 1; done", timeout=30)
    assert r.exit_code != 0, r
    assert "No space left on device" in r.stderr, r
    assert work_kib(sb) <= 65 << 10
    assert sb.exec("ls a b").exit_code == 0  # what fitted is kept
    with pytest.raises(SandboxFileError, match="workdir_mb|No space left"):
        sb.write_file("d", b"x" * (40 << 20))
    sb.exec("rm -f a b c")
    sb.write_file("d", b"x" * (40 << 20))  # room again once the files are gone


def test_cpu_seconds_are_capped_without_cgroups(backend):
    with open_sandbox(backend, job=JOB, limits=SMALL.with_(cpus=0.25)) as box:
        if backend == "docker" or box.cgroup is not None:
            pytest.skip("a CPU share holds here (Docker / cgroups); the seconds cap is bubblewrap's fallback")
        # 0.25 CPUs x a 6 s call: each process may use ceil(1.5) + 1 = 3 s of CPU, then SIGXCPU (exit 152)
        r = box.exec("python3 -c 'while True: pass'", timeout=6)
        assert r.exit_code == 128 + signal.SIGXCPU and not r.timed_out, r
        assert r.duration_s < 6


def test_large_output_is_truncated_and_marked(sb):
    cap = sb.limits.output_bytes
    r = sb.exec(
        "head -c 100000000 /dev/zero | tr '\\0' a; head -c 5000 /dev/zero | tr '\\0' b >&2", timeout=60
    )
    assert r.truncated and r.exit_code == 0
    marker = TRUNCATION_MARKER.format(shown=cap, total=100_000_000)
    assert r.stdout.endswith(marker + "\n")
    assert r.stdout.startswith("a" * cap)
    assert r.stderr == "b" * 5000  # under the cap: untouched


def test_files_round_trip_and_are_visible_to_exec(sb):
    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    sb.write_file("data/blob.bin", blob)
    assert sb.read_file("data/blob.bin") == blob
    assert sb.read_file("/work/data/blob.bin") == blob  # absolute inside /work is fine
    assert sb.exec("wc -c < data/blob.bin").stdout.strip() == str(len(blob))
    sb.write_file("note.txt", "héllo")
    assert sb.exec("cat note.txt").stdout == "héllo"
    sb.exec("ln -s note.txt alias.txt")
    assert sb.read_file("alias.txt") == "héllo".encode()  # a link that stays inside is followed
    with pytest.raises(SandboxFileError, match="no such file"):
        sb.read_file("missing.txt")
    with pytest.raises(SandboxFileError, match="directory"):
        sb.read_file("data")
    big = SandboxLimits(max_file_bytes=1000)
    with open_sandbox(sb.backend, job=JOB, limits=big) as small_box:
        with pytest.raises(SandboxFileError, match="max_file_bytes"):
            small_box.write_file("x", b"0" * 1001)


@pytest.mark.parametrize(
    "path", ["../escape", "a/../../escape", "/etc/passwd", "/work/../etc/passwd", "/workshop/x", ""]
)
def test_lexical_path_escapes_are_refused(sb, path):
    with pytest.raises(PathEscapeError):
        sb.write_file(path, b"x")
    with pytest.raises(PathEscapeError):
        sb.read_file(path)


def test_symlink_escapes_are_refused(sb):
    sb.exec("ln -s /etc etc_link; ln -s /etc/passwd passwd_link; ln -s /tmp tmp_link")
    with pytest.raises(PathEscapeError, match="outside /work"):
        sb.read_file("passwd_link")
    with pytest.raises(PathEscapeError, match="outside /work"):
        sb.read_file("etc_link/hostname")
    with pytest.raises(PathEscapeError, match="outside /work"):
        sb.write_file("tmp_link/planted", b"x")
    with pytest.raises(PathEscapeError, match="outside /work"):
        sb.write_file("passwd_link", b"x")
    assert sb.exec("ls /tmp").stdout == ""  # nothing was planted through the link
    with pytest.raises(PathEscapeError):
        sb.exec("pwd", workdir="../")
    with pytest.raises(PathEscapeError):
        sb.exec("pwd", workdir="etc_link")


def test_close_leaves_nothing_and_refuses_further_use(backend):
    box = open_sandbox(backend, job=JOB, limits=SMALL)
    box.exec("sleep 1000 > /dev/null 2>&1 &")  # a daemon that survives its exec
    box.close()
    box.close()  # idempotent
    if backend == "docker":
        import docker.errors

        with pytest.raises(docker.errors.NotFound):
            box.api.inspect_container(box.id)
    else:
        assert not box.base.exists()
        assert box.cgroup is None or all(not d.exists() for d in box.cgroup.dirs.values())
    with pytest.raises(SandboxClosedError):
        box.exec("true")


def test_killed_from_outside_mid_exec_gives_a_clear_error(backend):
    box = open_sandbox(backend, job=JOB, limits=SMALL)
    try:

        def kill_soon():
            time.sleep(1.0)
            if backend == "docker":
                box.client.api.kill(box.id)
            else:  # the sandbox's bwrap process, as an admin's `kill -9` would
                os.kill(box.host_pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(SandboxDeadError, match="killed"):
            box.exec("sleep 60", timeout=30)
        killer.join()
        assert time.monotonic() - t0 < 10
    finally:
        box.close()


def test_a_command_that_kills_every_process_gets_a_clear_error_and_the_sandbox_recovers(sb):
    sb.write_file("keep.txt", "still here")
    with pytest.raises(SandboxError, match=r"kill -9 -1"):
        sb.exec("kill -9 -1; sleep 5", timeout=20)
    assert sb.exec("cat keep.txt").stdout == "still here"  # the next call works (Docker: new agent)


def test_limits_are_validated_with_clear_messages():
    with pytest.raises(TypeError, match="memroy_mb"):
        open_sandbox("bwrap", memroy_mb=10)
    with pytest.raises(ValueError, match="pids"):
        SandboxLimits(pids=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=8)
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        open_sandbox("podman")


def test_async_variants(sb):
    import asyncio

    async def go():
        await sb.awrite_file("a.txt", "async")
        results = await asyncio.gather(*(sb.aexec(f"cat a.txt; echo {i}") for i in range(4)))
        return [r.stdout for r in results], await sb.aread_file("a.txt")

    outs, data = asyncio.run(go())
    assert outs == [f"async{i}\n" for i in range(4)] and data == b"async"
