"""The K3 chat template, exact to the encoder shipped with the checkpoint, rendered to token ids.

The format (docs/model.md §9.7; K3 report, appendix "chat template") is XML-like markup whose
brackets are special tokens. An element is

    [open]tag key="value"[sep] body [close]tag[sep]

and a message is `[open]message role="R"[ name="N"][sep] ... [close]message[sep][end_of_msg]`.
A prompt is, in order: the tool declaration, the thinking effort (thinking mode only), the
messages, the per-request options (`tool_choice`, `response_format`), then the generation
prefix `[open]message role="assistant"[sep]` + `[open]think[sep]` (thinking) or
`[open]response[sep]` (instruct).

Pieces. The official encoder cuts a prompt into pieces and tokenizes each piece on its own:
a special token, a tag name, and for each attribute ` key`, `="`, the escaped value and `"`,
then each body text. `render_pieces` returns exactly those pieces (`Special` for a special
token, `str` for text); `render` encodes each text piece with `tokenizer.encode`, which never
yields a special token, so markup inside content stays text. With a BPE tokenizer, encoding
`message role="user"` in one go would give other ids than the model was trained on.

Guarantees (tested):
  * Token in, token out: `ChatSession.add` appends a message's tokens and never changes earlier
    ones, and `render` equals the session that adds the same messages.
  * The loss mask covers exactly the assistant-generated tokens: everything after the
    generation prefix up to and including `[close]message[sep][end_of_msg]`.
  * `generation_prefix()` + sampled ids == the rendering of the parsed message, whenever the
    sampled ids are the canonical tokens of their text (the renderer drops whitespace-only
    thinking, as the official encoder does).
  * `parse_assistant(assistant_body(...))` gives the message back; malformed output raises
    `ToolCallParseError` with a message precise enough to show the model.

Images are media blocks `[media_begin]image WxH[media_content][media_pad]*N[media_end]` (W x H
the original size, N the vision tower's token count; the official encoder writes one pad and
its processor expands it) placed where the content has an image: at each
`<|kimi_image_placeholder|>` of the text, at each image part of OpenAI content parts, or, with
no placeholder, before the text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3rl.images import num_image_tokens, png_size
from k3rl.messages import IMAGE_PLACEHOLDER, Message, RawToolCall, tool_call  # noqa: F401  (users import them from here)
from k3rl.tokenizer import ByteTokenizer, Tokenizer
from k3rl.types import ToolCall

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
)
# The encoder accepts these three; its own prompt text also lists `medium`, which it rejects.
EFFORT_LEVELS = ("low", "high", "max")
ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")

# The option texts of the official encoder, word for word.
TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
NEW_TOOLS_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)
EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
JSON_OBJECT_TEXT = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
JSON_SCHEMA_TEXT = ("The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON +
                    "\nThe JSON data must match the following schema:\n```json\n{}\n```")


class ToolCallParseError(ValueError):
    """Generated tokens that do not form a valid assistant message; the text is meant for the model."""


# -- pieces ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Special:
    """A special token in a piece list; every other piece is text, encoded on its own."""

    name: str

    def __repr__(self) -> str:
        return self.name


Piece = str | Special
_OPEN, _CLOSE, _SEP, _EOM = Special(OPEN), Special(CLOSE), Special(SEP), Special(EOM)


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _open(tag: str, *attrs: tuple[str, Any]) -> list[Piece]:
    pieces: list[Piece] = [_OPEN, tag]
    for key, value in attrs:
        pieces += [f" {key}", '="', _escape(str(value)), '"']
    return pieces + [_SEP]


def _close(tag: str) -> list[Piece]:
    return [_CLOSE, tag, _SEP]


def _message(attrs: list[tuple[str, Any]], body: list[Piece]) -> list[Piece]:
    return _open("message", *attrs) + body + _close("message") + [_EOM]


def _system(kind: str, body: str) -> list[Piece]:
    return _message([("role", "system"), ("type", kind)], [body.strip()])


def _json_sorted(value: Any) -> str:
    """Compact JSON with keys deep-sorted and non-ASCII kept (tool declarations, schemas)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


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


def _schema(response_format: dict[str, Any]) -> Any:
    js = response_format.get("json_schema")
    if isinstance(js, dict):
        js = js.get("schema", js.get("json_schema", js))
    if js is None:
        raise ValueError("response_format json_schema needs a schema: "
                         "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
    return js


def order_tool_results(messages: list[Message]) -> list[Message]:
    """Each run of tool results that all name, by `tool_call_id`, calls of the assistant message
    before them, re-sorted into call order (as the official encoder does). A run not wholly matched
    stays as given, its ids ignored."""
    out: list[Message] = []
    positions: dict[str, int] = {}
    i = 0
    while i < len(messages):
        if messages[i].role != "tool":
            if messages[i].role == "assistant":
                positions = {}
                for p, call in enumerate(messages[i].tool_calls, start=1):
                    positions.setdefault(call.id, p)
            out.append(messages[i])
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].role == "tool":
            j += 1
        run = messages[i:j]
        if all(m.tool_call_id in positions for m in run):
            run = sorted(run, key=lambda m: positions[m.tool_call_id])
        else:
            run = [m.model_copy(update={"tool_call_id": None}) if m.tool_call_id else m for m in run]
        out += run
        i = j
    return out


@dataclass
class _Turn:
    """What rendering a message needs from before it: the last assistant message's calls and the
    tool results since (a tool result's index counts them)."""

    calls: list[ToolCall] = field(default_factory=list)
    results: int = 0


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

    def __iadd__(self, other: Rendered) -> Rendered:
        self.ids.extend(other.ids)
        self.mask.extend(other.mask)
        return self

    def __len__(self) -> int:
        return len(self.ids)


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer | None = None, thinking: bool = False,
                 image_tokens: Callable[[int, int], int] = num_image_tokens) -> None:
        self.tok = tokenizer or ByteTokenizer()
        self.thinking = thinking
        self.image_tokens = image_tokens
        self._s = {n: self.tok.special(n) for n in (OPEN, CLOSE, SEP, EOM)}  # the media tokens: when needed

    def encode(self, pieces: list[Piece]) -> list[int]:
        """Token ids of pieces: each special by id, each text piece encoded on its own."""
        ids: list[int] = []
        for p in pieces:
            if isinstance(p, Special):
                ids.append(self._s[p.name] if p.name in self._s else self.tok.special(p.name))
            elif p:
                ids.extend(self.tok.encode(p))
        return ids

    @property
    def stop_token_id(self) -> int:
        return self._s[EOM]

    @property
    def end_of_message(self) -> list[int]:
        return self.encode(_close("message") + [_EOM])

    # -- the pieces of each part of a prompt -------------------------------------------------------
    def _media(self, png: bytes) -> list[Piece]:
        w, h = png_size(png)
        return [Special(MEDIA_BEGIN), f"image {w}x{h}", Special(MEDIA_CONTENT),
                *[Special(MEDIA_PAD)] * self.image_tokens(w, h), Special(MEDIA_END)]

    def _content(self, msg: Message) -> list[Piece]:
        images = iter(msg.images)
        return [p for part in msg.content_parts() for p in ([part] if part is not None else self._media(next(images)))]

    def _tool_declaration(self, tools: list[dict[str, Any]], dynamic: bool = False) -> list[Piece]:
        header = NEW_TOOLS_HEADER if dynamic else TOOLS_HEADER
        return _message([("role", "system"), ("type", "tool-declare")],
                        [header + "```json\n" + _json_sorted(tools) + "\n```"])

    def _preamble(self, tools: list[dict[str, Any]] | None, effort: str | None) -> list[Piece]:
        if effort is not None and effort not in EFFORT_LEVELS:
            hint = (" (the official encoder rejects it, although its prompt text lists it)" if effort == "medium"
                    else "")
            raise ValueError(f"thinking effort {effort!r} is not one of {', '.join(EFFORT_LEVELS)}{hint}")
        pieces = self._tool_declaration(tools) if tools else []
        if effort and self.thinking:  # the encoder writes no effort in instruct mode
            pieces += _system("thinking-effort", EFFORT_TEXT.format(effort))
        return pieces

    def _request_options(self, tool_choice: str | None, response_format: str | dict[str, Any] | None) -> list[Piece]:
        pieces: list[Piece] = []
        if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_TEXT:
            pieces += _system("tool-choice", TOOL_CHOICE_TEXT[tool_choice])
        elif tool_choice not in (None, "auto"):
            raise ValueError(f"tool_choice {tool_choice!r}: the K3 format renders 'required' and 'none' ('auto' and "
                             "None add nothing); it has no way to force one named function")
        kind = response_format.get("type") if isinstance(response_format, dict) else response_format
        if kind == "json_object":
            pieces += _system("response-format", JSON_OBJECT_TEXT)
        elif kind == "json_schema":
            if not isinstance(response_format, dict):
                _schema({})  # raises: a schema is needed
            pieces += _system("response-format", JSON_SCHEMA_TEXT.format(_json_sorted(_schema(response_format))))
        elif kind not in (None, "text"):
            raise ValueError(f"response_format type {kind!r}: the K3 format renders json_object and json_schema "
                             "('text' and None add nothing)")
        return pieces

    def _generation_prefix(self) -> list[Piece]:
        return _open("message", ("role", "assistant")) + _open("think" if self.thinking else "response")

    def _assistant_body(self, content: str, tool_calls: list[ToolCall], thinking: str | None) -> list[Piece]:
        """The pieces after the generation prefix (which opens the think or the response channel)."""
        pieces: list[Piece] = []
        if self.thinking:  # always present in thinking mode; whitespace-only thinking is dropped
            pieces += ([thinking] if thinking and thinking.strip() else []) + _close("think") + _open("response")
        pieces += [content] + _close("response")
        if tool_calls:
            pieces += _open("tools")
            for i, call in enumerate(tool_calls, start=1):
                pieces += _open("call", ("tool", call.name), ("index", i))
                if isinstance(call, RawToolCall):
                    pieces += _open("json", ("type", "object")) + [call.raw_arguments] + _close("json")
                for key, value in call.arguments.items():
                    kind = _arg_type(value)
                    text = value if kind == "string" else json.dumps(value, ensure_ascii=False)
                    pieces += _open("argument", ("key", key), ("type", kind)) + [text] + _close("argument")
                pieces += _close("call")
            pieces += _close("tools")
        return pieces + _close("message") + [_EOM]

    def _message(self, msg: Message, turn: _Turn) -> tuple[list[Piece], list[Piece]]:
        """(untrained, trained) pieces of one message; updates `turn`."""
        named = [("name", msg.name)] if msg.name else []
        if msg.role == "assistant":
            turn.calls, turn.results = list(msg.tool_calls), 0
            return (_open("message", ("role", "assistant"), *named) + _open("think" if self.thinking else "response"),
                    self._assistant_body(msg.content, msg.tool_calls, msg.thinking))
        if msg.role == "system" and msg.tools:
            return self._tool_declaration(msg.tools, dynamic=True), []
        if msg.role != "tool":
            return _message([("role", msg.role), *named], self._content(msg)), []
        turn.results += 1
        name = msg.tool_name or msg.name
        if msg.tool_call_id is not None:
            matched = [p for p, c in enumerate(turn.calls, start=1) if c.id == msg.tool_call_id]
            if matched and matched[0] != turn.results:
                raise ValueError(f"the result of call {matched[0]} ({msg.tool_call_id}) comes as tool result "
                                 f"{turn.results}: add results in call order (render() re-sorts whole histories)")
            if matched:
                name = turn.calls[matched[0] - 1].name
        if not name and turn.results <= len(turn.calls):
            name = turn.calls[turn.results - 1].name
        if not name:
            raise ValueError(f"tool result {turn.results} has no tool name: set tool_name, or add it after the "
                             "assistant message whose call it answers")
        if msg.tool_index is not None and msg.tool_index != turn.results:
            raise ValueError(f"a tool message says tool_index={msg.tool_index} but is result {turn.results} since "
                             "the last assistant message: results are numbered by position, in call order")
        return _message([("role", "tool"), ("tool", name), ("index", turn.results)], self._content(msg)), []

    # -- public rendering --------------------------------------------------------------------------
    def render_pieces(self, messages: list[Message], tools: list[dict[str, Any]] | None = None,
                      effort: str | None = None, *, tool_choice: str | None = None,
                      response_format: str | dict[str, Any] | None = None,
                      add_generation_prompt: bool = True) -> list[Piece]:
        """The pieces of a prompt, exactly as the official encoder cuts them (empty texts left out)."""
        turn, pieces = _Turn(), self._preamble(tools, effort)
        for msg in order_tool_results(list(messages)):
            untrained, trained = self._message(msg, turn)
            pieces += untrained + trained
        pieces += self._request_options(tool_choice, response_format)
        if add_generation_prompt:
            pieces += self._generation_prefix()
        return [p for p in pieces if p != ""]

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None = None, effort: str | None = None,
               *, tool_choice: str | None = None, response_format: str | dict[str, Any] | None = None,
               add_generation_prompt: bool = True) -> Rendered:
        """Token ids and loss mask of a prompt; tool results are re-sorted by `tool_call_id` first."""
        session = self.session(tools=tools, effort=effort)
        for m in order_tool_results(list(messages)):
            session.add(m)
        if add_generation_prompt:
            session.add_generation_prompt(tool_choice=tool_choice, response_format=response_format)
        else:
            session.rendered.add(self.encode(self._request_options(tool_choice, response_format)))
        return session.rendered

    def session(self, tools: list[dict[str, Any]] | None = None, effort: str | None = None) -> ChatSession:
        return ChatSession(self, tools, effort)

    def message(self, msg: Message) -> Rendered:
        """One message on its own (a tool message needs its tool_name and tool_index)."""
        turn = _Turn(results=(msg.tool_index or 1) - 1)
        untrained, trained = self._message(msg, turn)
        return Rendered().add(self.encode(untrained)).add(self.encode(trained), trained=True)

    def generation_prefix(self) -> list[int]:
        return self.encode(self._generation_prefix())

    def assistant_body(self, content: str, tool_calls: list[ToolCall], thinking: str | None) -> list[int]:
        """The tokens an assistant produces after the generation prefix, [end_of_msg] included."""
        return self.encode(self._assistant_body(content, tool_calls, thinking))

    # -- parsing -----------------------------------------------------------------------------------
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
    """Incremental rendering: every `add` appends tokens and never touches earlier ones.

    Per-request options given to `add_generation_prompt` stay in the stream where they were shown
    (`render` of a whole history writes them once, at its end, as the encoder does per request).
    """

    def __init__(self, template: ChatTemplate, tools: list[dict[str, Any]] | None = None,
                 effort: str | None = None) -> None:
        self.t = template
        self.rendered = Rendered().add(template.encode(template._preamble(tools, effort)))
        self._turn = _Turn()

    def add(self, msg: Message) -> Rendered:
        untrained, trained = self.t._message(msg, self._turn)
        piece = Rendered().add(self.t.encode(untrained)).add(self.t.encode(trained), trained=True)
        self.rendered += piece
        return piece

    def add_generation_prompt(self, tool_choice: str | None = None,
                              response_format: str | dict[str, Any] | None = None) -> Rendered:
        pieces = self.t._request_options(tool_choice, response_format) + self.t._generation_prefix()
        piece = Rendered().add(self.t.encode(pieces))
        self.rendered += piece
        self._turn = _Turn()  # an assistant message begins
        return piece

    def add_generated(self, ids: list[int]) -> Rendered:
        """Append tokens the model sampled (after `add_generation_prompt`), exactly as sampled."""
        piece = Rendered().add(list(ids), trained=True)
        self.rendered += piece
        self._turn = _Turn()
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
        where = f"tool call {position} ({name})"
        if self._at_open("json"):  # arguments kept as written: JSON text, or text that is not JSON
            self._open_tag("json")
            raw = self._text()
            self._close_tag("json")
            self._close_tag("call")
            try:
                return tool_call(name, raw, index=index)
            except ValueError as e:
                raise self._fail(f"{where}, json arguments: {e}") from None
        args: dict[str, Any] = {}
        while self._at_open("argument"):
            _, a = self._open_tag("argument")
            key, typ = a.get("key"), a.get("type", "string")
            if not key:
                raise self._fail(f'{where}: an argument has no key="..." attribute')
            if key in args:
                raise self._fail(f"{where}: argument {key!r} given twice")
            raw = self._text()
            self._close_tag("argument")
            args[key] = self._value(raw, typ, f"{where}, argument {key!r}")
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
