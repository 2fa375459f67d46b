"""The K3 chat template (XML-like markup, docs/model.md §9.7), rendered straight to token ids.

An element is `[open]tag attr="v"[sep] body [close]tag[sep]` where [open], [sep] and
[close] are the structural special tokens `<|open|>`, `<|sep|>`, `<|close|>`. A message:

    [open]message role="R"[sep] ... [close]message[sep][end_of_msg]

Context order: tool declaration, reasoning effort, the input messages, then the
generation prefix `[open]message role="assistant"[sep]` + `[open]response[sep]` (instruct)
or `[open]think[sep]` (thinking).

Guarantees (tested):
  * Token in, token out: each message renders on its own, so appending message n+1 never
    changes the tokens of messages 1..n (`ChatSession` appends, `render` == concatenation).
  * Untrusted text (user, tool, argument values) is encoded with `tokenizer.encode`, which
    never yields a structural token, so markup inside content cannot inject structure.
  * The loss mask covers exactly the assistant-generated tokens: everything after the
    generation prefix up to and including `[close]message[sep][end_of_msg]`.
  * `parse_assistant(render(calls))` gives the calls back; malformed output raises
    `ToolCallParseError` with a message precise enough to show the model.

Images (user messages, and, as a k3rl extension, tool results) are media blocks
`<|media_begin|>image WxH<|media_content|><|media_pad|>*N<|media_end|>` placed before the
text, N = the tokens the vision tower makes of the image (k3rl.images.num_image_tokens).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from k3rl.images import num_image_tokens, png_size
from k3rl.tokenizer import ByteTokenizer, Tokenizer
from k3rl.types import ToolCall

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
)
EFFORT_LEVELS = ("low", "medium", "high", "max")
ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")


class ToolCallParseError(ValueError):
    """Generated tokens that do not form a valid assistant message; the text is meant for the model."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[bytes] = Field(default_factory=list)
    thinking: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    name: str | None = None
    tool_name: str | None = Field(None, description="tool messages: the tool that produced this result")
    tool_index: int | None = Field(None, ge=1, description="tool messages: 1-based index of the call it answers")
    tools: list[dict[str, Any]] | None = Field(None, description="system messages: extend the toolset mid-session")

    @field_validator("images", mode="before")
    @classmethod
    def _png(cls, v):
        from k3rl.types import _check_png, _unb64

        return [_check_png(_unb64(x)) for x in (v or [])]


@dataclass
class Rendered:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    def add(self, ids: list[int], trained: bool = False) -> Rendered:
        self.ids.extend(ids)
        self.mask.extend([1 if trained else 0] * len(ids))
        return self

    def __add__(self, other: Rendered) -> Rendered:
        return Rendered(self.ids + other.ids, self.mask + other.mask)

    def __len__(self) -> int:
        return len(self.ids)


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _arg_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise TypeError(f"tool-call argument of type {type(value).__name__} cannot be rendered; use JSON types")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer | None = None, thinking: bool = False,
                 image_tokens: Callable[[int, int], int] = num_image_tokens) -> None:
        self.tok = tokenizer or ByteTokenizer()
        self.thinking = thinking
        self.image_tokens = image_tokens
        self._s = {n: self.tok.special(n) for n in (OPEN, CLOSE, SEP, EOM, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END)}

    # -- pieces ------------------------------------------------------------------------
    def _open(self, tag: str, **attrs: Any) -> list[int]:
        header = tag + "".join(f' {k}="{_escape(str(v))}"' for k, v in attrs.items() if v is not None)
        return [self._s[OPEN], *self.tok.encode(header), self._s[SEP]]

    def _close(self, tag: str) -> list[int]:
        return [self._s[CLOSE], *self.tok.encode(tag), self._s[SEP]]

    def _element(self, tag: str, body: list[int], **attrs: Any) -> list[int]:
        return self._open(tag, **attrs) + body + self._close(tag)

    def _media(self, png: bytes) -> list[int]:
        w, h = png_size(png)
        n = self.image_tokens(w, h)
        return [self._s[MEDIA_BEGIN], *self.tok.encode(f"image {w}x{h}"), self._s[MEDIA_CONTENT],
                *([self._s[MEDIA_PAD]] * n), self._s[MEDIA_END]]

    def _message(self, body: list[int], **attrs: Any) -> list[int]:
        return self._open("message", **attrs) + body + self._close("message") + [self._s[EOM]]

    @property
    def end_of_message(self) -> list[int]:
        return self._close("message") + [self._s[EOM]]

    @property
    def stop_token_id(self) -> int:
        return self._s[EOM]

    def tool_declaration(self, tools: list[dict[str, Any]]) -> Rendered:
        body = "# Tools\n\n```json\n" + _compact(tools) + "\n```"
        return Rendered().add(self._message(self.tok.encode(body), role="system", type="tool-declare"))

    def effort(self, level: str) -> Rendered:
        if level not in EFFORT_LEVELS:
            raise ValueError(f"reasoning effort {level!r} is not one of {EFFORT_LEVELS}")
        body = f"Reasoning effort: {level}."
        return Rendered().add(self._message(self.tok.encode(body), role="system", type="thinking-effort"))

    def generation_prefix(self) -> list[int]:
        return self._open("message", role="assistant") + self._open("think" if self.thinking else "response")

    def assistant_body(self, content: str, tool_calls: list[ToolCall], thinking: str | None) -> list[int]:
        """The tokens an assistant produces after the generation prefix, [end_of_msg] included."""
        ids: list[int] = []
        if self.thinking:
            ids += self.tok.encode(thinking or "") + self._close("think") + self._open("response")
        ids += self.tok.encode(content) + self._close("response")
        if tool_calls:
            ids += self._open("tools")
            for i, call in enumerate(tool_calls, start=1):
                args: list[int] = []
                for key, value in call.arguments.items():
                    t = _arg_type(value)
                    text = value if t == "string" else _compact(value)
                    args += self._element("argument", self.tok.encode(text), key=key, type=t)
                ids += self._element("call", args, tool=call.name, index=call.index or i)
            ids += self._close("tools")
        return ids + self.end_of_message

    def message(self, msg: Message) -> Rendered:
        """One input message. Assistant messages carry a loss mask over their generated part."""
        if msg.role == "assistant":
            prefix = self.generation_prefix()
            return Rendered().add(prefix).add(self.assistant_body(msg.content, msg.tool_calls, msg.thinking), trained=True)
        out = Rendered()
        if msg.role == "system" and msg.tools:
            out.add(self.tool_declaration(msg.tools).ids)  # dynamic tool declaration mid-session
            if not msg.content:
                return out
        body: list[int] = []
        for png in msg.images:
            body += self._media(png)
        body += self.tok.encode(msg.content)
        if msg.role == "tool":
            if not msg.tool_name or msg.tool_index is None:
                raise ValueError("a tool message needs tool_name and tool_index (the 1-based call it answers)")
            return out.add(self._message(body, role="tool", tool=msg.tool_name, index=msg.tool_index))
        return out.add(self._message(body, role=msg.role, name=msg.name))

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None = None, effort: str | None = None,
               add_generation_prompt: bool = True) -> Rendered:
        session = self.session(tools=tools, effort=effort)
        for m in messages:
            session.add(m)
        if add_generation_prompt:
            session.add_generation_prompt()
        return session.rendered

    def session(self, tools: list[dict[str, Any]] | None = None, effort: str | None = None) -> ChatSession:
        return ChatSession(self, tools, effort)

    # -- parsing -----------------------------------------------------------------------
    def parse_assistant(self, ids: list[int]) -> ParsedAssistant:
        """Parse tokens generated after the generation prefix into thinking, text and tool calls."""
        return _Parser(self, ids).assistant()


@dataclass
class ParsedAssistant:
    content: str
    tool_calls: list[ToolCall]
    thinking: str | None = None

    def to_message(self) -> Message:
        return Message(role="assistant", content=self.content, tool_calls=self.tool_calls, thinking=self.thinking)


class ChatSession:
    """Incremental rendering: every `add` appends tokens and never touches earlier ones."""

    def __init__(self, template: ChatTemplate, tools: list[dict[str, Any]] | None, effort: str | None) -> None:
        self.t = template
        self.rendered = Rendered()
        self._tool_results_since_assistant = 0
        if tools:
            self.rendered += template.tool_declaration(tools)
        if effort:
            self.rendered += template.effort(effort)

    def add(self, msg: Message) -> Rendered:
        if msg.role == "tool":
            self._tool_results_since_assistant += 1
            if msg.tool_index is None:
                msg = msg.model_copy(update={"tool_index": self._tool_results_since_assistant})
        elif msg.role == "assistant":
            self._tool_results_since_assistant = 0
        piece = self.t.message(msg)
        self.rendered += piece
        return piece

    def add_generation_prompt(self) -> Rendered:
        piece = Rendered().add(self.t.generation_prefix())
        self.rendered += piece
        self._tool_results_since_assistant = 0
        return piece

    def add_generated(self, ids: list[int]) -> Rendered:
        """Append tokens the model sampled (after `add_generation_prompt`), exactly as sampled."""
        piece = Rendered().add(list(ids), trained=True)
        self.rendered += piece
        return piece


_HEADER = re.compile(r'^([A-Za-z_][\w-]*)((?:\s+[\w-]+="[^"]*")*)\s*$')
_ATTR = re.compile(r'([\w-]+)="([^"]*)"')


class _Parser:
    """Recursive descent over the token stream: specials are structure, runs of others are text."""

    def __init__(self, template: ChatTemplate, ids: list[int]) -> None:
        self.t = template
        self.ids = list(ids)
        self.pos = 0
        s = template._s
        self.OPEN, self.CLOSE, self.SEP, self.EOM = s[OPEN], s[CLOSE], s[SEP], s[EOM]

    def _fail(self, what: str) -> ToolCallParseError:
        return ToolCallParseError(f"malformed assistant message at token {self.pos}: {what}")

    def _text(self) -> str:
        start = self.pos
        while self.pos < len(self.ids) and not self.t.tok.is_special(self.ids[self.pos]):
            self.pos += 1
        return self._decode(self.ids[start:self.pos])

    def _decode(self, ids: list[int]) -> str:
        tok = self.t.tok
        if hasattr(tok, "decode_bytes"):
            try:
                return tok.decode_bytes(ids).decode("utf-8")
            except UnicodeDecodeError as e:
                raise self._fail(f"text is not valid UTF-8 ({e.reason})") from None
        return tok.decode(ids)

    def _peek(self) -> int | None:
        return self.ids[self.pos] if self.pos < len(self.ids) else None

    def _expect(self, token: int, what: str) -> None:
        got = self._peek()
        if got != token:
            found = "the end of the output" if got is None else (
                self.t.tok.special_name(got) or f"text {self._decode(self.ids[self.pos:self.pos + 20])!r}")
            raise self._fail(f"expected {what}, found {found}")
        self.pos += 1

    def _open_tag(self, expected: str | None = None) -> tuple[str, dict[str, str]]:
        self._expect(self.OPEN, f"<|open|>{expected or ''}")
        header = self._text()
        self._expect(self.SEP, f"<|sep|> after '{header}'")
        m = _HEADER.match(header)
        if not m:
            raise self._fail(f"bad element header {header!r}; expected tag name then key=\"value\" attributes")
        tag, attrs = m.group(1), {k: _unescape(v) for k, v in _ATTR.findall(m.group(2))}
        if expected and tag != expected:
            raise self._fail(f"expected element '{expected}', found '{tag}'")
        return tag, attrs

    def _close_tag(self, tag: str) -> None:
        self._expect(self.CLOSE, f"<|close|>{tag}")
        name = self._text().strip()
        if name != tag:
            raise self._fail(f"element '{tag}' closed as '{name}'")
        self._expect(self.SEP, f"<|sep|> after <|close|>{tag}")

    def _at_open(self, tag: str) -> bool:
        if self._peek() != self.OPEN:
            return False
        save = self.pos
        self.pos += 1
        header = self._text()
        self.pos = save
        return header.split(" ", 1)[0] == tag

    def assistant(self) -> ParsedAssistant:
        thinking = None
        if self.t.thinking:
            thinking = self._text()
            self._close_tag("think")
            self._open_tag("response")
        content = self._text()
        self._close_tag("response")
        calls: list[ToolCall] = []
        if self._at_open("tools"):
            self._open_tag("tools")
            while self._at_open("call"):
                calls.append(self._call(len(calls) + 1))
            if not calls:
                raise self._fail("the tools channel holds no <|open|>call")
            self._close_tag("tools")
        self._close_tag("message")
        self._expect(self.EOM, "<|end_of_msg|>")
        if self.pos != len(self.ids):
            raise self._fail(f"{len(self.ids) - self.pos} tokens after <|end_of_msg|>")
        return ParsedAssistant(content=content, tool_calls=calls, thinking=thinking)

    def _call(self, position: int) -> ToolCall:
        _, attrs = self._open_tag("call")
        name = attrs.get("tool")
        if not name:
            raise self._fail(f'tool call {position} has no tool="NAME" attribute')
        try:
            index = int(attrs.get("index", position))
        except ValueError:
            raise self._fail(f"tool call {position} ({name}): index {attrs['index']!r} is not an integer") from None
        args: dict[str, Any] = {}
        while self._at_open("argument"):
            _, a = self._open_tag("argument")
            key, typ = a.get("key"), a.get("type", "string")
            if not key:
                raise self._fail(f'tool call {position} ({name}): an argument has no key="..." attribute')
            if key in args:
                raise self._fail(f"tool call {position} ({name}): argument {key!r} given twice")
            raw = self._text()
            self._close_tag("argument")
            args[key] = self._value(raw, typ, f"tool call {position} ({name}), argument {key!r}")
        if self._at_open("json"):
            _, a = self._open_tag("json")
            raw = self._text()
            self._close_tag("json")
            obj = self._value(raw, "object", f"tool call {position} ({name}), json arguments")
            args.update(obj)
        self._close_tag("call")
        return ToolCall(name=name, arguments=args, index=index)

    def _value(self, raw: str, typ: str, where: str) -> Any:
        if typ == "string":
            return raw
        if typ not in ARG_TYPES:
            raise self._fail(f"{where}: unknown type {typ!r}; use one of {', '.join(ARG_TYPES)}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise self._fail(f"{where}: type={typ} but {raw[:80]!r} is not valid JSON ({e.msg})") from None
        ok = {
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "boolean": isinstance(value, bool),
            "null": value is None,
            "object": isinstance(value, dict),
            "array": isinstance(value, list),
        }[typ]
        if not ok:
            raise self._fail(f"{where}: type={typ} but the value {raw[:80]!r} is a {type(value).__name__}")
        return value
