"""A `ray start --head --block` cluster on loopback for tests that join a cluster. It is stopped through
its own process (never `ray stop`, which would end every Ray process on the machine)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def ray_head(port: int, num_cpus: int = 2):
    """Yields "127.0.0.1:<port>" once the head's GCS answers; stops the head on exit."""
    import ray

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                             "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={num_cpus}",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ray.shutdown()
    try:
        deadline = time.monotonic() + 180
        while True:  # the GCS answers on the loopback port once the head is up
            assert head.poll() is None, "ray start --head exited early"
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "ray start --head did not come up within 180 s"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        ray.shutdown()
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        # what `ray stop` would tidy: the pointer a later bare ray.init() would follow to a dead cluster
        current = "/tmp/ray/ray_current_cluster"
        if os.path.exists(current) and open(current).read().strip().endswith(f":{port}"):
            os.unlink(current)
