"""The helper every backend runs INSIDE the sandbox: `python3 -I -S -c <this file> MODE JSON`.

Standard library only (it runs on the sandbox's own Python). One protocol for all backends:
the helper writes one header line `K3RL/1 {json}\\n` to stdout, then the payload bytes the
header announces. Modes:

- `exec`:  run `/bin/sh -c CMD` in its own session (process group), read its stdout/stderr
           through pipes keeping the first `cap` bytes of each (the rest is drained and
           counted), enforce the wall-clock `timeout` by killing the process group *and* every
           process that carries this exec's `K3RL_EXEC_ID` in its environment (descendants
           that called setsid), and report OOM kills from the cgroup's `oom_kill` counter.
           Background jobs that still hold the output pipes once the command has exited (plus
           `GRACE_S`) are killed the same way; jobs that redirected their output keep running.
- `write`: stdin -> file, `read`: file -> payload; both refuse paths whose real path
           (symlinks resolved) leaves /work.
- `reset`: kill every process but PID 1 and itself, empty /work and /tmp, re-seed /tmp (pool reuse).
- `ping`:  health check.
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import time

MAGIC = b"K3RL/1 "
WORK = "/work"
TMP_SEED = "/etc/k3rl/tmp-seed"  # image files copied into the empty /tmp (matplotlib font cache)
GRACE_S = 0.2  # how long we keep reading after the command exited (its background jobs may hold the pipes)


def reply(header, *payloads):
    out = sys.stdout.buffer
    out.write(MAGIC + json.dumps(header).encode() + b"\n")
    for payload in payloads:
        out.write(payload)
    out.flush()


def fail(kind, message):
    reply({"error": kind, "message": message})
    sys.exit(0)


def oom_count(path):
    """`oom_kill N` from memory.oom_control (cgroup v1) or memory.events (v2); None when unreadable."""
    if not path:
        return None
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def tagged_pids(tag):
    """Pids (other than us and PID 1) whose environment holds K3RL_EXEC_ID=tag."""
    needle = b"\0K3RL_EXEC_ID=" + tag.encode() + b"\0"
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (me, 1):
            continue
        try:
            with open("/proc/" + name + "/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":
                    found.append(int(name))
        except OSError:
            continue
    return found


def kill_tree(pgid, tag):
    """SIGKILL the process group and every tagged process until none is left (fork bombs respawn)."""
    for _ in range(200):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        pids = tagged_pids(tag)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not pids:
            return
        time.sleep(0.01)


def child_setup():
    try:  # make the command, not this helper, the OOM killer's first choice
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def do_exec(args):
    cap, timeout, tag = int(args["cap"]), float(args["timeout"]), args["id"]
    cwd = args.get("cwd") or WORK
    real = os.path.realpath(cwd)
    if not (real == WORK or real.startswith(WORK + "/")):
        fail("escape", f"workdir {cwd!r} resolves to {real!r}, outside {WORK}")
    if not os.path.isdir(real):
        fail("notfound", f"workdir {cwd!r} does not exist in the sandbox (create it first)")
    env = dict(os.environ)
    env.update(args.get("env") or {})
    env["K3RL_EXEC_ID"] = tag
    before = oom_count(args.get("oom_file"))
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", args["cmd"]],
            cwd=real,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=child_setup,
        )
    except OSError as exc:
        fail("spawn", f"could not start the command: {exc} (process limit reached?)")
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    total = dict.fromkeys(kept, 0)
    sel = selectors.DefaultSelector()
    for fd in kept:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline, exited_at, timed_out = start + timeout, None, False
    while True:
        now = time.monotonic()
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and (not sel.get_map() or now - exited_at >= GRACE_S):
            break
        if now >= deadline:
            timed_out = True
            break
        wait = min(deadline - now, 0.05)
        if not sel.get_map():
            time.sleep(wait)
            continue
        for key, _ in sel.select(wait):
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fd)
                continue
            total[key.fd] += len(chunk)
            room = cap - len(kept[key.fd])
            if room > 0:
                kept[key.fd] += chunk[:room]
    if timed_out or sel.get_map():
        # timeout, or the command exited but something it started still holds our pipes:
        # the exec owns those processes, so they go (daemons that redirected their output stay)
        kill_tree(proc.pid, tag)
    code = proc.wait()
    duration = time.monotonic() - start
    after = oom_count(args.get("oom_file"))
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    out, err = bytes(kept[out_fd]), bytes(kept[err_fd])
    reply(
        {
            "exit_code": 128 - code if code < 0 else code,  # shell convention: 128 + signal
            "timed_out": timed_out,
            "oom_killed": before is not None and after is not None and after > before,
            "out_total": total[out_fd],
            "err_total": total[err_fd],
            "out_len": len(out),
            "err_len": len(err),
            "duration_s": duration,
        },
        out,
        err,
    )


def checked(path, must_exist):
    real = os.path.realpath(path)
    if not (real == WORK or real.startswith(WORK + "/")):
        fail("escape", f"path {path!r} resolves to {real!r} (through a symlink), outside {WORK}")
    if must_exist and not os.path.exists(real):
        fail("notfound", f"no such file in the sandbox: {path!r}")
    return real


def do_write(args):
    path, limit = args["path"], int(args["max"])
    parent = checked(os.path.dirname(path), must_exist=False)
    os.makedirs(parent, exist_ok=True)
    checked(os.path.dirname(path), must_exist=True)
    if os.path.islink(path):  # a link to a file inside /work is written through; outside is refused
        path = checked(path, must_exist=False)
    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        fail("toolarge", f"file larger than the limit of {limit} bytes")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except IsADirectoryError:
        fail("isdir", f"{path!r} is a directory")
    except OSError as exc:
        fail("other", f"cannot write {path!r}: {exc}")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    reply({"written": len(data)})


def do_read(args):
    path, limit = args["path"], int(args["max"])
    real = checked(path, must_exist=True)
    if os.path.isdir(real):
        fail("isdir", f"{path!r} is a directory, not a file")
    size = os.path.getsize(real)
    if size > limit:
        fail("toolarge", f"{path!r} is {size} bytes, over the limit of {limit} bytes")
    with open(real, "rb") as f:
        data = f.read(limit + 1)
    reply({"len": len(data)}, data)


def empty_dir(root):
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            for sub, dirs, files in os.walk(path, topdown=False):
                for item in files:
                    os.unlink(os.path.join(sub, item))
                for item in dirs:
                    full = os.path.join(sub, item)
                    os.unlink(full) if os.path.islink(full) else os.rmdir(full)
            os.rmdir(path)
        else:
            os.unlink(path)


def do_reset(args):
    me = os.getpid()
    for _ in range(200):
        others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        if not others:
            break
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
    for root in (WORK, "/tmp"):
        try:
            empty_dir(root)
        except OSError as exc:
            fail("other", f"could not empty {root}: {exc}")
    if os.path.isdir(TMP_SEED):
        import shutil

        for name in os.listdir(TMP_SEED):
            shutil.copytree(os.path.join(TMP_SEED, name), os.path.join("/tmp", name), dirs_exist_ok=True)
    reply({"reset": True})


def main():
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    {
        "exec": do_exec,
        "write": do_write,
        "read": do_read,
        "reset": do_reset,
        "ping": lambda a: reply({"ok": True}),
    }[mode](args)


if __name__ == "__main__":
    main()
