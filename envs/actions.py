"""Turning an action (what the assistant said) into an assistant message (and its token ids).

Accepted actions:
  * an assistant `Message` or a `ParsedAssistant`: already parsed (the episode loop parses the
    sampled tokens once and passes the Message); taken as it is;
  * token ids (list / tuple / 1-D int array): the tokens sampled after the generation prefix
    (the episode loop passes these when they did not parse, for the env to report);
  * `str`: the decoded assistant output with special tokens written by name
    (`...<|close|>response<|sep|><|open|>tools<|sep|>...`), as `assistant_text` produces.
    A string with no special token at all is a plain final answer (content only).

A missing `<|close|>message<|sep|><|end_of_msg|>` trailer is added (engines may strip the
stop token); anything else malformed raises `ToolCallParseError` for the env to report. Text
that parses becomes the chat template's own tokens (each text piece encoded on its own).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from k3rl.chat import ChatTemplate, Message, ParsedAssistant, ToolCallParseError
from k3rl.tokenizer import SPECIAL_TOKEN_IDS
from k3rl.types import ToolCall


def _specials(template: ChatTemplate) -> dict[str, int]:
    table = getattr(template.tok, "specials", None)
    if table:
        return dict(table)
    out = {}
    for name in SPECIAL_TOKEN_IDS:
        try:
            out[name] = template.tok.special(name)
        except KeyError:
            continue
    return out


def encode_with_specials(template: ChatTemplate, text: str) -> list[int]:
    """Token ids of decoded text in which special tokens appear by name (`<|open|>`...)."""
    specials = _specials(template)
    pattern = "(" + "|".join(re.escape(n) for n in sorted(specials, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for piece in re.split(pattern, text):
        if not piece:
            continue
        ids.extend([specials[piece]] if piece in specials else template.tok.encode(piece))
    return ids


def has_special(template: ChatTemplate, text: str) -> bool:
    return any(name in text for name in _specials(template))


def assistant_text(template: ChatTemplate, content: str = "", tool_calls: Sequence[ToolCall | dict] = (),
                   thinking: str | None = None) -> str:
    """The decoded text of an assistant message (after the generation prefix) — a valid action.

    `tool_calls` are ToolCall objects or dicts `{"name": ..., "arguments": {...}}`.
    """
    calls = [c if isinstance(c, ToolCall) else ToolCall(index=i, **c) for i, c in enumerate(tool_calls, start=1)]
    calls = [c.model_copy(update={"index": i}) for i, c in enumerate(calls, start=1)]
    return template.tok.decode(template.assistant_body(content, calls, thinking))


def action_to_ids(template: ChatTemplate, action: Any) -> list[int]:
    """Token ids of an action (see module doc); raises TypeError for an unsupported action type."""
    if isinstance(action, str):
        if not has_special(template, action):
            return template.assistant_body(action, [], "" if template.thinking else None)
        ids = encode_with_specials(template, action)
    elif isinstance(action, ParsedAssistant):
        return template.assistant_body(action.content, action.tool_calls, action.thinking)
    elif isinstance(action, Message):
        if action.role != "assistant":
            raise TypeError(f"an action Message must have role 'assistant', got {action.role!r}")
        return template.assistant_body(action.content, action.tool_calls, action.thinking)
    elif isinstance(action, np.ndarray) and action.ndim == 1 and np.issubdtype(action.dtype, np.integer):
        ids = [int(i) for i in action]
    elif isinstance(action, (list, tuple)) and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                                   for i in action):
        ids = [int(i) for i in action]
    else:
        raise TypeError(
            f"unsupported action of type {type(action).__name__}: pass the assistant's text, its token ids, "
            "a k3rl.chat.ParsedAssistant or an assistant k3rl.chat.Message"
        )
    trailer = template.end_of_message
    if ids[-len(trailer):] != trailer:
        # engines may stop before / strip the stop token; complete the trailer, never change content
        k = next((k for k in range(len(trailer) - 1, 0, -1) if ids[-k:] == trailer[:k]), 0)
        ids = ids + trailer[k:]
    if isinstance(action, str):
        # text becomes the renderer's tokens: with a BPE tokenizer a run of text between specials
        # encoded in one go is not cut into the pieces the model was trained on
        try:
            parsed = template.parse_assistant(ids)
        except ToolCallParseError:
            return ids  # the env reports it
        return template.assistant_body(parsed.content, parsed.tool_calls, parsed.thinking)
    return ids


def assistant_message(template: ChatTemplate, action: Any) -> Message:
    """The assistant Message of an action; text and ids are parsed (ToolCallParseError, ids on `.ids`)."""
    if isinstance(action, Message):
        if action.role != "assistant":
            raise TypeError(f"an action Message must have role 'assistant', got {action.role!r}")
        return action
    if isinstance(action, ParsedAssistant):
        return action.to_message()
    return parse_action(template, action)[1].to_message()


def parse_action(template: ChatTemplate, action: Any) -> tuple[list[int], ParsedAssistant]:
    """(ids, parsed) of an action; raises ToolCallParseError (with the ids on `.ids`) when malformed."""
    ids = action_to_ids(template, action)
    if isinstance(action, ParsedAssistant):
        return ids, action
    if isinstance(action, Message):
        return ids, ParsedAssistant(action.content, list(action.tool_calls), action.thinking)
    try:
        return ids, template.parse_assistant(ids)
    except ToolCallParseError as e:
        e.ids = ids
        raise
