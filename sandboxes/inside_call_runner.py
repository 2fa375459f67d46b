"""Runs a user's function INSIDE a sandbox, with a loopback port that reaches a host loopback port.

Standard library only (it runs on the sandbox's own Python); the host writes it into the sandbox and
starts it with `Sandbox.spawn` (`host_call.call_in_sandbox`). Given a JSON file

    {"module_file": "...py", "function": "solve", "args": [...], "url_arg": 0, "path": "/episodes/e1/v1"}

it listens on 127.0.0.1:<free port> in the sandbox's own network namespace (loopback only), replaces
`args[url_arg]` by `http://127.0.0.1:<port><path>`, imports the module from its file and calls the function.
Every connection to that port is relayed over this process's stdin and stdout, which travel over the
sandbox's agent channel, so the sandbox needs no network at all. stdout carries JSON lines only:

    {"c": N, "d": base64}   bytes connection N sent        {"c": N, "eof": true}   it closed its side
    {"result": value}       the function returned          {"error": traceback}    it raised

and stdin carries the host's `{"c": N, "d": ...}` / `{"c": N, "eof": true}` back. Whatever the function
prints goes to stderr (fd 1 is moved there), so it cannot corrupt the relay.
"""

import base64
import importlib.util
import json
import os
import socket
import sys
import threading
import traceback

RELAY = os.fdopen(os.dup(1), "wb", buffering=0)
os.dup2(2, 1)  # the user's prints (and its children's) go to stderr from here on
SEND_LOCK = threading.Lock()
CONNS = {}


def send(message):
    line = (json.dumps(message) + "\n").encode()
    with SEND_LOCK:
        RELAY.write(line)


def to_host(n, conn):
    """What connection `n` sends, to the host; its close as an eof."""
    try:
        while data := conn.recv(1 << 16):
            send({"c": n, "d": base64.b64encode(data).decode()})
    except OSError:
        pass
    send({"c": n, "eof": True})


def accept(listener):
    n = 0
    while True:
        conn, _ = listener.accept()
        n += 1
        CONNS[n] = conn
        threading.Thread(target=to_host, args=(n, conn), daemon=True).start()


def from_host():
    for line in sys.stdin.buffer:
        message = json.loads(line)
        conn = CONNS.get(message.get("c"))
        if conn is None:
            continue
        try:
            if "d" in message:
                conn.sendall(base64.b64decode(message["d"]))
            elif message.get("eof"):
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}{spec.get('path', '')}"
    threading.Thread(target=accept, args=(listener,), daemon=True).start()
    threading.Thread(target=from_host, daemon=True).start()
    args = list(spec["args"])
    if spec.get("url_arg") is not None:
        args[spec["url_arg"]] = url
    try:
        module_spec = importlib.util.spec_from_file_location(spec.get("module", "user_module"), spec["module_file"])
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        value = getattr(module, spec["function"])(*args)
        try:
            send({"result": value})
        except (TypeError, ValueError):
            send({"error": f"the function returned {value!r}, which is not JSON-able"})
    except BaseException:  # the user's failure, whatever it is, goes back as its traceback
        send({"error": traceback.format_exc()})
    os._exit(0)  # connection threads may still hold sockets: the answer is out, so end now


if __name__ == "__main__":
    main(sys.argv[1])
