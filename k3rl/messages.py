"""Chat messages as k3rl's episodes and the K3 chat template take them (`Message`), and the forms a
conversation arrives in that they normalise: OpenAI-style content parts (text and images as data
URLs, bytes or PIL), `function.arguments` given as JSON text, `reasoning_content` / `reasoning`
as `thinking`, and tool calls whose arguments are not JSON (`RawToolCall`, kept as written).
Rendering and parsing are `k3rl.chat`'s."""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Callable
from typing import Any, Literal

from PIL import Image, UnidentifiedImageError
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from k3rl.images import PNG_MAGIC, to_png
from k3rl.types import ToolCall, _check_png, _unb64

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"


class RawToolCall(ToolCall):
    """A call whose arguments are text that is not JSON, kept as written: in history it renders as
    `[open]json type="object"[sep]RAW[close]json[sep]` (`arguments` stays empty)."""

    raw_arguments: str

    @model_validator(mode="after")
    def _really_raw(self) -> RawToolCall:
        if self.arguments:
            raise ValueError("a RawToolCall has raw_arguments only; leave `arguments` empty")
        if not self.raw_arguments.strip():
            raise ValueError("raw_arguments is blank: a call without arguments is a ToolCall with arguments={}")
        try:
            json.loads(self.raw_arguments)
        except json.JSONDecodeError:
            return self
        raise ValueError(f"raw_arguments {self.raw_arguments[:60]!r} is valid JSON: pass it as ToolCall(arguments=...)")


def tool_call(name: str, arguments: Any = None, index: int = 1, id: str | None = None) -> ToolCall:
    """A call from OpenAI-style arguments: a dict, or JSON text (text that is not JSON gives a RawToolCall)."""
    extra = {"id": id} if id is not None else {}
    if arguments is None or isinstance(arguments, dict):
        return ToolCall(name=name, arguments=arguments or {}, index=index, **extra)
    if not isinstance(arguments, str):
        raise ValueError(f"tool call {name!r}: arguments must be a dict or JSON text, got {type(arguments).__name__}")
    if not arguments.strip():
        return ToolCall(name=name, arguments={}, index=index, **extra)
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return RawToolCall(name=name, raw_arguments=arguments, index=index, **extra)
    if not isinstance(value, dict):
        raise ValueError(f"tool call {name!r}: arguments {arguments[:60]!r} are JSON but not an object; "
                         "K3 tool calls take an object of named arguments")
    return ToolCall(name=name, arguments=value, index=index, **extra)


def _openai_call(item: Any, position: int) -> Any:
    if not isinstance(item, dict) or not ("function" in item or isinstance(item.get("arguments"), str)):
        return item  # a ToolCall, or a ToolCall's fields
    fn = item.get("function", item)
    if not isinstance(fn, dict) or not fn.get("name"):
        raise ValueError(f"tool call {position} has no function name")
    return tool_call(fn["name"], fn.get("arguments"), index=position, id=item.get("id"))


def _image_part(part: dict[str, Any], where: str) -> bytes:
    """PNG bytes of an OpenAI image part: {"type": "image_url", "image_url": {"url": "data:..."}} or
    {"type": "image", "image": image bytes / base64 / PIL image}."""
    value = part.get(part["type"])
    if isinstance(value, dict):
        value = value.get("url")
    if isinstance(value, str):
        if "://" in value:
            raise ValueError(f"{where}: k3rl does not fetch images ({value[:40]}...); pass a data: URL or the bytes")
        try:
            value = base64.b64decode(value.split(",", 1)[-1], validate=True)
        except binascii.Error:
            raise ValueError(f"{where}: the image is not base64 (a data URL is 'data:image/png;base64,...')") from None
    if isinstance(value, (bytes, bytearray)) and not bytes(value).startswith(PNG_MAGIC):
        try:
            value = Image.open(io.BytesIO(value))
        except UnidentifiedImageError:
            raise ValueError(f"{where}: the bytes are not an image PIL can read") from None
    if value is None:
        raise ValueError(f"{where}: no image under {part['type']!r}")
    return to_png(value)


class Message(BaseModel):
    """One chat message. Also accepts the OpenAI forms: `content` as a list of parts (text, image,
    image_url) or None, `tool_calls` with `function.arguments` as JSON text, `reasoning_content` /
    `reasoning` for `thinking`, and `tool` for `tool_name`."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[bytes] = Field(default_factory=list)
    thinking: str | None = Field(None, validation_alias=AliasChoices("thinking", "reasoning_content", "reasoning"))
    tool_calls: list[ToolCall] = Field(default_factory=list)
    name: str | None = None
    tool_name: str | None = Field(None, validation_alias=AliasChoices("tool_name", "tool"),
                                  description="tool messages: the tool that produced this result")
    tool_index: int | None = Field(None, ge=1, description="tool messages: 1-based index of the call it answers")
    tool_call_id: str | None = Field(None, description="tool messages: the id of the call it answers")
    tools: list[dict[str, Any]] | None = Field(None, description="system messages: extend the toolset mid-session")
    # the content parts as given (text, or None for an image): each text part is its own piece
    _parts: list[str | None] | None = PrivateAttr(None)

    @field_validator("images", mode="before")
    @classmethod
    def _png(cls, v):
        return [_check_png(_unb64(x)) for x in (v or [])]

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _calls(cls, v):
        return [_openai_call(c, i) for i, c in enumerate(v or [], start=1)]

    @model_validator(mode="wrap")
    @classmethod
    def _content_parts(cls, data: Any, handler: Callable[[Any], Message]) -> Message:
        parts = None
        if isinstance(data, dict) and data.get("content", "") is None:
            data = {**data, "content": ""}
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            if data.get("images"):
                raise ValueError("give images either as content parts or in `images`, not both")
            parts, images = [], []
            for i, part in enumerate(data["content"], start=1):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    if IMAGE_PLACEHOLDER in part["text"]:
                        raise ValueError(f"content part {i}: text parts cannot hold {IMAGE_PLACEHOLDER}; "
                                         "give the image as its own part")
                    parts.append(part["text"])
                elif kind in ("image", "image_url"):
                    images.append(_image_part(part, f"content part {i}"))
                    parts.append(None)
                else:
                    raise ValueError(f"content part {i} must be {{'type': 'text', 'text': ...}}, "
                                     f"{{'type': 'image_url', ...}} or {{'type': 'image', ...}}; got {part!r:.80}")
            data = {**data, "content": "".join(IMAGE_PLACEHOLDER if p is None else p for p in parts),
                    "images": images}
        msg = handler(data)
        if parts is not None:
            msg._parts = parts
        return msg

    @model_validator(mode="after")
    def _consistent(self) -> Message:
        if self.tools is not None and self.role != "system":
            raise ValueError(f"only system messages declare tools (this one is {self.role})")
        if self.tools and (self.content or self.images):
            raise ValueError("a system message with tools renders as the tool declaration alone (the official "
                             "encoder drops its content); put the text in a system message of its own")
        if self.images and self.role == "assistant":
            raise ValueError("assistant messages cannot carry images: their tokens are trained")
        n = self.content.count(IMAGE_PLACEHOLDER)
        if self.images and n not in (0, len(self.images)):
            raise ValueError(f"{len(self.images)} images but {n} {IMAGE_PLACEHOLDER} in the content: mark each "
                             "image's place once, or not at all (images then come before the text)")
        return self

    def content_parts(self) -> list[str | None]:
        """The content as text parts and image slots (None), in order."""
        if self._parts is not None and self._parts.count(None) == len(self.images) and \
                "".join(IMAGE_PLACEHOLDER if p is None else p for p in self._parts) == self.content:
            return self._parts
        if not self.images:
            return [self.content]
        if IMAGE_PLACEHOLDER not in self.content:
            return [None] * len(self.images) + [self.content]
        parts: list[str | None] = []
        for text in self.content.split(IMAGE_PLACEHOLDER):
            parts += [text, None]
        return parts[:-1]
