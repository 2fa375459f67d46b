"""A small MCP server over the sandbox's work dir, run INSIDE the sandbox by `k3rl/McpFiles-v0`.

Standard library only (the sandbox image has Python but not the `mcp` SDK and its compiled
dependencies): it speaks MCP's stdio transport itself — JSON-RPC 2.0 messages, one per line,
on stdin/stdout (MCP specification 2025-06-18, "Transports" and "Tools") — and answers
`initialize`, `ping`, `tools/list` and `tools/call`. The host side is the `mcp` SDK's
`ClientSession` (`k3rl.envs.mcp_tools`).

Tools: `list_files(path)` (hidden names left out), `read_file(path)`, `view_image(path)` (a
PNG as image content), all confined to /work. A failing tool answers a result with `isError: true`; an unknown tool
or method is a JSON-RPC error.

    python3 mcp_files_server.py [ROOT]      # ROOT defaults to /work
"""

import base64
import json
import os
import sys

PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
ROOT = os.path.realpath(sys.argv[1] if len(sys.argv) > 1 else "/work")


class ToolFailure(Exception):
    """The tool could not do what was asked: an `isError` result the model reads."""


def inside(path):
    real = os.path.realpath(os.path.join(ROOT, path))
    if real != ROOT and not real.startswith(ROOT + os.sep):
        raise ToolFailure(f"{path!r} is outside the work dir")
    return real


def list_files(path="."):
    real = inside(path)
    if not os.path.isdir(real):
        raise ToolFailure(f"no such directory: {path!r}")
    names = sorted(n + "/" if os.path.isdir(os.path.join(real, n)) else n
                   for n in os.listdir(real) if not n.startswith("."))
    return [{"type": "text", "text": "\n".join(names) or "(empty)"}]


def read_file(path):
    real = inside(path)
    if not os.path.isfile(real):
        raise ToolFailure(f"no such file: {path!r}")
    with open(real, "rb") as f:
        return [{"type": "text", "text": f.read(100_000).decode("utf-8", "replace")}]


def view_image(path):
    real = inside(path)
    if not os.path.isfile(real):
        raise ToolFailure(f"no such file: {path!r}")
    with open(real, "rb") as f:
        data = f.read()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ToolFailure(f"{path!r} is not a PNG image")
    return [{"type": "image", "data": base64.b64encode(data).decode(), "mimeType": "image/png"},
            {"type": "text", "text": f"{path} ({len(data)} bytes)"}]


def path_schema(description, required=True):
    return {"type": "object", "properties": {"path": {"type": "string", "description": description}},
            "required": ["path"] if required else []}


TOOLS = {
    "list_files": (list_files, "List the files and directories (with a trailing /) of a directory.",
                   path_schema("directory relative to the work dir, e.g. '.' or 'notes'", required=False)),
    "read_file": (read_file, "Read a text file.", path_schema("file relative to the work dir")),
    "view_image": (view_image, "Look at a PNG image.", path_schema("PNG file relative to the work dir")),
}


def call_tool(params):
    name, arguments = params.get("name"), params.get("arguments") or {}
    if name not in TOOLS:
        raise LookupError(f"unknown tool {name!r}; tools: {', '.join(TOOLS)}")
    fn, _, schema = TOOLS[name]
    unknown = sorted(set(arguments) - set(schema["properties"]))
    missing = [k for k in schema["required"] if k not in arguments]
    if unknown or missing:
        return {"content": [{"type": "text", "text": f"bad arguments: unknown {unknown}, missing {missing}"}],
                "isError": True}
    try:
        return {"content": fn(**arguments), "isError": False}
    except (ToolFailure, OSError) as exc:
        return {"content": [{"type": "text", "text": str(exc)}], "isError": True}


class UnknownMethod(LookupError):
    """A JSON-RPC method this server does not offer (answered with error -32601)."""


def answer(method, params):
    if method == "initialize":
        asked = params.get("protocolVersion")
        return {"protocolVersion": asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1],
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": "k3rl-files", "version": "1.0"}}
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": [{"name": name, "description": desc, "inputSchema": schema}
                          for name, (_, desc, schema) in TOOLS.items()]}
    if method == "tools/call":
        return call_tool(params)
    raise UnknownMethod(method)


def main():
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except ValueError:
            reply = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "parse error"}}
        else:
            if "id" not in message or "method" not in message:
                continue  # a notification (e.g. notifications/initialized) or a response: nothing to say
            reply = {"jsonrpc": "2.0", "id": message["id"]}
            try:
                reply["result"] = answer(message["method"], message.get("params") or {})
            except UnknownMethod:
                reply["error"] = {"code": -32601, "message": f"method not found: {message['method']}"}
            except LookupError as exc:
                reply["error"] = {"code": -32602, "message": str(exc)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
