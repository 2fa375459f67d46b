"""An OpenAI-compatible chat-completions endpoint over a k3rl engine that records every call's exact tokens.

    endpoint = ChatEndpoint(engine.agenerate, template, model="k3-small")
    server, base_url = serve_in_thread(make_app(endpoint))      # http://127.0.0.1:PORT/v1
    openai.OpenAI(base_url=base_url, api_key="-").chat.completions.create(model="k3-small", messages=[...])

`POST {base_url}/chat/completions` takes OpenAI's request (messages with text and image parts, `tool_calls`
and `tool` results; `tools`, `tool_choice`, `response_format`, `temperature`, `top_p`, `max_tokens` /
`max_completion_tokens`, `stop`, `seed`, `n` = 1, `stream`, `logprobs`) and answers in OpenAI's shape. The
messages render with the K3 template (`k3rl.chat`, exact to the release's encoder); the sampled ids parse
back into content, thinking (`reasoning_content`) and tool calls. Every call is recorded (`endpoint.calls`):
the prompt's ids, the completion's ids, log-probs and policy versions, exactly as the engine sampled them, so
a trainer learns from those tokens, never from a re-tokenisation of the messages.

A request that is malformed gets OpenAI's 400 (`{"error": {"message", "type", "param", "code"}}`) naming the
field; one whose prompt and `max_tokens` pass the context, or that comes after the call budget, gets a 400
whose code says so (`context_length_exceeded`, `call_budget_exhausted`) and marks the endpoint `truncated`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from k3rl.chat import ChatTemplate, ParsedAssistant, ToolCallParseError, order_tool_results
from k3rl.messages import Message, RawToolCall
from k3rl.types import SamplingParams, Trajectory, Turn

Generate = Callable[..., Awaitable[Any]]  # (token_ids, sampling, images=...) -> GenerationResult
# fields an OpenAI client sends back on an assistant message it got, which carry nothing to render
_ECHOED = ("refusal", "annotations", "audio", "function_call")


class EndpointError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat-completions request that k3rl acts on; others are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="the engine returns the sampled token's only")


@dataclass
class RecordedCall:
    """One call as the engine saw it: what a trainer learns from."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    images: list[bytes] = field(default_factory=list)
    parse_error: str | None = None


class ChatEndpoint:
    """Chat completions over `generate` (an engine's `agenerate`, or an inference pool's)."""

    def __init__(self, generate: Generate, template: ChatTemplate, model: str = "k3rl",
                 max_context_tokens: int = 8192, max_calls: int | None = None, default_max_tokens: int = 512):
        self.generate, self.template, self.model = generate, template, model
        self.max_context_tokens, self.max_calls, self.default_max_tokens = (max_context_tokens, max_calls,
                                                                            default_max_tokens)
        self.calls: list[RecordedCall] = []
        self.truncated = False
        self.divergences = 0  # answers sent back whose rendering differs from the sampled ids (which were kept)

    # -- a request -----------------------------------------------------------------------------------
    def parse(self, body: Any) -> ChatRequest:
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            raise EndpointError(f"{err['msg']} ({'.'.join(map(str, err['loc']))})",
                                param=".".join(map(str, err["loc"]))) from None

    def messages(self, req: ChatRequest) -> list[Message]:
        out = []
        for i, raw in enumerate(req.messages):
            data = {k: v for k, v in raw.items() if not (k in _ECHOED and not v)} if isinstance(raw, dict) else raw
            if isinstance(data, dict) and data.get("role") == "assistant" and data.get("content") is None:
                data = {**data, "content": ""}
            try:
                out.append(Message.model_validate(data))
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(map(str, (f"messages.{i}", *[p for p in err["loc"] if p != "__root__"])))
                raise EndpointError(f"{where}: {err['msg']}", param=where) from None
        return out

    def render(self, req: ChatRequest, messages: list[Message]) -> tuple[list[int], list[bytes]]:
        """The prompt's ids and its images in the order their media blocks come."""
        try:
            rendered = self.template.render(messages, req.tools, req.reasoning_effort, tool_choice=req.tool_choice,
                                            response_format=req.response_format)
        except ValueError as e:
            text = str(e)
            param = next((p for p in ("tool_choice", "response_format", "reasoning_effort") if p in text
                          or p.replace("reasoning_", "thinking ") in text), "messages")
            raise EndpointError(text, param=param) from None
        images = [png for m in order_tool_results(list(messages)) for png in m.images]
        return self._splice(rendered.ids), images

    def _splice(self, ids: list[int]) -> list[int]:
        """The recorded ids win: a prompt that goes on from the last call's context with that call's answer
        re-rendered from its text (the harness sent the message back) gets the sampled ids in its place.

            ids = last.prompt_ids + body + rest,  body = up to the first [end_of_msg] after the prompt
              ->  last.prompt_ids + last.completion_ids + rest       (divergences += 1 when body differs)

        Only a complete answer (ended by its stop token) is spliced; anything else is left as rendered, and
        the trajectory gets a new segment there (`trajectory_from_calls`)."""
        last = self.calls[-1] if self.calls else None
        eom = self.template.stop_token_id
        if last is None or last.finish_reason != "stop" or not last.completion_ids or last.completion_ids[-1] != eom:
            return ids
        base = last.prompt_ids
        if ids[: len(base)] != base or eom not in ids[len(base):]:
            return ids
        end = ids.index(eom, len(base)) + 1
        if ids[len(base):end] != last.completion_ids:
            self.divergences += 1
        return base + last.completion_ids + ids[end:]

    def sampling(self, req: ChatRequest, prompt_len: int) -> SamplingParams:
        room = self.max_context_tokens - prompt_len
        asked = req.max_completion_tokens or req.max_tokens
        if room <= 0 or (asked is not None and asked > room):
            self.truncated = True
            raise EndpointError(
                f"the prompt is {prompt_len} tokens and asks for {asked or 'at least 1'} more; the context holds "
                f"{self.max_context_tokens}: shorten the conversation (compact it) or ask for fewer tokens",
                param="messages", code="context_length_exceeded")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingParams(temperature=req.temperature, top_p=req.top_p,
                              max_tokens=asked or min(self.default_max_tokens, room),
                              stop_token_ids=[self.template.stop_token_id], stop_strings=stops, seed=req.seed)

    async def complete(self, body: Any) -> tuple[ChatRequest, dict[str, Any]]:
        """(the request, OpenAI's chat.completion object) for a request body."""
        req = self.parse(body)
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.truncated = True
            raise EndpointError(f"this episode's budget of {self.max_calls} model calls is spent", param=None,
                                code="call_budget_exhausted")
        messages = self.messages(req)
        ids, images = self.render(req, messages)
        params = self.sampling(req, len(ids))
        result = await self.generate(ids, params, images=images or None)
        out = list(result.token_ids)
        parsed, error = self._parse(out, result.finish_reason)
        self.calls.append(RecordedCall(list(ids), out, list(result.logprobs), list(result.versions),
                                       result.finish_reason, images, error))
        return req, self._response(req, ids, out, list(result.logprobs), parsed, result.finish_reason)

    # -- the answer ----------------------------------------------------------------------------------
    def _parse(self, ids: list[int], finish: str) -> tuple[ParsedAssistant, str | None]:
        """The message the ids spell; what cannot be parsed (cut by `length` or a stop string, or a malformed
        tool call) comes back as its text, with no tool calls."""
        try:
            return self.template.parse_assistant(ids), None
        except (ToolCallParseError, ValueError) as e:
            tok = self.template.tok
            text = tok.decode([i for i in ids if not tok.is_special(i)])
            return ParsedAssistant(content=text, tool_calls=[]), f"{finish}: {e}"

    def _response(self, req: ChatRequest, prompt: list[int], out: list[int], logprobs: list[float],
                  parsed: ParsedAssistant, finish: str) -> dict[str, Any]:
        calls = [{"id": c.id or f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                  "function": {"name": c.name, "arguments": c.raw_arguments if isinstance(c, RawToolCall)
                               else json.dumps(c.arguments, ensure_ascii=False)}}
                 for c in parsed.tool_calls]
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if parsed.thinking:
            message["reasoning_content"] = parsed.thinking
        tok = self.template.tok
        lps = None
        if req.logprobs:
            lps = {"content": [{"token": tok.decode([i]), "logprob": lp, "bytes": list(tok.decode([i]).encode()),
                                "top_logprobs": []} for i, lp in zip(out, logprobs, strict=True)]}
        reason = "tool_calls" if calls else "length" if finish == "length" else "stop"
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": req.model or self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": lps}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                          "total_tokens": len(prompt) + len(out)}}


def stream_chunks(req: ChatRequest, response: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole completion as OpenAI's chat.completion.chunk objects: the role and text, each tool call, the
    finish reason (and the usage, when `stream_options.include_usage` asks)."""
    choice, head = response["choices"][0], {k: response[k] for k in ("id", "created", "model")}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra) -> dict[str, Any]:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    msg = choice["message"]
    first = {"role": "assistant", "content": msg["content"] or ""}
    if "reasoning_content" in msg:
        first["reasoning_content"] = msg["reasoning_content"]
    chunks = [chunk(first, logprobs=choice["logprobs"])]
    for i, call in enumerate(msg.get("tool_calls", [])):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if (req.stream_options or {}).get("include_usage"):
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": response["usage"]})
    return chunks


def make_app(endpoint: ChatEndpoint | None = None, routes: dict[str, ChatEndpoint] | None = None):
    """A FastAPI app: POST /v1/chat/completions and GET /v1/models for one endpoint; with `routes`, each
    episode's endpoint under /episodes/<id>/v1 (an episode gone from `routes` answers 404)."""
    app = FastAPI(title="k3rl chat completions")

    @app.exception_handler(EndpointError)
    async def _refused(_request, exc: EndpointError):
        return JSONResponse(exc.body(), status_code=exc.status)

    def find(episode: str | None) -> ChatEndpoint:
        found = endpoint if episode is None else (routes or {}).get(episode)
        if found is None:
            raise EndpointError(f"no episode {episode!r} here (it ended, or never began)", code="episode_not_found",
                                status=404)
        return found

    async def models(episode: str | None = None):
        return {"object": "list", "data": [{"id": find(episode).model, "object": "model", "owned_by": "k3rl"}]}

    async def completions(request: Request, episode: str | None = None):
        target = find(episode)
        try:
            body = await request.json()
        except ValueError:
            raise EndpointError("the body is not JSON", param=None) from None
        req, response = await target.complete(body)
        if not req.stream:
            return response

        def events():
            for c in stream_chunks(req, response):
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    prefix = "/episodes/{episode}/v1" if routes is not None else "/v1"
    app.add_api_route(f"{prefix}/models", models, methods=["GET"])
    app.add_api_route(f"{prefix}/chat/completions", completions, methods=["POST"])
    return app


class EpisodeServer:
    """One server per process for every episode's endpoint: `add(id, endpoint)` gives the episode's base URL."""

    _lock = threading.Lock()
    _instance: EpisodeServer | None = None

    def __init__(self) -> None:
        self.routes: dict[str, ChatEndpoint] = {}
        self.server, base = serve_in_thread(make_app(routes=self.routes))
        self.root = base.removesuffix("/v1")

    @classmethod
    def get(cls) -> EpisodeServer:
        with cls._lock:
            if cls._instance is None or cls._instance.server.should_exit:
                cls._instance = cls()
            return cls._instance

    def add(self, episode_id: str, endpoint: ChatEndpoint) -> str:
        if episode_id in self.routes:
            raise ValueError(f"episode {episode_id!r} already has an endpoint")
        self.routes[episode_id] = endpoint
        return f"{self.root}/episodes/{episode_id}/v1"

    def remove(self, episode_id: str) -> None:
        self.routes.pop(episode_id, None)


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, ready_s: float = 30.0):
    """(uvicorn server, base URL ending in /v1): `app` served by a thread of this process; `server.should_exit
    = True` stops it. Port 0 takes a free one."""
    import uvicorn  # noqa: PLC0415  (only a served endpoint needs the web stack)

    from k3rl.cluster import free_port  # noqa: PLC0415  (the cluster module pulls in Ray)

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name="k3rl-openai", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the chat endpoint did not start on {host}:{port}")
        time.sleep(0.02)
    return server, f"http://{host}:{port}/v1"


def trajectory_from_calls(calls: list[RecordedCall], env_id: str, **fields: Any) -> Trajectory:
    """One episode's calls as a token-exact trajectory. A call whose prompt goes on from the previous call's
    prompt + answer continues its segment (the tokens in between, tool results and the next generation
    prefix, are not trained); any other call (the harness compacted or rewrote its history, a sub-agent)
    starts a new segment, trained on its own tokens, as `rollout.context` segments are. Only sampled ids
    carry loss, each with its recorded log-prob and policy version."""
    if not calls:
        raise ValueError("an episode with no model calls has nothing to train on")
    first = calls[0]
    traj = Trajectory(env_id=env_id, prompt_ids=list(first.prompt_ids),
                      turns=[Turn(role="user", images=list(first.images), start=0, end=len(first.prompt_ids))],
                      **fields)
    context: list[int] = []
    seen_images = 0
    for k, call in enumerate(calls):
        if k == 0:
            seen_images = len(call.images)
        elif call.prompt_ids[: len(context)] == context:  # goes on: what was added since, untrained
            start, end = traj.append(call.prompt_ids[len(context):], generated=False)
            traj.turns.append(Turn(role="tool", images=list(call.images[seen_images:]), start=start, end=end,
                                   segment=len(traj.segment_starts)))
            seen_images = len(call.images)
        else:  # a rewritten history: a segment of its own
            traj.segment_starts.append(len(traj.token_ids))
            start, end = traj.append(list(call.prompt_ids), generated=False)
            traj.turns.append(Turn(role="user", images=list(call.images), start=start, end=end,
                                   segment=len(traj.segment_starts)))
            seen_images = len(call.images)
        start = len(traj.token_ids)
        i = 0
        while i < len(call.completion_ids):  # a run of tokens sampled under one policy version
            j = i
            while j < len(call.completion_ids) and call.versions[j] == call.versions[i]:
                j += 1
            traj.append(call.completion_ids[i:j], generated=True, logprobs=call.logprobs[i:j],
                        version=call.versions[i])
            i = j
        traj.turns.append(Turn(role="assistant", start=start, end=len(traj.token_ids),
                               segment=len(traj.segment_starts)))
        context = list(call.prompt_ids) + list(call.completion_ids)
    traj.metadata["model_calls"] = len(calls)
    return traj
