"""`call_in_sandbox`: a function run inside a sandbox reaches one host loopback URL through the agent channel
(the sandbox keeps no network), and its failures come back as errors with its traceback."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from k3rl.sandboxes.host_call import SandboxCallError, call_in_sandbox

TARGETS = str(Path(__file__).with_name("call_targets.py"))


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: many requests may share one relayed connection

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def host_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/episodes/e1/v1"
    server.shutdown()


def call(sb, function, host_url, *args, timeout_s=30):
    return call_in_sandbox(sb, TARGETS, function, ["", *args], url_arg=0, host_url=host_url, timeout_s=timeout_s)


def test_a_function_in_the_sandbox_talks_to_the_host_url_both_ways(sb, host_url):
    assert call(sb, "fetch_twice", host_url, 300_000) == {"lengths": [300_000, 300_000], "same": True}


def test_its_failures_come_back_with_their_traceback_or_exit_code(sb, host_url):
    with pytest.raises(SandboxCallError, match="KeyError: 'no such thing in http://127.0.0.1:") as e:
        call(sb, "raises", host_url)
    assert "in raises" in e.value.traceback  # the path the sandbox saw: its own loopback port, with the path
    with pytest.raises(SandboxCallError, match=r"ended \(exit code 7\) without an answer"):
        call(sb, "exits", host_url)
    with pytest.raises(SandboxCallError, match="did not return within its time budget"):
        call(sb, "sleeps", host_url, timeout_s=1.0)
    assert "runner.py" not in sb.exec("ps -eo args", timeout=10).stdout  # the timed-out call was killed


def test_only_a_host_loopback_url_is_relayed(sb):
    with pytest.raises(ValueError, match="must be on the host's loopback"):
        call(sb, "raises", "http://10.0.0.1:80/v1")
