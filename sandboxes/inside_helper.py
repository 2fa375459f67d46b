"""The agent every backend runs INSIDE the sandbox, one long-lived process per sandbox.

Standard library only (it runs on the sandbox's own Python). Started as `python3 -I -S -c
<bootstrap>` (base.AGENT_BOOTSTRAP), which reads this source from stdin. Then requests arrive
on stdin as frames `>QI` (request id, length) + `JSON\\n` + input bytes; each is handled in its
own thread and answered on stdout by a frame `>QI` (request id, length) + reply, where a reply
is a header line `K3RL/1 {json}\\n` followed by the payload bytes the header announces.
Docker starts it with one `docker exec -i` per container, bubblewrap as the sandbox's process,
so a tool call costs no process start on the host and no daemon work.

Modes:

- `exec`:  run `/bin/sh -c CMD` in its own session (process group), read its stdout/stderr
           through pipes keeping the first `cap` bytes of each (the rest is drained and
           counted), enforce the wall-clock `timeout` by killing the process group *and* every
           process that carries this exec's `K3RL_EXEC_ID` in its environment (descendants
           that called setsid), and report OOM kills from the cgroup's `oom_kill` counter.
           Background jobs that still hold the output pipes once the command has exited (plus
           `GRACE_S`) are killed the same way; jobs that redirected their output keep running.
- `write`: stdin -> file, `read`: file -> payload; both refuse paths whose real path
           (symlinks resolved) leaves /work.
- `spawn`: start `/bin/sh -c CMD` as a long-lived process with pipes to its stdin and stdout (an
           MCP server speaking stdio, say); `send` writes to its stdin (or closes it), `recv`
           waits up to `timeout` for its stdout (the bytes, whether the stream ended, its exit
           code), `kill` ends it and everything it started. Its stdout is buffered here up to
           `SPAWN_BUFFER` bytes (then the process blocks until `recv` takes some); the last
           4 KiB of its stderr come with the end of its stdout.
- `reset`: kill every process but PID 1 and itself, empty /work and /tmp, re-seed /tmp (pool reuse).
- `ping`:  health check.

When its stdin closes (the host closed the sandbox, or the host process died) the agent ends the
sandbox (`end_sandbox`), so a crashed job leaves no running container behind.
"""

import errno
import json
import os
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time

MAGIC = b"K3RL/1 "
WORK = "/work"
TMP_SEED = "/etc/k3rl/tmp-seed"  # image files copied into the empty /tmp (matplotlib font cache)
GRACE_S = 0.2  # how long we keep reading after the command exited (its background jobs may hold the pipes)


class Failure(Exception):
    """A request that cannot be done: answered with {"error": kind, "message": ...}."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind, self.message = kind, message


def reply(header, *payloads):
    return MAGIC + json.dumps(header).encode() + b"\n" + b"".join(payloads)


def fail(kind, message):
    raise Failure(kind, message)


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


# The command's shell first makes itself (and so the command) the OOM killer's first choice,
# not this helper; done in sh rather than a preexec_fn, which is unsafe in a threaded process.
SHELL_PREFIX = 'echo 1000 > /proc/self/oom_score_adj 2>/dev/null; exec /bin/sh -c "$1"'
# Without cgroups (bubblewrap as a user) a call's CPU is capped in seconds instead of in share: each
# process of the command may use `cpu_s` seconds of CPU (RLIMIT_CPU: SIGXCPU then, SIGKILL a second later).
CPU_PREFIX = 'prlimit --pid $$ --cpu={cpu_s}:{hard} || exit 126; '


def feed(pipe, data):
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError):
        pass  # the command did not read all of its input
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def workdir_and_env(args, tag):
    """The checked working directory of a command and its environment (tagged with `tag`)."""
    cwd = args.get("cwd") or WORK
    real = os.path.realpath(cwd)
    if not (real == WORK or real.startswith(WORK + "/")):
        fail("escape", f"workdir {cwd!r} resolves to {real!r}, outside {WORK}")
    if not os.path.isdir(real):
        fail("notfound", f"workdir {cwd!r} does not exist in the sandbox (create it first)")
    env = dict(os.environ)
    env.update(args.get("env") or {})
    env["K3RL_EXEC_ID"] = tag
    return real, env


def do_exec(args, data):
    cap, timeout, tag = int(args["cap"]), float(args["timeout"]), args["id"]
    real, env = workdir_and_env(args, tag)
    before = oom_count(args.get("oom_file"))
    start = time.monotonic()
    try:
        cpu_s = int(args.get("cpu_s") or 0)
        prefix = CPU_PREFIX.format(cpu_s=cpu_s, hard=cpu_s + 1) if cpu_s else ""
        proc = subprocess.Popen(
            ["/bin/sh", "-c", prefix + SHELL_PREFIX, "k3rl", args["cmd"]],
            cwd=real,
            env=env,
            stdin=subprocess.DEVNULL if data is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        fail("spawn", f"could not start the command: {exc} (process limit reached?)")
    if data is not None:
        threading.Thread(target=feed, args=(proc.stdin, data), daemon=True).start()
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
        if not sel.get_map():  # output closed, command still running: wait for it (not a fixed sleep)
            try:
                proc.wait(timeout=deadline - now)
            except subprocess.TimeoutExpired:
                pass
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
    proc.stdout.close()
    proc.stderr.close()
    return reply(
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


SPAWN_BUFFER = 1 << 24
SPAWNED = {}  # spawn id -> Spawned


class Spawned:
    """A long-lived process and the stdout it wrote that nobody took yet."""

    def __init__(self, proc, tag):
        self.proc, self.tag = proc, tag
        self.out, self.err, self.eof = bytearray(), bytearray(), False
        self.cond = threading.Condition()
        threading.Thread(target=self.pump_stdout, daemon=True).start()
        self.err_pump = threading.Thread(target=self.pump_stderr, daemon=True)
        self.err_pump.start()

    def pump_stdout(self):
        fd = self.proc.stdout.fileno()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: len(self.out) < SPAWN_BUFFER)
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            with self.cond:
                self.out += chunk
                self.eof = not chunk
                self.cond.notify_all()
            if not chunk:
                return

    def pump_stderr(self):
        try:
            while chunk := os.read(self.proc.stderr.fileno(), 1 << 16):
                with self.cond:
                    self.err += chunk
                    del self.err[:-4096]
        except OSError:
            pass

    def take(self, timeout, limit):
        with self.cond:
            self.cond.wait_for(lambda: self.out or self.eof, timeout)
            data = bytes(self.out[:limit])
            del self.out[:limit]
            self.cond.notify_all()
            return data, self.eof and not self.out


def spawned(args):
    found = SPAWNED.get(args["id"])
    if found is None:
        fail("noprocess", f"no spawned process {args['id']!r} in the sandbox (it was killed, or the sandbox reset)")
    return found


def do_spawn(args, data):
    tag = args["id"]
    real, env = workdir_and_env(args, tag)
    try:
        cpu_s = int(args.get("cpu_s") or 0)
        prefix = CPU_PREFIX.format(cpu_s=cpu_s, hard=cpu_s + 1) if cpu_s else ""
        proc = subprocess.Popen(
            ["/bin/sh", "-c", prefix + SHELL_PREFIX, "k3rl", args["cmd"]],
            cwd=real, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        fail("spawn", f"could not start the command: {exc} (process limit reached?)")
    SPAWNED[tag] = Spawned(proc, tag)
    return reply({"pid": proc.pid})


def do_send(args, data):
    proc = spawned(args).proc
    try:
        if args.get("close"):
            proc.stdin.close()
        else:
            proc.stdin.write(data or b"")
            proc.stdin.flush()
    except (BrokenPipeError, ValueError, OSError) as exc:
        fail("closed", f"the process no longer reads its stdin (exit code {proc.poll()}): {exc}")
    return reply({"written": len(data or b"")})


def do_recv(args, data):
    found = spawned(args)
    out, ended = found.take(float(args["timeout"]), int(args["max"]))
    header = {"len": len(out), "eof": ended, "exit_code": None}
    if ended:  # its stdout closed: it has exited, or is about to
        try:
            header["exit_code"] = found.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        found.err_pump.join(timeout=1.0)  # its stderr may still be in the pipe when its stdout closed
        with found.cond:
            header["stderr"] = found.err.decode("utf-8", "replace")
    return reply(header, out)


def do_kill(args, data):
    found = SPAWNED.pop(args["id"], None)
    if found is None:
        return reply({"exit_code": None})
    kill_tree(found.proc.pid, found.tag)
    code = found.proc.wait()
    for pipe in (found.proc.stdin, found.proc.stdout, found.proc.stderr):
        try:
            pipe.close()
        except OSError:
            pass
    return reply({"exit_code": code})


def checked(path, must_exist):
    real = os.path.realpath(path)
    if not (real == WORK or real.startswith(WORK + "/")):
        fail("escape", f"path {path!r} resolves to {real!r} (through a symlink), outside {WORK}")
    if must_exist and not os.path.exists(real):
        fail("notfound", f"no such file in the sandbox: {path!r}")
    return real


def do_write(args, data):
    path, limit = args["path"], int(args["max"])
    parent = checked(os.path.dirname(path), must_exist=False)
    os.makedirs(parent, exist_ok=True)
    checked(os.path.dirname(path), must_exist=True)
    if os.path.islink(path):  # a link to a file inside /work is written through; outside is refused
        path = checked(path, must_exist=False)
    data = data or b""
    if len(data) > limit:
        fail("toolarge", f"file larger than the limit of {limit} bytes")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except IsADirectoryError:
        fail("isdir", f"{path!r} is a directory")
    except OSError as exc:
        fail("other", f"cannot write {path!r}: {exc}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as exc:  # a full /work (ENOSPC, EFBIG): what did not fit is not left half-written
        os.unlink(path)
        fail("nospace" if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else "other",
             f"cannot write {path!r} ({len(data)} bytes): {exc.strerror} (the sandbox's workdir_mb is its room)")
    return reply({"written": len(data)})


def do_read(args, data):
    path, limit = args["path"], int(args["max"])
    real = checked(path, must_exist=True)
    if os.path.isdir(real):
        fail("isdir", f"{path!r} is a directory, not a file")
    size = os.path.getsize(real)
    if size > limit:
        fail("toolarge", f"{path!r} is {size} bytes, over the limit of {limit} bytes")
    with open(real, "rb") as f:
        data = f.read(limit + 1)
    return reply({"len": len(data)}, data)


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


def do_reset(args, data):
    SPAWNED.clear()  # their processes die below with all the others
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
    seed_tmp()
    return reply({"reset": True})


def seed_tmp():
    """Copy the image's /tmp seed into /tmp (a fresh tmpfs, or one a reset emptied)."""
    if os.path.isdir(TMP_SEED):
        for name in os.listdir(TMP_SEED):
            shutil.copytree(os.path.join(TMP_SEED, name), os.path.join("/tmp", name), dirs_exist_ok=True)


HANDLERS = {
    "exec": do_exec,
    "write": do_write,
    "read": do_read,
    "reset": do_reset,
    "spawn": do_spawn,
    "send": do_send,
    "recv": do_recv,
    "kill": do_kill,
    "ping": lambda args, data: reply({"ok": True, "pid": os.getpid()}),
}


def handle(mode, args, data):
    """One request -> its reply bytes (errors become error replies, never a dead helper)."""
    try:
        return HANDLERS[mode](args, data)
    except Failure as exc:
        return reply({"error": exc.kind, "message": exc.message})
    except Exception as exc:  # a bug or an exhausted sandbox: say so instead of going silent
        return reply({"error": "other", "message": f"helper error in {mode}: {exc!r}"})


def read_exact(stream, n):
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def end_sandbox():
    """The host closed our stream: it closed the sandbox, or its process died (then nobody ever will).
    PID 1 of a Docker sandbox is its reaper, which exits on SIGTERM: the container stops, and the
    daemon removes it. (bubblewrap's PID 1 ignores this; its sandbox dies with the host process.)"""
    try:
        os.kill(1, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def serve():
    """Agent loop: framed requests on stdin, one thread each, framed replies on stdout."""
    inp, out, lock = sys.stdin.buffer, sys.stdout.buffer, threading.Lock()
    if os.environ.pop("K3RL_SEED_TMP", None):  # bubblewrap: /tmp is a fresh tmpfs of this agent's namespace
        try:
            seed_tmp()
        except OSError:
            pass

    def answer(req_id, meta, data):
        body = handle(meta["mode"], meta["args"], data)
        with lock:
            out.write(struct.pack(">QI", req_id, len(body)) + body)
            out.flush()

    while True:
        head = read_exact(inp, 12)
        if head is None:
            return end_sandbox()  # the host closed the stream
        req_id, length = struct.unpack(">QI", head)
        message = read_exact(inp, length)
        if message is None:
            return end_sandbox()
        line, _, data = message.partition(b"\n")
        meta = json.loads(line)
        work = (req_id, meta, data if meta.get("has_stdin") else None)
        try:
            threading.Thread(target=answer, args=work, daemon=True).start()
        except RuntimeError:  # no thread left (pids limit reached, e.g. a fork bomb): answer inline
            answer(*work)


if __name__ == "__main__":
    serve()
