"""MCP tools: the `mcp` SDK's client talking to a real MCP server inside the real sandbox."""

import gymnasium as gym
import pytest
from PIL import Image

import k3rl.envs  # noqa: F401
from k3rl.envs.mcp_files import SERVER
from k3rl.envs.mcp_tools import McpConnection, McpServer, McpServerError, McpTool
from k3rl.envs.tools import ToolError
from k3rl.images import PNG_MAGIC
from k3rl.rollout.episode import run_oracle_episode

from .conftest import BACKEND


def make(**kw):
    return gym.make("k3rl/McpFiles-v0", sandbox_backend=BACKEND, **kw).unwrapped


def call(env, name, **arguments):
    obs, reward, terminated, truncated, info = env.step(env.say(tool_calls=[{"name": name, "arguments": arguments}]))
    return obs[0], info["tool_calls"][0]


@pytest.fixture(scope="module")
def env():
    from .conftest import _require

    _require()
    env = make()
    env.reset(seed=5, options={"family": "setting"})
    yield env
    env.close()


def test_server_tools_become_k3_tool_declarations(env):
    by_name = {t["function"]["name"]: t["function"] for t in env.tools}
    assert sorted(by_name) == ["list_files", "read_file", "view_image"]
    assert by_name["read_file"]["description"] == "Read a text file."
    assert by_name["read_file"]["parameters"]["required"] == ["path"]
    assert by_name["read_file"]["parameters"]["properties"]["path"]["type"] == "string"


def test_a_call_returns_what_the_server_read_in_the_sandbox(env):
    listing, record = call(env, "list_files", path=".")
    assert record["ok"] and ".mcp" not in listing["content"]
    folder = env.task.path.split("/")[0]
    assert f"{folder}/" in listing["content"].splitlines()
    msg, record = call(env, "read_file", path=env.task.path)
    assert record["ok"] and f"= {env.task.answer}" in msg["content"]


def test_error_results_and_bad_arguments_reach_the_model(env):
    msg, record = call(env, "read_file", path="nowhere/x.ini")
    assert not record["ok"] and "no such file: 'nowhere/x.ini'" in msg["content"]  # the server's isError result
    msg, record = call(env, "read_file", path=7)  # refused by the tool's JSON schema before any call
    assert not record["ok"] and "bad arguments for read_file" in msg["content"] and "is not of type 'string'" in msg["content"]
    msg, record = call(env, "read_file", path="../etc/passwd")
    assert not record["ok"] and "outside the work dir" in msg["content"]


def test_json_rpc_errors_become_tool_errors(env):
    connection = env._mcp
    ghost = connection.tools[0].model_copy(update={"name": "ghost"})
    with pytest.raises(ToolError, match="unknown tool 'ghost'"):
        McpTool(ghost, connection, timeout_s=10).fn()


def test_image_results_come_back_as_png(require_sandbox):
    require_sandbox()
    env = make()
    ep = run_oracle_episode(env, seed=2, options={"family": "colour"})
    assert ep.reward == 1.0 and ep.terminated
    tool_turn = next(t for t in ep.turns if t.role == "tool")
    assert tool_turn.tool_name == "view_image" and len(tool_turn.images) == 1
    png = tool_turn.images[0]
    assert png.startswith(PNG_MAGIC)
    import io

    from k3rl.envs.mcp_files import COLOURS

    assert Image.open(io.BytesIO(png)).convert("RGB").getpixel((5, 5)) == COLOURS[env.task.answer]
    assert not env.has_sandbox  # released (with its server) when the episode ended


def test_the_server_ends_with_the_episode(require_sandbox):
    """The server process is killed when the episode ends, even when the sandbox lives on (a pool)."""
    require_sandbox()
    from k3rl.sandboxes import open_sandbox

    sandbox = open_sandbox(backend=BACKEND)
    try:
        env = make(sandbox_factory=lambda: sandbox, sandbox_release=lambda sb: None)
        env.reset(seed=0, options={"family": "setting"})
        assert "files_server.py" in sandbox.exec("ps -eo args", timeout=10).stdout
        env.step(env.say("I do not know."))  # the final answer ends the episode
        assert "files_server.py" not in sandbox.exec("ps -eo args", timeout=10).stdout
    finally:
        sandbox.close()


def test_a_server_that_dies_is_an_infrastructure_failure(require_sandbox):
    require_sandbox()
    broken = McpServer(command="echo 'no module named fastmcp' >&2; exit 3")
    env = make(mcp_server=broken)
    with pytest.raises(McpServerError, match=r"exited with code 3.*no module named fastmcp"):
        env.reset(seed=0)
    assert not env.has_sandbox


def test_a_server_that_lists_other_tools_than_it_declares_is_refused(require_sandbox):
    """McpServer.tools is what `k3rl envs list` shows without a sandbox: a connection checks it."""
    import dataclasses

    require_sandbox()
    assert sorted(SERVER.tools) == ["list_files", "read_file", "view_image"]
    env = make(mcp_server=dataclasses.replace(SERVER, tools=("list_files", "read_file")))
    with pytest.raises(McpServerError, match=r"lists the tools \['list_files', 'read_file', 'view_image'\], but its "
                                             r"McpServer declares \['list_files', 'read_file'\]"):
        env.reset(seed=0)
    assert not env.has_sandbox


def test_a_connection_on_a_plain_sandbox_closes_cleanly(require_sandbox):
    require_sandbox()
    from k3rl.sandboxes import open_sandbox

    with open_sandbox(backend=BACKEND) as sandbox:
        for path, data in SERVER.files.items():
            sandbox.write_file(path, data)
        sandbox.write_file("notes/a.txt", "alpha\n")
        connection = McpConnection(sandbox.spawn(SERVER.command))
        try:
            result = connection.call("read_file", {"path": "notes/a.txt"}, timeout_s=10)
            assert not result.is_error and result.content[0].text == "alpha\n"
        finally:
            connection.close()
        assert connection.process.at_eof
        assert not connection._thread.is_alive()


def test_episodes_on_a_pooled_sandbox_each_start_their_own_server(require_sandbox):
    """As in a rollout worker: sandboxes come from a SandboxPool on an event loop, the env steps in a thread."""
    import asyncio
    import threading

    from k3rl.envs.sandboxed import pooled
    from k3rl.sandboxes import SandboxPool

    require_sandbox()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    pool = SandboxPool(backend=BACKEND, max_size=1, min_idle=1)
    try:
        asyncio.run_coroutine_threadsafe(pool.start(), loop).result(timeout=120)
        env = make(**pooled(pool, loop))
        for seed, family in [(0, "setting"), (1, "colour")]:
            ep = run_oracle_episode(env, seed=seed, options={"family": family})
            assert ep.reward == 1.0 and ep.error is None
            assert pool.leased == 0
    finally:
        asyncio.run_coroutine_threadsafe(pool.close(), loop).result(timeout=120)
        loop.call_soon_threadsafe(loop.stop)
