"""Gymnasium spaces for chat: observations are lists of messages, actions are assistant text.

`ChatMessages` is "a list of chat messages": each element a dict that validates as a
`k3rl.chat.Message` (role, content, PNG images, tool name/index). `AssistantAction` is a
`spaces.Text` whose `contains` accepts any string up to `max_length` (model output is not
limited to a charset; the charset only drives `sample()`), plus the already-parsed forms
the episode loop passes (an assistant `Message` it parsed, or the token ids that did not parse).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from pydantic import ValidationError

from k3rl.chat import Message, ParsedAssistant
from k3rl.images import PNG_MAGIC

OBSERVATION_ROLES = ("system", "user", "tool")
SAMPLE_CHARSET = string.ascii_letters + string.digits + " .,:;!?-_=+*/()[]{}'\"\n"


def message_dict(msg: Message) -> dict[str, Any]:
    """The observation form of a message: role, content, images, and the tool/name fields that are set."""
    d: dict[str, Any] = {"role": msg.role, "content": msg.content, "images": list(msg.images)}
    for key in ("name", "tool_name", "tool_index"):
        value = getattr(msg, key)
        if value is not None:
            d[key] = value
    return d


class ChatMessages(spaces.Space[list]):
    """A list of chat messages (dicts in the shape of `k3rl.chat.Message`), as observations.

    `max_messages` bounds one observation; `roles` are the roles an environment may send.
    The list may be empty: the step that ends an episode with a final answer has nothing to say.
    """

    def __init__(self, max_messages: int = 64, max_chars: int = 1 << 20, roles: Sequence[str] = OBSERVATION_ROLES,
                 seed: int | np.random.Generator | None = None) -> None:
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        self.max_messages = max_messages
        self.max_chars = max_chars
        self.roles = tuple(roles)
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        if not isinstance(x, list) or len(x) > self.max_messages:
            return False
        for m in x:
            if not isinstance(m, dict) or m.get("role") not in self.roles:
                return False
            if not isinstance(m.get("content"), str) or len(m["content"]) > self.max_chars:
                return False
            images = m.get("images", [])
            if not isinstance(images, list) or not all(isinstance(i, bytes) and i.startswith(PNG_MAGIC) for i in images):
                return False
            try:
                msg = Message.model_validate(m)
            except ValidationError:
                return False
            if msg.role == "tool" and (msg.tool_name is None or msg.tool_index is None):
                return False
        return True

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, Any]]:
        """Random messages (text only) — for checkers and fuzzing, not a meaningful conversation."""
        if mask is not None or probability is not None:
            raise ValueError("ChatMessages.sample does not take a mask or probability")
        rng = self.np_random
        out = []
        for i in range(int(rng.integers(1, min(4, self.max_messages) + 1))):
            role = self.roles[int(rng.integers(len(self.roles)))]
            text = "".join(rng.choice(list(SAMPLE_CHARSET), size=int(rng.integers(0, 40))))
            m: dict[str, Any] = {"role": role, "content": text, "images": []}
            if role == "tool":
                m.update(tool_name="tool", tool_index=i + 1)
            out.append(m)
        return out

    def __repr__(self) -> str:
        return f"ChatMessages(max_messages={self.max_messages}, roles={self.roles})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ChatMessages) and (self.max_messages, self.max_chars, self.roles) == (
            other.max_messages, other.max_chars, other.roles)


class AssistantAction(spaces.Text):
    """The assistant's message: decoded text (special tokens written by name), or a parsed form.

    `sample()` draws text from a printable charset (which, having no tool-call markup, is a
    plain final answer); `contains` accepts any str up to `max_length`, a `ParsedAssistant`,
    an assistant `Message`, or a sequence of token ids.
    """

    def __init__(self, max_length: int = 1 << 16, min_length: int = 0,
                 seed: int | np.random.Generator | None = None) -> None:
        super().__init__(max_length=max_length, min_length=min_length, charset=SAMPLE_CHARSET, seed=seed)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        # keep samples short: a random 64k-character answer helps nobody
        if mask is None and probability is None:
            n = int(self.np_random.integers(self.min_length, min(self.max_length, 64) + 1))
            return "".join(self.np_random.choice(list(SAMPLE_CHARSET), size=n))
        return super().sample(mask=mask, probability=probability)

    def contains(self, x: Any) -> bool:
        if isinstance(x, str):
            return self.min_length <= len(x) <= self.max_length
        if isinstance(x, ParsedAssistant):
            return True
        if isinstance(x, Message):
            return x.role == "assistant"
        if isinstance(x, np.ndarray):
            return x.ndim == 1 and np.issubdtype(x.dtype, np.integer)
        if isinstance(x, (list, tuple)):
            return all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in x)
        return False

    def __repr__(self) -> str:
        return f"AssistantAction(max_length={self.max_length})"
