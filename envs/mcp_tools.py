"""Tools from an MCP server that runs inside the episode's sandbox.

    class MyEnv(McpToolEnv):
        mcp_server = McpServer(command=("python3", "/work/.mcp/server.py"),
                               files={".mcp/server.py": SERVER_SOURCE})
        ...  # generate_task, opening_messages, score, oracle as for any ToolEnv

The server is started in the episode's sandbox (`Sandbox.spawn`) when the sandbox is opened,
which `reset` does, and killed when the episode ends. The host talks to it with the `mcp`
SDK's `ClientSession` over MCP's stdio transport (newline-delimited JSON-RPC), carried by the
sandbox's agent channel (`sandbox_stdio`): the sandbox keeps no network. Each MCP tool becomes
a K3 tool declaration (its JSON-schema `inputSchema` as the parameters); arguments are checked
against that schema before the call. A result's text and images (PNG; other formats are
converted) go back to the model; `isError` results and JSON-RPC errors come back as tool
errors; a server that dies is an infrastructure failure (`McpServerError`, a SandboxError).
The env's own `@tool` methods (a `submit`, say) sit beside the server's tools.

The SDK is async; a ToolEnv steps synchronously, so each connection runs its session on an
event loop of its own in a daemon thread (`McpConnection`).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import jsonschema
import mcp_types
from mcp import ClientSession
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from PIL import Image

from k3rl.envs.base import ToolEnv
from k3rl.envs.tools import Tool, ToolArgumentError, ToolError, ToolResult
from k3rl.images import to_png
from k3rl.sandboxes.base import in_thread
from k3rl.sandboxes.types import SandboxError

POLL_S = 1.0  # how long one read of the server's stdout waits in the sandbox


class McpServerError(SandboxError):
    """The MCP server in the sandbox failed to start, answer or stay alive (an infrastructure failure)."""


@dataclass(frozen=True)
class McpServer:
    """How to start an MCP server in a sandbox: its command, and files written to the work dir first.
    `tools`: the names of the tools it lists, when known in advance: `k3rl envs list` shows them without
    starting a sandbox, and each connection checks that the server lists exactly these."""

    command: Sequence[str] | str
    files: Mapping[str, bytes | str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    tools: Sequence[str] = ()


@asynccontextmanager
async def sandbox_stdio(process: Any):
    """MCP's stdio transport over a `SandboxProcess`: (read stream, write stream) for `ClientSession`."""
    to_session, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, from_session = anyio.create_memory_object_stream[SessionMessage](0)

    async def pump_stdout() -> None:
        pending = b""
        async with to_session:
            while not process.at_eof:
                pending += await in_thread(process.read, POLL_S)
                *lines, pending = pending.split(b"\n")
                for line in filter(bytes.strip, lines):
                    try:
                        message = SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
                    except ValueError as exc:
                        message = exc
                    await to_session.send(message)

    async def pump_stdin() -> None:
        async with from_session:
            async for message in from_session:
                line = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                await in_thread(process.write, line.encode())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(pump_stdout)
        tasks.start_soon(pump_stdin)
        try:
            yield read_stream, write_stream
        finally:
            tasks.cancel_scope.cancel()


class McpConnection:
    """A `ClientSession` with a server process in a sandbox, for synchronous callers.

    `tools` is the server's tool list (read at start); `call(name, arguments)` returns the
    `CallToolResult`; `close()` ends the session and kills the process. The session runs on
    an event loop in a daemon thread of its own.
    """

    def __init__(self, process: Any, start_timeout_s: float = 60.0) -> None:
        self.process = process
        self._session: ClientSession | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._stop = asyncio.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="k3rl-mcp", daemon=True)
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        try:
            self.tools: list[mcp_types.Tool] = self._result(self._ready, start_timeout_s, "starting")
        except BaseException:
            self.close()
            raise

    async def _serve(self) -> None:
        """Hold the session open (its task groups live in this one task) until `close`."""
        try:
            async with sandbox_stdio(self.process) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                tools, params = [], None
                while True:
                    page = await session.list_tools(params=params)
                    tools += page.tools
                    if not page.next_cursor:
                        break
                    params = mcp_types.PaginatedRequestParams(cursor=page.next_cursor)
                self._session = session
                self._ready.set_result(tools)
                await self._stop.wait()
        except Exception as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)

    def _result(self, future: concurrent.futures.Future, timeout: float, doing: str):
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise McpServerError(f"the MCP server {self.process.cmd!r} did not finish {doing} within {timeout:g}s"
                                 f"{self.how_it_ended()}") from None
        except MCPError:
            raise
        except Exception as exc:
            raise McpServerError(f"the MCP server {self.process.cmd!r} failed while {doing}: "
                                 f"{type(exc).__name__}: {exc}{self.how_it_ended(settle_s=2.0)}") from exc

    def how_it_ended(self, settle_s: float = 0.0) -> str:
        """How the server process ended ("" while it runs). `settle_s`: once the session has failed (its
        pumps are gone), read on for up to that long, since a server that died may not have shown
        its end of stdout yet (a write to it can fail first)."""
        deadline = time.monotonic() + settle_s
        while not self.process.at_eof and time.monotonic() < deadline:
            try:
                self.process.read(0.2)
            except Exception:  # noqa: BLE001 - the sandbox is gone: nothing more to learn
                break
        if not self.process.at_eof:
            return ""
        return f" (it exited with code {self.process.returncode}; stderr: {self.process.stderr_tail[-500:]!r})"

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> mcp_types.CallToolResult:
        """The server's result of one call; MCPError for a JSON-RPC error (unknown tool, bad request)."""
        if self._session is None or self.process.at_eof:
            raise McpServerError(f"the MCP server {self.process.cmd!r} is not running{self.how_it_ended()}")
        call = self._session.call_tool(name, arguments, read_timeout_seconds=timeout_s)
        return self._result(asyncio.run_coroutine_threadsafe(call, self._loop), timeout_s + 10.0, f"calling {name}")

    def close(self) -> None:
        """End the session, kill the server process, stop the loop's thread (idempotent)."""
        if not self._main.done():
            self._loop.call_soon_threadsafe(self._stop.set)
        try:
            self._main.result(10.0)
        except BaseException:
            self._main.cancel()
        try:
            self.process.kill()
        except SandboxError:
            pass  # the sandbox is gone, and the process with it
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
        if not self._loop.is_running():
            self._loop.close()


class McpTool(Tool):
    """A tool of an MCP server: its JSON schema is the declaration and checks the arguments."""

    def __init__(self, spec: mcp_types.Tool, connection: McpConnection, timeout_s: float) -> None:
        self.spec, self.connection, self.timeout_s = spec, connection, timeout_s
        super().__init__(self._call, name=spec.name, description=spec.description or "",
                         args_model=object, is_method=False)  # type: ignore[arg-type]  # the schema stands in
        self._validator = jsonschema.Draft202012Validator(spec.input_schema)

    def _call(self, **arguments: Any) -> ToolResult:
        try:
            result = self.connection.call(self.name, arguments, self.timeout_s)
        except MCPError as exc:
            if self.connection.process.at_eof:  # the server died under the call
                raise McpServerError(f"the MCP server died during {self.name}{self.connection.how_it_ended()}") from exc
            raise ToolError(f"{self.name}: {exc.error.message}") from None
        return tool_result(result)

    @property
    def parameters(self) -> dict[str, Any]:
        return dict(self.spec.input_schema)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments of {self.name} must be an object, got {type(arguments).__name__}")
        problems = [f"{'.'.join(map(str, e.absolute_path)) or '(arguments)'}: {e.message}"
                    for e in self._validator.iter_errors(arguments)]
        if problems:
            raise ToolArgumentError(f"bad arguments for {self.name}: " + "; ".join(problems) + ".")
        return dict(arguments)


def tool_result(result: mcp_types.CallToolResult) -> ToolResult:
    """An MCP tool result as the model sees it: text parts joined, images as PNG, `isError` kept."""
    texts, images = [], []
    for part in result.content:
        if isinstance(part, mcp_types.TextContent):
            texts.append(part.text)
        elif isinstance(part, mcp_types.ImageContent):
            images.append(png_of(base64.b64decode(part.data)))
        elif isinstance(part, mcp_types.EmbeddedResource):
            resource = part.resource
            texts.append(getattr(resource, "text", None) or f"[resource {resource.uri}]")
        elif isinstance(part, mcp_types.ResourceLink):
            texts.append(f"[resource {part.uri}]")
        else:
            texts.append(f"[{part.type} content]")
    if not texts and result.structured_content is not None:
        texts.append(json.dumps(result.structured_content, ensure_ascii=False, sort_keys=True))
    return ToolResult("\n".join(texts), images, error=bool(result.is_error))


def png_of(data: bytes) -> bytes:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return data
    return to_png(Image.open(io.BytesIO(data)))


class McpToolEnv(ToolEnv):
    """A ToolEnv whose tools (besides its own `@tool` methods) come from `mcp_server`, run in its sandbox.

    `reset` opens the episode's sandbox: `setup_sandbox` prepares it for the task, then the
    env writes `mcp_server.files`, starts the server and lists its tools, so `env.tools` after
    `reset` declares them (before the first `reset` it holds only the env's own tools).
    """

    uses_sandbox = True
    mcp_server: McpServer | None = None

    def __init__(self, *, mcp_server: McpServer | None = None, mcp_call_timeout_s: float = 30.0,
                 **kwargs: Any) -> None:
        self.mcp_server = mcp_server or self.mcp_server
        if self.mcp_server is None:
            raise ValueError(f"{type(self).__name__} needs an MCP server: set the class attribute mcp_server "
                             "or pass mcp_server=McpServer(command=...)")
        self.mcp_call_timeout_s = mcp_call_timeout_s
        self._mcp: McpConnection | None = None
        super().__init__(**kwargs)
        self._own_tools = dict(self._tools)

    @property
    def sandbox(self) -> Any:
        first = self._sandbox is None
        sb = super().sandbox
        if first and self._mcp is None:
            try:
                self._connect(sb)
            except BaseException:
                self._release_sandbox()
                raise
        return sb

    def _connect(self, sb: Any) -> None:
        server = self.mcp_server
        for path, data in server.files.items():
            sb.write_file(path, data)
        self._mcp = McpConnection(sb.spawn(server.command, env=dict(server.env)))
        listed = sorted(spec.name for spec in self._mcp.tools)
        if server.tools and listed != sorted(server.tools):
            raise McpServerError(f"the MCP server of {type(self).__name__} lists the tools {listed}, but its McpServer "
                                 f"declares {sorted(server.tools)}; make McpServer.tools match the server")
        tools = dict(self._own_tools)
        for spec in self._mcp.tools:
            if spec.name in tools:
                raise McpServerError(f"the MCP server's tool {spec.name!r} has the name of another tool of "
                                     f"{type(self).__name__}; rename one of them")
            tools[spec.name] = McpTool(spec, self._mcp, self.mcp_call_timeout_s)
        self._tools = tools
        self._tool_schemas = [t.schema() for t in tools.values()]

    def _release_sandbox(self) -> None:
        mcp, self._mcp = self._mcp, None
        if mcp is not None:
            mcp.close()
        super()._release_sandbox()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = super().reset(seed=seed, options=options)
        try:
            _ = self.sandbox  # the server's tools are part of the opening: the prompt declares them
        except BaseException:
            self._end_episode()
            raise
        info["tools"] = self.tools
        return obs, info
